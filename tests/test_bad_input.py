"""Bad input, tried systematically: each row an input and the one-line error it must get, for the
command line, the Python API and the plan loader; then a property-based test of the plan loader.

A row passes when the error is a SelfSpecError (exit status 2 on the command line) whose message
contains the expected text, fits on one line, and no traceback is printed."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selfspec.errors import SelfSpecError
from selfspec.runtime.plan import load_plan, plan_from_dict

SHIPPED = Path(__file__).parents[1] / "selfspec" / "plans" / "smollm2-135m" / "plan.json"
VALID = json.loads(SHIPPED.read_text())
LONG_TEXT = "word " * 9000  # past smollm2-135m's 8192-token window
M = ["--model", "smollm2-135m"]


def _cli(argv: list[str], stdin: bytes | None = None) -> tuple[int, str]:
    """Run the real command line in a child process: (exit status, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "selfspec.cli", *argv],
        input=stdin,
        capture_output=True,
        timeout=300,
        # no record of use: rows about a missing one find none, whatever this machine learnt
        env={**os.environ, "SELFSPEC_NO_PROGRESS": "1", "SELFSPEC_HISTORY": "/nonexistent/history"},
    )
    return done.returncode, done.stderr.decode("utf-8", "replace")


def _text_file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _plan_file(tmp_path: Path, change) -> str:
    data = copy.deepcopy(VALID)
    change(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


CLI_ROWS = [
    # (id, argv (a callable of tmp_path for files), stdin, expected text)
    ("empty prompt", ["generate", "", *M], None, "the prompt is empty"),
    (
        "negative tokens",
        ["generate", "hi", "--max-new-tokens", "-5", *M],
        None,
        "--max-new-tokens must be at least 1",
    ),
    (
        "huge tokens",
        ["generate", "hi", "--max-new-tokens", "100000000", *M],
        None,
        "context window",
    ),
    (
        "tokens not a number",
        ["generate", "hi", "--max-new-tokens", "many", *M],
        None,
        "invalid int value: 'many'",
    ),
    (
        "negative temperature",
        ["generate", "hi", "--temperature", "-1", *M],
        None,
        "--temperature must be",
    ),
    ("top-p past 1", ["generate", "hi", "--top-p", "1.5", *M], None, "--top-p must be"),
    ("layer out of range", ["generate", "hi", "--skip-attention", "99", *M], None, "layer(s) [99]"),
    (
        "layers not numbers",
        ["generate", "hi", "--skip-attention", "a,b", *M],
        None,
        "--skip-attention",
    ),
    ("unknown model", ["generate", "hi", "--model", "llama-9000"], None, "unknown model"),
    (
        "missing plan",
        ["generate", "hi", "--plan", "/no/such/plan.json", *M],
        None,
        "/no/such/plan.json",
    ),
    (
        "plan of wrong types",
        lambda t: [
            "generate",
            "hi",
            *M,
            "--plan",
            _plan_file(t, lambda d: d.update(skip_attention="3,4")),
        ],
        None,
        "'skip_attention' must be a list",
    ),
    (
        "plan layers out of range",
        lambda t: [
            "generate",
            "hi",
            *M,
            "--plan",
            _plan_file(t, lambda d: d.update(skip_mlp=[-1, 45])),
        ],
        None,
        "names layer(s) [-1, 45]",
    ),
    ("non-UTF-8 prompt on stdin", ["generate", "-", *M], b"def f():\xff\xfe\n", "not UTF-8"),
    ("prompt longer than the window", ["generate", "-", *M], LONG_TEXT.encode(), "context window"),
    (
        "malformed storage URL",
        ["search", *M, "--storage", "not a url"],
        None,
        "is not a storage URL",
    ),
    (
        "unreachable storage",
        ["search", *M, "--storage", "postgresql://u:pw@127.0.0.1:1/db"],
        None,
        "cannot open Optuna storage 'postgresql://u:***@127.0.0.1:1/db'",
    ),
    ("negative trials", ["search", *M, "--trials", "-3"], None, "--trials must be at least 1"),
    (
        "huge search tokens",
        ["search", *M, "--tokens", "100000000", "--trials", "1"],
        None,
        "context window",
    ),
    ("bench limit 0", ["bench", *M, "--limit", "0"], None, "--limit must be at least 1"),
    ("bench unknown method", ["bench", *M, "--methods", "warp_drive"], None, "warp_drive"),
    (
        "bench learned without a kept table",
        ["bench", *M, "--learned", "--methods", "recycled"],
        None,
        "no recycled drafts' table is kept for smollm2-135m yet",
    ),
    ("bench negative temperature", ["bench", *M, "--temperature", "-1"], None, "--temperature"),
    (
        "bench sampling with transformers' methods",
        ["bench", *M, "--temperature", "0.7", "--limit", "1", "--methods", "hf_generate"],
        None,
        "hf_generate cannot sample alongside selfspec's methods",
    ),
    ("profile no repeats", ["profile", *M, "--repeats", "0"], None, "--repeats"),
    ("profile rows past 64", ["profile", *M, "--rows", "1,128"], None, "--rows: give pass sizes"),
    ("profile rows not numbers", ["profile", *M, "--rows", "a"], None, "not a number of tokens"),
    (
        "train-heads no questions",
        ["train-heads", *M, "--questions", "0"],
        None,
        "--questions must be at least 1",
    ),
    (
        "train-heads soft past 1",
        ["train-heads", *M, "--soft", "2"],
        None,
        "--soft must be between 0 and 1",
    ),
    (
        "train-heads budget not positive",
        ["train-heads", *M, "--budget", "0"],
        None,
        "--budget must be a positive number of minutes",
    ),
    (
        "train-heads no history",
        lambda t: ["train-heads", *M, "--from-history", str(t / "absent.jsonl")],
        None,
        "no history for smollm2-135m at",
    ),
    (
        "train-heads fresh alone",
        ["train-heads", *M, "--fresh"],
        None,
        "--fresh goes with --from-history",
    ),
    (
        "train-heads temperature past 2",
        ["train-heads", *M, "--temperature", "3"],
        None,
        "--temperature must be between 0 and 2",
    ),
    (
        "train-heads no texts file",
        lambda t: ["train-heads", *M, "--texts", str(t / "absent.jsonl")],
        None,
        "no texts file at",
    ),
    (
        "train-heads texts not JSON",
        lambda t: [
            "train-heads",
            *M,
            "--texts",
            _text_file(t / "t.jsonl", '{"text": "a b c"}\nhi\n'),
        ],
        None,
        "line 2 is not JSON",
    ),
    (
        "train-heads texts of no known shape",
        lambda t: ["train-heads", *M, "--texts", _text_file(t / "t.jsonl", '{"question": "a"}\n')],
        None,
        "line 1 has none of the known shapes",
    ),
    (
        "train-heads texts .xz not xz",
        lambda t: ["train-heads", *M, "--texts", _text_file(t / "t.jsonl.xz", '{"text": "a b"}\n')],
        None,
        "is not a whole .xz file",
    ),
    (
        "train-heads one text",
        lambda t: [
            "train-heads",
            *M,
            "--texts",
            _text_file(t / "t.jsonl", '{"text": "a b c d"}\n'),
        ],
        None,
        "1 usable text(s) in",
    ),
    (
        "train-heads texts and history",
        ["train-heads", *M, "--texts", "t.jsonl", "--from-history"],
        None,
        "--texts and --from-history are two sources",
    ),
    (
        "train-heads temperature from history",
        ["train-heads", *M, "--temperature", "0.7", "--from-history"],
        None,
        "--temperature is for answers train-heads writes",
    ),
    (
        "missing heads file",
        lambda t: ["generate", "hi", *M, "--heads", str(t / "absent.safetensors")],
        None,
        "does not exist",
    ),
    (
        "bench missing heads file",
        lambda t: ["bench", *M, "--heads", str(t / "absent.safetensors"), "--methods", "heads"],
        None,
        "does not exist",
    ),
    (
        "profile missing heads file",
        lambda t: ["profile", *M, "--heads", str(t / "absent.safetensors")],
        None,
        "does not exist",
    ),
    (
        "unknown option",
        ["generate", "hi", "--tokens", "5"],
        None,
        "unrecognized arguments: --tokens 5",
    ),
    (
        "serve with a zero body limit",
        ["serve", *M, "--max-body-kb", "0"],
        None,
        "--max-body-kb must be at least 1",
    ),
    (
        "serve with no idle time",
        ["serve", *M, "--idle-timeout", "0"],
        None,
        "--idle-timeout must be positive",
    ),
    (
        "check a missing file",
        lambda t: ["models", "--check", str(t / "absent.gguf")],
        None,
        "does not exist; pass a .gguf file or a model folder",
    ),
    (
        "check a file that is not GGUF",
        lambda t: ["models", "--check", _text_file(t / "notes.gguf", "not a model")],
        None,
        "no GGUF magic bytes",
    ),
    (
        "non-UTF-8 prompt argument",
        ["generate", b"caf\xe9".decode("utf-8", "surrogateescape"), *M],
        None,
        "not UTF-8",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, argv, stdin, expected", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli_bad_input(name, argv, stdin, expected, tmp_path):
    argv = argv(tmp_path) if callable(argv) else argv
    code, err = _cli(argv, stdin)
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0], err


# ------------------------------------------------------------------------------ Python API


def _api_rows():
    from selfspec.drafters.layerskip import SelfSkipDrafter  # noqa: F401  (import check only)

    return [
        ("prompt not text", lambda e: e.generate(123, max_new_tokens=4), "prompt"),
        ("empty prompt", lambda e: e.generate("", max_new_tokens=4), "prompt is empty"),
        ("negative tokens", lambda e: e.generate("hi", max_new_tokens=-1), "max_new_tokens"),
        ("tokens not a number", lambda e: e.generate("hi", max_new_tokens="8"), "max_new_tokens"),
        ("huge tokens", lambda e: e.generate("hi", max_new_tokens=10**8), "context window"),
        (
            "prompt past the window",
            lambda e: e.generate(LONG_TEXT, max_new_tokens=4),
            "context window",
        ),
        (
            "token ids out of vocabulary",
            lambda e: e.generate([10**9], max_new_tokens=4),
            "vocabulary",
        ),
        ("layer out of range", lambda e: e.make_plan([99], []), "layer(s) [99]"),
        ("layer of a wrong type", lambda e: e.make_plan(["3"], []), "layer"),
    ]


API_IDS = [r[0] for r in _api_rows()]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(API_IDS)), ids=API_IDS)
def test_python_api_bad_input(smollm2, index):
    _, call, expected = _api_rows()[index]
    with pytest.raises(SelfSpecError) as caught:
        call(smollm2)
    message = str(caught.value)
    assert expected in message and "\n" not in message.strip(), message


