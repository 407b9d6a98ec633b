"""Where plans come from: the user's searched plan first, then the one shipped in the package; and
the name a model's own files go under, never a path into the user's folders."""

import pytest

from selfspec.paths import (
    default_plan_candidates,
    find_default_plan,
    model_key,
    packaged_plan,
    user_heads_path,
    user_plan_path,
)
from selfspec.runtime.plan import load_plan


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    return tmp_path


def test_shipped_plans_load_from_the_package(cache):
    for model in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"):
        found = find_default_plan(model, "packed")
        assert found == packaged_plan(model)
        assert load_plan(found).model.name == model
    assert find_default_plan("no-such-model") is None


def test_a_searched_plan_wins_and_modes_borrow_the_closest(cache):
    model = "qwen2.5-coder-1.5b"
    assert find_default_plan(model, "gguf-q8") == packaged_plan(model, "gguf-q8")
    mine = user_plan_path(model, "gguf")
    assert mine == cache / "plans" / model / "gguf" / "plan.json"
    mine.parent.mkdir(parents=True)
    mine.write_text(packaged_plan(model, "gguf").read_text())
    assert find_default_plan(model, "gguf") == mine
    # gguf-q8 still prefers its own shipped plan over the user's gguf one: same-mode costs first
    assert find_default_plan(model, "gguf-q8") == packaged_plan(model, "gguf-q8")
    order = default_plan_candidates("qwen2.5-coder-0.5b", "gguf-q8")
    assert [p.parent.name for p in order] == [
        "gguf-q8",
        "gguf-q8",
        "gguf",
        "gguf",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b",
    ]
    assert find_default_plan("qwen2.5-coder-0.5b", "gguf-q8") == packaged_plan("qwen2.5-coder-0.5b")


def test_a_model_s_files_go_under_a_name_never_a_path(cache, tmp_path, monkeypatch):
    folder = tmp_path / "my model"
    folder.mkdir()
    gguf = tmp_path / "elsewhere" / "model.gguf"  # its cache entry is named by its content
    entry = cache / "models" / "gguf-0123456789abcdef"
    cases = [
        ("qwen2.5-coder-0.5b", cache / "models" / "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b"),
        ("HuggingFaceTB/SmolLM2-135M", tmp_path / "hub", "HuggingFaceTB--SmolLM2-135M"),
        (str(gguf), entry, "gguf-0123456789abcdef"),
        (str(folder), folder, None),  # its name and a hash of where it is
    ]
    for name, model_dir, expected in cases:
        key = model_key(name, model_dir)
        if expected is not None:
            assert key == expected
        assert "/" not in key and not key.startswith(".")
        assert user_heads_path(key).parent.parent == cache / "plans"
        assert user_plan_path(key).is_relative_to(cache)
    local = model_key(str(folder), folder)
    assert local.startswith("my model-") and local == model_key(str(folder) + "/", folder)
    other = tmp_path / "other" / "my model"
    other.mkdir(parents=True)
    assert model_key(str(other), other) != local  # two folders of one name keep apart
    monkeypatch.chdir(tmp_path)  # a folder of a bundled model's name here: the bundled one loads
    (tmp_path / "qwen2.5-coder-0.5b").mkdir()
    bundled = cache / "models" / "qwen2.5-coder-0.5b"
    assert model_key("qwen2.5-coder-0.5b", bundled) == "qwen2.5-coder-0.5b"
