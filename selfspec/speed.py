"""Speed modes: how a loaded model's weights are laid out and multiplied, chosen at load time.

- ``torch``: the model as transformers builds it (``F.linear`` over [out, in] weights).
- ``packed``: CPU, float32. Every linear layer of the decoder and the head is repacked into
  16-wide column panels and multiplied by selfspec's own kernel (``kernels/packed_linear.cpp``,
  compiled for this CPU on first use, about a minute, then cached). Same weights, same
  float32 arithmetic, summed in a fixed order, so a pass over k+1 tokens gives every row the
  logits a one-token pass gives, and costs about what one token costs (BLAS does not: see
  ``selfspec profile``).
- ``gguf``: as ``packed``, but the linear layers keep the GGUF file's quantized integers (Q4_K,
  Q6_K, ...) and the kernel rebuilds each float32 weight in registers: the same logits as
  ``packed``, bit for bit, from a fifth of the memory traffic (``selfspec.quantized``). Opt-in;
  for models that came from a GGUF file.
- ``gguf-q8``: the GGUF file's integers times the activations rounded to 8 bits (per 32 values),
  summed with integer dot products (AVX-512 VNNI), as llama.cpp does: 2-5x less arithmetic than
  ``gguf``, so verify passes and prefill cost far less. **Changes the numerics**: the logits are
  not the float32 model's (relative error about 1e-2 per layer output), and output can differ
  from the other modes after a few tokens. Speculation in this mode is still identical to plain
  decoding in this mode. Opt-in; CPUs with AVX-512 VNNI.
- ``cuda-graphs``: CUDA. The model as transformers builds it (bfloat16 by default), every pass
  after prefill run with a fixed shape over a static cache and replayed as a CUDA graph
  (``selfspec.static``): one launch per pass instead of about a thousand. On CUDA the ``torch``
  mode runs the same fixed-shape passes without graphs (fixed shapes keep rows independent of
  the pass length, which greedy identity needs).
- ``cuda-compiled``: as ``cuda-graphs``, each kind of pass first put through ``torch.compile``,
  which fuses the small ops between the matmuls: a pass of the 1.5B on an H100 takes 3.3 ms
  instead of 5.3, but compiling takes about a minute per kind of pass (the draft step, the
  verify pass) on first use in a process. Opt-in: for long runs, not one-off prompts.
- ``auto`` (default): ``cuda-graphs`` on CUDA; on a CPU ``packed`` if it can build the kernel, else
  ``torch``.

Modules are swapped on the one model instance selfspec loaded; transformers itself is untouched.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from selfspec.errors import SelfSpecError

SPEED_MODES = ("auto", "torch", "packed", "gguf", "gguf-q8", "cuda-graphs", "cuda-compiled")
GRAPH_MODES = ("cuda-graphs", "cuda-compiled")  # CUDA: fixed-shape passes replayed as CUDA graphs
QUANTIZED_MODES = ("gguf", "gguf-q8")  # read the GGUF file's own integers
KERNEL_MODES = ("packed", *QUANTIZED_MODES)
# Modes whose arithmetic is not the float32 model's: said in every stats line and bench.
NUMERICS = {"gguf-q8": "activations rounded to 8 bits per 32 values (llama.cpp's arithmetic): "
                       "not the float32 model's logits"}
# On CUDA every mode runs fixed 16-row passes over a static cache (selfspec.static): the same
# model, its sums in another order than transformers' one-token steps.
CUDA_NUMERICS = ("bfloat16 passes of 16 rows over a static cache: sums in another order than transformers' "
                 "one-token steps, so greedy output can part from hf_generate's")


def numerics_note(mode: str, device_type: str = "cpu") -> str | None:
    """How a mode's arithmetic differs from transformers' own on the same weights; None: it does not."""
    if mode in NUMERICS:
        return NUMERICS[mode]
    return CUDA_NUMERICS if device_type == "cuda" else None
_KERNEL_SOURCE = Path(__file__).resolve().parent / "kernels" / "packed_linear.cpp"
_PANEL = 16
# Passes over at most this many tokens use the kernel, whose rows do not depend on each other:
# every decode step, draft step and verify pass (max_draft_tokens <= 64, plus the pending token).
# Longer passes (prefill) are compute-bound, where BLAS, batched over the panels, is faster.
KERNEL_MAX_ROWS = 80
_kernel = None
_kernel_error: str | None = None
_kernel_lock = threading.Lock()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> Path:
    from selfspec.models import cache_dir

    # -march=native: a build is only valid on CPUs with the same instruction set.
    key = hashlib.sha256(_KERNEL_SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode())
    folder = cache_dir() / "kernels" / key.hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is not there unless the venv is activated."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def load_kernel():
    """The compiled packed-linear extension; raises SelfSpecError saying why it cannot be built."""
    global _kernel, _kernel_error
    with _kernel_lock:
        if _kernel is not None:
            return _kernel
        if _kernel_error is not None:
            raise SelfSpecError(_kernel_error)
        if platform.machine().lower() not in ("x86_64", "amd64") or " avx2" not in _cpu_flags() + " ":
            _kernel_error = "the packed kernel needs an x86-64 CPU with AVX2 and FMA; use --speed torch."
            raise SelfSpecError(_kernel_error)
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            folder = _build_dir()
            if not any(folder.glob("*.so")):
                print("selfspec: compiling the packed CPU kernel for this machine (once, about a minute)...",
                      file=sys.stderr, flush=True)
            _kernel = load(
                name="selfspec_packed_linear", sources=[str(_KERNEL_SOURCE)], build_directory=str(folder),
                # fp-contract off: the rebuilt weights must round as ggml's (no fused multiply-add the code
                # did not ask for).
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"], verbose=False,
            )
        except Exception as exc:  # compiler missing, ninja missing, unsupported CPU...
            _kernel_error = (f"could not build selfspec's packed CPU kernel ({type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}). "
                             "It needs a C++ compiler (g++) and ninja (`pip install ninja`); "
                             "or use --speed torch.")
            raise SelfSpecError(_kernel_error) from exc
        return _kernel


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)


def kernel_available() -> bool:
    try:
        load_kernel()
        return True
    except SelfSpecError:
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16] with packed[p, k, j] = weight[16p + j, k]."""
    n, k = weight.shape
    return weight.detach().reshape(n // _PANEL, _PANEL, k).transpose(1, 2).contiguous()


def matmul_panels(rows: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ panels [P, K, 16] -> [M, 16P] with BLAS, for long (prefill) passes. The gguf
    mode runs it too, on rebuilt panels, so both modes prefill with the same arithmetic."""
    return torch.matmul(rows, panels).permute(1, 0, 2).reshape(rows.shape[0], -1)


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

    def forward(self, x: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
        """``out_features``: compute only the first outputs (a multiple of 64), reading only their weights."""
        n = out_features or self.out_features
        weight = self.packed_weight[: n // _PANEL]  # a prefix of the panels: a view, no copy
        bias = self.bias[:n] if self.bias is not None else None
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernel.packed_linear(rows, weight, bias)
        else:
            out = matmul_panels(rows, weight)
            if bias is not None:
                out = out + bias
        return out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=16-wide panels"


def linear_prefix(linear: nn.Module, x: torch.Tensor, out_features: int | None) -> torch.Tensor:
    """The first ``out_features`` outputs of ``linear`` (all when None), reading only their weights."""
    if out_features is None or out_features >= linear.out_features:
        return linear(x)
    if getattr(linear, "reads_prefix", False):
        return linear(x, out_features)
    bias = linear.bias[:out_features] if linear.bias is not None else None
    return torch.nn.functional.linear(x, linear.weight[:out_features], bias)


def _packable(linear: nn.Module, group: int) -> bool:
    return (isinstance(linear, nn.Linear) and linear.weight.dtype == torch.float32
            and linear.out_features % (_PANEL * group) == 0)


def pack_model(model: nn.Module) -> int:
    """Swap every packable nn.Linear of ``model`` for a PackedLinear; returns how many were swapped."""
    kernel = load_kernel()
    group = kernel.panels_per_group()
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if _packable(child, group):
                setattr(parent, child_name, PackedLinear(child, kernel))
                swapped += 1
    # The weights may be views of the checkpoint file mapped into memory, which stays mapped (and its
    # pages, read while packing, stay resident) while any view lives: give the rest their own memory.
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor is not None and not name.endswith(("packed_weight", "quant_weight")):  # fresh already
                tensor.data = tensor.data.clone()
    return swapped


def resolve_speed_mode(mode: str, device, dtype) -> str:
    """The mode that will actually run: ``auto`` becomes ``packed`` or ``torch``."""
    if mode not in SPEED_MODES:
        raise SelfSpecError(f"unknown speed mode '{mode}'. Choose one of: {', '.join(SPEED_MODES)}.")
    cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    on_cuda = torch.device(device).type == "cuda"
    if mode in GRAPH_MODES and not on_cuda:
        raise SelfSpecError(f"--speed {mode} needs a CUDA device (--device cuda); on this device use --speed auto.")
    if mode == "auto" and on_cuda:
        return "cuda-graphs"
    if mode in KERNEL_MODES:
        if not cpu_fp32:
            raise SelfSpecError(f"--speed {mode} runs on the CPU in float32 only; use --speed torch here.")
        kernel = load_kernel()  # raises a clear error when it cannot be built
        if mode == "gguf-q8" and not kernel.q8_vectorized():
            raise SelfSpecError("--speed gguf-q8 needs a CPU with AVX-512 VNNI (integer dot products), which this "
                                "one lacks; use --speed gguf (same weights, float32 arithmetic).")
        return mode
    if mode == "auto":
        if not cpu_fp32:
            return "torch"
        try:
            load_kernel()
            return "packed"
        except SelfSpecError as exc:
            _warn_once(f"selfspec: running transformers' own kernels: {exc}")
            return "torch"
    return mode


def _attention_by_rows(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """Attention for the kernel speed modes: selfspec's kernel, one query row at a time in a fixed
    order (``attention_rows`` in kernels/packed_linear.cpp), so a verify pass gives every row the
    bits a one-token pass gives, and grouped key/value heads are read in place (transformers copies
    them once per query head of the group for a masked pass). Features it does not cover (dropout,
    soft-capping, position bias, paged caches) go to transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
             and kwargs.get("cache") is None and query.dtype == torch.float32 and query.device.type == "cpu"
             and (attention_mask is None or attention_mask.dtype in (torch.bool, torch.float32)))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return load_kernel().attention_rows(query, key, value, attention_mask, scale, bool(causal)), None


ROW_ATTENTION = "selfspec_rows"


def use_row_attention(model: nn.Module) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ROW_ATTENTION, _attention_by_rows)  # adds a name; transformers' own stay as they are
    model.set_attn_implementation(ROW_ATTENTION)


def apply_speed_mode(model: nn.Module, mode: str, gguf_path: Path | None = None) -> None:
    if mode in KERNEL_MODES and model.config._attn_implementation == "sdpa":
        use_row_attention(model)
    if mode in QUANTIZED_MODES:
        from selfspec.quantized import quantize_model

        quantize_model(model, gguf_path, load_kernel(), activations8=mode == "gguf-q8")
    if mode in KERNEL_MODES:
        pack_model(model)  # in gguf mode: what the file did not hold, and the rest gets its own memory
