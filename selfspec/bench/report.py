"""A bench result as Markdown, plots and JSON files."""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.bench.methods import BASELINE
from selfspec.figures import figure_png, pyplot
from selfspec.fileio import atomic_write_bytes


def _fmt(value, kind: str = "") -> str:
    if value is None:
        return "–"
    if value == "n/a":
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "mb":
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _decoding(config: dict) -> str:
    s = config.get("sampling")
    if not s:
        return "greedy"
    return (
        f"sampled at temperature {s['temperature']}, top-p {s['top_p']}, top-k {s['top_k']}, "
        f"seed {s['seed']}; outputs not compared"
    )


def _header(result: dict) -> list[str]:
    m, c = result["machine"], result["config"]
    count = len(c["categories"])
    return [
        "# selfspec bench",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"{m['memory_gb']} GB RAM" + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- software: torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; "
        f"device {m.get('device', '?')}, dtype {m.get('dtype', '?')}, selfspec speed mode "
        f"{m.get('speed_mode', '?')} (transformers' methods run the unmodified model)",
        f"- model: {c['model']}"
        + (f"; draft model: {c['draft_model']}" if c.get("draft_model") else ""),
        f"- plan: {c['plan_summary'] or 'none'}",
        f"- {c['prompts']} prompt(s) in {count} categor{'y' if count == 1 else 'ies'}, up to "
        f"{c['max_new_tokens']} new tokens ({_decoding(c)}, EOS {c['eos_token_ids']}), "
        f"{c['repeats']} repeat(s), chat template {'on' if c['chat_template'] else 'off'}; "
        "methods interleaved prompt by prompt after one warm-up each",
        f"- speedups: {c['speedup_method']}; decode: the decoding phase alone (the tokens after "
        "the first over the time after the first), which long prompts' prefill does not drown",
        "",
    ]


def _expected_difference(result: dict):
    """A precision mode (gguf-q8), or bfloat16 on CUDA, changes selfspec's numerics: its methods
    differing from the float32 baseline is expected, not a speculation error (that is the
    same-mode check)."""
    from selfspec.speed.modes import NUMERICS

    c = result["config"]
    own_numerics = bool(c.get("numerics") or c.get("speed_mode") in NUMERICS)  # older files: no key

    def expected(name: str, r: dict) -> bool:
        return (
            own_numerics
            and r["identical_to_baseline"] is False
            and (name == "autoregressive" or "identical_to_autoregressive" in r)
        )

    return expected


