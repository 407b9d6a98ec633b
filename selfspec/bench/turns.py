"""A conversation's second turn against the real `selfspec serve`, with the prefix cache and
without: how long the second turn waits for its first token when the keys and values of the
first turn (its prompt and answer) are kept.

    python -m selfspec.bench.turns --model qwen2.5-coder-1.5b --conversations 8 --max-tokens 128

Spec-Bench's two-turn conversations (MT-bench's categories), one category after another. Each
conversation: the first turn, then the second with the first's answer in its history, streamed
(time to its first token, and to its end). One server with the cache, then a fresh one without
(``--prefix-cache-mb 0``); greedy, so the second turns' answers must agree (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from selfspec.bench.serving import (
    _on_a_server,
    add_common_arguments,
    categories_in_turn,
    emit,
)
from selfspec.prompts import load_prompts


def _conversation(client, model: str, first: str, second: str, tokens: int) -> dict:
    messages = [{"role": "user", "content": first}]
    reply = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=tokens
    )
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": second},
    ]
    start, first_token, text, usage = time.perf_counter(), None, "", None
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=tokens, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first_token = first_token or time.perf_counter()
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details else 0,
        "first_token_seconds": round((first_token or time.perf_counter()) - start, 3),
        "seconds": round(time.perf_counter() - start, 3),
        "text": text,
    }


def bench_turns(model: str, speed: str, tokens: int, conversations: list, cache_mb: int) -> dict:
    def run(client):
        return [_conversation(client, model, p.text, p.follow_up, tokens) for p in conversations]

    kept, _, _ = _on_a_server(model, speed, cache_mb, run)
    fresh, _, _ = _on_a_server(model, speed, 0, run)

    def median(rows, key):
        return round(statistics.median(r[key] for r in rows), 3)

    return {
        "model": model,
        "speed": speed,
        "conversations": len(conversations),
        "max_tokens": tokens,
        "second_turn_prompt_tokens_median": median(kept, "prompt_tokens"),
        "second_turn_cached_tokens_median": median(kept, "cached_tokens"),
        "first_token_seconds_median_cached": median(kept, "first_token_seconds"),
        "first_token_seconds_median_uncached": median(fresh, "first_token_seconds"),
        "first_token_speedup_median": round(
            statistics.median(
                f["first_token_seconds"] / k["first_token_seconds"] for k, f in zip(kept, fresh)
            ),
            3,
        ),
        "second_turn_seconds_median_cached": median(kept, "seconds"),
        "second_turn_seconds_median_uncached": median(fresh, "seconds"),
        "answers_identical": all(k["text"] == f["text"] for k, f in zip(kept, fresh)),
        "per_conversation": [
            {name: r[name] for name in r if name != "text"} | {"uncached": f["first_token_seconds"]}
            for r, f in zip(kept, fresh)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.bench.turns", description=__doc__)
    add_common_arguments(parser, "the cached server's prefix cache")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128, help="per turn (default 128)")
    args = parser.parse_args(argv)
    if min(args.conversations, args.max_tokens, args.prefix_cache_mb) < 1:
        parser.error("--conversations, --max-tokens and --prefix-cache-mb must be at least 1")
    mixed = categories_in_turn([p for p in load_prompts("spec-bench") if p.follow_up])
    if len(mixed) < args.conversations:
        parser.error(f"Spec-Bench holds {len(mixed)} two-turn conversations")
    chosen = mixed[: args.conversations]
    result = bench_turns(args.model, args.speed, args.max_tokens, chosen, args.prefix_cache_mb)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
