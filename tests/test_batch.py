"""Several sequences decoded together (selfspec.batch): every sequence gets exactly the tokens it
gets alone, whatever joins or leaves the batch, in each kernel mode that batches."""

from __future__ import annotations

import pytest

from selfspec.batch import resume_sequence, start_sequence, step
from selfspec.decode import generate_ids

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


def test_a_batch_gives_each_sequence_its_solo_tokens(engine):
    expected = [_alone(engine, p, n) for p, n in zip(PROMPTS, LIMITS)]
    runner, tokenizer = engine.runner, engine.tokenizer
    active = []
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, LIMITS)):
        config = engine.decode_config(None, max_new_tokens=tokens)
        active.append((i, start_sequence(runner, engine.encode(prompt), config, tokenizer)))
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
    other = start_sequence(runner, engine.encode(PROMPTS[1]), other_config, tokenizer)
    while not first.gen.stop:
        step(runner, [s for s in (first, other) if not s.gen.stop])
    assert first.gen.generated == expected
    assert first.finish().new_tokens == tokens
