"""Drafters: anything that proposes the next few tokens, behind one small interface.

The decode loop calls ``begin`` once per generation, ``propose`` once per round and
``observe`` with the outcome. Adaptation (the confidence threshold, and whatever else a
drafter learns from the stream it serves) lives in the drafter, never in the loop. A new
drafter is a new class here, never a new loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.adaptation import AdaptiveThreshold
from selfspec.runner import ModelRunner, Resume
from selfspec.sampling import Sampling

if TYPE_CHECKING:
    from selfspec.plan import SkipPlan


@dataclass
class DraftRequest:
    """What the loop tells a drafter each round."""

    committed: list[
        int
    ]  # every token so far, prompt included; the last is not yet in the target cache
    max_tokens: int
    sampling: Sampling
    generator: torch.Generator | None


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = (
        None  # [len(tokens), vocab]: q each token was drawn from (sampling only)
    )
    resume: Resume | None = (
        None  # hidden states the verify pass can start from (self-drafting only)
    )


class Drafter:
    """Interface. ``propose`` may return an empty draft: the round is then a plain decoding step.

    ``begin(prompt_ids, max_len, threshold)``: a new generation; ``threshold`` is the confidence
    threshold the drafter stops at, which it owns and adapts in ``observe``.
    ``propose(request)``: up to ``request.max_tokens`` tokens after ``request.committed``, with
    the probabilities they were drawn from when sampling.
    ``observe(drafted, accepted)``: how the last proposal fared.
    """

    name = "drafter"

    def __init__(self) -> None:
        self.threshold = AdaptiveThreshold()

    def begin(self, prompt_ids: list[int], max_len: int, threshold: AdaptiveThreshold) -> None:
        self.threshold = threshold

    def propose(self, request: DraftRequest) -> Draft:
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int) -> None:
        self.threshold.update(drafted, accepted)


def _draft_loop(step, first_token: int, request: DraftRequest, threshold: float):
    """Shared autoregressive drafting: ``step(token, offset)`` returns (logits [vocab], extra).

    Stops at max_tokens, or before proposing a token whose drafter confidence is below threshold.
    Returns (tokens, probs list, extras list); extras has one entry per step run.
    """
    tokens, probs, extras = [], [], []
    token = first_token
    for offset in range(request.max_tokens):
        logits, extra = step(token, offset)
        extras.append(extra)
        q = request.sampling.probs(logits)
        if float(q.max()) < threshold:
            break
        token = (
            int(torch.argmax(logits))
            if request.sampling.greedy
            else int(torch.multinomial(q, 1, generator=request.generator))
        )
        tokens.append(token)
        probs.append(q)
    return tokens, probs, extras


class SelfSkipDrafter(Drafter):
    """The target drafts for itself with a plan's sublayers skipped, writing into the shared cache.

    Sublayers before the first skipped one compute exactly what the full model computes, so
    the hidden state entering it is kept and the verify pass resumes from there.
    """

    name = "self_speculative"

    def __init__(self, runner: ModelRunner, plan: SkipPlan):
        super().__init__()
        self.runner = runner
        self.plan = plan
        self.skip_attention = frozenset(plan.skip_attention)
        self.skip_mlp = frozenset(plan.skip_mlp)
        self.resume_at = plan.first_skipped_sublayer()
        draft_vocab = plan.policy.draft_vocab
        self.draft_vocab = draft_vocab if draft_vocab and draft_vocab < runner.head_rows else None

    def propose(self, request: DraftRequest) -> Draft:
        start = len(request.committed) - 1  # position of the pending token

        def step(token, offset):
            ids = torch.tensor([token])
            logits, hidden = self.runner.forward(
                ids,
                start + offset,
                self.skip_attention,
                self.skip_mlp,
                capture_at=self.resume_at,
                vocab=self.draft_vocab,
            )
            logits = logits[-1]
            if self.draft_vocab:  # token ids past the draft head can never be drafted: q = 0 there
                logits = torch.cat(
                    [
                        logits,
                        logits.new_full((self.runner.head_rows - self.draft_vocab,), float("-inf")),
                    ]
                )
            return logits, hidden

        tokens, probs, hiddens = _draft_loop(
            step, request.committed[-1], request, self.threshold.value
        )
        resume = None
        if self.resume_at > 0 and hiddens:
            rows = min(
                len(hiddens), len(tokens) + 1
            )  # verify scores the pending token plus the drafts
            resume = Resume(self.resume_at, torch.cat(hiddens[:rows], dim=1))
        return Draft(
            tokens, torch.stack(probs) if probs and not request.sampling.greedy else None, resume
        )


class ModelDrafter(Drafter):
    """A separate, smaller model with the same tokenizer and a cache of its own (dual-model drafting)."""

    name = "dual_model"

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.fed: list[int] = []  # tokens whose keys/values are in the draft cache, in order

    def begin(self, prompt_ids: list[int], max_len: int, threshold: AdaptiveThreshold) -> None:
        super().begin(prompt_ids, max_len, threshold)
        self.runner.reset(max_len)
        self.fed = []

    def propose(self, request: DraftRequest) -> Draft:
        committed = request.committed
        valid = (
            0  # the draft cache is good up to the first token that differs from what was committed
        )
        limit = min(len(self.fed), len(committed) - 1)
        while valid < limit and self.fed[valid] == committed[valid]:
            valid += 1
        catch_up = committed[valid:]
        self.fed = committed[:valid]

        def step(token, offset):
            feed = catch_up if offset == 0 else [token]
            logits, _ = self.runner.forward(torch.tensor(feed), len(self.fed))
            self.fed.extend(feed)
            return logits[-1], None

        tokens, probs, _ = _draft_loop(step, committed[-1], request, self.threshold.value)
        return Draft(tokens, torch.stack(probs) if probs and not request.sampling.greedy else None)
