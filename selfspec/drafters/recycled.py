"""Recycled drafts: the model's own next-token predictions, kept from the passes it already ran.

Every verify pass scores each of its rows over the whole vocabulary, and the loop keeps one token
of it. The rest is free: for each token a pass read, the model's most likely next token given
everything before it. Kept by that token, and by that token with the one before it (more often
right where both match), they draft the next time the same tokens come: a chain walked from the
pending token, each step's chance the model's own probability back then. It needs no training and
no second model, costs no pass, and learns across generations, so it serves any model. Its
acceptance is measured round by round like every other kind of draft (``adaptive``).

After Token Recycling (Luo et al., 2024: "Turning Trash into Treasure"), here with chains
instead of trees: on a CPU every verify row has a price.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from selfspec.runtime.sampling import top_probability_rows

if TYPE_CHECKING:
    from selfspec.runtime.runner import ModelRunner, ScoredRows

MAX_PAIRS = 1 << 18  # (token before, token) keys kept; the least recently written go first
MIN_CHANCE = 0.05  # a chain stops before a token whose chance (product of probabilities) is lower


class RecycledTable:
    """The model's top next token and its probability, by the token it followed, and by the pair
    of tokens it followed."""

    def __init__(self, max_pairs: int = MAX_PAIRS):
        self.by_token: dict[int, tuple[int, float]] = {}
        self.by_pair: OrderedDict[tuple[int, int], tuple[int, float]] = OrderedDict()
        self.max_pairs = max_pairs

    def __len__(self) -> int:
        return len(self.by_token)

    def record(self, before: int | None, token: int, following: int, probability: float) -> None:
        entry = (following, probability)
        self.by_token[token] = entry
        if before is None:
            return
        key = (before, token)
        self.by_pair[key] = entry
        self.by_pair.move_to_end(key)
        if len(self.by_pair) > self.max_pairs:
            self.by_pair.popitem(last=False)

    def next_token(self, before: int | None, token: int) -> tuple[int, float] | None:
        entry = self.by_pair.get((before, token)) if before is not None else None
        return entry if entry is not None else self.by_token.get(token)

    def chain(
        self, before: int | None, token: int, limit: int, min_chance: float = MIN_CHANCE
    ) -> tuple[list[int], list[float]]:
        """Up to ``limit`` tokens walked from ``token`` (after ``before``), with the chance of each
        and the ones before it; the first is always given where the table knows ``token``."""
        tokens, chances, chance = [], [], 1.0
        for _ in range(limit):
            entry = self.next_token(before, token)
            if entry is None:
                break
            chance *= entry[1]
            if tokens and chance < min_chance:
                break
            tokens.append(entry[0])
            chances.append(chance)
            before, token = token, entry[0]
        return tokens, chances

    def absorb(self, committed: list[int], rows: ScoredRows) -> int:
        """Learn from every row of a pass: a row after a rejected draft saw a context that never
        was, but what follows its token (and the token before it) there is still the model's
        own guess, and it fills the table faster; rows that read committed tokens are recorded
        last, so theirs win where both know a key. Returns how many rows read committed
        tokens."""
        if not rows.ids:
            return 0
        valid = 0
        for i, token in enumerate(rows.ids):
            position = rows.start + i
            if position >= len(committed) or committed[position] != token:
                break
            valid += 1
        ids, top = top_probability_rows(rows.logits[: len(rows.ids)])
        first_before = committed[rows.start - 1] if 0 < rows.start <= len(committed) else None
        for i in [*range(valid, len(rows.ids)), *range(valid)]:
            before = rows.ids[i - 1] if i else first_before
            self.record(before, rows.ids[i], ids[i], top[i])
        return valid


class RecycledDrafts:
    """A ``RecycledTable`` fed by ``runner``'s passes: ``absorb`` the last pass, then ``chain``."""

    def __init__(self, runner: ModelRunner, table: RecycledTable | None = None):
        self.runner = runner
        self.table = table or RecycledTable()
        self.absorbed: ScoredRows | None = None  # the last pass learnt from
        self.learnt_rows = 0

    def absorb(self, committed: list[int]) -> None:
        rows = self.runner.last_scored
        if rows is None or rows is self.absorbed:
            return
        self.absorbed = rows
        self.learnt_rows += self.table.absorb(committed, rows)

    def chain(self, committed: list[int], limit: int) -> tuple[list[int], list[float]]:
        """The draft after ``committed`` (its last token pending): up to ``limit`` tokens."""
        before = committed[-2] if len(committed) > 1 else None
        return self.table.chain(before, committed[-1], limit)

    def describe(self) -> str:
        return f"recycled predictions ({len(self.table)} tokens known)"
