"""Several sequences decoded together (selfspec.runtime.batch): every sequence gets exactly the
tokens it gets alone, whatever joins or leaves the batch, in each kernel mode that batches."""

from __future__ import annotations

import pytest

from selfspec.drafters.batched import BatchDrafter
from selfspec.runtime.batch import (
    PREFILL_CHUNK,
    admit_sequence,
    resume_sequence,
    step,
)
from selfspec.runtime.decode import generate_ids, prefill

pytestmark = pytest.mark.slow
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\nx = np."]
LIMITS = [40, 12, 28]  # sequences leave the batch at different passes


@pytest.fixture(scope="module", params=["gguf-q8", "packed"])
def engine(request):
    from selfspec.engine import Engine
    from selfspec.kernels import kernel_available

    if not kernel_available():
        pytest.skip("the CPU kernel cannot be built on this machine")
    engine = Engine.load("smollm2-135m", speed=request.param)
    assert engine.runner.can_batch
    return engine


def _alone(engine, prompt: str, tokens: int) -> list[int]:
    return engine.generate(prompt, None, max_new_tokens=tokens).token_ids


def _prefilled(runner, prompt_ids, config, tokenizer):
    """A new sequence whose prompt is read in one prefill pass of its own before it joins the
    batch (the way a generation paused alone joins, too): its first token is committed."""
    sequence = admit_sequence(runner, prompt_ids, config, tokenizer)
    with runner.using(sequence.cache):
        first = prefill(runner, prompt_ids, config.sampling, sequence.generator)
    sequence.prompt_left = 0
    sequence.gen.commit([first])
    return sequence


def test_a_batch_gives_each_sequence_its_solo_tokens(engine):
    expected = [_alone(engine, p, n) for p, n in zip(PROMPTS, LIMITS)]
    runner, tokenizer = engine.runner, engine.tokenizer
    active = []
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, LIMITS)):
        config = engine.decode_config(None, max_new_tokens=tokens)
        active.append((i, _prefilled(runner, engine.encode(prompt), config, tokenizer)))
        step(runner, [s for _, s in active])  # the next one joins after a pass
    done = {}
    while active:
        step(runner, [s for _, s in active])
        for i, sequence in [(i, s) for i, s in active if s.gen.stop]:
            done[i] = sequence.gen.generated
            assert sequence.finish().new_tokens == LIMITS[i]
        active = [(i, s) for i, s in active if not s.gen.stop]
    assert [done[i] for i in range(len(PROMPTS))] == expected


def test_a_paused_speculative_generation_goes_on_in_a_batch(engine):
    """A request alone runs with the drafter; when another comes it is paused and continued in
    the batch: its tokens are still the ones plain decoding gives."""
    prompt, tokens = PROMPTS[0], 40
    expected = _alone(engine, prompt, tokens)
    runner, tokenizer = engine.runner, engine.tokenizer
    config = engine.decode_config(engine.self_drafter(), max_new_tokens=tokens)
    rounds = []
    generated, stats = generate_ids(
        runner,
        engine.encode(prompt),
        config,
        engine.self_drafter(),
        tokenizer,
        pause=lambda: rounds.append(1) or len(rounds) >= 5,
    )
    assert stats.stop_reason == "paused" and 0 < len(generated) < tokens
    first = resume_sequence(runner, engine.encode(prompt), generated, stats, config, tokenizer)
    other_config = engine.decode_config(None, max_new_tokens=10)
    other = _prefilled(runner, engine.encode(PROMPTS[1]), other_config, tokenizer)
    while not first.gen.stop:
        step(runner, [s for s in (first, other) if not s.gen.stop])
    assert first.gen.generated == expected
    assert first.finish().new_tokens == tokens


# Text that repeats itself, so that every sequence finds context matches to draft from.
REPEATING = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
    "one two three four five. one two three four five. one two three",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
]


