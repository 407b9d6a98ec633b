"""The one decode loop every drafter shares: draft -> verify -> accept -> commit.

    prefill(prompt)                          -> first token x (pending: not yet in the cache)
    repeat:
        d_1..d_k = drafter.propose(...)       (k may be 0: a plain decoding step)
        logits   = target([x, d_1..d_k])      ONE forward pass, positions L..L+k
        m, y     = accept(d, logits)          m drafts kept, y from the target
        commit x, d_1..d_m; y becomes pending (cache length L+m+1)

The cache rows written for rejected drafts lie beyond the committed length and are
overwritten by the next pass, so the cache always holds the full model's keys and values
for exactly the committed tokens.

On a kernel runner a draft may be a tree (several guesses at a position): each row sees only
its ancestors, the kept path is the one the target's own picks follow from the root (its argmax,
or when sampling its draw at each row), and its rows' keys and values move into place before the
commit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.drafters import Draft, Drafter, DraftRequest, DraftSettings, RoundOutcome
from selfspec.drafters.adaptation import TARGET_ACCEPTANCE, AdaptiveThreshold
from selfspec.drafters.base import point_masses
from selfspec.errors import SelfSpecError
from selfspec.runtime.sampling import (
    Sampling,
    accept_certain,
    accept_greedy,
    accept_sampled,
    argmax_rows,
    sample,
)

if TYPE_CHECKING:
    from selfspec.runtime.prefixes import PrefixStore
    from selfspec.runtime.runner import ModelRunner


@dataclass
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    max_draft_tokens: int = 6
    confidence_threshold: float = 0.5
    adaptive_threshold: bool = True
    target_acceptance: float = TARGET_ACCEPTANCE  # the adaptive threshold aims at this acceptance
    fallback: bool = True  # switch to plain decoding when speculation is measurably slower


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_passes: int = 0  # full-model forward passes after prefill
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values a PrefixStore gave
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    fell_back: bool = False  # drafting was paused at least once, slower than plain decoding
    fell_back_at_token: int | None = None  # when it first was
    fallbacks: int = 0  # pauses (each ends by trying to draft again)
    final_threshold: float | None = None
    stop_reason: str = ""
    sources: dict = field(default_factory=dict)  # kind of draft -> [rounds, drafted, accepted]
    tree_rounds: int = 0  # rounds whose draft branched (several guesses at a position)
    # rows in a verify pass -> each such pass's seconds (to_dict gives their medians instead)
    verify_seconds: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass, the target's own token included (1.00 for plain
        decoding)."""
        from_passes = self.new_tokens - 1 if self.new_tokens else 0  # the first comes from prefill
        return from_passes / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second after prefill: the decoding phase on its own (0.0
        when there is none)."""
        decoding = self.seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decoding if self.new_tokens > 1 and decoding > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        pairs = zip(self.accepted_by_position, self.drafted_by_position)
        return [a / d if d else 0.0 for a, d in pairs]

    @property
    def verify_ms_by_rows(self) -> dict[int, float]:
        """Median milliseconds of this generation's verify passes, by rows in the pass (the
        pending token and the draft): what the machine charged for each draft length."""
        return {
            rows: round(statistics.median(times) * 1000, 3)
            for rows, times in sorted(self.verify_seconds.items())
        }

    def record_round(
        self, drafted: int, accepted: int, source: str = "", verify_seconds: float | None = None
    ) -> None:
        self.target_passes += 1
        if verify_seconds is not None:
            self.verify_seconds.setdefault(drafted + 1, []).append(verify_seconds)
        self.drafted += drafted
        self.accepted += accepted
        missing = drafted - len(self.drafted_by_position)
        if missing > 0:  # a batch's drafts may run longer than the width it began with
            self.drafted_by_position += [0] * missing
            self.accepted_by_position += [0] * missing
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted
        if drafted:
            counts = self.sources.setdefault(source or "draft", [0, 0, 0])
            counts[0] += 1
            counts[1] += drafted
            counts[2] += accepted

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["verify_seconds"]
        out.update(
            verify_ms_by_rows=self.verify_ms_by_rows,
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted_length=round(self.mean_accepted_length, 4),
            tokens_per_second=round(self.tokens_per_second, 3),
            acceptance_by_position=[round(x, 4) for x in self.acceptance_by_position],
        )
        return out


class Stopper:
    """EOS, stop strings and max_new_tokens, checked after every single token as plain decoding
    would."""

    def __init__(self, config: DecodeConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.eos = set(config.eos_token_ids)
        self.longest_stop = max((len(s) for s in config.stop_strings), default=0)

    def reason(self, generated: list[int]) -> str:
        if generated and generated[-1] in self.eos:
            return "eos"
        if len(generated) >= self.config.max_new_tokens:
            return "max_new_tokens"
        if self.longest_stop:
            # Only the tail can hold a newly completed stop string; tokens are at least one
            # character.
            tail_ids = generated[-(self.longest_stop + 8) :]
            tail = self.tokenizer.decode(tail_ids, skip_special_tokens=False)
            if any(s in tail for s in self.config.stop_strings):
                return "stop_string"
        return ""


def check_context(
    prompt_lengths: Mapping[str, int], new_tokens: int, window: int | None, flag: str
) -> None:
    """Refuse prompts that, with ``new_tokens`` more, would not fit a context of ``window`` tokens.
    ``prompt_lengths``: name -> token count; ``flag``: the option that sets ``new_tokens``."""
    if not window:
        return
    over = [f"{name} ({n} tokens)" for name, n in prompt_lengths.items() if n + new_tokens > window]
    if over:
        raise SelfSpecError(
            f"{', '.join(over)} plus {new_tokens} new tokens exceed{'s' if len(over) == 1 else ''} "
            f"the model's context window of {window} tokens. Shorten the prompt or lower {flag}."
        )


def check_request(prompt_ids: list[int], config: DecodeConfig, runner: ModelRunner) -> None:
    if not prompt_ids:
        raise SelfSpecError("the prompt is empty: give at least one token of text to continue.")
    tokens = config.max_new_tokens
    if type(tokens) is not int or tokens < 1:
        raise SelfSpecError(f"max_new_tokens must be an integer of at least 1, got {tokens!r}")
    vocab = runner.model.get_input_embeddings().num_embeddings
    if any(type(t) is not int or not 0 <= t < vocab for t in prompt_ids):
        raise SelfSpecError(
            f"the prompt's token ids must be integers in the vocabulary (0..{vocab - 1}); pass "
            "text, or ids from the model's own tokenizer."
        )
    check_context(
        {"the prompt": len(prompt_ids)},
        config.max_new_tokens,
        runner.context_window,
        "--max-new-tokens",
    )


def prefill(
    runner: ModelRunner, prompt_ids: list[int], sampling: Sampling, generator, cached: int = 0
) -> int:
    """Run the prompt through the model, past its first ``cached`` tokens (already in the cache);
    returns the first new token (not yet in the cache)."""
    logits, _ = runner.forward(torch.tensor(prompt_ids[cached:]), cached, last_logits_only=True)
    return sampling.pick(logits[-1], generator)


def verify(runner: ModelRunner, committed: list[int], draft: Draft) -> torch.Tensor:
    """One full pass over the pending token and the draft: logits [1 + k, vocab]."""
    ids = torch.tensor([committed[-1]] + draft.tokens)
    logits, _ = runner.forward(ids, len(committed) - 1, resume=draft.resume, tree=draft.parents)
    return logits


def accept_tree(
    draft: Draft, target_logits: torch.Tensor, sampling: Sampling | None = None, generator=None
) -> tuple[list[int], int]:
    """Acceptance of a tree draft: (the kept tokens' indices in the draft, root to leaf, the
    target's token after them). From the pending token (row 0), keep the child whose token is the
    target's pick at its parent's row, while there is one (siblings are distinct).

    Greedy, the pick is the row's argmax. Sampling, it is a draw from the row's p: a tree's tokens
    are proposed with certainty (q = 1 on each), and for such guesses recursive rejection sampling
    (keep the first with probability p, the next with p renormalized without the ones rejected,
    ..., else draw from what is left) emits each token with probability p, as one draw does."""
    greedy = sampling is None or sampling.greedy
    best = argmax_rows(target_logits) if greedy else None
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
        children.setdefault(parent, {})[token] = i
    path, node = [], -1
    while True:
        row = node + 1
        pick = best[row] if best is not None else sampling.pick(target_logits[row], generator)
        child = children.get(node, {}).get(pick)
        if child is None:
            return path, pick
        path.append(child)
        node = child


def accept(
    draft: Draft, target_logits: torch.Tensor, sampling: Sampling, generator
) -> tuple[int, int]:
    """(drafts kept m, the target's token after them): greedy prefix match, or the lossless
    sampling rule against the drafter's distributions."""
    if sampling.greedy:
        return accept_greedy(draft.tokens, target_logits)
    if draft.probs is None:  # no draft, or tokens proposed with certainty (copied, not sampled)
        fast = accept_certain(draft.tokens, target_logits, sampling, generator)
        if fast is not None:
            return fast
        if draft.tokens:  # the general rule, with q = 1 on each token
            draft = Draft(draft.tokens, point_masses(draft.tokens, target_logits.shape[-1]))
    target_probs = sampling.probs(target_logits)
    if not draft.tokens:
        return 0, sample(target_probs[0], generator)
    draft_probs = draft.probs
    if draft_probs.shape[-1] != target_probs.shape[-1]:
        draft_probs = _match_vocab(draft_probs, target_probs.shape[-1])
    return accept_sampled(draft.tokens, draft_probs, target_probs, generator)


@dataclass
class Generation:
    """One generation's state as the loop advances it."""

    committed: list[int]  # prompt and every token so far; the last is pending (not yet cached)
    generated: list[int]
    stats: DecodeStats
    stopper: Stopper
    on_tokens: Callable[[list[int]], None] | None
    stop: str = ""

    def commit(self, tokens: list[int]) -> None:
        """Append tokens one at a time, so EOS, stop strings and the length limit cut exactly
        where plain decoding would."""
        new = []
        for token in tokens:
            self.committed.append(token)
            self.generated.append(token)
            new.append(token)
            self.stop = self.stopper.reason(self.generated)
            if self.stop:
                break
        if self.on_tokens:
            self.on_tokens(new)


def begin_generation(
    runner: ModelRunner,
    prompt_ids: list[int],
    config: DecodeConfig,
    tokenizer,
    on_tokens: Callable[[list[int]], None] | None,
    stats: DecodeStats,
    prefixes: PrefixStore | None = None,
) -> tuple[Generation, torch.Generator | None]:
    """Prefill ``prompt_ids`` over the runner's current cache (past the longest prefix
    ``prefixes`` holds) and commit the first token: the generation's state and its random
    generator (None when greedy)."""
    generator = make_generator(config, runner.device)
    gen = Generation(list(prompt_ids), [], stats, Stopper(config, tokenizer), on_tokens)
    t0 = time.perf_counter()
    if prefixes is not None and runner.can_batch:  # elsewhere a row's bits depend on its pass
        stats.cached_prompt_tokens = prefixes.restore(prompt_ids, runner.cache)
    first = prefill(runner, prompt_ids, config.sampling, generator, stats.cached_prompt_tokens)
    stats.prefill_seconds = time.perf_counter() - t0
    gen.commit([first])
    return gen, generator


def generate_ids(
    runner: ModelRunner,
    prompt_ids: list[int],
    config: DecodeConfig,
    drafter: Drafter | None = None,
    tokenizer=None,
    on_tokens: Callable[[list[int]], None] | None = None,
    pause: Callable[[], bool] | None = None,
    prefixes: PrefixStore | None = None,
) -> tuple[list[int], DecodeStats]:
    """Decode up to max_new_tokens after ``prompt_ids``; with no drafter this is plain decoding.

    ``on_tokens`` is called with each batch of newly committed tokens, as soon as they are final.
    ``pause`` is asked after every round; when it says so the generation stops with stop reason
    "paused", its committed tokens' keys and values in the runner's cache, to be continued
    elsewhere (``selfspec.runtime.batch.resume_sequence``). With ``prefixes`` the prompt's longest
    stored prefix is not read again (``selfspec.runtime.prefixes``; only where the runner batches).
    """
    check_request(prompt_ids, config, runner)
    width = config.max_draft_tokens
    stats = DecodeStats(drafted_by_position=[0] * width, accepted_by_position=[0] * width)
    max_len = len(prompt_ids) + config.max_new_tokens + config.max_draft_tokens + 2
    runner.reset(max_len)
    if drafter is not None:
        threshold = AdaptiveThreshold(
            config.confidence_threshold, config.adaptive_threshold, config.target_acceptance
        )
        drafter.begin(prompt_ids, max_len, DraftSettings(threshold, fallback=config.fallback))

    t0 = time.perf_counter()
    gen, generator = begin_generation(
        runner, prompt_ids, config, tokenizer, on_tokens, stats, prefixes
    )
    while not gen.stop:
        _round(runner, gen, config, drafter, generator)
        if not gen.stop and pause is not None and pause():
            gen.stop = "paused"

    stats.seconds = time.perf_counter() - t0
    stats.new_tokens = len(gen.generated)
    stats.stop_reason = gen.stop
    stats.final_threshold = drafter.threshold.value if drafter is not None else None
    return gen.generated, stats


def _round(
    runner, gen: Generation, config: DecodeConfig, drafter: Drafter | None, generator
) -> None:
    """One round: draft (when a drafter runs and there is room), verify, accept, commit."""
    room = config.max_new_tokens - len(gen.generated)
    t_draft = time.perf_counter()
    draft = Draft()
    if drafter is not None and room > 1:
        limit = min(config.max_draft_tokens, room - 1)
        trees = limit if runner.trees else 0
        request = DraftRequest(gen.committed, limit, config.sampling, generator, trees)
        draft = drafter.propose(request)
    t_verify = time.perf_counter()
    logits = verify(runner, gen.committed, draft)
    if draft.parents is not None:
        if draft.probs is not None:  # a tree's guesses are certain: nothing drew them from q
            raise ValueError("tree drafts carry no draft distributions")
        path, next_token = accept_tree(draft, logits, config.sampling, generator)
        runner.keep_path(len(gen.committed) - 1, [0] + [i + 1 for i in path])
        kept = [draft.tokens[i] for i in path]
        gen.stats.tree_rounds += 1
    else:
        m, next_token = accept(draft, logits, config.sampling, generator)
        kept = draft.tokens[:m]
    m = len(kept)
    verify_seconds = time.perf_counter() - t_verify
    k = len(draft.tokens)
    gen.stats.record_round(k, m, draft.source, verify_seconds)
    if drafter is not None:
        pauses = drafter.guard.pauses
        drafter.observe(RoundOutcome(k, m, t_verify - t_draft, verify_seconds, draft.source))
        if drafter.guard.pauses > pauses:
            _note_fallback(gen.stats, len(gen.generated) + m + 1)
    gen.commit(kept + [next_token])


def _note_fallback(stats: DecodeStats, at_token: int) -> None:
    if not stats.fell_back:
        stats.fell_back, stats.fell_back_at_token = True, at_token
    stats.fallbacks += 1


def make_generator(config: DecodeConfig, device) -> torch.Generator | None:
    if config.sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed if config.seed is not None else torch.seed())
    return generator


def _match_vocab(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft model's head may be padded to another size; tokens past the shared vocabulary
    get q = 0."""
    if probs.shape[-1] > vocab:
        probs = probs[..., :vocab]
        return probs / probs.sum(-1, keepdim=True)
    return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))
