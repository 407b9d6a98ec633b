"""From timed runs to the bench's figures: per prompt, per method, per category.

Speedups are medians over prompts of per-prompt ratios. End to end: tokens/s over the whole
generation, prefill included. Decoding phase: tokens after the first per second after the first
(``decode_tokens_per_second``), which long prompts' prefill does not drown.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from selfspec.bench.methods import BASELINE

if TYPE_CHECKING:
    from selfspec.bench.methods import Method, MethodRun
    from selfspec.prompts import Prompt
    from selfspec.runtime.decode import DecodeStats

REFERENCES = (BASELINE, "autoregressive")


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rounded(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) else value


def first_difference(a: list[int], b: list[int]) -> dict:
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {
        "index": n,
        "method_token": a[n] if n < len(a) else None,
        "baseline_token": b[n] if n < len(b) else None,
    }


def _entry(
    method: Method, reps: list[MethodRun], base: list[int] | None, plain: list[int] | None
) -> dict:
    """One method on one prompt: tokens of the first repeat, median times, identity checks
    (against hf_generate when it ran: None otherwise)."""
    tokens = reps[0].token_ids
    seconds = statistics.median(r.seconds for r in reps)
    identical = all(r.token_ids == base for r in reps) if base is not None else None
    if not method.checks_identity:
        identical = "n/a"
    entry = {
        "new_tokens": len(tokens),
        "seconds": seconds,
        "tokens_per_second": len(tokens) / seconds if seconds else 0.0,
        "time_to_first_token": median([r.first_token_seconds for r in reps]),
        "decode_tokens_per_second": median([r.decode_tokens_per_second for r in reps]),
        "identical_to_baseline": identical,
        "stats": reps[0].stats,
    }
    if plain is not None and (method.same_as or reps[0].stats is not None):
        # its own plain decoding (selfspec's in the same speed mode, or llama.cpp's for llama.cpp's
        # speculation): speculation must not change a token
        entry[f"identical_to_{plain_reference(method)}"] = all(r.token_ids == plain for r in reps)
    return entry


def _prompt_row(
    prompt: Prompt,
    n_prompt: int,
    entries: dict[str, dict],
    tokens: dict[str, list[int]],
    base: list[int],
) -> dict:
    row = {"id": prompt.id, "category": prompt.category, "prompt_tokens": n_prompt, "methods": {}}
    for name, entry in entries.items():
        shown = {k: rounded(v) for k, v in entry.items() if k != "stats"}
        if entry["stats"] is not None:
            shown["mean_accepted_length"] = round(entry["stats"].mean_accepted_length, 4)
        if entry["identical_to_baseline"] is False:
            shown["first_difference"] = first_difference(tokens[name], base)
        row["methods"][name] = shown
    return row


SAME_AS_PREFIX = "identical_to_"  # and a method's plain decoding (never the baseline)


def plain_reference(method: Method) -> str:
    """The plain decoding a method's tokens are checked against in the same numerics."""
    return method.same_as or "autoregressive"


def _median_ratio(
    table: dict[str, list[dict]], entries: list[dict], indices: list[int], ref: str, key: str
) -> float | None:
    """Median over prompts of this method's ``key`` over the reference method's on that prompt."""
    ratios = []
    for e, i in zip(entries, indices):
        mine, theirs = e[key], table[ref][i][key]
        if mine is not None and theirs:
            ratios.append(mine / theirs)
    return rounded(median(ratios))


def _speedups(
    table: dict[str, list[dict]], entries: list[dict], indices: list[int], key: str, prefix: str
) -> dict:
    """``{prefix}speedup_vs_{ref}`` for each reference method (None when it did not run)."""
    return {
        f"{prefix}speedup_vs_{ref}": _median_ratio(table, entries, indices, ref, key)
        if ref in table
        else None
        for ref in REFERENCES
    }


def _drafting(stats: list[DecodeStats]) -> dict:
    """Acceptance figures summed over runs (selfspec's own methods only)."""
    if not stats:
        return {
            "mean_accepted_length": None,
            "acceptance_rate": None,
            "acceptance_by_position": None,
        }
    passes = sum(s.target_passes for s in stats)
    emitted = sum(max(s.new_tokens - 1, 0) for s in stats)
    drafted = sum(s.drafted for s in stats)
    width = max(len(s.drafted_by_position) for s in stats)

    def by_position(attr: str) -> list[int]:
        return [
            sum(getattr(s, attr)[k] for s in stats if k < len(getattr(s, attr)))
            for k in range(width)
        ]

    by_d, by_a = by_position("drafted_by_position"), by_position("accepted_by_position")
    return {
        "mean_accepted_length": rounded(emitted / passes) if passes else None,
        "acceptance_rate": rounded(sum(s.accepted for s in stats) / drafted) if drafted else None,
        "acceptance_by_position": [rounded(a / d) if d else None for a, d in zip(by_a, by_d)]
        if drafted
        else [],
        "drafted_by_position": by_d,
        "target_passes": passes,
        "fell_back": sum(bool(s.fell_back) for s in stats),
    }


