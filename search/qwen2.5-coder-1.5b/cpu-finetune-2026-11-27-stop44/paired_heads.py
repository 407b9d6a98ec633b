"""Two draft heads files paired in one process: each prompt twice, the order alternated.

    python paired_heads.py OLD.safetensors NEW.safetensors spec-bench:rag,summarization 2

Prints each pair's decoding-phase ratio new / old and target passes, then the median ratio,
the mean accepted lengths and the median ratio by category. Every pair's outputs must be
identical (greedy decoding: heads change the speed, never the tokens).
"""

from __future__ import annotations

import collections
import statistics
import sys

from selfspec.engine import Engine
from selfspec.prompts import load_prompts


def timed(engine: Engine, ids: list[int], drafter) -> tuple[list[int], float, int]:
    result = engine.generate(ids, drafter, max_new_tokens=128)
    stats = result.stats
    decode = stats.seconds - stats.prefill_seconds
    rate = (stats.new_tokens - 1) / decode if stats.new_tokens > 1 else 0.0
    return result.token_ids, rate, stats.target_passes


def main() -> None:
    old, new, source, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    engine = Engine.load("qwen2.5-coder-1.5b")
    drafters = {"old": engine.self_drafter(heads=old), "new": engine.self_drafter(heads=new)}
    compare(engine, drafters, load_prompts(source, limit))


def compare(engine: Engine, drafters: dict, prompts: list) -> None:
    """Drafters ``old`` and ``new`` paired on each of ``prompts`` twice, the order alternated;
    prints what the module's docstring says."""
    ids = [engine.encode(p.text, chat=True) for p in prompts]
    for drafter in drafters.values():
        engine.generate(ids[0], drafter, max_new_tokens=16)  # warm-up
    ratios, by_category = [], collections.defaultdict(list)
    passes, tokens = {"old": 0, "new": 0}, 0
    for rep in range(2):
        for prompt, prompt_ids in zip(prompts, ids):
            runs = {}
            for name in ("old", "new") if rep == 0 else ("new", "old"):
                runs[name] = timed(engine, prompt_ids, drafters[name])
                passes[name] += runs[name][2]
            assert runs["old"][0] == runs["new"][0], prompt.category
            tokens += len(runs["old"][0])
            ratio = runs["new"][1] / runs["old"][1] if runs["old"][1] else 1.0
            ratios.append(ratio)
            by_category[prompt.category].append(ratio)
            print(prompt.category, rep, round(ratio, 3), "passes", runs["old"][2], runs["new"][2])
    print("median new / old, decoding phase:", round(statistics.median(ratios), 4))
    print(f"{tokens} tokens; passes {passes}; mean accepted length old", end=" ")
    print(round(tokens / passes["old"], 3), "new", round(tokens / passes["new"], 3))
    for category, values in sorted(by_category.items()):
        print(f"  {category:15s} {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
