"""A head guess's parts timed back to back (warm: weights and code in the caches), ms, medians of
50: head 1's first product (3,072 -> 1,536), its second (1,536 -> 1,536) and the output rows of
the draft's 8,192 ids, each in the arithmetic drafting uses.

    python warm_products.py > warm_products.log
"""

import statistics
import time

import torch

from selfspec.drafters.heads import HeadDrafter
from selfspec.engine import Engine

engine = Engine.load("qwen2.5-coder-1.5b")
runner = engine.runner
drafter = HeadDrafter(runner, engine.resolve_heads(True))
x, y, state = torch.randn(1, 3072), torch.randn(1, 1536), torch.randn(1, 1536)


def ms(f, n=50):
    times = []
    for _ in range(n):
        began = time.perf_counter()
        f()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


first = ms(lambda: drafter.products[0](x))
second = ms(lambda: drafter.down_products[0](y))
rows = ms(lambda: runner.adapter.normed_logits(state[None], drafter.vocab))
print(f"first product {first:.3f}, second product {second:.3f}, output rows {rows:.3f}")
print(f"a guess's products and output rows, warm: {first + second + rows:.3f} ms")
