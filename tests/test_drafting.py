"""The default drafter: context n-gram drafts (and layer-skip drafts where they pay), chosen each
round from measured costs. Lossless in greedy decoding and in sampling; adapts; never stays off."""

import pytest
import torch

from selfspec.drafters import (
    AdaptiveDrafter,
    Draft,
    DraftRequest,
    DraftSettings,
    RoundOutcome,
)
from selfspec.drafters.adaptation import SpeedGuard
from selfspec.drafters.adaptive import Acceptance, Calibration, head_prior
from selfspec.drafters.ngram import ContextIndex
from selfspec.drafters.pass_costs import PassCosts
from selfspec.runtime.sampling import Sampling

# ------------------------------------------------------------------------------ the context index


def lookup(tokens, max_tokens=8, **kwargs):
    index = ContextIndex(**kwargs)
    index.sync(tokens)
    return index.lookup(max_tokens)


def test_longest_most_recent_match_and_what_followed_it():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 0, 2, 3]
    m = lookup(tokens)
    assert (m.ngram, m.end) == (2, 6)  # "2 3" last ended at 6 (3-grams "0 2 3" never occurred)
    assert m.tokens == [7, 5, 0, 2, 3]  # what followed, up to the present
    tokens = tokens + [7]
    m = lookup(tokens)
    assert (m.ngram, m.end, m.tokens) == (3, 7, [5, 0, 2, 3, 7])
    assert lookup(tokens, max_tokens=2).tokens == [5, 0]


def test_no_match_without_an_earlier_occurrence():
    assert lookup([1, 2, 3, 4, 5]) is None
    assert lookup([4, 4]) is None  # "4 4" only as the suffix itself
    assert lookup([4, 4, 4]).tokens == [4]  # the earlier "4 4" (ending at 1) was followed by 4


def test_incremental_indexing_matches_a_fresh_index():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    growing = ContextIndex()
    for length in range(2, len(tokens)):
        growing.sync(tokens[:length])
        fresh = lookup(tokens[:length], max_tokens=6)
        got = growing.lookup(6)
        assert (got is None) == (fresh is None)
        if got is not None:
            assert (got.tokens, got.ngram, got.end) == (fresh.tokens, fresh.ngram, fresh.end)


# ----------------------------------------------------------------------------------- planning


def test_pass_costs_interpolate_and_extrapolate():
    costs = PassCosts()
    assert costs.verify_cost(1) is None
    for rows, seconds in ((1, 0.10), (3, 0.12), (5, 0.20)):
        costs.record(RoundOutcome(rows - 1, 0, 0.0, seconds), steps=0)
    assert costs.verify_cost(2) == pytest.approx(0.11)
    assert costs.verify_cost(4) == pytest.approx(0.16)
    assert costs.verify_cost(7) == pytest.approx(0.28)  # the last two's slope: 0.04 per row


def test_pass_costs_are_multiples_of_a_plain_step():
    """Longer passes are timed rarely, plain steps often: when the machine slows down, what a
    longer pass is believed to cost follows the fresh plain steps instead of staying stale. Each
    estimate is the median of recent samples."""
    costs = PassCosts()
    costs.record(RoundOutcome(0, 0, 0.0, 0.10), steps=0)
    costs.record(RoundOutcome(2, 0, 0.06, 0.13), steps=2)  # 3 rows: 1.3 plain steps
    assert costs.verify_cost(3) == pytest.approx(0.13) and costs.draft_step == pytest.approx(0.03)
    for _ in range(30):
        costs.record(RoundOutcome(0, 0, 0.0, 0.20), steps=0)  # the machine is now twice as slow
    assert costs.verify_cost(3) == pytest.approx(0.26, rel=1e-3)
    assert costs.draft_step == pytest.approx(0.06, rel=1e-3)
    # A spike (another process, a page fault) does not move the estimate; a lasting change does.
    for seconds in (0.26, 0.26, 0.80, 0.26):
        costs.record(RoundOutcome(2, 0, 0.0, seconds), steps=0)
    assert costs.verify_cost(3) == pytest.approx(0.26, rel=1e-3)
    for _ in range(5):
        costs.record(RoundOutcome(2, 0, 0.0, 0.30), steps=0)
    assert costs.verify_cost(3) == pytest.approx(0.30, rel=1e-3)


