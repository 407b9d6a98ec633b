"""Three ways to help the heads from the context, measured on ``record.py``'s chains (stop 43).

    python context.py WORK/records.pt [--answers A.safetensors ...]

Only positions where the drafter would use the heads count (no context match of 2+ tokens, the
n-gram drafter's rule). Guesses score the heads' draft ids: the 8192 most frequent and the ids
the context holds.
  bias:        a bonus to the logits of ids the context holds, and of ids that followed the fed
               token somewhere in the context; first-guess accuracy on items 1-2 and 3-4.
  followers:   the token that followed the pending token in the context (latest, most often)
               against the heads' first guess.
  choices:     where a matched n-gram went on in several ways, the latest occurrence's next
               token against the candidate the first head scores highest.
  datastore:   REST-style lookup of the longest suffix (2-6 tokens) in the model's own answers
               (the GPU runs' answer sets, decompressed .safetensors): its 4-token continuation
               against the heads' 4 guesses, alone and after the heads' first 1-2 guesses.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

from selfspec.drafters.heads import FREQUENT_IDS, DraftHeads
from selfspec.drafters.ngram import ContextIndex

HEADS = "selfspec/plans/qwen2.5-coder-1.5b/heads.safetensors"


def walk(records):
    """(record, i, context up to answer token i, the drafter's context match there or None)."""
    for r in records:
        context, index = list(r["prompt"]), ContextIndex()
        for i in range(len(r["answer"]) - 1):
            context.append(r["answer"][i])
            index.sync(context)
            yield r, i, context, index.lookup(1)


def head_positions(records):
    """(record, i, context so far, drafted ids per head j): where the heads would draft."""
    heads = DraftHeads.load(HEADS)
    frequent = set(heads.frequent[heads.frequent < 151936][:FREQUENT_IDS].tolist())
    for r, i, context, match in walk(records):
        if match is None:
            seen = set(context)
            allowed = [
                [k for k, t in enumerate(ids.tolist()) if t in frequent or t in seen]
                for ids in (indices[i] for _, indices in r["chain"])
            ]
            yield r, i, context, allowed


def bias(records) -> None:
    for name, part in (("items 1-2", [r for r in records if r["item"] <= 2]),
                       ("items 3-4", [r for r in records if r["item"] > 2])):  # fmt: skip
        for b_in, b_follow in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0)):
            right = total = 0
            for r, i, context, allowed in head_positions(part):
                keep = allowed[0]
                if not keep:
                    continue
                values, ids = r["chain"][0][0][i].float()[keep], r["chain"][0][1][i].tolist()
                ids = [ids[k] for k in keep]
                seen = set(context)
                followed = {b for a, b in zip(context, context[1:]) if a == context[-1]}
                bonus = torch.tensor([b_in * (t in seen) + b_follow * (t in followed) for t in ids])
                right += ids[int((values + bonus).argmax())] == r["answer"][i + 1]
                total += 1
            share = right / total
            print(f"bias {name}: context {b_in} followers {b_follow}: {share:.3f} of {total}")


def followers(records) -> None:
    c = collections.Counter()
    for r, i, context, allowed in head_positions(records):
        ids = r["chain"][0][1][i].tolist()
        guess = ids[allowed[0][0]] if allowed[0] else -1
        truth = r["answer"][i + 1]
        after = [b for a, b in zip(context, context[1:]) if a == context[-1]]
        c["positions"] += 1
        if after:
            c["with"] += 1
            c["heads"] += guess == truth
            c["latest"] += after[-1] == truth
            c["most"] += collections.Counter(after).most_common(1)[0][0] == truth
    w = c["with"]
    print(f"followers: {w} of {c['positions']} positions have one")
    for kind in ("heads", "latest", "most"):
        print(f"  right: {kind} {c[kind] / w:.3f}")


