"""What a model was used for, kept so that its draft heads can learn from it.

With ``--learn`` (``selfspec generate``, ``selfspec serve``) every finished generation appends one
line to the model's history (``~/.cache/selfspec/history/<model>.jsonl``, or in the folder
``$SELFSPEC_HISTORY``): the end of its prompt
and the answer's token ids. ``selfspec train-heads --from-history`` trains the model's heads on
those answers, starting from the heads it has, so a model gets heads, and better ones, by being
used. Nothing else reads the file; it stays on this machine and holds the prompts' ids, so it is
kept only when asked for.

The file is bounded: past ``max_tokens`` answer tokens the oldest lines are dropped (the file is
rewritten atomically). A line cut short by a crash is skipped when read.

Beside it, ``<model>.recycled.safetensors`` keeps the table of recycled drafts the model's passes
filled (``LearnedTable``), so they start from earlier use rather than from nothing. It is
bounded too (one entry per token id and ``recycled.MAX_PAIRS`` pairs, about 15 MB at most).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.fileio import atomic_write_text
from selfspec.paths import cache_dir

PROMPT_TAIL = 512  # the prompt's last ids kept: context enough for the hidden states at the answer
MAX_TOKENS = 250_000  # answer tokens kept per model (a few MB); heads gain little past this
KEEP_AFTER_TRIM = 0.75  # a trim keeps this share of max_tokens, so trims are rare


HISTORY_ENV = "SELFSPEC_HISTORY"  # the folder the histories are kept in, if not the cache's


def history_path(model_name: str) -> Path:
    folder = os.environ.get(HISTORY_ENV)
    return (Path(folder) if folder else cache_dir() / "history") / f"{model_name}.jsonl"


class History:
    """One model's record of use: ``record`` after each generation, ``entries`` to train on."""

    def __init__(self, path: Path, max_tokens: int = MAX_TOKENS):
        self.path = Path(path)
        self.max_tokens = max_tokens
        self._lock = threading.Lock()  # the server's threads; other processes: a lock file
        self._tokens: int | None = None

    @classmethod
    def for_model(cls, model_name: str, max_tokens: int = MAX_TOKENS) -> History:
        return cls(history_path(model_name), max_tokens)

    def record(self, prompt_ids: list[int], answer_ids: list[int]) -> int:
        """Append one generation (answers under two tokens teach the heads nothing); the answer
        tokens the history holds after it."""
        if len(answer_ids) < 2:
            return self._tokens if self._tokens is not None else self._count()
        entry = {"prompt": list(prompt_ids[-PROMPT_TAIL:]), "answer": list(answer_ids)}
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        try:
            with self._locked():
                known = self._tokens if self._tokens is not None else self._count()  # before it
                with open(self.path, "a+b") as fh:
                    if fh.tell():
                        fh.seek(-1, os.SEEK_END)
                        if fh.read(1) != b"\n":
                            line = "\n" + line  # after a line a crash cut short, not glued to it
                    fh.write(line.encode())  # one write of a whole line, at the end (O_APPEND)
                self._tokens = known + len(answer_ids)
                if self._tokens > self.max_tokens:
                    self._trim()
                return self._tokens
        except OSError as exc:
            raise SelfSpecError(
                f"cannot record use in {self.path}: {exc.strerror or exc}. Free some disk space "
                "or make the folder writable, or leave out --learn"
            ) from None

    def entries(self) -> list[tuple[list[int], list[int]]]:
        """(prompt tail, answer) per generation recorded, oldest first."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
                prompt, answer = entry["prompt"], entry["answer"]
            except (ValueError, KeyError, TypeError):
                continue  # a line a crash cut short
            if _ids(prompt) and _ids(answer) and len(answer) >= 2:
                out.append((prompt, answer))
        return out

    def tokens(self) -> int:
        """Answer tokens recorded."""
        return self._count()

    def _count(self) -> int:
        return sum(len(answer) for _, answer in self.entries())

    def _trim(self) -> None:
        """Keep the newest entries, up to ``KEEP_AFTER_TRIM`` of ``max_tokens`` answer tokens."""
        kept, total = [], 0
        for prompt, answer in reversed(self.entries()):
            if total + len(answer) > KEEP_AFTER_TRIM * self.max_tokens:
                break
            kept.append({"prompt": prompt, "answer": answer})
            total += len(answer)
        text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in reversed(kept))
        atomic_write_text(self.path, text)
        self._tokens = total

    @contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


class LearnedTable:
    """A model's table of recycled drafts kept between runs (``--learn``): ``load`` it before
    drafting, ``save`` it after; a write is atomic and only happens when the table learnt."""

    def __init__(self, path: Path, vocab_size: int):
        self.path, self.vocab_size = Path(path), vocab_size
        self._saved_rows = 0  # the drafts' learnt rows when last loaded or saved
        self._saved_at = time.monotonic()

    @classmethod
    def for_model(cls, model_name: str, vocab_size: int) -> LearnedTable:
        return cls(history_path(model_name).with_suffix(".recycled.safetensors"), vocab_size)

    def resume(self, drafter: object, read_only: bool = False) -> int:
        """Start ``drafter``'s recycled drafts (if it has them) from the table kept; the token ids
        it knows (0: none kept yet). A file that cannot be read is moved aside (``.unreadable``,
        with a one-line warning) and learning starts again; ``read_only``: its error is raised
        instead, and the file left where it is."""
        from selfspec.drafters.recycled import RecycledTable

        drafts = getattr(drafter, "recycled", None)
        if drafts is None or not self.path.is_file():
            return 0
        try:
            table = RecycledTable.load(self.path, self.vocab_size)
        except SelfSpecError as exc:
            if read_only:
                raise
            self._move_aside(exc)
            return 0
        drafts.adopt(table)
        self._saved_rows = drafts.learnt_rows
        return len(table)

    def _move_aside(self, exc: SelfSpecError) -> None:
        aside = self.path.with_name(self.path.name + ".unreadable")
        try:
            os.replace(self.path, aside)
            moved = f"moved it to {aside.name} and starting a new table"
        except OSError as error:
            moved = f"starting a new table (it could not be moved aside: {error.strerror})"
        print(f"[selfspec] warning: {exc}; {moved}", file=sys.stderr, flush=True)

    def due_in(self, drafter: object, at_most_every: float) -> float | None:
        """Seconds until ``save(drafter, at_most_every)`` would write (0: now); None while there
        is nothing new to write."""
        drafts = getattr(drafter, "recycled", None)
        if drafts is None or drafts.learnt_rows == self._saved_rows:
            return None
        return max(0.0, at_most_every - (time.monotonic() - self._saved_at))

    def save(self, drafter: object, at_most_every: float = 0.0) -> bool:
        """Write ``drafter``'s recycled table if it learnt since it was resumed or saved, and the
        last write is ``at_most_every`` seconds old (a write of a full table takes a fraction of
        a second); whether it wrote."""
        if self.due_in(drafter, at_most_every) != 0.0:  # nothing new, or its time not yet up
            return False
        drafts = drafter.recycled
        drafts.table.save(self.path, self.vocab_size)
        self._saved_rows, self._saved_at = drafts.learnt_rows, time.monotonic()
        return True


def _ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and i >= 0 for i in value)
