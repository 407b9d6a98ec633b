"""What a verify pass over 1..6 rows costs after a cached prefix of 200, 1,000 and 2,000 tokens.

    python rows_by_context.py

Medians of 15 rounds (the row counts take turns within a round), in ms and over the one-row pass
after the same prefix.
"""

from __future__ import annotations

import statistics
from functools import partial

import torch

from selfspec.engine import Engine
from selfspec.profile import _interleaved_ms


def main() -> None:
    runner = Engine.load("qwen2.5-coder-1.5b").runner
    gen = torch.Generator().manual_seed(0)
    for prefix in (200, 1000, 2000):
        ids = torch.randint(100, 30000, (prefix + 8,), generator=gen)
        runner.reset(prefix + 9)
        runner.forward(ids[:prefix], 0, last_logits_only=True)
        passes = {n: partial(runner.forward, ids[prefix : prefix + n], prefix) for n in range(1, 7)}
        times = _interleaved_ms(passes, 15)  # selfspec profile's timing: turns, after a warm-up
        one = statistics.median(times[1])
        cells = [
            f"{n}: {statistics.median(t):.1f} ({statistics.median(t) / one:.2f})"
            for n, t in times.items()
        ]
        print(prefix, "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
