"""Paired runs in one process: head drafts over 8192 ids against 16384 (stop 41).

    python search/qwen2.5-coder-1.5b/paired-2026-11-27-stop41/vocab.py nofit   # output: vocab.log

26 Spec-Bench prompts (--limit 2), 128 tokens, twice, the two drafters' order alternated, plain
decoding run beside each pair; the ratio is of decode tokens/s (after the first token).
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import selfspec.drafters.heads as H
from selfspec.engine import Engine
from selfspec.prompts import load_prompts

WITH_FIT = sys.argv[1] == "fit"
e = Engine.load("qwen2.5-coder-1.5b")
H.FREQUENT_IDS = 16384  # the default when this ran; 8192 since
base = e.self_drafter()
H.FREQUENT_IDS = 8192
small = e.self_drafter()
print(
    "vocab sizes",
    base.heads.vocab.base_size
    if hasattr(base.heads.vocab, "base_size")
    else len(base.heads.vocab.base_ids),
    len(small.heads.vocab.base_ids),
)
if WITH_FIT:
    from fitcosts import FitCosts

    base.costs, small.costs = FitCosts(), FitCosts()
rate = lambda r: (len(r.token_ids) - 1) / (r.stats.seconds - r.stats.prefill_seconds)
ratios, sn, so = [], [], []
prompts = load_prompts("spec-bench", 2)
for rep in range(2):
    for i, p in enumerate(prompts):
        ids = e.encode(p.text, chat=True)
        order = (
            [("new", small), ("old", base)]
            if (i + rep) % 2 == 0
            else [("old", base), ("new", small)]
        )
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
        f"median 8192/16384 {statistics.median(ratios):.3f}; speedups 8192 "
        f"{statistics.median(sn):.3f} 16384 {statistics.median(so):.3f}",
        flush=True,
    )
