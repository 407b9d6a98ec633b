"""`selfspec bench`: every method on the same prompts, well-formed outputs, honest identity
checks."""

import json
import statistics

import pytest
import torch

from selfspec import bench
from selfspec.bench.methods import llama_cpp_available
from selfspec.cli import main
from selfspec.prompts import load_prompts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS = 10
SUMMARY_FIELDS = (
    "tokens_per_second",
    "speedup_vs_hf_generate",
    "speedup_vs_autoregressive",
    "mean_accepted_length",
    "acceptance_rate",
    "acceptance_by_position",
    "identical_to_baseline",
    "decode_tokens_per_second",
    "decode_speedup_vs_autoregressive",
    "decode_speedup_vs_hf_generate",
    "time_to_first_token",
)


def broken(ctx, prompt_ids):
    """Plain decoding with its last token changed: a lossy method the identity check must catch."""
    run = bench.METHODS["autoregressive"].run(ctx, prompt_ids)
    run.token_ids[-1] = (run.token_ids[-1] + 1) % ctx.engine.loaded.model.config.vocab_size
    return run


def light_plan(engine):
    n = engine.identity.num_layers
    return engine.make_plan(
        [n // 2 - 2, n // 2, n // 2 + 2], [n // 2 + 1], provenance={"how": "test"}
    )


@pytest.fixture(scope="module")
def bench_run(smollm2, tmp_path_factory):
    """One bench over two prompts (two categories): every method that can run, and a broken one."""
    prompts = load_prompts("spec-bench:coding,math", limit=1)
    result = bench.run_bench(
        smollm2,
        prompts,
        plan=light_plan(smollm2),
        draft=smollm2,
        max_new_tokens=TOKENS,
        custom_methods={"broken": broken},
        progress=False,
    )
    out = tmp_path_factory.mktemp("bench")
    written = bench.write_outputs(result, out)
    return result, out, written


@pytest.mark.slow
def test_bench_end_to_end_outputs(bench_run):
    result, out, written = bench_run
    expected = [
        "hf_generate",
        "autoregressive",
        "self_speculative",
        "ngram",
        "recycled",
        "heads",
        "layer_skip",
        "dual_model",
        "hf_assisted",
        "prompt_lookup",
    ]
    assert list(result["methods"])[: len(expected)] == expected
    assert "broken" in result["methods"]
    if not llama_cpp_available():
        assert any("llama_cpp skipped" in note for note in result["notes"])

    for name, m in result["methods"].items():
        for key in SUMMARY_FIELDS + ("peak_rss_mb", "categories"):
            assert key in m, f"{name} lacks {key}"
        assert m["tokens_per_second"] > 0
        assert m["peak_rss_mb"] > 50
        assert set(m["categories"]) == {"coding", "math"}
        for cat in m["categories"].values():
            for key in SUMMARY_FIELDS:
                assert key in cat
    methods = result["methods"]
    assert methods["hf_generate"]["speedup_vs_hf_generate"] == pytest.approx(1.0)
    assert methods["autoregressive"]["speedup_vs_autoregressive"] == pytest.approx(1.0)
    assert methods["autoregressive"]["decode_speedup_vs_autoregressive"] == pytest.approx(1.0)

    assert methods["autoregressive"]["mean_accepted_length"] == pytest.approx(1.0)
    assert methods["autoregressive"]["acceptance_rate"] is None
    # The adaptive drafter may rightly draft nothing (it chooses from timings): >= 1 for it.
    assert methods["self_speculative"]["mean_accepted_length"] >= 1.0
    for name in ("layer_skip", "dual_model"):
        m = methods[name]
        assert m["mean_accepted_length"] > 1.0
        assert 0 < m["acceptance_rate"] <= 1
        assert m["acceptance_by_position"] and all(
            v is None or 0 <= v <= 1 for v in m["acceptance_by_position"]
        )
    assert methods["hf_generate"]["acceptance_by_position"] is None
    # Every prompt generated the same number of tokens in each honest method, EOS counted alike.
    for row in result["prompts"]:
        counts = {v["new_tokens"] for k, v in row["methods"].items() if k != "broken"}
        assert len(counts) == 1 and 1 <= counts.pop() <= TOKENS

    for key in ("cpu", "cores", "torch", "device", "dtype"):
        assert key in result["machine"]
    assert result["config"]["max_new_tokens"] == TOKENS
    assert "psutil" in result["config"]["memory_method"]

    assert {p.name for p in written} == {
        "bench.json",
        "bench.md",
        "speedup_by_category.png",
        "acceptance_by_position.png",
    }
    assert (
        json.loads((out / "bench.json").read_text())["methods"].keys() == result["methods"].keys()
    )
    md = (out / "bench.md").read_text()
    assert md == bench.format_markdown(result)
    assert "| method | tok/s | vs hf_generate |" in md
    for name in result["methods"]:
        assert f"| {name} |" in md
    for png in ("speedup_by_category.png", "acceptance_by_position.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert not list(out.glob(".*")), "a temporary file was left behind"


@pytest.mark.slow
def test_bench_reports_the_decoding_phase_on_its_own(bench_run):
    """Decode tok/s = (new tokens - 1) / (seconds - time to the first token), per prompt, for
    selfspec's methods (prefill from their stats) and transformers' (a streamer's clock) alike;
    the overall figure is the median over prompts."""
    result, _, _ = bench_run
    for name in ("autoregressive", "self_speculative", "hf_generate", "prompt_lookup"):
        rows = [p["methods"][name] for p in result["prompts"]]
        for row in rows:
            assert 0 < row["time_to_first_token"] < row["seconds"]
            expected = (row["new_tokens"] - 1) / (row["seconds"] - row["time_to_first_token"])
            # rows keep 4 decimals of seconds, hence the tolerance
            assert row["decode_tokens_per_second"] == pytest.approx(expected, rel=1e-2)
        overall = result["methods"][name]
        decode = [r["decode_tokens_per_second"] for r in rows]
        assert overall["decode_tokens_per_second"] == pytest.approx(
            statistics.median(decode), rel=1e-3
        )
        ttft = [r["time_to_first_token"] for r in rows]
        assert overall["time_to_first_token"] == pytest.approx(statistics.median(ttft), abs=1e-4)
        for cat in overall["categories"].values():
            assert cat["decode_tokens_per_second"] > 0 and cat["time_to_first_token"] > 0
    assert result["methods"]["hf_generate"]["decode_speedup_vs_hf_generate"] == pytest.approx(1.0)
    md = bench.format_markdown(result)
    assert "| decode tok/s | decode vs autoregressive |" in md
    assert "Decoding-phase speedup vs autoregressive by category" in md
    # every verify pass timed: plain decoding's are one row each, one a token after the first
    plain = result["methods"]["autoregressive"]
    emitted = sum(p["methods"]["autoregressive"]["new_tokens"] - 1 for p in result["prompts"])
    assert plain["verify_passes_by_rows"] == {1: emitted}
    spec = result["methods"]["self_speculative"]
    assert sum(spec["verify_passes_by_rows"].values()) == spec["target_passes"]
    assert "Verify passes by rows in the pass" in md


@pytest.mark.slow
def test_broken_method_reported_as_not_identical(bench_run):
    result, out, _ = bench_run
    methods = result["methods"]
    assert methods["broken"]["identical_to_baseline"] is False
    assert set(methods["broken"]["mismatched_prompts"]) == {p["id"] for p in result["prompts"]}
    for cat in methods["broken"]["categories"].values():
        assert cat["identical_to_baseline"] is False
    for name in (
        "hf_generate",
        "autoregressive",
        "self_speculative",
        "dual_model",
        "hf_assisted",
        "prompt_lookup",
    ):
        assert methods[name]["identical_to_baseline"] is True, f"{name} changed the greedy output"
    for row in result["prompts"]:
        assert row["methods"]["broken"]["identical_to_baseline"] is False
        assert (
            row["methods"]["broken"]["first_difference"]["index"]
            == row["methods"]["broken"]["new_tokens"] - 1
        )
    md = (out / "bench.md").read_text()
    assert "| broken |" in md and "**NO**" in md and "broken differs from hf_generate" in md


@pytest.mark.slow
def test_cli_bench_json_and_files(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 7, "category": "code", "turns": ["def add(a, b):"]}) + "\n"
    )
    code = main(
        [
            "bench",
            "--model",
            "smollm2-135m",
            # transformers' own arithmetic, so identity to hf_generate is exact (auto may pick
            # gguf-q8, whose 8-bit activations can part from it)
            "--speed",
            "torch",
            "--skip-attention",
            "12,14",
            "--prompts",
            str(prompts),
            "--methods",
            "autoregressive,self_speculative",
            "--max-new-tokens",
            "6",
            "--no-chat",
            "--out",
            str(tmp_path / "out"),
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["methods"]) == ["hf_generate", "autoregressive", "self_speculative"]
    assert all(m["identical_to_baseline"] is True for m in data["methods"].values())
    assert data["config"]["chat_template"] is False and data["config"]["prompt_spec"] == str(
        prompts
    )
    assert data["config"]["plan"]["skip_attention"] == [12, 14]
    assert any("hf_generate added" in note for note in data["notes"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "acceptance_by_position.png",
        "bench.json",
        "bench.md",
        "speedup_by_category.png",
    ]


@pytest.mark.slow
def test_a_sampled_bench_records_its_sampling_and_compares_no_outputs(smollm2):
    """At a temperature each method draws its randomness its own way: speeds only, the same seed
    for every generation, and no identity claimed either way."""
    from selfspec.runtime.sampling import Sampling

    sampling = Sampling(temperature=0.8, top_p=0.95)

    def sampled(prompts: list[str], methods: list[str]) -> dict:
        return bench.run_bench(
            smollm2, prompts, methods, max_new_tokens=12, chat=False, progress=False,
            baseline=False, sampling=sampling, seed=3,
        )  # fmt: skip

    result = sampled(
        ["def add(a, b):", "The capital of France is"], ["autoregressive", "self_speculative"]
    )
    assert result["config"]["sampling"] == {
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 0,
        "seed": 3,
    }
    for method in result["methods"].values():
        assert (
            method["identical_to_baseline"] is None and "identical_to_autoregressive" not in method
        )
        assert method["tokens_per_second"] > 0
    md = bench.format_markdown(result)
    assert "sampled at temperature 0.8" in md and "**NO**" not in md
    again = sampled(["def add(a, b):"], ["autoregressive"])  # the same seed: the same draws
    first = result["prompts"][0]["methods"]["autoregressive"]["new_tokens"]
    assert again["prompts"][0]["methods"]["autoregressive"]["new_tokens"] == first


def test_cli_rejects_unknown_method(capsys):
    assert main(["bench", "--model", "smollm2-135m", "--methods", "autoregressive,warp_drive"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown method(s) warp_drive")


@pytest.mark.parametrize(
    "flag,value", [("--repeats", "0"), ("--limit", "0"), ("--max-new-tokens", "0")]
)
def test_cli_rejects_bad_counts(flag, value, capsys):
    assert main(["bench", flag, value]) == 2
    assert capsys.readouterr().err.startswith(f"error: {flag} must be at least 1")


@pytest.mark.slow
def test_explicit_dual_model_without_draft_is_an_error(smollm2):
    from selfspec.errors import SelfSpecError

    with pytest.raises(SelfSpecError, match="cannot run dual_model: no draft model"):
        bench.run_bench(
            smollm2,
            ["Hello"],
            ["dual_model"],
            plan=light_plan(smollm2),
            explicit=True,
            progress=False,
        )
    # Not asked for by name: skipped with a note instead.
    result = bench.run_bench(
        smollm2, ["Hello"], plan=light_plan(smollm2), max_new_tokens=2, progress=False, chat=False
    )
    assert "dual_model" not in result["methods"] and "hf_assisted" not in result["methods"]
    assert any(note.startswith("dual_model skipped") for note in result["notes"])


class FakeLlama:
    """Stands in for llama_cpp.Llama: 'decodes' a fixed sequence, so only the plumbing is tested."""

    instances = []

    def __init__(self, model_path, n_threads, n_ctx, verbose):
        self.kwargs = dict(model_path=model_path, n_threads=n_threads, n_ctx=n_ctx)
        FakeLlama.instances.append(self)

    def token_eos(self):
        return 99

    def reset(self):
        pass

    def generate(self, tokens, **kwargs):
        assert kwargs["top_k"] == 1 and kwargs["temp"] == 0.0
        yield from [5, 6, 7, 8, 9, 10, 11]


@pytest.mark.slow
def test_llama_cpp_method_plumbing(smollm2, tmp_path, monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setattr(bench.run, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(bench.run, "llama_cpp_failure", lambda name, threads: None)
    monkeypatch.setattr(bench.methods, "gguf_path_for", lambda name: tmp_path / f"{name}.gguf")
    result = bench.run_bench(
        smollm2,
        ["Hello"],
        ["hf_generate", "llama_cpp"],
        max_new_tokens=4,
        chat=False,
        explicit=True,
        progress=False,
    )
    m = result["methods"]["llama_cpp"]
    assert (
        m["identical_to_baseline"] == "n/a"
        and m["categories"]["all"]["identical_to_baseline"] == "n/a"
    )
    assert result["prompts"][0]["methods"]["llama_cpp"]["new_tokens"] == 4
    assert (
        FakeLlama.instances[-1].kwargs["n_threads"]
        == result["config"]["threads"]
        == torch.get_num_threads()
    )
    assert FakeLlama.instances[-1].kwargs["model_path"].endswith("smollm2-135m.gguf")
    assert "| llama_cpp |" in bench.format_markdown(result) and "| n/a |" in bench.format_markdown(
        result
    )


@pytest.mark.slow
def test_draft_model_with_another_tokenizer_fails_before_running(smollm2):
    from selfspec.errors import SelfSpecError

    def must_not_run(ctx, prompt_ids):
        raise AssertionError("a method ran before the draft model was checked")

    with pytest.raises(SelfSpecError, match="does not share smollm2-135m's tokenizer"):
        bench.run_bench(
            smollm2,
            ["Hello"],
            ["dual_model", "early"],
            draft="qwen2.5-coder-0.5b",
            max_new_tokens=2,
            custom_methods={"early": must_not_run},
            explicit=True,
            progress=False,
        )


def test_a_method_whose_library_crashes_is_reported_not_run(monkeypatch):
    """llama.cpp is tried in a child first: a child that dies of a signal (as some AMX builds of
    llama-cpp-python do on some VMs) is named, and the bench skips the method with that reason, or
    refuses in one line when the method was asked for, instead of dying with it."""
    import sys

    from selfspec.errors import SelfSpecError

    name = "qwen2.5-coder-0.5b"
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    assert bench.methods.child_failure(crash) == "it died of SIGILL"
    assert bench.methods.child_failure([sys.executable, "-c", "pass"]) is None
    failing = [sys.executable, "-c", "raise SystemExit('no model here')"]
    assert bench.methods.child_failure(failing) == "no model here"

    # the real probe, its child made to die as those builds do
    monkeypatch.setattr(bench.run, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(bench.methods, "gguf_path_for", lambda name: f"{name}.gguf")
    monkeypatch.setattr(bench.methods, "LLAMA_CPP_PROBE", crash[2])
    chosen, notes = bench.run.resolve_methods(
        ["autoregressive", "llama_cpp"], plan=None, draft=None, model_name=name
    )
    assert chosen == ["hf_generate", "autoregressive"]
    assert any("llama_cpp skipped" in n and "SIGILL" in n and "GGML_NATIVE=OFF" in n for n in notes)
    with pytest.raises(SelfSpecError, match="cannot run llama_cpp: .*SIGILL"):
        bench.run.resolve_methods(
            ["llama_cpp"], plan=None, draft=None, model_name=name, explicit=True
        )


def test_llama_server_methods_need_a_built_server(tmp_path, monkeypatch):
    """Without a llama-server build, a bench asked for llama.cpp's speculation says in one line
    how to build it; without --methods it never runs them (one server each, opt-in)."""
    from selfspec.errors import SelfSpecError

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SELFSPEC_LLAMA_SERVER", raising=False)
    missing = "cannot run llama_server_ngram_mod: llama-server is not built: run `python -m"
    with pytest.raises(SelfSpecError, match=missing):
        bench.run.resolve_methods(
            ["llama_server_ngram_mod"], plan=None, draft=None, model_name="smollm2-135m",
            explicit=True,
        )  # fmt: skip
    assert not any(m.startswith("llama_server") for m in bench.methods.ALL_METHODS)


@pytest.mark.skipif(
    bench.llama_server.find_binary() is None,
    reason="llama-server is not built (python -m selfspec.bench.build_llama_server)",
)
def test_llama_server_methods_generate_for_real(smollm2):
    """llama.cpp's server, started for real on the model's .gguf: plain and ngram-mod speculation
    each generate the asked number of tokens, the speculation's equality with llama.cpp's plain
    decoding is reported, and the servers are gone afterwards."""
    prompts = load_prompts("spec-bench:coding,summarization", limit=1)
    methods = ["autoregressive", "llama_server", "llama_server_ngram_mod"]
    result = bench.run_bench(
        smollm2, prompts, methods, max_new_tokens=TOKENS, baseline=False, progress=False
    )
    for name in methods[1:]:
        m = result["methods"][name]
        assert m["new_tokens"] > 0 and m["decode_tokens_per_second"] > 0
        assert m["peak_rss_mb"] > 50  # the server's own memory, not this process's
    same = result["methods"]["llama_server_ngram_mod"]["identical_to_llama_server"]
    assert isinstance(same, bool)
    assert "Identical to llama.cpp's own plain decoding" in bench.format_markdown(result)
    import psutil

    children = [p.name() for p in psutil.Process().children(recursive=True)]
    assert "llama-server" not in children
