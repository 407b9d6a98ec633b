"""Several sequences decoded together, speculatively, in one pass per step (what `selfspec serve`
runs when more than one request is active).

Each sequence has its own KV cache. A pass takes every sequence's pending token and the tokens
drafted for it from its own context (``BatchDrafter``: as many as pay, none without a drafter)
at once (``ModelRunner.forward_many``: the linear layers over all rows, attention per row over
its own sequence's keys), and each sequence keeps the longest prefix of its draft the target
agrees with plus the target's next token, with its own sampling and stop rule. Rows never mix
and each gets the bits of a one-token pass, so a greedy sequence decodes to exactly the tokens it
gets alone. Sequences join and leave between passes; a generation that ran alone,
speculatively, can be paused and continued here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from selfspec.decode import (
    DecodeConfig,
    DecodeStats,
    Generation,
    Stopper,
    accept,
    begin_generation,
    check_request,
    make_generator,
)
from selfspec.drafters.base import Draft, point_masses
from selfspec.drafters.ngram import ContextIndex

if TYPE_CHECKING:
    import torch

    from selfspec.drafters.batched import BatchDrafter
    from selfspec.runner import KVCache, ModelRunner


@dataclass
class Sequence:
    """One sequence in a batch: its cache, its tokens so far (the last pending) and settings."""

    cache: KVCache
    gen: Generation
    config: DecodeConfig
    generator: torch.Generator | None
    started: float
    context: ContextIndex = field(default_factory=ContextIndex)  # for drafts from its own text

    def draft_room(self) -> int:
        """Tokens a draft may hold: within max_new_tokens (the target adds one) and the cache."""
        committed = len(self.gen.committed)
        room = self.config.max_new_tokens - len(self.gen.generated) - 1
        return max(0, min(room, self.config.max_draft_tokens, self.cache.max_len - committed))

    def finish(self) -> DecodeStats:
        stats = self.gen.stats
        stats.new_tokens = len(self.gen.generated)
        stats.seconds = time.perf_counter() - self.started
        stats.stop_reason = self.gen.stop
        return stats


def start_sequence(
    runner: ModelRunner,
    prompt_ids: list[int],
    config: DecodeConfig,
    tokenizer,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Sequence:
    """Prefill a new sequence into a cache of its own; its first token is committed."""
    check_request(prompt_ids, config, runner)
    started = time.perf_counter()
    cache = runner.new_cache(len(prompt_ids) + config.max_new_tokens + config.max_draft_tokens + 2)
    with runner.using(cache):
        gen, generator = begin_generation(
            runner, prompt_ids, config, tokenizer, on_tokens, DecodeStats()
        )
    return Sequence(cache, gen, config, generator, started)


def resume_sequence(
    runner: ModelRunner,
    prompt_ids: list[int],
    generated: list[int],
    stats: DecodeStats,
    config: DecodeConfig,
    tokenizer,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Sequence:
    """Continue a generation that ``generate_ids(..., pause=...)`` paused: it takes over the
    runner's cache (which holds its committed tokens); the runner makes itself a new one."""
    cache, runner.cache = runner.cache, None
    if config.seed is not None:  # go on drawing, not replay the draws already made
        config = DecodeConfig(**{**vars(config), "seed": config.seed + len(generated)})
    generator = make_generator(config, runner.device)
    committed = list(prompt_ids) + list(generated)
    gen = Generation(committed, list(generated), stats, Stopper(config, tokenizer), on_tokens)
    return Sequence(cache, gen, config, generator, time.perf_counter() - stats.seconds)


def step(
    runner: ModelRunner, sequences: list[Sequence], drafter: BatchDrafter | None = None
) -> int:
    """One pass over every sequence's pending token and its draft (none without ``drafter``);
    commits to each the drafts the target kept and the target's next token. Returns the pass's
    rows."""
    if drafter is not None:
        for s in sequences:
            s.context.sync(s.gen.committed)
        rooms = [s.draft_room() for s in sequences]
        drafts = drafter.propose([s.context for s in sequences], rooms)
    else:
        drafts = [[] for _ in sequences]
    caches, tokens, positions = [], [], []
    for sequence, draft in zip(sequences, drafts):
        start = len(sequence.gen.committed) - 1
        rows = [sequence.gen.committed[-1], *draft]
        caches += [sequence.cache] * len(rows)
        tokens += rows
        positions += range(start, start + len(rows))
    started = time.perf_counter()
    logits = runner.forward_many(caches, tokens, positions)
    seconds = time.perf_counter() - started
    kept, first = [], 0
    for sequence, draft in zip(sequences, drafts):
        rows = logits[first : first + len(draft) + 1]
        first += len(draft) + 1
        m, token = _accept(sequence, draft, rows)
        kept.append(m)
        sequence.gen.stats.record_round(len(draft), m, "ngram")
        sequence.gen.commit(draft[:m] + [token])
    if drafter is not None:
        drafter.observe(drafts, kept, seconds)
    return len(tokens)


def _accept(sequence: Sequence, draft: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """(drafts kept, the target's token after them) for one sequence's rows of a pass."""
    sampling = sequence.config.sampling
    if not draft:
        return 0, sampling.pick(logits[0], sequence.generator)
    probs = None if sampling.greedy else point_masses(draft, logits.shape[-1])
    return accept(Draft(draft, probs), logits, sampling, sequence.generator)
