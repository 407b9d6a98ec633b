"""Atomic file writes: a crash or a full disk never leaves a half-written plan, cache or report."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from selfspec.errors import SelfSpecError


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder and rename, so a crash never leaves half a file.
    A write that fails (full disk, read-only folder) is a SelfSpecError; the old file is kept."""
    path = Path(path)
    try:
        _write_and_rename(path, data)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise SelfSpecError(
            f"cannot write {path}: {reason}. "
            + ("The previous file is unchanged. " if path.exists() else "")
            + "Free some disk space, make the folder writable, or write somewhere else."
        ) from None


def _write_and_rename(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
