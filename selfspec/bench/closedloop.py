"""The serving bench's concurrent workload without the server: ``--streams`` closed-loop streams
of Spec-Bench chat requests decoded together through ``selfspec.runtime.batch`` in this process, as
the server's scheduler decodes them, minus HTTP and the solo path (every pass is a batch pass, even
when one request is left). Steadier than the server bench for comparing two versions of the
batch code, one run after the other.

    python -m selfspec.bench.closedloop --model qwen2.5-coder-1.5b --streams 4 --max-tokens 256

Each stream sends its requests one after another (stream s: prompts s, s + streams, ...), so
the batch stays full until the streams run out. A request joins the batch by reading its prompt
in chunks inside the passes (past what the prefix cache holds, warmed by one short request).
"""

from __future__ import annotations

import argparse
import sys
import time

from selfspec.bench.serving import add_common_arguments, categories_in_turn, emit
from selfspec.prompts import load_prompts


def run_streams(engine, prompt_ids: list[list[int]], streams: int, tokens: int, cache_mb: int):
    """Decode the requests as ``streams`` closed loops, after one short warm-up request (kernels,
    the drafter's timings, the chat template's opening in the prefix cache); the counts and
    seconds of the streams alone."""
    import torch

    from selfspec.drafters.batched import BatchDrafter
    from selfspec.runtime.prefixes import PrefixStore

    drafter = engine.self_drafter(None, layer_skip=False)
    batch_drafter = BatchDrafter.following(drafter)
    store = PrefixStore(cache_mb << 20) if cache_mb and engine.runner.can_batch else None
    config = engine.decode_config(drafter, max_new_tokens=tokens)
    warm_up = engine.encode_messages([{"role": "user", "content": "Say hi."}])
    with torch.inference_mode():
        _loops(engine, [warm_up], [[0]], config, batch_drafter, store)
        started = time.perf_counter()
        queues = [list(range(s, len(prompt_ids), streams)) for s in range(streams)]
        counts = _loops(engine, prompt_ids, queues, config, batch_drafter, store)
    return counts, time.perf_counter() - started


def _loops(engine, prompt_ids, queues, config, batch_drafter, store) -> dict[str, int]:
    """Loop s sends the requests ``queues[s]`` one after another; one batch pass a step."""
    from selfspec.runtime.batch import admit_sequence, step

    counts = dict(tokens=0, passes=0, rows=0, prompt_tokens=0, prompt_tokens_cached=0)
    active: list = []  # (loop, sequence)
    while any(queues) or active:
        for s, queue in enumerate(queues):
            if queue and not any(owner == s for owner, _ in active):
                ids = prompt_ids[queue.pop(0)]
                sequence = admit_sequence(
                    engine.runner, ids, config, engine.tokenizer, prefixes=store
                )
                active.append((s, sequence))
                counts["prompt_tokens"] += len(ids)
                counts["prompt_tokens_cached"] += sequence.gen.stats.cached_prompt_tokens
        counts["rows"] += step(engine.runner, [q for _, q in active], batch_drafter)
        counts["passes"] += 1
        for _, sequence in active:
            if sequence.gen.stop:
                counts["tokens"] += len(sequence.gen.generated)
                if store is not None:
                    store.save(sequence.cached_tokens(), sequence.cache)
        active = [(owner, sequence) for owner, sequence in active if not sequence.gen.stop]
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.bench.closedloop", description=__doc__
    )
    add_common_arguments(parser, "the prefix cache; 0: off")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompts-per-stream", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if min(args.streams, args.prompts_per_stream, args.max_tokens) < 1:
        parser.error("--streams, --prompts-per-stream and --max-tokens must be at least 1")
    if args.prefix_cache_mb < 0:
        parser.error("--prefix-cache-mb must be 0 (off) or more")
    from selfspec.engine import Engine

    engine = Engine.load(args.model, speed=args.speed)
    if not engine.runner.can_batch:
        parser.error(f"speed mode {engine.loaded.speed} does not batch requests")
    wanted = args.streams * args.prompts_per_stream
    chosen = categories_in_turn(load_prompts("spec-bench"))[:wanted]
    ids = [engine.encode_messages([{"role": "user", "content": p.text}]) for p in chosen]
    counts, seconds = run_streams(engine, ids, args.streams, args.max_tokens, args.prefix_cache_mb)
    result = {
        "model": args.model,
        "speed": engine.loaded.speed,
        "streams": args.streams,
        "requests": len(ids),
        "max_tokens": args.max_tokens,
        **counts,
        "seconds": round(seconds, 3),
        "aggregate_tok_s": round(counts["tokens"] / seconds, 2),
        "rows_per_pass": round(counts["rows"] / counts["passes"], 2),
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
