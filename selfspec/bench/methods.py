"""The benchmarked methods: each runs one greedy generation and reports its tokens and times.

selfspec's own (autoregressive, self_speculative, head_trees, ngram, recycled, recycled_trees,
heads, layer_skip, dual_model) run through the Engine; transformers' (hf_generate, hf_assisted,
prompt_lookup) on the model exactly as transformers builds it; llama_cpp (plain decoding of the
same .gguf) through llama-cpp-python when it is installed; llama_server* (llama.cpp's server,
plain and per speculation type) when it is built (`llama_server.py`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.bench import llama_server

if TYPE_CHECKING:
    from selfspec.drafters import Drafter
    from selfspec.drafters.heads import DraftHeads
    from selfspec.engine import Engine
    from selfspec.loading.models import LoadedModel
    from selfspec.runtime.decode import DecodeStats
    from selfspec.runtime.plan import SkipPlan
    from selfspec.runtime.sampling import Sampling

BASELINE = "hf_generate"  # every speedup and identity check refers to it
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class MethodRun:
    """One generation: the new token ids (EOS included when it stopped there), its wall time and
    the time to its first new token (prefill)."""

    token_ids: list[int]
    seconds: float
    stats: DecodeStats | None = None  # selfspec's own methods
    first_token_seconds: float | None = None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first per second after the first: the decoding phase on its own."""
        if self.first_token_seconds is None or len(self.token_ids) < 2:
            return None
        decode = self.seconds - self.first_token_seconds
        return (len(self.token_ids) - 1) / decode if decode > 0 else None


@dataclass
class BenchContext:
    """What methods need: the engine, the plan, the draft model and the stopping rule."""

    engine: Engine
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    plan: SkipPlan | None = None
    draft: LoadedModel | None = None
    # The same models exactly as transformers builds them, for transformers' own methods
    # (the engine's and draft's own objects when they run speed mode "torch").
    hf_target: LoadedModel | None = None
    hf_draft: LoadedModel | None = None
    threads: int | None = None  # llama_cpp's threads (None: torch's, which selfspec runs with)
    heads: bool | str | DraftHeads = True  # draft heads: the model's (True), a file's, or none
    learned: bool = False  # recycled drafts start from the table --learn kept for the model
    sampling: Sampling | None = None  # None: greedy
    seed: int = 0  # every sampled generation's seed, so each method meets the same draws first
    state: dict = field(default_factory=dict)  # per-method objects made by setup (drafters, llama)


@dataclass
class Method:
    """A benchmarked method. ``needs``: what must be loaded: "target", "plan", "draft" or "gguf"."""

    name: str
    run: Callable[[BenchContext, list[int]], MethodRun]
    needs: str = "target"
    checks_identity: bool = True  # False: other weights/numerics (llama_cpp), reported as "n/a"
    setup: Callable[[BenchContext], None] | None = None
    transformers: bool = False  # runs transformers' generate: needs the unmodified model
    teardown: Callable[[BenchContext], None] | None = None  # after the last run (stop a server)
    # The peak RSS to report when the method runs outside this process (a server's)
    peak_rss_mb: Callable[[BenchContext], float | None] | None = None
    # The plain decoding whose tokens this method must give (llama.cpp's speculation: its own)
    same_as: str | None = None


