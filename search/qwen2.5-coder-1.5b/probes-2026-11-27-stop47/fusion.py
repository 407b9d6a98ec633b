"""Features from inside the model for the shipped heads: do they make the guesses better? (stop 47)

    python fusion.py features --answers A.safetensors B.safetensors --pick heldout --out W/unseen.pt
    python fusion.py features --answers A.safetensors --pick test --count 150 --out W/test.pt
    python fusion.py features --records W/records.pt --out W/specbench.pt
    python fusion.py train W/unseen.pt W/test.pt --out W/fusion.pt
    python fusion.py measure W/fusion.pt W/specbench.pt

EAGLE-3's idea: the final hidden state is shaped for the next token, and states from lower layers
hold more of what the tokens after it need. ``features``: this CPU's gguf-q8 states at every row of
prompt and answer, float16: the final state (normed, what the heads read today) and the states
entering layers ``LOW`` and ``MID`` (scaled to unit RMS). ``--pick`` as in stop 43's
``attention.py`` (test: the heads' held-out answers 0, 20, 40, ...; heldout: the held-out answers
after the first 150). ``train``: a fusion adds W [low ; mid] to the state head 1 starts from;
W starts at zero, so it starts as the shipped heads, which stay frozen. Loss: the four heads'
chained cross-entropy over the 8192 draft ids, fed the true tokens. ``--control``: W over [final ;
final] instead, the same capacity and training with no new information (what training alone
gives). ``measure``: the share of rows where heads 1..j all guess right, with and without.
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "probes-2026-11-27-stop43"))
from attention import Context, picked_sequences  # noqa: E402  (the frozen heads; the pick)

from selfspec.drafters.heads import token_input  # noqa: E402

LOW, MID = 8, 18  # layers whose entering states the fusion reads (of 28)
HIDDEN = 1536


def _unit(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.inference_mode()
def features(args) -> None:
    from selfspec.engine import Engine

    engine = Engine.load("qwen2.5-coder-1.5b")
    runner, out, began = engine.runner, [], time.time()
    cuts = [0, 2 * LOW, 2 * MID, runner.num_sublayers]
    for ids, prompt_len, category in picked_sequences(args):
        runner.reset(len(ids) + 1)
        x, hidden, states = torch.tensor(ids).view(1, -1), None, []
        for first, stop in zip(cuts, cuts[1:]):
            hidden, _ = runner._run(x, 0, first, stop, frozenset(), frozenset(), hidden, None)
            states.append(hidden[0])
        final = runner.adapter.final_norm(states[-1][None])[0]
        out.append(
            dict(
                ids=ids,
                prompt_len=prompt_len,
                category=category,
                feat=final.half().clone(),
                low=_unit(states[0]).half().clone(),
                mid=_unit(states[1]).half().clone(),
            )
        )
    torch.save(out, args.out)
    rows = sum(len(s["ids"]) for s in out)
    print(f"{len(out)} sequences, {rows} rows, {time.time() - began:.0f} s")


class Fusion(nn.Module):
    def __init__(self, control: bool = False):
        super().__init__()
        self.control = control
        self.w = nn.Linear(2 * HIDDEN, HIDDEN)
        nn.init.zeros_(self.w.weight)
        nn.init.zeros_(self.w.bias)

    def forward(self, seq: dict, rows: torch.Tensor) -> torch.Tensor:
        if self.control:
            both = torch.cat([seq["feat"][rows].float()] * 2, -1)
        else:
            both = torch.cat([seq["low"][rows].float(), seq["mid"][rows].float()], -1)
        return self.w(both)


def chain(ctx: Context, fusion: Fusion | None, seq: dict, count: int = 4, soft: bool = False):
    """Per head j: logits over the ids [rows, 8192] and the id index to guess (-1: none): the
    answer's token, or with ``soft`` the model's argmax at that row, with the model's logits."""
    ids, feat = torch.tensor(seq["ids"]), seq["feat"].float()
    inputs = token_input(ctx.embed[ids].float())
    rows = torch.arange(max(seq["prompt_len"] - 1, 0), len(ids) - 2)  # row i made token i + 1
    state = feat[rows] + (fusion(seq, rows) if fusion is not None else 0)
    last = len(ids) - 1
    for j in range(count):
        state = ctx.steps[j](state, inputs[(rows + 1 + j).clamp(max=last)])
        ahead = (rows + 1 + j).clamp(max=last)  # the row whose logits pick token i + 2 + j
        if soft:  # the model's own choice there (its argmax over the draft ids), and its logits
            model = feat[ahead] @ ctx.out.T
            target = torch.where(rows + 2 + j <= last, model.argmax(-1), -1)
            yield state @ ctx.out.T, target, model
        else:
            target = ctx.index[ids[(rows + 2 + j).clamp(max=last)]]
            yield state @ ctx.out.T, torch.where(rows + 2 + j <= last, target, -1)


