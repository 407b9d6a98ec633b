"""Median ms of cached passes over 1 and 4 rows after 200 tokens (stop 48).

python onerow.py SPEED REPEATS
"""

import statistics
import sys
import time

import torch

from selfspec.engine import Engine

speed, repeats = sys.argv[1], int(sys.argv[2])
eng = Engine.load("qwen2.5-coder-1.5b", device="cpu", dtype=torch.float32, speed=speed)
r = eng.runner
g = torch.Generator().manual_seed(0)
pre = torch.randint(100, 30000, (200,), generator=g)
new = torch.randint(100, 30000, (8,), generator=g)
r.reset(220)
r.forward(pre, 0, last_logits_only=True)
out = {}
for n in (1, 4):
    r.forward(new[:n], 200)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        r.forward(new[:n], 200)
        ts.append((time.perf_counter() - t) * 1000)
    out[n] = statistics.median(ts)
print(speed, " ".join(f"{n}:{v:.1f}" for n, v in out.items()))
