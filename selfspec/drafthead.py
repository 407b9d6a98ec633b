"""The token ids a draft step scores (``DraftVocab``), and the head over just those ids.

A draft step's output head is a sizeable share of its cost, so it scores only the first token
ids, where byte-pair vocabularies keep their frequent tokens. Tokens past them still come up: a
name the prompt introduced, a rare word the answer repeats, the end-of-turn token itself.
``DraftVocab`` adds every id past the prefix that the context has used, and the stop tokens, and
scores them from their own rows of the head (for the kernel's modules, the panels that hold them,
copied once), with the same arithmetic as the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from selfspec.kernels import linear_outputs, linear_prefix


class DraftVocab:
    """The first ``prefix`` token ids of a ``size``-id vocabulary, plus the ids past them that
    the context has used and ``always`` (the stop tokens)."""

    def __init__(self, prefix: int, size: int, always: Iterable[int] = ()):
        self.prefix, self.size = prefix, size
        self.always = tuple(always)
        self.reset()

    def reset(self) -> None:
        """Forget the context (a new generation): only the prefix and ``always``."""
        self.extra: list[int] = []
        self._seen = 0  # tokens of the context already looked at
        self._ids = None  # ``extra`` as a tensor, built when first needed
        self._outputs = None  # the head over ``extra``, built when first needed
        self.add(self.always)

    def add(self, ids: Iterable[int]) -> None:
        known = set(self.extra)
        new = [t for t in dict.fromkeys(ids) if self.prefix <= t < self.size and t not in known]
        if new:
            self.extra += new
            self._ids = self._outputs = None

    def _extra_ids(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = torch.tensor(self.extra)
        return self._ids

    def follow(self, context: list[int]) -> None:
        """Take in the tokens ``context`` (the whole text so far) gained since the last call."""
        self.add(context[self._seen :])
        self._seen = len(context)

    def logits(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``linear``'s outputs for the prefix, then for ``extra`` in order: [..., prefix + E]."""
        prefix = linear_prefix(linear, x, self.prefix)
        if not self.extra:
            return prefix
        if self._outputs is None:
            self._outputs = linear_outputs(linear, self._extra_ids())
        return torch.cat([prefix, self._outputs(x)], dim=-1)

    def id_at(self, index: int) -> int:
        """The token id of position ``index`` of ``logits``' output."""
        return index if index < self.prefix else self.extra[index - self.prefix]

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """[prefix + E] logits -> [size], -inf at every id the draft does not score (q = 0)."""
        out = logits.new_full((self.size,), float("-inf"))
        out[: self.prefix] = logits[: self.prefix]
        if self.extra:
            out[self._extra_ids()] = logits[self.prefix :]
        return out


def head_logits(head: torch.nn.Module, x: torch.Tensor, vocab: int | DraftVocab | None):
    """The output head over all ids (None), the first ``vocab`` ids, or a ``DraftVocab``'s."""
    if isinstance(vocab, DraftVocab):
        return vocab.logits(head, x)
    return linear_prefix(head, x, vocab)
