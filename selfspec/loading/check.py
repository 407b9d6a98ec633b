"""``selfspec models --check FILE``: whether a GGUF file (or a Hugging Face folder) will load, in
which speed modes, and which tensor types it holds, read from its header in a second, before a
long load."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.errors import SelfSpecError

# GGUF architectures whose transformers model type differs from the name
_MODEL_TYPES = {"gemma3": "gemma3_text"}


@dataclass
class CheckReport:
    path: str
    architecture: str | None
    model_type: str | None
    types: dict[str, int] = field(default_factory=dict)  # tensor type -> tensors of that type
    modes: dict[str, str] = field(default_factory=dict)  # speed mode -> "yes", or why not / how
    problem: str | None = None  # why no mode loads it
    heads_of: str | None = None  # the bundled model whose weights (and draft heads) a GGUF holds

    @property
    def loads(self) -> bool:
        return any(v.startswith("yes") for v in self.modes.values())

    def to_dict(self) -> dict:
        return {**self.__dict__, "loads": self.loads}

    def lines(self) -> list[str]:
        types = ", ".join(f"{t} x {n}" for t, n in sorted(self.types.items(), key=lambda x: -x[1]))
        out = [f"{self.path}: architecture {self.architecture} (model type {self.model_type})"]
        if types:
            out.append(f"  tensor types: {types}")
        out += [f"  --speed {mode}: {verdict}" for mode, verdict in self.modes.items()]
        if self.problem:
            out.append(f"  does not load: {self.problem}")
        elif self.heads_of:
            out.append(f"  draft heads: {self.heads_of}'s (this file holds its weights)")
        elif self.types:
            out.append("  draft heads: none shipped for these weights (selfspec train-heads)")
        return out


def check_model_file(path: str | Path) -> CheckReport:
    """What ``path`` (a .gguf file or a folder with config.json) holds and where it loads."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _check_folder(path)
    if not path.is_file():
        raise SelfSpecError(f"{path} does not exist; pass a .gguf file or a model folder.")
    return _check_gguf(path)


def _family_problem(model_type: str | None) -> str | None:
    from selfspec.runtime.adapters import ADAPTED_FAMILIES

    if model_type in ADAPTED_FAMILIES:
        return None
    return (
        f"selfspec has no adapter for model type '{model_type}' "
        f"(supported: {', '.join(ADAPTED_FAMILIES)})"
    )


def _check_folder(folder: Path) -> CheckReport:
    config = folder / "config.json"
    if not config.is_file():
        raise SelfSpecError(f"{folder} holds no config.json; pass a .gguf file or a model folder.")
    model_type = json.loads(config.read_text()).get("model_type")
    report = CheckReport(str(folder), None, model_type)
    report.problem = _family_problem(model_type)
    verdict = "yes" if report.problem is None else "no"
    report.modes = {"torch": verdict, "packed": verdict, "gguf": "no (not a GGUF file)"}
    report.modes["gguf-q8"] = report.modes["gguf"]
    return report


def _check_gguf(path: Path) -> CheckReport:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from selfspec.loading.fingerprint import EMBEDDING, embedding_of
    from selfspec.loading.gguf_reader import read_gguf
    from selfspec.speed.blocks import DECODERS, Q8_DECODERS, read_problem

    gguf = read_gguf(path)  # a damaged file: a one-line error
    arch = gguf.architecture
    model_type = _MODEL_TYPES.get(arch, arch)
    report = CheckReport(str(path), arch, model_type)
    report.types = dict(Counter(t.type_name for t in gguf.tensors.values()))
    one_of_each = {t.type_name: t for t in gguf.tensors.values()}
    unreadable = [name for name, tensor in one_of_each.items() if read_problem(tensor)]
    if arch not in GGUF_CONFIG_MAPPING:
        report.problem = f"transformers cannot read the GGUF architecture '{arch}'"
    elif unreadable:
        report.problem = f"gguf cannot dequantize {', '.join(unreadable)}"
    else:
        report.problem = _family_problem(model_type)
    if report.problem:
        report.modes = dict.fromkeys(("torch", "packed", "gguf", "gguf-q8"), "no")
        return report
    matrices = {
        t.type_name for n, t in gguf.tensors.items() if t.rows > 1 and n != "token_embd.weight"
    }
    if "output.weight" not in gguf.tensors:  # the output layer is the embedding's
        matrices.add(gguf.tensors["token_embd.weight"].type_name)
    inexact = sorted(matrices - set(DECODERS))
    relaid = sorted(matrices - set(DECODERS) - set(Q8_DECODERS))
    report.modes = {"torch": "yes (float32 copy)", "packed": "yes (float32 copy)"}
    report.modes["gguf"] = "yes" if not inexact else f"no ({', '.join(inexact)} not read exactly)"
    report.modes["gguf-q8"] = "yes" if not relaid else f"yes ({', '.join(relaid)} laid out as Q8_0)"
    report.heads_of = embedding_of(gguf.tensors.get(EMBEDDING))  # the header already read
    return report
