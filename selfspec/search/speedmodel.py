"""The search's objective: a skip set and draft policy scored without generating.

Per trial, one teacher-forced forward of the draft over each calibration continuation (the
prompt's keys and values are the full model's, as in real decoding) gives the draft's argmax and
top probability at every position; greedy speculation is then replayed round by round
(``simulate``) and priced with the measured cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfspec.errors import SelfSpecError
from selfspec.runtime.plan import ModelIdentity, SkipPlan
from selfspec.search.calibration import CalibrationItem
from selfspec.search.cost_model import CostModel
from selfspec.search.simulate import SimResult, simulate

if TYPE_CHECKING:
    from selfspec.engine import Engine
    from selfspec.runtime.draft_vocab import DraftVocab


@dataclass
class TrialEval:
    """A skip set and policy scored by the speed model."""

    sim: SimResult
    agreement: float  # share of positions where the draft's argmax equals the target's token
    draft_step: float
    pruned: bool = False

    @property
    def predicted_speedup(self) -> float:
        return self.sim.speedup


class SpeedModel:
    """Scores a skip set and draft policy: teacher-forced draft passes + replayed speculation."""

    def __init__(self, engine: Engine, items: list[CalibrationItem], costs: CostModel):
        import torch

        self.engine, self.items, self.costs = (
            engine,
            [i for i in items if len(i.continuation) >= 2],
            costs,
        )
        if not self.items:
            raise SelfSpecError(
                "every calibration continuation is shorter than 2 tokens (the model stopped at "
                "once); use other prompts or more --tokens."
            )
        self.runner = engine.runner
        self.max_len = max(len(i.prompt_ids) + len(i.continuation) for i in self.items) + 2
        self.runner.reset(self.max_len)
        self.snapshots = []  # the full model's keys/values over each prompt
        for item in self.items:
            P = len(item.prompt_ids)
            self.runner.forward(torch.tensor(item.prompt_ids), 0, last_logits_only=True)
            cache = self.runner.cache
            self.snapshots.append(
                (cache.keys[:, :, :, :P].clone(), cache.values[:, :, :, :P].clone())
            )

    def draft_predictions(self, index: int, skip_attention, skip_mlp, draft_vocab: int = 0):
        """(agree [n] bool list, top probability [n] list) of the draft along item ``index``'s
        continuation."""
        import torch

        item = self.items[index]
        P = len(item.prompt_ids)
        self.runner.reset(self.max_len)
        keys, values = self.snapshots[index]
        self.runner.cache.keys[:, :, :, :P].copy_(keys)
        self.runner.cache.values[:, :, :, :P].copy_(values)
        inputs = item.continuation[:-1]
        vocab = self._draft_vocab(item, draft_vocab) if draft_vocab else None
        logits, _ = self.runner.forward(
            torch.tensor(inputs), P, frozenset(skip_attention), frozenset(skip_mlp), vocab=vocab
        )
        if vocab is not None:
            logits = self._per_position(vocab, logits, item)
        top, arg = torch.softmax(logits, dim=-1).max(dim=-1)
        agree = (arg == torch.tensor(item.continuation[1:])).tolist()
        return agree, top.tolist()

    def _draft_vocab(self, item: CalibrationItem, prefix: int) -> DraftVocab:
        """The ids the drafter's head scores somewhere along this continuation (as it runs:
        the prefix, the stop tokens and the context's ids)."""
        from selfspec.runtime.draft_vocab import DraftVocab

        vocab = DraftVocab(prefix, self.runner.head_rows, always=self.engine.eos_ids())
        vocab.follow(item.prompt_ids + item.continuation[:-1])
        return vocab

    @staticmethod
    def _per_position(vocab: DraftVocab, logits, item: CalibrationItem):
        """[n, prefix + E] -> [n, vocab size]: at each position only the ids the drafter would
        score there (an id the continuation brings first is not scored before it appears)."""
        import torch

        rows = torch.stack([vocab.spread(row) for row in logits])
        first = {}
        for i, t in enumerate(item.continuation[:-1]):
            first.setdefault(t, i)
        context = set(item.prompt_ids) | set(vocab.always)
        for t in vocab.extra:
            if t not in context:
                rows[: first[t], t] = float("-inf")  # row r's context ends with input r
        return rows

    def evaluate(
        self,
        skip_attention,
        skip_mlp,
        max_draft: int,
        threshold: float,
        adaptive: bool,
        on_prompt: Callable[[int, float], bool] | None = None,
        draft_vocab: int = 0,
    ) -> TrialEval:
        """Score a plan. ``on_prompt(index, agreement so far)`` may return True to stop early
        (pruned)."""
        L = self.costs.num_layers
        skip_attention, skip_mlp = sorted(set(skip_attention)), sorted(set(skip_mlp))
        probe = SkipPlan(ModelIdentity("", "", L, ""), skip_attention, skip_mlp)
        costs = self.costs
        draft_step = costs.draft_step(L - len(skip_attention), L - len(skip_mlp), draft_vocab)
        fraction = costs.prefix_fraction(probe.first_skipped_sublayer())

        def verify_cost(rows, tail):
            return costs.verify_cost(rows, tail, fraction)

        total, agreed, positions = SimResult(), 0, 0
        for index in range(len(self.items)):
            agree, confidence = self.draft_predictions(index, skip_attention, skip_mlp, draft_vocab)
            agreed += sum(agree)
            positions += len(agree)
            total = total + simulate(
                agree,
                confidence,
                max_draft=max_draft,
                threshold=threshold,
                adaptive=adaptive,
                draft_step_cost=draft_step,
                verify_cost=verify_cost,
                plain_step_cost=costs.full_step,
            )
            if on_prompt is not None and on_prompt(index, agreed / positions):
                return TrialEval(total, agreed / positions, draft_step, pruned=True)
        return TrialEval(total, agreed / positions if positions else 0.0, draft_step)
