"""Reading a GGUF file's tensors: mapped from the file, not read, and without parsing the
metadata values (the 150k-token vocabulary among them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfspec.errors import SelfSpecError


@dataclass
class GGUFTensor:
    name: str
    type_name: str
    rows: int
    columns: int
    data: np.ndarray  # [rows, bytes per row] uint8, mapped from the file
    path: Path
    offset: int  # of the first row in the file

    def read_rows(self, first: int, last: int) -> np.ndarray:
        """Rows [first, last) read into memory of their own: unlike ``data``'s pages, which stay
        counted in the process's resident memory while the file is mapped, these are freed with
        the array."""
        row_bytes = self.data.shape[1]
        with open(self.path, "rb") as fh:
            fh.seek(self.offset + first * row_bytes)
            rows = np.fromfile(fh, np.uint8, (last - first) * row_bytes)
        return rows.reshape(last - first, row_bytes)


@dataclass
class GGUFFile:
    tensors: dict[str, GGUFTensor]
    architecture: str | None  # general.architecture: llama.cpp's name for the model family


_SCALAR_BYTES = {
    0: 1,
    1: 1,
    2: 2,
    3: 2,
    4: 4,
    5: 4,
    6: 4,
    7: 1,
    10: 8,
    11: 8,
    12: 8,
}  # GGUF value types
_STRING, _ARRAY = 8, 9


def gguf_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The tensors of a GGUF file, mapped, not read."""
    return read_gguf(path).tensors


def read_gguf(path: Path) -> GGUFFile:
    """A GGUF file's tensors, mapped, not read, and its architecture. (gguf's GGUFReader also
    parses every metadata value, the 150k-token vocabulary included, which takes seconds; this
    skips them.)"""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        pos = 4  # past the magic bytes

        def take(fmt: str):
            nonlocal pos
            values = struct.unpack_from("<" + fmt, mapped, pos)
            pos += struct.calcsize("<" + fmt)
            return values if len(values) > 1 else values[0]

        def string() -> str:
            nonlocal pos
            length = take("Q")
            pos += length
            return bytes(mapped[pos - length : pos]).decode("utf-8", "replace")

        def skip_value(kind: int) -> None:
            nonlocal pos
            if kind == _STRING:
                length = take("Q")  # (not `pos += take(...)`: take moves pos itself)
                pos += length
            elif kind == _ARRAY:
                item_kind, count = take("IQ")
                if item_kind in _SCALAR_BYTES:
                    pos += _SCALAR_BYTES[item_kind] * count
                elif item_kind == _STRING:  # the vocabulary: a tight loop, not one call a string
                    lengths = struct.Struct("<Q")
                    for _ in range(count):
                        pos += 8 + lengths.unpack_from(mapped, pos)[0]
                else:
                    for _ in range(count):
                        skip_value(item_kind)
            else:
                pos += _SCALAR_BYTES[kind]

        if bytes(mapped[:4]) != b"GGUF":
            raise ValueError("no GGUF magic bytes")
        _version, n_tensors, n_values = take("IQQ")
        alignment, architecture = 32, None
        for _ in range(n_values):
            key, kind = string(), take("I")
            if key == "general.alignment" and kind == 4:
                alignment = take("I")
            elif key == "general.architecture" and kind == _STRING:
                architecture = string()
            else:
                skip_value(kind)
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("Q") for _ in range(take("I"))]
            infos.append((name, dims, GGMLQuantizationType(take("I")), take("Q")))
        start = -(-pos // alignment) * alignment
        tensors = {}
        for name, dims, kind, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            row_bytes = dims[0] // block * block_bytes
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            begin = start + offset
            if begin + rows * row_bytes > mapped.size:
                raise ValueError(f"tensor {name} runs past the end of the file")
            tensors[name] = GGUFTensor(
                name,
                kind.name,
                rows,
                dims[0],
                mapped[begin : begin + rows * row_bytes].reshape(rows, row_bytes),
                Path(path),
                begin,
            )
        return GGUFFile(tensors, architecture)
    except Exception as exc:  # struct, enum and numpy errors all mean a damaged file here
        raise SelfSpecError(
            f"cannot read {path} as a GGUF file ({type(exc).__name__}: {exc}). "
            "Download it again, or use --speed packed."
        ) from exc