class _FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives (put() is called
    first with the prompt, then with each new token)."""

    def __init__(self):
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf_generate(ctx: BenchContext, prompt_ids: list[int], **extra) -> MethodRun:
    import torch
    from transformers import GenerationConfig

    model = ctx.hf_target.model
    tokenizer = ctx.engine.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ctx.eos_ids[0]
    # A fresh config, so the model's own sampling defaults (repetition penalty, top_k ...) stay out.
    lookup = extra.pop("prompt_lookup_num_tokens", None)
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=ctx.max_new_tokens,
        eos_token_id=list(ctx.eos_ids),
        pad_token_id=pad,
        prompt_lookup_num_tokens=lookup,
    )
    ids = torch.tensor([prompt_ids], device=model.device)
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            streamer=clock,
            **extra,
        )
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    first = clock.first - t0 if clock.first is not None else None
    tokens = _cut_at_eos(out[0, len(prompt_ids) :].tolist(), ctx.eos_ids)
    return MethodRun(tokens, seconds, first_token_seconds=first)


def _cut_at_eos(tokens: list[int], eos_ids) -> list[int]:
    eos = set(eos_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _run_hf_generate(ctx: BenchContext, prompt_ids: list[int]) -> MethodRun:
    return run_hf_generate(ctx, prompt_ids)


def _run_hf_assisted(ctx: BenchContext, prompt_ids: list[int]) -> MethodRun:
    return run_hf_generate(ctx, prompt_ids, assistant_model=ctx.hf_draft.model)


def _run_prompt_lookup(ctx: BenchContext, prompt_ids: list[int]) -> MethodRun:
    return run_hf_generate(ctx, prompt_ids, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)


def _engine_run(ctx: BenchContext, prompt_ids: list[int], drafter: Drafter | None) -> MethodRun:
    result = ctx.engine.generate(
        list(prompt_ids),
        drafter,
        max_new_tokens=ctx.max_new_tokens,
        sampling=ctx.sampling,
        seed=ctx.seed,
    )
    stats = result.stats
    return MethodRun(
        result.token_ids, stats.seconds, stats, first_token_seconds=stats.prefill_seconds
    )


def _run_autoregressive(ctx: BenchContext, prompt_ids: list[int]) -> MethodRun:
    return _engine_run(ctx, prompt_ids, None)


def _drafter_run(name: str) -> Callable[[BenchContext, list[int]], MethodRun]:
    """A method that generates with the drafter its setup stored under ``name``."""

    def run(ctx: BenchContext, prompt_ids: list[int]) -> MethodRun:
        return _engine_run(ctx, prompt_ids, ctx.state[name])

    return run


def _self_drafter(ctx: BenchContext, plan: SkipPlan | None = None, **options) -> Drafter:
    drafter = ctx.engine.self_drafter(plan, **options)
    if ctx.learned:  # read only: the bench never writes the table back
        ctx.engine.learned_table().resume(drafter, read_only=True)
    return drafter


def _setup_self_speculative(ctx: BenchContext) -> None:
    # selfspec's default drafter: context drafts, the model's draft heads and the plan's layer-skip
    # drafts where they pay
    ctx.state["self_speculative"] = _self_drafter(
        ctx, ctx.plan, layer_skip=ctx.plan is not None, heads=ctx.heads
    )


def _setup_ngram(ctx: BenchContext) -> None:
    ctx.state["ngram"] = ctx.engine.self_drafter(layer_skip=False, heads=False, recycled=False)


def _setup_recycled(ctx: BenchContext) -> None:
    # context drafts and recycled drafts: what any model drafts with, untrained and planless
    ctx.state["recycled"] = _self_drafter(ctx, layer_skip=False, heads=False)


def _setup_recycled_trees(ctx: BenchContext) -> None:
    # the same, its recycled drafts branching where the loop verifies trees (what trees add)
    ctx.state["recycled_trees"] = _self_drafter(ctx, layer_skip=False, heads=False, trees=True)


def _setup_head_trees(ctx: BenchContext) -> None:
    # the default drafter, its head drafts branching where the loop verifies trees
    ctx.state["head_trees"] = _self_drafter(
        ctx, ctx.plan, layer_skip=ctx.plan is not None, heads=ctx.heads, head_trees=True
    )


def _setup_heads(ctx: BenchContext) -> None:
    # context drafts and the model's draft heads, no layer-skip drafts
    ctx.state["heads"] = _self_drafter(ctx, layer_skip=False, heads=ctx.heads)


def _setup_layer_skip(ctx: BenchContext) -> None:
    ctx.state["layer_skip"] = ctx.engine.layer_skip_drafter(ctx.plan)


def _setup_dual_model(ctx: BenchContext) -> None:
    ctx.state["dual_model"] = ctx.engine.model_drafter(ctx.draft)


def gguf_path_for(model_name: str) -> Path | None:
    """The model's .gguf: the bundled model's, kept in its cache folder (fetched again if it
    predates that), or the local file the model was loaded from."""
    from selfspec.loading.sources import KNOWN_MODELS, ensure_bundled, gguf_source

    if model_name not in KNOWN_MODELS:
        local = Path(model_name)
        return local if local.suffix == ".gguf" and local.is_file() else None
    return gguf_source(model_name, ensure_bundled(model_name))


def _setup_llama_cpp(ctx: BenchContext) -> None:
    import torch
    from llama_cpp import Llama

    path = gguf_path_for(ctx.engine.loaded.name)
    window = ctx.state.get("llama_ctx", 4096)
    threads = ctx.threads or torch.get_num_threads()
    ctx.state["llama_cpp"] = Llama(
        model_path=str(path), n_threads=threads, n_ctx=window, verbose=False
    )


def _run_llama_cpp(ctx: BenchContext, prompt_ids: list[int]) -> MethodRun:
    llm = ctx.state["llama_cpp"]
    eos = set(ctx.eos_ids) | {llm.token_eos()}
    out: list[int] = []
    llm.reset()
    first = None
    t0 = time.perf_counter()
    for token in llm.generate(
        list(prompt_ids), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True
    ):
        if first is None:
            first = time.perf_counter() - t0
        out.append(int(token))
        if token in eos or len(out) >= ctx.max_new_tokens:
            break
    return MethodRun(out, time.perf_counter() - t0, first_token_seconds=first)


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


# How to build llama-cpp-python for AVX-512 without the AMX tiles a native build picks up.
LLAMA_CPP_WITHOUT_AMX = (
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON' pip install "
    "--force-reinstall --no-cache-dir --no-binary llama-cpp-python llama-cpp-python"
)

# What llama_cpp_failure runs in a child: the bench's own first steps, on a short prompt.
LLAMA_CPP_PROBE = """import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=256, verbose=False)
llm.eval(llm.tokenize(b"def fibonacci(n):\\n    return n" * 6))
"""


def llama_cpp_failure(model_name: str, threads: int) -> str | None:
    """Why llama.cpp cannot read a prompt of the model's .gguf on this machine, or None.

    Tried in a child process first: some builds of llama-cpp-python die of an illegal instruction
    there (built with AMX tiles, on VMs where their tile code faults), and such a death inside the
    bench would take every other method's results with it."""
    path = gguf_path_for(model_name)
    failure = child_failure([sys.executable, "-c", LLAMA_CPP_PROBE, str(path), str(threads)])
    if failure and failure.startswith(DIED_OF):  # the advice fits a crash, not a missing file
        failure += (
            "; builds of llama-cpp-python that use AMX tiles do that on some VMs: reinstall it "
            f"built without them ({LLAMA_CPP_WITHOUT_AMX})"
        )
    return failure


