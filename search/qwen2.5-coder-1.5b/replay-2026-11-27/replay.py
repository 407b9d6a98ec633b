"""Replay drafting policies over recorded greedy answers (stop 40's "replayed before building").

    python search/qwen2.5-coder-1.5b/replay-2026-11-27/replay.py record --out answers.pt
    python search/qwen2.5-coder-1.5b/replay-2026-11-27/replay.py replay answers.pt

``record`` writes each Spec-Bench prompt's greedy answer (``--limit`` per category) and, at every
answer position, what the draft heads would guess there: the chain fed the true tokens (as
drafting meets it while its guesses are right), each guess's id and top probability over the
draft's ids (the context's ids only once the context holds them), for several draft vocabulary
sizes. ``replay`` walks each answer round by round under a policy (context match first, else head
guesses while the committed rule says a guess is worth its verify row) and prices each round with
fixed costs (verify passes by rows in plain steps, a head guess in plain steps). It is a model of
the drafter, not the drafter: no learning, no Python overhead, costs fixed.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, replace

import torch

from selfspec.drafters.ngram import ContextIndex

VOCABS = (16384, 8192, 4096, 2048)
FAST_ROWS = (1.0, 1.10, 1.21, 1.30, 1.50)  # verify pass over 1..5 rows, in plain steps
SLOW_ROWS = (1.0, 1.02, 1.09, 1.17, 1.40)
STALE_ROWS = (1.0, 1.0, 1.0, 1.0, 1.45)  # what the drafter believed with a stale plain step


def record(args) -> None:
    from selfspec.drafters.heads import HeadDrafter
    from selfspec.engine import Engine
    from selfspec.prompts import load_prompts

    engine = Engine.load(args.model)
    runner, adapter = engine.runner, engine.runner.adapter
    chosen = engine.resolve_heads(args.heads or True)
    heads = HeadDrafter(runner, chosen, stop_ids=engine.eos_ids())
    drafter = engine.self_drafter()
    records = []
    for prompt in load_prompts("spec-bench", args.limit):
        ids = engine.encode(prompt.text, chat=True)
        answer = engine.generate(ids, drafter, max_new_tokens=args.max_new_tokens).token_ids
        records.append(_chains(runner, adapter, heads, prompt.category, ids, answer))
        print(prompt.category, len(ids), len(answer), flush=True)
    torch.save(records, args.out)


@torch.inference_mode()
def _chains(runner, adapter, heads, category, prompt, answer) -> dict:
    from selfspec.drafters.heads import head_step

    full, n = prompt + answer, len(answer)
    runner.reset(len(full) + 4)
    hidden, _ = runner._run(
        torch.tensor(full).view(1, -1),
        0,
        0,
        runner.num_sublayers,
        frozenset(),
        frozenset(),
        None,
        None,
    )
    state = adapter.final_norm(hidden[0, len(prompt) - 1 : len(prompt) - 1 + n]).float()
    heads.vocab.reset()
    heads.vocab.follow(full)
    first_seen = {}
    for i, t in enumerate(full):
        first_seen.setdefault(t, i)
    base, extra = heads.vocab.base_ids, heads.vocab.extra
    ids = torch.tensor(base + extra)
    # an extra id may be scored at position i only once the context (prompt + answer[:i + 1]) has it
    extra_seen = torch.tensor([first_seen[t] for t in extra], dtype=torch.long)
    guesses = {v: [] for v in VOCABS}  # vocab -> per head j: (ids [n], confidence [n])
    # committed vocab, per head j: the second-best probability [n] and the entropy [n] (nats)
    extras = []
    for j in range(len(heads.heads)):
        feed = torch.cat([heads._token_input(answer[min(i + j, n - 1)]) for i in range(n)])
        state = head_step(state, feed, heads.products[j], heads.down_products[j])
        logits = adapter.normed_logits(state.to(hidden.dtype)[None], heads.vocab)[0].float()
        hidden_later = extra_seen[None, :] > len(prompt) + torch.arange(n)[:, None]
        logits[:, len(base) :] = logits[:, len(base) :].masked_fill(hidden_later, float("-inf"))
        for vocab in VOCABS:
            cut = logits.clone()
            cut[:, vocab : len(base)] = float("-inf")
            probs = torch.softmax(cut, -1)
            top = probs.topk(2, -1)
            guesses[vocab].append((ids[top.indices[:, 0]], top.values[:, 0]))
            if vocab == Policy.vocab:
                entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
                extras.append((top.values[:, 1], entropy))
    return dict(category=category, prompt=prompt, answer=answer, guesses=guesses, extras=extras)


@dataclass(frozen=True)
class Policy:
    vocab: int = 8192  # the committed draft vocabulary (16384 until stop 41)
    guess_cost: float = 0.0  # plain steps; 0: a 16384-id guess's 0.039, scaled by its bytes
    head_mb: float = 5.0  # a head's weights as a guess reads them (two layers: 7.5)
    rows: tuple = FAST_ROWS
    row_slope: float = 0.15  # past the table
    context_tokens: int = 3  # a context match drafts this many
    min_match: int = 2
    oracle: bool = False  # stop the head chain exactly where it fails
    context_after_heads: int = 0  # a context match continuing the head guesses, this many
    heads_overrule: float = 0.0  # a disagreeing head first guess this confident replaces a match
    believed_rows: tuple | None = None  # verify costs the rule decides by, where not ``rows``

    def __post_init__(self) -> None:
        if not self.guess_cost:  # a guess reads head_mb MB of head weights, 1.26 KB per draft id
            cost = 0.039 * (self.head_mb + 1.26e-3 * self.vocab) / 25.6
            object.__setattr__(self, "guess_cost", cost)

    def verify(self, rows: int, believed: bool = False) -> float:
        """A verify pass's cost in plain steps: paid, or as the rule believes it (``believed``)."""
        table = (self.believed_rows or self.rows) if believed else self.rows
        return (
            table[rows - 1]
            if rows <= len(table)
            else table[-1] + self.row_slope * (rows - len(table))
        )


