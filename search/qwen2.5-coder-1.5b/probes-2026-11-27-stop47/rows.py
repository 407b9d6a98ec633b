"""Passes over 1..8 rows after a 300-token prefix, one process, sizes alternated (stop 47).

    python rows.py gguf        # or gguf-q8

Prints the median of 7 passes per size in ms and, in parentheses, over the one-row pass.
``selfspec profile`` times 1 / 2 / 4 / 8 / 16 rows; verify passes hold 1-7.
"""

import statistics
import sys
import time

import torch

from selfspec.engine import Engine

speed = sys.argv[1] if len(sys.argv) > 1 else "gguf"
runner = Engine.load("qwen2.5-coder-1.5b", speed=speed).runner
generator = torch.Generator().manual_seed(0)
prefix = torch.randint(100, 30000, (300,), generator=generator)
new = torch.randint(100, 30000, (16,), generator=generator)
runner.reset(340)
runner.forward(prefix, 0, last_logits_only=True)
sizes = range(1, 9)
times = {n: [] for n in sizes}
for _ in range(7):
    for n in sizes:
        began = time.perf_counter()
        runner.forward(new[:n], 300)
        times[n].append((time.perf_counter() - began) * 1e3)
one = statistics.median(times[1])
medians = {n: statistics.median(t) for n, t in times.items()}
print(speed, " ".join(f"{n}:{ms:.1f}({ms / one:.2f})" for n, ms in medians.items()))
