"""Several sequences decoded together, one token each per pass (what `selfspec serve` runs when
more than one request is active).

Each sequence has its own KV cache. A pass takes every sequence's pending token at once
(``ModelRunner.forward_many``: the linear layers over all rows, attention per sequence) and
commits one token to each with that sequence's own sampling and stop rule. Rows never mix, so a
greedy sequence decodes to exactly the tokens it gets alone. Sequences join and leave between
passes; a generation that ran alone, speculatively, can be paused and continued here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfspec.decode import (
    DecodeConfig,
    DecodeStats,
    Generation,
    Stopper,
    begin_generation,
    check_request,
    make_generator,
)

if TYPE_CHECKING:
    import torch

    from selfspec.runner import KVCache, ModelRunner


@dataclass
class Sequence:
    """One sequence in a batch: its cache, its tokens so far (the last pending) and settings."""

    cache: KVCache
    gen: Generation
    config: DecodeConfig
    generator: torch.Generator | None
    started: float

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
    cache = runner.new_cache(len(prompt_ids) + config.max_new_tokens + 1)
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


def step(runner: ModelRunner, sequences: list[Sequence]) -> None:
    """One pass over every sequence's pending token; commits one token to each."""
    tokens = [s.gen.committed[-1] for s in sequences]
    positions = [len(s.gen.committed) - 1 for s in sequences]
    logits = runner.forward_many([s.cache for s in sequences], tokens, positions)
    for sequence, row in zip(sequences, logits):
        sequence.gen.stats.target_passes += 1
        sequence.gen.commit([sequence.config.sampling.pick(row, sequence.generator)])
