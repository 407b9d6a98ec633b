"""`selfspec serve` for real: the server starts on a loopback port in a child process and the real
`openai` client (or plain HTTP, for requests that client cannot send) talks to it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from live_server import ENV, MODEL, call, openai_client, read_metrics, serving

pytestmark = pytest.mark.slow
QUEUE = 2
BATCH = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory, "--queue-size", str(QUEUE), "--max-batch", str(BATCH))


def _generate(*args: str) -> str:
    """What `selfspec generate` prints on stdout, without the newline it adds at the end."""
    command = [sys.executable, "-m", "selfspec.cli", "generate", *args, "--model", MODEL]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    return done.stdout[:-1]


def _post(server, path: str, body) -> tuple[int, dict]:
    return call(
        server, "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode()
    )


def _chat(client, prompt: str, tokens: int, stream: bool = False, **extra):
    messages = [{"role": "user", "content": prompt}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=tokens,
        stream=stream,
        **extra,
    )
    if not stream:
        return reply
    return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)


def test_greedy_chat_is_what_generate_prints(server):
    """The same text, the same length and the same reason to stop. (Whether the answer ends
    before 32 tokens depends on the machine: on an AVX2-only EPYC it ended after 25.)"""
    prompt = "Write a haiku about the sea."
    expected = json.loads(_generate("--chat", prompt, "--max-new-tokens", "32", "--json"))
    client = openai_client(server)
    reply = _chat(client, prompt, 32)
    assert reply.choices[0].message.content == expected["text"]
    length = expected["stop_reason"] == "max_new_tokens"
    assert reply.choices[0].finish_reason == ("length" if length else "stop")
    assert reply.usage.completion_tokens == expected["new_tokens"]
    assert _chat(client, prompt, 32, stream=True) == expected["text"]
    short = _chat(client, prompt, 8)  # every answer of this prompt runs past 8 tokens
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 8
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_text_completion_and_usage(server):
    expected = _generate("def fibonacci(n):", "--max-new-tokens", "24")
    reply = openai_client(server).completions.create(
        model=MODEL, prompt="def fibonacci(n):", max_tokens=24, temperature=0
    )
    assert reply.choices[0].text == expected
    from transformers import AutoTokenizer

    from selfspec.loading.sources import ensure_bundled

    tokenizer = AutoTokenizer.from_pretrained(ensure_bundled(MODEL))
    assert reply.usage.prompt_tokens == len(tokenizer("def fibonacci(n):")["input_ids"])
    assert reply.usage.completion_tokens == 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24


def test_a_later_turn_reads_only_what_the_prefix_cache_lacks(server):
    """The second turn of a conversation starts from the first turn's keys and values (its
    prompt and answer): the usage block and /metrics count them, and the answer is the one a
    prefill of the whole conversation gives."""
    from selfspec.engine import Engine

    client = openai_client(server)
    messages = [{"role": "user", "content": "Name a prime number."}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    before = read_metrics(server)
    later = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16
    )
    cached = later.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached < later.usage.prompt_tokens
    after = read_metrics(server)
    assert after["prompt_tokens_cached_total"] - before["prompt_tokens_cached_total"] == cached
    assert after["prefix_cache_bytes"] > 0 and after["prefix_cache_evictions_total"] == 0
    engine = Engine.load(MODEL)
    fresh = engine.generate(engine.encode_messages(messages), max_new_tokens=16)
    assert later.choices[0].message.content == fresh.text


def test_each_response_carries_its_own_speculation_statistics(server):
    """usage.selfspec, in whole answers and in a stream's last chunk, through the real client
    (which keeps fields it does not know as extras). (The drafter learns across requests, so the
    same prompt twice need not take the same rounds.)"""
    client = openai_client(server)
    prompt = "List the numbers from 1 to 30, one per line."
    reply = _chat(client, prompt, 48)
    _check_speculation(reply.usage)
    messages = [{"role": "user", "content": prompt}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=48, stream=True
        )
    )
    _check_speculation(chunks[-1].usage)
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def _check_speculation(usage) -> None:
    stats = usage.model_extra["selfspec"]
    assert stats["target_passes"] >= 1 and 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]
    sources = stats["by_draft_source"].values()
    assert sum(s["drafted"] for s in sources) == stats["drafted_tokens"]
    assert sum(s["accepted"] for s in sources) == stats["accepted_tokens"]
    # every pass gives one token besides the drafts it keeps (the last pass's may be cut)
    assert usage.completion_tokens <= stats["target_passes"] + stats["accepted_tokens"]
    passes = stats["target_passes"] - 1  # after the prefill
    expected = (usage.completion_tokens - 1) / passes if passes else 0.0
    assert stats["mean_accepted_length"] == pytest.approx(expected, abs=1e-4)


def test_stop_strings_end_the_text_before_them(server):
    client = openai_client(server)
    whole = _chat(client, "Count from 1 to 20, separated by commas.", 48).choices[0].message
    assert "5" in whole.content
    cut = _chat(client, "Count from 1 to 20, separated by commas.", 48, stop=["5"])
    text = cut.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop"
    assert text == whole.content[: whole.content.index("5")]
    streamed = _chat(client, "Count from 1 to 20, separated by commas.", 48, True, stop=["5"])
    assert streamed == text


def test_concurrent_clients_get_their_solo_answers(server):
    """Three clients at once, with room for two in the batch and two waiting: each gets the
    answer it got alone. (Arriving while the engine still tidies up the previous request, the
    third can find two waiting and get 503; it retries, as the error asks.)"""
    from openai import InternalServerError

    client = openai_client(server)
    prompts = ["Name three colours.", "What is 2 + 2?", "Say hello in French."]
    solo = {p: _chat(client, p, 24).choices[0].message.content for p in prompts}
    before = read_metrics(server)
    together: dict = {}

    def ask(prompt):
        for attempt in range(20):
            try:
                stream = prompt.startswith("W")
                together[prompt] = _chat(openai_client(server), prompt, 24, stream=stream)
                return
            except InternalServerError as busy:
                assert busy.status_code == 503 and attempt < 19, busy
                time.sleep(0.2)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    answers = {
        p: a if isinstance(a, str) else a.choices[0].message.content for p, a in together.items()
    }
    assert answers == solo
    spent = {name: value - before[name] for name, value in read_metrics(server).items()}
    assert spent["requests_total"] == len(prompts)
    # --max-batch holds (a pass's rows may be more: drafts, prompt chunks)
    assert spent["batch_requests_total"] <= BATCH * spent["batch_steps_total"]


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "smollm2-135m", "messages": [', 400, "not valid JSON"),
    (
        "unknown model",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model 'gpt-9' is not served here",
    ),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages is empty"),
    (
        "max_tokens 0",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        400,
        "max_tokens must be at least 1",
    ),
    (
        "max_tokens past the window",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
        400,
        "exceed the model's context window of 8192",
    ),
    (
        "prompt past the window",
        {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]},
        400,
        "more than the model's context window of 8192",
    ),
    (
        "two choices",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2},
        400,
        "n:",
    ),
    (
        "temperature too high",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7},
        400,
        "temperature:",
    ),
    ("no messages field", {"model": MODEL}, 400, "messages: Field required"),
]


@pytest.mark.parametrize(
    "name, body, status, message", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS]
)
def test_bad_requests_get_an_openai_error(server, name, body, status, message):
    code, reply = _post(server, "/v1/chat/completions", body)
    assert code == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert message in reply["error"]["message"], reply


def _open_stream(server, tokens: int = 2000):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        server["base"] + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    stream = urllib.request.urlopen(request, timeout=60)
    assert stream.readline().startswith(b"data: ")
    return stream


def _wait_for(server, gauge: str, value: int) -> None:
    deadline = time.monotonic() + 60
    while read_metrics(server)[gauge] < value:
        assert time.monotonic() < deadline, f"{gauge} never reached {value}: {read_metrics(server)}"
        time.sleep(0.1)


def test_full_queue_is_503_and_a_gone_client_frees_its_slot(server):
    before = read_metrics(server)
    streams = [_open_stream(server) for _ in range(BATCH)]
    _wait_for(server, "requests_running", BATCH)  # the batch is full: the next ones wait
    short = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    waiting = [
        threading.Thread(target=_post, args=(server, "/v1/chat/completions", short))
        for _ in range(QUEUE)
    ]
    for t in waiting:
        t.start()
    _wait_for(server, "queue_depth", QUEUE)
    code, reply = _post(server, "/v1/chat/completions", short)
    assert code == 503 and reply["error"]["code"] == "server_busy"
    for stream in streams:
        stream.close()  # the clients go away mid-stream
    for t in waiting:
        t.join(timeout=60)
        assert not t.is_alive(), "a waiting request never ran after the slots were freed"
    after = read_metrics(server)
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + BATCH
    assert after["requests_rejected_total"] == before["requests_rejected_total"] + 1
    assert after["requests_total"] == before["requests_total"] + QUEUE
    assert after["requests_running"] == 0 and after["queue_depth"] == 0


def test_an_answer_stopped_midway_is_kept_for_the_next_turn(server):
    """A client that stops reading (a chat UI's stop button) leaves its prompt and the answer so
    far in the prefix cache: the next turn, which carries that partial answer, reads only the
    rest."""
    from selfspec.engine import Engine

    question = "Tell a long story about a lighthouse keeper."
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}]}
    body |= {"max_tokens": 400, "temperature": 0, "stream": True}
    before = read_metrics(server)
    request = urllib.request.Request(
        server["base"] + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    stream, partial = urllib.request.urlopen(request, timeout=60), ""
    while len(partial) < 60:
        line = stream.readline().decode()
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            partial += delta.get("content") or ""
    stream.close()
    deadline = time.monotonic() + 60
    while read_metrics(server)["requests_cancelled_total"] == before["requests_cancelled_total"]:
        assert time.monotonic() < deadline, "the server never noticed the client leave"
        time.sleep(0.1)
    messages = body["messages"] + [
        {"role": "assistant", "content": partial},
        {"role": "user", "content": "Go on."},
    ]
    reply = openai_client(server).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=4
    )
    asked = len(Engine.load(MODEL).encode_messages(body["messages"]))
    assert reply.usage.prompt_tokens_details.cached_tokens > asked


def test_sigterm_shuts_down_cleanly(server):
    """A stream still open when SIGTERM comes gets an error event and its end at once (before,
    it held the shutdown until uvicorn cut it off with a traceback); the server exits 0."""
    stream = _open_stream(server)
    _wait_for(server, "requests_running", 1)
    process = server["process"]
    process.send_signal(signal.SIGTERM)
    rest = stream.read().decode()
    assert "the server is shutting down" in rest and rest.endswith("data: [DONE]\n\n"), rest
    assert process.wait(timeout=60) == 0, server["log"].read_text()
    assert "Traceback" not in server["log"].read_text()


def _bench(name: str, *args: str) -> dict:
    """What `python -m selfspec.bench.NAME --model MODEL ARGS` prints, read as JSON."""
    out = subprocess.run(
        [sys.executable, "-m", f"selfspec.bench.{name}", "--model", MODEL, *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_serving_bench_sends_each_streams_requests_in_turn():
    """`python -m selfspec.bench.serving` against its own real server: 2 streams of 2 requests
    each, every prompt asked alone and then within its stream; greedy answers must agree."""
    result = _bench("serving", "--streams", "2", "--prompts-per-stream", "2", "--max-tokens", "12")
    assert result["requests"] == 4 and result["streams"] == 2
    assert result["answers_identical_to_solo"] is True
    assert 4 <= result["completion_tokens"] <= 4 * 12
    assert result["together_engine_busy_seconds"] > 0
    # each phase on a server of its own: the streams reuse the chat template's opening (left
    # by the warm-up), never their own prompts asked alone
    cached = result["together_prompt_tokens_cached"]
    assert 0 < cached < result["together_prompt_tokens"] - 4
    requests = result["per_request"]
    assert len(requests) == 4
    assert sum(r["completion_tokens"] for r in requests) == result["completion_tokens"]
    assert all(r["prompt_tokens"] > 0 and r["together_seconds"] > 0 for r in requests)
    # each client's requests (0 and 2, 1 and 3) against the same requests alone
    clients = result["per_client_vs_alone"]
    assert len(clients) == 2
    for s, ratio in enumerate(clients):
        mine = requests[s::2]
        tokens = sum(r["completion_tokens"] for r in mine)
        alone = tokens / sum(r["alone_seconds"] for r in mine)
        together = tokens / sum(r["together_seconds"] for r in mine)  # greedy: the same tokens
        assert ratio == pytest.approx(together / alone, rel=0.02)


def test_the_turns_bench_finds_the_first_turn_in_the_prefix_cache():
    """`python -m selfspec.bench.turns`: two-turn conversations on a server with the prefix cache
    and on one without; the second turns reuse the first turns and answer the same."""
    result = _bench("turns", "--conversations", "2", "--max-tokens", "8")
    assert result["conversations"] == 2 and result["answers_identical"] is True
    for turn in result["per_conversation"]:
        assert 8 < turn["cached_tokens"] < turn["prompt_tokens"]
        assert 0 < turn["first_token_seconds"] <= turn["seconds"]


def test_the_closed_loop_bench_decodes_every_request_in_full():
    """`python -m selfspec.bench.closedloop`: the serving workload through selfspec.runtime.batch
    in one process; every request's tokens counted, the chat template's opening from the prefix
    cache."""
    result = _bench(
        "closedloop", "--streams", "2", "--prompts-per-stream", "2", "--max-tokens", "12"
    )
    assert result["requests"] == 4 and 4 <= result["tokens"] <= 4 * 12
    assert 0 < result["prompt_tokens_cached"] < result["prompt_tokens"]
    assert result["rows"] >= result["passes"] > 0 and result["aggregate_tok_s"] > 0


def test_the_load_bench_sends_every_kind_of_request_and_leaves_no_slot():
    """`python -m selfspec.bench.load` (locust, headless) against its own real server: a mix of
    whole and streamed requests, greedy and sampled, some streams dropped by the client after
    two chunks; none fails, every slot is freed, and the server's RSS is followed."""
    result = _bench("load", "--users", "3", "--requests", "30", "--max-tokens", "8")
    assert result["requests"] == 30 and sum(result["by_kind"].values()) == 30
    assert all(count > 0 for count in result["by_kind"].values()), result["by_kind"]
    assert result["errors"] == 0 and result["error_examples"] == []
    assert result["slots_left"] == {"running": 0, "queued": 0}
    assert result["first_token_ms"]["n"] > 0 and result["latency_ms"]["n"] > 0
    assert 0 < result["completion_tokens"] <= 30 * 8
    assert result["rss_mb_samples"] > 0 and result["rss_mb_max"] > 100  # the server, a real model
