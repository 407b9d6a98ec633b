"""Sampling stays lossless: emitted tokens follow the target's distribution (chi-square tests).

Each test also runs with the residual rule broken on purpose and must then reject, so the
tests can fail.
"""

import pytest
import torch

from selfspec.kernels import kernel_available, load_kernel
from selfspec.runtime import decode
from selfspec.runtime.draft_vocab import DraftVocab
from selfspec.runtime.sampling import Sampling, accept_certain, accept_sampled, sample

SIGNIFICANCE = 1e-3


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed counts under probs. Bins with expected < 5 are pooled, and a pool
    still under 5 joins the smallest bin, so that every cell the statistic sums expects >= 5."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    if expected[~big].sum() < 5 and big.sum() > 1:
        big[torch.where(big, expected, torch.inf).argmin()] = False
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def broken_accept(draft_tokens, draft_probs, target_probs, generator):
    """The classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i, token], draft_probs[i, token]
        if torch.rand((), generator=generator) * q <= p:
            continue
        return i, sample(target_probs[i], generator)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], generator)


def first_token_counts(accept, p, q, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p)
    for _ in range(n):
        d = sample(q, gen)
        m, nxt = accept([d], q[None], torch.stack([p, p]), gen)
        counts[d if m == 1 else nxt] += 1
    return counts


def test_acceptance_rule_reproduces_target_distribution():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])  # a bad drafter: mostly wrong
    counts = first_token_counts(accept_sampled, p, q, 8000)
    assert chi_square_p_value(counts, p) > SIGNIFICANCE
    broken = first_token_counts(broken_accept, p, q, 8000)
    assert chi_square_p_value(broken, p) < SIGNIFICANCE


def certain_first_token_counts(logits, sampling, draft, n, broken=False, seed=0):
    """The first token emitted after a certain draft of ``draft`` ([d1]) over ``n`` draws through
    the kernel's rule; ``broken``: on a miss, draw from p itself (d1 left in)."""
    kernel = load_kernel()
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1])
    rows = torch.stack([logits, logits])
    for _ in range(n):
        if broken:
            top, total = (t.tolist() for t in kernel.softmax_partition(rows, sampling.temperature))
            p = torch.softmax(logits / sampling.temperature, -1)[draft[0]]
            if float(torch.rand((), generator=gen)) <= p:
                m, token = 1, None
            else:
                u = float(torch.rand((), generator=gen))
                m, token = (
                    0,
                    kernel.sample_row(logits, sampling.temperature, top[0], total[0], u, -1),
                )
        else:
            m, token = accept_certain(draft, rows, sampling, gen)
        counts[draft[0] if m == 1 else token] += 1
    return counts


