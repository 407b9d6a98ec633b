"""Heads trained while the server is idle (selfspec.server.learning), for real: a live server
records its requests, trains on them in a process of its own once it has been idle, stops that
process while it serves, takes up the new heads between requests with output unchanged, and no
training outlives a server killed with SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from live_server import ENV, MODEL, openai_client, serving
from test_history import PROMPTS as HISTORY_PROMPTS

from selfspec.loading.sources import ensure_bundled
from selfspec.paths import cache_dir
from selfspec.server.learning import heads_pay

PROMPTS = HISTORY_PROMPTS[:5]


@pytest.mark.parametrize(
    ("timed", "pays"),
    [
        ({"with": 1.2, "without": 1.1}, True),
        ({"with": 1.2, "without": 1.1, "before": 1.25}, False),  # older heads were better
        ({"with": 1.05, "without": 1.1}, False),  # no heads were better
        ({"with": 0.95, "without": 0.9}, False),  # slower than plain decoding
        (None, False),  # never timed: no evidence
    ],
)
def test_heads_replace_the_model_s_only_where_they_decoded_faster_than_every_rival(timed, pays):
    info = {"decode_speedup": timed} if timed else {}
    assert heads_pay(info) is pays


def gauge(server, name: str) -> float:
    with urllib.request.urlopen(server["base"] + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return float(re.search(rf"^selfspec_{name} (\S+)$", text, re.M).group(1))


def wait_for(server, name: str, value: float, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while gauge(server, name) != value:
        assert server["process"].poll() is None, server["log"].read_text()
        assert time.monotonic() < deadline, (
            f"{name} never reached {value}\n" + server["log"].read_text()
        )
        time.sleep(0.5)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def training_server(tmp_path_factory):
    """A server whose heads go to a cache of its own (the models and kernels shared)."""
    ensure_bundled(MODEL)  # in the shared cache, whichever test runs first
    cache = tmp_path_factory.mktemp("cache")
    for shared in ("models", "kernels"):
        (cache_dir() / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(cache_dir() / shared, target_is_directory=True)
    env = dict(ENV, SELFSPEC_CACHE=str(cache), SELFSPEC_HISTORY=str(cache / "history"))
    options = ["--learn", "--train-idle", "--train-after", "150", "--train-idle-seconds", "2"]
    options += ["--train-budget", "1", "--train-adopt", "always", "--max-batch", "1"]
    for server in serving(tmp_path_factory, *options, env=env):
        yield server, cache


@pytest.mark.slow  # a live server and two trainings
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_server_trains_heads_while_idle_and_output_stays_the_same(training_server):
    server, cache = training_server
    client = openai_client(server)

    def complete(prompt: str, stream: bool = False):
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=stream
        )

    first = [complete(prompt).choices[0].text for prompt in PROMPTS]
    wait_for(server, "heads_training_running", 1, seconds=30)
    # a request stops the training process while it is served
    stream = complete("Three tips for a job interview:\n1.", stream=True)
    next(iter(stream))
    assert gauge(server, "heads_training_paused") == 1
    (training,) = children(server["process"].pid)
    assert Path(f"/proc/{training}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    list(stream)
    wait_for(server, "heads_trainings_finished_total", 1, seconds=600)  # a lower priority
    assert gauge(server, "heads_adopted_total") == 1
    heads = cache / "plans" / MODEL / "heads.safetensors"
    assert heads.is_file() and "new draft heads" in server["log"].read_text()
    # the next requests draft with them, and say the same
    assert [complete(prompt).choices[0].text for prompt in PROMPTS] == first
    assert "drafting with the new heads" in server["log"].read_text()
    # kill -9 during the next training: the training ends with its server
    wait_for(server, "heads_training_running", 1, seconds=30)
    (training,) = children(server["process"].pid)
    os.kill(server["process"].pid, signal.SIGKILL)
    server["process"].wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{training}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (
        not Path(f"/proc/{training}").exists()
        or "Z" in Path(f"/proc/{training}/stat").read_text().rsplit(")", 1)[1].split()[0]
    )
    assert heads.is_file()  # the model's heads stay as they were
