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
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from selfspec.drafters import Draft, Drafter, DraftRequest
from selfspec.errors import SelfSpecError
from selfspec.runner import ModelRunner
from selfspec.sampling import Sampling, accept_greedy, accept_sampled


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
    target_acceptance: float = 0.8  # the adaptive threshold aims at this draft acceptance rate
    fallback: bool = True  # switch to plain decoding when speculation is measurably slower


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_passes: int = 0  # full-model forward passes after prefill
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    fell_back: bool = False
    fell_back_at_token: int | None = None
    final_threshold: float | None = None
    stop_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass, the target's own token included (1.00 for plain decoding)."""
        from_passes = self.new_tokens - 1 if self.new_tokens else 0  # the first token comes from prefill
        return from_passes / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted_length=round(self.mean_accepted_length, 4),
            tokens_per_second=round(self.tokens_per_second, 3),
            acceptance_by_position=[round(x, 4) for x in self.acceptance_by_position],
        )
        return out


class _Stopper:
    """EOS, stop strings and max_new_tokens, checked after every single token as plain decoding would."""

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
            # Only the tail can hold a newly completed stop string; tokens are at least one character.
            tail = self.tokenizer.decode(generated[-(self.longest_stop + 8):], skip_special_tokens=False)
            if any(s in tail for s in self.config.stop_strings):
                return "stop_string"
        return ""


def check_request(prompt_ids: list[int], config: DecodeConfig, runner: ModelRunner) -> None:
    if not prompt_ids:
        raise SelfSpecError("the prompt is empty: give at least one token of text to continue.")
    if config.max_new_tokens < 1:
        raise SelfSpecError(f"max_new_tokens must be at least 1, got {config.max_new_tokens}")
    window = runner.context_window
    if window and len(prompt_ids) + config.max_new_tokens > window:
        raise SelfSpecError(
            f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"model's context window of {window} tokens. Shorten the prompt or lower --max-new-tokens."
        )


def generate_ids(
    runner: ModelRunner,
    prompt_ids: list[int],
    config: DecodeConfig,
    drafter: Drafter | None = None,
    tokenizer=None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> tuple[list[int], DecodeStats]:
    """Decode up to max_new_tokens after ``prompt_ids``; with no drafter this is plain decoding.

    ``on_tokens`` is called with each batch of newly committed tokens, as soon as they are final.
    """
    check_request(prompt_ids, config, runner)
    sampling = config.sampling
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=runner.device)
        generator.manual_seed(config.seed if config.seed is not None else torch.seed())
    stopper = _Stopper(config, tokenizer)
    stats = DecodeStats(drafted_by_position=[0] * config.max_draft_tokens,
                        accepted_by_position=[0] * config.max_draft_tokens)
    max_len = len(prompt_ids) + config.max_new_tokens + config.max_draft_tokens + 2
    runner.reset(max_len)
    if drafter is not None:
        drafter.begin(prompt_ids, max_len)

    t0 = time.perf_counter()
    logits, _ = runner.forward(torch.tensor(prompt_ids), 0, last_logits_only=True)
    committed = list(prompt_ids) + [sampling.pick(logits[-1], generator)]
    generated = committed[len(prompt_ids):]
    stats.prefill_seconds = time.perf_counter() - t0
    if on_tokens:
        on_tokens(generated[:])
    stop = stopper.reason(generated)

    threshold = config.confidence_threshold
    acceptance_ema = config.target_acceptance
    window = deque(maxlen=8)  # (tokens emitted, draft seconds, verify seconds) of recent speculative rounds
    speculating = drafter is not None

    while not stop:
        room = config.max_new_tokens - len(generated)
        draft = Draft()
        t_draft = time.perf_counter()
        if speculating and room > 1:
            draft = drafter.propose(DraftRequest(
                committed, min(config.max_draft_tokens, room - 1), threshold, sampling, generator))
        t_verify = time.perf_counter()
        start = len(committed) - 1
        ids = torch.tensor([committed[-1]] + draft.tokens)
        target_logits, _ = runner.forward(ids, start, resume=draft.resume)
        stats.target_passes += 1
        if sampling.greedy:
            m, next_token = accept_greedy(draft.tokens, target_logits)
        else:
            draft_probs = draft.probs
            if draft_probs is not None and draft_probs.shape[-1] != target_logits.shape[-1]:
                draft_probs = _match_vocab(draft_probs, target_logits.shape[-1])
            target_probs = sampling.probs(target_logits)
            m, next_token = (accept_sampled(draft.tokens, draft_probs, target_probs, generator)
                             if draft.tokens else (0, _sample_row(target_probs[0], generator)))
        t_end = time.perf_counter()

        k = len(draft.tokens)
        stats.drafted += k
        stats.accepted += m
        for i in range(k):
            stats.drafted_by_position[i] += 1
            stats.accepted_by_position[i] += i < m
        if drafter is not None and speculating:
            drafter.observe(k, m)

        # Commit one token at a time so EOS / stop strings / the length limit cut exactly where plain decoding would.
        new = []
        for token in draft.tokens[:m] + [next_token]:
            committed.append(token)
            generated.append(token)
            new.append(token)
            stop = stopper.reason(generated)
            if stop:
                break
        if on_tokens:
            on_tokens(new)

        if speculating and k:
            if config.adaptive_threshold:
                acceptance_ema = 0.7 * acceptance_ema + 0.3 * (m / k)
                step = 0.05 if acceptance_ema < config.target_acceptance else -0.05
                threshold = min(0.95, max(0.0, threshold + step))
            window.append((m + 1, t_verify - t_draft, t_end - t_verify))
            if config.fallback and len(window) == window.maxlen and _slower_than_plain(window):
                speculating = False
                stats.fell_back = True
                stats.fell_back_at_token = len(generated)

    stats.seconds = time.perf_counter() - t0
    stats.new_tokens = len(generated)
    stats.stop_reason = stop
    stats.final_threshold = threshold if drafter is not None else None
    return generated, stats


def _slower_than_plain(window) -> bool:
    """Speculation loses when tokens per round x verify time < draft + verify time.

    A verify pass over k+1 tokens costs at least a plain step, so using it as the plain step's
    cost errs towards staying speculative; we only fall back when clearly slower.
    """
    tokens = sum(w[0] for w in window)
    draft_s = sum(w[1] for w in window)
    verify_s = sum(w[2] for w in window)
    return tokens * verify_s / len(window) < draft_s + verify_s


def _sample_row(probs: torch.Tensor, generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _match_vocab(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft model's head may be padded to another size; tokens past the shared vocabulary get q = 0."""
    if probs.shape[-1] > vocab:
        probs = probs[..., :vocab]
        return probs / probs.sum(-1, keepdim=True)
    return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))
