"""Whether a GGUF file holds a bundled model's weights, quantized another way.

A user's Q3_K_M or Q5_K_M file of a bundled model is another model to selfspec's cache (its key
is the file's content hash), so it would draft without the bundled model's heads. The heads read
the final hidden state, which another quantization of the same weights barely moves, so they
carry over. A bundled model with heads ships a fingerprint beside them
(``plans/<model>/fingerprint.safetensors``): the shape of its token embedding and ``ROWS`` of its
rows as the bundled file dequantizes them. A file whose embedding has that shape and whose rows
point the same way (mean cosine at least ``SAME``) holds the same weights: quantization alone
leaves them at 0.96 (the 1.5B's Q2_K file) to 0.9998 (Q5_K_M). A fine-tune of the same base may
pass too; the drafter's measured costs decide each round whether borrowed heads run, so a wrong
match costs speed, never output.

``python -m selfspec.loading.fingerprint FILE.gguf OUT`` writes a fingerprint.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import numpy as np

from selfspec.fileio import atomic_write_bytes
from selfspec.loading.gguf_reader import GGUFTensor, gguf_tensors

ROWS = 16
SAME = 0.9
FINGERPRINT = "fingerprint.safetensors"
EMBEDDING = "token_embd.weight"


def _row_ids(vocab: int) -> list[int]:
    """``ROWS`` token ids spread over the vocabulary (the same for every file of that size)."""
    return [(i + 1) * vocab // (ROWS + 1) for i in range(ROWS)]


def _rows(tensor: GGUFTensor) -> np.ndarray:
    """The fingerprint's rows of an embedding, as float32 [ROWS, columns]."""
    from selfspec.speed.blocks import dequantize  # selfspec.speed imports selfspec.loading

    return dequantize(tensor.gather_rows(_row_ids(tensor.rows)), tensor.type_name, ROWS)


def write_fingerprint(gguf_path: Path, out: Path) -> None:
    from safetensors.numpy import save

    embedding = gguf_tensors(gguf_path)[EMBEDDING]
    rows = _rows(embedding).astype(np.float16)
    meta = {"vocab": str(embedding.rows), "hidden": str(embedding.columns)}
    meta["source"] = gguf_path.name
    atomic_write_bytes(out, save({"rows": rows}, metadata=meta))


def _agreement(ours: np.ndarray, theirs: np.ndarray) -> float:
    """Mean cosine of corresponding rows."""
    dot = (ours * theirs).sum(axis=1)
    norms = np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
    return float(np.mean(dot / np.maximum(norms, 1e-30)))


def shipped_fingerprints():
    """(model name, fingerprint file) of every bundled model that ships one."""
    plans = resources.files("selfspec") / "plans"
    for folder in sorted(plans.iterdir(), key=lambda f: f.name):
        if (folder / FINGERPRINT).is_file():
            yield folder.name, folder / FINGERPRINT


def same_weights_as(gguf_path: Path, fingerprints=None) -> str | None:
    """The model whose weights ``gguf_path`` holds (quantized any way), or None: among the
    bundled models' fingerprints, or ``fingerprints`` ((name, fingerprint file) pairs)."""
    return embedding_of(gguf_tensors(gguf_path).get(EMBEDDING), fingerprints)


def embedding_of(embedding: GGUFTensor | None, fingerprints=None) -> str | None:
    """``same_weights_as`` for a file's token embedding (None: the file has none)."""
    from safetensors import safe_open

    if embedding is None:
        return None
    ours = None
    for name, path in shipped_fingerprints() if fingerprints is None else fingerprints:
        with resources.as_file(path) as local, safe_open(local, "numpy") as fh:
            meta, theirs = fh.metadata(), fh.get_tensor("rows").astype(np.float32)
        if (int(meta["vocab"]), int(meta["hidden"])) != (embedding.rows, embedding.columns):
            continue
        ours = _rows(embedding) if ours is None else ours
        if _agreement(ours, theirs) >= SAME:
            return name
    return None


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m selfspec.loading.fingerprint FILE.gguf OUT")
    write_fingerprint(Path(sys.argv[1]), Path(sys.argv[2]))
