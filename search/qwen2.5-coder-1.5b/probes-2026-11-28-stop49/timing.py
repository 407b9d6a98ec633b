"""Calls timed by wrapping them in place: each wrapped call's seconds add up under a key in
``seconds`` and count in ``calls`` (round_parts.py, draft_cost.py)."""

import collections
import time

seconds = collections.defaultdict(float)
calls = collections.Counter()


def wrap(obj, name: str, key: str) -> None:
    """``obj.name`` replaced by a wrapper that times each call under ``key``."""
    f = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        seconds[key] += time.perf_counter() - t
        calls[key] += 1
        return r

    setattr(obj, name, timed)


def clear() -> None:
    seconds.clear()
    calls.clear()
