"""Reading a GGUF file's tensors: mapped from the file, not read, and without parsing the
metadata values (the 150k-token vocabulary among them)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfspec.errors import SelfSpecError

_STRETCH_BYTES = 8 << 20  # the most ``gather_rows`` reads at once
_GAP_BYTES = 64 << 10  # rows further apart than this are read apart


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

    def gather_rows(self, ids) -> np.ndarray:
        """Rows ``ids`` (any order, repeats allowed) [len(ids), bytes per row], read as
        ``read_rows`` reads (never through ``data``'s pages): wanted rows near each other in one
        read, rows standing apart each in its own."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        row_bytes = self.data.shape[1]
        wanted = np.unique(ids)
        gathered = np.empty((len(wanted), row_bytes), np.uint8)
        stretch = wanted // max(1, _STRETCH_BYTES // row_bytes)
        apart = (np.diff(wanted) > max(1, _GAP_BYTES // row_bytes)) | (np.diff(stretch) != 0)
        done = 0
        with open(self.path, "rb", buffering=0) as fh:
            for group in np.split(wanted, np.flatnonzero(apart) + 1):
                first, last = int(group[0]), int(group[-1]) + 1
                size = (last - first) * row_bytes
                raw = os.pread(fh.fileno(), size, self.offset + first * row_bytes)
                if len(raw) != size:
                    raise SelfSpecError(
                        f"{self.path.name} ends inside tensor {self.name}: the file is truncated. "
                        "Download it again."
                    )
                span = np.frombuffer(raw, np.uint8).reshape(last - first, row_bytes)
                gathered[done : done + len(group)] = span[group - first]
                done += len(group)
        return gathered[np.searchsorted(wanted, ids)]


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
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(mapped[:4]) != b"GGUF":
            raise ValueError("no GGUF magic bytes")
        cursor = _Cursor(mapped, 4)  # past the magic bytes
        _version, n_tensors, n_values = cursor.take("IQQ")
        alignment, architecture = 32, None
        for _ in range(n_values):
            key, kind = cursor.string(), cursor.take("I")
            if key == "general.alignment" and kind == 4:
                alignment = cursor.take("I")
            elif key == "general.architecture" and kind == _STRING:
                architecture = cursor.string()
            else:
                cursor.skip_value(kind)
        infos = [cursor.tensor_info(GGMLQuantizationType) for _ in range(n_tensors)]
        start = -(-cursor.pos // alignment) * alignment
        tensors = _map_tensors(mapped, Path(path), start, infos, GGML_QUANT_SIZES)
        return GGUFFile(tensors, architecture)
    except Exception as exc:  # struct, enum and numpy errors all mean a damaged file here
        raise SelfSpecError(
            f"cannot read {path} as a GGUF file ({type(exc).__name__}: {exc}). "
            "Download it again, or use --speed packed."
        ) from exc


class _Cursor:
    """Reads GGUF header fields from ``mapped`` at ``pos``, moving past them."""

    def __init__(self, mapped: np.ndarray, pos: int):
        self.mapped, self.pos = mapped, pos

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.mapped, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        length = self.take("Q")
        self.pos += length
        return bytes(self.mapped[self.pos - length : self.pos]).decode("utf-8", "replace")

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            length = self.take("Q")  # (not `pos += take(...)`: take moves pos itself)
            self.pos += length
        elif kind == _ARRAY:
            item_kind, count = self.take("IQ")
            if item_kind in _SCALAR_BYTES:
                self.pos += _SCALAR_BYTES[item_kind] * count
            elif item_kind == _STRING:  # the vocabulary: a tight loop, not one call a string
                lengths = struct.Struct("<Q")
                for _ in range(count):
                    self.pos += 8 + lengths.unpack_from(self.mapped, self.pos)[0]
            else:
                for _ in range(count):
                    self.skip_value(item_kind)
        else:
            self.pos += _SCALAR_BYTES[kind]

    def tensor_info(self, types) -> tuple:
        """(name, dims, quantization type, offset from the data's start) of the next tensor;
        ``types``: gguf's GGMLQuantizationType."""
        name = self.string()
        dims = [self.take("Q") for _ in range(self.take("I"))]
        return name, dims, types(self.take("I")), self.take("Q")


def _map_tensors(
    mapped: np.ndarray, path: Path, start: int, infos: list, sizes: dict
) -> dict[str, GGUFTensor]:
    """The tensors ``infos`` lists, mapped from ``mapped``; ``sizes``: gguf's GGML_QUANT_SIZES."""
    tensors = {}
    for name, dims, kind, offset in infos:
        block, block_bytes = sizes[kind]
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        begin = start + offset
        if begin + rows * row_bytes > mapped.size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = mapped[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, kind.name, rows, dims[0], data, path, begin)
    return tensors
