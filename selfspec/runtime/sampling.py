"""Turning logits into tokens, and the lossless acceptance rule.

Greedy: a draft token is accepted while it equals the target's argmax.
Sampling: the draft token x ~ q is accepted with probability min(1, p(x) / q(x)); at the
first rejection the replacement is drawn from norm(max(0, p - q)); when every draft token
passes, a bonus token is drawn from p. p and q are the target's and drafter's distributions
after the same temperature / top-k / top-p warping. The emitted tokens are then distributed
exactly as if drawn from the target alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from selfspec.errors import SelfSpecError
from selfspec.kernels import loaded_kernel

# Temperatures this small are argmax (their limit); far smaller ones round to 0 in float32 or
# make logits / temperature overflow, and the softmax would give NaNs.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 (or under GREEDY_BELOW) means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise SelfSpecError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SelfSpecError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SelfSpecError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distribution over the vocabulary, [..., vocab], float32."""
        logits = logits.float()
        if self.greedy:
            return torch.softmax(logits, dim=-1)
        logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Drop a token when the mass before it already reaches top_p (always keep the first).
            drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= self.top_p
            drop_sorted[..., 0] = False  # a top_p under float32's least value rounds to 0
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from one row of logits (argmax when greedy)."""
        if self.greedy:
            return argmax_rows(logits)[0]
        drawn = accept_certain([], logits.reshape(1, -1), self, generator)  # no draft: a draw
        return drawn[1] if drawn is not None else sample(self.probs(logits), generator)

    def kernel_for(self, logits: torch.Tensor):
        """The kernel where it can sample this distribution (plain temperature sampling of CPU
        float32 logits): a softmax and a draw over 150k logits in two vector passes, where torch's
        softmax and multinomial take milliseconds. None elsewhere."""
        if self.top_k or self.top_p < 1.0 or logits.device.type != "cpu":
            return None
        return loaded_kernel()


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, as torch.argmax), [..., vocab] -> a list:
    through the kernel where this process has loaded it (torch's reduction takes most of a
    millisecond over a row of 150k logits), else torch."""
    rows = logits.reshape(-1, logits.shape[-1])
    kernel = loaded_kernel()
    if kernel is not None and rows.device.type == "cpu" and rows.dtype == torch.float32:
        return kernel.argmax_rows(rows).tolist()
    return torch.argmax(rows, dim=-1).tolist()


def top_probability_rows(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's argmax (as ``argmax_rows``) and its softmax probability: through the kernel
    where this process has loaded it (a softmax over 150k logits takes most of a millisecond in
    torch), else torch."""
    rows = logits.reshape(-1, logits.shape[-1])
    kernel = loaded_kernel()
    if kernel is not None and rows.device.type == "cpu" and rows.dtype == torch.float32:
        ids, probs = kernel.top_probability_rows(rows)
        return ids.tolist(), probs.tolist()
    probs, ids = torch.softmax(rows.float(), dim=-1).max(dim=-1)
    return ids.tolist(), probs.tolist()


def top_k_probability_rows(
    logits: torch.Tensor, k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's ``k`` most likely tokens (``argmax_rows``' first, then by logit, ties to the
    lower id) and their softmax probabilities: through the kernel where loaded, else torch."""
    rows = logits.reshape(-1, logits.shape[-1])
    kernel = loaded_kernel()
    if kernel is not None and rows.device.type == "cpu" and rows.dtype == torch.float32:
        ids, probs = kernel.top_k_probability_rows(rows, k)
        return ids.tolist(), probs.tolist()
    probs = torch.softmax(rows.float(), dim=-1)
    top, ids = probs.topk(k, dim=-1)  # ties: torch's order, which may differ from the kernel's
    return ids.tolist(), top.tolist()


_SAMPLE_BLOCK = 1024


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from ``probs`` (one row of weights, any positive total) by inverse CDF in
    float64, in two levels: the blocks' sums, then one block's running sum. (torch.multinomial
    takes milliseconds over 150k ids; one float32 running sum would round away small weights.)"""
    flat = probs.reshape(-1).float()
    n = flat.shape[0]
    padded = torch.nn.functional.pad(flat, (0, -n % _SAMPLE_BLOCK)).view(-1, _SAMPLE_BLOCK)
    block_sums = padded.sum(1, dtype=torch.float64)
    block_cdf = block_sums.cumsum(0)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(block_cdf[-1])
    b = _first_above(block_cdf, u, block_sums > 0)
    within = u - (float(block_cdf[b - 1]) if b else 0.0)
    row = padded[b]
    return b * _SAMPLE_BLOCK + _first_above(row.double().cumsum(0), within, row > 0)


def _first_above(cdf: torch.Tensor, u: float, positive: torch.Tensor) -> int:
    """The first index whose running sum passes ``u`` (a weight-zero index never is: its sum
    equals the one before); rounding past the end gives the last index with weight."""
    i = int(torch.searchsorted(cdf, torch.tensor(u, dtype=cdf.dtype), right=True))
    if i < cdf.shape[0] and positive[i]:
        return i
    return int(positive.nonzero()[-1])


def accept_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of the draft equal to the target's argmax, and the target's next token.

    target_logits: [len(draft)+1, vocab], row i scores the token after draft[:i].
    Returns (accepted count m, token to emit after the accepted drafts).
    """
    best = argmax_rows(target_logits)
    m = 0
    while m < len(draft_tokens) and draft_tokens[m] == best[m]:
        m += 1
    return m, best[m]


def _draw(kernel, row, sampling: Sampling, top: float, total: float, generator, excluded=-1):
    u = float(torch.rand((), generator=generator))
    return kernel.sample_row(row, sampling.temperature, top, total, u, excluded)


def accept_certain(
    draft_tokens: list[int],
    target_logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> tuple[int, int] | None:
    """The lossless rule for drafts proposed with certainty (q = 1 on each drafted token): keep
    token i with probability p_i(token); at the first miss draw from p_i without that token (the
    residual max(0, p - q), normalized); when every draft passes, draw from the next row's p.
    Through the kernel (``Sampling.kernel_for``); None where it cannot, or a row is not finite."""
    kernel = sampling.kernel_for(target_logits)
    if kernel is None:
        return None
    rows = target_logits.float()
    tops, totals = (t.tolist() for t in kernel.softmax_partition(rows, sampling.temperature))
    if not all(math.isfinite(t) for t in totals):
        return None
    for i, token in enumerate(draft_tokens):
        p = math.exp((float(rows[i, token]) - tops[i]) / sampling.temperature) / totals[i]
        u = float(torch.rand((), generator=generator))
        if u <= p:  # u * q <= p with q = 1
            continue
        excluded = token if p < 1.0 else -1  # an empty residual (p = 1 up to rounding): p itself
        return i, _draw(kernel, rows[i], sampling, tops[i], totals[i], generator, excluded)
    k = len(draft_tokens)
    return k, _draw(kernel, rows[k], sampling, tops[k], totals[k], generator)


def accept_sampled(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """The lossless rule. draft_probs: [k, vocab] (q_i each draft token was drawn from);
    target_probs: [k+1, vocab] (p_i). Returns (accepted count m, token to emit next)."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i, token], draft_probs[i, token]
        u = torch.rand((), generator=generator, device=target_probs.device)
        if q > 0 and u * q <= p:  # u < p/q without dividing; p >= q always passes
            continue
        residual = torch.clamp(target_probs[i] - draft_probs[i], min=0)
        total = residual.sum()
        if total <= 0:  # p == q up to rounding: the residual is empty, fall back to p
            residual, total = target_probs[i], target_probs[i].sum()
        return i, sample(residual / total, generator)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], generator)
