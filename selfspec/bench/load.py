"""Load and soak for `selfspec serve`: locust, headless, with N users that send a mix of whole and
streamed chat and text completions, greedy and sampled, and streams the client drops after two
chunks, until a count of requests has been sent.

    python -m selfspec.bench.load --model smollm2-135m --users 8 --requests 500 --out load.json

It starts the server on a free loopback port (or takes ``--url`` of a running one, with
``--server-pid`` to follow its memory), samples the server's RSS every second, and reports:
requests and completion tokens per second, p50/p99 time to first token and between stream
chunks, whole-request latency, errors, RSS after the warm-up and at the end, and the server's
running and queued requests once the load is gone (any left is a leaked slot). ``--check`` exits 1
unless the soak holds: no errors, RSS growth after the warm-up within ``--max-rss-growth``, no
slot left.
"""

# locust patches the standard library for gevent on import: it must come before the rest.
from locust import HttpUser, constant, task  # isort: skip
from locust.env import Environment  # isort: skip
from locust.exception import StopUser  # isort: skip

import argparse
import json
import random
import statistics
import sys
import time

import gevent
import psutil

from selfspec.bench.serving import (
    categories_in_turn,
    emit,
    free_port,
    server_counters,
    start_server,
)
from selfspec.prompts import load_prompts
from selfspec.server.cli import DEFAULT_PREFIX_CACHE_MB

KINDS = ("chat", "completion", "chat_stream", "completion_stream", "dropped_stream")
WEIGHTS = (3, 2, 3, 1, 1)
TEMPERATURES = (0.0, 0.7, 1.0)


class Load:
    """What the users share: the plan (model, prompts, tokens, how many requests) and what
    they measured."""

    def __init__(self, model: str, prompts: list[str], max_tokens: int, requests: int, seed: int):
        self.model, self.prompts, self.max_tokens, self.requests = (
            model,
            prompts,
            max_tokens,
            requests,
        )
        self.random = random.Random(seed)
        self.sent = 0
        self.kinds = dict.fromkeys(KINDS, 0)
        self.errors: list[str] = []
        self.latencies: list[float] = []  # seconds, whole answers
        self.first_token: list[float] = []  # seconds to the first text of a stream
        self.between_chunks: list[float] = []  # seconds between a stream's text chunks
        self.tokens = 0

    def next_request(self) -> tuple[str, dict]:
        if self.sent >= self.requests:
            raise StopUser()
        kind = self.random.choices(KINDS, WEIGHTS)[0]
        temperature = self.random.choice(TEMPERATURES)
        prompt = self.prompts[self.sent % len(self.prompts)]
        self.sent += 1
        self.kinds[kind] += 1
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": temperature}
        if temperature:
            body["seed"] = self.sent
        if kind.startswith("chat"):
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body["stream"] = kind.endswith("stream")
        return kind, body


class ServeUser(HttpUser):
    wait_time = constant(0)
    load: Load  # set before the run

    @task
    def one_request(self) -> None:
        kind, body = self.load.next_request()
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        started = time.perf_counter()
        with self.client.post(
            path, json=body, stream=body["stream"], catch_response=True, name=kind, timeout=600
        ) as response:
            if response.status_code != 200:
                self.load.errors.append(f"{kind}: {response.status_code} {response.text[:200]}")
                response.failure(f"status {response.status_code}")
                return
            if not body["stream"]:
                self.load.latencies.append(time.perf_counter() - started)
                self.load.tokens += response.json()["usage"]["completion_tokens"]
                return
            problem = self._read_stream(response, started, dropped=kind == "dropped_stream")
            if problem:
                self.load.errors.append(f"{kind}: {problem}")
                response.failure(problem)

    def _read_stream(self, response, started: float, dropped: bool) -> str | None:
        """Read a stream's events (only two text chunks when ``dropped``): None, or what was
        wrong with it."""
        last, chunks = None, 0
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"error event {event['error']}"
            choice = event["choices"][0]
            if choice.get("text") or choice.get("delta", {}).get("content"):
                now = time.perf_counter()
                if last is None:
                    self.load.first_token.append(now - started)
                else:
                    self.load.between_chunks.append(now - last)
                last, chunks = now, chunks + 1
                if dropped and chunks == 2:
                    response.close()  # the client goes away mid-stream
                    return None
            if "usage" in event:
                self.load.tokens += event["usage"]["completion_tokens"]
                return None
        return None if dropped else "the stream ended without its usage chunk"


def _percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {
        "p50": round(pick(0.5) * scale, 1),
        "p99": round(pick(0.99) * scale, 1),
        "n": len(values),
    }


def _sample_rss(url: str, pid: int | None, load: Load, samples: list, full: list) -> None:
    """Every second: (seconds, requests sent, the server's RSS in MiB); and in ``full`` the
    requests sent when the server's prefix cache first dropped an entry (it had filled)."""
    process = psutil.Process(pid) if pid else None
    started = time.perf_counter()
    while True:
        if process is not None:
            rss = process.memory_info().rss / 2**20
            samples.append((round(time.perf_counter() - started, 1), load.sent, round(rss, 1)))
        if not full and server_counters(url).get("prefix_cache_evictions_total", 0) > 0:
            full.append(load.sent)
        gevent.sleep(1.0)


