"""The shipped draft heads trained on for a while on this CPU, on task answers and own answers.

    python finetune.py --tasks WORK/tasks.pt --own WORK/own.pt --heldout WORK/unseen.pt \\
        --specbench WORK/specbench.pt --own-count 400 --epochs 2 --lr 2e-4 \\
        --out WORK/heads.safetensors

``--tasks``: ``task_answers.py``'s file (a tenth of it held out). ``--own``, ``--heldout``,
``--specbench``: features files of stop 43's ``attention.py features`` (this CPU's normed final
hidden states at every row of prompt and answer): answers the heads trained on, answers they
never saw, and the Spec-Bench answers of ``record.py``. All four heads are trained (two layers
each, as shipped), the loss over the 8192 ids a draft scores: half cross-entropy against the
answer's token, half against the model's own distribution at the row that produced it (the GPU
recipe's). Before and after, per set and Spec-Bench category: the share of rows where guesses
1..j are all right.
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch
import torch.nn.functional as F

from selfspec.drafters.heads import FREQUENT_IDS, DraftHeads, token_input
from selfspec.headfit import _initial_heads

HEADS = "selfspec/plans/qwen2.5-coder-1.5b/heads.safetensors"
K = 4  # heads


def tables(heads: DraftHeads):
    """The draft ids' output rows [8192, hidden], every token's input embedding, id -> row."""
    from selfspec.engine import Engine
    from selfspec.headtrain import embedding_table
    from selfspec.kernels import linear_rows

    engine = Engine.load("qwen2.5-coder-1.5b")
    ids = heads.frequent[heads.frequent < engine.runner.head_rows][:FREQUENT_IDS]
    head = engine.runner.model.get_output_embeddings()
    with torch.inference_mode():
        out = linear_rows(head, ids)(torch.eye(head.in_features)).float().T
    embed = embedding_table(engine)
    index = torch.full((len(embed),), -1, dtype=torch.long)
    index[ids] = torch.arange(len(ids))
    return out.clone(), embed, index


def samples(path: str, kind: str) -> list:
    """(states [n, hidden], answer ids [n], category): state k produced answer token k."""
    out = []
    for s in torch.load(path, weights_only=False):
        if kind == "task":
            out.append((s["states"], torch.tensor(s["answer"]), "task"))
            continue
        ids, p = s["ids"], s["prompt_len"]
        if kind == "own" and s.get("test"):  # one the heads held out
            continue
        if len(ids) - p >= 2:
            states = s["feat"][p - 1 : len(ids) - 1]
            out.append((states, torch.tensor(ids[p:]), s.get("category") or kind))
    return out


def flatten(data: list, index: torch.Tensor):
    """Rows of every answer: states, fed token, per head the draft-id row of its target (-1: none
    or not a draft id) and the row that produced that target (-1: past the answer)."""
    states, fed, targets, later, base = [], [], [], [], 0
    for s, answer, _ in data:
        n, k = len(answer), torch.arange(len(answer))
        t = torch.full((K, n), -1, dtype=torch.long)
        row = torch.full((K, n), -1, dtype=torch.long)
        for j in range(K):
            ok = k + 1 + j < n
            t[j, ok] = index[answer[(k + 1 + j)[ok]]]
            row[j, ok] = base + (k + 1 + j)[ok]
        states.append(s.half())
        fed.append(answer)
        targets.append(t)
        later.append(row)
        base += n
    return torch.cat(states), torch.cat(fed), torch.cat(targets, 1), torch.cat(later, 1)


def measure(heads: DraftHeads, data: list, out, embed, index, label: str) -> None:
    steps, by = heads.steps(), collections.defaultdict(lambda: [torch.zeros(K), 0])
    with torch.no_grad():
        for s, answer, category in data:
            n = len(answer)
            state, good, rows = s.float()[: n - 1], None, torch.arange(n - 1)
            for j in range(K):
                state = steps[j](state, token_input(embed[answer[(rows + j).clamp(max=n - 1)]]))
                guess = (state @ out.T).argmax(-1)
                target = rows + 1 + j
                hit = (target < n) & (guess == index[answer[target.clamp(max=n - 1)]])
                good = hit if good is None else good & hit
                for name in (category, "all"):
                    by[name][0][j] += good.sum()
            for name in (category, "all"):
                by[name][1] += n - 1
    for name, (right, n) in sorted(by.items()):
        shares = " / ".join(f"{100 * float(r) / n:.1f}" for r in right)
        print(f"  {label:6s} {name:15s} rows {n:6d}  {shares}", flush=True)


def train(heads: DraftHeads, data: list, out, embed, index, epochs, lr, soft, batch=256):
    torch.manual_seed(0)
    states, fed, targets, later = flatten(data, index)
    trained = _initial_heads(heads, K, states.shape[1], torch.device("cpu"), 2)
    params = [*trained.weights, *trained.biases, *trained.downs, *trained.down_biases]
    for p in params:
        p.requires_grad_()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = epochs * -(-len(fed) // batch)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - 0.9 * step / total)
    steps, began = trained.steps(), time.time()
    for epoch in range(epochs):
        order = torch.randperm(len(fed))
        for first in range(0, len(order), batch):
            i = order[first : first + batch]
            state, token, loss = states[i].float(), fed[i], 0.0
            for j in range(K):
                state = steps[j](state, token_input(embed[token]))
                logits = state @ out.T
                t = targets[j, i]
                hard = F.cross_entropy(logits, t.masked_fill(t < 0, -100), ignore_index=-100)
                loss = loss + (1 - soft) * torch.nan_to_num(hard)
                has = later[j, i] >= 0
                if soft > 0 and bool(has.any()):
                    with torch.no_grad():
                        model = torch.softmax(states[later[j, i][has]].float() @ out.T, -1)
                    loss = loss - soft * (model * torch.log_softmax(logits[has], -1)).sum(-1).mean()
                token = torch.where(has, fed[later[j, i].clamp(min=0)], token)
            opt.zero_grad()
            loss.backward()
            opt.step()
            decay.step()
        print(f"epoch {epoch + 1}: {time.time() - began:.0f} s, last loss {float(loss):.3f}")
    return trained.detached()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--own", required=True)
    parser.add_argument("--heldout", required=True)
    parser.add_argument("--specbench", required=True)
    parser.add_argument("--own-count", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--soft", type=float, default=0.5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    heads = DraftHeads.load(HEADS)
    out, embed, index = tables(heads)
    tasks = samples(args.tasks, "task")
    random.Random(0).shuffle(tasks)
    held = max(1, len(tasks) // 10)
    sets = [tasks[:held], samples(args.heldout, "own-unseen")[:150]]
    sets.append(samples(args.specbench, "spec-bench"))
    for data in sets:
        measure(heads, data, out, embed, index, "before")
    own = samples(args.own, "own")[: args.own_count]
    new = train(heads, tasks[held:] + own, out, embed, index, args.epochs, args.lr, args.soft)
    new.info = dict(heads.info, cpu_finetune=vars(args))
    new.frequent = heads.frequent
    new.save(args.out)
    for data in sets:
        measure(new, data, out, embed, index, "after")


if __name__ == "__main__":
    main()
