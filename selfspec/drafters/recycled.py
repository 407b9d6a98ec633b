"""Recycled drafts: the model's own next-token predictions, kept from the passes it already ran.

Every verify pass scores each of its rows over the whole vocabulary, and the loop keeps one token
of it. The rest is free: for each token a pass read, the model's most likely next token given
everything before it. Kept by that token, and by that token with the one before it (more often
right where both match), they draft the next time the same tokens come: a chain walked from the
pending token, each step's chance the model's own probability back then. It needs no training and
no second model, costs no pass, and learns across generations, so it serves any model. Its
acceptance is measured round by round like every other kind of draft (``adaptive``).

Each key keeps the model's few most likely next tokens, so a draft can branch: ``tree`` grows the
nodes most likely to be kept first, and where the decode loop verifies trees (a kernel runner,
greedy or sampled) one pass checks every branch, each row seeing only its own ancestors. On a CPU
every verify row has a price, so the drafter takes as many nodes as pay (``adaptive``).

The table can be kept between processes (``save``, ``load``): with ``--learn`` a model's table
is kept beside its record of use, so recycled drafts start from what earlier use taught them.

After Token Recycling (Luo et al., 2024: "Turning Trash into Treasure").
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.errors import SelfSpecError
from selfspec.fileio import atomic_write_bytes
from selfspec.runtime.sampling import top_k_probability_rows

if TYPE_CHECKING:
    from selfspec.runtime.runner import ModelRunner, ScoredRows

MAX_PAIRS = 1 << 18  # (token before, token) keys kept; the least recently written go first
MIN_CHANCE = 0.05  # a draft stops before a token whose chance (product of probabilities) is lower
WIDTH = 3  # next tokens a table for trees keeps per key: the branches a tree may take at a node

FILE_FORMAT = "selfspec-recycled-table/1"

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

    def save(self, path: Path, vocab_size: int) -> None:
        """Write the table to ``path`` (safetensors, atomically): what ``load`` reads back."""
        from safetensors.torch import save

        pairs = list(self.by_pair)  # least recently written first, as ``load`` restores them
        tensors = {
            "tokens": _ids_tensor(list(self.by_token)),
            "pairs": _ids_tensor([t for pair in pairs for t in pair]).view(-1, 2),
        }
        for name, entries in (("token", self.by_token.values()), ("pair", self.by_pair.values())):
            tensors[f"{name}_next"], tensors[f"{name}_probability"] = _pack(list(entries))
        metadata = {"format": FILE_FORMAT, "vocab_size": str(vocab_size)}
        atomic_write_bytes(path, save(tensors, metadata))

    @classmethod
    def load(
        cls, path: Path, vocab_size: int, width: int = 1, max_pairs: int = MAX_PAIRS
    ) -> RecycledTable:
        """The table ``save`` wrote, for a model of ``vocab_size`` token ids; a SelfSpecError
        names what is wrong with a file that is not one, or one of another vocabulary."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                metadata = f.metadata() or {}
                if metadata.get("format") != FILE_FORMAT:
                    raise SelfSpecError(f"{path} is not a table of recycled drafts")
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise SelfSpecError(f"cannot read {path}: {exc}") from None
        if metadata.get("vocab_size") != str(vocab_size):
            raise SelfSpecError(
                f"{path} was learnt by a model of {metadata.get('vocab_size')} token ids, "
                f"not {vocab_size}"
            )
        if not _consistent(tensors, vocab_size):
            raise SelfSpecError(f"{path} is damaged: its tensors do not fit together")
        table = cls(max_pairs, width)
        tokens, pairs = tensors["tokens"], tensors["pairs"]
        token_entries = _unpack(tensors["token_next"], tensors["token_probability"])
        table.by_token = dict(zip(tokens.tolist(), token_entries))
        pair_entries = _unpack(tensors["pair_next"], tensors["pair_probability"])
        kept = list(zip(map(tuple, pairs.tolist()), pair_entries))[-max_pairs:]
        table.by_pair = OrderedDict(kept)
        return table

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


def _ids_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int32)


def _consistent(tensors: dict[str, torch.Tensor], vocab_size: int) -> bool:
    """Whether a saved table's tensors are all there, agree in length and hold token ids."""
    names = ("tokens", "pairs", "token_next", "token_probability", "pair_next", "pair_probability")
    if any(name not in tensors for name in names):
        return False
    tokens, pairs = tensors["tokens"], tensors["pairs"]
    if tokens.dim() != 1 or pairs.dim() != 2 or pairs.shape[-1] != 2:
        return False
    for name, keys in (("token", tokens), ("pair", pairs)):
        nexts, chances = tensors[f"{name}_next"], tensors[f"{name}_probability"]
        if nexts.dim() != 2 or nexts.shape != chances.shape or len(nexts) != len(keys):
            return False
        # every entry a first next token, and probabilities in [0, 1]
        if nexts.shape[-1] < 1 or (nexts.numel() and (nexts[:, 0] < 0).any()):
            return False
        if chances.dtype != torch.float32 or not ((chances >= 0) & (chances <= 1)).all():
            return False
    for name in ("tokens", "pairs", "token_next", "pair_next"):
        ids = tensors[name]
        low = 0 if name in ("tokens", "pairs") else -1
        if ids.dtype != torch.int32:
            return False
        if ids.numel() and (ids.min() < low or ids.max() >= vocab_size):
            return False
    return True


def _pack(entries: list[Entry]) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries as [n, width] next tokens (-1 past an entry's own) and their probabilities."""
    width = max((len(tokens) for tokens, _ in entries), default=1)
    nexts = [list(tokens) + [-1] * (width - len(tokens)) for tokens, _ in entries]
    chances = [list(p) + [0.0] * (width - len(p)) for _, p in entries]
    return (
        torch.tensor(nexts, dtype=torch.int32).view(-1, width),
        torch.tensor(chances, dtype=torch.float32).view(-1, width),
    )


def _unpack(nexts, chances) -> list[Entry]:
    entries = []
    for tokens, probabilities in zip(nexts.tolist(), chances.tolist()):
        kept = [i for i, t in enumerate(tokens) if t >= 0]
        entries.append((tuple(tokens[i] for i in kept), tuple(probabilities[i] for i in kept)))
    return entries


class RecycledDrafts:
    """A ``RecycledTable`` fed by ``runner``'s passes: ``absorb`` the last pass, then ``chain``."""

    def __init__(self, runner: ModelRunner, table: RecycledTable | None = None, width: int = 1):
        """``width``: next tokens a new table keeps per key (more than one only for trees)."""
        self.runner = runner
        self.table = table if table is not None else RecycledTable(width=width)
        self.absorbed: ScoredRows | None = None  # the last pass learnt from
        self.learnt_rows = 0

    def adopt(self, table: RecycledTable) -> None:
        """Draft from ``table`` (one kept from earlier use) from now on, learning into it."""
        table.width = self.table.width
        self.table = table

    def absorb(self, committed: list[int]) -> None:
        rows = self.runner.last_scored
        if rows is None or rows is self.absorbed:
            return
        self.absorbed = rows
        self.learnt_rows += self.table.absorb(committed, rows)

    def learn(self, committed: list[int], rows: ScoredRows) -> None:
        """Learn from rows of a pass another loop ran (one sequence's rows of a batch pass)."""
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
