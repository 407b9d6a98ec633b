"""Recycled drafts (selfspec.drafters.recycled): the model's own earlier predictions. The table
learns from every row of a pass (rows that read committed tokens winning), prefers the pair of
tokens to the token alone, stays bounded; the drafts are lossless in greedy decoding and in
sampling."""

import copy

import pytest
import torch

from selfspec.drafters import AdaptiveDrafter
from selfspec.drafters.recycled import RecycledDrafts, RecycledTable
from selfspec.kernels import kernel_available, load_kernel
from selfspec.runtime.runner import ScoredRows
from selfspec.runtime.sampling import Sampling, top_probability_rows

VOCAB = 16


def rows(start, ids, following, sure=8.0):
    """Logits whose top token after ids[i] is following[i]."""
    logits = torch.zeros(len(ids), VOCAB)
    for i, token in enumerate(following):
        logits[i, token] = sure
    return ScoredRows(start, ids, logits)


@pytest.mark.skipif(not kernel_available(), reason="the CPU kernel cannot be built")
def test_the_kernel_s_top_probabilities_are_torch_s_softmax():
    load_kernel()
    logits = torch.randn(3, 151936, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, 77] = logits[1, 78] = 30.0  # two equal maxima: the first, as torch.argmax
    ids, probs = top_probability_rows(logits)
    expected, expected_ids = torch.softmax(logits, dim=-1).max(dim=-1)
    assert ids == expected_ids.tolist() and ids[1] == 77
    assert probs == pytest.approx(expected.tolist(), rel=1e-5)
    logits[2, 5] = float("inf")  # nothing to tell: probability 0
    assert top_probability_rows(logits)[1][2] == 0.0


def test_every_row_is_learnt_and_rows_that_read_committed_tokens_win():
    table = RecycledTable()
    committed = [1, 2, 3, 4, 5, 9]  # the pass read 3, 4, 5, 6 at positions 2..5: 6 was rejected
    assert table.absorb(committed, rows(2, [3, 4, 5, 6], [4, 5, 9, 11])) == 3
    assert table.next_token(None, 5)[0] == 9 and table.next_token(2, 3)[0] == 4
    assert table.next_token(5, 6)[0] == 11  # after the rejected draft: still the model's guess
    assert table.next_token(None, 5)[1] == pytest.approx(
        torch.softmax(rows(0, [0], [9]).logits[0], 0)[9]
    )
    table = RecycledTable()
    committed = [1, 2, 3, 4]  # the pass read 3, 7, 3 at positions 2..4: 7 was rejected
    assert table.absorb(committed, rows(2, [3, 7, 3], [4, 3, 8])) == 1
    assert table.next_token(None, 3)[0] == 4  # the committed row's guess, not the one after 7
    assert table.next_token(7, 3)[0] == 8 and table.next_token(None, 7)[0] == 3


def test_a_pair_it_knows_wins_over_the_token_alone():
    table = RecycledTable()
    table.record(1, 7, following=2, probability=0.9)
    table.record(3, 7, following=5, probability=0.9)  # the token alone: its latest prediction
    assert table.next_token(1, 7)[0] == 2 and table.next_token(3, 7)[0] == 5
    assert table.next_token(4, 7)[0] == 5 and table.next_token(None, 7)[0] == 5


def test_chains_walk_the_table_and_stop_where_the_chance_falls_too_low():
    table = RecycledTable()
    table.record(None, 1, following=2, probability=0.9)
    table.record(1, 2, following=3, probability=0.5)
    table.record(2, 3, following=4, probability=0.05)  # 0.9 * 0.5 * 0.05 < MIN_CHANCE
    tokens, chances = table.chain(0, 1, limit=8)
    assert tokens == [2, 3] and chances == pytest.approx([0.9, 0.45])
    assert table.chain(0, 1, limit=1)[0] == [2]
    table.record(None, 8, following=9, probability=0.01)
    assert table.chain(None, 8, limit=4)[0] == [9]  # the first is always given
    assert table.chain(None, 15, limit=4) == ([], [])


def test_pairs_kept_are_bounded_the_oldest_written_going_first():
    table = RecycledTable(max_pairs=2)
    for before in range(3):
        table.record(before, 7, following=before, probability=0.5)
    assert list(table.by_pair) == [(1, 7), (2, 7)]


def recycled_drafter(engine, table=None, planned=False):
    """Recycled drafts only (the context index needs 5-grams that this text never repeats)."""
    recycled = RecycledDrafts(engine.runner, table)
    vocab = engine.runner.head_rows
    return AdaptiveDrafter(vocab, planned=planned, min_ngram=5, max_tokens=3, recycled=recycled)


