"""Where a self-speculative round's time goes: the decode loop's parts and the head draft's, timed
by wrapping them (8 Spec-Bench prompts, 128 new tokens, the default drafter, one process).

    python round_parts.py > round_parts.log
"""

import collections
import time

import torch

from selfspec import decode as D
from selfspec.drafters import heads as H
from selfspec.engine import Engine
from selfspec.prompts import load_prompts

engine = Engine.load("qwen2.5-coder-1.5b")
runner = engine.runner
drafter = engine.self_drafter()
T = collections.defaultdict(float)
N = collections.Counter()


def wrap(obj, name, key):
    f = getattr(obj, name)

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T[key] += time.perf_counter() - t
        N[key] += 1
        return r

    setattr(obj, name, g)


wrap(runner, "forward", "forward")
hdr = drafter.heads
wrap(hdr, "_link", "link")
wrap(H, "head_step", "link.head_step")
wrap(H, "argmax_rows", "link.argmax")
wrap(hdr.vocab, "logits", "link.vocab.logits")
wrap(hdr.vocab, "id_at", "link.id_at")
_sm = torch.softmax


def sm(*a, **k):
    t = time.perf_counter()
    r = _sm(*a, **k)
    T["softmax"] += time.perf_counter() - t
    N["softmax"] += 1
    return r


torch.softmax = sm
wrap(hdr.runner.adapter, "final_norm", "final_norm")
wrap(hdr.vocab, "follow", "vocab.follow")
wrap(hdr, "_token_input", "token_input")
wrap(hdr, "draft", "heads.draft")
wrap(drafter.index, "sync", "index.sync")
wrap(drafter.index, "lookup", "index.lookup")
wrap(drafter, "draft", "adaptive.draft")
wrap(drafter, "observe", "observe")
wrap(D, "accept", "accept")
wrap(D, "verify", "verify")
wrap(D, "_round", "round")
prompts = load_prompts("spec-bench", 1)[:8]
ids_list = [engine.encode(p.text, chat=True) for p in prompts]
engine.generate(ids_list[0], drafter, max_new_tokens=16)
T.clear()
N.clear()
for ids in ids_list:
    engine.generate(ids, drafter, max_new_tokens=128)
r = N["round"]
for k in sorted(T, key=lambda k: -T[k]):
    per_call, per_round = T[k] / N[k] * 1e3, T[k] / r * 1e3
    print(f"{k:16s} calls {N[k]:5d}  ms/call {per_call:7.3f}  ms/round {per_round:7.3f}")
