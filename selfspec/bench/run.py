"""``run_bench``: every method on every prompt, interleaved, after one warm-up each.

Methods run prompt by prompt (the order rotates from prompt to prompt), so machine drift hits all
alike. The warm-ups, grouped by what they need loaded (the target, then the draft model, then the
.gguf for llama_cpp), double as the memory measurement.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfspec.bench.host import MEMORY_METHOD, PeakRss, describe_machine, process_peak_rss_mb
from selfspec.bench.methods import (
    ALL_METHODS,
    BASELINE,
    METHODS,
    PROMPT_LOOKUP_TOKENS,
    BenchContext,
    Method,
    MethodRun,
    gguf_path_for,
    llama_cpp_available,
    llama_cpp_failure,
    llama_server_unavailable,
)
from selfspec.bench.summary import summarize
from selfspec.errors import SelfSpecError
from selfspec.loading.models import LoadedModel
from selfspec.prompts import Prompt

if TYPE_CHECKING:
    from selfspec.drafters.heads import DraftHeads
    from selfspec.engine import Engine
    from selfspec.runtime.plan import SkipPlan
    from selfspec.runtime.sampling import Sampling

PHASES = ("target", "draft", "gguf")
PHASE_OF = {"plan": "target", "llama_server": "gguf"}  # needs without a phase of their own


class _QuietTransformers:
    """Silence transformers' per-call advice (assisted generation repeats it on every call)."""

    def __enter__(self):
        from transformers.utils import logging

        self.level = logging.get_verbosity()
        logging.set_verbosity_error()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self.level)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc="bench",
        unit="run",
        leave=False,
        file=sys.stderr,
        disable=not enabled or os.environ.get("SELFSPEC_NO_PROGRESS") == "1",
    )


def _unavailable(method: Method, plan, draft, model_name: str) -> str | None:
    """Why a method cannot run here, or None."""
    if method.needs == "plan" and plan is None:
        return (
            f"no skip plan for {model_name}: pass --plan or --skip-*, or run "
            f"`selfspec search --model {model_name}`"
        )
    if method.needs == "draft" and draft is None:
        return f"no draft model: {model_name} has no default draft model; pass --draft-model"
    if method.needs == "llama_server":
        return llama_server_unavailable(method.name, model_name, draft)
    if method.needs == "gguf":
        if not llama_cpp_available():
            return "llama-cpp-python is not installed (pip install 'selfspec[llama-cpp]')"
        if gguf_path_for(model_name) is None:
            return f"{model_name} is neither a bundled model nor a local .gguf file"
        import torch

        failure = llama_cpp_failure(model_name, torch.get_num_threads())
        if failure:
            return f"llama.cpp could not read a prompt on this machine in a test process: {failure}"
    return None


def resolve_methods(
    requested,
    *,
    plan,
    draft,
    model_name: str,
    custom: dict | None = None,
    explicit: bool = False,
    baseline: bool = True,
) -> tuple[list[str], list[str]]:
    """Which methods can run, and a note for each left out. Explicitly requested ones must run.
    ``baseline``: add hf_generate when it was not asked for (identity checks refer to it)."""
    known = dict(METHODS, **(custom or {}))
    requested = list(requested) if requested else [*ALL_METHODS, *(custom or {})]
    unknown = [m for m in requested if m not in known]
    if unknown:
        raise SelfSpecError(f"unknown method(s) {', '.join(unknown)}. Known: {', '.join(known)}.")
    notes, chosen = [], []
    if not baseline:
        requested = [m for m in requested if m != BASELINE]
    elif BASELINE not in requested:
        requested.insert(0, BASELINE)
        notes.append(
            f"{BASELINE} added: it is the baseline every speedup and identity check refers to."
        )
    for name in dict.fromkeys(requested):
        method = known[name] if isinstance(known[name], Method) else Method(name, known[name])
        reason = _unavailable(method, plan, draft, model_name)
        if reason and explicit and name != BASELINE:
            raise SelfSpecError(f"cannot run {name}: {reason}.")
        if reason:
            notes.append(f"{name} skipped: {reason}.")
        else:
            chosen.append(name)
    return chosen, notes