def wrong_table(seed=0) -> RecycledTable:
    """A table that knows a random next token after every token: mostly wrong drafts."""
    generator = torch.Generator().manual_seed(seed)
    table = RecycledTable()
    for token in range(64):
        table.record(None, token, int(torch.randint(64, (1,), generator=generator)), 0.9)
    return table


def test_greedy_with_recycled_drafts_is_identical_to_plain_decoding(tiny_llama):
    prompt = [5, 17, 33, 2, 9, 41, 12, 5, 17, 60, 3]
    plain = tiny_llama.generate(prompt, None, max_new_tokens=40)
    drafter = recycled_drafter(tiny_llama, wrong_table())
    drafted = accepted = 0
    for _ in range(2):  # the second generation starts from what the first learnt
        out = tiny_llama.generate(prompt, drafter, max_new_tokens=40)
        assert out.token_ids == plain.token_ids
        _, d, a = out.stats.sources["recycled"]
        drafted, accepted = drafted + d, accepted + a
    assert drafted > accepted > 0  # kept and rejected drafts both ran
    assert drafter.recycled.learnt_rows > 40


@pytest.mark.slow
def test_greedy_recycled_drafts_of_a_real_model_are_plain_decoding_s(smollm2):
    ids = smollm2.encode("List the planets of the solar system, one per line.", chat=True)
    plain = smollm2.generate(ids, None, max_new_tokens=64)
    drafter = smollm2.self_drafter(layer_skip=False, heads=False)
    for _ in range(2):
        out = smollm2.generate(ids, drafter, max_new_tokens=64)
        assert out.token_ids == plain.token_ids
    assert out.stats.sources["recycled"][2] > 0  # the second time, its own text was known


@pytest.fixture
def sharper_tiny(tiny_llama, sharpened_head):
    with sharpened_head(tiny_llama, 30.0):
        yield tiny_llama


@pytest.mark.slow  # thousands of seeded generations
def test_sampling_with_recycled_drafts_matches_the_target(sharper_tiny, monkeypatch):
    """Recycled drafts are certain (q = 1 for the drafted token), as context drafts are: the
    second token's distribution is the target's, and with the rule broken it is not."""
    from test_drafting import second_token_counts
    from test_sampling import assert_keeps_target_distribution

    engine = sharper_tiny
    sampling = Sampling(temperature=1.0)
    prompt = [5, 17, 33, 2, 9, 41, 12]
    table = RecycledTable()  # every token's next after the prompt: often, not always, right
    with torch.inference_mode():
        for token in range(64):
            probs = torch.softmax(engine.loaded.model(torch.tensor([prompt + [token]])).logits, -1)
            top, following = probs[0, -1].max(-1)
            table.record(None, token, int(following), float(top))

    def second_tokens():
        make = lambda: recycled_drafter(engine, table)  # noqa: E731
        return second_token_counts(engine, prompt, sampling, 1500, make, "recycled", (0.1, 0.9))

    assert_keeps_target_distribution(engine, prompt, sampling, second_tokens, monkeypatch)


def test_kernel_top_k_is_torch_s_softmax_top_k():
    from selfspec.runtime.sampling import top_k_probability_rows

    if not kernel_available():
        pytest.skip("the CPU kernel cannot be built")
    load_kernel()
    logits = torch.randn(4, 151936, generator=torch.Generator().manual_seed(1)) * 4
    logits[1, 77] = logits[1, 78] = logits[1, 90] = 30.0  # ties: the lower id first
    ids, probs = top_k_probability_rows(logits, 3)
    expected, expected_ids = torch.softmax(logits, dim=-1).topk(3, dim=-1)
    assert ids[0] == expected_ids[0].tolist() and ids[1] == [77, 78, 90]
    assert sum(probs, []) == pytest.approx(expected.flatten().tolist(), rel=1e-4)
    logits[2, 5] = float("inf")  # nothing to tell: the argmax, probability 0, then -1
    ids, probs = top_k_probability_rows(logits, 3)
    assert ids[2] == [5, -1, -1] and probs[2] == [0.0, 0.0, 0.0]


def test_trees_grow_the_most_likely_nodes_first_within_their_depth():
    table = RecycledTable(width=3)
    table.record(None, 1, following=[2, 3], probability=[0.6, 0.25])
    table.record(1, 2, following=[4, 5], probability=[0.5, 0.4])
    table.record(1, 3, following=[6], probability=[0.9])
    table.record(2, 4, following=[7], probability=[0.1])  # 0.6 * 0.5 * 0.1 < MIN_CHANCE
    tokens, parents, chances = table.tree(0, 1, nodes=8, depth=4)
    assert tokens == [2, 4, 3, 5, 6] and parents == [-1, 0, -1, 0, 2]
    assert chances == pytest.approx([0.6, 0.3, 0.25, 0.24, 0.225])
    assert table.tree(0, 1, nodes=2, depth=4)[0] == [2, 4]
    assert table.tree(0, 1, nodes=8, depth=1)[0] == [2, 3]  # no deeper than asked
    assert table.tree(0, 15, nodes=8, depth=4) == ([], [], [])
    assert table.chain(0, 1, limit=4)[0] == [2, 4]  # a chain follows each key's first


