"""Speed modes: the packed kernel computes the same products as F.linear, its rows do not depend
on each other, and speculation in packed mode is lossless against plain decoding in packed mode."""

import pytest
import torch
import torch.nn.functional as F
from test_engine import PROMPTS, hf_greedy, plans_for

from selfspec.errors import SelfSpecError
from selfspec.kernels import KERNEL_MAX_ROWS, kernel_available, load_kernel, pack_weight
from selfspec.speed.modes import PackedLinear, resolve_speed_mode

needs_kernel = pytest.mark.skipif(
    not kernel_available(), reason="the packed CPU kernel cannot be built here"
)


@needs_kernel
@pytest.mark.parametrize(
    "out_features,in_features", [(64, 16), (192, 576), (256, 1536), (1536, 8960)]
)
def test_kernel_matches_f_linear(out_features, in_features):
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features) / in_features**0.5
    bias = torch.randn(out_features)
    layer = torch.nn.Linear(in_features, out_features)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(bias)
    packed = PackedLinear(layer, load_kernel())
    for rows in (1, 2, 3, 5, 8, 13, 16, 17, 32, 33, 100):
        x = torch.randn(1, rows, in_features)
        expected = F.linear(x.double(), weight.double(), bias.double()).float()
        torch.testing.assert_close(packed(x), expected, atol=2e-4, rtol=1e-4)
    no_bias = torch.nn.Linear(in_features, out_features, bias=False)
    no_bias.weight.data.copy_(weight)
    x = torch.randn(4, in_features)
    torch.testing.assert_close(
        PackedLinear(no_bias, load_kernel())(x), F.linear(x, weight), atol=2e-4, rtol=1e-4
    )


@needs_kernel
def test_kernel_rows_are_independent_of_each_other():
    """Row r of a pass over m rows equals, bit for bit, a pass over that row alone (m <=
    KERNEL_MAX_ROWS)."""
    torch.manual_seed(1)
    kernel = load_kernel()
    weight = torch.randn(8960 // 4, 1536)
    packed = pack_weight(weight)
    x = torch.randn(KERNEL_MAX_ROWS, 1536)
    singles = torch.cat(
        [kernel.packed_linear(x[r : r + 1], packed, None) for r in range(KERNEL_MAX_ROWS)]
    )
    for rows in (2, 3, 4, 7, 8, 9, 16, KERNEL_MAX_ROWS):
        assert torch.equal(kernel.packed_linear(x[:rows], packed, None), singles[:rows]), rows


def test_unknown_or_impossible_speed_mode_is_a_clear_error():
    with pytest.raises(SelfSpecError, match="unknown speed mode 'fastest'"):
        resolve_speed_mode("fastest", "cpu", torch.float32)
    with pytest.raises(SelfSpecError, match="float32 only"):
        resolve_speed_mode("packed", "cpu", torch.bfloat16)
    assert resolve_speed_mode("auto", "cpu", torch.bfloat16) == "torch"
    for mode in ("cuda-graphs", "cuda-compiled"):
        with pytest.raises(SelfSpecError, match=f"--speed {mode} needs a CUDA device"):
            resolve_speed_mode(mode, "cpu", torch.float32)


def test_stats_name_the_numerics_of_cuda_and_precision_modes():
    from selfspec.speed.modes import numerics_note

    assert numerics_note("packed", "cpu") is None and numerics_note("torch", "cpu") is None
    assert "static cache" in numerics_note("torch", "cuda") and "static cache" in numerics_note(
        "cuda-graphs", "cuda"
    )
    assert "8 bits" in numerics_note("gguf-q8", "cpu")


@needs_kernel
@pytest.mark.slow
def test_packed_logits_match_transformers(smollm2, smollm2_packed):
    ids = torch.tensor([smollm2.encode(PROMPTS[0], chat=True)])
    with torch.inference_mode():
        reference = smollm2.loaded.model(ids).logits
        packed = smollm2_packed.loaded.model(ids).logits
    torch.testing.assert_close(packed, reference, atol=2e-3, rtol=1e-3)
    assert not any(isinstance(m, PackedLinear) for m in smollm2.loaded.model.modules())
    assert (
        sum(isinstance(m, PackedLinear) for m in smollm2_packed.loaded.model.modules())
        == 7 * 30 + 1
    )


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["smollm2_packed", "qwen05_packed"])
def test_packed_mode_speculation_is_lossless(model_fixture, request):
    """In packed mode, every plan's output equals plain decoding in packed mode, and transformers'
    own generate over the same packed model."""
    engine = request.getfixturevalue(model_fixture)
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        plain = engine.generate(ids, None, max_new_tokens=24)
        assert plain.token_ids == hf_greedy(engine, ids, 24)
        for name, plan in plans_for(engine).items():
            result = engine.generate(ids, engine.layer_skip_drafter(plan), max_new_tokens=24)
            assert result.token_ids == plain.token_ids, (
                f"plan {name} changed the output in packed mode"
            )


