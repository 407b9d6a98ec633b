"""Head drafts with and without ``input_table.patch`` (the draft ids' token inputs made once),
two default drafters in one process, every Spec-Bench category's first prompt twice, order
alternated: ms per head draft and per round. Apply the patch first (``git apply``).

    python draft_cost.py > draft_cost.log
"""

import collections
import time

from timing import calls as N
from timing import clear, wrap
from timing import seconds as T

from selfspec.engine import Engine
from selfspec.prompts import load_prompts

engine = Engine.load("qwen2.5-coder-1.5b")
t = time.perf_counter()
new = engine.self_drafter()
made = time.perf_counter() - t
t = time.perf_counter()
new.heads._input_table(new.heads.vocab._base_tensor)
table = time.perf_counter() - t
print(f"drafter made in {made:.2f} s, of which the input table {table:.2f} s")
old = engine.self_drafter()
old.heads._base_inputs = {}
R = collections.Counter()
for name, d in (("old", old), ("new", new)):
    wrap(d.heads, "draft", name)
prompts = load_prompts("spec-bench", 1)
ids = [engine.encode(p.text, chat=True) for p in prompts]
for d in (old, new):
    engine.generate(ids[0], d, max_new_tokens=16)
clear()
for rep in range(2):
    for pid in ids:
        for name, d in (("old", old), ("new", new)) if rep == 0 else (("new", new), ("old", old)):
            r = engine.generate(pid, d, max_new_tokens=128)
            R[name] += r.stats.target_passes
for n in ("old", "new"):
    each, per_round = T[n] / N[n] * 1e3, T[n] / R[n] * 1e3
    print(f"{n}: head drafts {N[n]}, ms each {each:.3f}, per round {per_round:.3f} ms")
