"""Dual-model drafting: a separate, smaller model of the same family drafts with a cache of its
own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from selfspec.drafters.base import Draft, Drafter, DraftRequest, DraftSettings, draft_loop

if TYPE_CHECKING:
    from selfspec.runtime.runner import ModelRunner


class ModelDrafter(Drafter):
    """A separate, smaller model with the same tokenizer and a cache of its own."""

    name = "dual_model"

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.fed: list[int] = []  # tokens whose keys/values are in the draft cache, in order

    def describe(self) -> str:
        return f"dual-model drafting with {self.runner.loaded.name}"

    def begin(self, prompt_ids: list[int], max_len: int, settings: DraftSettings) -> None:
        super().begin(prompt_ids, max_len, settings)
        self.runner.reset(max_len)
        self.fed = []

    def draft(self, request: DraftRequest) -> Draft:
        committed = request.committed
        valid = (
            0  # the draft cache is good up to the first token that differs from what was committed
        )
        limit = min(len(self.fed), len(committed) - 1)
        while valid < limit and self.fed[valid] == committed[valid]:
            valid += 1
        catch_up = committed[valid:]
        self.fed = committed[:valid]

        def step(token: int, offset: int):
            feed = catch_up if offset == 0 else [token]
            logits, _ = self.runner.forward(torch.tensor(feed), len(self.fed))
            self.fed.extend(feed)
            return logits[-1], None

        tokens, probs, _ = draft_loop(step, committed[-1], request, self.threshold.value)
        probs = torch.stack(probs) if probs and not request.sampling.greedy else None
        return Draft(tokens, probs, source=self.name)
