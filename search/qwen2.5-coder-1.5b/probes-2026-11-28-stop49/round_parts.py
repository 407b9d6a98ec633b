"""Where a self-speculative round's time goes: the decode loop's parts and the head draft's, timed
by wrapping them (8 Spec-Bench prompts, 128 new tokens, the default drafter, one process).

    python round_parts.py > round_parts.log
"""

import torch
from timing import calls as N
from timing import clear, wrap
from timing import seconds as T

from selfspec import decode as D
from selfspec.drafters import heads as H
from selfspec.engine import Engine
from selfspec.prompts import load_prompts

engine = Engine.load("qwen2.5-coder-1.5b")
runner = engine.runner
drafter = engine.self_drafter()
wrap(runner, "forward", "forward")
hdr = drafter.heads
wrap(hdr, "_link", "link")
wrap(H, "head_step", "link.head_step")
wrap(H, "argmax_rows", "link.argmax")
wrap(hdr.vocab, "logits", "link.vocab.logits")
wrap(hdr.vocab, "id_at", "link.id_at")
wrap(torch, "softmax", "softmax")
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
clear()
for ids in ids_list:
    engine.generate(ids, drafter, max_new_tokens=128)
r = N["round"]
for k in sorted(T, key=lambda k: -T[k]):
    per_call, per_round = T[k] / N[k] * 1e3, T[k] / r * 1e3
    print(f"{k:16s} calls {N[k]:5d}  ms/call {per_call:7.3f}  ms/round {per_round:7.3f}")
