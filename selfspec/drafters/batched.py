"""Drafts for a batch of sequences: each sequence's own context n-gram draft, or its draft heads'
guesses, as many rows as pay.

In a batch pass every sequence already has its row (its pending token). A drafted token adds a
row, which the target keeps with the probability measured for context drafts of that n-gram
length, or for a head guess the heads' own confidence scaled by how far it has come true. Rows
cost little while a pass is memory-bound and about a row's arithmetic once it is not, so the
drafter weighs every candidate token of every sequence together: it takes them most likely first
and stops at the total row count with the most expected tokens per second, from the batch's own
passes (``RowCostFit``; the solo drafter's timings until enough are in). A sequence's draft is
always a prefix of its match or of its heads' chain.

Head guesses come from the final hidden state of the row that made each sequence's pending token
(the pass before), all sequences' chains computed together (``HeadDrafter.guess_many``): a step
costs about what one sequence's does. Layer-skip drafts are not made here: they run the model over
one sequence at a time, which a batch pass exists to avoid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from selfspec.drafters.adaptive import (
    Acceptance,
    AdaptiveDrafter,
    Calibration,
    most_tokens_per_second,
)
from selfspec.drafters.base import RoundOutcome
from selfspec.drafters.pass_costs import PassCosts, RowCostFit

if TYPE_CHECKING:
    from selfspec.drafters.base import Drafter
    from selfspec.drafters.heads import HeadDrafter
    from selfspec.drafters.ngram import ContextIndex
    from selfspec.drafters.recycled import RecycledDrafts

MAX_ROWS = 32  # rows of one batch pass, pending tokens and drafts together
_MAX_TOKENS = 8  # drafted tokens per sequence and pass


class BatchDrafter:
    """Plans the draft of every sequence of a batch pass (``propose``) and learns from the outcome
    (``observe``): context-draft acceptance by n-gram length, how far head guesses' chances come
    true, and pass costs by rows."""

    def __init__(
        self,
        costs: PassCosts | None = None,
        ngram: dict[int, Acceptance] | None = None,
        max_tokens: int = _MAX_TOKENS,
        planned: bool = True,
        heads: HeadDrafter | None = None,
        calibration: Calibration | None = None,
        recycled: RecycledDrafts | None = None,
    ):
        """``costs``, ``ngram``, ``calibration``: what a solo drafter measured, shared and kept up
        to date. ``heads``: draft heads for sequences whose text offers no match (None: none).
        ``recycled``: the solo drafter's recycled drafts, which learn from the batch's passes
        (they draft only alone: a batch's rows are dearer).
        ``planned=False``: draft every match and guess in full, whatever it costs (tests)."""
        self.costs = costs if costs is not None else PassCosts()
        self.ngram = ngram if ngram is not None else {}
        self.max_tokens, self.planned = max_tokens, planned
        self.heads, self.recycled = heads, recycled
        self.calibration = calibration if calibration is not None else Calibration()
        self.fit = RowCostFit()  # this batch's own passes
        self.sources: list[str] = []  # "ngram" or "heads": where each sequence's draft came from
        self._lengths: list[int] = []  # n-gram length behind each sequence's draft this pass
        self._chances: list[list[float]] = []  # each head draft's chances (its tokens')

    @classmethod
    def following(cls, drafter: Drafter | None) -> BatchDrafter:
        """A batch drafter that starts from what the default drafter ``drafter`` has measured
        (and goes on measuring into the same estimates), with its draft heads; a fresh one for
        any other drafter."""
        if isinstance(drafter, AdaptiveDrafter):
            return cls(
                drafter.costs,
                drafter.ngram,
                min(drafter.max_tokens, _MAX_TOKENS),
                heads=drafter.heads,
                calibration=drafter.head_calibration,
                recycled=drafter.recycled,
            )
        return cls()

    def propose(
        self,
        contexts: list[ContextIndex],
        limits: list[int],
        hidden: list[torch.Tensor | None] | None = None,
    ) -> list[list[int]]:
        """Draft tokens for each sequence: ``contexts[i]`` indexes its committed tokens (the last
        pending), ``limits[i]`` caps its draft, ``hidden[i]`` is the final hidden state [1, hidden]
        of the row that made its pending token (None: unknown, no head guesses)."""
        matches = [
            index.lookup(min(limit, self.max_tokens)) if limit > 0 else None
            for index, limit in zip(contexts, limits)
        ]
        self._lengths = [m.ngram if m is not None else 0 for m in matches]
        proposals = [m.tokens if m is not None else [] for m in matches]
        candidates = []  # (P(kept), sequence), each sequence's in draft order
        for i, match in enumerate(matches):
            if match is None:
                continue
            acceptance = self.ngram.setdefault(match.ngram, Acceptance(self.max_tokens))
            survive = 1.0
            for j in range(len(match.tokens)):
                survive *= acceptance.rate(j)
                candidates.append((survive, i))
        chances: list[list[float]] = [[] for _ in contexts]  # each head draft's chances
        scale = self.calibration.value
        for i, chain in self._head_guesses(contexts, limits, hidden, matches).items():
            proposals[i] = [token for token, _ in chain]
            chances[i] = [chance for _, chance in chain]
            candidates += [(scale * chance, i) for chance in chances[i]]
        # Stable: within a sequence P(kept) never rises, so every sequence keeps a prefix.
        candidates.sort(key=lambda c: -c[0])
        taken = self._rows_worth_adding(candidates, len(contexts))
        counts = [0] * len(contexts)
        for _, i in candidates[:taken]:
            counts[i] += 1
        self.sources = ["heads" if chances[i] else "ngram" for i in range(len(contexts))]
        self._chances = [c[:n] for c, n in zip(chances, counts)]
        return [p[:n] for p, n in zip(proposals, counts)]

    def _head_guesses(
        self,
        contexts: list[ContextIndex],
        limits: list[int],
        hidden: list[torch.Tensor | None] | None,
        matches: list,
    ) -> dict[int, list[tuple[int, float]]]:
        """The heads' chains of (token, chance) for the sequences without a match, by sequence
        (none where even a certain guess could not pay)."""
        wanting = [
            i
            for i, (match, limit) in enumerate(zip(matches, limits))
            if match is None and limit > 0 and hidden is not None and hidden[i] is not None
        ]
        scale, going_on = self.calibration.value, self._least_paying_chance(len(contexts))
        if self.heads is None or not wanting or going_on >= scale:
            return {}  # no head, or even a certain guess would not pay
        chains = self.heads.guess_many(
            torch.cat([hidden[i] for i in wanting]),
            [contexts[i].tokens[-1] for i in wanting],
            min(self.max_tokens, max(limits[i] for i in wanting)),
            going_on / scale,
        )
        return {i: chain[: limits[i]] for i, chain in zip(wanting, chains)}

    def _least_paying_chance(self, batch: int) -> float:
        """The chance below which one more row cannot pay in a pass of ``batch`` rows (each row
        emits a token): the tokens it adds must outgrow the pass's cost. 0 when not planned."""
        if not self.planned:
            return 0.0
        base, more = self._pass_cost(batch), self._pass_cost(batch + 1)
        if base is None or more is None:
            return 2.0  # time a pass first
        return batch * (more / base - 1.0)

    def _rows_worth_adding(self, candidates: list[tuple[float, int]], batch: int) -> int:
        """How many of the candidates (most likely first) to add to a pass of ``batch`` rows."""
        room = max(0, MAX_ROWS - batch)
        if not self.planned or not candidates:
            return min(len(candidates), room)
        if self._pass_cost(batch) is None:
            return 0  # time a pass first
        gains = [p for p, _ in candidates[:room]]
        return most_tokens_per_second(gains, lambda n: self._pass_cost(batch + n), batch)

    def _pass_cost(self, rows: int) -> float | None:
        """Seconds of a batch pass over ``rows`` rows: the fit over this batch's passes, or
        before it is ready the pass costs timed alone."""
        fitted = self.fit.cost(rows)
        return fitted if fitted is not None else self.costs.verify_cost(rows)

    def observe(
        self,
        drafts: list[list[int]],
        kept: list[int],
        seconds: float | None,
        prompt_rows: float = 0.0,
    ) -> None:
        """The pass's outcome: each sequence's draft and how many of it the target kept, the
        pass's time (None: untimed) and the prompt rows it read beside them (in scored rows'
        worth: a prompt row skips the output head)."""
        rows = sum(len(d) + 1 for d in drafts)
        if seconds is not None and rows + prompt_rows:
            self.fit.record(rows + prompt_rows, seconds)
        if seconds is not None and rows and not prompt_rows:  # a pass solo decoding can meet
            self.costs.record(RoundOutcome(rows - 1, 0, verify_seconds=seconds), 0)
        for draft, m, n, chances in zip(drafts, kept, self._lengths, self._chances):
            if draft and chances:
                self.calibration.record(sum(chances), m)
            elif draft:
                self.ngram[n].record(len(draft), m)
