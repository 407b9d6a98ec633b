"""Cache entries for converted models: built in a staging folder, published by one rename, guarded
by a lock so that concurrent first loads build once, and sealed with each file's size, mtime and
CRC-32 so that damage is noticed.

A start checks sizes and mtimes only (cheap); a file whose mtime moved is checksummed, so a file
truncated or written over is caught without hashing gigabytes on every start. Bit rot under an
unchanged mtime is caught by ``entry_damage(folder, full=True)`` (``selfspec models --verify``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.fileio import atomic_write_text
from selfspec.paths import cache_dir, staging_root

MARKER_FILE = "selfspec-model.json"  # written last: an entry without it is unfinished
LOCK_WAIT_NOTE_SECONDS = 1.0


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically move a finished cache entry into place; a concurrent winner is kept."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if (final_dir / MARKER_FILE).is_file():
            shutil.rmtree(tmp_dir, ignore_errors=True)
        else:  # a stale, unfinished entry: replace it
            shutil.rmtree(final_dir, ignore_errors=True)
            os.rename(tmp_dir, final_dir)


@contextlib.contextmanager
def staging(prefix: str):
    """A fresh work folder inside the cache (same filesystem: finished entries are renamed into
    place), removed afterwards whatever happens."""
    root = staging_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=root))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def build_lock(name: str):
    """Held while one process builds the entry ``name``; another waits (said once on stderr) and
    then finds the entry built."""
    from filelock import FileLock, Timeout

    folder = cache_dir() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / f"{name}.lock"))
    try:
        lock.acquire(timeout=LOCK_WAIT_NOTE_SECONDS)
    except Timeout:
        print(
            f"selfspec: another process is preparing {name} in the cache; waiting for it.",
            file=sys.stderr,
            flush=True,
        )
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _file_record(path: Path, with_checksum: bool = True) -> dict:
    stat = path.stat()
    record = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if with_checksum:
        record["crc32"] = crc32_file(path)
    return record


def seal(folder: Path) -> None:
    """Record every file's size, mtime and CRC-32 in the entry's marker."""
    marker = folder / MARKER_FILE
    meta = json.loads(marker.read_text())
    meta["files"] = {
        str(f.relative_to(folder)): _file_record(f)
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != MARKER_FILE
    }
    atomic_write_text(marker, json.dumps(meta))


def _marker(folder: Path) -> dict | None:
    """The entry's marker, its "files" records defaulted to none; None if it cannot be read."""
    try:
        meta = json.loads((folder / MARKER_FILE).read_text())
        meta.setdefault("files", {})
    except (OSError, ValueError, AttributeError):
        return None
    return meta


def _file_damage(path: Path, rel: str, record, full: bool) -> tuple[str | None, bool]:
    """(what is wrong with one file or None, whether its record should be refreshed)."""
    if isinstance(record, int):  # entries sealed before checksums recorded sizes only
        record = {"size": record}
    if not path.is_file():
        return f"{rel} is missing", False
    stat = path.stat()
    if stat.st_size != record["size"]:
        return f"{rel} has {stat.st_size} bytes, expected {record['size']}", False
    moved = stat.st_mtime_ns != record.get("mtime_ns", stat.st_mtime_ns)
    if "crc32" not in record or not (moved or full):
        return None, False
    if crc32_file(path) != record["crc32"]:
        return f"{rel} does not match its checksum", False
    return None, moved  # rewritten with the same bytes (e.g. copied): remember the new mtime


def entry_damage(folder: Path, full: bool = False) -> str | None:
    """What is wrong with a finished cache entry (a file missing, of the wrong size or, where its
    mtime moved or ``full``, not matching its checksum); None if nothing is."""
    meta = _marker(folder)
    if meta is None:
        return f"its marker {MARKER_FILE} is unreadable"
    files = meta["files"]
    refresh = False
    for rel, record in files.items():
        damage, moved = _file_damage(folder / rel, rel, record, full)
        if damage:
            return damage
        if moved:
            files[rel] = {**record, **_file_record(folder / rel, with_checksum=False)}
            refresh = True
    if refresh:
        with contextlib.suppress(SelfSpecError):  # a read-only cache still loads
            atomic_write_text(folder / MARKER_FILE, json.dumps(meta))
    return None


def entry_ready(folder: Path, label: str) -> bool:
    """Whether ``folder`` holds a whole entry; a damaged one is said in one line (naming it
    ``label``) and marked unfinished, to be built again."""
    if not (folder / MARKER_FILE).is_file():
        return False
    damage = entry_damage(folder)
    if damage is None:
        return True
    print(
        f"selfspec: the cached {label} in {folder} is damaged ({damage}); rebuilding it.",
        file=sys.stderr,
    )
    (folder / MARKER_FILE).unlink(missing_ok=True)  # now an unfinished entry: replaced
    return False


def build_entry(
    final: Path, label: str, build: Callable[[Path], None], lock: str | None = None
) -> Path:
    """``final`` as a whole entry: as it is when whole (a damaged one is said and rebuilt), else
    built by ``build(folder)`` (which writes the marker) in a staging folder, sealed and
    published, under the lock ``lock`` (default: ``final``'s name) so that concurrent callers
    build it once."""
    if entry_ready(final, label):
        return final
    with build_lock(lock or final.name):
        if entry_ready(final, label):  # built by the process this one waited for
            return final
        with staging(final.name) as work:
            out = work / "entry"
            out.mkdir()
            build(out)
            seal(out)
            publish(out, final)
    return final


def has_checksums(folder: Path) -> bool:
    """Whether the entry's marker records checksums (entries cached by older versions do not)."""
    files = (_marker(folder) or {"files": {}})["files"]
    return bool(files) and all(isinstance(r, dict) and "crc32" in r for r in files.values())
