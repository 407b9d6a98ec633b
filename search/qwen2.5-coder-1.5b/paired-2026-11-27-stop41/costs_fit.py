"""Paired runs in one process: pass costs from a line over the stream's latest 48 passes
(``fitcosts.FitCosts``) against the committed ``PassCosts`` (stop 41; not landed).

    python search/qwen2.5-coder-1.5b/paired-2026-11-27-stop41/costs_fit.py   # output: costs_fit.log

Both drafters score 16384 draft ids (the default when this ran).
"""

import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fitcosts import FitCosts

import selfspec.drafters.heads as H
from selfspec.engine import Engine
from selfspec.prompts import load_prompts

e = Engine.load("qwen2.5-coder-1.5b")
H.FREQUENT_IDS = 16384
new, old = e.self_drafter(), e.self_drafter()
new.costs = FitCosts()
count = {"new": collections.Counter(), "old": collections.Counter()}


def wrap(d, name):
    orig = d.observe

    def obs(o):
        c = count[name]
        c["rounds"] += 1
        c["drafted"] += o.drafted
        c["kept"] += o.accepted
        orig(o)

    d.observe = obs


wrap(new, "new")
wrap(old, "old")
rate = lambda r: (len(r.token_ids) - 1) / (r.stats.seconds - r.stats.prefill_seconds)
ratios, sn, so = [], [], []
prompts = load_prompts("spec-bench", 2)
for rep in range(2):
    for i, p in enumerate(prompts):
        ids = e.encode(p.text, chat=True)
        order = [("new", new), ("old", old)] if (i + rep) % 2 == 0 else [("old", old), ("new", new)]
        plain = e.generate(ids, None, max_new_tokens=128)
        out = {}
        for name, d in order:
            r = e.generate(ids, d, max_new_tokens=128)
            assert r.token_ids == plain.token_ids
            out[name] = rate(r)
        ratios.append(out["new"] / out["old"])
        sn.append(out["new"] / rate(plain))
        so.append(out["old"] / rate(plain))
    print(
        "rep",
        rep,
        f"median new/old {statistics.median(ratios):.3f}; speedups new "
        f"{statistics.median(sn):.3f} old {statistics.median(so):.3f}",
        flush=True,
    )
for k, c in count.items():
    print(k, dict(c), "MAL %.3f" % ((c["rounds"] + c["kept"]) / c["rounds"]))
