"""selfspec's CPU kernel (``module.cpp``, the sources beside it and their headers): how it is
built, and the primitives around it.

The C++ extension is compiled for this machine on first use (``-march=native``: a build is only
valid on CPUs with the same instruction set) and cached under the user's cache, keyed by the
source, the CPU's flags and the torch version. It provides:

- ``packed_linear`` / ``quant_linear`` / ``q8_linear``: a linear layer over few rows, weights in
  16-wide column panels (float32, or the GGUF file's integers), each row summed in a fixed order
  so that row r of a pass over m rows is bit for bit a pass over that row alone;
- ``attention_rows``: attention with each query row's arithmetic its own, for the same reason;
- ``DecoderLayer``: a whole pre-norm decoder sublayer (norm, projections, rotary embedding,
  attention; or the MLP) in one call, row by row in the same way (``selfspec.speed.fused``).

The speed modes (``selfspec.speed.modes``, ``selfspec.speed.quantized``) build their modules on
these.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.errors import SelfSpecError
from selfspec.machine import cpu_flags, has_flag, is_x86_64
from selfspec.paths import kernel_build_root

if TYPE_CHECKING:
    from torch import nn

SOURCE_DIR = Path(__file__).resolve().parent
# module.cpp holds the Python bindings; linear.cpp, q8.cpp and layers.cpp the kernels, so that a
# first build compiles them side by side (ninja runs a job per core)
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
PANEL = 16  # output columns per panel
# Rows per kernel call: every decode step, draft step and verify pass (max_draft_tokens <= 64, plus
# the pending token) in one call; longer passes (prefill) in chunks of this many rows, whose
# activations stay in cache while each weight passes by them once. A row's sums do not depend on
# the rows beside it, so a chunked prefill gives the logits of one-token passes.
KERNEL_MAX_ROWS = 80
ROW_ATTENTION = "selfspec_rows"  # the name the row attention is registered under in transformers

# fp-contract off: the rebuilt weights must round as ggml's (no fused multiply-add the code did
# not ask for)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_BUILT = "selfspec-built"  # written once a build has linked: the .so beside it is whole

_kernel = None
_kernel_error: str | None = None
_kernel_lock = threading.Lock()


def _build_dir() -> Path:
    key = hashlib.sha256(cpu_flags().encode() + torch.__version__.encode())
    key.update(" ".join(_CFLAGS).encode())
    for path in sorted(SOURCE_DIR.glob("*.[ch]*")):  # the sources and their headers
        key.update(path.name.encode() + path.read_bytes())
    folder = kernel_build_root() / key.hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is not there unless the venv is
    activated."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _import_built(folder: Path):
    """The extension built earlier in ``folder``, imported directly (torch's loader would import
    its build tools and run ninja to check the build, a noticeable part of a start), or None."""
    import importlib.util

    library = folder / "selfspec_kernels.so"
    if not (folder / _BUILT).is_file() or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location("selfspec_kernels", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile():
    folder = _build_dir()
    with contextlib.suppress(ImportError, OSError):
        built = _import_built(folder)
        if built is not None:
            return built
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    if not any(folder.glob("*.so")):
        print(
            "selfspec: compiling the packed CPU kernel for this machine (once, under a minute)...",
            file=sys.stderr,
            flush=True,
        )
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    # torch marks a build in progress with a plain file that a killed build leaves behind, and
    # every later build would wait on it for ever. An OS lock dies with its process: whoever holds
    # it is the only builder, so a baton file found then is stale.
    with FileLock(str(folder.parent / f"{folder.name}.build.lock")):
        (folder / "lock").unlink(missing_ok=True)
        module = load(
            name="selfspec_kernels",
            sources=[str(path) for path in SOURCES],
            build_directory=str(folder),
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        (folder / _BUILT).touch()
        return module


def loaded_kernel():
    """The compiled extension if this process has loaded it already, else None (builds nothing)."""
    return _kernel


def load_kernel():
    """The compiled extension; raises SelfSpecError saying why it cannot be built."""
    global _kernel, _kernel_error
    with _kernel_lock:
        if _kernel is not None:
            return _kernel
        if _kernel_error is not None:
            raise SelfSpecError(_kernel_error)
        if not is_x86_64() or not has_flag("avx2"):
            _kernel_error = (
                "the packed kernel needs an x86-64 CPU with AVX2 and FMA; use --speed torch."
            )
            raise SelfSpecError(_kernel_error)
        try:
            _kernel = _compile()
        except Exception as exc:  # compiler missing, ninja missing, unsupported CPU...
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else exc
            _kernel_error = (
                f"could not build selfspec's packed CPU kernel ({type(exc).__name__}: {last}). "
                "It needs a C++ compiler (g++) and ninja (`pip install ninja`); or use --speed "
                "torch."
            )
            raise SelfSpecError(_kernel_error) from exc
        return _kernel


def kernel_available() -> bool:
    try:
        load_kernel()
        return True
    except SelfSpecError:
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16] with packed[p, k, j] = weight[16p + j, k]."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def in_row_chunks(kernel_call: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor):
    """``kernel_call`` over rows [M, K], KERNEL_MAX_ROWS at a time; its rows, in order."""
    if rows.shape[0] <= KERNEL_MAX_ROWS:
        return kernel_call(rows)
    step = KERNEL_MAX_ROWS
    return torch.cat([kernel_call(rows[m : m + step]) for m in range(0, rows.shape[0], step)])


def linear_prefix(linear: nn.Module, x: torch.Tensor, out_features: int | None) -> torch.Tensor:
    """The first ``out_features`` outputs of ``linear`` (all when None), reading only their
    weights."""
    if out_features is None or out_features >= linear.out_features:
        return linear(x)
    if hasattr(linear, "_hf_hook"):  # placed by accelerate: its weights may load only on call
        return linear(x)[..., :out_features]
    if getattr(linear, "reads_prefix", False):
        return linear(x, out_features)
    bias = linear.bias[:out_features] if linear.bias is not None else None
    return torch.nn.functional.linear(x, linear.weight[:out_features], bias)


def linear_rows(linear: nn.Module, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of x giving ``linear``'s outputs ``ids`` only ([..., len(ids)]), from a module
    holding just those rows (many ids: ``linear_outputs`` would copy most panels), each row's
    arithmetic the module's own. Modules that cannot make one give ``linear_outputs``."""
    make = getattr(linear, "rows_module", None)
    module = make(ids) if make is not None else None
    if module is None:
        return linear_outputs(linear, ids)
    return lambda x: module(x)[..., : len(ids)]