def test_pass_costs_never_fall_with_more_rows():
    """A timing that says more rows cost less is pooled with its neighbours, weighted by how often
    each was timed: one low sample does not make long drafts look cheap, one high sample of a
    rarely drafted length does not make every longer draft look dear."""
    costs = PassCosts()
    costs.record(RoundOutcome(0, 0, 0.0, 0.10), steps=0)
    for _ in range(4):
        costs.record(RoundOutcome(2, 0, 0.0, 0.13), steps=0)  # 3 rows: 1.3, timed 4 times
    costs.record(RoundOutcome(4, 0, 0.0, 0.08), steps=0)  # 5 rows: 0.8, once
    assert (
        costs.verify_cost(3) == costs.verify_cost(5) == pytest.approx(0.12)
    )  # (4 * 1.3 + 0.8) / 5
    assert costs.verify_cost(2) >= costs.verify_cost(1) and costs.verify_cost(6) > 0.12
    costs.record(RoundOutcome(1, 0, 0.0, 0.20), steps=0)  # 2 rows: 2.0, once
    assert costs.verify_cost(2) == pytest.approx(0.8 / 6)  # pooled: (2.0 + 5 * 1.2) / 6 plain steps
    assert costs.verify_cost(1) == pytest.approx(0.10)  # a plain step is never pooled


def test_carried_over_acceptance_keeps_its_rate_but_yields_to_new_text():
    a = Acceptance(4)
    for _ in range(40):
        a.record(drafted=1, accepted=1)
    a.carry_over(weight=4.0)
    assert a.tried[0] == 4.0 and a.rate(0) > 0.8  # the rate stands, as a few rounds' worth
    for _ in range(6):
        a.record(drafted=1, accepted=0)  # the new text does not repeat: a few misses outweigh it
    assert a.rate(0) < 0.5


def test_acceptance_is_conditional_on_the_prefix():
    a = Acceptance(4)
    for _ in range(50):
        a.record(drafted=4, accepted=1)  # first kept, second rejected, later ones never judged
    assert a.rate(0) > 0.9 and a.rate(1) < 0.1 and a.tried[2] == 0
    assert a.expected_tokens(0) == 1.0
    assert a.expected_tokens(2) == pytest.approx(1 + a.rate(0) + a.rate(0) * a.rate(1))


def round_of(drafter, committed, max_tokens=8):
    return drafter.propose(DraftRequest(list(committed), max_tokens, Sampling(), None))


def test_drafts_only_when_the_measured_costs_say_it_pays():
    drafter = AdaptiveDrafter(vocab=100)
    drafter.begin([1], 64, DraftSettings(fallback=False))
    context = [5, 6, 7, 8, 9, 5, 6, 7]
    assert round_of(drafter, context).tokens == []  # no plain step timed yet
    drafter.observe(RoundOutcome(0, 0, 0.0, 0.100))
    draft = round_of(drafter, context)
    assert draft.tokens == [8, 9, 5, 6, 7][: len(draft.tokens)] and draft.source == "ngram"
    # Rows turn out expensive and drafts wrong: drafting stops paying, so it stops.
    for _ in range(30):
        drafter.observe(
            RoundOutcome(len(draft.tokens), 0, 0.0, 0.100 + 0.08 * len(draft.tokens), "ngram")
        )
        draft = round_of(drafter, context)
        if not draft.tokens:
            break
    assert draft.tokens == []


def test_context_drafts_believed_unprofitable_are_tried_again():
    """One slow pass timed on a busy machine must not stop context drafts for good: only their
    own rounds time the longer passes that would correct the estimate."""
    drafter = AdaptiveDrafter(vocab=100)
    drafter.begin([1], 4096, DraftSettings(fallback=False))
    context = [5, 6, 7, 8, 9, 5, 6, 7]
    drafter.observe(RoundOutcome(0, 0, 0.0, 0.100))
    draft = round_of(drafter, context)
    drafter.observe(RoundOutcome(1, 0, 0.0, 0.300, "ngram"))  # missed, and timed at 3 steps
    drafted_at = []
    for i in range(64):
        draft = round_of(drafter, context)
        if draft.tokens:  # a try: kept, and at a plain step's cost this time
            drafted_at.append(i)
            drafter.observe(RoundOutcome(1, 1, 0.0, 0.100, "ngram"))
        else:
            drafter.observe(RoundOutcome(0, 0, 0.0, 0.100))
    assert drafted_at and drafted_at[0] < 20  # tried again within the probe interval
    assert len(drafted_at) > 32  # and once it pays again, drafted every round


