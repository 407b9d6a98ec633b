"""The engine is lossless: greedy output equals transformers' generate token for token, for any
plan."""

import random

import pytest
import torch
from transformers import DynamicCache

from selfspec.errors import SelfSpecError
from selfspec.prompts import load_prompts
from selfspec.runtime.plan import DraftPolicy

PROMPTS = [p.text for p in load_prompts("spec-bench:coding,math_reasoning,translation", limit=1)]


def hf_greedy(engine, prompt_ids, max_new_tokens, eos=True):
    kwargs = {} if eos else {"eos_token_id": None}
    out = engine.loaded.model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=engine.tokenizer.eos_token_id,
        **kwargs,
    )
    return out[0, len(prompt_ids) :].tolist()


def plans_for(engine, seed=0):
    """Empty, light, heavy and random plans for this model."""
    n = engine.identity.num_layers
    rng = random.Random(seed)
    mid = range(n // 4, n - 2)
    return {
        "empty": engine.make_plan([], []),
        "light": engine.make_plan([n // 2, n // 2 + 2], [n // 2 + 1]),
        "heavy": engine.make_plan(list(range(2, n - 1, 2)), list(range(3, n - 1, 3))),
        "random": engine.make_plan(
            sorted(rng.sample(mid, len(mid) // 3)), sorted(rng.sample(mid, len(mid) // 4))
        ),
        # the draft scores only the first 16384 token ids; the verify pass scores them all
        "light_small_head": engine.make_plan(
            [n // 2, n // 2 + 2], [n // 2 + 1], DraftPolicy(draft_vocab=16384)
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["smollm2", "qwen05"])
def test_greedy_identical_to_hf_generate(model_fixture, request):
    engine = request.getfixturevalue(model_fixture)
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        expected = hf_greedy(engine, ids, 24)
        plain = engine.generate(ids, None, max_new_tokens=24)
        assert plain.token_ids == expected, "plain decoding differs from transformers"
        assert plain.stats.mean_accepted_length == pytest.approx(1.0)
        for name, plan in plans_for(engine).items():
            result = engine.generate(ids, engine.layer_skip_drafter(plan), max_new_tokens=24)
            assert result.token_ids == expected, f"plan {name} changed the output"
            assert result.stats.target_passes <= plain.stats.target_passes


@pytest.mark.slow
def test_light_plan_accepts_more_than_one_token_per_pass(qwen05):
    ids = qwen05.encode(PROMPTS[0], chat=True)
    plan = qwen05.make_plan([12], [], provenance={"how": "test"})
    result = qwen05.generate(
        ids,
        qwen05.layer_skip_drafter(plan),
        max_new_tokens=32,
        config=qwen05.decode_config(
            plan,
            max_new_tokens=32,
            confidence_threshold=0.0,
            adaptive_threshold=False,
            fallback=False,
        ),
    )
    assert result.stats.mean_accepted_length > 1.5
    assert result.stats.accepted > 0 and result.stats.drafted >= result.stats.accepted


@pytest.mark.slow
def test_dual_model_drafter_is_lossless(qwen05, smollm2):
    # smollm2 drafting for itself from a second runner: a same-tokenizer separate model with its own
    # cache.
    ids = smollm2.encode(PROMPTS[1], chat=True)
    expected = hf_greedy(smollm2, ids, 20)
    drafter = smollm2.model_drafter(smollm2.loaded)
    result = smollm2.generate(ids, drafter, max_new_tokens=20)
    assert result.token_ids == expected
    assert result.stats.acceptance_rate > 0.9  # same weights: the draft almost always agrees
    with pytest.raises(
        SelfSpecError, match="'smollm2-135m' does not share qwen2.5-coder-0.5b's tokenizer"
    ):
        qwen05.model_drafter(smollm2.loaded)


@pytest.mark.slow
def test_max_new_tokens_mid_draft_and_eos(smollm2):
    ids = smollm2.encode("Count from one to five in words:", chat=True)
    drafter = smollm2.layer_skip_drafter(
        plans_for(smollm2)["empty"]
    )  # accepts everything: drafts run past the limit
    full = hf_greedy(smollm2, ids, 64)
    assert smollm2.tokenizer.eos_token_id in full or full[-1] in smollm2.eos_ids(), (
        "prompt should end with EOS"
    )
    for limit in (1, 2, 5, 7):
        result = smollm2.generate(ids, drafter, max_new_tokens=limit)
        assert result.token_ids == full[:limit]
        assert result.stats.new_tokens == limit
    result = smollm2.generate(ids, drafter, max_new_tokens=64)
    assert result.token_ids == full and result.stats.stop_reason == "eos"


@pytest.mark.slow
def test_stop_string_cuts_where_plain_decoding_would(smollm2):
    ids = smollm2.encode("def add(a, b):\n", chat=False)
    plain = smollm2.generate(ids, None, max_new_tokens=30)
    text = plain.text
    stop = text.strip()[:4] if len(text.strip()) >= 4 else None
    assert stop, f"need some text to cut: {text!r}"
    drafter = smollm2.layer_skip_drafter(plans_for(smollm2)["empty"])
    a = smollm2.generate(ids, None, max_new_tokens=30, stop_strings=(stop,))
    b = smollm2.generate(ids, drafter, max_new_tokens=30, stop_strings=(stop,))
    assert a.token_ids == b.token_ids and b.stats.stop_reason == "stop_string"
    assert stop in b.text and len(b.token_ids) < len(plain.token_ids)
    assert b.token_ids == plain.token_ids[: len(b.token_ids)]


@pytest.mark.slow
def test_cache_holds_full_model_keys_after_generation(qwen05):
    ids = qwen05.encode(PROMPTS[2], chat=True)
    plan = plans_for(qwen05)["heavy"]
    result = qwen05.generate(ids, qwen05.layer_skip_drafter(plan), max_new_tokens=20)
    committed = ids + result.token_ids
    in_cache = len(committed) - 1  # the last token is pending
    reference = DynamicCache(config=qwen05.loaded.model.config)
    with torch.inference_mode():
        qwen05.loaded.model(
            torch.tensor([committed[:-1]]), past_key_values=reference, use_cache=True
        )
    cache = qwen05.runner.cache
    for layer in range(qwen05.identity.num_layers):
        ref_k, ref_v = reference.layers[layer].keys[0], reference.layers[layer].values[0]
        torch.testing.assert_close(cache.keys[layer, 0, :, :in_cache], ref_k, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(
            cache.values[layer, 0, :, :in_cache], ref_v, atol=2e-3, rtol=1e-3
        )


def test_tiny_model_identity_over_many_random_plans(tiny_llama):
    engine = tiny_llama
    rng = random.Random(1)
    prompt = [rng.randrange(64) for _ in range(9)]
    expected = hf_greedy(engine, prompt, 16, eos=False)
    config = engine.decode_config(None, max_new_tokens=16, confidence_threshold=0.0, fallback=False)
    config.eos_token_ids = ()
    for _ in range(12):
        attn = sorted(rng.sample(range(4), rng.randrange(0, 3)))
        mlp = sorted(rng.sample(range(4), rng.randrange(0, 3)))
        config.max_draft_tokens = rng.randrange(1, 7)
        plan = engine.make_plan(attn, mlp)
        out = engine.generate(prompt, engine.layer_skip_drafter(plan), config=config)
        assert out.token_ids == expected, (attn, mlp, config.max_draft_tokens)


def test_empty_prompt_and_context_window_errors(tiny_llama):
    with pytest.raises(SelfSpecError, match="prompt is empty"):
        tiny_llama.generate("   ", None)
    with pytest.raises(SelfSpecError, match="prompt is empty"):
        tiny_llama.generate([], None)
    with pytest.raises(SelfSpecError, match="exceeds the model's context window of 256 tokens"):
        tiny_llama.generate([1] * 200, None, max_new_tokens=100)


def test_plan_for_another_model_is_refused(tiny_llama, tmp_path):
    plan = tiny_llama.make_plan([1], [])
    plan.model.fingerprint = "0123456789abcdef"
    plan.model.name = "some-other-model"
    path = tmp_path / "plan.json"
    plan.save(path)
    with pytest.raises(
        SelfSpecError, match="was made for model 'some-other-model'.*Run `selfspec search`"
    ):
        tiny_llama.load_plan(path)