def padded_rows(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` with its last repeated up to a whole number of the kernel's panel groups."""
    return _padded(ids, PANEL * load_kernel().panels_per_group())


def _padded(items: torch.Tensor, multiple: int) -> torch.Tensor:
    """``items`` with its last repeated up to a multiple of ``multiple`` entries."""
    return torch.cat([items, items[-1:].expand(-len(items) % multiple)])


def linear_outputs(linear: nn.Module, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of x giving ``linear``'s outputs ``ids`` only ([..., len(ids)]), reading only
    their weights: for the kernel's modules, the panels holding them (copied once, padded to the
    kernel's panel-count granularity), through the module's own arithmetic."""
    if hasattr(linear, "_hf_hook"):  # placed by accelerate: its weights may load only on call
        return lambda x: linear(x)[..., ids]
    if not hasattr(linear, "run_panels"):
        weight = linear.weight[ids]
        bias = linear.bias[ids] if linear.bias is not None else None
        return lambda x: torch.nn.functional.linear(x, weight, bias)
    panels = torch.unique(ids // PANEL)  # sorted
    gathered = _padded(panels, load_kernel().panels_per_group())
    weight = linear.panel_weight.index_select(0, gathered)
    bias = None
    if linear.bias is not None:
        bias = linear.bias.view(-1, PANEL).index_select(0, gathered).reshape(-1)
    columns = torch.searchsorted(panels, ids // PANEL) * PANEL + ids % PANEL

    def outputs(x: torch.Tensor) -> torch.Tensor:
        out = linear.run_panels(x.reshape(-1, linear.in_features), weight, bias)
        return out[:, columns].view(*x.shape[:-1], len(ids))

    return outputs


def _attention_by_rows(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """Attention for the kernel speed modes: each query row in a fixed order of its own
    (``attention_rows``), so a verify pass gives every row the bits a one-token pass gives, and
    grouped key/value heads are read in place. Features it does not cover (dropout, soft-capping,
    position bias, paged caches) go to transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (
        dropout == 0.0
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and query.dtype == torch.float32
        and query.device.type == "cpu"
        and (attention_mask is None or attention_mask.dtype in (torch.bool, torch.float32))
    )
    if not plain:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    rows = load_kernel().attention_rows(query, key, value, attention_mask, scale, bool(causal))
    return rows, None


def use_row_attention(model: nn.Module) -> None:
    """Switch one model instance to the row attention (transformers' own implementations stay)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ROW_ATTENTION, _attention_by_rows)
    model.set_attn_implementation(ROW_ATTENTION)
