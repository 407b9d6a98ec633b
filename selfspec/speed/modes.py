"""Speed modes: how a loaded model's weights are laid out and multiplied, chosen at load time.

- ``torch``: the model as transformers builds it (``F.linear`` over [out, in] weights).
- ``packed``: CPU, float32. Every linear layer of the decoder and the head is repacked into
  16-wide column panels and multiplied by selfspec's own kernel (``kernels/linear.cpp``,
  compiled for this CPU on first use, about a minute, then cached). Same weights, same
  float32 arithmetic, summed in a fixed order, so a pass over k+1 tokens gives every row the
  logits a one-token pass gives, and costs about what one token costs (BLAS does not: see
  ``selfspec profile``).
- ``gguf``: as ``packed``, but the linear layers keep the GGUF file's quantized integers (Q4_K,
  Q6_K, ...) and the kernel rebuilds each float32 weight in registers: the same logits as
  ``packed``, bit for bit, from a fifth of the memory traffic (``selfspec.speed.quantized``).
  Opt-in; for models that came from a GGUF file.
- ``gguf-q8``: the GGUF file's integers times the activations rounded to 8 bits (per 32 values),
  summed with integer dot products (AVX-512 VNNI, else AVX2), as llama.cpp does: less arithmetic
  than ``gguf``, so verify passes and prefill cost less. **Changes the numerics**: the logits are
  not the float32 model's (relative error about 1e-2 per layer output), and output can differ
  from the other modes after a few tokens. Speculation in this mode is still identical to plain
  decoding in this mode. The default for GGUF models on x86-64 CPUs.
- ``cuda-graphs``: CUDA. The model as transformers builds it (bfloat16 by default), every pass
  after prefill run with a fixed shape over a static cache and replayed as a CUDA graph
  (``selfspec.runtime.cuda_graphs``): one launch per pass instead of about a thousand. On CUDA the
  ``torch`` mode runs the same fixed-shape passes without graphs (fixed shapes keep rows
  independent of the pass length, which greedy identity needs).
- ``cuda-compiled``: as ``cuda-graphs``, each kind of pass first put through ``torch.compile``,
  which fuses the small ops between the matmuls (faster passes; docs/performance.md), but
  compiling takes about a minute per kind of pass (the draft step, the verify pass) on first use
  in a process. Opt-in: for long runs, not one-off prompts.
- ``auto`` (default): the fastest mode this machine runs: ``cuda-graphs`` on CUDA; on a CPU,
  for a model that came from a GGUF file (the bundled ones), ``gguf-q8`` where the kernel has its
  integer dot products (AVX-512 VNNI or AVX2), else ``gguf``; for other models ``packed``;
  ``torch`` if the kernel cannot be built.

Modules are swapped on the one model instance selfspec loaded; transformers itself is untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.kernels import (
    PANEL,
    in_row_chunks,
    load_kernel,
    pack_weight,
    padded_rows,
    use_row_attention,
)

SPEED_MODES = ("auto", "torch", "packed", "gguf", "gguf-q8", "cuda-graphs", "cuda-compiled")
GRAPH_MODES = ("cuda-graphs", "cuda-compiled")  # CUDA: fixed-shape passes replayed as CUDA graphs
QUANTIZED_MODES = ("gguf", "gguf-q8")  # read the GGUF file's own integers
KERNEL_MODES = ("packed", *QUANTIZED_MODES)
# Modes whose arithmetic is not the float32 model's: said in every stats line and bench.
NUMERICS = {
    "gguf-q8": "activations rounded to 8 bits per 32 values (llama.cpp's arithmetic): "
    "not the float32 model's logits"
}
# On CUDA every mode runs fixed 16-row passes over a static cache (selfspec.runtime.cuda_graphs):
# the same model, its sums in another order than transformers' one-token steps.
CUDA_NUMERICS = (
    "bfloat16 passes of 16 rows over a static cache: sums in another order than transformers' "
    "one-token steps, so greedy output can part from hf_generate's"
)


def numerics_note(mode: str, device_type: str = "cpu", relaid: tuple = ()) -> str | None:
    """How a mode's arithmetic differs from transformers' own on the same weights; None: it does
    not. ``relaid``: the file's types gguf-q8 laid out as Q8_0 (``relaid_types``)."""
    note = NUMERICS.get(mode) or (CUDA_NUMERICS if device_type == "cuda" else None)
    if relaid:
        note = f"{note}; {', '.join(relaid)} weights laid out as Q8_0 (no kernel tiles for them)"
    return note


