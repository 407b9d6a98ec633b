"""Token trees of draft-head guesses (selfspec.drafters.head_tree): the likeliest nodes first,
parents before children, and output identical to plain decoding. Sampled trees share the decode
loop's tree rule, whose distribution tests/test_recycled.py checks."""

from __future__ import annotations

import pytest
import torch
from test_heads import random_heads
from test_recycled import LONG, tiny_packed  # noqa: F401 (a fixture)

from selfspec.drafters.adaptive import AdaptiveDrafter
from selfspec.drafters.head_tree import grow_tree
from selfspec.drafters.heads import HeadDrafter
from selfspec.runtime.sampling import Sampling


def three_children(j, states, tokens):
    """A head step whose every node's likeliest children are 10t + 1, + 2, + 3."""
    ids = [[10 * t + 1, 10 * t + 2, 10 * t + 3] for t in tokens]
    return states, ids, [[0.6, 0.3, 0.1]] * len(tokens)


def test_a_tree_holds_the_likeliest_guesses_parents_first():
    root = torch.zeros(1, 4)
    tokens, parents, chances, steps = grow_tree(three_children, root, 0, depth=2, nodes=4)
    # 12 (0.18) rather than 3 (0.1), though 3 was a candidate first
    assert tokens == [1, 11, 2, 12] and parents == [-1, 0, -1, 0] and steps == 2
    assert chances == pytest.approx([0.6, 0.36, 0.3, 0.18])
    tokens, parents, chances, _ = grow_tree(three_children, root, 0, depth=3, nodes=8)
    assert len(tokens) == 8 and chances == sorted(chances, reverse=True)
    assert all(-1 <= parents[i] < i for i in range(8))  # every prefix is a tree
    assert all(chances[i] <= chances[parents[i]] for i in range(8) if parents[i] >= 0)
    assert [tokens[parents[i]] for i in range(8) if parents[i] >= 0] == [
        t // 10 for t, p in zip(tokens, parents) if p >= 0
    ]


def test_worth_cuts_the_tree_and_spares_head_steps_that_could_not_pay():
    root = torch.zeros(1, 4)
    worth = lambda chances: chances[-1] >= 0.3  # noqa: E731
    tokens, parents, chances, steps = grow_tree(three_children, root, 0, 3, 8, worth)
    assert tokens == [1, 11, 2] and parents == [-1, 0, -1]
    assert steps == 3  # the third step ran (11's children might have passed), none did
    tokens, _, _, steps = grow_tree(three_children, root, 0, 3, 8, lambda chances: False)
    assert tokens == [1] and steps == 1  # the first guess always; no step for its children


@pytest.mark.parametrize("planned", [False, True])
def test_greedy_head_trees_are_identical_to_plain_decoding(tiny_packed, planned):  # noqa: F811
    engine = tiny_packed
    assert engine.runner.trees
    prompt = [5, 17, 33, 2, 9, 41, 12, 5, 17, 60, 3]
    plain = engine.generate(prompt, None, config=engine.decode_config(None, **LONG))
    assert len(plain.token_ids) == 48
    heads = HeadDrafter(engine.runner, random_heads(64, 2, 64))
    drafter = AdaptiveDrafter(
        engine.runner.head_rows, planned=planned, min_ngram=5, heads=heads, head_trees=True
    )
    config = engine.decode_config(drafter, fallback=False, **LONG)
    out = engine.generate(prompt, drafter, config=config)
    assert out.token_ids == plain.token_ids
    rounds, drafted, _ = out.stats.sources["heads"]
    if planned:  # random heads seldom pay: drafted, then tried now and then
        assert rounds >= 1
    else:  # every round a whole tree: three guesses at the first position
        assert rounds > 5 and drafted > rounds and out.stats.tree_rounds > 5
    sampled = engine.generate(prompt, drafter, max_new_tokens=8, sampling=Sampling(0.7), seed=0)
    assert len(sampled.token_ids) == 8
