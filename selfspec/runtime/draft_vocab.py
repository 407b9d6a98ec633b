"""The token ids a draft step scores (``DraftVocab``), and the head over just those ids.

A draft step's output head is a sizeable share of its cost, so it scores only some ids: the
first ones, where byte-pair vocabularies keep their frequent tokens, or a list of the ids most
frequent in the answers the draft heads were trained on (the same share of a text's tokens in half
as many ids; their rows gathered into a head of their own once). Other tokens still come up: a
name the prompt introduced, a rare word the answer repeats, the end-of-turn token itself.
``DraftVocab`` adds every id outside its base that the context has used, and the stop tokens, and
scores them from their own rows of the head (for the kernel's modules, the panels that hold them,
copied once), with the same arithmetic as the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from selfspec.kernels import linear_outputs, linear_prefix, linear_rows


class DraftVocab:
    """The token ids a draft scores: a base set (the first ``base`` ids of a ``size``-id
    vocabulary, or the ids ``base`` lists, e.g. the most frequent first), plus the ids outside it
    that the context has used and ``always`` (the stop tokens)."""

    def __init__(self, base: int | Sequence[int], size: int, always: Iterable[int] = ()):
        if isinstance(base, int):
            self.base_ids, self.prefix = None, base
        else:
            ids = dict.fromkeys(int(t) for t in base)  # ints: a tensor's elements hash by identity
            self.base_ids = [t for t in ids if 0 <= t < size]
            self.prefix = len(self.base_ids)
            self._in_base = set(self.base_ids)
            self._base_tensor = torch.tensor(self.base_ids)
            self._base_outputs = None  # the head over base_ids, built when first needed
        self.size = size
        self.always = tuple(always)
        self.reset()

    def reset(self) -> None:
        """Forget the context (a new generation): only the base and ``always``."""
        self.extra: list[int] = []
        self._seen = 0  # tokens of the context already looked at
        self._ids = None  # ``extra`` as a tensor, built when first needed
        self._outputs = None  # the head over ``extra``, built when first needed
        self.add(self.always)

    def _in_base_ids(self, token: int) -> bool:
        return token < self.prefix if self.base_ids is None else token in self._in_base

    def add(self, ids: Iterable[int]) -> None:
        known = set(self.extra)
        new = [
            t
            for t in dict.fromkeys(ids)
            if 0 <= t < self.size and t not in known and not self._in_base_ids(t)
        ]
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

    def prepare(self, linear: torch.nn.Module) -> None:
        """Gather the base ids' rows of ``linear`` now (given ids only; a prefix needs nothing), so
        that the first draft, whose time the drafter measures, does not pay for it."""
        if self.base_ids is not None and self._base_outputs is None:
            self._base_outputs = linear_rows(linear, self._base_tensor)

    def logits(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``linear``'s outputs for the base ids, then for ``extra`` in order: [..., base + E]."""
        if self.base_ids is None:
            base = linear_prefix(linear, x, self.prefix)
        else:
            self.prepare(linear)
            base = self._base_outputs(x)
        if not self.extra:
            return base
        if self._outputs is None:
            self._outputs = linear_outputs(linear, self._extra_ids())
        return torch.cat([base, self._outputs(x)], dim=-1)

    def id_at(self, index: int) -> int:
        """The token id of position ``index`` of ``logits``' output."""
        if index >= self.prefix:
            return self.extra[index - self.prefix]
        return index if self.base_ids is None else self.base_ids[index]

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """[base + E] logits -> [size], -inf at every id the draft does not score (q = 0)."""
        out = logits.new_full((self.size,), float("-inf"))
        if self.base_ids is None:
            out[: self.prefix] = logits[: self.prefix]
        else:
            out[self._base_tensor.to(out.device)] = logits[: self.prefix]
        if self.extra:
            out[self._extra_ids()] = logits[self.prefix :]
        return out


def head_logits(head: torch.nn.Module, x: torch.Tensor, vocab: int | DraftVocab | None):
    """The output head over all ids (None), the first ``vocab`` ids, or a ``DraftVocab``'s."""
    if isinstance(vocab, DraftVocab):
        return vocab.logits(head, x)
    return linear_prefix(head, x, vocab)
