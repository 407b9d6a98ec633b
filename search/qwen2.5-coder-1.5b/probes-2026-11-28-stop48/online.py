"""Heads that learn while they draft (DVI's idea, issue 15 item 4): priced before building (stop 48)

    python online.py W/specbench.pt --adapt bias out head1 --lr 0.1 0.03 0.01 --scope answer run

``W/specbench.pt`` is stop 47's ``fusion.py features --records`` output (the final states of the 26
Spec-Bench answers of ``replay.py record``). Each answer is walked row by row as drafting meets it:
at row i (the verify pass that produced token i + 1 is done) the heads' chain guesses tokens i + 2..
i + 5, fed the true tokens, and is scored on them; then every example whose target token is now
known (head j at row i - 1 - j) takes one SGD step on what ``--adapt`` lets change: ``bias``,
a bias on the scores of the 8192 draft ids; ``out``, a change to the draft ids' output rows;
``head1``, a change to head 1's first layer. ``--scope answer`` starts each answer from the
shipped heads; ``run`` carries the change from one answer to the next, in the bench's order.
Printed: the share of rows where guesses 1..j are all right (against the answer's tokens),
frozen and learning.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "probes-2026-11-27-stop43"))
from attention import HEADS, Context  # noqa: E402  (the frozen heads, their ids and inputs)

from selfspec.drafters.heads import DraftHeads, head_step, token_input  # noqa: E402

CHAIN = 4


class Learner:
    """The shipped heads plus a change that SGD may make to one part of them."""

    def __init__(self, ctx: Context, heads: DraftHeads, adapt: str, lr: float):
        self.ctx, self.heads, self.adapt, self.lr = ctx, heads, adapt, lr
        self.reset()

    def reset(self) -> None:
        h, ids = self.heads.hidden_size, self.ctx.out.shape[0]
        shape = {
            "bias": (ids,),
            "out": (ids, h),
            "head1": self.heads.weights[0].shape,
            "none": (1,),
        }
        self.delta = torch.zeros(shape[self.adapt], requires_grad=self.adapt != "none")

    def step(self, j: int, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        h = self.heads
        weight = h.weights[j] + (self.delta if self.adapt == "head1" and j == 0 else 0)
        down = None if h.downs is None else lambda y: F.linear(y, h.downs[j], h.down_biases[j])
        return head_step(state, token, lambda x: F.linear(x, weight, h.biases[j]), down)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        scores = state @ self.ctx.out.T
        if self.adapt == "out":
            return scores + state @ self.delta.T
        return scores + self.delta if self.adapt == "bias" else scores

    def chain(self, state: torch.Tensor, inputs: torch.Tensor, count: int):
        for j in range(count):
            state = self.step(j, state, inputs[j])
            yield self.logits(state)

    def last_logits(self, state: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        for j in range(len(inputs)):
            state = self.step(j, state, inputs[j])
        return self.logits(state)

    def learn(self, examples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """examples: (start state, token inputs [j + 1], target draft-id index) for head j."""
        if self.adapt == "none" or not examples:
            return
        loss = 0.0
        for state, inputs, target in examples:
            logits = self.last_logits(state, inputs)
            loss = loss + F.cross_entropy(logits[None], torch.tensor([target]))
        (grad,) = torch.autograd.grad(loss, self.delta)
        with torch.no_grad():
            self.delta -= self.lr * grad


def walk(learner: Learner, seq: dict) -> torch.Tensor:
    """[rows, CHAIN] bools: guesses 1..j all right at each answer row, learning as it goes."""
    ctx = learner.ctx
    ids = torch.tensor(seq["ids"])
    feat, inputs = seq["feat"].float(), token_input(ctx.embed[ids].float())
    target = ctx.index[ids]  # -1: not a draft id (never guessed right)
    first, last = max(seq["prompt_len"] - 1, 0), len(ids) - 1
    right = []
    for i in range(first, last - 1):
        with torch.no_grad():
            count = min(CHAIN, last - 1 - i)
            hits = [
                bool(logits.argmax() == target[i + 2 + j]) and bool(target[i + 2 + j] >= 0)
                for j, logits in enumerate(
                    learner.chain(feat[i], inputs[i + 1 : i + 1 + count], count)
                )
            ]
        good = torch.tensor(hits + [False] * (CHAIN - count)).cumprod(0).bool()
        right.append(good)
        examples = [
            (feat[r], inputs[r + 1 : r + 2 + j], int(target[r + 2 + j]))
            for j in range(CHAIN)
            if (r := i - 1 - j) >= first and target[r + 2 + j] >= 0
        ]
        learner.learn(examples)
    return torch.stack(right)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--adapt", nargs="+", default=["bias"], choices=("bias", "out", "head1"))
    parser.add_argument("--lr", nargs="+", type=float, default=[0.01])
    parser.add_argument("--scope", nargs="+", default=["answer"], choices=("answer", "run"))
    args = parser.parse_args()
    torch.manual_seed(0)
    ctx, heads, data = Context(), DraftHeads.load(HEADS), torch.load(args.data, weights_only=False)
    runs = [("none", 0.0, "answer")] + [
        (a, lr, s) for a in args.adapt for lr in args.lr for s in args.scope
    ]
    for adapt, lr, scope in runs:
        learner, by = Learner(ctx, heads, adapt, lr), collections.defaultdict(list)
        for seq in data:
            if scope == "answer":
                learner.reset()
            by[seq["category"]].append(walk(learner, seq))
        every = torch.cat(sum(by.values(), []))
        share = [round(100 * float(x), 2) for x in every.float().mean(0)]
        firsts = {c: 100 * float(torch.cat(v)[:, 0].float().mean()) for c, v in by.items()}
        cats = " ".join(f"{c[:6]}={pct:.0f}" for c, pct in sorted(firsts.items()))
        print(f"{adapt:5s} lr {lr:<6g} {scope:6s} rows {len(every)}: {share}", flush=True)
        print(f"  first guess by category: {cats}", flush=True)


if __name__ == "__main__":
    main()