def all_right(
    ctx: Context, fusion: Fusion | None, seqs: list[dict], soft: bool = False
) -> tuple[list[float], int]:
    right, total = torch.zeros(4), 0
    with torch.no_grad():
        for seq in seqs:
            good = None
            for j, (logits, target, *_) in enumerate(chain(ctx, fusion, seq, soft=soft)):
                hit = (logits.argmax(-1) == target) & (target >= 0)
                good = hit if good is None else good & hit
                right[j] += good.sum()
            total += len(good)
    return [round(100 * float(r) / total, 2) for r in right], total


def train(args) -> None:
    torch.manual_seed(0)
    random.seed(0)
    ctx, fusion = Context(), Fusion(args.control)
    data = torch.load(args.data, weights_only=False)
    test = torch.load(args.test, weights_only=False)
    print("without", all_right(ctx, None, test), all_right(ctx, None, test, True), flush=True)
    opt = torch.optim.AdamW(fusion.parameters(), lr=args.lr, weight_decay=0.0)
    total, step, began = args.epochs * len(data), 0, time.time()
    for epoch in range(args.epochs):
        random.shuffle(data)
        for seq in data:
            loss = 0.0
            for logits, target, *model in chain(ctx, fusion, seq, args.heads, args.soft):
                if args.soft:  # cross-entropy against the model's distribution at that row
                    keep = target >= 0
                    wanted = torch.softmax(model[0][keep], -1)
                    loss = loss - (wanted * torch.log_softmax(logits[keep], -1)).sum(-1).mean()
                else:
                    loss = loss + F.cross_entropy(logits, target, ignore_index=-1)
            if torch.isfinite(loss):
                (loss / 4).backward()
            step += 1
            if step % 4 == 0:  # four sequences a step, the rate on a cosine
                for group in opt.param_groups:
                    group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total))
                opt.step()
                opt.zero_grad()
        seconds = time.time() - began
        with_fusion = all_right(ctx, fusion, test), all_right(ctx, fusion, test, True)
        print(f"epoch {epoch} ({seconds:.0f} s): with", *with_fusion, flush=True)
    torch.save({"control": args.control, "state": fusion.state_dict()}, args.out)


def measure(args) -> None:
    ctx, saved = Context(), torch.load(args.fusion)
    fusion = Fusion(saved["control"])
    fusion.load_state_dict(saved["state"])
    by = collections.defaultdict(list)
    for seq in torch.load(args.data, weights_only=False):
        by[seq["category"]].append(seq)
    for name, seqs in [("all", sum(by.values(), []))] + sorted(by.items()):
        for soft in (False, True):
            (base, n) = all_right(ctx, None, seqs, soft)
            new, _ = all_right(ctx, fusion, seqs, soft)
            against = "the model's argmax" if soft else "the answer's token"
            print(f"{name:15s} rows {n:5d}  against {against}: without {base}  with {new}")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("features")
    f.add_argument("--answers", nargs="*")
    f.add_argument("--records")
    f.add_argument("--pick", choices=("test", "heldout"), default="test")
    f.add_argument("--count", type=int, default=None)
    f.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("data")
    t.add_argument("test")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--heads", type=int, default=4, help="heads whose loss trains the fusion")
    t.add_argument("--control", action="store_true")
    t.add_argument("--soft", action="store_true", help="train on the model's distribution")
    t.add_argument("--out", required=True)
    m = sub.add_parser("measure")
    m.add_argument("fusion")
    m.add_argument("data")
    args = parser.parse_args()
    {"features": features, "train": train, "measure": measure}[args.command](args)


if __name__ == "__main__":
    main()
