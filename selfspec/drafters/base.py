"""The drafter interface: what the decode loop asks of anything that proposes tokens.

The loop calls ``begin`` once per generation, ``propose`` once per round and ``observe`` with the
round's outcome. Adaptation lives in the drafter, never in the loop: the confidence threshold
(``AdaptiveThreshold``), what the drafter learns from the stream it serves, and the guard that
pauses drafting while it is measurably slower than plain decoding (and tries again later).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.drafters.adaptation import AdaptiveThreshold, SpeedGuard
from selfspec.runtime.sampling import argmax_rows, sample

if TYPE_CHECKING:
    from selfspec.runtime.runner import Resume
    from selfspec.runtime.sampling import Sampling


@dataclass
class DraftRequest:
    """What the loop tells a drafter each round."""

    # every token so far, prompt included; the last is not yet in the target cache
    committed: list[int]
    max_tokens: int
    sampling: Sampling
    generator: torch.Generator | None
    # how many tokens a tree draft may hold (0: the loop verifies chains only): trees are verified
    # on runners whose rows see only their ancestors (``ModelRunner.trees``); a tree's tokens are
    # proposed with certainty (``Draft.probs`` None), greedy or sampled
    tree_nodes: int = 0


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # [len(tokens), vocab]: q each token was drawn from (sampling only); None: the tokens were
    # proposed with certainty (copied from the context or a table: q = 1 on each)
    probs: torch.Tensor | None = None
    # hidden states the verify pass can start from (self-drafting only)
    resume: Resume | None = None
    source: str = ""  # which drafter made it (stats)
    # a tree: token i follows token parents[i] (-1: the pending token), parents before children;
    # None: a chain (token i follows token i - 1)
    parents: list[int] | None = None


@dataclass
class DraftSettings:
    """Per generation: the confidence threshold to start from, and whether the guard may pause
    drafting."""

    threshold: AdaptiveThreshold = field(default_factory=AdaptiveThreshold)
    fallback: bool = True


@dataclass
class RoundOutcome:
    """How a round went: what was drafted and kept, and what the round cost."""

    drafted: int
    accepted: int
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    source: str = ""

    @property
    def rows(self) -> int:
        return self.drafted + 1  # the verify pass scores the pending token and the drafts


class Drafter:
    """Interface. Subclasses implement ``draft`` (and ``learn`` if they learn from outcomes).

    ``propose`` may return an empty draft: the round is then a plain decoding step. It does so on
    its own while the guard has paused drafting (speculation measured slower than plain decoding).
    """

    name = "drafter"
    guard_window = 8  # drafting rounds the speed guard judges at once

    def __init__(self) -> None:
        self.settings = DraftSettings()
        self.guard = SpeedGuard(window=self.guard_window)

    @property
    def threshold(self) -> AdaptiveThreshold:
        return self.settings.threshold

    def begin(self, prompt_ids: list[int], max_len: int, settings: DraftSettings) -> None:
        self.settings = settings
        self.guard = SpeedGuard(enabled=settings.fallback, window=self.guard_window)

    def propose(self, request: DraftRequest) -> Draft:
        if self.guard.paused():
            return Draft()
        return self.draft(request)

    def observe(self, outcome: RoundOutcome) -> None:
        self.threshold.update(outcome.drafted, outcome.accepted)
        self.guard.record(
            outcome.drafted, outcome.accepted, outcome.draft_seconds, outcome.verify_seconds
        )
        self.learn(outcome)

    def draft(self, request: DraftRequest) -> Draft:
        raise NotImplementedError

    def learn(self, outcome: RoundOutcome) -> None:
        pass

    def describe(self) -> str:
        return self.name

    def policy_defaults(self) -> dict:
        """DecodeConfig fields this drafter brings (a plan's draft policy); explicit settings
        win."""
        return {}


def tree_draft(tokens: list[int], parents: list[int] | None, source: str) -> Draft:
    """A draft of ``tokens`` proposed with certainty: a tree where ``parents`` branch, else a
    chain (a tree that does not branch is verified as the chain it is)."""
    if parents is None or parents == list(range(-1, len(tokens) - 1)):
        return Draft(tokens, source=source)
    return Draft(tokens, source=source, parents=parents)


def point_masses(tokens: list[int], vocab: int) -> torch.Tensor:
    """q for tokens proposed with certainty (copied, not sampled): one-hot rows [len, vocab]."""
    probs = torch.zeros(len(tokens), vocab)
    probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return probs


def draft_loop(step, first_token: int, request: DraftRequest, threshold: float):
    """Autoregressive drafting: ``step(token, offset)`` returns (logits [vocab], extra).

    Stops at max_tokens, or before proposing a token whose drafter confidence is below threshold.
    Returns (tokens, probs list, extras list); extras has one entry per step run.
    """
    tokens, probs, extras = [], [], []
    token = first_token
    for offset in range(request.max_tokens):
        logits, extra = step(token, offset)
        extras.append(extra)
        q = request.sampling.probs(logits)
        if float(q.max()) < threshold:
            break
        if request.sampling.greedy:
            token = argmax_rows(logits)[0]
        else:
            token = sample(q, request.generator)
        tokens.append(token)
        probs.append(q)
    return tokens, probs, extras
