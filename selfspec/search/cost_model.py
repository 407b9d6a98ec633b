"""The search's cost model: measured seconds of the passes a speculative round is made of.

Measured once per study on the engine's own runner (a plain step, a step with every attention or
every MLP sublayer skipped, verify passes over k tokens) and stored in the study, so every trial and
every worker scores with the same costs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfspec.runtime.runner import ModelRunner

VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12)


@dataclass
class CostModel:
    """Measured seconds of the passes a speculative round is made of (one device, one context
    length)."""

    full_step: float  # a plain decoding step: one token through the full model, prefix cached
    base_step: float  # one token with every sublayer skipped: embedding, final norm, head, argmax
    attention: float  # one attention sublayer for one token (mean over layers)
    mlp: float  # one MLP sublayer for one token (mean over layers)
    num_layers: int
    verify_sizes: list[int]
    verify: list[float]  # full forward over k tokens (k in verify_sizes), argmax included
    verify_base: list[float]  # the same with every sublayer skipped (embedding + head over k rows)
    context: int = 0  # cached prefix length the costs were measured at
    draft_overhead: float = 0.0  # softmax/top-prob/argmax per draft step, on top of the forward
    # the output layer over the whole vocabulary, for one token (inside base_step)
    head: float = 0.0
    vocab: int = 0  # rows of the output layer

    @staticmethod
    def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
        if x <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]  # extrapolate linearly past the last size
        return y1 + (y1 - y0) * (x - x1) / (x1 - x0)

    def draft_step(self, attention_kept: int, mlp_kept: int, draft_vocab: int = 0) -> float:
        """A draft step; ``draft_vocab`` > 0: its head scores only that many token ids (cost linear
        in rows)."""
        saved = self.head * (1 - draft_vocab / self.vocab) if 0 < draft_vocab < self.vocab else 0.0
        return (
            self.base_step
            - saved
            + self.draft_overhead
            + attention_kept * self.attention
            + mlp_kept * self.mlp
        )

    def prefix_fraction(self, first_skipped_sublayer: int) -> float:
        """Share of the layer stack's cost before the first skipped sublayer (the verify pass
        resumes there)."""
        s = first_skipped_sublayer
        attention_before, mlp_before = (s + 1) // 2, s // 2
        total = self.num_layers * (self.attention + self.mlp)
        return (
            (attention_before * self.attention + mlp_before * self.mlp) / total
            if total > 0
            else 0.0
        )

    def verify_cost(self, rows: int, tail_rows: int, prefix_fraction: float = 0.0) -> float:
        """A verify pass over ``rows`` tokens that resumes from the draft's hidden states at the
        first skipped sublayer; ``tail_rows`` rows (0 or 1) the draft did not cover run the
        prefix too."""
        total = self._interp(self.verify_sizes, self.verify, rows)
        base = self._interp(self.verify_sizes, self.verify_base, rows)
        stack = max(0.0, total - base)
        stack_one = max(
            0.0,
            self._interp(self.verify_sizes, self.verify, 1)
            - self._interp(self.verify_sizes, self.verify_base, 1),
        )
        return base + (1.0 - prefix_fraction) * stack + prefix_fraction * stack_one * tail_rows

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(**data)


def non_decreasing(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): a pass over more tokens never
    costs less."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]
    return [m for m, c in blocks for _ in range(c)]


def measure_costs(
    runner: ModelRunner,
    context_ids: list[int],
    repeats: int = 5,
    sizes: Sequence[int] = VERIFY_SIZES,
) -> CostModel:
    """Time the passes of a round on ``runner`` with ``context_ids`` cached.

    Every measurement is repeated ``repeats`` times, interleaved, and the fastest repeat is kept: on
    a shared machine the fastest run is the one least disturbed by other work, so it estimates the
    pass's own cost far more stably than the median (which drifts with the machine's load).
    """
    timer = _PassTimer(runner, context_ids, sizes)
    times, verify_full, verify_none = timer.measure(repeats)
    best = {name: min(v) for name, v in times.items()}
    L, vocab = runner.num_layers, runner.head_rows
    # Split the layer stack's cost (full minus nothing) between attention and MLP in the measured
    # proportion, so a draft that skips nothing costs exactly a plain step.
    stack = max(0.0, best["full"] - best["none"])
    raw_attention = max(0.0, best["full"] - best["no_attention"])
    raw_mlp = max(0.0, best["full"] - best["no_mlp"])
    share = raw_attention / (raw_attention + raw_mlp) if raw_attention + raw_mlp > 0 else 0.5
    return CostModel(
        full_step=best["full"],
        base_step=best["none"],
        attention=stack * share / L,
        mlp=stack * (1 - share) / L,
        num_layers=L,
        verify_sizes=list(sizes),
        verify=non_decreasing([min(verify_full[k]) for k in sizes]),
        verify_base=non_decreasing([min(verify_none[k]) for k in sizes]),
        context=timer.start,
        draft_overhead=best["overhead"],
        head=max(0.0, best["none"] - best["none_tiny_head"]) * vocab / max(1, vocab - 64),
        vocab=vocab,
    )


class _PassTimer:
    """Times single-token passes with sublayers skipped and verify passes over k tokens."""

    def __init__(self, runner: ModelRunner, context_ids: list[int], sizes: Sequence[int]):
        import torch

        self.runner, self.sizes = runner, sizes
        context = list(context_ids)
        self.start = len(context)
        runner.reset(self.start + max(sizes) + 4)
        runner.forward(torch.tensor(context), 0, last_logits_only=True)
        self.token = torch.tensor([context[-1]])
        self.ids_k = {
            k: torch.tensor((context * (1 + k // max(1, len(context))))[-k:]) for k in sizes
        }
        every = frozenset(range(runner.num_layers))
        self.every = every
        none = frozenset()
        self.variants = {
            "full": (none, none, None),
            "no_attention": (every, none, None),
            "no_mlp": (none, every, None),
            "none": (every, every, None),
            "none_tiny_head": (every, every, 64),
        }

    def single(self, skip_attention, skip_mlp, head_rows=None) -> float:
        import torch

        t0 = time.perf_counter()
        logits, _ = self.runner.forward(
            self.token, self.start, skip_attention, skip_mlp, vocab=head_rows
        )
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - t0

    def overhead(self) -> float:
        """softmax, top probability and argmax over one row of logits: a draft step's extra work."""
        import torch

        logits = torch.randn(1, self.runner.loaded.model.config.vocab_size)
        t0 = time.perf_counter()
        q = torch.softmax(logits[-1], dim=-1)
        float(q.max())
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - t0

    def verify(self, k: int, skip: frozenset) -> float:
        import torch

        t0 = time.perf_counter()
        logits, _ = self.runner.forward(self.ids_k[k], self.start, skip, skip)
        torch.argmax(logits, dim=-1).tolist()
        return time.perf_counter() - t0

    def measure(self, repeats: int):
        for variant in self.variants.values():  # warm-up
            self.single(*variant)
        self.verify(max(self.sizes), frozenset())
        times: dict[str, list[float]] = {name: [] for name in [*self.variants, "overhead"]}
        full: dict[int, list[float]] = {k: [] for k in self.sizes}
        none: dict[int, list[float]] = {k: [] for k in self.sizes}
        for _ in range(repeats):
            for name, variant in self.variants.items():
                times[name].append(self.single(*variant))
            times["overhead"].append(self.overhead())
            for k in self.sizes:
                full[k].append(self.verify(k, frozenset()))
                none[k].append(self.verify(k, self.every))
        return times, full, none