def _split_draft(draft) -> tuple[str | LoadedModel | None, str | None]:
    """The draft as run_bench keeps it (a name or path to load later, or a LoadedModel), and its
    name."""
    from selfspec.engine import Engine

    if isinstance(draft, Engine):
        draft = draft.loaded
    if isinstance(draft, LoadedModel):
        return draft, draft.name
    return (str(draft), str(draft)) if draft is not None else (None, None)


@dataclass
class _Setup:
    """What run_bench settles before any method runs."""

    prompts: list[Prompt]
    encoded: list[list[int]]
    registry: dict[str, Method]
    chosen: list[str]
    draft: str | LoadedModel | None  # a name or path is loaded after the target-only warm-ups
    draft_name: str | None
    chat: bool
    numerics: str | None
    repeats: int

    def needs(self, what: str) -> bool:
        return any(self.registry[m].needs == what for m in self.chosen)


def _as_prompts(prompts) -> list[Prompt]:
    prompts = [
        p if isinstance(p, Prompt) else Prompt(str(i), "all", p) for i, p in enumerate(prompts)
    ]
    if not prompts:
        raise SelfSpecError("no prompts to benchmark.")
    return prompts


def _choose(
    engine: Engine,
    methods: Sequence[str] | None,
    plan: SkipPlan | None,
    draft_name: str | None,
    custom_methods: dict | None,
    explicit: bool,
    baseline: bool = True,
) -> tuple[dict[str, Method], list[str], list[str]]:
    """The method registry (custom methods included), the methods that run, and notes on the
    others."""
    custom = {
        n: (m if isinstance(m, Method) else Method(n, m)) for n, m in (custom_methods or {}).items()
    }
    chosen, notes = resolve_methods(
        methods,
        plan=plan,
        draft=draft_name,
        model_name=engine.loaded.name,
        custom=custom,
        explicit=explicit,
        baseline=baseline,
    )
    return dict(METHODS, **custom), chosen, notes


def _check_sampled_methods(registry: dict[str, Method], chosen: list[str]) -> None:
    """Sampled benches run selfspec's own methods only: transformers' and llama.cpp's samplers
    draw differently, so their speed would not compare."""
    others = [m for m in chosen if registry[m].transformers or not registry[m].checks_identity]
    if others:
        raise SelfSpecError(
            f"--temperature: {', '.join(others)} cannot sample alongside selfspec's methods; "
            "pass --no-hf-baseline and --methods without them, e.g. "
            "--methods autoregressive,self_speculative."
        )


def _numerics(engine: Engine, notes: list[str]) -> str | None:
    """How selfspec's speed mode changes the numerics, if it does (said in a note too)."""
    from selfspec.speed.modes import numerics_note

    numerics = numerics_note(engine.loaded.speed, engine.loaded.device.type, engine.relaid)
    if numerics:
        notes.append(
            f"speed mode {engine.loaded.speed} changes the numerics ({numerics}), so selfspec's "
            f"methods need not match {BASELINE} token for token; speculation is checked against "
            "selfspec's own plain decoding in the same mode."
        )
    return numerics


def _check_draft_early(engine: Engine, setup: _Setup) -> None:
    """A draft model with another tokenizer fails now, not after the target-only methods ran."""
    from selfspec.loading.models import check_same_tokenizer, load_tokenizer

    name = setup.draft_name
    if setup.needs("draft") and isinstance(setup.draft, str) and name != engine.loaded.name:
        check_same_tokenizer(engine.loaded.name, engine.tokenizer, name, load_tokenizer(name))


def _encode(
    engine: Engine, prompts: list[Prompt], chat: bool, max_new_tokens: int
) -> list[list[int]]:
    """The prompts' token ids, each checked to leave room for ``max_new_tokens`` more."""
    from selfspec.runtime.decode import check_context

    encoded = [engine.encode(p.text, chat=chat) for p in prompts]
    lengths = {f"prompt {p.id}": len(ids) for p, ids in zip(prompts, encoded)}
    check_context(lengths, max_new_tokens, engine.runner.context_window, "--max-new-tokens")
    return encoded


def _load_draft(ctx: BenchContext, setup: _Setup, bar) -> LoadedModel:
    from selfspec.loading.models import check_same_tokenizer, load_model

    engine, name = ctx.engine, setup.draft_name
    if isinstance(setup.draft, LoadedModel):
        loaded = setup.draft
    elif name == engine.loaded.name:
        loaded = engine.loaded  # drafting with itself: one copy of the weights
    else:
        bar.set_description(f"loading {name}")
        device, dtype, speed = str(engine.loaded.device), engine.loaded.dtype, engine.loaded.speed
        loaded = load_model(name, device=device, dtype=dtype, speed=speed)
    check_same_tokenizer(engine.loaded.name, engine.tokenizer, name, loaded.tokenizer)
    return loaded


