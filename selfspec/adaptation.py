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
        """Record one round's outcome: ``accepted`` of ``drafted`` tokens kept (no-op if none drafted)."""
        if not self.adaptive or not drafted:
            return
        self.acceptance = _EMA_KEEP * self.acceptance + (1 - _EMA_KEEP) * (accepted / drafted)
        step = _STEP if self.acceptance < self.target else -_STEP
        self.value = min(_CEILING, max(0.0, self.value + step))