def test_context_drafts_of_a_new_text_stay_short_until_the_text_keeps_one():
    """What earlier texts kept says little about a new one: its context drafts are one token long
    until one is kept, then as long as the measured costs and acceptance say."""
    drafter = AdaptiveDrafter(vocab=100)
    context = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]  # "5 6 7" was followed by 8 9 10 11 12 5 6 7
    for _text in range(2):
        drafter.begin([1], 64, DraftSettings(fallback=False))
        drafter.observe(RoundOutcome(0, 0, 0.0, 0.100))
        for _ in range(3):  # misses: still one token a round
            draft = round_of(drafter, context)
            assert draft.tokens == [8]
            drafter.observe(RoundOutcome(1, 0, 0.0, 0.101, "ngram"))
        draft = round_of(drafter, context)
        drafter.observe(RoundOutcome(1, 1, 0.0, 0.101, "ngram"))  # the text repeats itself
        for _ in range(20):  # cheap rows, drafts kept: they grow
            draft = round_of(drafter, context)
            drafter.observe(RoundOutcome(len(draft.tokens), len(draft.tokens), 0.0, 0.101, "ngram"))
        assert len(draft.tokens) > 1
    # the second text began short again, although the first had ended with long kept drafts


class CountingSkipDrafter:
    """Stands in for a layer-skip drafter in planning tests: drafts token 1, counts its calls."""

    plan = None
    last_steps = 0

    def __init__(self):
        self.calls = 0

    def begin(self, prompt_ids, max_len, settings):
        pass

    def draft(self, request):
        self.calls += 1
        self.last_steps = request.max_tokens
        return Draft([1] * request.max_tokens)

    def observe(self, outcome):
        pass


def test_layer_skip_is_not_probed_where_it_cannot_pay():
    """A probe of layer-skip drafting costs real draft steps: where a draft step plus a longer
    verify pass cost more than the tokens could earn even if all were kept, it is not made."""

    def probes(draft_seconds):
        skip = CountingSkipDrafter()
        drafter = AdaptiveDrafter(vocab=100, layer_skip=skip)
        drafter.begin([1], 4096, DraftSettings(fallback=False))
        drafter.observe(RoundOutcome(0, 0, 0.0, 0.100))
        for _ in range(2000):
            k = len(round_of(drafter, [5, 6, 7]).tokens)
            # Drafts are all rejected; a pass over k + 1 rows costs 1 + 0.15 k plain steps.
            seconds = 0.100 * (1 + 0.15 * k)
            drafter.observe(
                RoundOutcome(k, 0, k * draft_seconds, seconds, "layer_skip" if k else "")
            )
        return skip.calls

    # 0.8 of a plain step: even drafts all kept would earn less than plain steps. Only the first
    # probe (nothing measured yet) is made.
    assert probes(0.080) == 1
    # Cheap steps: after the first tries (the prior still hopes) probes recur, spaced out more each
    # time they disappoint (gaps 48, 96, ... 768).
    assert 5 <= probes(0.010) <= 12


def test_head_drafts_start_from_the_held_out_figures_of_their_training():
    # heads 1..j all right on 50%, 30%, 15% of held-out positions: kept given the ones before it
    prior = head_prior({"heldout_top1_by_head": [0.5, 0.3, 0.15]})
    assert prior == pytest.approx([0.5, 0.6, 0.5])
    acceptance = Acceptance(3, prior)
    assert acceptance.rate(1) == pytest.approx(0.6)  # before any round
    for _ in range(20):
        acceptance.record(drafted=3, accepted=0)
    assert acceptance.rate(0) < 0.1  # what the stream shows soon outweighs it
    assert head_prior({}) is None and head_prior({"heldout_top1_by_head": [0.4, 0.0]}) is None


def test_head_chances_are_scaled_by_how_they_came_true():
    calibration = Calibration()
    assert calibration.value == 1.0
    for _ in range(60):  # chances summing to 2 per round, 1 token kept
        calibration.record(expected=2.0, kept=1)
    assert 0.48 < calibration.value < 0.55
    for _ in range(200):
        calibration.record(expected=0.1, kept=3)
    assert calibration.value == 2.0  # bounded


