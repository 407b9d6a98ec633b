"""The search space: one skip flag per attention and per MLP sublayer, plus the draft policy.

Trial parameters <-> plans, and the warm starts every study begins with.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfspec.runtime.plan import SkipPlan

MAX_DRAFT_RANGE = (2, 10)
# Draft heads over the first N token ids (0: the whole vocabulary); sizes past the vocabulary drop
# out.
DRAFT_VOCAB_CHOICES = (0, 16384, 32768, 65536)
THRESHOLD_RANGE = (0.0, 0.9)
THRESHOLD_STEP = 0.05


def param_name(kind: str, layer: int) -> str:
    return f"{kind}_{layer:02d}"


def params_for(
    num_layers: int,
    skip_attention=(),
    skip_mlp=(),
    max_draft: int = 4,
    threshold: float = 0.5,
    adaptive: bool = True,
    draft_vocab: int = 0,
) -> dict:
    """Trial parameters describing a plan (used to enqueue warm starts)."""
    lo, hi = MAX_DRAFT_RANGE
    steps = round(
        (min(max(threshold, THRESHOLD_RANGE[0]), THRESHOLD_RANGE[1]) - THRESHOLD_RANGE[0])
        / THRESHOLD_STEP
    )
    params = {param_name("attn", i): i in set(skip_attention) for i in range(num_layers)}
    params.update({param_name("mlp", i): i in set(skip_mlp) for i in range(num_layers)})
    params.update(
        max_draft_tokens=min(max(int(max_draft), lo), hi),
        confidence_threshold=round(THRESHOLD_RANGE[0] + steps * THRESHOLD_STEP, 4),
        adaptive_threshold=bool(adaptive),
        draft_vocab=int(draft_vocab or 0),
    )
    return params


def plan_args(params: dict, num_layers: int) -> tuple[list[int], list[int], dict]:
    """(skip_attention, skip_mlp, policy kwargs) from a trial's parameters."""
    skip_attention = [i for i in range(num_layers) if params.get(param_name("attn", i))]
    skip_mlp = [i for i in range(num_layers) if params.get(param_name("mlp", i))]
    policy = dict(
        max_draft_tokens=int(params["max_draft_tokens"]),
        confidence_threshold=round(float(params["confidence_threshold"]), 4),
        adaptive_threshold=bool(params["adaptive_threshold"]),
        draft_vocab=int(params.get("draft_vocab", 0)) or None,
    )
    return skip_attention, skip_mlp, policy


def warm_starts(
    num_layers: int,
    current: SkipPlan | None = None,
    seed: int = 0,
    random_starts: int = 5,
    vocab_choices=(0,),
) -> list[dict]:
    """The first trials of a study, in order: the plan already at --out, nothing skipped, evenly
    spaced skips in the middle half (every third / every other attention, every other MLP, every
    other whole layer), then a few seeded random sparse plans (10-35% of the sublayers between
    the first two and the last layer). Independent random flags would skip half the model and
    prune; these start TPE nearby."""
    import random

    L = num_layers
    lo, hi = L // 4, L - L // 4
    starts = [
        params_for(L),
        params_for(L, range(lo, hi, 3), max_draft=4, threshold=0.5),
        params_for(L, range(lo, hi, 2), max_draft=4, threshold=0.5),
        params_for(L, [], range(lo, hi, 2), max_draft=3, threshold=0.6),
        params_for(L, range(lo, hi, 2), range(lo, hi, 2), max_draft=3, threshold=0.6),
        params_for(
            L, range(L // 2, L - 1, 2), range(L // 2 + 1, L - 1, 2), max_draft=5, threshold=0.4
        ),
    ]
    rng = random.Random(seed)
    pool = [("attn", i) for i in range(2, L - 1)] + [("mlp", i) for i in range(2, L - 1)]
    for _ in range(random_starts if L >= 4 else 0):
        chosen = rng.sample(pool, max(1, round(rng.uniform(0.10, 0.35) * len(pool))))
        starts.append(
            params_for(
                L,
                [i for kind, i in chosen if kind == "attn"],
                [i for kind, i in chosen if kind == "mlp"],
                max_draft=rng.randint(3, 6),
                threshold=rng.choice([0.3, 0.4, 0.5, 0.6, 0.7]),
                adaptive=rng.random() < 0.5,
                draft_vocab=rng.choice(list(vocab_choices)),
            )
        )
    if current is not None:
        p = current.policy
        vocab = p.draft_vocab if p.draft_vocab in vocab_choices else 0
        starts.insert(
            0,
            params_for(
                L,
                current.skip_attention,
                current.skip_mlp,
                p.max_draft_tokens,
                p.confidence_threshold,
                p.adaptive_threshold,
                vocab,
            ),
        )
    return starts


def plan_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)