@pytest.mark.skipif(not kernel_available(), reason="the CPU kernel cannot be built")
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_the_kernel_s_rule_for_certain_drafts_reproduces_the_target_distribution(temperature):
    """A draft proposed with certainty (q = 1) is kept with probability p, and a miss draws from p
    without it: the first token emitted follows p. Drawing a miss from p itself must fail."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, generator=gen) * 2  # more than one vector of lanes, and a tail
    sampling = Sampling(temperature=temperature)
    p = torch.softmax(logits / temperature, -1)
    draft = [int(torch.argmax(p))]
    assert chi_square_p_value(certain_first_token_counts(logits, sampling, draft, 8000), p) > (
        SIGNIFICANCE
    )
    broken = certain_first_token_counts(logits, sampling, draft, 8000, broken=True)
    assert chi_square_p_value(broken, p) < SIGNIFICANCE
    # with no draft, a plain draw from p
    counts = torch.zeros(40)
    for _ in range(8000):
        counts[sampling.pick(logits, gen)] += 1
    assert chi_square_p_value(counts, p) > SIGNIFICANCE


def test_top_k_top_p_warping():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    probs = Sampling(temperature=1.0, top_k=2).probs(logits)
    assert (probs[2:] == 0).all() and probs[:2].sum() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)
    probs = Sampling(temperature=1.0, top_p=0.7).probs(logits)
    assert full[0] < 0.7 <= full[:2].sum()
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()
    assert Sampling(temperature=5e-324).pick(logits, None) == 0  # tiny: greedy, not NaN
    for tiny in (1e-9, 5e-324):  # 5e-324 is 0 in float32: the top token must still be kept
        probs = Sampling(temperature=1.0, top_p=tiny).probs(logits)
        assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def peaked_tiny(tiny_llama, sharpened_head):
    """The tiny model with a sharper head, so target and draft distributions differ visibly."""
    with sharpened_head(tiny_llama, 60.0):
        yield tiny_llama


def exact_first_two_tokens(engine, prompt, sampling):
    """P(x1, x2) = p(x1 | prompt) p(x2 | prompt, x1), computed exactly: [vocab, vocab]."""
    model = engine.loaded.model
    with torch.inference_mode():
        p1 = sampling.probs(model(torch.tensor([prompt])).logits[0, -1])
        batch = torch.tensor([prompt + [x] for x in range(p1.shape[0])])
        p2 = sampling.probs(model(batch).logits[:, -1])
    return p1[:, None] * p2


def exact_second_token_marginal(engine, prompt, sampling):
    """P(x2) = sum over x1 of p(x1 | prompt) p(x2 | prompt, x1), computed exactly."""
    return exact_first_two_tokens(engine, prompt, sampling).sum(0)


def second_token_counts(engine, prompt, sampling, plan, n, draft_vocab=None):
    drafter = engine.layer_skip_drafter(plan)
    if draft_vocab:  # plans ask for multiples of 64; this model has only 64 tokens
        drafter.vocab = DraftVocab(draft_vocab, 64)
    return drafted_second_token_counts(engine, prompt, sampling, drafter, n)


def drafted_second_token_counts(engine, prompt, sampling, drafter, n):
    """How often each token came second in ``n`` seeded generations of 3 tokens with ``drafter``
    (drafts of up to 2 tokens, no confidence cut, no fallback)."""
    config = engine.decode_config(
        drafter,
        max_new_tokens=3,
        sampling=sampling,
        confidence_threshold=0.0,
        adaptive_threshold=False,
        fallback=False,
        max_draft_tokens=2,
    )
    config.eos_token_ids = ()
    counts = torch.zeros(64)
    for seed in range(n):
        config.seed = seed
        out = engine.generate(prompt, drafter, config=config)
        counts[out.token_ids[1]] += 1
    return counts


def assert_keeps_target_distribution(engine, prompt, sampling, second_tokens, monkeypatch):
    """``second_tokens()``: counts of the second token over seeded generations. They match the
    target's exact marginal (chi-square), and with a broken acceptance rule the same test fails."""
    exact = exact_second_token_marginal(engine, prompt, sampling)
    assert chi_square_p_value(second_tokens(), exact) > SIGNIFICANCE
    monkeypatch.setattr(decode, "accept_sampled", broken_accept)
    # certain drafts (context, recycled) then go the way of every draft, to the broken rule
    monkeypatch.setattr(decode, "accept_certain", lambda *args: None)
    assert chi_square_p_value(second_tokens(), exact) < SIGNIFICANCE


def test_speculative_sampling_end_to_end_matches_target(peaked_tiny, monkeypatch):
    engine = peaked_tiny
    prompt = [5, 17, 33, 2]
    sampling = Sampling(temperature=1.0)
    plan = engine.make_plan([1, 2], [2])
    assert_keeps_target_distribution(
        engine,
        prompt,
        sampling,
        lambda: second_token_counts(engine, prompt, sampling, plan, 1500),
        monkeypatch,
    )


def test_sampling_with_a_partial_draft_head_matches_target(peaked_tiny):
    """Drafts that can only propose the first token ids and those the context used (q = 0 for
    the rest) still leave the target's distribution."""
    engine = peaked_tiny
    prompt = [5, 17, 33, 2]
    sampling = Sampling(temperature=4.0)  # spread the peaked model's mass over several tokens
    plan = engine.make_plan([1], [2])
    exact = exact_second_token_marginal(engine, prompt, sampling)
    # Cut the draft head where a good share of the target's mass lies beyond it.
    cut = next((c for c in range(1, 64) if 0.1 <= float(exact[c:].sum()) <= 0.9), None)
    assert cut is not None, "the test needs target mass on both sides of the cut"
    counts = second_token_counts(engine, prompt, sampling, plan, 1500, draft_vocab=cut)
    assert chi_square_p_value(counts, exact) > SIGNIFICANCE
