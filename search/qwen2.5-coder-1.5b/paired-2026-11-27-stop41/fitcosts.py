from selfspec.drafters.costs import PassCosts, RowCostFit


class FitCosts(PassCosts):
    def __init__(self):
        super().__init__()
        self.fit = RowCostFit()
        self.fit.passes = __import__("collections").deque(maxlen=48)

    def record(self, outcome, steps):
        if outcome.verify_seconds > 0:
            self.fit.passes.append((outcome.rows, outcome.verify_seconds))
            line = self._line48()
            self.fit._line = line
        super().record(outcome, steps)
        f = self.fit.cost(1)
        if f is not None:
            self.plain = f
            self._estimates.clear()

    def _line48(self):
        import statistics

        by = {}
        for r, t in self.fit.passes:
            by.setdefault(r, []).append(t)
        if len(self.fit.passes) < 12 or max(by) - min(by) < 2:
            return None
        pts = [(r, statistics.median(t), len(t)) for r, t in by.items()]
        w = sum(p[2] for p in pts)
        mr = sum(r * n for r, _, n in pts) / w
        mt = sum(t * n for _, t, n in pts) / w
        sp = sum(n * (r - mr) ** 2 for r, _, n in pts)
        b = sum(n * (r - mr) * (t - mt) for r, t, n in pts) / sp
        a = mt - b * mr
        return (a, b) if b > 0 and a > 0 else None

    def verify_cost(self, rows):
        f = self.fit.cost(rows)
        return f if f is not None else super().verify_cost(rows)
