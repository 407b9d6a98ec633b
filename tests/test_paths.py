"""Where plans come from: the user's searched plan first, then the one shipped in the package."""

import pytest

from selfspec.paths import default_plan_candidates, find_default_plan, packaged_plan, user_plan_path
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
