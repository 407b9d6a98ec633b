"""Context drafts choosing the occurrence by the first draft head (new) or the latest (old), paired.

Runs on the branch ``heads-pick-match`` only (main has no ``AdaptiveDrafter._likeliest_match``):

    git checkout heads-pick-match
    python search/qwen2.5-coder-1.5b/probes-2026-11-27-stop43/paired_match_choice.py \\
        spec-bench:summarization,rag,extraction,writing,coding,math

Two prompts a category, twice, the order of the two variants alternated; every pair of outputs
must be identical. Prints each pair's decoding-phase ratio new / old and the context drafts'
rounds, drafted and kept tokens per variant.
"""

from __future__ import annotations

import statistics
import sys

from selfspec.drafters.adaptive import AdaptiveDrafter
from selfspec.engine import Engine
from selfspec.prompts import load_prompts

NEW_CHOICE = AdaptiveDrafter._likeliest_match


def latest(self, request, match, limit):
    return match


def main() -> None:
    engine = Engine.load("qwen2.5-coder-1.5b")
    drafter = engine.self_drafter()
    prompts = load_prompts(sys.argv[1] if len(sys.argv) > 1 else "spec-bench", 2)
    ids = [engine.encode(p.text, chat=True) for p in prompts]
    engine.generate(ids[0], drafter, max_new_tokens=16)  # warm-up
    ratios, tally = [], {"old": [0, 0, 0], "new": [0, 0, 0]}
    for rep in range(2):
        for prompt, prompt_ids in zip(prompts, ids):
            runs = {}
            for name in ("old", "new") if rep == 0 else ("new", "old"):
                AdaptiveDrafter._likeliest_match = NEW_CHOICE if name == "new" else latest
                result = engine.generate(prompt_ids, drafter, max_new_tokens=128)
                stats = result.stats
                decode = stats.seconds - stats.prefill_seconds
                rate = (stats.new_tokens - 1) / decode if stats.new_tokens > 1 else 0.0
                runs[name] = (result.token_ids, rate, stats.target_passes)
                for k, count in enumerate(stats.sources.get("ngram", [0, 0, 0])):
                    tally[name][k] += count
            assert runs["old"][0] == runs["new"][0], prompt.category
            ratios.append(runs["new"][1] / runs["old"][1] if runs["old"][1] else 1.0)
            passes = (runs["old"][2], runs["new"][2])
            print(prompt.category, rep, round(ratios[-1], 3), "passes old/new", *passes, flush=True)
    print("median new/old decode", statistics.median(ratios))
    print("ngram rounds, drafted, accepted:", tally)


if __name__ == "__main__":
    main()
