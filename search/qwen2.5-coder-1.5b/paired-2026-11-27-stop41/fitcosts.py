"""Pass costs re-timed from a line over the stream's latest 48 passes (stop 41's trial; not
landed): ``RowCostFit`` over every solo pass, ready after 12 passes spanning 2 row counts, gives
the plain step and every verify pass's cost; ``PassCosts``' multiples stand in until then."""

from selfspec.drafters.costs import PassCosts, RowCostFit


class FitCosts(PassCosts):
    def __init__(self):
        super().__init__()
        self.fit = RowCostFit(passes=48, min_passes=12, min_spread=2)

    def record(self, outcome, steps):
        if outcome.verify_seconds > 0:
            self.fit.record(outcome.rows, outcome.verify_seconds)
        super().record(outcome, steps)
        plain = self.fit.cost(1)
        if plain is not None:
            self.plain = plain
            self._estimates.clear()

    def verify_cost(self, rows):
        fitted = self.fit.cost(rows)
        return fitted if fitted is not None else super().verify_cost(rows)