def _run_batch(engine, prompts, configs, drafter):
    runner, tokenizer = engine.runner, engine.tokenizer
    active = [
        (i, _prefilled(runner, engine.encode(p), c, tokenizer))
        for i, (p, c) in enumerate(zip(prompts, configs))
    ]
    done, rows = {}, []
    while active:
        rows.append(step(runner, [s for _, s in active], drafter))
        for i, sequence in [(i, s) for i, s in active if s.gen.stop]:
            done[i] = (sequence.gen.generated, sequence.finish())
        active = [(i, s) for i, s in active if not s.gen.stop]
    return [done[i] for i in range(len(prompts))], rows


def test_drafts_in_a_batch_keep_each_sequence_its_solo_tokens(engine):
    """Each sequence drafts from its own text (every match in full, paid or not): the drafts are
    checked in the batch pass, and every sequence still gets exactly its solo tokens."""
    limits = [30, 24, 17]
    expected = [_alone(engine, p, n) for p, n in zip(REPEATING, limits)]
    configs = [engine.decode_config(None, max_new_tokens=n) for n in limits]
    results, rows = _run_batch(engine, REPEATING, configs, BatchDrafter(planned=False))
    assert [generated for generated, _ in results] == expected
    for generated, stats in results:
        # the first token comes from the prefill; each pass adds its kept drafts and one more,
        # unless a stop cut it short
        assert stats.new_tokens == len(generated)
        assert stats.new_tokens - 1 <= stats.target_passes + stats.accepted
        assert stats.target_passes < len(generated) or stats.accepted == 0
    drafted = sum(stats.drafted for _, stats in results)
    accepted = sum(stats.accepted for _, stats in results)
    assert drafted > 0 and accepted > 0  # the draft rows were there, and some were kept
    assert max(rows) > len(REPEATING)  # some pass held more rows than sequences


def test_head_drafts_in_a_batch_keep_each_sequence_its_solo_tokens(engine):
    """Sequences whose text offers no match draft with the draft heads, all sequences' guesses in
    one chain (random heads here: guesses mostly wrong, every one checked): every sequence still
    gets exactly its solo tokens, and the rounds say where their drafts came from."""
    from test_heads import random_heads

    from selfspec.drafters.heads import HeadDrafter

    runner = engine.runner
    hidden = runner.adapter.model.config.hidden_size
    heads = HeadDrafter(runner, random_heads(hidden, 2, vocab_prefix=512), engine.eos_ids())
    limits = [20, 9, 14]
    expected = [_alone(engine, p, n) for p, n in zip(PROMPTS, limits)]
    configs = [engine.decode_config(None, max_new_tokens=n) for n in limits]
    drafter = BatchDrafter(planned=False, heads=heads)
    results, rows = _run_batch(engine, PROMPTS, configs, drafter)
    assert [generated for generated, _ in results] == expected
    head_rounds = [stats.sources.get("heads", [0, 0, 0]) for _, stats in results]
    assert all(rounds > 0 and drafted >= rounds for rounds, drafted, _ in head_rounds)
    assert max(rows) > len(PROMPTS)


def test_a_planned_batch_drafts_only_where_rows_pay():
    """With pass costs timed and acceptance measured, the batch drafter adds a sequence's draft
    tokens most likely first, and only while the expected tokens per second rise."""
    from selfspec.drafters.adaptive import Acceptance
    from selfspec.drafters.base import RoundOutcome
    from selfspec.drafters.ngram import ContextIndex
    from selfspec.drafters.pass_costs import PassCosts

    costs = PassCosts()
    for rows, seconds in [(1, 0.10), (2, 0.102), (3, 0.104), (4, 0.106), (5, 0.2), (6, 0.3)]:
        costs.record(RoundOutcome(rows - 1, 0, verify_seconds=seconds), 0)
    sure, doubtful = Acceptance(8), Acceptance(8)
    for _ in range(40):
        sure.record(3, 3)
        doubtful.record(1, 0)
    drafter = BatchDrafter(costs, {3: sure, 2: doubtful})
    # sequence 0 ends in a 3-token match (kept 3 of 3 so far), sequence 1 in a 2-token one
    contexts = [ContextIndex(), ContextIndex()]
    contexts[0].sync([5, 6, 7, 8, 9, 10, 11, 5, 6, 7])
    contexts[1].sync([1, 2, 40, 41, 42, 1, 2])
    drafts = drafter.propose(contexts, [8, 8])
    # two rows of sequence 0's likely tokens are nearly free; a third row would cost as much as a
    # pass: only the likely draft goes in
    assert drafts == [[8, 9], []]
    assert BatchDrafter(costs, {3: sure, 2: doubtful}).propose(contexts, [0, 8]) == [[], []]


