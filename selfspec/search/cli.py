"""`selfspec search`: the command line over ``search_plan``."""

from __future__ import annotations

import argparse
import shlex
import sys

from selfspec.cliargs import add_model_arguments, check_at_least, load_engine
from selfspec.errors import SelfSpecError
from selfspec.search.config import (
    DEFAULT_CONFIRM,
    DEFAULT_LIMIT,
    DEFAULT_PROMPTS,
    DEFAULT_TOKENS,
    DEFAULT_TRIALS,
    SearchConfig,
)
from selfspec.search.storage import open_storage
from selfspec.search.study import default_out, search_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_model_arguments(parser)
    parser.add_argument(
        "--prompts",
        default=DEFAULT_PROMPTS,
        help=(
            "calibration prompts: a .jsonl file or spec-bench[:cat,...] (default "
            f"{DEFAULT_PROMPTS})"
        ),
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        help=f"prompts per category (default {DEFAULT_LIMIT})",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help=f"greedy continuation length per prompt (default {DEFAULT_TOKENS})",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=DEFAULT_TRIALS,
        help=f"trials the study should hold; finished ones count (default {DEFAULT_TRIALS})",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop searching after this many seconds"
    )
    parser.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL (default sqlite:///<out folder>/study.db)",
    )
    parser.add_argument(
        "--study", default=None, help="study name (default: from the model and calibration)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="plan to write (default: the user's plan folder, ~/.cache/selfspec/plans/<model>/, "
        "where `selfspec generate` looks first)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    parser.add_argument(
        "--confirm",
        type=int,
        default=DEFAULT_CONFIRM,
        help=(
            f"best distinct trials to confirm by real generation (default {DEFAULT_CONFIRM}; 0: "
            "none)"
        ),
    )
    parser.add_argument(
        "--no-chat",
        action="store_true",
        help="feed prompts as raw text (default: the model's chat template if it has one)",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from selfspec.prompts import load_prompts

    for flag, value, low in (
        ("--trials", args.trials, 1),
        ("--tokens", args.tokens, 4),
        ("--limit", args.limit, 1),
        ("--confirm", args.confirm, 0),
    ):
        check_at_least(flag, value, low)
    if args.speed == "cuda-compiled":  # every trial's skip set is a new kind of pass to compile
        raise SelfSpecError(
            "search with --speed cuda-graphs: under cuda-compiled every trial's draft "
            "would be compiled anew (about a minute each). The plan it finds serves "
            "both modes."
        )
    # a bad file fails before the model loads
    prompts = load_prompts(args.prompts, limit=args.limit)
    if args.storage is not None:
        open_storage(args.storage)  # so does a bad storage URL
    engine = load_engine(args)
    # Without --out a bundled model's plan goes to the user's plan folder for the mode that runs.
    out = Path(args.out) if args.out else default_out(engine.loaded.key, engine.loaded.speed)
    config = SearchConfig(
        prompts=prompts,
        trials=args.trials,
        tokens=args.tokens,
        out=out,
        storage=args.storage,
        study_name=args.study,
        seed=args.seed,
        timeout=args.timeout,
        confirm=args.confirm,
        chat=False if args.no_chat else None,
        how=_command_line(args),
        prompts_label=f"{args.prompts} (limit {args.limit} per category)",
    )
    result = search_plan(engine, config)
    print(result.summary())
    return 0


def _command_line(args: argparse.Namespace) -> str:
    if sys.argv[1:2] == ["search"]:
        return shlex.join(["selfspec", *sys.argv[1:]])
    argv = []
    for key, value in sorted(vars(args).items()):
        if key in ("func", "command") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return shlex.join(["selfspec", "search", *argv])
