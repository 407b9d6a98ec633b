"""Confirmation: the best trials timed for real, interleaved with plain decoding, prompt by
prompt."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfspec.engine import Engine, GenerationResult
    from selfspec.runtime.plan import SkipPlan
    from selfspec.search.calibration import CalibrationItem


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _decode_seconds(result: GenerationResult) -> float:
    return max(1e-9, result.stats.seconds - result.stats.prefill_seconds)


def confirm_plans(
    engine: Engine,
    items: list[CalibrationItem],
    plans: list[SkipPlan],
    tokens: int,
    log: Callable[[str], None] | None = None,
    fallback: bool = False,
) -> list[dict]:
    """Real greedy generation with each plan vs plain decoding, interleaved prompt by prompt.

    With ``fallback`` False (the default) the decode loop's switch to plain decoding is off, so
    the figures are each plan's own speed (what the speed model predicts), not a blend with
    plain decoding. Returns one dict per plan: median per-prompt decode speedup (prefill
    excluded), the same end to end, mean accepted length, acceptance rate and whether every
    output was identical to plain decoding.
    """
    drafters = [engine.layer_skip_drafter(plan) for plan in plans]
    configs = [engine.decode_config(p, max_new_tokens=tokens, fallback=fallback) for p in plans]
    _warm_up(engine, items[0].prompt_ids, plans, drafters, min(8, tokens), fallback)
    runs: list[list[GenerationResult]] = [[] for _ in plans]
    plain_runs = []
    for index, item in enumerate(items):
        order = list(range(-1, len(plans)))  # -1: plain decoding
        shift = index % len(order)
        results = {}
        for m in order[shift:] + order[:shift]:  # rotate so no method always runs first
            drafter, config = (None, None) if m < 0 else (drafters[m], configs[m])
            results[m] = engine.generate(
                list(item.prompt_ids), drafter, max_new_tokens=tokens, config=config
            )
        plain_runs.append(results[-1])
        for m in range(len(plans)):
            runs[m].append(results[m])
        if log:
            plain_s = _decode_seconds(results[-1])
            parts = ", ".join(
                f"#{m + 1} {plain_s / _decode_seconds(results[m]):.2f}x" for m in range(len(plans))
            )
            log(f"confirm prompt {index + 1}/{len(items)} ({item.category}): {parts}")
    return [_plan_summary(plain_runs, plan_runs, fallback) for plan_runs in runs]


def _warm_up(engine, prompt_ids, plans, drafters, tokens: int, fallback: bool) -> None:
    """The first generations after a search pay for allocations: one short run of each."""
    engine.generate(list(prompt_ids), None, max_new_tokens=tokens)
    for plan, drafter in zip(plans, drafters):
        config = engine.decode_config(plan, max_new_tokens=tokens, fallback=fallback)
        engine.generate(list(prompt_ids), drafter, config=config)


def _plan_summary(
    plain_runs: list[GenerationResult], runs: list[GenerationResult], fallback: bool
) -> dict:
    decode_ratios = [_decode_seconds(p) / _decode_seconds(r) for p, r in zip(plain_runs, runs)]
    e2e_ratios = [p.stats.seconds / max(1e-9, r.stats.seconds) for p, r in zip(plain_runs, runs)]
    drafted = sum(r.stats.drafted for r in runs)
    accepted = sum(r.stats.accepted for r in runs)
    passes = sum(r.stats.target_passes for r in runs)
    new_tokens = sum(max(0, r.stats.new_tokens - 1) for r in runs)
    return {
        "measured_speedup": round(_median(decode_ratios), 4),
        "measured_speedup_end_to_end": round(_median(e2e_ratios), 4),
        "per_prompt_speedup": [round(r, 3) for r in decode_ratios],
        "mean_accepted_length": round(new_tokens / passes, 4) if passes else 0.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "fallback": fallback,
        "fell_back": sum(1 for r in runs if r.stats.fell_back),
        "identical_output": all(r.token_ids == p.token_ids for p, r in zip(plain_runs, runs)),
        "plain_tokens_per_second": round(
            _median([p.stats.tokens_per_second for p in plain_runs]), 3
        ),
        "tokens_per_second": round(_median([r.stats.tokens_per_second for r in runs]), 3),
    }
