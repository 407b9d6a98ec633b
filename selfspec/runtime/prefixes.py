"""Keys and values of prompts already read, kept for the next request that starts with the same
tokens (a chat's system prompt; in a later turn of a conversation, all the turns before it), so
that request reads only the rest of its prompt (``PrefixStore``; what llama.cpp's server calls
prompt caching and vLLM automatic prefix caching).

Entries live in one pool of fixed blocks (``block_tokens`` positions of every layer's keys and
values each), allocated once and reused, as vLLM's paged cache: entries made and dropped one
after another as requests come and go would otherwise leave the allocator's heap fragmented, and
the process's memory would grow past the budget over a long run.

A row's keys and values depend on the tokens up to it only, and where the runner batches
(``ModelRunner.can_batch``) they are the same bits whichever pass wrote them, so a request that
starts from a stored prefix gets exactly the tokens a fresh prefill gives. Entries are copies: a
sequence's cache is reused or dropped when it ends. When the pool is full the least recently
used entry goes first; an entry that a newer one extends is dropped at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from selfspec.runtime.runner import KVCache


@dataclass(eq=False)  # entries are told apart by identity
class _Entry:
    tokens: torch.Tensor  # [n] int64
    blocks: torch.Tensor  # [ceil(n / block_tokens)] int64: the pool's blocks, in order


class PrefixStore:
    """Prompts' (and answers') keys and values by their tokens, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int, block_tokens: int = 16):
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        self.entries: list[_Entry] = []  # least recently used first
        self.pool: torch.Tensor | None = None  # [blocks, layers, 2, heads, block_tokens, dim]
        self.free: list[int] = []
        self.evictions = 0  # entries dropped to make room

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold (whole blocks)."""
        if self.pool is None:
            return 0
        used = sum(len(e.blocks) for e in self.entries)
        return used * self.pool[0].nbytes

    def restore(self, prompt_ids: list[int], cache: KVCache) -> int:
        """Copy the keys and values of the longest stored prefix of ``prompt_ids`` into the
        first positions of ``cache``; the number of positions filled. The prompt's last token
        is never restored: its row gives the logits of the first new token."""
        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        best, shared = None, 0
        for entry in self.entries:
            n = _shared_length(entry.tokens, prompt)
            if n > shared:
                best, shared = entry, n
        shared = min(shared, len(prompt_ids) - 1, cache.max_len)
        if best is None or shared <= 0:
            return 0
        blocks = best.blocks[: -(-shared // self.block_tokens)]
        for i in range(len(cache.keys)):
            for kv, target in enumerate(cache.layer(i)):
                rows = self.pool[blocks, i, kv].transpose(0, 1).flatten(1, 2)  # [heads, n, dim]
                target[:, :shared] = rows[:, :shared]
        self.entries.remove(best)
        self.entries.append(best)
        return shared

    def save(self, token_ids: list[int], cache: KVCache) -> None:
        """Keep the keys and values of ``token_ids``, the tokens at the first positions of
        ``cache`` (as many as fit in the budget)."""
        if not token_ids or not self._ready(cache):
            return
        b = self.block_tokens
        n = min(len(token_ids), len(self.pool) * b)
        tokens = torch.tensor(token_ids[:n], dtype=torch.long)
        for entry in self.entries:
            if _shared_length(entry.tokens, tokens) == n:  # stored already
                self.entries.remove(entry)
                self.entries.append(entry)
                return
        # an entry the new one extends holds nothing the new one lacks
        for entry in [e for e in self.entries if _shared_length(e.tokens, tokens) == len(e.tokens)]:
            self._drop(entry)
        needed = -(-n // b)
        while len(self.free) < needed:
            self._drop(self.entries[0])
            self.evictions += 1
        blocks = torch.tensor([self.free.pop() for _ in range(needed)], dtype=torch.long)
        whole, rest = divmod(n, b)
        for i in range(len(cache.keys)):
            for kv, source in enumerate(cache.layer(i)):
                heads, _, dim = source.shape
                rows = source[:, : whole * b].reshape(heads, whole, b, dim).transpose(0, 1)
                self.pool[blocks[:whole], i, kv] = rows
                if rest:
                    self.pool[blocks[whole], i, kv, :, :rest] = source[:, whole * b : n]
        self.entries.append(_Entry(tokens, blocks))

    def _ready(self, cache: KVCache) -> bool:
        """Whether the pool is there (made at the first save, shaped by that cache: its pages
        are only touched as blocks fill)."""
        if self.pool is None:
            keys, _ = cache.layer(0)
            heads, _, dim = keys.shape
            shape = (len(cache.keys), 2, heads, self.block_tokens, dim)
            block_bytes = keys.element_size() * shape[0] * 2 * heads * self.block_tokens * dim
            count = self.budget_bytes // block_bytes
            if count == 0:
                return False
            self.pool = torch.empty((count, *shape), dtype=keys.dtype, device=keys.device)
            self.free = list(range(count - 1, -1, -1))
        return True

    def _drop(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        self.free.extend(entry.blocks.tolist())


def _shared_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    m = min(len(a), len(b))
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0, 0]) if len(differ) else m