def test_a_batch_that_never_ran_alone_drafts_once_its_own_passes_are_timed():
    """A server whose requests always come together never times a one-row pass; the batch's own
    passes (prompt chunks included) fit a line of cost against rows, and drafting starts from it:
    a row that costs a tenth of a four-row pass pays for a draft kept 90% of the time."""
    from selfspec.drafters.adaptive import Acceptance
    from selfspec.drafters.ngram import ContextIndex
    from selfspec.drafters.pass_costs import PassCosts

    sure = Acceptance(8)
    for _ in range(40):
        sure.record(3, 3)
    drafter = BatchDrafter(PassCosts(), {3: sure})
    contexts = [ContextIndex() for _ in range(4)]
    contexts[0].sync([5, 6, 7, 8, 9, 10, 11, 5, 6, 7])
    for i, context in enumerate(contexts[1:]):
        context.sync([100 + i, 200 + i, 300 + i])
    assert drafter.propose(contexts, [8] * 4) == [[]] * 4  # no pass timed yet
    for n in range(16):  # four sequences decoding, every other pass reading 60 prompt rows
        prompt_rows = 60 * (n % 2)
        drafter.observe([[]] * 4, [0] * 4, 0.040 + 0.004 * (4 + prompt_rows), prompt_rows)
    assert drafter.fit.cost(10) == pytest.approx(0.040 + 0.004 * 10)
    drafts = drafter.propose(contexts, [8] * 4)
    assert drafts[0][:3] == [8, 9, 10] and drafts[1:] == [[]] * 3
    # timings that fall as rows grow, or that leave no cost per pass, are noise: no line
    for rows, seconds in [(4, 0.06), (20, 0.05)] * 50:
        drafter.fit.record(rows, seconds)
    assert drafter.fit.cost(10) is None
    for rows in [4, 20] * 50:
        drafter.fit.record(rows, 0.01 * rows - 0.001)
    assert drafter.fit.cost(10) is None


class _FixedGuesses:
    """Head guesses with given chances (what ``HeadDrafter.guess_many`` returns), counting calls."""

    def __init__(self, chains):
        self.chains, self.calls = chains, 0

    def guess_many(self, hidden, tokens, steps, going_on=0.0):
        self.calls += 1
        assert hidden.shape == (len(tokens), 4)
        return [chain[:steps] for chain in self.chains[: len(tokens)]]


def test_a_planned_batch_takes_head_guesses_only_where_rows_pay():
    """Head guesses go in most likely first while a row costs less than the tokens it is expected
    to bring; where even a certain guess could not pay, the heads are not run at all."""
    import torch

    from selfspec.drafters.base import RoundOutcome
    from selfspec.drafters.ngram import ContextIndex
    from selfspec.drafters.pass_costs import PassCosts

    contexts = [ContextIndex(), ContextIndex()]
    contexts[0].sync([1, 2, 3])
    contexts[1].sync([4, 5, 6])
    hidden = [torch.zeros(1, 4), torch.zeros(1, 4)]
    chains = [[(7, 0.95), (8, 0.9)], [(9, 0.3), (10, 0.1)]]

    cheap = PassCosts()  # rows 3 and 4 cost almost nothing more than 2
    for rows, seconds in [(1, 0.10), (2, 0.101), (3, 0.102), (4, 0.103), (5, 0.2), (6, 0.3)]:
        cheap.record(RoundOutcome(rows - 1, 0, verify_seconds=seconds), 0)
    heads = _FixedGuesses(chains)
    drafter = BatchDrafter(cheap, heads=heads)
    assert drafter.propose(contexts, [8, 8], hidden) == [[7, 8], []]
    assert drafter.sources == ["heads", "heads"]
    drafter.observe([[7, 8], []], [2, 0], None)
    assert drafter.calibration.value > 1.0  # both kept, more than their chances promised

    dear = PassCosts()  # every row as dear as a pass
    for rows in range(1, 6):
        dear.record(RoundOutcome(rows - 1, 0, verify_seconds=0.1 * rows), 0)
    heads = _FixedGuesses(chains)
    assert BatchDrafter(dear, heads=heads).propose(contexts, [8, 8], hidden) == [[], []]
    assert heads.calls == 0
    # no hidden state yet (a sequence that just joined): nothing to guess from
    assert BatchDrafter(cheap, heads=heads).propose(contexts, [8, 8], [None, None]) == [[], []]
    assert heads.calls == 0


