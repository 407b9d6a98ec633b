"""Recycled drafts: the model's own next-token predictions, kept from the passes it already ran.

Every verify pass scores each of its rows over the whole vocabulary, and the loop keeps one token
of it. The rest is free: for each token a pass read, the model's most likely next token given
everything before it. Kept by that token, and by that token with the one before it (more often
right where both match), they draft the next time the same tokens come: a chain walked from the
pending token, each step's chance the model's own probability back then. It needs no training and
no second model, costs no pass, and learns across generations, so it serves any model. Its
acceptance is measured round by round like every other kind of draft (``adaptive``).

Each key keeps the model's few most likely next tokens, so a draft can branch: ``tree`` grows the
nodes most likely to be kept first, and where the decode loop verifies trees (greedy, a kernel
runner) one pass checks every branch, each row seeing only its own ancestors. On a CPU every
verify row has a price, so the drafter takes as many nodes as pay (``adaptive``).

After Token Recycling (Luo et al., 2024: "Turning Trash into Treasure").
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from selfspec.runtime.sampling import top_k_probability_rows

if TYPE_CHECKING:
    from selfspec.runtime.runner import ModelRunner, ScoredRows

MAX_PAIRS = 1 << 18  # (token before, token) keys kept; the least recently written go first
MIN_CHANCE = 0.05  # a draft stops before a token whose chance (product of probabilities) is lower
WIDTH = 3  # next tokens a table for trees keeps per key: the branches a tree may take at a node

Entry = tuple[tuple[int, ...], tuple[float, ...]]  # next tokens, most likely first; probabilities


class RecycledTable:
    """The model's most likely next tokens and their probabilities, by the token they followed,
    and by the pair of tokens they followed."""

    def __init__(self, max_pairs: int = MAX_PAIRS, width: int = 1):
        self.by_token: dict[int, Entry] = {}
        self.by_pair: OrderedDict[tuple[int, int], Entry] = OrderedDict()
        self.max_pairs, self.width = max_pairs, width

    def __len__(self) -> int:
        return len(self.by_token)

    def record(
        self,
        before: int | None,
        token: int,
        following: int | Sequence[int],
        probability: float | Sequence[float],
    ) -> None:
        """What followed ``token`` (after ``before``): one token, or several, most likely first."""
        if isinstance(following, int):
            entry = ((following,), (float(probability),))
        else:
            kept = [i for i, t in enumerate(following) if t >= 0]  # -1: the row had no more
            entry = (tuple(following[i] for i in kept), tuple(probability[i] for i in kept))
        self.by_token[token] = entry
        if before is None:
            return
        key = (before, token)
        self.by_pair[key] = entry
        self.by_pair.move_to_end(key)
        if len(self.by_pair) > self.max_pairs:
            self.by_pair.popitem(last=False)

    def candidates(self, before: int | None, token: int) -> Entry | None:
        """The next tokens after ``token`` (the pair's where known) and their probabilities."""
        entry = self.by_pair.get((before, token)) if before is not None else None
        return entry if entry is not None else self.by_token.get(token)

    def next_token(self, before: int | None, token: int) -> tuple[int, float] | None:
        entry = self.candidates(before, token)
        return (entry[0][0], entry[1][0]) if entry else None

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

    def tree(
        self, before: int | None, token: int, nodes: int, depth: int, min_chance: float = MIN_CHANCE
    ) -> tuple[list[int], list[int], list[float]]:
        """Up to ``nodes`` tokens branching from ``token`` (after ``before``), at most ``depth``
        deep, the most likely first: (tokens, each one's parent's index among them, -1 for
        ``token``, each one's chance). A node's chance is its path's product of probabilities,
        never above its parent's, so parents come before their children and every prefix of the
        list is a tree; the first is always given where the table knows ``token``."""
        tokens: list[int] = []
        parents: list[int] = []
        chances: list[float] = []
        frontier: list = []  # (-chance, order, parent, token before, token, depth)
        order = itertools.count()

        def grow(parent: int, before: int | None, token: int, chance: float, level: int) -> None:
            entry = self.candidates(before, token) if level < depth else None
            for following, probability in zip(*entry) if entry else ():
                item = (-chance * probability, next(order), parent, token, following, level + 1)
                heapq.heappush(frontier, item)

        grow(-1, before, token, 1.0, 0)
        while frontier and len(tokens) < nodes:
            negative, _, parent, previous, following, level = heapq.heappop(frontier)
            if tokens and -negative < min_chance:
                break
            tokens.append(following)
            parents.append(parent)
            chances.append(-negative)
            grow(len(tokens) - 1, previous, following, -negative, level)
        return tokens, parents, chances

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
        ids, top = top_k_probability_rows(rows.logits[: len(rows.ids)], self.width)
        first_before = committed[rows.start - 1] if 0 < rows.start <= len(committed) else None
        for i in [*range(valid, len(rows.ids)), *range(valid)]:
            before = rows.ids[i - 1] if i else first_before
            self.record(before, rows.ids[i], ids[i], top[i])
        return valid


class RecycledDrafts:
    """A ``RecycledTable`` fed by ``runner``'s passes: ``absorb`` the last pass, then ``chain``."""

    def __init__(self, runner: ModelRunner, table: RecycledTable | None = None, width: int = 1):
        """``width``: next tokens a new table keeps per key (more than one only for trees)."""
        self.runner = runner
        self.table = table or RecycledTable(width=width)
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

    def tree(
        self, committed: list[int], nodes: int, depth: int
    ) -> tuple[list[int], list[int], list[float]]:
        """The tree after ``committed`` (its last token pending): ``RecycledTable.tree``."""
        before = committed[-2] if len(committed) > 1 else None
        return self.table.tree(before, committed[-1], nodes, depth)

    def describe(self) -> str:
        return f"recycled predictions ({len(self.table)} tokens known)"