def test_the_guard_pauses_slow_drafting_and_tries_again():
    guard = SpeedGuard(window=4, first_pause=3)
    guard.record(0, 0, 0.0, 0.1)  # a plain step: 0.1 s
    for _ in range(4):
        guard.record(drafted=3, accepted=0, draft_seconds=0.2, verify_seconds=0.12)
    assert guard.paused() and guard.pauses == 1
    for _ in range(3):
        guard.record(0, 0, 0.0, 0.1)
    assert not guard.paused()  # never permanent: drafting resumes
    for _ in range(4):
        guard.record(drafted=3, accepted=3, draft_seconds=0.01, verify_seconds=0.12)
    assert not guard.paused()  # fast drafting is left alone
    for _ in range(4):
        guard.record(drafted=3, accepted=0, draft_seconds=0.2, verify_seconds=0.12)
    assert guard.pause_left == 6  # the second pause is twice as long
    assert not SpeedGuard(enabled=False).paused()


# ------------------------------------------------------------------------------- losslessness

REPEAT = (
    "Copy this list exactly, one item per line, then copy it a second time:\n"
    "alpha beta gamma\ndelta epsilon zeta\neta theta iota\nkappa lambda mu\n"
)


@pytest.mark.slow
def test_greedy_output_is_identical_to_plain_decoding(smollm2):
    ids = smollm2.encode(REPEAT, chat=True)
    plain = smollm2.generate(ids, None, max_new_tokens=60)
    n = smollm2.identity.num_layers
    plan = smollm2.make_plan([n // 2], [n // 2 + 1])
    for drafter in (smollm2.self_drafter(layer_skip=False), smollm2.self_drafter(plan)):
        out = smollm2.generate(ids, drafter, max_new_tokens=60)
        assert out.token_ids == plain.token_ids
        rounds, drafted, accepted = out.stats.sources["ngram"]
        assert accepted > 0 and out.stats.mean_accepted_length > 1.0
    # planned=False drafts every match in full (many rejections): still identical
    greedy = smollm2.generate(
        ids,
        AdaptiveDrafter(smollm2.runner.head_rows, planned=False, min_ngram=1),
        max_new_tokens=60,
    )
    assert greedy.token_ids == plain.token_ids and greedy.stats.drafted > greedy.stats.accepted


@pytest.fixture
def sharper_tiny(tiny_llama, sharpened_head):
    """The tiny model with a sharper head (its own text then repeats itself, as real text does,
    so context drafts are often right and often wrong: both halves of the rule get exercised)."""
    with sharpened_head(tiny_llama, 30.0):
        yield tiny_llama


def own_text(engine, sampling, length, seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = [1]
    with torch.inference_mode():
        for _ in range(length):
            probs = sampling.probs(engine.loaded.model(torch.tensor([tokens])).logits[0, -1])
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens


def second_token_counts(
    engine, prompt, sampling, n, make_drafter=None, source="ngram", kept=(0.2, 0.8)
):
    """How often each token came second in ``n`` seeded generations of 3 tokens, each with a new
    ``make_drafter()`` (default: context drafts of every match); its ``source`` drafts must have
    run in most of them and been judged both ways (a share ``kept`` of them accepted)."""
    config = engine.decode_config(
        None, max_new_tokens=3, sampling=sampling, fallback=False, max_draft_tokens=3
    )
    config.eos_token_ids = ()
    counts = torch.zeros(64)
    drafted = accepted = 0
    for seed in range(n):
        config.seed = seed
        if make_drafter is None:
            drafter = AdaptiveDrafter(64, planned=False, min_ngram=1, max_tokens=3)
        else:
            drafter = make_drafter()
        out = engine.generate(prompt, drafter, config=config)
        counts[out.token_ids[1]] += 1
        _, d, a = out.stats.sources.get(source, (0, 0, 0))
        drafted, accepted = drafted + d, accepted + a
    low, high = kept
    assert drafted > 0.9 * n and low * drafted < accepted < high * drafted  # judged, both ways
    return counts


@pytest.mark.slow  # thousands of seeded generations
def test_sampling_with_context_drafts_matches_the_target(sharper_tiny, monkeypatch):
    """Context drafts are certain (q = 1 for the drafted token): the acceptance rule then keeps a
    draft with probability p and resamples from p without it, which leaves p exactly. The same test
    with the rule broken (resampling from p itself) must fail."""
    from test_sampling import assert_keeps_target_distribution

    engine = sharper_tiny
    sampling = Sampling(temperature=1.0)
    prompt = own_text(engine, sampling, 150)
    assert_keeps_target_distribution(
        engine,
        prompt,
        sampling,
        lambda: second_token_counts(engine, prompt, sampling, 1500),
        monkeypatch,
    )
