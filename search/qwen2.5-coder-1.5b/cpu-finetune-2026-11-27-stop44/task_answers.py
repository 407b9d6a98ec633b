"""The model's answers to tasks over its own earlier answers, with the states behind each token.

    python task_answers.py B.safetensors WORK/tasks.pt --count 2400 --seed 7

B is a GPU run's answer set (tokens and lengths [N, 2] = prompt, answer), decompressed. Each task
(``selfspec.headtrain.TASKS``: a summary, an answer from the passage, extraction, translation, a
rewrite, questions with answers) is asked over one of B's answers the heads trained on (index % 20
not 0 or 4, at least 48 tokens). The answers are greedy, 128 tokens at most, eight sequences a
pass, in this CPU's gguf-q8 mode. Per answer the file keeps the prompt, the answer and the normed
final hidden state of the row that produced each answer token (float16). Saved every 64 answers:
stop it when there are enough.
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch
from safetensors.torch import load_file

from selfspec.engine import Engine
from selfspec.headtrain import task_prompt

MAX_NEW, BATCH = 128, 8


def task_prompts(engine: Engine, path: str, count: int, seed: int) -> list[list[int]]:
    f = load_file(path)
    tokens, lengths = f["tokens"], f["lengths"]
    starts = [0, *(lengths[:, 0] + lengths[:, 1]).long().cumsum(0).tolist()]
    rng = random.Random(seed)
    picked = [i for i in range(len(lengths)) if i % 20 not in (0, 4) and lengths[i, 1] >= 48]
    rng.shuffle(picked)
    prompts = []
    for i in picked[:count]:
        ids, p = tokens[starts[i] : starts[i + 1]].tolist(), int(lengths[i, 0])
        asked = engine.tokenizer.decode(ids[:p], skip_special_tokens=False)
        found = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", asked, re.S)
        text = engine.tokenizer.decode(ids[p:], skip_special_tokens=True)
        prompt = task_prompt(text, found.group(1) if found else "", rng)
        prompts.append(engine.encode(prompt, chat=True))
    return prompts


@torch.inference_mode()
def answer_group(engine: Engine, group: list[list[int]]) -> list[dict]:
    runner, eos, norm = engine.runner, set(engine.eos_ids()), engine.runner.adapter.final_norm
    caches, answers, states = [], [], []
    for prompt in group:
        cache = runner.new_cache(len(prompt) + MAX_NEW + 1)
        with runner.using(cache):
            logits, _ = runner.forward(torch.tensor(prompt), 0, last_logits_only=True)
            states.append([norm(runner.last_hidden[-1:]).half()])
        caches.append(cache)
        answers.append([int(logits[-1].argmax())])
    for _ in range(MAX_NEW - 1):
        live = [i for i, a in enumerate(answers) if a[-1] not in eos]
        if not live:
            break
        positions = [len(group[i]) + len(answers[i]) - 1 for i in live]
        logits = runner.forward_many(
            [caches[i] for i in live], [answers[i][-1] for i in live], positions
        )
        hidden = norm(runner.last_rows_hidden).half()
        for row, i in enumerate(live):
            states[i].append(hidden[row : row + 1])
            answers[i].append(int(logits[row].argmax()))
    return [
        dict(prompt=p, answer=a, states=torch.cat(s).clone())
        for p, a, s in zip(group, answers, states)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("answers")
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    engine = Engine.load("qwen2.5-coder-1.5b")
    answer_all(engine, task_prompts(engine, args.answers, args.count, args.seed), args.out)


def answer_all(engine: Engine, prompts: list[list[int]], out: str) -> None:
    """``answer_group`` over ``prompts``, BATCH at a time, saved to ``out`` every 64 answers."""
    done, began = [], time.time()
    for first in range(0, len(prompts), BATCH):
        done += answer_group(engine, prompts[first : first + BATCH])
        rows = sum(len(d["answer"]) for d in done)
        print(len(done), rows, f"{rows / (time.time() - began):.1f} rows/s", flush=True)
        if len(done) % 64 == 0:
            torch.save(done, out)
    torch.save(done, out)


if __name__ == "__main__":
    main()