# ---------------------------------------------------------------------------- plan loader

PLAN_ROWS = [
    ("not JSON", b"{ nope", "is not valid JSON"),
    ("not UTF-8", b"\xff\xfe{}", "not UTF-8"),
    ("empty file", b"", "is not valid JSON"),
    ("a list", b"[1, 2, 3]", "JSON object"),
    ("no model", json.dumps({k: v for k, v in VALID.items() if k != "model"}).encode(), "model"),
    ("layers as text", json.dumps({**VALID, "skip_attention": "1,2"}).encode(), "must be a list"),
    ("bool layers", json.dumps({**VALID, "skip_mlp": [True]}).encode(), "must be a list"),
    ("layer past the model", json.dumps({**VALID, "skip_mlp": [30]}).encode(), "layer(s) [30]"),
    ("duplicate layers", json.dumps({**VALID, "skip_mlp": [3, 3]}).encode(), "more than once"),
    ("future format", json.dumps({**VALID, "format_version": 99}).encode(), "format_version"),
    (
        "negative draft",
        json.dumps({**VALID, "policy": {**VALID["policy"], "max_draft_tokens": -2}}).encode(),
        "max_draft_tokens",
    ),
    (
        "threshold of a wrong type",
        json.dumps(
            {**VALID, "policy": {**VALID["policy"], "confidence_threshold": "high"}}
        ).encode(),
        "confidence_threshold",
    ),
]