def _verify_passes(table: dict[str, list[dict]], name: str, indices: list[int]) -> dict:
    """The method's verify passes pooled by rows over the prompts: median milliseconds, how many,
    and (where plain decoding ran) the median of each pass over plain decoding's median one-row
    pass on the same prompt, so that long prompts' dearer passes do not skew it."""
    pooled: dict[int, list[float]] = {}
    multiples: dict[int, list[float]] = {}
    plain_entries = table.get("autoregressive")
    for i in indices:
        stats = table[name][i]["stats"]
        if stats is None:
            return {}
        plain = plain_entries[i]["stats"] if plain_entries else None
        one_row = median(plain.verify_seconds.get(1, [])) if plain else None
        for rows, times in stats.verify_seconds.items():
            pooled.setdefault(rows, []).extend(times)
            if one_row:
                multiples.setdefault(rows, []).extend(t / one_row for t in times)
    out = {
        "verify_ms_by_rows": {r: rounded(median(t) * 1000) for r, t in sorted(pooled.items())},
        "verify_passes_by_rows": {r: len(t) for r, t in sorted(pooled.items())},
    }
    if multiples:
        out["verify_steps_by_rows"] = {r: rounded(median(m)) for r, m in sorted(multiples.items())}
    return out


def _summary(
    table: dict[str, list[dict]], name: str, indices: list[int], prompts: list[Prompt]
) -> dict:
    entries = [table[name][i] for i in indices]
    out = {
        "prompts": len(entries),
        "new_tokens": sum(e["new_tokens"] for e in entries),
        "seconds": round(sum(e["seconds"] for e in entries), 4),
        "tokens_per_second": rounded(median(e["tokens_per_second"] for e in entries)),
        **_speedups(table, entries, indices, "tokens_per_second", ""),
        "decode_tokens_per_second": rounded(median(e["decode_tokens_per_second"] for e in entries)),
        **_speedups(table, entries, indices, "decode_tokens_per_second", "decode_"),
        "time_to_first_token": rounded(median(e["time_to_first_token"] for e in entries)),
    }
    out.update(_drafting([e["stats"] for e in entries if e["stats"] is not None]))
    out.update(_verify_passes(table, name, indices))
    for key in {
        k for k in entries[0] if k.startswith(SAME_AS_PREFIX) and k != "identical_to_baseline"
    }:
        if all(key in e for e in entries):
            out[key] = all(e[key] for e in entries)
    identities = [e["identical_to_baseline"] for e in entries]
    if "n/a" in identities:
        out["identical_to_baseline"] = "n/a"
    elif None in identities:  # hf_generate did not run
        out["identical_to_baseline"] = None
    else:
        out["identical_to_baseline"] = all(identities)
    if out["identical_to_baseline"] is False:
        out["mismatched_prompts"] = [
            prompts[i].id for i, e in zip(indices, entries) if e["identical_to_baseline"] is False
        ]
    return out


def summarize(
    prompts: list[Prompt],
    encoded: list[list[int]],
    chosen: list[str],
    registry: dict[str, Method],
    runs: dict[str, list[list[MethodRun]]],
    peak_rss: dict[str, float],
    check_identity: bool = True,
) -> dict:
    """The result's "methods" (overall and per category) and "prompts" (per prompt) parts.
    ``check_identity=False`` (sampled runs): no output is compared with another."""
    table: dict[str, list[dict]] = {name: [] for name in chosen}
    per_prompt = []
    for i, prompt in enumerate(prompts):
        base = runs[BASELINE][i][0].token_ids if BASELINE in runs and check_identity else None
        entries = {}
        for name in chosen:
            reference = plain_reference(registry[name])
            compared = reference in runs and check_identity
            plain = runs[reference][i][0].token_ids if compared else None
            entries[name] = _entry(registry[name], runs[name][i], base, plain)
        for name, entry in entries.items():
            table[name].append(entry)
        tokens = {name: runs[name][i][0].token_ids for name in chosen}
        per_prompt.append(_prompt_row(prompt, len(encoded[i]), entries, tokens, base))
    categories = list(dict.fromkeys(p.category for p in prompts))
    methods = {}
    for name in chosen:
        overall = _summary(table, name, list(range(len(prompts))), prompts)
        overall["peak_rss_mb"] = rounded(peak_rss.get(name), 1)
        overall["categories"] = {
            c: _summary(table, name, [i for i, p in enumerate(prompts) if p.category == c], prompts)
            for c in categories
        }
        methods[name] = overall
    return {"methods": methods, "prompts": per_prompt}