def _rss_summary(samples: list, warmup: int) -> dict:
    """RSS once ``warmup`` requests were sent (the median of the next tenth of the samples) and
    at the end (the median of the last tenth): the growth between them is the soak's figure."""
    after = [s for s in samples if s[1] >= warmup]
    if len(after) < 4:  # too short a run (or RSS not followed) to judge growth
        top = max((s[2] for s in samples), default=None)
        return {
            "warmup_requests": warmup,
            "rss_mb_max": top,
            "rss_growth_pct": None,
            "rss_mb_samples": len(samples),
        }
    tenth = max(1, len(after) // 10)
    base = statistics.median(s[2] for s in after[:tenth])
    end = statistics.median(s[2] for s in after[-tenth:])
    return {
        "warmup_requests": warmup,
        "rss_mb_after_warmup": round(base, 1),
        "rss_mb_end": round(end, 1),
        "rss_mb_max": max(s[2] for s in samples),
        "rss_growth_pct": round(100 * (end / base - 1), 2),
        "rss_mb_samples": len(samples),
        "rss_mb_over_time": samples[:: max(1, len(samples) // 60)],  # (seconds, sent, MiB)
    }


def _slots_left(url: str) -> dict:
    """The server's running and queued requests once the load is gone (dropped streams are
    noticed within a second), read from /metrics."""
    deadline, counts = time.monotonic() + 15, {}
    while time.monotonic() < deadline:
        counts = server_counters(url)
        if counts["requests_running"] == 0 and counts["queue_depth"] == 0:
            break
        gevent.sleep(0.5)
    return {"running": int(counts["requests_running"]), "queued": int(counts["queue_depth"])}


def run_load(url: str, pid: int | None, load: Load, users: int, warmup: int) -> dict:
    ServeUser.load = load
    environment = Environment(user_classes=[ServeUser], host=url)
    runner = environment.create_local_runner()
    samples: list = []
    full: list = []
    started = time.perf_counter()
    sampler = gevent.spawn(_sample_rss, url, pid, load, samples, full)
    runner.start(users, spawn_rate=users)
    while runner.user_count > 0 or load.sent == 0:
        gevent.sleep(0.2)
    seconds = time.perf_counter() - started
    runner.quit()
    sampler.kill()
    return {
        "users": users,
        "requests": load.sent,
        "by_kind": load.kinds,
        "max_tokens": load.max_tokens,
        "seconds": round(seconds, 2),
        "requests_per_s": round(load.sent / seconds, 3),
        "completion_tokens": load.tokens,
        "completion_tokens_per_s": round(load.tokens / seconds, 2),
        "errors": len(load.errors),
        "error_examples": load.errors[:5],
        "latency_ms": _percentiles(load.latencies),
        "first_token_ms": _percentiles(load.first_token),
        "between_chunks_ms": _percentiles(load.between_chunks),
        "prefix_cache_full_after_requests": full[0] if full else None,
        # the warm-up ends once the prefix cache has filled, if it does, and not before --warmup
        **_rss_summary(samples, max(warmup, full[0] if full else 0)),
        "slots_left": _slots_left(url),
    }


def verdict(result: dict, max_growth: float) -> list[str]:
    """What keeps the run from being a clean soak (empty: it is one)."""
    problems = []
    if result["errors"]:
        problems.append(f"{result['errors']} errors")
    growth = result["rss_growth_pct"]
    if growth is None:
        problems.append(
            "no RSS growth figure (RSS not followed, or too few samples after the warm-up)"
        )
    elif growth > max_growth:
        problems.append(f"RSS grew {growth}% after the warm-up (limit {max_growth}%)")
    if result["slots_left"] != {"running": 0, "queued": 0}:
        problems.append(f"slots left: {result['slots_left']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.bench.load", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--speed", default="auto")
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--server-pid", type=int, default=None, help="its pid, to follow RSS")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=DEFAULT_PREFIX_CACHE_MB,
        help=f"the started server's prefix cache (default {DEFAULT_PREFIX_CACHE_MB})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests before RSS is taken as the base (default: a fifth of --requests); "
        "later if the server's prefix cache is still filling then",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="percent, for --check")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the soak holds")
    parser.add_argument("--out", default=None, help="write the result as JSON here too")
    args = parser.parse_args(argv)
    if min(args.users, args.requests, args.max_tokens) < 1:
        parser.error("--users, --requests and --max-tokens must be at least 1")
    prompts = [p.text for p in categories_in_turn(load_prompts("spec-bench"))]
    load = Load(args.model, prompts, args.max_tokens, args.requests, args.seed)
    warmup = args.requests // 5 if args.warmup is None else args.warmup
    server = None
    if args.url is None:
        port = free_port()
        server = start_server(args.model, args.speed, port, args.prefix_cache_mb, 2 * args.users)
        url, pid = f"http://127.0.0.1:{port}", server.pid
    else:
        url, pid = args.url.rstrip("/"), args.server_pid
    try:
        result = {"model": args.model, "url": url, **run_load(url, pid, load, args.users, warmup)}
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    problems = verdict(result, args.max_rss_growth)
    result["soak_holds"] = not problems
    emit(result, args.out)
    if problems:
        print(f"[selfspec] the soak does not hold: {'; '.join(problems)}", file=sys.stderr)
    return 1 if problems and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
