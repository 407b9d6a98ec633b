"""What verify passes cost, as the drafters measure them while they decode.

``PassCosts``: solo decoding's passes by rows (and layer-skip draft steps), from its own timings.
``RowCostFit``: a line of a batch pass's seconds against its rows, over the batch's latest passes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from selfspec.drafters.base import RoundOutcome

_ROW_COST_PRIOR = 0.15  # a verify row's cost as a share of a plain step, before rows are timed
_COST_WINDOW = 9  # timed passes a cost estimate is the median of
_FIT_PASSES = 96  # batch passes the row-cost fit remembers
_FIT_MIN_PASSES = 16


class RecentMedian:
    """The median of the last few samples: a pass's time on a busy machine has a long right tail
    (another process, a page fault), and a mean, even a moving one, follows each spike."""

    def __init__(self, size: int = _COST_WINDOW):
        self.samples: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self.samples.append(value)

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


class PassCosts:
    """What verify passes and layer-skip draft steps cost in this generation's stream.

    A plain step (a verify pass over one row) is timed often; longer passes and draft steps are
    timed only when drafted. A VM's speed drifts by up to 2x within minutes, so those are kept as
    multiples of the plain step timed around them: a stale multiple stays true when the machine
    slows down or speeds up, a stale time would not. Each is the median of its last few samples.
    """

    def __init__(self) -> None:
        self._plain_times = RecentMedian()  # seconds of verify passes over one row
        self._ratios: dict[int, RecentMedian] = {}  # rows > 1: seconds / a plain step's
        self._draft_ratios = RecentMedian()  # a layer-skip draft step / a plain step
        # Derived from those by record, which alone changes them:
        self.plain: float | None = None  # seconds of a plain step
        self.draft_step: float | None = None  # seconds of a layer-skip draft step
        self._known: dict[int, float] = {1: 1.0}  # rows -> plain steps, non-decreasing
        self._estimates: dict[int, float] = {}  # verify_cost answers since the last record

    def record(self, outcome: RoundOutcome, steps: int) -> None:
        if outcome.verify_seconds <= 0:
            return
        self._estimates.clear()
        if outcome.rows == 1:
            self._plain_times.add(outcome.verify_seconds)
        else:
            # Before a plain step is timed, the pass itself stands in for one.
            plain = self.plain or outcome.verify_seconds
            ratio = outcome.verify_seconds / plain
            self._ratios.setdefault(outcome.rows, RecentMedian()).add(ratio)
            self._known = self._monotone()
            if steps and outcome.draft_seconds > 0:
                self._draft_ratios.add(outcome.draft_seconds / steps / plain)
        self.plain = self._plain_times.value
        draft_ratio = self._draft_ratios.value
        if draft_ratio is not None and self.plain is not None:
            self.draft_step = draft_ratio * self.plain

    def verify_cost(self, rows: int) -> float | None:
        """Seconds of a verify pass over ``rows`` rows (None before a plain step is timed)."""
        if self.plain is None:
            return None
        if rows not in self._estimates:
            self._estimates[rows] = self.plain * self._ratio(rows)
        return self._estimates[rows]

    def _ratio(self, rows: int) -> float:
        """Interpolated between timed row counts; past them, the slope of the last two (or a
        prior)."""
        known = self._known
        if rows in known:
            return known[rows]
        below = max(r for r in known if r < rows)
        above = [r for r in known if r > rows]
        if above:
            hi = min(above)
            w = (rows - below) / (hi - below)
            return (1 - w) * known[below] + w * known[hi]
        slope = _ROW_COST_PRIOR
        if len(known) >= 2:
            a, b = sorted(known)[-2:]
            slope = max(slope * 0.5, (known[b] - known[a]) / (b - a))
        return known[below] + slope * (rows - below)

    def _monotone(self) -> dict[int, float]:
        """The timed multiples made non-decreasing in rows (pooling neighbours that disagree,
        weighted by their samples: isotonic regression), a plain step fixed at 1: a noisy timing
        must not make a longer draft look cheaper, nor a rarely timed one make all longer ones
        look dearer."""
        blocks: list[list] = [[1.0, math.inf, [1]]]  # value, weight, row counts pooled
        for rows, median in sorted(self._ratios.items()):
            blocks.append([median.value, len(median.samples), [rows]])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (v1, w1, r1), (v2, w2, r2) = blocks.pop(-2), blocks.pop()
                value = v1 if math.isinf(w1) else (v1 * w1 + v2 * w2) / (w1 + w2)
                blocks.append([value, w1 + w2, r1 + r2])
        return {rows: value for value, _, pooled in blocks for rows in pooled}


class RowCostFit:
    """Seconds of a batch pass as ``a + b * rows``, fitted over the batch's latest passes
    (prompt chunks included, their rows counted as the share of a scored row they cost): each
    row count's median time, weighted by how often it was timed. Past a few rows a pass costs
    about its rows' arithmetic, so one line holds from the few rows of decoding to the many of
    a prompt chunk; a multiple per row count, timed apart, would be noisy where rarely timed.
    Unready (None) until the passes span a few row counts and give a line that rises from a
    positive cost (a fixed cost per pass and a cost per row): anything else is noise."""

    def __init__(
        self, passes: int = _FIT_PASSES, min_passes: int = _FIT_MIN_PASSES, min_spread: float = 3
    ) -> None:
        self.passes: deque[tuple[float, float]] = deque(maxlen=passes)
        self.min_passes, self.min_spread = min_passes, min_spread  # before a line is ready
        self._line: tuple[float, float] | None = None

    def record(self, rows: float, seconds: float) -> None:
        self.passes.append((rows, seconds))
        self._line = self._fit()

    def cost(self, rows: float) -> float | None:
        if self._line is None:
            return None
        a, b = self._line
        return a + b * rows

    def _fit(self) -> tuple[float, float] | None:
        by_rows: dict[float, list[float]] = {}
        for rows, seconds in self.passes:
            by_rows.setdefault(rows, []).append(seconds)
        if len(self.passes) < self.min_passes or max(by_rows) - min(by_rows) < self.min_spread:
            return None
        points = [(r, statistics.median(t), len(t)) for r, t in by_rows.items()]
        weight = sum(w for _, _, w in points)
        mean_r = sum(r * w for r, _, w in points) / weight
        mean_t = sum(t * w for _, t, w in points) / weight
        spread = sum(w * (r - mean_r) ** 2 for r, _, w in points)
        slope = sum(w * (r - mean_r) * (t - mean_t) for r, t, w in points) / spread
        intercept = mean_t - slope * mean_r
        return (intercept, slope) if slope > 0 and intercept > 0 else None
