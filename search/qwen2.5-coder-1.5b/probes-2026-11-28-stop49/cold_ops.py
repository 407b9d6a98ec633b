"""A few small torch calls right after a verify pass (cold) and again at once (warm), ms.

python cold_ops.py > cold_ops.log
"""

import statistics
import time

import torch

from selfspec.engine import Engine

engine = Engine.load("qwen2.5-coder-1.5b")
runner = engine.runner
ad = runner.adapter
gen = torch.Generator().manual_seed(0)
prefix = torch.randint(100, 30000, (200,), generator=gen)
new = torch.randint(100, 30000, (8,), generator=gen)
runner.reset(220)
runner.forward(prefix, 0, last_logits_only=True)
h = torch.randn(1, 1536)


def ms(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


cold, hot, emb_c, emb_h = [], [], [], []
for r in range(20):
    runner.forward(new[:1], 200)
    cold.append(ms(lambda: ad.final_norm(h)))
    hot.append(ms(lambda: ad.final_norm(h)))
    runner.forward(new[:1], 200)
    ids = torch.tensor([1000 + r])
    emb_c.append(ms(lambda ids=ids: ad.embed(ids)))
    emb_h.append(ms(lambda ids=ids: ad.embed(ids)))
print(f"final_norm cold {statistics.median(cold):.3f} hot {statistics.median(hot):.3f}")
print(f"embed cold {statistics.median(emb_c):.3f} hot {statistics.median(emb_h):.3f}")
