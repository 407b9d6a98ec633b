"""A time budget for a training run: a deadline for the whole run, and one for each stage within
what is left of it."""

from __future__ import annotations

import time


class Budget:
    """The minutes a run may take (``None``: no limit); each stage gets a deadline within it."""

    def __init__(self, minutes: float | None):
        self.end = None if minutes is None else time.monotonic() + minutes * 60

    def until(self, share: float) -> float | None:
        """A stage's deadline: ``share`` of the time left from now."""
        return None if self.end is None else time.monotonic() + share * self.left()

    def left(self) -> float:
        return float("inf") if self.end is None else max(0.0, self.end - time.monotonic())

    def show(self, bar) -> None:
        if self.end is not None:
            minutes, seconds = divmod(int(self.left()), 60)
            bar.set_postfix_str(f"budget left {minutes}:{seconds:02d}", refresh=False)


def past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