def test_a_tree_keeps_the_path_the_target_s_argmax_follows():
    from selfspec.drafters import Draft
    from selfspec.runtime.decode import accept_tree

    # the pending token, then 2 and 3 after it; 4 after 2, 5 after 3
    draft = Draft([2, 3, 4, 5], parents=[-1, -1, 0, 1])
    logits = torch.zeros(5, VOCAB)
    for row, best in enumerate([3, 9, 9, 9, 11]):  # row 0 picks 3 (draft 1), its row picks 5
        logits[row, best] = 1.0
    logits[2, 5] = 2.0  # row 2 is draft 1's (token 3): the target's next is 5, draft 3
    assert accept_tree(draft, logits) == ([1, 3], 11)
    logits[0] = 0
    logits[0, 8] = 1.0  # no child of the pending token matches: nothing kept
    assert accept_tree(draft, logits) == ([], 8)


@pytest.fixture(scope="module")
def tiny_packed(tmp_path_factory):
    """The tiny llama through the kernel's layer stack, where drafts may be trees."""
    from tiny_models import TINY_SHAPE, word_level_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfspec.engine import Engine
    from selfspec.loading.models import load_model

    if not kernel_available():
        pytest.skip("the CPU kernel cannot be built")
    torch.manual_seed(0)
    # four key-value heads: 64 outputs, a whole kernel panel group, so the layers fuse
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY_SHAPE, num_key_value_heads=4)))
    with torch.no_grad():  # a sharper head: fewer near-ties between the top two tokens
        model.lm_head.weight.mul_(4)
    folder = tmp_path_factory.mktemp("tiny-packed")
    model.save_pretrained(folder)
    word_level_tokenizer().save_pretrained(folder)
    return Engine(load_model(str(folder), speed="packed"))


def branching_table(engine, prompt, seed=0) -> RecycledTable:
    """A table of three next tokens after every token: the model's own top one after the prompt
    in a random place among two random ones, so trees branch and some branches are right."""
    generator = torch.Generator().manual_seed(seed)
    table = RecycledTable(width=3)
    with torch.inference_mode():
        for token in range(64):
            logits = engine.loaded.model(torch.tensor([prompt + [token]])).logits[0, -1]
            guesses = torch.randint(64, (3,), generator=generator).tolist()
            guesses[int(torch.randint(3, (1,), generator=generator))] = int(logits.argmax())
            if len(set(guesses)) == 3:
                table.record(None, token, guesses, [0.5, 0.3, 0.2])
    return table


def test_a_tree_row_scores_as_the_chain_of_its_ancestors_bit_for_bit(tiny_packed):
    runner = tiny_packed.runner
    prompt = [5, 17, 33, 2, 9, 41, 12]
    tokens, parents = [20, 21, 22, 23, 24, 25], [-1, -1, 0, 1, 1, 4]
    start = len(prompt) - 1
    runner.reset(32)
    runner.forward(torch.tensor(prompt[:-1]), 0)
    tree, _ = runner.forward(torch.tensor(prompt[-1:] + tokens), start, tree=parents)
    tree = tree.clone()
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        chain = [tokens[i] for i in reversed(path)]
        logits, _ = runner.forward(torch.tensor(prompt[-1:] + chain), start)
        assert torch.equal(tree[node + 1], logits[-1]), f"node {node}"


LONG = dict(max_new_tokens=48, eos_token_ids=())  # no end of text: every run as long


def test_greedy_tree_drafts_are_identical_to_plain_decoding(tiny_packed):
    engine = tiny_packed
    assert engine.runner.trees
    prompt = [5, 17, 33, 2, 9, 41, 12, 5, 17, 60, 3]
    plain = engine.generate(prompt, None, config=engine.decode_config(None, **LONG))
    assert len(plain.token_ids) == 48
    recycled = RecycledDrafts(engine.runner, branching_table(engine, prompt))
    vocab = engine.runner.head_rows
    drafter = AdaptiveDrafter(
        vocab, planned=False, min_ngram=5, max_tokens=6, recycled=recycled, trees=True
    )
    # every round drafts: the guard would pause drafts that cost more than they save here
    config = engine.decode_config(drafter, fallback=False, **LONG)
    trees = 0
    for _ in range(2):  # the second generation drafts from what the first learnt
        out = engine.generate(prompt, drafter, config=config)
        assert out.token_ids == plain.token_ids
        trees += out.stats.tree_rounds
    _, drafted, accepted = out.stats.sources["recycled"]
    assert trees >= 5 and drafted > accepted > 0
    sampled = engine.generate(prompt, drafter, max_new_tokens=8, sampling=Sampling(0.7), seed=0)
    assert sampled.stats.tree_rounds > 0  # sampling verifies trees too


