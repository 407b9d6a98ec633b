"""Online adaptation rules shared by the drafters and by the search's replay of the decode loop.

``AdaptiveThreshold``: a drafter stops drafting when its top probability falls below a
threshold; after each round the threshold moves one step towards the value that gives a
target acceptance (Draft & Verify's rule): up when the running acceptance is below target,
down when above. The search replays decoding with this very object, so its predictions
follow the real loop step for step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TARGET_ACCEPTANCE = 0.8  # the acceptance the adaptive threshold steers towards
_EMA_KEEP = 0.7  # weight of the running acceptance against the latest round
_STEP = 0.05
_CEILING = 0.95


@dataclass
class AdaptiveThreshold:
    """The confidence threshold of one generation, and how it adapts round by round."""

    value: float = 0.5
    adaptive: bool = True
    target: float = TARGET_ACCEPTANCE
    acceptance: float = field(init=False)  # running (exponentially weighted) acceptance

    def __post_init__(self) -> None:
        self.acceptance = self.target

    def update(self, drafted: int, accepted: int) -> None:
        """Record one round's outcome: ``accepted`` of ``drafted`` tokens kept (no-op if none
        drafted)."""
        if not self.adaptive or not drafted:
            return
        self.acceptance = _EMA_KEEP * self.acceptance + (1 - _EMA_KEEP) * (accepted / drafted)
        step = _STEP if self.acceptance < self.target else -_STEP
        self.value = min(_CEILING, max(0.0, self.value + step))


class SpeedGuard:
    """Pauses drafting while speculation is measurably slower than plain decoding, and tries again.

    Slower: over the last ``window`` rounds that drafted, the tokens they emitted times a plain
    step's cost fall short of their draft and verify seconds. A plain step's cost is taken from
    plain rounds (a verify pass over one row) once there are some; before that, from the verify
    passes themselves, which cost at least a plain step, so the guard errs towards drafting.
    A pause lasts ``first_pause`` plain rounds, then drafting resumes with a fresh window; each
    further pause is twice as long (at most ``max_pause``). Never permanent.
    """

    def __init__(
        self, enabled: bool = True, window: int = 8, first_pause: int = 16, max_pause: int = 256
    ):
        self.enabled, self.window = enabled, window
        self.first_pause, self.max_pause = first_pause, max_pause
        # (tokens, draft s, verify s) of drafting rounds
        self.rounds: list[tuple[int, float, float]] = []
        self.plain_step: float | None = None  # EMA of one-row verify passes
        self.pause_left = 0
        self.pauses = 0

    def paused(self) -> bool:
        return self.pause_left > 0

    def record(
        self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        if drafted == 0:
            self._plain_round(verify_seconds)
            return
        self.rounds.append((accepted + 1, draft_seconds, verify_seconds))
        del self.rounds[: -self.window]
        if self.enabled and len(self.rounds) == self.window and self._slower():
            self.pause_left = min(self.max_pause, self.first_pause * 2**self.pauses)
            self.pauses += 1
            self.rounds = []

    def _plain_round(self, verify_seconds: float) -> None:
        if verify_seconds > 0:
            keep = 0.8 if self.plain_step is not None else 0.0
            self.plain_step = keep * (self.plain_step or 0.0) + (1 - keep) * verify_seconds
        if self.pause_left:
            self.pause_left -= 1

    def _slower(self) -> bool:
        tokens = sum(r[0] for r in self.rounds)
        spent = sum(r[1] + r[2] for r in self.rounds)
        verify_mean = sum(r[2] for r in self.rounds) / len(self.rounds)
        plain = min(self.plain_step, verify_mean) if self.plain_step is not None else verify_mean
        return tokens * plain < spent
