"""Attention over the context before the shipped heads: does it make their guesses better? (stop 43)

    python attention.py features --answers A.safetensors --pick heldout --out WORK/unseen.pt
    python attention.py features --answers A.safetensors --pick test --count 150 --out WORK/test.pt
    python attention.py features --records WORK/records.pt --out WORK/specbench.pt
    python attention.py train WORK/unseen.pt WORK/test.pt --out WORK/block.pt
    python attention.py measure WORK/block.pt WORK/specbench.pt

``features``: this CPU's gguf-q8 final hidden states (normed, float16) at every row of prompt and
answer. ``--pick test``: answers 0, 20, 40, ... (the heads' held-out answers); ``--pick heldout``:
the held-out answers after the first 150 (A is the first GPU set; B, the stop-42 set, whose
held-out answers are those with index % 20 == 4); ``--pick train``: answers the heads trained on.
``train``: a block (4 heads x 64 dims; queries, keys and values from each position's (final hidden
state, next token input), a learned bias per distance bucket, causal) adds its output to the state
head 1 starts from; its output projection starts at zero, so it starts as the shipped heads, which
stay frozen. Loss: head 1's cross-entropy over the 8192 most frequent ids. ``measure``: the share
of rows where heads 1..j all guess right, with and without the block, by category.
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from selfspec.drafters.heads import FREQUENT_IDS, DraftHeads, token_input

HEADS = "selfspec/plans/qwen2.5-coder-1.5b/heads.safetensors"
H, D, IN = 4, 64, 3072


def picked_sequences(args) -> list[tuple[list[int], int, str]]:
    """(token ids, prompt length, category) of ``--records``' answers and the ``--pick`` of
    ``--answers``' (see the module's docstring)."""
    sequences = []
    if args.records:
        for r in torch.load(args.records, weights_only=False):
            sequences.append((r["prompt"] + r["answer"], len(r["prompt"]), r["category"]))
    for k, path in enumerate(args.answers or []):
        from safetensors.torch import load_file

        f = load_file(path)
        tokens, lengths = f["tokens"], f["lengths"]
        starts = [0, *(lengths[:, 0] + lengths[:, 1]).long().cumsum(0).tolist()]
        test = [i for i in range(len(lengths)) if i % 20 == (0 if k == 0 else 4)]
        picked = {
            "test": test[: args.count],
            "heldout": test[150:] if k == 0 else test,
            "train": [i for i in range(len(lengths)) if i % 20 != 0][: args.count],
        }[args.pick]
        for i in picked:
            sequences.append((tokens[starts[i] : starts[i + 1]].tolist(), int(lengths[i, 0]), ""))
    return sequences


def features(args) -> None:
    from selfspec.engine import Engine

    engine = Engine.load("qwen2.5-coder-1.5b")
    runner = engine.runner
    sequences = picked_sequences(args)
    out = []
    for ids, prompt_len, category in sequences:
        with torch.inference_mode():
            runner.reset(len(ids) + 1)
            _, hidden = runner.forward(
                torch.tensor(ids), 0, capture_at=runner.num_sublayers, last_logits_only=True
            )
            normed = runner.adapter.final_norm(hidden[0]).half().clone()
        out.append(dict(ids=ids, prompt_len=prompt_len, feat=normed, category=category))
    torch.save(out, args.out)
    print(f"{len(out)} sequences, {sum(len(s['ids']) for s in out)} rows")


class Context:
    """The frozen heads, the ids they score and the token inputs, from the shipped files."""

    def __init__(self):
        from selfspec.engine import Engine
        from selfspec.headtrain import embedding_table
        from selfspec.kernels import linear_rows

        engine = Engine.load("qwen2.5-coder-1.5b")
        heads = DraftHeads.load(HEADS)
        self.steps = heads.steps()
        ids = heads.frequent[heads.frequent < engine.runner.head_rows][:FREQUENT_IDS]
        head = engine.runner.model.get_output_embeddings()
        with torch.inference_mode():
            out = linear_rows(head, ids)(torch.eye(head.in_features)).float().T
        self.out = out.clone()  # outside inference mode: the backward pass saves it
        self.embed = embedding_table(engine)
        self.index = torch.full((len(self.embed),), -1, dtype=torch.long)
        self.index[ids] = torch.arange(len(ids))


def buckets(distance: torch.Tensor) -> torch.Tensor:
    """0..3 as they are, then two buckets per doubling, up to 15."""
    logs = (4 + torch.log2(distance.float().clamp(min=1) / 4) * 2).long()
    return torch.where(distance < 4, distance, logs).clamp(max=15)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(IN, H * D), nn.Linear(IN, H * D), nn.Linear(IN, H * D)
        self.o = nn.Linear(H * D, IN // 2)
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.o.bias)
        self.distance = nn.Parameter(torch.zeros(H, 16))

    def forward(self, pairs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """pairs [n, IN] (position j: state j ; input of token j + 1); rows [m] query positions."""
        n = len(pairs)
        q = self.q(pairs[rows]).view(-1, H, D).transpose(0, 1)
        k = self.k(pairs).view(n, H, D).transpose(0, 1)
        v = self.v(pairs).view(n, H, D).transpose(0, 1)
        distance = rows[:, None] - torch.arange(n)[None, :]
        scores = (
            q @ k.transpose(1, 2) / math.sqrt(D) + self.distance[:, buckets(distance.clamp(min=0))]
        )
        scores = scores.masked_fill((distance < 0)[None], float("-inf"))
        mixed = torch.softmax(scores, -1) @ v
        return self.o(mixed.transpose(0, 1).reshape(len(rows), H * D))


def chain(ctx: Context, block: Block | None, seq: dict, count: int = 4):
    """Per head j: logits over the ids [rows, 8192] and the id index to guess (-1: none)."""
    ids, feat = torch.tensor(seq["ids"]), seq["feat"].float()
    inputs = token_input(ctx.embed[ids].float())
    pairs = torch.cat([feat[:-1], inputs[1:]], -1)
    rows = torch.arange(max(seq["prompt_len"] - 1, 0), len(ids) - 2)  # row i made token i + 1
    state = feat[rows] + (block(pairs, rows) if block is not None else 0)
    last = len(ids) - 1
    for j in range(count):
        state = ctx.steps[j](state, inputs[(rows + 1 + j).clamp(max=last)])
        target = ctx.index[ids[(rows + 2 + j).clamp(max=last)]]
        yield state @ ctx.out.T, torch.where(rows + 2 + j <= last, target, -1)


def all_right(ctx: Context, block: Block | None, seqs: list[dict]) -> tuple[list[float], int]:
    right, total = torch.zeros(4), 0
    with torch.no_grad():
        for seq in seqs:
            good = None
            for j, (logits, target) in enumerate(chain(ctx, block, seq)):
                hit = (logits.argmax(-1) == target) & (target >= 0)
                good = hit if good is None else good & hit
                right[j] += good.sum()
            total += len(good)
    return [round(float(r) / total, 4) for r in right], total


def train(args) -> None:
    torch.manual_seed(0)
    random.seed(0)
    ctx, block = Context(), Block()
    data, test = (
        torch.load(args.data, weights_only=False),
        torch.load(args.test, weights_only=False),
    )
    print("without the block", all_right(ctx, None, test), flush=True)
    opt = torch.optim.AdamW(block.parameters(), lr=args.lr, weight_decay=0.0)
    total, step, began = args.epochs * len(data), 0, time.time()
    for epoch in range(args.epochs):
        random.shuffle(data)
        for seq in data:
            logits, target = next(chain(ctx, block, seq, 1))
            loss = F.cross_entropy(logits, target, ignore_index=-1)
            if torch.isfinite(loss):
                (loss / 4).backward()
            step += 1
            if step % 4 == 0:  # four sequences a step, the rate on a cosine
                for group in opt.param_groups:
                    group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total))
                opt.step()
                opt.zero_grad()
        seconds = time.time() - began
        print(f"epoch {epoch} ({seconds:.0f} s): with the block", all_right(ctx, block, test))
    torch.save(block.state_dict(), args.out)


def measure(args) -> None:
    ctx, block = Context(), Block()
    block.load_state_dict(torch.load(args.block))
    by = collections.defaultdict(list)
    for seq in torch.load(args.data, weights_only=False):
        by[seq["category"]].append(seq)
    for name, seqs in [("all", sum(by.values(), []))] + sorted(by.items()):
        (base, n), (new, _) = all_right(ctx, None, seqs), all_right(ctx, block, seqs)
        print(f"{name:15s} rows {n:5d}  without {base}  with {new}")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("features")
    f.add_argument("--answers", nargs="*")
    f.add_argument("--records")
    f.add_argument("--pick", choices=("test", "heldout", "train"), default="test")
    f.add_argument("--count", type=int, default=None)
    f.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("data")
    t.add_argument("test")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--out", required=True)
    m = sub.add_parser("measure")
    m.add_argument("block")
    m.add_argument("data")
    args = parser.parse_args()
    {"features": features, "train": train, "measure": measure}[args.command](args)


if __name__ == "__main__":
    main()