@pytest.mark.parametrize("name, content, expected", PLAN_ROWS, ids=[r[0] for r in PLAN_ROWS])
def test_plan_loader_bad_input(name, content, expected, tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(SelfSpecError) as caught:
        load_plan(path)
    message = str(caught.value)
    assert expected in message, message


def test_missing_plan_file_is_a_clear_error(tmp_path):
    with pytest.raises(SelfSpecError, match="does not exist"):
        load_plan(tmp_path / "nope.json")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
PLAN_KEYS = st.sampled_from(
    ["format_version", "model", "skip_attention", "skip_mlp", "policy", "provenance"]
)
POLICY_KEYS = st.sampled_from(sorted(VALID["policy"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(PLAN_KEYS, JSON_VALUES), max_size=3),
    policy_edits=st.lists(st.tuples(POLICY_KEYS, JSON_VALUES), max_size=3),
    drops=st.lists(PLAN_KEYS, max_size=2),
)
def test_plan_loader_property(edits, policy_edits, drops):
    """Whatever a plan file holds, loading it gives a plan whose fields are valid, or a
    SelfSpecError; never another exception."""
    data = copy.deepcopy(VALID)
    for key, value in edits:
        data[key] = value
    if isinstance(data.get("policy"), dict):
        for key, value in policy_edits:
            data["policy"][key] = value
    for key in drops:
        data.pop(key, None)
    try:
        plan = plan_from_dict(data)
    except SelfSpecError as exc:
        assert str(exc).strip()
        return
    layers = plan.model.num_layers
    assert isinstance(layers, int) and layers >= 1
    for group in (plan.skip_attention, plan.skip_mlp):
        assert all(type(i) is int and 0 <= i < layers for i in group)
        assert len(set(group)) == len(group)
    assert type(plan.policy.max_draft_tokens) is int and plan.policy.max_draft_tokens >= 1
    assert 0.0 <= plan.policy.confidence_threshold <= 1.0
    json.dumps(plan.to_dict())  # and it can be written back
