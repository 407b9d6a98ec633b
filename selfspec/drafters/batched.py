"""Drafts for a batch of sequences: each sequence's own context n-gram draft, as many rows as pay.

In a batch pass every sequence already has its row (its pending token). A drafted token adds a
row, which the target keeps with the probability measured for context drafts of that n-gram
length. Rows cost little while a pass is memory-bound and about a row's arithmetic once it is
not, so the drafter weighs every candidate token of every sequence together: it takes them most
likely first and stops at the total row count with the most expected tokens per second, from
the pass costs timed on this machine. A sequence's draft is always a prefix of its match.

Layer-skip drafts are not made here: they run the model over one sequence at a time, which a
batch pass exists to avoid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfspec.drafters.adaptive import (
    Acceptance,
    AdaptiveDrafter,
    PassCosts,
    most_tokens_per_second,
)
from selfspec.drafters.base import RoundOutcome

if TYPE_CHECKING:
    from selfspec.drafters.base import Drafter
    from selfspec.drafters.ngram import ContextIndex

MAX_ROWS = 32  # rows of one batch pass, pending tokens and drafts together
_MAX_TOKENS = 8  # drafted tokens per sequence and pass


class BatchDrafter:
    """Plans the draft of every sequence of a batch pass (``propose``) and learns from the outcome
    (``observe``): context-draft acceptance by n-gram length, and pass costs by rows."""

    def __init__(
        self,
        costs: PassCosts | None = None,
        ngram: dict[int, Acceptance] | None = None,
        max_tokens: int = _MAX_TOKENS,
        planned: bool = True,
    ):
        """``costs``, ``ngram``: what a solo drafter measured, shared and kept up to date.
        ``planned=False``: draft every match in full, whatever it costs (tests)."""
        self.costs = costs if costs is not None else PassCosts()
        self.ngram = ngram if ngram is not None else {}
        self.max_tokens, self.planned = max_tokens, planned
        self._lengths: list[int] = []  # n-gram length behind each sequence's draft this pass

    @classmethod
    def following(cls, drafter: Drafter | None) -> BatchDrafter:
        """A batch drafter that starts from what the default drafter ``drafter`` has measured
        (and goes on measuring into the same estimates); a fresh one for any other drafter."""
        if isinstance(drafter, AdaptiveDrafter):
            return cls(drafter.costs, drafter.ngram, min(drafter.max_tokens, _MAX_TOKENS))
        return cls()

    def propose(self, contexts: list[ContextIndex], limits: list[int]) -> list[list[int]]:
        """Draft tokens for each sequence: ``contexts[i]`` indexes its committed tokens (the last
        pending), ``limits[i]`` caps its draft."""
        matches = [
            index.lookup(min(limit, self.max_tokens)) if limit > 0 else None
            for index, limit in zip(contexts, limits)
        ]
        self._lengths = [m.ngram if m is not None else 0 for m in matches]
        candidates = []  # (P(kept), sequence), each sequence's in draft order
        for i, match in enumerate(matches):
            if match is None:
                continue
            acceptance = self.ngram.setdefault(match.ngram, Acceptance(self.max_tokens))
            survive = 1.0
            for j in range(len(match.tokens)):
                survive *= acceptance.rate(j)
                candidates.append((survive, i))
        # Stable: within a sequence P(kept) never rises, so every sequence keeps a prefix.
        candidates.sort(key=lambda c: -c[0])
        taken = self._rows_worth_adding(candidates, len(contexts))
        counts = [0] * len(contexts)
        for _, i in candidates[:taken]:
            counts[i] += 1
        return [m.tokens[:n] if m is not None else [] for m, n in zip(matches, counts)]

    def _rows_worth_adding(self, candidates: list[tuple[float, int]], batch: int) -> int:
        """How many of the candidates (most likely first) to add to a pass of ``batch`` rows."""
        room = max(0, MAX_ROWS - batch)
        if not self.planned or not candidates:
            return min(len(candidates), room)
        if self.costs.verify_cost(batch) is None:
            return 0  # time a pass first
        gains = [p for p, _ in candidates[:room]]
        return most_tokens_per_second(gains, lambda n: self.costs.verify_cost(batch + n), batch)

    def observe(self, drafts: list[list[int]], kept: list[int], seconds: float | None) -> None:
        """The pass's outcome: each sequence's draft and how many of it the target kept, and the
        pass's time (None: the pass held other rows too, prompt chunks, so its time says nothing
        about these rows' cost)."""
        rows = sum(len(d) + 1 for d in drafts)
        if seconds is not None and rows:
            self.costs.record(RoundOutcome(rows - 1, 0, verify_seconds=seconds), 0)
        for draft, m, n in zip(drafts, kept, self._lengths):
            if draft:
                self.ngram[n].record(len(draft), m)