@needs_kernel
@pytest.mark.slow
def test_bench_gives_transformers_methods_the_unmodified_model(smollm2_packed):
    from selfspec.bench import Method, run_bench
    from selfspec.bench.methods import run_hf_generate

    seen = []

    def hf_checked(ctx, prompt_ids):
        seen.append(any(isinstance(m, PackedLinear) for m in ctx.hf_target.model.modules()))
        return run_hf_generate(ctx, prompt_ids)

    result = run_bench(
        smollm2_packed,
        PROMPTS[:1],
        ["hf_generate", "autoregressive", "self_speculative", "hf_checked"],
        plan=plans_for(smollm2_packed)["light"],
        max_new_tokens=8,
        progress=False,
        custom_methods={"hf_checked": Method("hf_checked", hf_checked, transformers=True)},
    )
    assert seen and not any(seen)
    assert result["config"]["speed_mode"] == "packed"
    assert result["methods"]["self_speculative"]["identical_to_autoregressive"] is True


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_row_attention_matches_torch_sdpa_and_rows_stand_alone(causal, dim):
    """Kernel modes compute attention one query row at a time: close to torch's SDPA (grouped
    heads, bool and float masks, no mask), and a row's bits do not depend on the other rows.
    37 keys: two blocks of 16 (four of 8 on AVX2) and a tail; head sizes with and without the
    register paths."""
    kernel = load_kernel()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 5, dim, generator=gen)
    k, v = (torch.randn(2, 2, 37, dim, generator=gen) for _ in range(2))
    offset = 37 - 5  # cached prefix: row i sees keys 0..offset+i
    allowed = torch.arange(37)[None, :] <= offset + torch.arange(5)[:, None]
    allowed = allowed[None, None].expand(2, 1, 5, 37)
    float_mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask in (allowed, float_mask):
        got = kernel.attention_rows(q, k, v, mask, 0.125, causal)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True
        )
        assert torch.allclose(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)
        for i in range(5):
            row = kernel.attention_rows(
                q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1], 0.125, causal
            )
            assert torch.equal(row, got[:, i : i + 1])
    # a mask of its own for each query head, heads of one group included
    per_head = torch.rand(2, 6, 5, 37, generator=gen) < 0.5
    per_head[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=per_head, scale=0.125, enable_gqa=True
    )
    got = kernel.attention_rows(q, k, v, per_head, 0.125, causal)
    assert torch.allclose(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    # keys and values as the runner's cache hands them out (views of longer buffers), queries
    # transposed: read in place, same bits
    buffers = [torch.cat([t, torch.randn(2, 2, 11, dim, generator=gen)], dim=2) for t in (k, v)]
    k_view, v_view = (b[:, :, :37] for b in buffers)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_view.is_contiguous() and not q_view.is_contiguous()
    assert torch.equal(
        kernel.attention_rows(q_view, k_view, v_view, allowed, 0.125, causal),
        kernel.attention_rows(q, k, v, allowed, 0.125, causal),
    )
    # no mask: causal from key 0 over several rows (prefill), every key for a single row
    got = kernel.attention_rows(q, k[:, :, :5], v[:, :, :5], None, 0.125, causal)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :5], v[:, :, :5], is_causal=causal, scale=0.125, enable_gqa=True
    )
    assert torch.allclose(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    single = kernel.attention_rows(q[:, :, :1], k, v, None, 0.125, causal)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :1], k, v, scale=0.125, enable_gqa=True
    )
    assert torch.allclose(single, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.slow
def test_a_verify_pass_gives_each_row_the_bits_of_one_token_passes(qwen05_packed):
    """The property greedy losslessness rests on, for a whole model in a kernel mode: scoring k+1
    tokens in one pass gives each of them exactly the logits of k+1 one-token passes."""
    from selfspec.kernels import ROW_ATTENTION

    engine = qwen05_packed
    assert engine.loaded.model.config._attn_implementation == ROW_ATTENTION
    runner = engine.runner
    ids = torch.tensor(engine.encode(PROMPTS[1], chat=True))
    start = ids.numel() - 6
    runner.reset(ids.numel() + 8)
    runner.forward(ids[:start], 0, last_logits_only=True)
    together = runner.forward(ids[start:], start)[0].reshape(6, -1)
    for i in range(6):
        alone = runner.forward(ids[start + i : start + i + 1], start + i)[0].reshape(-1)
        assert torch.equal(together[i], alone), i


def test_auto_picks_the_fastest_mode_this_machine_runs(monkeypatch):
    """A GGUF model: gguf-q8 with AVX-512 VNNI, else gguf (the same weights, float32 arithmetic);
    another model: packed; no kernel: transformers' own (torch)."""
    from selfspec.errors import SelfSpecError
    from selfspec.speed import modes as speed

    class Kernel:
        vnni = True

        def q8_vectorized(self):
            return self.vnni

    kernel = Kernel()
    monkeypatch.setattr(speed, "load_kernel", lambda: kernel)
    assert speed.resolve_speed_mode("auto", "cpu", torch.float32, from_gguf=True) == "gguf-q8"
    assert speed.resolve_speed_mode("auto", "cpu", torch.float32, from_gguf=False) == "packed"
    kernel.vnni = False
    assert speed.resolve_speed_mode("auto", "cpu", torch.float32, from_gguf=True) == "gguf"

    def no_kernel():
        raise SelfSpecError("no compiler")

    monkeypatch.setattr(speed, "load_kernel", no_kernel)
    assert speed.resolve_speed_mode("auto", "cpu", torch.float32, from_gguf=True) == "torch"
