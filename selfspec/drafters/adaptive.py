"""The default drafter: free context drafts where the context repeats itself, draft-head, recycled
and layer-skip drafts where they pay, plain decoding otherwise, each round chosen from measured
costs.

Per round, for every way to draft, the drafter estimates the tokens the round would emit (from
the acceptance it has measured for that kind of draft) and what the round would cost (from the
verify passes and draft steps it has timed in this generation), and picks the way with the most
tokens per second, drafting nothing when no draft beats a plain step. A kind of draft believed
unprofitable is tried again now and then, so an early bad estimate is never final.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from selfspec.drafters.base import (
    Draft,
    Drafter,
    DraftRequest,
    DraftSettings,
    RoundOutcome,
    tree_draft,
)
from selfspec.drafters.ngram import MIN_NGRAM, ContextIndex
from selfspec.drafters.pass_costs import PassCosts, RecentMedian

if TYPE_CHECKING:
    from selfspec.drafters.heads import HeadDrafter
    from selfspec.drafters.layerskip import SelfSkipDrafter
    from selfspec.drafters.recycled import RecycledDrafts

_PRIOR_ACCEPTANCE = 0.6  # what a kind of draft is assumed to achieve before it is measured
_PRIOR_WEIGHT = 2.0  # in rounds
_PROBE_EVERY = 48  # rounds between tries of a kind of draft believed unprofitable
_MAX_PROBE_GAP = 16 * _PROBE_EVERY
_GAIN_MARGIN = 1.02  # a draft must beat a plain step by this much
# Layer-skip rounds cost more than their timed steps say (the draft's own overhead, cache rows it
# rewrites) and their estimate is noisier: they must promise more.
_SKIP_MARGIN = 1.10
_DECAY = 0.97  # per round, the weight of what was measured before
# At most this many rounds of earlier generations' acceptance carry into a new one: how often a
# kind of draft is kept depends on the text (a summary copies its source, a rewrite does not), so
# a few rounds of the new text must be able to outweigh it.
_CARRY_WEIGHT = 4.0
_PROBE_TOKENS = 2  # a probe of layer-skip drafting believed unprofitable drafts this many
# Rounds between one-token tries of a cheap kind of draft (context, heads) believed unprofitable:
# without them one slow pass timed on a busy machine could stop it for good (only its own rounds
# time the longer passes that would correct the estimate).
_CHEAP_PROBE_EVERY = 16


class Calibration:
    """How far estimated chances come true: kept / expected tokens over recent rounds (each
    round's weight decays by ``_DECAY``), 1 before any round, within [0.25, 2]."""

    def __init__(self, prior_tokens: float = 2.0):
        self.prior = prior_tokens
        self.expected = self.kept = 0.0

    def record(self, expected: float, kept: int) -> None:
        self.expected = _DECAY * self.expected + expected
        self.kept = _DECAY * self.kept + kept

    @property
    def value(self) -> float:
        ratio = (self.kept + self.prior) / (self.expected + self.prior)
        return min(2.0, max(0.25, ratio))


def most_tokens_per_second(
    gains: list[float],
    cost: Callable[[int], float],
    base_tokens: float,
    margin: float = _GAIN_MARGIN,
) -> int:
    """How many of ``gains`` to take, in order, for the most tokens per second: taking n emits
    ``base_tokens`` plus the first n gains (expected tokens each adds) in ``cost(n)`` seconds.
    0 unless some n beats taking none by ``margin``."""
    best_n, best_rate = 0, margin * base_tokens / cost(0)
    tokens = base_tokens
    for n, gain in enumerate(gains, start=1):
        tokens += gain
        rate = tokens / cost(n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


class _AllKept:
    """The acceptance of drafts that are always kept: what the best case would pay."""

    @staticmethod
    def rate(i: int) -> float:
        return 1.0


_ALL_KEPT = _AllKept()


class Acceptance:
    """P(the i-th drafted token is kept | the ones before it were), per kind of draft; older rounds
    count less and less, so the estimate follows the stream."""

    def __init__(self, width: int, prior: list[float] | None = None) -> None:
        self.tried = [0.0] * width
        self.kept = [0.0] * width
        self.prior = prior or [_PRIOR_ACCEPTANCE] * width  # before a position is measured

    def rate(self, i: int) -> float:
        i = min(i, len(self.tried) - 1)
        return (self.kept[i] + self.prior[i] * _PRIOR_WEIGHT) / (self.tried[i] + _PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        self.tried = [t * _DECAY for t in self.tried]
        self.kept = [k * _DECAY for k in self.kept]
        for i in range(min(drafted, len(self.tried))):
            if i > accepted:
                break
            self.tried[i] += 1
            self.kept[i] += i < accepted

    def carry_over(self, weight: float = _CARRY_WEIGHT) -> None:
        """A new generation begins: what earlier ones measured keeps its rates but counts as at
        most ``weight`` rounds."""
        for i, tried in enumerate(self.tried):
            if tried > weight:
                self.kept[i] *= weight / tried
                self.tried[i] = weight

    def expected_tokens(self, k: int) -> float:
        """Tokens a round emits when it drafts k: the target's own token plus the kept prefix."""
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.rate(i)
            total += survive
        return total


class AdaptiveDrafter(Drafter):
    """Context n-gram drafts, draft-head drafts, recycled drafts, layer-skip drafts (with a plan) or
    none, chosen round by round."""

    name = "self_speculative"
    # This drafter weighs costs itself every round, so its speed guard is only a backstop against a
    # wrong cost model; over the base guard's 8 rounds, cheap drafts kept 40% of the time look
    # slower than plain steps by chance alone, and each pause costs 16+ rounds.
    guard_window = 24

    def __init__(
        self,
        vocab: int,
        layer_skip: SelfSkipDrafter | None = None,
        max_tokens: int = 16,
        min_ngram: int = MIN_NGRAM,
        planned: bool = True,
        heads: HeadDrafter | None = None,
        recycled: RecycledDrafts | None = None,
        trees: bool = False,
        head_trees: bool = False,
    ):
        """``planned=False``: draft every context match in full, without weighing costs (tests).
        ``trees=True``: recycled drafts may branch where the loop verifies trees;
        ``head_trees=True``: head drafts may."""
        super().__init__()
        self.vocab, self.layer_skip, self.max_tokens = vocab, layer_skip, max_tokens
        self.head_step = RecentMedian()  # a head draft's seconds / a plain step's
        self.use_heads(heads)
        self.recycled, self.trees, self.head_trees = recycled, trees, head_trees
        self._tree_chances: list[float] | None = None  # of the current round's head tree
        self.recycled_calibration = Calibration()  # recycled drafts' kept tokens / chances' sum
        self._recycled_chances: list[float] = []  # of the current round's recycled draft
        self.planned = planned
        self.plan = layer_skip.plan if layer_skip is not None else None
        self.index = ContextIndex(min_ngram=min_ngram)
        # What it measures describes the machine, the model and the stream: it carries over from one
        # generation to the next (the estimates weigh recent rounds most).
        self.costs = PassCosts()
        self.ngram: dict[int, Acceptance] = {}  # by n-gram length
        self.skip = Acceptance(max_tokens)
        self.rounds = 0
        self.next_skip_probe = 0  # round at which layer-skip drafting is next tried regardless
        self.probe_gap = _PROBE_EVERY
        self.next_cheap_probe = dict.fromkeys(("ngram", "heads", "recycled"), _CHEAP_PROBE_EVERY)
        self._steps = 0  # layer-skip draft steps of the current round
        self._ngram_n = 0
        # Context drafts of a new text are one token long until the text keeps one: the acceptance
        # carried over from other texts says little about this one, and a long draft of a text
        # that does not repeat itself costs rows for nothing.
        self.ngram_cap = 1

    def use_heads(self, heads: HeadDrafter | None) -> None:
        """Draft with ``heads`` from the next generation on (a server's heads trained while it
        was idle): their acceptance and calibration start again; the time of a head step,
        measured on heads of the same shape, carries over."""
        self.heads = heads
        self.head_acceptance = None
        if heads is not None:
            self.head_acceptance = Acceptance(len(heads.heads), head_prior(heads.heads.info))
        self.head_calibration = Calibration()  # head drafts' kept tokens / their chances' sum

    def describe(self) -> str:
        kinds = ["drafts from the context (n-gram lookup) where it repeats itself"]
        if self.heads is not None:
            kinds.append(f"draft heads where they pay ({self.heads.describe()})")
        if self.recycled is not None:
            kinds.append("the model's own earlier predictions where they pay (recycled)")
        if self.plan is not None:
            kinds.append(f"layer-skip drafts where they pay ({self.plan.describe()})")
        return ", else ".join(kinds) + ", chosen each round from measured costs"

    def begin(self, prompt_ids: list[int], max_len: int, settings: DraftSettings) -> None:
        super().begin(prompt_ids, max_len, settings)
        self.index.reset()
        self.ngram_cap = 1
        self._tree_chances = None
        for acceptance in (self.skip, *self.ngram.values(), self.head_acceptance):
            if acceptance is not None:
                acceptance.carry_over()
        if self.layer_skip is not None:
            self.layer_skip.begin(prompt_ids, max_len, settings)
        if self.heads is not None:
            self.heads.begin(prompt_ids, max_len, settings)

    # -- planning ---------------------------------------------------------------------------------
    def _best_length(
        self, acceptance: Acceptance, limit: int, step: float = 0.0, margin: float = _GAIN_MARGIN
    ) -> int:
        """The draft length with the most expected tokens per second (0: a plain step beats them
        all): a round drafting k emits 1 + sum_i prod_{j<=i} a_j tokens and costs k draft steps of
        ``step`` seconds plus a verify pass over k + 1 rows."""
        survive, kept = 1.0, []  # P(the k-th drafted token is kept)
        for k in range(limit):
            survive *= acceptance.rate(k)
            kept.append(survive)

        def cost(k: int) -> float:
            return self.costs.verify_cost(k + 1) + k * step

        return most_tokens_per_second(kept, cost, 1.0, margin)

    # -- drafting -------------------------------------------------------------------------------
    def draft(self, request: DraftRequest) -> Draft:
        self.rounds += 1
        self._steps, self._ngram_n = 0, 0
        limit = min(request.max_tokens, self.max_tokens)
        if self.recycled is not None:
            self.recycled.absorb(request.committed)  # the last pass's predictions, every round
        if self.planned and self.costs.verify_cost(1) is None:
            return Draft()  # time a plain step first: plans need it
        self.index.sync(request.committed)
        match = self.index.lookup(limit)
        if match is not None:
            acceptance = self.ngram.setdefault(match.ngram, Acceptance(self.max_tokens))
            k = len(match.tokens)
            if self.planned:
                k = min(self._or_probe("ngram", self._best_length(acceptance, k)), self.ngram_cap)
            if k:
                self._ngram_n = match.ngram
                tokens = match.tokens[:k]
                return Draft(tokens, source="ngram")  # certain: q = 1 on each token
        if self.layer_skip is None or self.rounds < self.next_skip_probe:
            draft = self._head_draft(request, limit)
            if not draft.tokens:
                draft = self._recycled_draft(request, limit)
            if draft.tokens:
                return draft
        return self._layer_skip_draft(request, limit)

    def _recycled_draft(self, request: DraftRequest, limit: int) -> Draft:
        """The model's own earlier predictions walked from the pending token, as long as pays:
        each token's chance (the model's probabilities back then, scaled by how far such chances
        have come true) against the verify row it costs; they cost no pass."""
        if self.recycled is None:
            return Draft()
        parents = None
        if (
            request.tree_nodes and self.trees
        ):  # the most likely nodes first: each prefix of them is a tree
            nodes = min(request.tree_nodes, self.max_tokens)
            tokens, parents, chances = self.recycled.tree(request.committed, nodes, limit)
        else:
            tokens, chances = self.recycled.chain(request.committed, limit)
        k = len(tokens)
        if self.planned and k:
            # a node's chance is that of its being kept, so the gains add up as a chain's do
            calibration = self.recycled_calibration.value
            gains = [calibration * c for c in chances]
            k = most_tokens_per_second(gains, lambda n: self.costs.verify_cost(n + 1), 1.0)
            k = self._or_probe("recycled", k)
        if not k:
            return Draft()
        self._recycled_chances = chances[:k]
        return tree_draft(tokens[:k], None if parents is None else parents[:k], "recycled")

    def _head_draft(self, request: DraftRequest, limit: int) -> Draft:
        """Draft-head tokens when their expected tokens per second beat a plain step's and the
        layer-skip drafts'."""
        if self.heads is None or self.costs.plain is None:
            return Draft()
        step = (self.head_step.value or 0.0) * self.costs.plain
        limit = min(limit, len(self.heads.heads))
        if self.head_trees and request.tree_nodes:
            return self._head_tree(request, limit, step)
        k = self._best_length(self.head_acceptance, limit, step)
        if k and self._rate(self.head_acceptance, k, step) < self._skip_rate(limit):
            k = 0
        if not self._or_probe("heads", k):
            return Draft()
        if not k:  # a probe: one guess whatever its chance, so that it measures something
            return self.heads.draft(
                DraftRequest(request.committed, 1, request.sampling, request.generator)
            )
        sub = DraftRequest(request.committed, limit, request.sampling, request.generator)
        return self.heads.draft(sub, self._head_worth(step))

    def _head_tree(self, request: DraftRequest, limit: int, step: float) -> Draft:
        """A tree of head guesses (``HeadDrafter.tree``), cut where verifying more of its nodes
        stops paying: its head steps are spent by then, only its rows are left to weigh."""
        nodes = min(request.tree_nodes, self.max_tokens)
        sub = DraftRequest(request.committed, limit, request.sampling, request.generator, nodes)
        draft = self.heads.tree(sub, self._head_worth(0.0) if self.planned else None)
        chances = self.heads.last_chances
        k = len(draft.tokens)
        if self.planned and k:
            gains = [self.head_calibration.value * c for c in chances]
            k = most_tokens_per_second(gains, lambda n: self.costs.verify_cost(n + 1), 1.0)
            tokens = 1.0 + sum(gains[:k])
            seconds = self.costs.verify_cost(k + 1) + self.heads.last_steps * step
            if k and tokens / seconds < self._skip_rate(limit):
                k = 0
            k = self._or_probe("heads", k)
        self._tree_chances = chances[:k] if k else None
        cut = None if draft.parents is None else draft.parents[:k]
        return tree_draft(draft.tokens[:k], cut, draft.source)

    def _head_worth(self, step: float) -> Callable[[list[float]], bool]:
        """Whether a round's next head guess adds more tokens per second than it costs, from its
        chance of being kept (the heads' confidence, scaled by how it has come true): a guess with
        chance c raises a round's expected tokens E by c and its cost C by one verify row and one
        head step, so it pays while c / (row + step) >= E / C."""
        calibration = self.head_calibration.value

        def worth(chances: list[float]) -> bool:
            j = len(chances) - 1
            expected = 1.0 + calibration * sum(chances[:-1])
            cost = self.costs.verify_cost(j + 1) + j * step
            extra = self.costs.verify_cost(j + 2) - self.costs.verify_cost(j + 1) + step
            return calibration * chances[-1] * cost >= _GAIN_MARGIN * extra * expected

        return worth

    def _or_probe(self, kind: str, k: int) -> int:
        """``k``; or 1 where it is 0 but this cheap kind of draft has not run for
        ``_CHEAP_PROBE_EVERY`` rounds, so an estimate that it does not pay is never final."""
        if not k and self.rounds < self.next_cheap_probe[kind]:
            return 0
        self.next_cheap_probe[kind] = self.rounds + _CHEAP_PROBE_EVERY
        return k or 1

    def _rate(self, acceptance: Acceptance, k: int, step: float) -> float:
        return acceptance.expected_tokens(k) / (self.costs.verify_cost(k + 1) + k * step)

    def _skip_rate(self, limit: int) -> float:
        """Expected tokens per second of the best layer-skip draft (0 while it is unmeasured)."""
        step = self.costs.draft_step
        if self.layer_skip is None or step is None:
            return 0.0
        k = self._best_length(self.skip, limit, step, _SKIP_MARGIN)
        return self._rate(self.skip, k, step) / _SKIP_MARGIN if k else 0.0

    def _layer_skip_draft(self, request: DraftRequest, limit: int) -> Draft:
        if self.layer_skip is None:
            return Draft()
        step = self.costs.draft_step
        k = 0 if step is None else self._best_length(self.skip, limit, step, _SKIP_MARGIN)
        if k:
            self.probe_gap = _PROBE_EVERY
        elif self.rounds >= self.next_skip_probe:
            # Believed unprofitable (or never measured): try it anyway now and then, less often
            # each time it disappoints, so an early bad estimate is never final. Where even drafts
            # that were all kept would not pay at the timed costs, only a change of costs could
            # help: try again after the longest gap.
            k = min(limit, _PROBE_TOKENS)
            if step is not None and not self._could_pay(limit, step):
                self.probe_gap = _MAX_PROBE_GAP
                k = 0
            self.next_skip_probe = self.rounds + self.probe_gap
            self.probe_gap = min(_MAX_PROBE_GAP, 2 * self.probe_gap)
        if not k:
            return Draft()
        sub = DraftRequest(request.committed, k, request.sampling, request.generator)
        draft = self.layer_skip.draft(sub)
        self._steps = self.layer_skip.last_steps
        draft.source = "layer_skip"
        return draft

    def _could_pay(self, limit: int, step: float) -> bool:
        """Whether some draft length would beat a plain step if every drafted token were kept."""
        return self._best_length(_ALL_KEPT, limit, step, _SKIP_MARGIN) > 0

    def observe(self, outcome: RoundOutcome) -> None:
        # The confidence threshold is the layer-skip drafter's: only its rounds move it.
        self.guard.record(
            outcome.drafted, outcome.accepted, outcome.draft_seconds, outcome.verify_seconds
        )
        self.learn(outcome)

    def learn(self, outcome: RoundOutcome) -> None:
        self.costs.record(outcome, self._steps)
        if self.heads is not None:
            self.heads.learn(outcome)  # which row of this pass the next head draft reads
        if outcome.source == "ngram":
            self.ngram[self._ngram_n].record(outcome.drafted, outcome.accepted)
            if outcome.accepted:
                self.ngram_cap = self.max_tokens  # the text repeats itself: as long as pays
        elif outcome.source == "heads":
            chances = self.heads.last_chances
            if self._tree_chances is not None:  # a tree's nodes are no chain's positions
                chances, self._tree_chances = self._tree_chances, None
            else:
                self.head_acceptance.record(outcome.drafted, outcome.accepted)
            self.head_calibration.record(sum(chances), outcome.accepted)
            if self.costs.plain:
                steps = self.heads.last_steps  # guesses made, the one cut off included
                seconds = outcome.draft_seconds * self.heads.guess_share  # without the setup
                self.head_step.add(seconds / steps / self.costs.plain)
        elif outcome.source == "recycled":
            self.recycled_calibration.record(sum(self._recycled_chances), outcome.accepted)
        elif outcome.source == "layer_skip":
            self.skip.record(outcome.drafted, outcome.accepted)
            self.layer_skip.observe(outcome)

    def policy_defaults(self) -> dict:
        defaults = self.layer_skip.policy_defaults() if self.layer_skip is not None else {}
        return {**defaults, "max_draft_tokens": self.max_tokens}


def head_prior(info: dict) -> list[float] | None:
    """P(head j's guess kept | the ones before it were), from the held-out figures the heads were
    trained with (the share of held-out positions where heads 1..j all guess right), or None."""
    top1 = info.get("heldout_top1_by_head")
    if not top1 or min(top1) <= 0:
        return None
    return [min(0.95, t / before) for before, t in zip([1.0, *top1], top1)]
