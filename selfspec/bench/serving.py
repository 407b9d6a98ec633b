"""Concurrent streams against the real `selfspec serve`: each prompt's request alone, then N
streams at once, through the OpenAI client; tokens/s per request and in aggregate.

    python -m selfspec.bench.serving --model qwen2.5-coder-1.5b --streams 4 --max-tokens 64

With ``--prompts-per-stream P`` each stream is a client that sends P requests one after another
(a closed loop: N requests stay in flight until the streams run out), so the batch stays full
instead of shrinking as answers of different lengths end.

It starts the server itself on a free loopback port (same model, speed mode and defaults as
`selfspec serve`), waits for /health, runs the requests alone and stops it, then does the same
for the streams on a fresh server (so the streams find nothing of the solo phase in the prefix
cache). Greedy by default, so every concurrent answer must equal its solo answer (checked);
with ``--temperature`` each request samples with its own seed (``--seed`` plus its index), the
same alone and among the streams, and the answers are not compared (a request's drafts differ
inside a batch, and with them the draws). Needs the `openai` package.

From the server's /metrics it also splits each phase's engine time into prefill, passes of the
batch (with their rows per pass and milliseconds per pass) and decoding alone, which says where
an aggregate short of the streams' count goes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from selfspec.prompts import Prompt, load_prompts
from selfspec.server.cli import DEFAULT_PREFIX_CACHE_MB


def add_common_arguments(parser: argparse.ArgumentParser, cache_help: str) -> None:
    """The arguments every serving bench takes: model, speed mode, prefix cache, --out."""
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--speed", default="auto")
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=DEFAULT_PREFIX_CACHE_MB,
        help=f"{cache_help} (default {DEFAULT_PREFIX_CACHE_MB})",
    )
    parser.add_argument("--out", default=None, help="write the result as JSON here too")


def emit(result: dict, out: str | None) -> None:
    """Print a bench's result as JSON, and write it to ``out`` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def categories_in_turn(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts reordered one category after another: the first of each, the second..."""
    by_category: dict[str, list] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    return [p for group in itertools.zip_longest(*by_category.values()) for p in group if p]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str, speed: str, port: int, prefix_cache_mb: int, queue: int = 64
) -> subprocess.Popen:
    """`selfspec serve` on a loopback ``port``, once its /health answers."""
    command = [sys.executable, "-m", "selfspec.cli", "serve", "--model", model, "--speed", speed]
    command += ["--port", str(port), "--queue-size", str(queue)]
    command += ["--prefix-cache-mb", str(prefix_cache_mb)]
    env = dict(os.environ, SELFSPEC_NO_PROGRESS="1")
    process = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not come up in 10 minutes")


def _one(client, model: str, prompt: str, tokens: int, sampling: tuple = (0.0, None)) -> dict:
    """One chat request; ``sampling`` is its (temperature, seed)."""
    start = time.perf_counter()
    temperature, seed = sampling
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=temperature,
        seed=seed,
        max_tokens=tokens,
    )
    seconds = time.perf_counter() - start
    made = reply.usage.completion_tokens
    return {
        "text": reply.choices[0].message.content,
        "prompt_tokens": reply.usage.prompt_tokens,
        "tokens": made,
        "seconds": seconds,
        "tok_s": made / seconds,
    }


def _tokens_per_second(requests: list[dict]) -> float:
    return sum(r["tokens"] for r in requests) / sum(r["seconds"] for r in requests)


