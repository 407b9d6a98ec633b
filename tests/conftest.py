"""Shared fixtures. Real models load once per test run (first use downloads and converts them)."""

import contextlib
import os

os.environ.setdefault("SELFSPEC_NO_PROGRESS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import selfspec  # noqa: E402,F401  (sets MKL_CBWR before torch)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Fixtures that load a real model (the first use downloads and converts it): a test that uses one
# is slow whether or not it says so, and the quick lane (-m "not slow") leaves it out.
REAL_MODEL_FIXTURES = {"smollm2", "qwen05", "smollm2_packed", "qwen05_packed"}


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# Speed mode "torch": the model exactly as transformers builds it, so transformers' own
# generate on the same object is an independent reference.
@pytest.fixture(scope="session")
def smollm2():
    from selfspec.engine import Engine

    return Engine.load("smollm2-135m", speed="torch")


@pytest.fixture(scope="session")
def qwen05():
    from selfspec.engine import Engine

    return Engine.load("qwen2.5-coder-0.5b", speed="torch")


def _packed(name):
    from selfspec.engine import Engine
    from selfspec.kernels import kernel_available

    if not kernel_available():
        pytest.skip("the packed CPU kernel cannot be built on this machine")
    return Engine.load(name, speed="packed")


@pytest.fixture(scope="session")
def smollm2_packed():
    return _packed("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_packed():
    return _packed("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A randomly initialised 4-layer llama with a 64-token vocabulary, for fast exact-distribution
    tests."""
    from tiny_models import TINY_SHAPE, word_level_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfspec.engine import Engine
    from selfspec.loading.models import LoadedModel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_SHAPE)).eval()
    model.config._attn_implementation = "sdpa"
    tokenizer = word_level_tokenizer()
    return Engine(LoadedModel("tiny-llama", model, tokenizer, path="<memory>"))


@contextlib.contextmanager
def _sharpened_head(engine, factor: float):
    """The engine's output layer scaled by ``factor`` (sharper distributions) while inside."""
    head = engine.loaded.model.lm_head.weight
    with torch.no_grad():
        original = head.clone()
        head.mul_(factor)
    try:
        yield engine
    finally:
        with torch.no_grad():
            head.copy_(original)


@pytest.fixture(scope="session")
def sharpened_head():
    """``with sharpened_head(engine, factor):`` the engine with a sharper output layer."""
    return _sharpened_head
