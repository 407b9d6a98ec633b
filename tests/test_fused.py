"""Whole decoder sublayers as one native call each (selfspec.speed.fused), in the kernel speed
modes."""

import pytest
import torch

from selfspec.kernels import kernel_available

pytestmark = pytest.mark.skipif(
    not kernel_available(), reason="the CPU kernel cannot be built here"
)

PROMPT = "def merge_sorted(a, b):\n    "


def module_path(engine):
    """The same engine's runner, calling the model's modules instead of the fused layers."""
    from selfspec.runtime.runner import ModelRunner

    runner = ModelRunner(engine.loaded)
    runner.adapter.fused = None
    return runner


@pytest.mark.slow
def test_fused_layers_compute_the_module_path_s_logits(qwen05_packed):
    engine = qwen05_packed
    assert engine.loaded.fused is not None and engine.runner.adapter.fused is not None
    modules = module_path(engine)
    ids = torch.tensor(engine.encode(PROMPT))
    results = []
    for runner in (engine.runner, modules):
        runner.reset(ids.numel() + 8)
        prefill = runner.forward(ids, 0)[0]  # every row's logits: prefill through BLAS panels
        step = runner.forward(torch.tensor([7, 8, 9]), ids.numel())[
            0
        ]  # a verify pass through the kernel
        results.append((prefill, step))
    for fused, plain in zip(*results):
        # the same float32 arithmetic but for the norms' and activation's summation order
        torch.testing.assert_close(fused, plain, atol=2e-3, rtol=1e-4)
        assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.slow
def test_fused_decoding_matches_the_module_path_token_for_token(smollm2_packed):
    from selfspec.runtime.decode import generate_ids

    engine = smollm2_packed
    ids = engine.encode(PROMPT)
    config = engine.decode_config(None, max_new_tokens=40)
    fused, _ = generate_ids(engine.runner, ids, config)
    plain, _ = generate_ids(module_path(engine), ids, config)
    assert fused == plain


def test_only_kernel_modes_of_pre_norm_families_fuse(tiny_llama):
    from selfspec.speed.fused import fuse_layers

    assert fuse_layers(tiny_llama.loaded.model, "torch") is None  # transformers' own modules
    assert tiny_llama.runner.adapter.fused is None


@pytest.mark.slow
@pytest.mark.parametrize("speed", ["gguf-q8", "packed"])
def test_the_layer_stack_gives_the_per_sublayer_calls_bits(speed):
    """One native call for the whole stack (``LayerStack``) against one call per sublayer: the
    same logits and the same hidden state at the resume point, bit for bit, over a prefill, one
    row, a verify pass, and layer-skip drafts that capture where the verify pass resumes."""
    from selfspec.engine import Engine

    engine = Engine.load("smollm2-135m", speed=speed)
    runner, stack = engine.runner, engine.runner.layer_stack
    assert stack is not None
    ids = torch.tensor(engine.encode(PROMPT))
    n = ids.numel()
    passes = [
        dict(input_ids=ids, start=0, last_logits_only=True),
        dict(input_ids=torch.tensor([5]), start=n),
        dict(input_ids=torch.tensor([7, 8, 9, 10]), start=n + 1),
        dict(
            input_ids=torch.tensor([11, 12]),
            start=n + 5,
            skip_attention=frozenset({3, 5}),
            skip_mlp=frozenset({7}),
            capture_at=10,
        ),
        dict(input_ids=torch.tensor([13]), start=n + 7, capture_at=2 * runner.num_layers),
        dict(input_ids=torch.tensor([14]), start=n + 8, capture_at=0),
    ]
    results = []
    for layer_stack in (stack, None):
        runner.layer_stack = layer_stack
        runner.reset(n + 16)
        results.append([runner.forward(**p) for p in passes])
    runner.layer_stack = stack
    for (logits, captured), (logits_ref, captured_ref) in zip(*results):
        assert torch.equal(logits, logits_ref)
        assert (captured is None) == (captured_ref is None)
        if captured is not None:
            assert torch.equal(captured, captured_ref)


def test_argmax_rows_is_torch_s_argmax():
    """The kernel's argmax (greedy decoding's every token): the first of equal maxima, and rows
    with NaN or infinities as torch gives them."""
    from selfspec.kernels import load_kernel
    from selfspec.runtime.sampling import argmax_rows

    kernel = load_kernel()
    torch.manual_seed(0)
    for trial in range(120):
        vocab = [151936, 49152, 33, 17, 16, 1][trial % 6]
        logits = torch.randn(3, vocab) * 4
        if trial % 4 == 1:
            logits = logits.round()  # many equal maxima
        if trial % 7 == 2:
            logits[1, vocab // 2] = float("nan")
        if trial % 9 == 3:
            logits[2, vocab - 1] = float("inf")
        if trial % 5 == 4:
            logits[0] = -float("inf")
        expected = torch.argmax(logits, dim=-1).tolist()
        assert kernel.argmax_rows(logits).tolist() == expected
        assert argmax_rows(logits) == expected
        assert argmax_rows(logits[0]) == expected[:1]