def _together(
    client, model: str, prompts: list[str], tokens: int, streams: int, samplings: list[tuple]
) -> tuple[list[dict], float]:
    """Stream s sends prompts s, s + streams, ... one after another; all streams at once."""
    results: list = [None] * len(prompts)

    def ask(first: int) -> None:
        for i in range(first, len(prompts), streams):
            results[i] = _one(client, model, prompts[i], tokens, samplings[i])

    start = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(s,)) for s in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def _on_a_server(model: str, speed: str, prefix_cache_mb: int, work):
    """``work(client)`` on a server of its own, after a warm-up request: its result and the
    server's counters before and after it."""
    from openai import OpenAI

    port = free_port()
    server = start_server(model, speed, port, prefix_cache_mb)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600)
        _one(client, model, "Say hi.", 8)  # warm-up (kernels, caches)
        before = server_counters(f"http://127.0.0.1:{port}")
        result = work(client)
        return result, before, server_counters(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        server.wait(timeout=60)


def bench_serving(
    model: str,
    speed: str,
    streams: int,
    tokens: int,
    prompts: list[str],
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """Each prompt alone, then the streams; each phase on a server of its own, so the streams'
    requests find in the prefix cache only what their own phase left there (the chat
    template's opening), not the same prompts asked alone before."""
    samplings = [(temperature, seed + i if temperature else None) for i in range(len(prompts))]
    alone, start, before = _on_a_server(
        model,
        speed,
        prefix_cache_mb,
        lambda c: [_one(c, model, p, tokens, s) for p, s in zip(prompts, samplings)],
    )
    (together, seconds), middle, after = _on_a_server(
        model,
        speed,
        prefix_cache_mb,
        lambda c: _together(c, model, prompts, tokens, streams, samplings),
    )
    identical = all(a["text"] == t["text"] for a, t in zip(alone, together))
    if temperature:
        identical = None  # sampled: not compared
    alone_median = statistics.median(a["tok_s"] for a in alone)
    per_stream = [t["tok_s"] / a["tok_s"] for a, t in zip(alone, together)]  # per request
    # per client: its requests' tokens over their seconds, among the streams against alone
    per_client = [
        _tokens_per_second(together[s::streams]) / _tokens_per_second(alone[s::streams])
        for s in range(min(streams, len(prompts)))
    ]
    aggregate = sum(t["tokens"] for t in together) / seconds
    return {
        "model": model,
        "speed": speed,
        "streams": streams,
        "requests": len(prompts),
        "max_tokens": tokens,
        "temperature": temperature,
        "seed": seed if temperature else None,
        "completion_tokens": sum(t["tokens"] for t in together),
        "alone_tok_s_median": round(alone_median, 2),
        "aggregate_tok_s": round(aggregate, 2),
        "aggregate_vs_one_stream": round(aggregate / alone_median, 3),
        "per_stream_vs_alone_min": round(min(per_stream), 3),
        "per_stream_vs_alone_median": round(statistics.median(per_stream), 3),
        "per_client_vs_alone": [round(r, 3) for r in per_client],
        "answers_identical_to_solo": identical,
        # where the together phase's time went, from the server's own counters
        "together_seconds": round(seconds, 3),
        **_engine_split(start, before, "alone"),
        **_engine_split(middle, after, "together"),
        # each request: its prompt, its answer, and its seconds alone and among the streams
        "per_request": [
            {
                "prompt_tokens": a["prompt_tokens"],
                "completion_tokens": a["tokens"],
                "together_completion_tokens": t["tokens"],
                "alone_seconds": round(a["seconds"], 3),
                "together_seconds": round(t["seconds"], 3),
                "together_vs_alone": round(t["tok_s"] / a["tok_s"], 3),
            }
            for a, t in zip(alone, together)
        ],
    }


def server_counters(url: str) -> dict[str, float]:
    """The server's counters so far, read from /metrics (names without the selfspec_ prefix)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    rows = [line.split() for line in text.splitlines() if line.startswith("selfspec_")]
    return {name.removeprefix("selfspec_"): float(value) for name, value in rows}


def _engine_split(before: dict[str, float], after: dict[str, float], phase: str) -> dict:
    """Where a phase's engine time went: prefills (one request at a time), passes of the batch,
    and the rest (a request decoding alone, speculatively)."""
    spent = {name: after[name] - before[name] for name in after}
    busy, prefill = spent["engine_busy_seconds_total"], spent["prefill_seconds_total"]
    steps, batch = spent["batch_steps_total"], spent["batch_seconds_total"]
    split = {
        "engine_busy_seconds": round(busy, 3),
        "prefill_seconds": round(prefill, 3),
        "batch_seconds": round(batch, 3),
        "solo_decode_seconds": round(busy - prefill - batch, 3),
        "batch_steps": int(steps),
        "batch_rows_per_step": round(spent["batch_rows_total"] / steps, 2) if steps else 0,
        "batch_step_ms": round(1000 * batch / steps, 1) if steps else 0,
        "passes": int(spent["target_passes_total"]),
        "prompt_tokens": int(spent["prompt_tokens_total"]),
        "prompt_tokens_cached": int(spent["prompt_tokens_cached_total"]),
    }
    return {f"{phase}_{name}": value for name, value in split.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.bench.serving", description=__doc__)
    add_common_arguments(parser, "the server's prefix cache; 0: off")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="spec-bench", help="prompt set")
    parser.add_argument(
        "--prompts-per-stream",
        type=int,
        default=1,
        help="requests each stream sends one after another (default 1)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy, answers compared"
    )
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    args = parser.parse_args(argv)
    if min(args.streams, args.max_tokens, args.prompts_per_stream) < 1:
        parser.error("--streams, --max-tokens and --prompts-per-stream must be at least 1")
    if args.prefix_cache_mb < 0:
        parser.error("--prefix-cache-mb must be 0 (off) or more")
    if not 0 <= args.temperature <= 2:
        parser.error("--temperature must be in [0, 2]")
    wanted = args.streams * args.prompts_per_stream
    prompts = load_prompts(args.prompts)
    chosen = categories_in_turn(prompts)[:wanted]  # so that each stream gets a mix
    if len(chosen) < wanted:
        parser.error(f"{args.prompts} holds {len(chosen)} prompts; {wanted} are needed")
    texts = [p.text for p in chosen]
    result = bench_serving(
        args.model,
        args.speed,
        args.streams,
        args.max_tokens,
        texts,
        args.prefix_cache_mb,
        args.temperature,
        args.seed,
    )
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
