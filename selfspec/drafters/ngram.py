"""Free drafts from the context: the tokens that followed the last time the same n tokens appeared.

Prompt lookup decoding: summaries quote their source, answers about a document copy its phrases,
edited code repeats the code it edits, and generated code repeats itself. A match costs no model
pass at all, only the rows it adds to the verify pass.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_NGRAM = 2
MAX_NGRAM = 5


@dataclass
class Match:
    """A continuation found in the context: ``tokens`` followed the ``ngram`` last tokens before."""

    tokens: list[int]
    ngram: int  # how many tokens matched
    end: int  # position of the earlier occurrence's last token


class ContextIndex:
    """Where each n-gram (MIN_NGRAM..MAX_NGRAM tokens) last ended in a growing token sequence.

    ``extend`` indexes new tokens incrementally; ``lookup`` finds the longest n-gram ending the
    sequence that occurred earlier, and what followed its latest earlier occurrence."""

    def __init__(self, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # positions < indexed are in last_end

    def reset(self) -> None:
        self.tokens, self.last_end, self.indexed = [], {}, 0

    def sync(self, tokens: list[int]) -> None:
        """Follow ``tokens``: the committed sequence, which only grows within a generation (a new
        generation calls ``reset`` first)."""
        if len(tokens) < self.indexed:
            self.reset()
        self.tokens = tokens

    def _index_until(self, stop: int) -> None:
        tokens = self.tokens
        for end in range(self.indexed, stop):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, stop)

    def lookup(self, max_tokens: int) -> Match | None:
        """The continuation of the longest earlier match of the sequence's last n tokens."""
        tokens = self.tokens
        length = len(tokens)
        # Index every position but the last: the current suffix must match an earlier occurrence.
        self._index_until(length - 1)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self.last_end.get(tuple(tokens[length - n :]))
            if end is None:
                continue
            following = tokens[end + 1 : min(length, end + 1 + max_tokens)]
            if following:
                return Match(following, n, end)
        return None
