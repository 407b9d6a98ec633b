"""`selfspec bench`'s summary and report from runs with known times and tokens: the decoding
phase, verify passes by rows, and what a precision mode's differences are called."""

import json
import statistics
from pathlib import Path

import pytest

from selfspec import bench

SAVED_Q8_BENCH = (
    Path(__file__).resolve().parent.parent / "results/qwen2.5-coder-1.5b/gguf-q8/bench/bench.json"
)


def test_decoding_phase_summary_from_known_runs():
    """The summary's decoding-phase figures from runs with made-up times: per prompt, (new tokens
    - 1) / (seconds - first token); then medians over prompts, speedups as medians of per-prompt
    ratios (the end-to-end speedups' rule), and nothing for a run of a single token."""
    from selfspec.bench.summary import summarize
    from selfspec.prompts import Prompt

    prompts = [Prompt("a", "x", "."), Prompt("b", "x", "."), Prompt("c", "y", ".")]

    def runs(*times, tokens=(1, 2, 3, 4, 5)):
        return [[bench.MethodRun(list(tokens), s, first_token_seconds=f)] for s, f in times]

    all_runs = {
        "hf_generate": runs((1.0, 0.2), (1.0, 0.6), (2.0, 1.0)),  # decode 5, 10, 4 tok/s
        "autoregressive": runs((0.5, 0.1), (0.9, 0.5), (1.0, 0.2)),  # decode 10, 10, 5 tok/s
        "one_token": runs((0.1, 0.1), (0.1, 0.1), (0.1, 0.1), tokens=(1,)),
    }
    registry = {name: bench.Method(name, None) for name in all_runs}
    result = summarize(prompts, [[0]] * 3, list(all_runs), registry, all_runs, {})
    hf, ar = result["methods"]["hf_generate"], result["methods"]["autoregressive"]
    assert [p["methods"]["hf_generate"]["decode_tokens_per_second"] for p in result["prompts"]] == (
        pytest.approx([5.0, 10.0, 4.0])
    )
    assert hf["decode_tokens_per_second"] == pytest.approx(5.0)
    assert hf["time_to_first_token"] == pytest.approx(0.6)
    assert ar["decode_tokens_per_second"] == pytest.approx(10.0)
    assert ar["decode_speedup_vs_hf_generate"] == pytest.approx(1.25)  # median of 2, 1, 1.25
    assert ar["decode_speedup_vs_autoregressive"] == pytest.approx(1.0)
    assert hf["decode_speedup_vs_autoregressive"] == pytest.approx(0.8)  # median of 0.5, 1, 0.8
    assert ar["categories"]["x"]["decode_speedup_vs_hf_generate"] == pytest.approx(1.5)
    assert ar["categories"]["y"]["decode_tokens_per_second"] == pytest.approx(5.0)
    assert ar["categories"]["y"]["time_to_first_token"] == pytest.approx(0.2)
    # end to end as before: tokens over all the seconds
    assert ar["speedup_vs_hf_generate"] == pytest.approx(statistics.median([2.0, 1.0 / 0.9, 2.0]))
    one = result["methods"]["one_token"]
    assert one["decode_tokens_per_second"] is None and one["decode_speedup_vs_hf_generate"] is None
    assert one["time_to_first_token"] == pytest.approx(0.1) and one["tokens_per_second"] == 10.0


