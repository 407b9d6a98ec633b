"""Whole decoder sublayers as one native call each (selfspec.fused), in the kernel speed modes."""

import pytest
import torch

from selfspec.kernels import kernel_available

pytestmark = pytest.mark.skipif(
    not kernel_available(), reason="the CPU kernel cannot be built here"
)

PROMPT = "def merge_sorted(a, b):\n    "


def module_path(engine):
    """The same engine's runner, calling the model's modules instead of the fused layers."""
    from selfspec.runner import ModelRunner

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
    from selfspec.decode import generate_ids

    engine = smollm2_packed
    ids = engine.encode(PROMPT)
    config = engine.decode_config(None, max_new_tokens=40)
    fused, _ = generate_ids(engine.runner, ids, config)
    plain, _ = generate_ids(module_path(engine), ids, config)
    assert fused == plain


def test_only_kernel_modes_of_pre_norm_families_fuse(tiny_llama):
    from selfspec.fused import fuse_layers

    assert fuse_layers(tiny_llama.loaded.model, "torch") is None  # transformers' own modules
    assert tiny_llama.runner.adapter.fused is None