def broken_accept_tree(draft, target_logits, sampling, generator):
    """Recursive rejection sampling without its renormalization, the bug a tree invites: each
    child of the pending token is kept with probability p (not p over the mass the rejected ones
    left), and a miss of them all draws from p without them."""
    from selfspec.runtime.sampling import sample

    p = sampling.probs(target_logits[0])
    children = [i for i, parent in enumerate(draft.parents) if parent == -1]
    for child in children:
        if float(torch.rand((), generator=generator)) < float(p[draft.tokens[child]]):
            return [child], sampling.pick(target_logits[child + 1], generator)
    p[[draft.tokens[child] for child in children]] = 0
    return [], sample(p, generator)


def exact_third_token(engine, prompt, sampling, first_two: torch.Tensor) -> torch.Tensor:
    """P(x3) = sum over x1, x2 of P(x1, x2) p(x3 | prompt, x1, x2), computed exactly."""
    pairs = [prompt + [x1, x2] for x1 in range(64) for x2 in range(64)]
    with torch.inference_mode():
        p3 = sampling.probs(engine.loaded.model(torch.tensor(pairs)).logits[:, -1])
    return (first_two.flatten()[:, None] * p3).sum(0)


@pytest.mark.slow  # thousands of seeded generations
def test_sampled_tree_drafts_keep_the_target_distribution(tiny_packed, monkeypatch):
    """Sampling, a tree's guesses are certain: the target's draw at each row keeps the child it
    meets (recursive rejection sampling with point masses). The first two tokens' distribution
    (the tree's first level) and the third token's (its second level, where the first guess was
    kept) are the target's; with a rule broken at the first level the first two tokens' is not."""
    from test_sampling import SIGNIFICANCE, chi_square_p_value, exact_first_two_tokens

    from selfspec.runtime import decode

    engine = tiny_packed
    prompt = [5, 17, 33, 2, 9, 41, 12]
    sampling = Sampling(temperature=0.25)  # the first guess holds a good share of the mass
    table = RecycledTable(width=3)  # after every token, the model's own three most likely
    with torch.inference_mode():
        for token in range(64):
            logits = engine.loaded.model(torch.tensor([prompt + [token]])).logits[0, -1]
            table.record(None, token, logits.topk(3).indices.tolist(), [0.5, 0.3, 0.2])
    first_two = exact_first_two_tokens(engine, prompt, sampling)
    third = exact_third_token(engine, prompt, sampling, first_two)
    # the first round drafts three nodes: room for them after the first token
    config = engine.decode_config(None, max_new_tokens=5, sampling=sampling, fallback=False)
    config.eos_token_ids, config.max_draft_tokens = (), 3

    def first_tokens(n=4000) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts of (first token, second token) and of the third token over n generations."""
        pairs, thirds, judged, kept = torch.zeros(64 * 64), torch.zeros(64), 0, 0
        for seed in range(n):
            recycled = RecycledDrafts(engine.runner, copy.deepcopy(table))  # as designed
            drafter = AdaptiveDrafter(
                engine.runner.head_rows, planned=False, min_ngram=5, max_tokens=3,
                recycled=recycled, trees=True,
            )  # fmt: skip
            config.seed = seed
            out = engine.generate(prompt, drafter, config=config)
            pairs[out.token_ids[0] * 64 + out.token_ids[1]] += 1
            thirds[out.token_ids[2]] += 1
            judged += out.stats.drafted_by_position[0]
            kept += out.stats.accepted_by_position[0]
        assert 0.1 * judged < kept < 0.9 * judged  # the first level's guesses judged both ways
        return pairs, thirds

    roots, accept_tree = [], decode.accept_tree

    def counted(draft, *args):  # the children of the pending token in each tree verified
        roots.append(draft.parents.count(-1))
        return accept_tree(draft, *args)

    monkeypatch.setattr(decode, "accept_tree", counted)
    pairs, thirds = first_tokens()
    assert chi_square_p_value(pairs, first_two.flatten()) > SIGNIFICANCE
    assert chi_square_p_value(thirds, third) > SIGNIFICANCE
    assert sum(children > 1 for children in roots) > 2500  # most runs branched there
    monkeypatch.setattr(decode, "accept_tree", broken_accept_tree)
    assert chi_square_p_value(first_tokens()[0], first_two.flatten()) < SIGNIFICANCE
