"""`selfspec bench`: the command line over ``run_bench``."""

from __future__ import annotations

import argparse
import json
import sys

import selfspec.bench
from selfspec.bench.methods import METHODS
from selfspec.bench.report import format_markdown, write_outputs
from selfspec.bench.run import run_bench
from selfspec.cliargs import (
    add_model_arguments,
    add_plan_arguments,
    add_sampling_arguments,
    check_at_least,
    load_engine,
    resolve_heads,
    resolve_plan,
    sampling_from,
)
from selfspec.errors import SelfSpecError
from selfspec.loading.sources import DEFAULT_DRAFT_MODEL

DESCRIPTION = selfspec.bench.__doc__  # what `selfspec bench --help` says about the bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_plan_arguments(parser, "for self_speculative")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft model for dual_model and hf_assisted (default: the model's usual draft model)",
    )
    parser.add_argument(
        "--heads",
        default=None,
        help="draft heads file for self_speculative and heads (default: the model's; none: no "
        "head drafts)",
    )
    parser.add_argument(
        "--learned",
        action="store_true",
        help="recycled drafts start from the table `--learn` kept for the model, as they do in "
        "`generate --learn` and `serve --learn` (read only: the bench never writes it)",
    )
    parser.add_argument(
        "--prompts",
        default="spec-bench",
        help="a .jsonl file, or spec-bench[:cat,...] (default spec-bench: every category)",
    )
    parser.add_argument("--limit", type=int, default=1, help="prompts per category (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated subset of {','.join(METHODS)} (default: all that can run, "
        "llama.cpp's server (llama_server*) only when named)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per prompt and method; the median is used",
    )
    parser.add_argument(
        "--no-chat",
        action="store_true",
        help="feed prompts as raw text (default: the model's chat template if it has one)",
    )
    parser.add_argument("--out", default=None, help="folder for bench.json, bench.md and PNG plots")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the Markdown table"
    )
    add_sampling_arguments(parser, seed_default=0)
    parser.add_argument(
        "--no-hf-baseline",
        action="store_true",
        help="leave out hf_generate (transformers' greedy decoding, the slowest method on a CPU) "
        "unless --methods names it; speculation is still checked against selfspec's plain decoding",
    )


def _methods(text: str | None) -> list[str] | None:
    if not text:
        return None
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SelfSpecError(f"unknown method(s) {', '.join(unknown)}. Known: {', '.join(METHODS)}.")
    return methods


def run(args: argparse.Namespace) -> int:
    from selfspec.prompts import load_prompts

    check_at_least("--limit", args.limit, 1)
    check_at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_at_least("--repeats", args.repeats, 1)
    methods = _methods(args.methods)
    sampling = sampling_from(args)  # bad values fail before the model loads
    prompts = load_prompts(args.prompts, limit=args.limit)
    engine = load_engine(args)
    plan = resolve_plan(engine, args)
    heads = resolve_heads(engine, args)
    if args.learned and not engine.learned_table().path.is_file():
        raise SelfSpecError(
            f"--learned: no recycled drafts' table is kept for {engine.loaded.name} yet "
            f"(looked for {engine.learned_table().path}): use the model with --learn first"
        )
    draft = args.draft_model or DEFAULT_DRAFT_MODEL.get(engine.loaded.name)
    notes = []
    if draft is None and (methods is None or any(METHODS[m].needs == "draft" for m in methods)):
        notes.append(
            f"{engine.loaded.name} has no default draft model and no --draft-model was given."
        )
    result = run_bench(
        engine,
        prompts,
        methods,
        plan=plan,
        heads=heads,
        learned=args.learned,
        draft=draft,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        chat=False if args.no_chat else None,
        explicit=methods is not None,
        notes=notes,
        config_extra={
            "prompt_spec": args.prompts,
            "limit": args.limit,
            "heads": args.heads or "the model's own, if any",
            "learned_table": str(engine.learned_table().path) if args.learned else None,
        },
        baseline=not args.no_hf_baseline,
        sampling=sampling,
        seed=args.seed,
    )
    if args.out:
        written = write_outputs(result, args.out)
        print(f"[selfspec] wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_markdown(result), end="")
    return 0