def _main_table(result: dict) -> list[str]:
    expected = _expected_difference(result)
    lines = [
        "| method | tok/s | vs hf_generate | vs autoregressive | decode tok/s | "
        "decode vs autoregressive | mean accepted length | acceptance | peak RSS MiB | "
        "identical to hf_generate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in result["methods"].items():
        identical = (
            "no (mode's numerics)" if expected(name, r) else _fmt(r["identical_to_baseline"])
        )
        cells = [
            _fmt(r["tokens_per_second"]),
            _fmt(r["speedup_vs_hf_generate"], "x"),
            _fmt(r["speedup_vs_autoregressive"], "x"),
            _fmt(r.get("decode_tokens_per_second")),  # older files have no decode figures
            _fmt(r.get("decode_speedup_vs_autoregressive"), "x"),
            _fmt(r["mean_accepted_length"]),
            _fmt(r["acceptance_rate"]),
            _fmt(r["peak_rss_mb"], "mb"),
            identical,
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _category_table(result: dict, key: str, title: str) -> list[str]:
    """One row per method, one column per category (none for a single category)."""
    categories = result["config"]["categories"]
    methods = {
        n: r
        for n, r in result["methods"].items()
        if any(r["categories"][c].get(key) is not None for c in categories)
    }
    if len(categories) < 2 or not methods:
        return []
    lines = [
        "",
        title,
        "",
        "| method | " + " | ".join(categories) + " |",
        "|---|" + "---:|" * len(categories),
    ]
    for name, r in methods.items():
        cells = [_fmt(r["categories"][cat].get(key), "x") for cat in categories]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _acceptance_table(result: dict) -> list[str]:
    accept = {
        n: r["acceptance_by_position"]
        for n, r in result["methods"].items()
        if r.get("acceptance_by_position")
    }
    if not accept:
        return []
    width = max(len(v) for v in accept.values())
    lines = [
        "",
        "Acceptance by draft position (share of drafted tokens at that position that were "
        "accepted):",
        "",
        "| method | " + " | ".join(str(k + 1) for k in range(width)) + " |",
        "|---|" + "---:|" * width,
    ]
    for name, values in accept.items():
        cells = [_fmt(values[k] if k < len(values) else None) for k in range(width)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def verify_table(result: dict) -> list[str]:
    """Median verify pass by rows, per method, with (where plain decoding ran) its median multiple
    of plain decoding's one-row pass on the same prompt: what drafting cost in this run."""
    methods = {n: r for n, r in result["methods"].items() if r.get("verify_ms_by_rows")}
    if not methods:
        return []
    widths = sorted({int(rows) for r in methods.values() for rows in r["verify_ms_by_rows"]})
    lines = [
        "",
        "Verify passes by rows in the pass (the pending token and the draft): median ms over the "
        "run's rounds and, in parentheses, the median of each pass over plain decoding's one-row "
        "pass on the same prompt:",
        "",
        "| method | " + " | ".join(str(rows) for rows in widths) + " |",
        "|---|" + "---:|" * len(widths),
    ]
    for name, r in methods.items():
        ms = {int(k): v for k, v in r["verify_ms_by_rows"].items()}
        steps = {int(k): v for k, v in (r.get("verify_steps_by_rows") or {}).items()}
        cells = [
            _fmt(ms.get(rows)) + (f" ({steps[rows]:.2f})" if rows in steps else "")
            for rows in widths
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _identity_notes(result: dict) -> list[str]:
    expected = _expected_difference(result)
    lines = []
    mismatched = {
        n: r.get("mismatched_prompts")
        for n, r in result["methods"].items()
        if r["identical_to_baseline"] is False and not expected(n, r)
    }
    if mismatched:
        lines += [""] + [
            f"**{n} differs from hf_generate on prompt(s) {', '.join(map(str, ids))}.**"
            for n, ids in mismatched.items()
        ]
    same_mode = {
        n: r["identical_to_autoregressive"]
        for n, r in result["methods"].items()
        if "identical_to_autoregressive" in r and n != "autoregressive"
    }
    if same_mode:
        lines += [
            "",
            "Identical to selfspec's own plain decoding (autoregressive, same speed mode) on "
            "every prompt: "
            + ", ".join(f"{n} {'yes' if ok else '**no**'}" for n, ok in same_mode.items())
            + ".",
        ]
    llama_same = {
        n: r["identical_to_llama_server"]
        for n, r in result["methods"].items()
        if "identical_to_llama_server" in r
    }
    if llama_same:
        lines += [
            "",
            "Identical to llama.cpp's own plain decoding (llama_server) on every prompt: "
            + ", ".join(f"{n} {'yes' if ok else '**no**'}" for n, ok in llama_same.items())
            + ".",
        ]
    return lines


def format_markdown(result: dict) -> str:
    """The result as Markdown: machine and setup, the overall table, per-category speedups (end to
    end and decoding phase), acceptance by position, identity, memory and notes."""
    lines = _header(result) + _main_table(result)
    lines += _category_table(
        result,
        "speedup_vs_hf_generate",
        "Speedup vs hf_generate by category (median over that category's prompts):",
    )
    if "autoregressive" in result["methods"]:
        lines += _category_table(
            result,
            "decode_speedup_vs_autoregressive",
            "Decoding-phase speedup vs autoregressive by category (median over that category's "
            "prompts of the per-prompt ratios of decode tok/s):",
        )
    lines += _acceptance_table(result) + verify_table(result) + _identity_notes(result)
    lines += ["", f"Memory: {result['config']['memory_method']}"]
    if result.get("notes"):
        lines += ["", "Notes:"] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def _speedup_plot(result: dict) -> bytes:
    methods, categories = result["methods"], result["config"]["categories"]
    groups = categories + (["overall"] if len(categories) > 1 else [])
    names = list(methods)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) * max(1, len(names)) / 3 + 3), 4.2))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        values = [
            (methods[name]["categories"][g] if g != "overall" else methods[name])[
                "speedup_vs_hf_generate"
            ]
            or 0
            for g in groups
        ]
        offsets = [g + (k - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(offsets, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    tilt = len(groups) > 4
    ax.set_xticklabels(groups, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    ax.set_ylabel(f"speedup vs {BASELINE} (median per-prompt ratio)")
    ax.set_title(f"{result['config']['model']}: speedup by category")
    ax.legend(fontsize=8)
    return figure_png(fig)


def _acceptance_plot(result: dict) -> bytes:
    fig, ax = pyplot().subplots(figsize=(6.0, 4.0))
    plotted = False
    for name, r in result["methods"].items():
        points = [
            (k + 1, v) for k, v in enumerate(r.get("acceptance_by_position") or []) if v is not None
        ]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
            plotted = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted at that position)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{result['config']['model']}: acceptance by draft position")
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(
            0.5, 0.5, "no drafting method ran", ha="center", va="center", transform=ax.transAxes
        )
    return figure_png(fig)


def plot_results(result: dict) -> dict[str, bytes]:
    """PNG bytes by file name: speedup by category and method (bars), acceptance by draft position
    (lines)."""
    return {
        "speedup_by_category.png": _speedup_plot(result),
        "acceptance_by_position.png": _acceptance_plot(result),
    }


def write_outputs(result: dict, out_dir) -> list[Path]:
    """Write bench.json, bench.md and the PNG plots into ``out_dir``, each atomically."""
    out = Path(out_dir)
    files = {
        "bench.json": (json.dumps(result, indent=2) + "\n").encode(),
        "bench.md": format_markdown(result).encode(),
        **plot_results(result),
    }
    written = []
    for name, data in files.items():
        atomic_write_bytes(out / name, data)
        written.append(out / name)
    return written
