"""A live `selfspec serve` for tests: started for real on a free loopback port in a child
process, talked to by the real `openai` client or plain HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

MODEL = "smollm2-135m"
ENV = dict(os.environ, SELFSPEC_NO_PROGRESS="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(tmp_path_factory, *options: str, env: dict = ENV, port: int | None = None):
    """A fixture's body: `selfspec serve --model MODEL *options` on ``port`` (a free loopback
    port), until its /health answers; yields {"base", "process", "log"} and kills it
    afterwards."""
    port = port or free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-m", "selfspec.cli", "serve", "--model", MODEL]
    command += ["--port", str(port), *options]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                if json.load(reply)["status"] == "ok":
                    break
        except OSError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail("the server did not come up")
    yield {"base": base, "process": process, "log": log}
    if process.poll() is None:
        process.kill()


def openai_client(server, api_key: str = "unused"):
    from openai import OpenAI

    return OpenAI(base_url=server["base"] + "/v1", api_key=api_key, max_retries=0, timeout=300)


def call(server, method: str, path: str, body: bytes | None = None, key: str | None = None):
    """(status, JSON reply) of one plain HTTP request, with ``key`` as its bearer token."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server["base"] + path, body, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def read_metrics(server) -> dict:
    with urllib.request.urlopen(server["base"] + "/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return {
        line.split()[0].removeprefix("selfspec_"): float(line.split()[1])
        for line in lines
        if line and not line.startswith("#")
    }
