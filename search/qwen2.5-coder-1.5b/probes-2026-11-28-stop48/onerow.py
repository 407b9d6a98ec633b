"""Median ms of cached passes over 1 and 4 rows after 200 tokens (stop 48).

python onerow.py SPEED REPEATS
"""

import statistics
import sys
import time

import torch

from selfspec.engine import Engine
from selfspec.profile import cached_prefix

speed, repeats = sys.argv[1], int(sys.argv[2])
eng = Engine.load("qwen2.5-coder-1.5b", device="cpu", dtype=torch.float32, speed=speed)
r = eng.runner
_, new = cached_prefix(r, 200, 8)
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
