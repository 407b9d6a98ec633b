"""`selfspec profile`: what passes over 1..16 tokens, a layer-skip draft step and a draft of the
heads' guesses cost, timed in turn."""

import torch


def test_profile_times_every_pass_size_and_the_draft_step_in_turn(smollm2):
    """`selfspec profile`: pass sizes and the draft step take turns within each round, so the
    draft step's share of a step is a median of ratios timed side by side."""
    from selfspec.bench.profiler import SIZES, profile_engine

    n = smollm2.identity.num_layers
    plan = smollm2.make_plan([n // 2], [n // 2 + 1])
    result = profile_engine(smollm2, plan, prefix=16, repeats=3, acceptance=0.7)
    assert list(result["forward_ms"]) == [str(s) for s in SIZES]
    assert all(ms > 0 for ms in result["forward_ms"].values())
    assert result["draft_step_ms"] > 0 and 0 < result["draft_cost_ratio"] < 5
    assert result["acceptance_assumed"] == 0.7 and 0 <= result["best_draft_length"] < 16
    assert "head_draft_ms" not in result  # no heads given


def test_profile_times_the_pass_sizes_asked_for(smollm2):
    """`selfspec profile --rows 3,5`: those sizes, and one token, which every ratio is to."""
    from selfspec.bench.profiler import profile_engine

    result = profile_engine(smollm2, None, prefix=16, repeats=2, rows=[5, 3])
    assert list(result["forward_ms"]) == ["1", "3", "5"] == list(result["hf_forward_ms"])
    assert "verify_ratio_8_over_1" not in result  # 8 was not timed


def test_profile_times_a_draft_of_every_head_guess(smollm2):
    from selfspec.bench.profiler import profile_engine
    from selfspec.drafters.heads import DraftHeads

    size = smollm2.loaded.model.config.hidden_size
    heads = DraftHeads([torch.zeros(size, 2 * size)] * 3, [torch.zeros(size)] * 3, {})
    result = profile_engine(smollm2, None, prefix=16, repeats=3, heads=heads)
    assert result["head_guesses"] == 3 and result["head_draft_ms"] > 0
    assert 0 < result["head_guess_cost_ratio"] < 5
    # a round with the draft beside its verify pass (over the pending token and 3 guesses), and
    # one after the other: each ran both (halved: medians of separate timings on a busy machine)
    assert result["ahead_pass_tokens"] == 4
    pass_ms = result["forward_ms"]["4"]
    assert result["ahead_sequential_ms"] > 0.5 * (result["head_draft_ms"] + pass_ms)
    assert result["ahead_beside_ms"] > 0.5 * max(result["head_draft_ms"], pass_ms)


def test_profile_fastest_reports_each_measurements_fastest_round(smollm2):
    """`selfspec profile --fastest`: the least of each measurement's rounds, not their median (for
    two builds compared one after the other on a machine shared with others)."""
    from selfspec.bench.profiler import profile_engine, summary

    assert summary(True)([3.0, 1.0, 2.0]) == 1.0 and summary(False)([3.0, 1.0, 2.0]) == 2.0
    result = profile_engine(smollm2, None, prefix=16, repeats=3, rows=[2], fastest=True)
    assert result["statistic"] == "fastest" and list(result["forward_ms"]) == ["1", "2"]
    assert all(ms > 0 for ms in result["forward_ms"].values())
    median = profile_engine(smollm2, None, prefix=16, repeats=3, rows=[2])
    assert median["statistic"] == "median"