def _head_draft(policy: Policy, chain, i: int, answer: list[int]) -> tuple[list[int], int]:
    """Head guesses at position i under the committed rule (or the oracle), and guesses computed.

    The drafter cannot tell which guess misses, so guesses after a miss are proposed too while
    the rule says so: they cost rows and are never kept (-1 here; their confidences are those of
    the chain fed the true tokens, the nearest thing recorded). Before 2026-11-27 the replay
    stopped at the first miss, which priced long chains too kindly."""
    draft, chance, expected, steps, missed = [], 1.0, 1.0, 0, False
    for ids, confidence in chain:
        guess, c = int(ids[i]), float(confidence[i])
        steps += 1
        right = not missed and i + len(draft) + 1 < len(answer)
        right = right and guess == answer[i + len(draft) + 1]
        if policy.oracle:
            if not right:
                break
            draft.append(guess)
            continue
        chance *= c
        k = len(draft)
        cost = policy.verify(k + 1, True) + k * policy.guess_cost
        extra = policy.verify(k + 2, True) - policy.verify(k + 1, True) + policy.guess_cost
        if chance * cost < 1.02 * extra * expected:
            break
        draft.append(guess if right else -1)
        expected += chance
        missed = missed or not right
    return draft, steps


def replay_one(policy: Policy, rec: dict, before_heads=None) -> tuple[int, float]:
    """Tokens after the first and their cost in plain steps, round by round. ``before_heads``
    (committed ids -> draft), if given, drafts where no context match does and it returns
    tokens; the heads draft where it returns none."""
    prompt, answer = rec["prompt"], rec["answer"]
    chain = rec["guesses"][policy.vocab]
    index = ContextIndex(min_ngram=policy.min_match)
    i, cost = 0, 0.0
    while i < len(answer) - 1:
        committed = prompt + answer[: i + 1]
        index.sync(committed)
        match = index.lookup(16)
        steps = 0
        if match is not None and policy.heads_overrule:
            ids, confidence = chain[0]
            if int(ids[i]) != match.tokens[0] and float(confidence[i]) > policy.heads_overrule:
                match = None
        if match is not None:
            draft = match.tokens[: policy.context_tokens]
        else:
            draft = before_heads(committed) if before_heads is not None else []
        if match is None and not draft:
            draft, steps = _head_draft(policy, chain, i, answer)
            if policy.context_after_heads and draft:
                more = ContextIndex(min_ngram=policy.min_match)
                more.sync(committed + draft)
                follow = more.lookup(policy.context_after_heads)
                draft += follow.tokens if follow is not None else []
        kept = 0
        while (
            kept < len(draft) and i + kept + 1 < len(answer) and answer[i + kept + 1] == draft[kept]
        ):
            kept += 1
        cost += policy.verify(len(draft) + 1) + steps * policy.guess_cost
        i += kept + 1
    return i, cost


def replay(args) -> None:
    records = torch.load(args.answers, weights_only=False)
    base = Policy(head_mb=args.head_mb)
    variants = {
        "committed policy": base,
        "oracle chain length": replace(base, oracle=True),
        "head guesses cost nothing": replace(base, guess_cost=1e-9),
        **{
            f"{v} draft ids": replace(base, vocab=v, guess_cost=0.0)
            for v in VOCABS
            if v != base.vocab
        },
        "context match after head guesses (4)": replace(base, context_after_heads=4),
        "context match after head guesses (8)": replace(base, context_after_heads=8),
        "context drafts of 5": replace(base, context_tokens=5),
        "context drafts of 8": replace(base, context_tokens=8),
        "context matches of 3+ tokens": replace(base, min_match=3),
        "heads overrule a match (0.5)": replace(base, heads_overrule=0.5),
        "heads overrule a match (0.7)": replace(base, heads_overrule=0.7),
        "verify rows 20% cheaper": replace(base, rows=(1.0, 1.08, 1.17, 1.24, 1.40)),
        "verify rows 35% cheaper": replace(base, rows=(1.0, 1.065, 1.14, 1.2, 1.33)),
        "slower state's verify rows": replace(base, rows=SLOW_ROWS),
        "rows believed free (a stale plain step)": replace(base, believed_rows=STALE_ROWS),
    }
    print("| variant | median of per-prompt speedups | pooled |\n|---|---:|---:|")
    for name, policy in variants.items():
        ratios, tokens, steps = [], 0, 0.0
        for rec in records:
            t, c = replay_one(policy, rec)
            if t:
                ratios.append(t / c)
                tokens, steps = tokens + t, steps + c
        print(f"| {name} | {statistics.median(ratios):.3f}x | {tokens / steps:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", default="qwen2.5-coder-1.5b")
    rec.add_argument("--limit", type=int, default=2)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--out", required=True)
    rec.add_argument("--heads", help="draft heads file (default: the model's)")
    rep = sub.add_parser("replay")
    rep.add_argument("answers")
    rep.add_argument("--head-mb", type=float, default=5.0, help="two-layer heads: 7.5")
    args = parser.parse_args()
    if args.command == "record":
        record(args)
    else:
        replay(args)


if __name__ == "__main__":
    main()
