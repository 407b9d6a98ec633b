"""Several sequences decoded together, speculatively, in one pass per step (what `selfspec serve`
runs when more than one request is active).

Each sequence has its own KV cache. A pass takes every sequence's pending token and the tokens
drafted for it from its own context or by the draft heads from the final hidden state of the
row that made that token (``BatchDrafter``: as many as pay, none without a drafter) at once
(``ModelRunner.forward_many``: the linear layers over all rows, attention per row over its own
sequence's keys), and each sequence keeps the longest prefix of its draft the target
agrees with plus the target's next token, with its own sampling and stop rule. Rows never mix
and each gets the bits of a one-token pass, so a greedy sequence decodes to exactly the tokens it
gets alone. Sequences join and leave between passes; a generation that ran alone,
speculatively, can be paused and continued here.

As a row's bits do not depend on how many rows its pass holds, at any length (the kernel modes
run long passes through the same kernels, a chunk of rows at a time), a sequence that joins
reads its prompt in chunks inside the batch's passes (``admit_sequence``) instead of one prefill
that stops every other sequence: the others go on decoding, one pass per chunk, and its cache
gets the bits a prefill gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from selfspec.drafters.base import Draft
from selfspec.drafters.ngram import ContextIndex
from selfspec.runtime.decode import (
    DecodeConfig,
    DecodeStats,
    Generation,
    Stopper,
    accept,
    check_request,
    make_generator,
)
from selfspec.runtime.runner import ScoredRows

if TYPE_CHECKING:
    import torch

    from selfspec.drafters.batched import BatchDrafter
    from selfspec.runtime.prefixes import PrefixStore
    from selfspec.runtime.runner import KVCache, ModelRunner

PREFILL_CHUNK = 64  # prompt rows a pass takes, so that the batch's other rows wait little


@dataclass
class Sequence:
    """One sequence in a batch: its cache, its tokens so far (the last pending) and settings."""

    cache: KVCache
    gen: Generation
    config: DecodeConfig
    generator: torch.Generator | None
    started: float
    context: ContextIndex = field(default_factory=ContextIndex)  # for drafts from its own text
    # prompt tokens not yet in the cache (admit_sequence): the sequence reads them in chunks
    # before its first token; 0 once it decodes
    prompt_left: int = 0
    # final hidden state [1, hidden] of the row that made the pending token (what head drafts
    # read); None until a batch pass made it
    hidden: torch.Tensor | None = None

    def draft_room(self) -> int:
        """Tokens a draft may hold: within max_new_tokens (the target adds one) and the cache."""
        committed = len(self.gen.committed)
        room = self.config.max_new_tokens - len(self.gen.generated) - 1
        return max(0, min(room, self.config.max_draft_tokens, self.cache.max_len - committed))

    def cached_tokens(self) -> list[int]:
        """The tokens whose keys and values are in the cache: the prompt read so far, then every
        token but the pending one."""
        return self.gen.committed[: len(self.gen.committed) - (self.prompt_left or 1)]

    def finish(self) -> DecodeStats:
        stats = self.gen.stats
        stats.new_tokens = len(self.gen.generated)
        stats.seconds = time.perf_counter() - self.started
        stats.stop_reason = self.gen.stop
        return stats


def admit_sequence(
    runner: ModelRunner,
    prompt_ids: list[int],
    config: DecodeConfig,
    tokenizer,
    on_tokens: Callable[[list[int]], None] | None = None,
    prefixes: PrefixStore | None = None,
) -> Sequence:
    """A new sequence with a cache of its own and its prompt still to read (past the longest
    prefix ``prefixes`` holds): ``step`` reads it in chunks and commits its first token after
    the last chunk."""
    check_request(prompt_ids, config, runner)
    started = time.perf_counter()
    # its prompt, its tokens and a draft past them
    cache = runner.new_cache(len(prompt_ids) + config.max_new_tokens + config.max_draft_tokens + 2)
    generator = make_generator(config, runner.device)
    stopper = Stopper(config, tokenizer)
    stats = DecodeStats()
    if prefixes is not None:
        stats.cached_prompt_tokens = prefixes.restore(prompt_ids, cache)
    gen = Generation(list(prompt_ids), [], stats, stopper, on_tokens)
    left = len(prompt_ids) - stats.cached_prompt_tokens
    return Sequence(cache, gen, config, generator, started, prompt_left=left)


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
    """One pass over every decoding sequence's pending token and its draft (none without
    ``drafter``) and the next chunk of the prompts still being read; commits to each decoding
    sequence the drafts the target kept and the target's next token, and to a sequence whose
    prompt is read its first token. Returns the pass's rows."""
    decoding = [s for s in sequences if not s.prompt_left]
    drafts = _drafts(decoding, drafter)
    rows = _PassRows()
    for sequence, draft in zip(decoding, drafts):
        rows.add(sequence, [sequence.gen.committed[-1], *draft], scored=len(draft) + 1)
    reading, budget = [], PREFILL_CHUNK
    for sequence in [s for s in sequences if s.prompt_left]:
        if budget == 0:
            break
        chunk = sequence.gen.committed[-sequence.prompt_left :][:budget]
        budget -= len(chunk)
        last = len(chunk) == sequence.prompt_left  # only the prompt's last row needs logits
        rows.add(sequence, chunk, scored=int(last))
        reading.append((sequence, len(chunk)))
    started = time.perf_counter()
    logits = runner.forward_many(rows.caches, rows.tokens, rows.positions, rows.scored)
    seconds = time.perf_counter() - started
    per_sequence, states = rows.split(logits), rows.split(runner.last_rows_hidden)
    sources = drafter.sources if drafter is not None else ["ngram"] * len(decoding)
    learner = drafter.recycled if drafter is not None else None
    kept = []
    for sequence, draft, scores, source in zip(decoding, drafts, per_sequence, sources):
        m, token = _accept(sequence, draft, scores)
        kept.append(m)
        sequence.gen.stats.record_round(len(draft), m, source)
        start = len(sequence.gen.committed) - 1  # where the pending token was read
        sequence.gen.commit(draft[:m] + [token])
        if learner is not None:
            read = [sequence.gen.committed[start], *draft]
            learner.learn(sequence.gen.committed, ScoredRows(start, read, scores))
    for (sequence, n), scores in zip(reading, per_sequence[len(decoding) :]):
        _read_chunk(sequence, n, scores)
    # the row that made each sequence's pending token: the row after its kept drafts, or its
    # prompt's last row
    for sequence, m, hidden in zip(decoding, kept, states):
        sequence.hidden = hidden[m : m + 1].clone()
    for (sequence, _), hidden in zip(reading, states[len(decoding) :]):
        sequence.hidden = hidden[-1:].clone() if len(hidden) else None
    if drafter is not None:
        # a prompt row needs no logits: it costs a scored row less the output head
        prompt_rows = sum(n for _, n in reading) * (1.0 - runner.head_share)
        drafter.observe(drafts, kept, seconds, prompt_rows)
    return len(rows.tokens)


