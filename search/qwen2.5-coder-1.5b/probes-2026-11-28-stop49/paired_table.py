"""Two default drafters in one process, one with a change switched off (here
``input_table.patch``'s table): each prompt twice, order alternated; decoding-phase ratio new /
old, passes, identical outputs. Apply the patch first (``git apply``).

    python paired_table.py spec-bench 1 > paired_table.log
"""

import collections
import statistics
import sys
import time

from selfspec.engine import Engine
from selfspec.prompts import load_prompts


def timed(engine, ids, drafter):
    r = engine.generate(ids, drafter, max_new_tokens=128)
    s = r.stats
    return r.token_ids, (s.new_tokens - 1) / (s.seconds - s.prefill_seconds), s.target_passes


def main(switch_off, source, limit, reps=2):
    engine = Engine.load("qwen2.5-coder-1.5b")
    t = time.perf_counter()
    new = engine.self_drafter()
    print("drafter made in %.2f s" % (time.perf_counter() - t))
    old = engine.self_drafter()
    switch_off(old)
    drafters = {"old": old, "new": new}
    prompts = load_prompts(source, limit)
    ids = [engine.encode(p.text, chat=True) for p in prompts]
    for d in drafters.values():
        engine.generate(ids[0], d, max_new_tokens=16)
    ratios, cats = [], collections.defaultdict(list)
    for rep in range(reps):
        for p, pid in zip(prompts, ids):
            runs = {}
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                runs[name] = timed(engine, pid, drafters[name])
            assert runs["old"][0] == runs["new"][0], p.category
            ratio = runs["new"][1] / runs["old"][1]
            ratios.append(ratio)
            cats[p.category].append(ratio)
            print(
                p.category,
                rep,
                round(ratio, 3),
                "passes",
                runs["old"][2],
                runs["new"][2],
                flush=True,
            )
    print(
        "median new / old, decoding phase:", round(statistics.median(ratios), 4), "of", len(ratios)
    )


if __name__ == "__main__":

    def off(d):
        d.heads._base_inputs = {}

    main(
        off,
        sys.argv[1] if len(sys.argv) > 1 else "spec-bench",
        int(sys.argv[2]) if len(sys.argv) > 2 else 1,
    )