DIED_OF = "it died of "  # how child_failure names a death by a signal


def child_failure(argv: list[str], timeout: float = 300.0) -> str | None:
    """Run ``argv``; None if it exits with status 0, else what went wrong, in a few words."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"it did not finish in {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        return DIED_OF + signal.Signals(-proc.returncode).name
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"it exited with status {proc.returncode}"


def _gguf_paths(model_name: str, draft_name: str | None) -> tuple[Path | None, Path | None]:
    """The target's and the draft's .gguf files (``gguf_path_for``; None where there is none)."""
    return gguf_path_for(model_name), gguf_path_for(draft_name) if draft_name else None


def llama_server_unavailable(name: str, model_name: str, draft_name: str | None) -> str | None:
    spec = llama_server.SPEC_TYPES[name]
    return llama_server.missing_build() or llama_server.unavailable(
        spec, *_gguf_paths(model_name, draft_name)
    )  # the build first: finding the files may fetch a bundled model


def _llama_server_method(name: str) -> Method:
    spec = llama_server.SPEC_TYPES[name]

    def setup(ctx: BenchContext) -> None:
        model, draft = _gguf_paths(ctx.engine.loaded.name, ctx.state.get("draft_name"))
        threads = ctx.threads or 1
        window = ctx.state.get("llama_ctx", 4096)
        command = llama_server.server_command(spec, model, draft, threads, window)
        ctx.state[name] = llama_server.start(command, name)

    def run(ctx: BenchContext, prompt_ids: list[int]) -> MethodRun:
        server = ctx.state[name]
        tokens, seconds, first = llama_server.generate(
            server, prompt_ids, ctx.max_new_tokens, ctx.eos_ids
        )
        return MethodRun(tokens, seconds, first_token_seconds=first)

    def teardown(ctx: BenchContext) -> None:
        if name in ctx.state:
            llama_server.stop(ctx.state.pop(name))

    return Method(
        name,
        run,
        needs="llama_server",
        checks_identity=False,
        setup=setup,
        teardown=teardown,
        peak_rss_mb=lambda ctx: llama_server.peak_rss_mb(ctx.state[name]),
        same_as=None if name == llama_server.PLAIN else llama_server.PLAIN,
    )


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("hf_generate", _run_hf_generate, transformers=True),
        Method("autoregressive", _run_autoregressive),
        Method("self_speculative", _drafter_run("self_speculative"), setup=_setup_self_speculative),
        Method("ngram", _drafter_run("ngram"), setup=_setup_ngram),
        Method("recycled", _drafter_run("recycled"), setup=_setup_recycled),
        Method("recycled_trees", _drafter_run("recycled_trees"), setup=_setup_recycled_trees),
        Method("head_trees", _drafter_run("head_trees"), setup=_setup_head_trees),
        Method("heads", _drafter_run("heads"), setup=_setup_heads),
        Method("layer_skip", _drafter_run("layer_skip"), needs="plan", setup=_setup_layer_skip),
        Method("dual_model", _drafter_run("dual_model"), needs="draft", setup=_setup_dual_model),
        Method("hf_assisted", _run_hf_assisted, needs="draft", transformers=True),
        Method("prompt_lookup", _run_prompt_lookup, transformers=True),
        Method(
            "llama_cpp", _run_llama_cpp, needs="gguf", checks_identity=False, setup=_setup_llama_cpp
        ),
        *[_llama_server_method(name) for name in llama_server.SPEC_TYPES],
    ]
}
# A bench without --methods runs these: llama.cpp's server only when asked for (one server each),
# and token trees, which do not pay on the CPUs measured, too.
TREE_METHODS = ("recycled_trees", "head_trees")
ALL_METHODS = tuple(
    m for m in METHODS if m not in llama_server.SPEC_TYPES and m not in TREE_METHODS
)