def relaid_types(model: nn.Module) -> tuple[str, ...]:
    """The file's weight types that speed mode gguf-q8 holds as Q8_0, in name order."""
    from selfspec.speed.blocks import RELAID

    kinds = {getattr(m, "type_name", "") for m in model.modules()}
    return tuple(sorted(k.removesuffix(RELAID) for k in kinds if k.endswith(RELAID)))


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` whose weight lives in panels; float32 on CPU."""

    reads_prefix = True  # forward(x, out_features) reads only the first outputs' weights

    def __init__(self, linear: nn.Linear, kernel):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.register_buffer("packed_weight", pack_weight(linear.weight))
        bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    @property
    def panel_weight(self) -> torch.Tensor:
        return self.packed_weight

    def run_panels(self, rows: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        """rows [M, in_features] times ``weight`` (some of this layer's panels) + ``bias``."""
        return in_row_chunks(lambda chunk: self.kernel.packed_linear(chunk, weight, bias), rows)

    def rows_module(self, ids: torch.Tensor) -> PackedLinear:
        """A module of output rows ``ids`` only (padded: ``padded_rows``)."""
        ids = padded_rows(ids)
        # on the meta device: no random initial weights for what is replaced at once
        rows = nn.Linear(self.in_features, len(ids), bias=self.bias is not None, device="meta")
        rows.weight = nn.Parameter(self.packed_weight[ids // PANEL, :, ids % PANEL], False)
        if self.bias is not None:
            rows.bias = nn.Parameter(self.bias[ids], False)
        return PackedLinear(rows, self.kernel)

    def forward(self, x: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
        """``out_features``: compute only the first outputs (a multiple of 64), reading only their
        weights."""
        n = out_features or self.out_features
        weight = self.packed_weight[: n // PANEL]  # a prefix of the panels: a view, no copy
        bias = self.bias[:n] if self.bias is not None else None
        out = self.run_panels(x.reshape(-1, self.in_features), weight, bias)
        return out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, packed=16-wide panels"


def _packable(linear: nn.Module, group: int) -> bool:
    return (
        isinstance(linear, nn.Linear)
        and linear.weight.dtype == torch.float32
        and linear.out_features % (PANEL * group) == 0
    )


def pack_model(model: nn.Module) -> int:
    """Swap every packable nn.Linear of ``model`` for a PackedLinear; returns how many were
    swapped."""
    kernel = load_kernel()
    group = kernel.panels_per_group()
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if _packable(child, group):
                setattr(parent, child_name, PackedLinear(child, kernel))
                swapped += 1
    # The weights may be views of the checkpoint file mapped into memory, which stays mapped (and
    # its pages, read while packing, stay resident) while any view lives: give the rest their
    # own memory.
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor is not None and not name.endswith(
                ("packed_weight", "quant_weight")
            ):  # fresh already
                tensor.data = tensor.data.clone()
    return swapped


def resolve_speed_mode(mode: str, device, dtype, from_gguf: bool = False) -> str:
    """The mode that will actually run. ``auto`` becomes the fastest this machine runs: on CUDA
    ``cuda-graphs``; on a CPU, for a model read from a GGUF file (``from_gguf``), ``gguf-q8`` with
    integer dot products, else ``gguf``; for other models ``packed``; ``torch`` where the kernel
    cannot be built."""
    if mode not in SPEED_MODES:
        raise SelfSpecError(
            f"unknown speed mode '{mode}'. Choose one of: {', '.join(SPEED_MODES)}."
        )
    cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    on_cuda = torch.device(device).type == "cuda"
    if mode in GRAPH_MODES and not on_cuda:
        raise SelfSpecError(
            f"--speed {mode} needs a CUDA device (--device cuda); on this device use --speed auto."
        )
    if mode == "auto" and on_cuda:
        return "cuda-graphs"
    if mode in KERNEL_MODES:
        if not cpu_fp32:
            raise SelfSpecError(
                f"--speed {mode} runs on the CPU in float32 only; use --speed torch here."
            )
        kernel = load_kernel()  # raises a clear error when it cannot be built
        if mode == "gguf-q8" and not kernel.q8_vectorized():
            raise SelfSpecError(
                "--speed gguf-q8 needs integer dot products (AVX-512 VNNI or AVX2), which this "
                "build of the kernel lacks; use --speed gguf (same weights, float32 arithmetic)."
            )
        return mode
    if mode == "auto":
        return _fastest_cpu_mode(from_gguf) if cpu_fp32 else "torch"
    return mode


def _fastest_cpu_mode(from_gguf: bool) -> str:
    try:
        kernel = load_kernel()
    except SelfSpecError as exc:
        _warn_once(f"selfspec: running transformers' own kernels: {exc}")
        return "torch"
    if not from_gguf:
        return "packed"
    return "gguf-q8" if kernel.q8_vectorized() else "gguf"


def apply_speed_mode(model: nn.Module, mode: str, gguf_path: Path | None = None) -> None:
    """Lay ``model``'s weights out for ``mode``. A float32 model put into a quantized mode needs
    the GGUF file it came from (``gguf_path``); one loaded by ``selfspec.loading.gguf_load`` is
    quantized already."""
    if mode in KERNEL_MODES and model.config._attn_implementation == "sdpa":
        use_row_attention(model)
    if mode in QUANTIZED_MODES:
        from selfspec.speed.quantized import QuantLinear, quantize_model

        if not any(isinstance(m, QuantLinear) for m in model.modules()):
            if gguf_path is None:
                raise SelfSpecError(
                    f"speed mode {mode} reads the GGUF file the model came from; none was given."
                )
            quantize_model(model, gguf_path, load_kernel(), activations8=mode == "gguf-q8")
    if mode in KERNEL_MODES:
        # in gguf mode: what the file did not hold, and the rest gets its own memory
        pack_model(model)
