"""What a better-calibrated chance for each head guess would buy (stop 45).

    python search/qwen2.5-coder-1.5b/replay-2026-11-27/replay.py record --out WORK/answers.pt
    python search/qwen2.5-coder-1.5b/probes-2026-11-27-stop45/calibration.py WORK/answers.pt

The drafter proposes guess j while the chain's chance (the product of the heads' top
probabilities, scaled by how such chances came true) is worth a verify row. This fits, per head,
other maps from what a guess's distribution shows to the chance that it is right given the guesses
before it were, on half of the prompts, and prices each map with replay.py's policy on the other
half (and the other way round): the raw top probability, the raw one times a constant per head
(close to what the drafter's scaling does), a binned (isotonic-like) map of it, and a logistic
regression on the top two probabilities and the entropy. Held-out log loss and the replayed
speedup say whether a better predictor is worth building.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "replay-2026-11-27"))
import replay  # noqa: E402

VOCAB = replay.Policy.vocab


def samples(records: list[dict], which: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per head j: features [m, 3] (top probability, second, entropy) and labels [m] of the guesses
    the chain meets with every guess before it right, over the records ``which``."""
    feats, labels = {}, {}
    for r in which:
        rec = records[r]
        answer, chain, extras = rec["answer"], rec["guesses"][VOCAB], rec["extras"]
        n = len(answer)
        for i in range(n - 1):
            for j, (ids, conf) in enumerate(chain):
                if i + j + 1 >= n:
                    break
                right = int(ids[i]) == answer[i + j + 1]
                second, entropy = float(extras[j][0][i]), float(extras[j][1][i])
                feats.setdefault(j, []).append([float(conf[i]), second, entropy])
                labels.setdefault(j, []).append(float(right))
                if not right:
                    break
    return {j: (torch.tensor(feats[j]), torch.tensor(labels[j])) for j in feats}


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-6, 1 - 1e-6)
    return (p / (1 - p)).log()


def _design(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([_logit(x[:, 0]), _logit(x[:, 1]), x[:, 2], torch.ones(len(x))], -1)


def fit(kind: str, x: torch.Tensor, y: torch.Tensor):
    """A map from features [m, 3] to the chance of being right [m], fitted on (x, y)."""
    if kind == "raw":
        return lambda f: f[:, 0]
    if kind == "scaled":
        scale = float(y.sum() / x[:, 0].sum())
        return lambda f: (f[:, 0] * scale).clamp(max=1.0)
    if kind == "binned":
        edges = torch.quantile(x[:, 0], torch.linspace(0, 1, 11)[1:-1])
        bins = torch.bucketize(x[:, 0], edges)
        means = torch.zeros(10)
        for b in range(10):
            if (bins == b).any():
                means[b] = y[bins == b].mean()
        means = torch.cummax(means, 0).values  # never less likely at a higher top probability
        return lambda f: means[torch.bucketize(f[:, 0], edges)]
    if kind == "logistic":
        design = _design(x)
        w = torch.zeros(design.shape[1], requires_grad=True)
        opt = torch.optim.LBFGS([w], max_iter=200)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(design @ w, y)
            loss.backward()
            return loss

        opt.step(closure)
        w = w.detach()
        return lambda f: torch.sigmoid(_design(f) @ w)
    raise ValueError(kind)


def log_loss(q: torch.Tensor, y: torch.Tensor) -> float:
    q = q.clamp(1e-6, 1 - 1e-6)
    return float(-(y * q.log() + (1 - y) * (1 - q).log()).mean())


def with_chances(rec: dict, maps: dict) -> dict:
    """The record with each head's recorded confidence replaced by its map's chance."""
    chain, extras = rec["guesses"][VOCAB], rec["extras"]
    new_chain = []
    for j, (ids, conf) in enumerate(chain):
        f = torch.stack([conf.float(), extras[j][0].float(), extras[j][1].float()], -1)
        new_chain.append((ids, maps[j](f)))
    return dict(rec, guesses={**rec["guesses"], VOCAB: new_chain})


def main() -> None:
    records = torch.load(sys.argv[1], weights_only=False)
    halves = [list(range(0, len(records), 2)), list(range(1, len(records), 2))]
    kinds = ("raw", "scaled", "binned", "logistic")
    # two-layer heads; verify rows as the Xeon of stop 45 measured them (bench, --limit 2)
    policy = replay.Policy(head_mb=7.5, rows=(1.0, 1.04, 1.06, 1.13, 1.23))
    ratios = {k: [] for k in (*kinds, "oracle")}
    losses = {k: [] for k in kinds}
    for train, test in (halves, halves[::-1]):
        fit_on, held = samples(records, train), samples(records, test)
        for kind in kinds:
            maps = {j: fit(kind, *fit_on[j]) for j in fit_on}
            for j, (x, y) in held.items():
                losses[kind].append((j, len(y), log_loss(maps[j](x), y)))
            for r in test:
                t, c = replay.replay_one(policy, with_chances(records[r], maps))
                if t:
                    ratios[kind].append(t / c)
        for r in test:
            t, c = replay.replay_one(replace(policy, oracle=True), records[r])
            if t:
                ratios["oracle"].append(t / c)
    print("| chance of guess j | held-out log loss (heads 1 / 2 / 3 / 4) | replayed, median |")
    print("|---|---|---:|")
    for kind in (*kinds, "oracle"):
        if kind in losses:
            by_head = {}
            for j, m, loss in losses[kind]:
                a, b = by_head.get(j, (0.0, 0))
                by_head[j] = (a + loss * m, b + m)
            text = " / ".join(f"{a / b:.3f}" for _, (a, b) in sorted(by_head.items()))
        else:
            text = "–"
        print(f"| {kind} | {text} | {statistics.median(ratios[kind]):.3f}x |")
    counts = samples(records, list(range(len(records))))
    print(
        "guesses met per head:",
        {j: len(y) for j, (x, y) in counts.items()},
        "right:",
        {j: round(float(y.mean()), 3) for j, (x, y) in counts.items()},
    )


if __name__ == "__main__":
    main()
