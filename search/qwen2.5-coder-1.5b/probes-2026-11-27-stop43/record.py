"""Greedy answers to Spec-Bench prompts and the draft heads' chains along them (stop 43's probes).

    python record.py --limit 4 --out WORK/records.pt      # 52 prompts: items 1-2 tune, 3-4 check

Per prompt: its chat-template ids, the greedy answer (128 tokens at most), and per head j the
top 64 ids of the full output head over the chain fed the true tokens (as drafting meets it while
its guesses are right), with their logits. The other probes read this file.
"""

from __future__ import annotations

import argparse
import time

import torch

from selfspec.drafters.heads import HeadDrafter, head_step
from selfspec.engine import Engine
from selfspec.prompts import load_prompts


@torch.inference_mode()
def chains(runner, heads: HeadDrafter, prompt: list[int], answer: list[int]) -> list:
    full, n = prompt + answer, len(answer)
    runner.reset(len(full) + 4)
    hidden, _ = runner._run(
        torch.tensor(full).view(1, -1), 0, 0, runner.num_sublayers,
        frozenset(), frozenset(), None, None,
    )  # fmt: skip
    adapter = runner.adapter
    state = adapter.final_norm(hidden[0, len(prompt) - 1 : len(prompt) - 1 + n]).float()
    out = []
    for j in range(len(heads.heads.weights)):
        feed = torch.cat([heads._token_input(answer[min(i + j, n - 1)]) for i in range(n)])
        state = head_step(state, feed, heads.products[j], heads.down_products[j])
        logits = adapter.normed_logits(state.to(hidden.dtype)[None], None)[0].float()
        top = logits.topk(64, -1)
        out.append((top.values.half(), top.indices.int()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    engine = Engine.load("qwen2.5-coder-1.5b")
    runner = engine.runner
    heads = HeadDrafter(runner, engine.resolve_heads(True), stop_ids=engine.eos_ids())
    drafter = engine.self_drafter()
    records, taken = [], {}
    for p in load_prompts("spec-bench", args.limit):
        taken[p.category] = taken.get(p.category, 0) + 1
        ids = engine.encode(p.text, chat=True)
        began = time.time()
        answer = engine.generate(ids, drafter, max_new_tokens=128).token_ids
        records.append(
            dict(category=p.category, item=taken[p.category], prompt=ids, answer=answer,
                 chain=chains(runner, heads, ids, answer))
        )  # fmt: skip
        print(p.category, taken[p.category], len(ids), len(answer), round(time.time() - began, 1))
    torch.save(records, args.out)


if __name__ == "__main__":
    main()
