"""A one-row pass right after a head draft against one right after a pass (stop 41), interleaved.

python search/qwen2.5-coder-1.5b/paired-2026-11-27-stop41/pass_after_draft.py
"""

import statistics
import time

import torch

from selfspec.drafters.base import DraftRequest
from selfspec.drafters.heads import HeadDrafter
from selfspec.engine import Engine
from selfspec.sampling import Sampling

e = Engine.load("qwen2.5-coder-1.5b")
r = e.runner
heads = HeadDrafter(r, e.default_heads(), stop_ids=e.eos_ids())
ids = e.encode("Write a short story about a robot who learns to paint.", chat=True)
res = e.generate(ids, None, max_new_tokens=40)
full = ids + res.token_ids
r.reset(len(full) + 8)
with torch.inference_mode():
    r.forward(torch.tensor(full[:-1]), 0)
pos = len(full) - 1
greedy = Sampling()


def one():
    t = time.perf_counter()
    r.forward(torch.tensor([full[-1]]), pos)
    return time.perf_counter() - t


heads._after_prefill = True
a, b, d = [], [], []
with torch.inference_mode():
    for _ in range(3):
        one()
    for i in range(120):
        if i % 2:
            a.append(one())
        else:
            t = time.perf_counter()
            heads._after_prefill = True
            heads.draft(DraftRequest(full, 3, greedy, None))
            d.append(time.perf_counter() - t)
            b.append(one())
ms = lambda x: "%.2f" % (statistics.median(x) * 1000)
print("pass after pass", ms(a), "pass after head draft", ms(b), "draft", ms(d))