def _transformers_copies(ctx: BenchContext, phase: str, bar) -> None:
    """Load the unmodified models transformers' own methods need, when first needed."""
    from selfspec.loading.models import unmodified

    engine = ctx.engine
    if phase == "target" and ctx.hf_target is None:
        bar.set_description(f"loading {engine.loaded.name} for transformers")
        ctx.hf_target = unmodified(engine.loaded)
    if phase == "draft" and ctx.hf_draft is None:
        bar.set_description(f"loading {ctx.draft.name} for transformers")
        shared = ctx.draft is engine.loaded and ctx.hf_target
        ctx.hf_draft = ctx.hf_target if shared else unmodified(ctx.draft)


def _phases(setup: _Setup) -> dict[str, list[str]]:
    """The methods by what they need loaded; selfspec's own before transformers' in each."""
    phases: dict[str, list[str]] = {phase: [] for phase in PHASES}
    for name in sorted(setup.chosen, key=lambda m: setup.registry[m].transformers):
        needs = setup.registry[name].needs
        phases[PHASE_OF.get(needs, needs)].append(name)
    return phases


def _warm_up(ctx: BenchContext, setup: _Setup, bar) -> dict[str, float]:
    """One warm-up generation per method, phase by phase; returns each one's peak RSS in MB."""
    peak_rss: dict[str, float] = {}
    for phase, names in _phases(setup).items():
        if phase == "draft" and names and ctx.draft is None:
            ctx.draft = _load_draft(ctx, setup, bar)
        for name in names:
            method = setup.registry[name]
            if method.transformers:
                _transformers_copies(ctx, phase, bar)
            bar.set_description(f"warm-up {name}")
            with PeakRss() as rss:
                if method.setup:
                    method.setup(ctx)
                method.run(ctx, setup.encoded[0])
            peak_rss[name] = method.peak_rss_mb(ctx) if method.peak_rss_mb else rss.peak_mb
            bar.update(1)
    return peak_rss


def _timed_runs(ctx: BenchContext, setup: _Setup, bar) -> dict[str, list[list[MethodRun]]]:
    """Every method on a prompt before the next prompt; who goes first rotates."""
    chosen, encoded = setup.chosen, setup.encoded
    runs: dict[str, list[list[MethodRun]]] = {name: [[] for _ in encoded] for name in chosen}
    for i, ids in enumerate(encoded):
        order = chosen[i % len(chosen) :] + chosen[: i % len(chosen)]
        for _ in range(setup.repeats):
            for name in order:
                bar.set_description(f"{name} {i + 1}/{len(encoded)}")
                runs[name][i].append(setup.registry[name].run(ctx, ids))
                bar.update(1)
    return runs


def _measure(
    ctx: BenchContext, setup: _Setup, progress: bool
) -> tuple[dict[str, float], dict[str, list[list[MethodRun]]]]:
    """Warm-ups (with their memory), then the timed runs: (peak RSS by method, runs by method)."""
    total = len(setup.chosen) * (1 + len(setup.prompts) * setup.repeats)
    bar = _progress(total, progress)
    try:
        with _QuietTransformers():
            return _warm_up(ctx, setup, bar), _timed_runs(ctx, setup, bar)
    finally:
        bar.close()
        for name in setup.chosen:
            if setup.registry[name].teardown:
                setup.registry[name].teardown(ctx)


def _sampling_config(ctx: BenchContext) -> dict | None:
    if ctx.sampling is None:
        return None
    s = ctx.sampling
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": ctx.seed}