def _drafts(sequences: list[Sequence], drafter: BatchDrafter | None) -> list[list[int]]:
    if drafter is None or not sequences:
        return [[] for _ in sequences]
    for s in sequences:
        s.context.sync(s.gen.committed)
    return drafter.propose(
        [s.context for s in sequences],
        [s.draft_room() for s in sequences],
        [s.hidden for s in sequences],
    )


class _PassRows:
    """The rows of one batch pass, sequence after sequence: tokens at consecutive positions of the
    sequence's cache (after the tokens already there), and which rows need logits."""

    def __init__(self) -> None:
        self.caches: list[KVCache] = []
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.scored: list[int] = []  # rows whose logits the pass computes
        self._scored_counts: list[int] = []

    def add(self, sequence: Sequence, tokens: list[int], scored: int) -> None:
        """``tokens`` of ``sequence``; its last ``scored`` rows need logits."""
        start = len(sequence.cached_tokens())
        first, n = len(self.tokens), len(tokens)
        self.caches += [sequence.cache] * n
        self.tokens += tokens
        self.positions += range(start, start + n)
        self.scored += range(first + n - scored, first + n)
        self._scored_counts.append(scored)

    def split(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """The scored rows' logits, sequence by sequence."""
        out, first = [], 0
        for n in self._scored_counts:
            out.append(logits[first : first + n])
            first += n
        return out


def _read_chunk(sequence: Sequence, rows: int, logits: torch.Tensor) -> None:
    """``rows`` more of the sequence's prompt are in its cache; after the last, its first token
    (from the prompt's last row, ``logits``)."""
    sequence.prompt_left -= rows
    if sequence.prompt_left:
        return
    sequence.gen.stats.prefill_seconds = time.perf_counter() - sequence.started
    sequence.gen.commit([sequence.config.sampling.pick(logits[-1], sequence.generator)])


def _accept(sequence: Sequence, draft: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """(drafts kept, the target's token after them) for one sequence's rows of a pass."""
    sampling = sequence.config.sampling
    if not draft:
        return 0, sampling.pick(logits[0], sequence.generator)
    return accept(Draft(draft), logits, sampling, sequence.generator)  # certain context drafts
