"""Keys and values of prompts already read, kept for the next request that starts with the same
tokens (a chat's system prompt; in a later turn of a conversation, all the turns before it), so
that request reads only the rest of its prompt (``PrefixStore``; what llama.cpp's server calls
prompt caching and vLLM automatic prefix caching).

A row's keys and values depend on the tokens up to it only, and where the runner batches
(``ModelRunner.can_batch``) they are the same bits whichever pass wrote them, so a request that
starts from a stored prefix gets exactly the tokens a fresh prefill gives. Entries are copies: a
sequence's cache is reused or dropped when it ends. Past a byte budget the least recently used
entry goes first; an entry that a newer one extends is dropped at once.
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
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [heads, n, dim]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class PrefixStore:
    """Prompts' (and answers') keys and values by their tokens, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: list[_Entry] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

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
        for i, (keys, values) in enumerate(best.layers):
            cache_keys, cache_values = cache.layer(i)
            cache_keys[:, :shared] = keys[:, :shared]
            cache_values[:, :shared] = values[:, :shared]
        self.entries.remove(best)
        self.entries.append(best)
        return shared

    def save(self, token_ids: list[int], cache: KVCache) -> None:
        """Keep the keys and values of ``token_ids``, the tokens at the first positions of
        ``cache`` (as many as fit in the budget)."""
        if not token_ids or self.budget_bytes <= 0:
            return
        keys, _ = cache.layer(0)
        per_token = 2 * keys[:, :1].nbytes * len(cache.keys)
        n = min(len(token_ids), self.budget_bytes // per_token)
        if n == 0:
            return
        tokens = torch.tensor(token_ids[:n], dtype=torch.long)
        for entry in self.entries:
            if _shared_length(entry.tokens, tokens) == n:  # stored already
                self.entries.remove(entry)
                self.entries.append(entry)
                return
        layers = []
        for i in range(len(cache.keys)):
            keys, values = cache.layer(i)
            layers.append((keys[:, :n].clone(), values[:, :n].clone()))
        # an entry the new one extends holds nothing the new one lacks
        self.entries = [e for e in self.entries if _shared_length(e.tokens, tokens) < len(e.tokens)]
        self.entries.append(_Entry(tokens, layers))
        while self.nbytes > self.budget_bytes:
            self.entries.pop(0)


def _shared_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    m = min(len(a), len(b))
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0, 0]) if len(differ) else m
