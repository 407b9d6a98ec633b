"""Fixed-shape passes over a static cache (selfspec.runtime.cuda_graphs): the runner on CUDA.

On the CPU the same runner runs without graphs over the packed kernel, whose rows do not
depend on each other, so it must give the ordinary runner's logits bit for bit: that checks
positions, cache writes, masks, padding rows, chunking and resumes exactly. On CUDA (skipped
without one) the graphs are checked against the same passes run eagerly, rows against
one-token passes, and speculation against plain decoding, on randomly initialised models of
the real shapes (bfloat16, where flat random logits make any difference in the last bits
show up as a different token).
"""

import random

import pytest
import torch

from selfspec.runtime.cuda_graphs import PASS_ROWS, StaticRunner
from selfspec.runtime.decode import generate_ids
from selfspec.runtime.runner import ModelRunner

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ids(count, seed, high=30000):
    return torch.randint(100, high, (count,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_static_passes_give_the_runners_logits_bit_for_bit(smollm2_packed):
    loaded = smollm2_packed.loaded
    plain, static = ModelRunner(loaded), StaticRunner(loaded, graphs=False)
    plain.adapter.fused = None  # both call the model's modules (the static runner never fuses)
    prompt, new = _ids(37, 0), _ids(2 * PASS_ROWS + 8, 1)
    outputs = []
    for runner in (plain, static):
        runner.reset(200)
        # each pass's logits and the final hidden states it leaves for draft heads
        out = [runner.forward(prompt, 0, last_logits_only=True)[0], runner.last_hidden.clone()]
        for n in (1, 3, PASS_ROWS, PASS_ROWS + 4, len(new)):
            out += [runner.forward(new[:n], 37)[0], runner.last_hidden.clone()]
        # a draft step (sublayers skipped, hidden state captured), then a verify pass resuming from
        # it
        logits, hidden = runner.forward(
            new[:1], 37, frozenset({3, 5}), frozenset({4}), capture_at=6
        )
        out += [logits, hidden]
        out.append(runner.forward(new[:1], 37, resume=_resume(hidden))[0])
        outputs.append(out)
    assert len(outputs[1]) == len(outputs[0])
    for a, b in zip(*outputs):
        assert a.shape == b.shape and torch.equal(a, b)


def _resume(hidden):
    from selfspec.runtime.runner import Resume

    return Resume(6, hidden)


@pytest.mark.slow
def test_speculation_on_static_passes_is_identical_to_plain_decoding(smollm2_packed):
    from test_engine import plans_for

    engine = smollm2_packed
    runner = engine.runner
    engine.runner = StaticRunner(engine.loaded, graphs=False)
    try:
        prompt = engine.encode("def quicksort(items):", chat=False)
        config = engine.decode_config(
            None, max_new_tokens=40, confidence_threshold=0.0, fallback=False
        )
        plain, _ = generate_ids(engine.runner, prompt, config)
        for plan in plans_for(engine).values():
            drafter = engine.layer_skip_drafter(plan)
            ids, stats = generate_ids(engine.runner, prompt, config, drafter)
            assert ids == plain, plan.skip_attention
        reference, _ = generate_ids(runner, prompt, config)
        assert plain == reference  # and the ordinary runner's plain decoding
    finally:
        engine.runner = runner


# ---------------------------------------------------------------------------------- CUDA


def _random_engine(
    layers: int, vocab: int = 151936, hidden: int = 1536, speed: str = "cuda-graphs"
):
    """A randomly initialised Qwen2 of the 1.5B's widths on CUDA, in bfloat16."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from selfspec.engine import Engine
    from selfspec.loading.models import LoadedModel
    from selfspec.speed.modes import apply_speed_mode

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=8960 * hidden // 1536,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    apply_speed_mode(model, speed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(
            models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0")
        ),
        unk_token="t0",
    )
    return Engine(
        LoadedModel(f"random-qwen2-{layers}l", model, tokenizer, path="<memory>", speed=speed)
    )


@pytest.fixture(scope="module")
def random_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return _random_engine(layers=6)


@cuda
def test_cuda_runner_is_static_and_graphs_match_eager_passes(random_cuda):
    graphs = random_cuda.runner
    assert isinstance(graphs, StaticRunner) and graphs.use_graphs
    eager = StaticRunner(random_cuda.loaded, graphs=False)
    prompt, new = _ids(50, 2), _ids(PASS_ROWS + 5, 3)
    results = []
    for runner in (eager, graphs):
        runner.reset(300)
        out = [runner.forward(prompt, 0, last_logits_only=True)[0]]
        for _ in range(2):  # the second time replays the graphs captured the first time
            out += [runner.forward(new[:n], 50)[0] for n in (1, 4, len(new))]
            logits, hidden = runner.forward(
                new[:1], 50, frozenset({2}), frozenset({3}), capture_at=4, vocab=4096
            )
            out += [logits, hidden]
        results.append(out)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@cuda
def test_cuda_rows_do_not_depend_on_the_rest_of_the_pass(random_cuda):
    runner = random_cuda.runner
    prompt, new = _ids(64, 4), _ids(PASS_ROWS, 5)
    runner.reset(200)
    runner.forward(prompt, 0, last_logits_only=True)
    whole, _ = runner.forward(new, 64)
    for j in range(PASS_ROWS):  # row j alone, after one-token passes wrote the rows before it
        single, _ = runner.forward(new[j : j + 1], 64 + j)
        assert torch.equal(single[0], whole[j]), j


@cuda
def test_cuda_speculation_is_identical_to_plain_decoding(random_cuda):
    engine = random_cuda
    rng = random.Random(0)
    config = engine.decode_config(None, max_new_tokens=48, confidence_threshold=0.0, fallback=False)
    config.eos_token_ids = ()
    for trial in range(4):
        prompt = [rng.randrange(100, 150000) for _ in range(rng.randrange(5, 120))]
        plain, _ = generate_ids(engine.runner, prompt, config)
        for skip in ({1, 4}, {0, 2, 3}, {5}):
            plan = engine.make_plan(skip_attention=skip, skip_mlp={2})
            ids, stats = generate_ids(
                engine.runner, prompt, config, engine.layer_skip_drafter(plan)
            )
            assert ids == plain, (trial, skip)
            assert stats.drafted > 0


@cuda
def test_cuda_dual_model_drafting_and_sampling(random_cuda):
    from selfspec.runtime.sampling import Sampling

    engine = random_cuda
    drafter = engine.model_drafter(_random_engine(layers=2))  # catches up in 16-row passes
    config = engine.decode_config(None, max_new_tokens=40, confidence_threshold=0.0, fallback=False)
    config.eos_token_ids = ()
    prompt = [int(t) for t in _ids(70, 6, high=150000)]
    plain, _ = generate_ids(engine.runner, prompt, config)
    ids, stats = generate_ids(engine.runner, prompt, config, drafter)
    assert ids == plain and stats.drafted > 0
    # Sampling runs on the device's generator: the same seed gives the same tokens.
    config.sampling, config.seed = Sampling(temperature=1.0), 7
    first, _ = generate_ids(engine.runner, prompt, config, drafter)
    again, _ = generate_ids(engine.runner, prompt, config, drafter)
    assert first == again and len(first) == 40


@cuda
def test_cuda_compiled_speculation_is_identical_to_plain_decoding():
    engine = _random_engine(layers=3, speed="cuda-compiled")
    assert engine.runner.compiled
    config = engine.decode_config(None, max_new_tokens=24, confidence_threshold=0.0, fallback=False)
    config.eos_token_ids = ()
    prompt = [int(t) for t in _ids(40, 8, high=150000)]
    plain, _ = generate_ids(engine.runner, prompt, config)
    ids, stats = generate_ids(
        engine.runner,
        prompt,
        config,
        engine.layer_skip_drafter(engine.make_plan(skip_attention={1})),
    )
    assert ids == plain and stats.drafted > 0