def _config(ctx: BenchContext, setup: _Setup, extra: dict | None) -> dict:
    plan = ctx.plan
    return {
        "model": ctx.engine.loaded.name,
        "plan": plan.to_dict() if plan is not None else None,
        "plan_summary": plan.describe() if plan is not None else None,
        "draft_model": setup.draft_name if setup.needs("draft") else None,
        "speed_mode": ctx.engine.loaded.speed,
        "numerics": setup.numerics,
        "prompts": len(setup.prompts),
        "categories": sorted({p.category for p in setup.prompts}),
        "max_new_tokens": ctx.max_new_tokens,
        "eos_token_ids": list(ctx.eos_ids),
        "repeats": setup.repeats,
        "chat_template": setup.chat,
        "threads": ctx.threads,
        "methods": setup.chosen,
        "sampling": _sampling_config(ctx),
        "baseline": BASELINE,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "memory_method": MEMORY_METHOD,
        "speedup_method": (
            "median over prompts of (method tokens/s) / (reference tokens/s) on the same prompt"
        ),
        **(extra or {}),
    }


def run_bench(
    engine: Engine,
    prompts,
    methods=None,
    *,
    plan: SkipPlan | None = None,
    heads: bool | str | DraftHeads = True,
    learned: bool = False,
    draft=None,
    max_new_tokens: int = 64,
    repeats: int = 1,
    chat: bool | None = None,
    custom_methods: dict | None = None,
    explicit: bool = False,
    progress: bool = True,
    notes: list[str] | None = None,
    config_extra: dict | None = None,
    baseline: bool = True,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> dict:
    """Benchmark ``methods`` on ``prompts`` (selfspec.prompts.Prompt objects or plain strings).

    ``baseline``: run hf_generate (transformers' own greedy decoding), the reference of the
    identity checks and of ``speedup_vs_hf_generate``, even when ``methods`` leave it out. False
    leaves it out (it is the slowest method on a CPU); speculation is still checked against
    selfspec's own plain decoding.

    ``plan``: the skip plan for self_speculative (None: the engine's default plan).
    ``heads``: draft heads for self_speculative and heads (True: the model's; a file; False: none).
    ``learned``: recycled drafts start from the table ``--learn`` kept for the model (read only).
    ``draft``: the draft model for dual_model and hf_assisted: a bundled name or path (loaded
    only after the target-only methods' memory is measured), a LoadedModel or an Engine.
    ``custom_methods``: extra methods, name -> Method or callable(ctx, prompt_ids) -> MethodRun;
    a test can register a deliberately broken one to see it reported as not identical.
    ``chat``: wrap prompts in the chat template (None: when the tokenizer has one).
    ``sampling``: sample (with ``seed`` for every generation) instead of greedy decoding: only
    selfspec's own methods run, and no output is checked for identity (each method draws its
    randomness differently; that sampling keeps the target's distribution is tested).
    Returns the result dict that ``format_markdown`` and ``write_outputs`` take.
    """
    import torch

    from selfspec.cliargs import check_at_least

    check_at_least("max_new_tokens", max_new_tokens, 1)
    check_at_least("repeats", repeats, 1)
    prompts = _as_prompts(prompts)
    plan = plan if plan is not None else engine.default_plan()
    draft, draft_name = _split_draft(draft)
    registry, chosen, skipped = _choose(
        engine, methods, plan, draft_name, custom_methods, explicit, baseline
    )
    sampled = sampling is not None and not sampling.greedy
    if sampled:
        _check_sampled_methods(registry, chosen)
    notes = [*(notes or []), *skipped]
    numerics = _numerics(engine, notes)
    chat = bool(getattr(engine.tokenizer, "chat_template", None)) if chat is None else chat
    setup = _Setup(prompts, [], registry, chosen, draft, draft_name, chat, numerics, repeats)
    _check_draft_early(engine, setup)
    setup.encoded = _encode(engine, prompts, chat, max_new_tokens)
    threads = torch.get_num_threads()
    ctx = BenchContext(
        engine,
        max_new_tokens,
        engine.eos_ids(),
        plan=plan,
        threads=threads,
        heads=heads,
        learned=learned,
    )
    if sampled:
        ctx.sampling, ctx.seed = sampling, seed
    ctx.state["llama_ctx"] = max(len(ids) for ids in setup.encoded) + max_new_tokens + 16
    ctx.state["draft_name"] = draft_name
    peak_rss, runs = _measure(ctx, setup, progress)
    result = summarize(
        prompts, setup.encoded, chosen, registry, runs, peak_rss, check_identity=not sampled
    )
    result["machine"] = describe_machine(engine)
    result["machine"]["process_peak_rss_mb"] = round(process_peak_rss_mb(), 1)
    result["config"] = _config(ctx, setup, config_extra)
    result["notes"] = notes
    return result
