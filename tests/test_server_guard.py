"""`selfspec serve` behind a key and limits, for real: a server started with --api-key (from the
environment), --max-body-kb and --max-tokens-cap, talked to by the real `openai` client and by
plain HTTP for what that client cannot send."""

from __future__ import annotations

import http.client
import json

import pytest
from live_server import ENV, MODEL, call, openai_client, serving

pytestmark = pytest.mark.slow
KEY = "sk-test-9f2c1e"
ROUTES = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    env = dict(ENV, SELFSPEC_API_KEY=KEY)
    options = ("--max-body-kb", "4", "--max-tokens-cap", "8")
    yield from serving(tmp_path_factory, *options, env=env)


def _chat_body(**extra) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return json.dumps({**body, **extra}).encode()


@pytest.mark.parametrize("method,path", ROUTES + [("GET", "/v1/no-such-route")])
@pytest.mark.parametrize("key", [None, "sk-wrong", KEY[:-1]])
def test_every_v1_route_needs_the_key(guarded, method, path, key):
    body = _chat_body() if method == "POST" else None
    status, reply = call(guarded, method, path, body, key)
    assert status == 401
    assert reply["error"]["code"] == "invalid_api_key"
    assert reply["error"]["type"] == "invalid_request_error"


def test_the_key_opens_the_api_and_never_reaches_the_log(guarded):
    from openai import AuthenticationError

    assert call(guarded, "GET", "/health")[0] == 200  # probes need no key
    reply = openai_client(guarded, api_key=KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(AuthenticationError):
        openai_client(guarded, api_key="sk-wrong").models.list()
    assert KEY not in guarded["log"].read_text()
    assert "(API key required)" in guarded["log"].read_text()


def test_a_body_over_the_limit_is_413_declared_or_streamed(guarded):
    big = _chat_body(user="x" * 5000)
    status, reply = call(guarded, "POST", "/v1/chat/completions", big, KEY)
    assert status == 413 and "limit of 4096 bytes" in reply["error"]["message"]
    host, port = guarded["base"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    pieces = (big[i : i + 1000] for i in range(0, len(big), 1000))  # chunked: no length given
    connection.request("POST", "/v1/chat/completions", pieces, headers, encode_chunked=True)
    answer = connection.getresponse()
    assert answer.status == 413 and b"limit of 4096 bytes" in answer.read()
    connection.close()
    assert call(guarded, "POST", "/v1/chat/completions", _chat_body(), KEY)[0] == 200


def test_max_tokens_has_a_ceiling(guarded):
    status, reply = call(guarded, "POST", "/v1/completions", _completion(max_tokens=9), KEY)
    assert status == 400 and reply["error"]["param"] == "max_tokens"
    assert "over this server's limit of 8" in reply["error"]["message"]
    status, reply = call(guarded, "POST", "/v1/completions", _completion(), KEY)
    assert status == 200 and reply["usage"]["completion_tokens"] <= 8  # the default is capped


def _completion(**extra) -> bytes:
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0}
    return json.dumps({**body, **extra}).encode()


def _snapshot(folder) -> dict:
    """Every file under ``folder``: its size and modification time."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
        if p.is_file()
    }  # fmt: skip


def test_kill_9_mid_stream_is_a_clean_client_error_and_a_restart_serves_at_once(
    tmp_path_factory,
):
    from openai import APIConnectionError

    from selfspec.loading.sources import ensure_bundled

    first = serving(tmp_path_factory)
    server = next(first)
    entry = ensure_bundled(MODEL)
    before = _snapshot(entry)  # once the server has built what it needs
    stream = openai_client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about the sea."}],
        max_tokens=400,
        stream=True,
    )
    chunks = iter(stream)
    next(chunks)  # the stream has begun
    server["process"].kill()
    server["process"].wait(timeout=60)
    with pytest.raises(APIConnectionError):  # the client's own error, not a hang
        for _ in chunks:
            pass
    port = int(server["base"].rsplit(":", 1)[1])
    second = serving(tmp_path_factory, port=port)
    again = next(second)
    reply = openai_client(again).completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert reply.usage.completion_tokens >= 1
    for generator in (first, second):
        next(generator, None)  # the fixture body's end: kills the server if it still runs
    assert _snapshot(entry) == before
