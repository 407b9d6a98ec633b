"""Benchmark decoding methods side by side on the same prompts, weights and stopping rule.

Methods: hf_generate (transformers greedy generate, the baseline), autoregressive (selfspec's
loop with no drafter), self_speculative (selfspec's default drafter: context drafts, and the
model's layer-skip drafts with its plan where they pay, chosen each round from measured costs),
ngram (the context drafts alone), recycled (context and recycled drafts: no training, no plan),
recycled_trees (the same, recycled drafts branching into token trees where a kernel mode
verifies them, greedy or sampled; not in the default set), layer_skip (the plan's layer-skip drafts
every round),
dual_model (a smaller model of the same family drafts), hf_assisted (transformers assisted
generation with that draft model), prompt_lookup (transformers prompt lookup decoding) and,
when llama-cpp-python is installed, llama_cpp (plain decoding of the bundled GGUF file).

Every method runs on every prompt, interleaved prompt by prompt (the method order rotates
from prompt to prompt), after one warm-up generation each, so machine drift hits all alike.
Speedups are medians of per-prompt ratios. Each method's greedy tokens are checked against
hf_generate's on every prompt: a lossless method must match exactly (llama_cpp runs other,
quantized weights: n/a).

Besides end-to-end tokens/s, each method's decoding phase is reported on its own: the tokens
after the first over the time after the first (decode tok/s), with the time to the first token
(prefill), which dominates end-to-end time on long prompts.

llama_cpp reads the model's .gguf, which selfspec keeps beside its float32 conversion (models
cached by older versions fetch it once more from PyPI), and runs with selfspec's thread count.
"""

from selfspec.bench.methods import (
    ALL_METHODS,
    BASELINE,
    METHODS,
    BenchContext,
    Method,
    MethodRun,
)
from selfspec.bench.report import format_markdown, plot_results, write_outputs
from selfspec.bench.run import resolve_methods, run_bench

__all__ = [
    "ALL_METHODS",
    "BASELINE",
    "METHODS",
    "BenchContext",
    "Method",
    "MethodRun",
    "format_markdown",
    "plot_results",
    "resolve_methods",
    "run_bench",
    "write_outputs",
]
