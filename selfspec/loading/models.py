"""Load a model by name or path, ready to decode: weights, tokenizer and speed mode.

Where its files come from (the bundled models, the cache) is ``selfspec.loading.sources``; the
quantized speed modes load straight from the GGUF file (``selfspec.loading.gguf_load``), the others
from float32 weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.loading.fetch import progress_wanted
from selfspec.loading.sources import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    float32_dir,
    gguf_source,
    has_gguf_source,
    is_cached,
    resolve_model_dir,
)
from selfspec.memory import return_freed_memory
from selfspec.paths import cache_dir, model_key


@dataclass
class LoadedModel:
    """A model ready to decode: the module in eval mode, its tokenizer and where it came from.

    ``model`` is transformers' model, except in the quantized modes on a CPU with fused layers:
    there it is selfspec's own skeleton of the same modules (``selfspec.loading.skeleton``), which
    runs through ``selfspec.runtime.runner.ModelRunner`` only; ``load_model(..., fused=False)``
    gives transformers' model in every mode."""

    name: str
    model: object
    tokenizer: object
    path: str
    speed: str = "torch"  # the speed mode its weights were laid out for (selfspec.speed.modes)
    fused: list | None = (
        None  # the kernel's DecoderLayer per layer (selfspec.speed.fused), if fused
    )
    device_map: dict | None = None  # module name -> device, for a model spread over devices

    @cached_property
    def key(self) -> str:
        """The name this model's heads, plans and record of use go under (``paths.model_key``)."""
        return model_key(self.name, self.path)

    @property
    def device(self):
        """Where tokens enter (the embedding's device for a model spread over devices)."""
        if self.device_map is not None:
            from selfspec.loading.placement import execution_device

            return execution_device(self.device_map, "embed_tokens")
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype


def default_dtype(device: str):
    import torch

    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    device: str = "cpu",
    dtype=None,
    speed: str = "torch",
    fused: bool = True,
    max_memory: dict | None = None,
) -> LoadedModel:
    """Load a model by bundled name, local folder, local .gguf or hub id, with SDPA attention.

    ``speed``: a mode of ``selfspec.speed.modes`` ("auto", "torch", "packed", "gguf", "gguf-q8");
    "torch" leaves the model exactly as transformers builds it. ``fused``: in the kernel modes,
    run each decoder sublayer as one native call where the model's family allows
    (``selfspec.speed.fused``). ``max_memory``: spread the model over devices (``{0: bytes, "cpu":
    bytes}``, the rest to disk) as ``selfspec.loading.placement`` explains; speed mode torch only.
    """
    import torch

    from selfspec.loading.skeleton import CausalLM
    from selfspec.loading.tokenizer import load_tokenizer_from
    from selfspec.speed.modes import QUANTIZED_MODES, resolve_speed_mode

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise SelfSpecError(
            "--device cuda was asked for, but torch sees no CUDA device. Use --device cpu."
        )
    first_run = name_or_path in KNOWN_MODELS and not is_cached(name_or_path)
    if first_run and str(device) == "cpu" and speed != "torch":
        compile_kernel_meanwhile()  # a first run: the download and the compiler overlap
    folder = resolve_model_dir(name_or_path)
    dtype = dtype or default_dtype(device)
    speed = resolve_speed_mode(
        speed, device, dtype, from_gguf=has_gguf_source(name_or_path, folder)
    )
    progress_wanted()  # SELFSPEC_NO_PROGRESS=1 quiets transformers' bars too
    if max_memory is not None:
        return _load_split(name_or_path, folder, dtype, speed, max_memory)
    own_skeleton = fused and str(device) == "cpu" and speed in QUANTIZED_MODES
    try:
        tokenizer = load_tokenizer_from(folder)
        model, layers = load_weights(
            name_or_path, folder, device, dtype, speed, fused, own_skeleton
        )
    except OSError as exc:
        raise SelfSpecError(f"could not load model '{name_or_path}' from {folder}: {exc}") from exc
    if own_skeleton and layers is None and isinstance(model, CausalLM):
        # a layer the kernel cannot fuse: selfspec's skeleton runs only fused layers
        model, layers = load_weights(name_or_path, folder, device, dtype, speed, fused, False)
    return_freed_memory()  # what loading freed (the parsed tokenizer file, decoded blocks)
    return LoadedModel(
        name=name_or_path, model=model, tokenizer=tokenizer, path=folder, speed=speed, fused=layers
    )


def load_weights(name: str, folder, device, dtype, speed: str, fused: bool, own_skeleton: bool):
    """(model in eval mode laid out for ``speed``, its fused layers or None)."""
    from selfspec.loading.gguf_load import load_quantized
    from selfspec.runtime.adapters import attention_implementation
    from selfspec.speed.fused import fuse_layers
    from selfspec.speed.modes import QUANTIZED_MODES, apply_speed_mode

    if speed in QUANTIZED_MODES:
        model = load_quantized(folder, gguf_source(name, folder), speed, own_skeleton)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = float32_dir(name, folder)
        attention = attention_implementation(AutoConfig.from_pretrained(path))
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attention
        )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    apply_speed_mode(model, speed)
    return model, fuse_layers(model, speed) if fused else None


def compile_kernel_meanwhile() -> None:
    """Build the CPU kernel in a thread (the compiler runs as its own processes) while the model is
    fetched; whoever asks for the kernel next waits for this build. A build that fails says why
    when the kernel is asked for."""
    import threading

    # Imported here, before the thread: the build and the model's download both take file locks,
    # and when the two threads imported filelock at the same moment one of them could fail with
    # "No module named 'filelock._core._registry'" (the package half-initialised in the other).
    import filelock  # noqa: F401

    from selfspec.kernels import kernel_available

    threading.Thread(target=kernel_available, name="selfspec-kernel-build", daemon=True).start()


def _load_split(name: str, folder: str, dtype, speed: str, max_memory: dict) -> LoadedModel:
    import atexit
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from selfspec.loading.placement import load_split

    if speed != "torch":
        raise SelfSpecError(
            f"--max-memory spreads the model over devices with accelerate, which runs speed mode "
            f"torch only (the kernel modes keep each weight in one packed buffer); got {speed}. "
            "Add --speed torch."
        )
    root = cache_dir() / "offload"
    root.mkdir(parents=True, exist_ok=True)
    offload = Path(tempfile.mkdtemp(prefix="weights-", dir=root))
    atexit.register(shutil.rmtree, offload, ignore_errors=True)
    try:
        model, device_map = load_split(float32_dir(name, folder), dtype, max_memory, offload)
    except OSError as exc:
        raise SelfSpecError(f"could not load model '{name}' from {folder}: {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(folder),
        path=folder,
        speed=speed,
        device_map=device_map,
    )


def check_same_tokenizer(
    target_name: str, target_tokenizer, draft_name: str, draft_tokenizer
) -> None:
    """Refuse a draft model whose token ids mean something else than the target's."""
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise SelfSpecError(
            f"draft model '{draft_name}' does not share {target_name}'s tokenizer, so its tokens "
            "mean something else. Pick a draft model of the same family."
        )


def load_tokenizer(name_or_path: str):
    """A model's tokenizer alone (cheap: for checks before its weights are loaded)."""
    from selfspec.loading.tokenizer import load_tokenizer_from

    return load_tokenizer_from(resolve_model_dir(name_or_path))


def unmodified(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` exactly as transformers builds it: itself in speed mode torch, else a fresh
    copy."""
    if loaded.speed == "torch":
        return loaded
    copy = load_model(loaded.name, device=str(loaded.device), dtype=loaded.dtype, speed="torch")
    copy.name = loaded.name
    return copy
