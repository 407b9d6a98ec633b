"""A model spread over devices with accelerate (selfspec.loading.placement): forced here on the CPU
by a max_memory smaller than the model, so part of it is offloaded to disk; self-speculation must
still give plain decoding's tokens."""

from __future__ import annotations

import pytest

from selfspec.errors import SelfSpecError
from selfspec.loading.placement import DISK, parse_max_memory

PROMPT = "def fibonacci(n):"


def test_max_memory_text():
    assert parse_max_memory("0=10GiB, cpu=300MB,disk=1") == {
        0: 10 * 2**30,
        "cpu": 300_000_000,
        "disk": 1,
    }
    for bad, message in [
        ("cpu", "each entry is DEVICE=SIZE"),
        ("gpu=3GB", "device 'gpu' is not a GPU number"),
        ("cpu=lots", "'lots' is not a size"),
    ]:
        with pytest.raises(SelfSpecError, match=message):
            parse_max_memory(bad)


@pytest.fixture(scope="module")
def split_engine():
    from selfspec.engine import Engine

    return Engine.load("smollm2-135m", max_memory={"cpu": "300MB"})


@pytest.mark.slow
def test_device_map_follows_the_sublayers(split_engine):
    device_map = split_engine.loaded.device_map
    assert split_engine.loaded.speed == "torch"
    names = list(device_map)
    assert names[0].endswith("embed_tokens") and device_map[names[0]] == "cpu"
    assert "model.layers.0.self_attn" in device_map and "model.layers.0.mlp" in device_map
    # filled in order: the CPU first, then disk, never back
    devices = [device_map[n] for n in names if not n.endswith("lm_head")]
    first_disk = devices.index(DISK)
    assert set(devices[:first_disk]) == {"cpu"} and set(devices[first_disk:]) == {DISK}
    # smollm2 ties its head to its embedding: one tensor, one place
    assert device_map["lm_head"] == device_map["model.embed_tokens"]
    meta = [n for n, p in split_engine.loaded.model.named_parameters() if p.device.type == "meta"]
    assert meta, "nothing was offloaded: the test would not test a split"


@pytest.mark.slow
def test_split_model_speculates_losslessly(split_engine, smollm2):
    expected = smollm2.generate(PROMPT, None, max_new_tokens=32).token_ids  # whole, on one device
    plain = split_engine.generate(PROMPT, None, max_new_tokens=32)
    assert plain.token_ids == expected
    plan = split_engine.default_plan()
    drafted = split_engine.generate(
        PROMPT, split_engine.layer_skip_drafter(plan), max_new_tokens=32
    )
    assert drafted.token_ids == expected
    assert drafted.stats.drafted > 0  # draft passes ran, skipping sublayers, across the split
    adaptive = split_engine.generate(PROMPT, split_engine.self_drafter(plan), max_new_tokens=32)
    assert adaptive.token_ids == expected


@pytest.mark.slow
def test_kernel_modes_refuse_a_split():
    from selfspec.engine import Engine

    with pytest.raises(SelfSpecError, match="Add --speed torch"):
        Engine.load("smollm2-135m", speed="gguf", max_memory={"cpu": "300MB"})