def test_prompts_read_in_chunks_inside_the_batch_give_solo_tokens(engine):
    """A sequence that joins reads its prompt in chunks inside the batch's passes while the others
    go on decoding; every sequence still gets exactly its solo tokens."""
    long_prompt = "Here is a list of fruit: " + ", ".join(["apple", "pear", "plum"] * 40) + "."
    prompts, limits = [PROMPTS[0], long_prompt, PROMPTS[2]], [30, 20, 12]
    expected = [_alone(engine, p, n) for p, n in zip(prompts, limits)]
    assert len(engine.encode(long_prompt)) > 2 * PREFILL_CHUNK  # read over several passes
    runner, tokenizer = engine.runner, engine.tokenizer
    drafter = BatchDrafter(planned=False)
    active, done, rows = [], {}, []
    for i, (prompt, tokens) in enumerate(zip(prompts, limits)):
        config = engine.decode_config(None, max_new_tokens=tokens)
        active.append((i, admit_sequence(runner, engine.encode(prompt), config, tokenizer)))
        rows.append(step(runner, [s for _, s in active], drafter))  # the next joins a pass later
    while active:
        rows.append(step(runner, [s for _, s in active], drafter))
        for i, sequence in [(i, s) for i, s in active if s.gen.stop]:
            done[i] = sequence.gen.generated
            assert sequence.finish().prefill_seconds > 0
        active = [(i, s) for i, s in active if not s.gen.stop]
    assert [done[i] for i in range(len(prompts))] == expected
    assert max(rows) > PREFILL_CHUNK  # a chunk and the others' rows shared a pass


def test_prompts_read_past_a_stored_prefix_give_their_plain_tokens(engine):
    """A later turn starts from the keys and values the turn before left in a PrefixStore, alone
    (generate_ids) and in a batch (admit_sequence): it reads only the rest of its prompt and gets
    exactly the tokens a fresh prefill gives."""
    from selfspec.runtime.prefixes import PrefixStore

    runner, tokenizer = engine.runner, engine.tokenizer
    store = PrefixStore(budget_bytes=1 << 30)
    first = engine.encode(PROMPTS[0])
    config = engine.decode_config(None, max_new_tokens=20)
    answer, stats = generate_ids(runner, first, config, None, tokenizer, prefixes=store)
    assert stats.cached_prompt_tokens == 0
    store.save((first + answer)[:-1], runner.cache)
    later = first + answer + engine.encode("\n\ndef factorial(n):")[1:]
    expected = _alone(engine, later, 24)
    config = engine.decode_config(None, max_new_tokens=24)
    again, stats = generate_ids(
        runner, later, config, engine.self_drafter(), tokenizer, prefixes=store
    )
    assert stats.cached_prompt_tokens == len(first) + len(answer) - 1
    assert again == expected
    # in a batch, beside a sequence that shares nothing with the store
    other = admit_sequence(runner, engine.encode(PROMPTS[1]), config, tokenizer, prefixes=store)
    joined = admit_sequence(runner, later, config, tokenizer, prefixes=store)
    assert other.prompt_left == len(engine.encode(PROMPTS[1]))
    assert joined.prompt_left == len(later) - joined.gen.stats.cached_prompt_tokens
    assert joined.gen.stats.cached_prompt_tokens >= len(first) + len(answer) - 1
    while not joined.gen.stop:
        step(runner, [s for s in (other, joined) if not s.gen.stop], BatchDrafter(planned=False))
    assert joined.gen.generated == expected
