"""Paired runs in one process: pass costs from a line over the stream's latest 48 passes
(``fitcosts.FitCosts``) against the committed ``PassCosts`` (stop 41; not landed).

    python search/qwen2.5-coder-1.5b/paired-2026-11-27-stop41/costs_fit.py   # output: costs_fit.log

Both drafters score 16384 draft ids (the default when this ran).
"""

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fitcosts import FitCosts
from paired import compare

import selfspec.drafters.heads as H
from selfspec.engine import Engine

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
compare(e, new, old, "new", "old")
for k, c in count.items():
    print(k, dict(c), "MAL %.3f" % ((c["rounds"] + c["kept"]) / c["rounds"]))
