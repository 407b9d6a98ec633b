"""The target drafts for itself with a plan's sublayers skipped, over the shared KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from selfspec.drafters.base import Draft, Drafter, DraftRequest, DraftSettings, draft_loop
from selfspec.runtime.draft_vocab import DraftVocab
from selfspec.runtime.runner import Resume

if TYPE_CHECKING:
    from selfspec.runtime.plan import SkipPlan
    from selfspec.runtime.runner import ModelRunner


class SelfSkipDrafter(Drafter):
    """Runs the target with a plan's sublayers skipped, writing into the shared cache.

    Sublayers before the first skipped one compute exactly what the full model computes, so
    the hidden state entering it is kept and the verify pass resumes from there.
    """

    name = "layer_skip"

    def __init__(self, runner: ModelRunner, plan: SkipPlan, stop_ids: tuple[int, ...] = ()):
        """``stop_ids``: the tokens that end a generation; a draft head that scores only some
        ids (the plan's ``draft_vocab``) scores these too, and every id the context has used."""
        super().__init__()
        self.runner = runner
        self.plan = plan
        self.skip_attention = frozenset(plan.skip_attention)
        self.skip_mlp = frozenset(plan.skip_mlp)
        self.resume_at = plan.first_skipped_sublayer()
        draft_vocab = plan.policy.draft_vocab
        self.draft_vocab = draft_vocab if draft_vocab and draft_vocab < runner.head_rows else None
        self.vocab = None
        if self.draft_vocab:
            self.vocab = DraftVocab(self.draft_vocab, runner.head_rows, always=stop_ids)
        self.last_steps = 0  # draft steps the last draft ran (a step below the threshold included)

    def begin(self, prompt_ids: list[int], max_len: int, settings: DraftSettings) -> None:
        super().begin(prompt_ids, max_len, settings)
        if self.vocab is not None:
            self.vocab.reset()

    def describe(self) -> str:
        return f"layer-skip drafts every round, {self.plan.describe()}"

    def policy_defaults(self) -> dict:
        policy = self.plan.policy
        return {
            "max_draft_tokens": policy.max_draft_tokens,
            "confidence_threshold": policy.confidence_threshold,
            "adaptive_threshold": policy.adaptive_threshold,
        }

    def _step(self, start: int):
        vocab = self.vocab

        def step(token: int, offset: int):
            logits, hidden = self.runner.forward(
                torch.tensor([token]),
                start + offset,
                self.skip_attention,
                self.skip_mlp,
                capture_at=self.resume_at,
                vocab=vocab,
            )
            logits = logits[-1]
            if vocab is not None:  # ids the draft head does not score are never drafted: q = 0
                logits = vocab.spread(logits)
            return logits, hidden

        return step

    def draft(self, request: DraftRequest) -> Draft:
        start = len(request.committed) - 1  # position of the pending token
        if self.vocab is not None:
            self.vocab.follow(request.committed)
        tokens, probs, hiddens = draft_loop(
            self._step(start), request.committed[-1], request, self.threshold.value
        )
        self.last_steps = len(hiddens)
        resume = None
        if self.resume_at > 0 and hiddens:
            # verify scores the pending token plus the drafts
            rows = min(len(hiddens), len(tokens) + 1)
            resume = Resume(self.resume_at, torch.cat(hiddens[:rows], dim=1))
        probs = torch.stack(probs) if probs and not request.sampling.greedy else None
        return Draft(tokens, probs, resume, source=self.name)
