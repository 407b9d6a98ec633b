"""Replaying greedy speculation along a known continuation: what a plan would have done, and cost.

The decode loop's rules (draft while confident, up to max_draft tokens and the room left; accept
the longest agreeing prefix plus the target's own token; adapt the threshold) applied to a draft's
per-position agreement and confidence, priced with the measured cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from selfspec.drafters.adaptation import TARGET_ACCEPTANCE, AdaptiveThreshold


@dataclass
class SimResult:
    """Outcome of replaying greedy speculation along a known continuation."""

    tokens: int = 0  # tokens emitted by target passes (the prefill's token excluded)
    rounds: int = 0  # target passes
    drafted: int = 0
    accepted: int = 0
    draft_steps: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0  # the same tokens by plain decoding

    def __add__(self, other: SimResult) -> SimResult:
        return SimResult(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 0.0


def simulate(
    agree: Sequence[bool],
    confidence: Sequence[float],
    *,
    max_draft: int,
    threshold: float,
    adaptive: bool,
    draft_step_cost: float,
    verify_cost: Callable[[int, int], float],
    plain_step_cost: float,
    target_acceptance: float = TARGET_ACCEPTANCE,
) -> SimResult:
    """Replay selfspec's greedy decode loop along a continuation c_0..c_n of the target.

    ``agree[i]``: the draft's argmax after c_0..c_i equals c_{i+1}; ``confidence[i]``: its top
    probability there (i = 0..n-1). c_0 comes from prefill, so n tokens are left to emit. Each
    round starting with pending token c_j drafts while confidence >= threshold (a step that
    falls below it is still paid) and up to min(max_draft, room - 1) tokens; the longest agreeing
    prefix is accepted, plus the target's own token. ``verify_cost(rows, tail_rows)`` is the
    verify pass over rows = drafted + 1 tokens, of which ``tail_rows`` had no draft step.
    The threshold adapts with the drafters' own rule
    (selfspec.drafters.adaptation.AdaptiveThreshold).
    """
    n = len(agree)
    if len(confidence) != n:
        raise ValueError("agree and confidence must have the same length")
    result = SimResult()
    total = n + 1  # continuation length, c_0 included
    generated = 1
    j = 0  # index of the pending token
    thr = AdaptiveThreshold(threshold, adaptive, target_acceptance)
    while generated < total:
        room = total - generated
        limit = min(max_draft, room - 1) if room > 1 else 0
        drafted = steps = 0
        for offset in range(limit):
            steps += 1
            if confidence[j + offset] < thr.value:
                break
            drafted += 1
        accepted = 0
        while accepted < drafted and agree[j + accepted]:
            accepted += 1
        rows = drafted + 1
        tail = rows - min(steps, rows)
        result.seconds += steps * draft_step_cost + verify_cost(rows, tail)
        result.rounds += 1
        result.drafted += drafted
        result.accepted += accepted
        result.draft_steps += steps
        result.tokens += accepted + 1
        generated += accepted + 1
        j += accepted + 1
        thr.update(drafted, accepted)
    result.plain_seconds = result.tokens * plain_step_cost
    return result