def test_verify_passes_by_rows_from_known_runs():
    """Each method's verify passes pooled by rows over prompts: median ms, counts, and the median
    of each pass over plain decoding's median one-row pass on the same prompt; in the Markdown."""
    from selfspec.bench.report import verify_table
    from selfspec.bench.summary import summarize
    from selfspec.prompts import Prompt
    from selfspec.runtime.decode import DecodeStats

    def run(verify_seconds: dict) -> bench.MethodRun:
        return bench.MethodRun([1, 2, 3], 1.0, DecodeStats(verify_seconds=verify_seconds), 0.1)

    prompts = [Prompt("short", "x", "."), Prompt("long", "x", ".")]
    runs = {  # the long prompt's passes cost twice the short one's
        "autoregressive": [[run({1: [0.010, 0.012, 0.010]})], [run({1: [0.020, 0.021, 0.020]})]],
        "self_speculative": [[run({1: [0.010], 3: [0.012, 0.013]})], [run({3: [0.024]})]],
    }
    registry = {name: bench.Method(name, None) for name in runs}
    result = summarize(prompts, [[0]] * 2, list(runs), registry, runs, {})
    spec = result["methods"]["self_speculative"]
    assert spec["verify_ms_by_rows"] == {1: pytest.approx(10.0), 3: pytest.approx(13.0)}
    assert spec["verify_passes_by_rows"] == {1: 1, 3: 3}
    # 3 rows: 0.012 / 0.010, 0.013 / 0.010 on the short prompt, 0.024 / 0.020 on the long one
    assert spec["verify_steps_by_rows"] == {1: pytest.approx(1.0), 3: pytest.approx(1.2)}
    assert result["methods"]["autoregressive"]["verify_steps_by_rows"] == {1: pytest.approx(1.0)}
    result["config"] = {"categories": ["x"], "memory_method": "."}
    result["machine"], result["notes"] = {}, []
    table = verify_table(result)
    assert "| self_speculative | 10.00 (1.00) | 13.00 (1.20) |" in table
    assert DecodeStats(verify_seconds={2: [0.001, 0.003]}).to_dict()["verify_ms_by_rows"] == {
        2: pytest.approx(2.0)
    }


def test_report_tells_a_precision_modes_expected_differences_from_real_errors():
    """In gguf-q8 (8-bit activations) selfspec's methods may differ from the float32 baseline: the
    report says why instead of flagging an error; in a float32 mode the same result is flagged."""
    result = json.loads(SAVED_Q8_BENCH.read_text())
    assert result["config"]["speed_mode"] == "gguf-q8"
    assert result["methods"]["autoregressive"]["identical_to_baseline"] is False
    md = bench.format_markdown(result)
    assert (
        "no (mode's numerics)" in md and "**NO**" not in md and "differs from hf_generate" not in md
    )
    assert all(
        m["identical_to_autoregressive"]
        for n, m in result["methods"].items()
        if "identical_to_autoregressive" in m
    )
    result["config"]["speed_mode"] = "gguf"
    md = bench.format_markdown(result)
    assert "**NO**" in md and "**autoregressive differs from hf_generate" in md


def test_llama_cpp_speculation_is_checked_against_its_own_plain_decoding():
    """llama.cpp's speculation types are compared with llama_server (its plain decoding), not
    with hf_generate (other numerics), and a type that changes a token is named in the report."""
    from selfspec.bench.summary import summarize
    from selfspec.prompts import Prompt

    prompts = [Prompt("a", "x", "."), Prompt("b", "x", ".")]
    tokens = {"llama_server": [[1, 2, 3], [4, 5]], "good": [[1, 2, 3], [4, 5]]}
    tokens["bad"] = [[1, 2, 3], [4, 6]]  # differs on the second prompt

    def runs(name):
        return [[bench.MethodRun(t, 1.0, first_token_seconds=0.1)] for t in tokens[name]]

    registry = {
        "llama_server": bench.Method("llama_server", None, checks_identity=False),
        "good": bench.Method("good", None, checks_identity=False, same_as="llama_server"),
        "bad": bench.Method("bad", None, checks_identity=False, same_as="llama_server"),
    }
    all_runs = {name: runs(name) for name in registry}
    result = summarize(prompts, [[0]] * 2, list(all_runs), registry, all_runs, {})
    methods = result["methods"]
    assert methods["good"]["identical_to_llama_server"] is True
    assert methods["bad"]["identical_to_llama_server"] is False
    assert "identical_to_llama_server" not in methods["llama_server"]
    assert all(m["identical_to_baseline"] == "n/a" for m in methods.values())
    saved = json.loads(SAVED_Q8_BENCH.read_text())  # a real result's machine and config
    saved["config"]["categories"] = ["x"]
    text = bench.format_markdown({**saved, **result})
    assert "good yes" in text and "bad **no**" in text
