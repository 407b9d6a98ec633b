"""Heads that learn from use (selfspec.training.history): the record is bounded and survives a
line a crash cut short; recording changes no output (CLI and server, for real); heads trained on
it, from zeros or from the heads a model has, keep greedy output identical to plain decoding and
count what they learned from."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from live_server import ENV, MODEL, openai_client, serving

from selfspec.drafters.heads import DraftHeads
from selfspec.drafters.recycled import RecycledTable
from selfspec.errors import SelfSpecError
from selfspec.training.heads import train_heads
from selfspec.training.history import PROMPT_TAIL, History

VOCAB = 49152  # smollm2-135m's token ids

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about rain.\n",
    "import numpy as np\n\n",
    "Q: What is 12 times 7?\nA:",
    "Once upon a time, in a small village,",
    "SELECT name FROM users WHERE",
    "Three tips for a job interview:\n1.",
]


def test_the_history_is_bounded_and_skips_a_line_a_crash_cut_short(tmp_path):
    history = History(tmp_path / "m.jsonl", max_tokens=100)
    held = [history.record(list(range(PROMPT_TAIL + 88)), [i, i + 1, i + 2, i + 3, i + 4])
            for i in range(30)]  # fmt: skip
    assert held[:3] == [5, 10, 15]  # what it holds after each record, the first counted once
    assert history.record([1, 2], [3]) == history.tokens()  # one token teaches nothing: not kept
    entries = history.entries()
    assert 50 <= history.tokens() <= 100  # trimmed to the newest, never past the bound
    assert entries[-1] == (list(range(88, PROMPT_TAIL + 88)), [29, 30, 31, 32, 33])
    with open(history.path, "a") as fh:
        fh.write('{"prompt": [1, 2], "answ')  # a crash in the middle of a line
    assert history.entries() == entries
    history.record([7], [8, 9])
    assert history.entries() == entries + [([7], [8, 9])]  # not glued to the cut line


def test_training_from_a_history_without_two_generations_is_a_one_line_error(smollm2, tmp_path):
    history = History(tmp_path / "m.jsonl")
    history.record([1, 2], [3, 4])
    with pytest.raises(SelfSpecError, match="1 generation.*--learn"):
        train_heads(smollm2, tmp_path / "h.safetensors", tmp_path, history=history)


@pytest.fixture(scope="module")
def used(smollm2, tmp_path_factory):
    """A history of the small model's greedy answers to PROMPTS, as `generate --learn` keeps."""
    history = History(tmp_path_factory.mktemp("history") / "smollm2-135m.jsonl")
    for prompt in PROMPTS:
        ids = smollm2.encode(prompt)
        history.record(ids, smollm2.generate(ids, None, max_new_tokens=64).token_ids)
    return history


def test_heads_learn_from_use_from_zeros_then_from_the_heads_they_have(smollm2, used, tmp_path):
    fresh = train_heads(smollm2, tmp_path / "a.safetensors", tmp_path, epochs=3, history=used)
    rows = fresh.info["rows"]  # the answer tokens trained on (the held-out ones are not)
    assert 0 < rows < sum(len(a) for _, a in used.entries())
    assert fresh.info["learned_tokens"] == fresh.info["learned_from_use"] == rows
    assert fresh.info["heldout_top1"] > 0.0
    more = train_heads(
        smollm2, tmp_path / "b.safetensors", tmp_path, epochs=1, history=used, start=fresh
    )
    assert more.info["learned_tokens"] == more.info["learned_from_use"] == 2 * rows
    # what the heads started from still counts among the ids they score
    assert set(fresh.frequent[:64].tolist()) <= set(more.frequent.tolist())
    loaded = DraftHeads.load(tmp_path / "b.safetensors", smollm2.loaded.model.config.hidden_size)
    assert f"{2 * rows:,} from use" in loaded.describe()
    drafted = 0
    for prompt in ("def fibonacci(n):", "Dear team,\n\nI", "The three primary colors are"):
        plain = smollm2.generate(prompt, None, max_new_tokens=40)
        drafter = smollm2.self_drafter(heads=loaded)
        config = smollm2.decode_config(drafter, max_new_tokens=40, fallback=False)
        result = smollm2.generate(prompt, drafter, config=config)
        assert result.token_ids == plain.token_ids, prompt
        drafted += result.stats.sources.get("heads", (0, 0, 0))[1]
    assert drafted > 0


def learning_env(folder) -> dict:
    return dict(ENV, SELFSPEC_HISTORY=str(folder))


@pytest.mark.slow  # three CLI runs
def test_generate_learn_records_the_tokens_and_changes_nothing(tmp_path):
    command = [sys.executable, "-m", "selfspec.cli", "generate", "def add(a, b):", "--json"]
    command += ["--model", "smollm2-135m", "--max-new-tokens", "24"]

    def run(*extra):
        done = subprocess.run(
            command + list(extra), env=learning_env(tmp_path), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    plain, learned = run(), run("--learn")
    assert learned["token_ids"] == plain["token_ids"] and learned["text"] == plain["text"]
    assert learned["history_tokens"] == len(plain["token_ids"])
    (entry,) = History(tmp_path / "smollm2-135m.jsonl").entries()
    assert entry[1] == plain["token_ids"]
    table = tmp_path / "smollm2-135m.recycled.safetensors"
    assert len(RecycledTable.load(table, VOCAB)) > 0  # the recycled drafts' table, kept
    again = run("--learn")  # drafting from the table the first run kept
    assert again["history_tokens"] == 2 * len(plain["token_ids"])
    assert again["token_ids"] == plain["token_ids"]


@pytest.fixture(scope="module")
def learning_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("learned")
    env = learning_env(folder)
    for server in serving(tmp_path_factory, "--learn", "--max-batch", "4", env=env):
        yield server, History(folder / "smollm2-135m.jsonl")


@pytest.mark.slow  # a live server
def test_serve_learn_records_every_finished_request(learning_server):
    server, history = learning_server
    client = openai_client(server)
    tokens = 0
    for prompt in PROMPTS[:3]:
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=False
        )
        tokens += reply.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens += [chunk for chunk in stream][-1].usage.completion_tokens
    entries = history.entries()
    assert len(entries) == 4 and sum(len(a) for _, a in entries) == tokens
    assert "recording use in" in server["log"].read_text()


@pytest.mark.slow  # a live server
def test_serve_learn_keeps_the_recycled_table_when_it_stops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kept")
    for server in serving(tmp_path_factory, "--learn", env=learning_env(folder)):
        reply = openai_client(server).completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0
        )
        assert reply.usage.completion_tokens > 0
        assert not (folder / "smollm2-135m.recycled.safetensors").exists()  # idle writes wait
        server["process"].send_signal(signal.SIGTERM)
        assert server["process"].wait(timeout=60) == 0, server["log"].read_text()
    table = RecycledTable.load(folder / "smollm2-135m.recycled.safetensors", VOCAB)
    assert len(table) > 0  # written as the server stopped


@pytest.mark.slow  # a live server
def test_a_history_that_cannot_be_written_ends_the_record_not_the_server(tmp_path_factory):
    blocker = tmp_path_factory.mktemp("blocked") / "a-file"
    blocker.write_text("not a folder")  # the history folder cannot be made under a file
    env = learning_env(blocker / "history")
    for server in serving(tmp_path_factory, "--learn", env=env):
        client = openai_client(server)
        for _ in range(2):
            reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8)
            assert reply.usage.completion_tokens > 0
        assert "not recording use any more" in server["log"].read_text()
