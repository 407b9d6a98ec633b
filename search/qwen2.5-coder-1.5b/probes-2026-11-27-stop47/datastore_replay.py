"""The model's own answers as a datastore drafter, replayed with this Xeon's costs (stop 47).

    python datastore_replay.py RECORDS A.safetensors B.safetensors

RECORDS: ``replay.py record``'s output (stop 40's replay folder). A and B: the GPU runs' answer
sets, decompressed (``xz -dc``). Stop 43 (``probes-2026-11-27-stop43/context.py``) counted the
datastore's kept tokens against the heads'; this prices it in the replay. At each answer position
without a context match, the datastore drafts the most frequent continuation of the longest suffix
(2-8 tokens) that the 2.43M answer tokens hold, while the product of each next token's share of
the continuations stays above a bound (``replay.py``'s ``replay_one`` with it before the heads);
elsewhere the heads' guesses under the committed rule.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "replay-2026-11-27"))
from replay import Policy, replay_one  # noqa: E402

from selfspec.drafters.ngram import ContextIndex  # noqa: E402

XEON_ROWS = (1.0, 1.04, 1.06, 1.13, 1.23)  # verify passes over 1..5 rows (stop 45's bench)
_MUL = np.uint64(1000003)


def _hash(tokens) -> np.uint64:
    h = np.uint64(0)
    with np.errstate(over="ignore"):
        for t in tokens:
            h = h * _MUL + np.uint64(t + 7)
    return h


class Store:
    """Every answer's n-grams (n <= nmax) by hash, sorted, with where each starts."""

    def __init__(self, answers: list[list[int]], nmax: int = 8):
        parts = [np.asarray(a + [-1], dtype=np.int64) for a in answers]  # -1 ends an answer
        self.tokens, self.nmax, self.tables = np.concatenate(parts), nmax, {}
        n_all = len(self.tokens)
        h, crosses = np.zeros(n_all, dtype=np.uint64), np.zeros(n_all, dtype=bool)
        with np.errstate(over="ignore"):
            for n in range(1, nmax + 1):
                last = np.full(n_all, -1, dtype=np.int64)
                last[: n_all - n + 1] = self.tokens[n - 1 :]
                crosses |= last < 0
                h = h * _MUL + (last.astype(np.uint64) + np.uint64(7))
                starts = np.nonzero(~crosses)[0]
                order = np.argsort(h[starts], kind="stable")
                self.tables[n] = (h[starts][order], starts[order])

    def lookup(self, committed: list[int], min_n: int = 2, most: int = 8, cap: int = 512):
        """(n, tokens, shares) for the longest suffix of at least ``min_n`` tokens found."""
        for n in range(min(self.nmax, len(committed)), min_n - 1, -1):
            suffix, (hashes, starts) = committed[-n:], self.tables[n]
            h = _hash(suffix)
            lo, hi = np.searchsorted(hashes, h, "left"), np.searchsorted(hashes, h, "right")
            found = starts[lo:hi][:cap]
            same = np.all([self.tokens[found + j] == suffix[j] for j in range(n)], axis=0)
            cursor = found[same] + n
            if not len(cursor):
                continue
            tokens, shares = [], []
            for _ in range(most):
                cursor = cursor[cursor < len(self.tokens)]
                following = self.tokens[cursor]
                if not (following >= 0).any():
                    break
                values, counts = np.unique(following[following >= 0], return_counts=True)
                best = int(np.argmax(counts))
                tokens.append(int(values[best]))
                shares.append(counts[best] / len(following))
                cursor = cursor[following == tokens[-1]] + 1
            return n, tokens, shares
        return None


def read_answers(paths: list[str]) -> list[list[int]]:
    answers = []
    for path in paths:
        with safe_open(path, "pt") as f:
            tokens, lengths = f.get_tensor("tokens").tolist(), f.get_tensor("lengths").tolist()
        first = 0
        for prompt_len, answer_len in lengths:
            answers.append(tokens[first + prompt_len : first + prompt_len + answer_len])
            first += prompt_len + answer_len
    return answers


def _store_draft(store: Store, committed: list[int], *, min_n: int, bound: float) -> list[int]:
    found = store.lookup(committed, min_n=min_n)
    if found is None:
        return []
    draft, chance = [], 1.0
    for token, share in zip(found[1], found[2]):
        chance *= share
        if chance < bound or len(draft) >= 6:
            break
        draft.append(token)
    return draft


def _kept(draft: list[int], answer: list[int], i: int) -> int:
    kept = 0
    while kept < len(draft) and answer[i + kept + 1 : i + kept + 2] == [draft[kept]]:
        kept += 1
    return kept


def first_guesses(store: Store, records: list[dict]) -> None:
    """At positions with no context match, by the datastore's suffix length (0: none found):
    its first token right, its tokens kept, the heads' first guess right, the heads' chain kept
    (all teacher-forced)."""
    by = defaultdict(lambda: [0, 0, 0, 0, 0])
    for rec in records:
        prompt, answer, chain = rec["prompt"], rec["answer"], rec["guesses"][8192]
        index = ContextIndex(min_ngram=2)
        for i in range(len(answer) - 1):
            committed = prompt + answer[: i + 1]
            index.sync(committed)
            if index.lookup(16) is not None:
                continue
            found = store.lookup(committed)
            n, tokens = (0, []) if found is None else found[:2]
            kept = _kept(tokens, answer, i)
            heads = _kept([int(ids[i]) for ids, _ in chain], answer, i)
            row = by[n]
            row[0] += 1
            row[1] += kept > 0
            row[2] += kept
            row[3] += heads > 0
            row[4] += heads
    print("| suffix | positions | datastore first right | kept | heads first right | kept |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, (count, first, kept, head_first, head_kept) in sorted(by.items()):
        shares = [first / count, kept / count, head_first / count, head_kept / count]
        print(f"| {n} | {count} | " + " | ".join(f"{x:.3f}" for x in shares) + " |")


def main() -> None:
    records = torch.load(sys.argv[1], weights_only=False)
    store = Store(read_answers(sys.argv[2:]))
    first_guesses(store, records)
    policy = Policy(head_mb=7.5, rows=XEON_ROWS)
    variants = [("committed policy (no datastore)", None, 2, 0.0)]
    for n in (4, 6, 8):
        for b in (0.3, 0.5, 0.7):
            variants.append((f"datastore, suffix >= {n}, chance >= {b}", store, n, b))
    print("| variant | median of per-prompt speedups | pooled | by category |\n|---|---:|---:|---|")
    for name, chosen, min_n, bound in variants:
        ratios, tokens, steps, by = [], 0, 0.0, defaultdict(list)
        for rec in records:
            between = None
            if chosen is not None:
                between = partial(_store_draft, chosen, min_n=min_n, bound=bound)
            t, c = replay_one(policy, rec, between)
            if t:
                ratios.append(t / c)
                tokens, steps = tokens + t, steps + c
                by[rec["category"]].append(t / c)
        cats = " ".join(f"{k} {statistics.median(v):.2f}" for k, v in sorted(by.items()))
        print(f"| {name} | {statistics.median(ratios):.3f}x | {tokens / steps:.3f}x | {cats} |")


if __name__ == "__main__":
    main()
