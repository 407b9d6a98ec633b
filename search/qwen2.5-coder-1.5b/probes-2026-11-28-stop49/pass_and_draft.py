"""Passes over 1 / 2 / 4 / 8 rows after 300 cached tokens, a final norm and a four-guess head draft
right after a pass, and a round (3-row pass, then the draft), ms, medians of 21; run once per
kernel build to compare builds (the software prefetch hint, README).

    python pass_and_draft.py
"""

import statistics

import torch

from selfspec.engine import Engine
from selfspec.profile import _head_draft, cached_prefix
from selfspec.profile import _timed_ms as ms

engine = Engine.load("qwen2.5-coder-1.5b")
runner = engine.runner
ad = runner.adapter
heads = engine.resolve_heads(True)
prefix, new = cached_prefix(runner, 300, 8)
draft = _head_draft(runner, heads, prefix.tolist())
h = torch.randn(1, 1536)


R = {k: [] for k in ("p1", "p2", "p4", "p8", "norm", "draft", "round")}
for _ in range(3):
    draft()
    runner.forward(new[:4], 300)
for _ in range(21):
    for n in (1, 2, 4, 8):
        R[f"p{n}"].append(ms(lambda n=n: runner.forward(new[:n], 300)))
    R["norm"].append(ms(lambda: ad.final_norm(h)))
    runner.forward(new[:3], 300)
    R["draft"].append(ms(draft))
    R["round"].append(ms(lambda: (runner.forward(new[:3], 300), draft())))
print(" ".join(f"{k} {statistics.median(v):.3f}" for k, v in R.items()))
