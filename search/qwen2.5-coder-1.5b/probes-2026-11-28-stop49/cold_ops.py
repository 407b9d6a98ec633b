"""A few small torch calls right after a verify pass (cold) and again at once (warm), ms.

python cold_ops.py > cold_ops.log
"""

import statistics

import torch

from selfspec.engine import Engine
from selfspec.profile import _timed_ms as ms
from selfspec.profile import cached_prefix

engine = Engine.load("qwen2.5-coder-1.5b")
runner = engine.runner
ad = runner.adapter
_, new = cached_prefix(runner, 200, 8)
h = torch.randn(1, 1536)

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