def choices(records) -> None:
    """At context matches (the drafter's own rule), where the matched n-gram went on in more than
    one way: the latest occurrence's next token against the one the first head scores highest."""
    c = collections.Counter()
    for r, i, context, match in walk(records):
        if match is None:
            continue
        n, suffix, following = match.ngram, context[-match.ngram :], collections.Counter()
        latest = None
        for end in range(n - 1, len(context) - 1):
            if context[end - n + 1 : end + 1] == suffix:
                following[context[end + 1]] += 1
                latest = context[end + 1]
        values, ids = r["chain"][0]
        score = {t: float(v) for t, v in zip(ids[i].tolist(), values[i].float())}
        picked = max(following, key=lambda t: score.get(t, -1e9))
        picked = picked if picked in score else latest
        truth = r["answer"][i + 1]
        c["matches"] += 1
        c["latest right"] += latest == truth
        c["picked right"] += picked == truth
        if len(following) > 1:
            c["several ways"] += 1
            c["several: latest right"] += latest == truth
            c["several: picked right"] += picked == truth
    print(f"choices: {dict(c)}")


class Datastore:
    """Every 2..6-gram of the answers (hashed, sorted) and where it ended."""

    P = np.int64(1000003)

    def __init__(self, paths: list[str]):
        from safetensors.torch import load_file

        seqs = []
        for path in paths:
            f = load_file(path)
            tokens, lengths = f["tokens"].numpy().astype(np.int64), f["lengths"].numpy()
            start = 0
            for p, a in lengths:  # answers, with up to 8 prompt tokens before them
                seqs.append(np.append(tokens[start + max(0, p - 8) : start + p + a], -1))
                start += p + a
        self.tokens = np.concatenate(seqs)
        self.index = {}
        with np.errstate(over="ignore"):
            for n in range(2, 7):
                h, valid = np.zeros(len(self.tokens), np.int64), np.ones(len(self.tokens), bool)
                for k in range(n):  # h[p] hashes tokens p-n+1..p, first to last
                    shifted = np.roll(self.tokens, n - 1 - k)
                    h, valid = h * self.P + shifted, valid & (shifted >= 0)
                valid[: n - 1] = False
                ends = np.nonzero(valid[:-1] & (self.tokens[1:] >= 0))[0]
                order = np.argsort(h[ends], kind="stable")
                self.index[n] = (h[ends][order], ends[order])

    def lookup(self, context: list[int], depth: int, min_n: int) -> list[int] | None:
        """The most frequent continuation (token by token) of the longest matching suffix."""
        for n in range(6, min_n - 1, -1):
            if len(context) < n:
                continue
            h = np.int64(0)
            with np.errstate(over="ignore"):
                for t in context[-n:]:
                    h = h * self.P + np.int64(t)
            hashes, ends = self.index[n]
            lo, hi = np.searchsorted(hashes, h), np.searchsorted(hashes, h, "right")
            if hi == lo:
                continue
            at, out = ends[lo:hi], []
            for d in range(1, depth + 1):
                at = at[at + d < len(self.tokens)]
                following = self.tokens[at + d]
                counts = collections.Counter(int(t) for t in following if t >= 0)
                if not counts:
                    break
                token = counts.most_common(1)[0][0]
                out.append(token)
                at = at[following == token]
            return out
        return None


def datastore(records, paths: list[str]) -> None:
    store = Datastore(paths)
    print(f"datastore: {len(store.tokens)} tokens")

    def kept(draft, answer, i):
        k = 0
        while k < len(draft) and i + k + 1 < len(answer) and draft[k] == answer[i + k + 1]:
            k += 1
        return k

    for min_n in (2, 3, 4):
        c = collections.Counter()
        for r, i, context, allowed in head_positions(records):
            n = len(r["answer"])
            guesses = [
                r["chain"][j][1][i].tolist()[allowed[j][0]] if allowed[j] and i + j + 1 < n else -1
                for j in range(4)
            ]
            heads_kept = kept(guesses, r["answer"], i)
            c["heads"] += heads_kept
            found = store.lookup(context, 4, min_n)
            if found is not None:
                c["matched"] += 1
                c["store"] += kept(found, r["answer"], i)
                c["heads at matches"] += heads_kept
            for first in (1, 2):
                after = store.lookup(context + guesses[:first], 4 - first, min_n)
                draft = guesses[:first] + (after if after is not None else guesses[first:])
                c[f"heads {first} then store"] += kept(draft, r["answer"], i)
        print(f"datastore, suffixes of {min_n}+ tokens: {dict(c)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("records")
    parser.add_argument("--answers", nargs="*", default=[])
    args = parser.parse_args()
    records = torch.load(args.records, weights_only=False)
    bias(records)
    followers(records)
    choices(records)
    if args.answers:
        datastore(records, args.answers)


if __name__ == "__main__":
    main()
