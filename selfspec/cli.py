"""The `selfspec` command: a thin layer over the Python API.

Subcommands: models, generate, search, bench, profile, serve, train-heads. Problems the user can
fix are printed as one `error:` line (exit 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import sys
import threading

import selfspec  # noqa: F401  (sets MKL_CBWR before torch is imported)
from selfspec.cliargs import (
    add_model_arguments,
    add_sampling_arguments,
    check_at_least,
    load_engine,
    read_prompt,
    resolve_heads,
    resolve_plan,
    sampling_from,
)
from selfspec.errors import SelfSpecError
from selfspec.loading.models import DEFAULT_MODEL

# Each of these modules provides add_arguments(parser) and run(args) -> int.
_SUBCOMMAND_MODULES = {
    "search": ("selfspec.search.cli", "find a skip plan for a model with an Optuna search"),
    "bench": (
        "selfspec.bench.cli",
        "compare plain, self-speculative and dual-model decoding side by side",
    ),
    "profile": (
        "selfspec.bench.profiler",
        "measure forward-pass costs over 1..16 tokens and a draft step",
    ),
    "serve": ("selfspec.server.cli", "serve the model over an OpenAI-compatible HTTP API"),
    "train-heads": (
        "selfspec.training.cli",
        "train draft heads for a model on its own answers (cheap drafts from the last pass)",
    ),
}


# ------------------------------------------------------------------------------------ models


def cmd_models(args: argparse.Namespace) -> int:
    from selfspec.loading.sources import list_models

    if args.check:
        return _check_models(args.check, args.json)
    rows = list_models(verify=args.verify)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'name':<20} {'architecture':<12} {'layers':>6} {'GGUF MB':>8}  {'cached':<6} description"
    )
    for r in rows:
        print(
            f"{r['name']:<20} {r['architecture']:<12} {r['layers']:>6} {r['gguf_mb']:>8}  "
            f"{'yes' if r['cached'] else 'no':<6} {r['description']}"
        )
    for r in rows:
        if r.get("damage"):
            print(f"{r['name']}: damaged ({r['damage']}); the next load rebuilds it")
        elif r.get("checksums"):
            print(f"{r['name']}: every cached file matches its checksum")
        elif "checksums" in r:
            print(f"{r['name']}: sizes match; no checksums recorded (cached by an older selfspec)")
    return 1 if any(r.get("damage") for r in rows) else 0


def _check_models(paths: list[str], as_json: bool) -> int:
    from selfspec.loading.check import check_model_file

    reports = [check_model_file(path) for path in paths]
    if as_json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n".join(line for r in reports for line in r.lines()))
    return 0 if all(r.loads for r in reports) else 1


# ---------------------------------------------------------------------------------- generate


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt", nargs="?", default=None, help="the prompt text, or - to read it from stdin"
    )
    add_model_arguments(p, model_default=None)
    plan = p.add_mutually_exclusive_group()
    plan.add_argument("--plan", help="skip plan JSON (default: the model's plan)")
    plan.add_argument(
        "--no-plan", action="store_true", help="start from an empty plan (use with --skip-*)"
    )
    p.add_argument(
        "--skip-attention",
        default=None,
        help="attention sublayers to skip, e.g. 3,5,7 or 10-14 (overrides the plan)",
    )
    p.add_argument("--skip-mlp", default=None, help="MLP sublayers to skip (overrides the plan)")
    p.add_argument(
        "--draft",
        choices=["auto", "ngram", "recycled", "layer-skip"],
        default="auto",
        help=(
            "auto (default): context n-gram, draft-head, recycled and layer-skip drafts (with "
            "the plan) where they pay, chosen each round from measured costs; ngram: context "
            "drafts only; recycled: context drafts and the model's own earlier predictions; "
            "layer-skip: the plan's drafts every round"
        ),
    )
    p.add_argument(
        "--heads",
        default=None,
        help="draft heads file for --draft auto (default: the model's, from `selfspec "
        "train-heads` or shipped; none: no head drafts)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft with a separate model instead (dual-model drafting)",
    )
    p.add_argument(
        "--max-draft",
        type=int,
        default=None,
        help="most tokens drafted per round (default: 16, or the plan's with --draft layer-skip)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="draft confidence threshold (default: the plan's)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=1024,
        help="stop after this many new tokens at the latest (default 1024: a whole answer; EOS "
        "ends it sooner)",
    )
    add_sampling_arguments(p, seed_default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument(
        "--baseline", action="store_true", help="plain autoregressive decoding of the same model"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text and stats instead of streaming",
    )
    p.add_argument(
        "--learn",
        action="store_true",
        help="record the prompt's and answer's tokens (bounded, on this machine) for `selfspec "
        "train-heads --from-history`, so the model's draft heads learn from its use, and keep "
        "its recycled drafts' table between runs",
    )


def _generate_model(args: argparse.Namespace) -> str:
    """--model, else the model a --plan was made for, else the default model."""
    if args.model is None and args.plan:
        from selfspec.runtime.plan import load_plan

        return load_plan(args.plan).model.name
    return args.model or DEFAULT_MODEL


def _drafter_and_plan(engine, args: argparse.Namespace):
    if args.draft_model:
        return engine.model_drafter(args.draft_model), None
    if args.baseline:
        return None, None
    if args.draft in ("ngram", "recycled"):
        recycled = args.draft == "recycled"
        return engine.self_drafter(layer_skip=False, heads=False, recycled=recycled), None
    plan = resolve_plan(engine, args)
    if plan is None and args.draft == "layer-skip":
        name = engine.loaded.name
        raise SelfSpecError(
            f"no skip plan for {name}: pass --plan, --skip-attention/--skip-mlp, "
            f"--draft auto, or run `selfspec search --model {name}`."
        )
    if args.draft == "layer-skip":
        return engine.layer_skip_drafter(plan), plan
    heads = resolve_heads(engine, args)
    return engine.self_drafter(plan, layer_skip=plan is not None, heads=heads), plan


def _stats_line(method: str, result) -> str:
    s = result.stats
    fell_back = (
        f"; drafting paused {s.fallbacks}x (slower than plain decoding), first at token "
        f"{s.fell_back_at_token}"
        if s.fell_back
        else ""
    )
    sources = ", ".join(f"{name} {a}/{d} in {r} rounds" for name, (r, d, a) in s.sources.items())
    numerics = result.numerics_note
    return (
        f"[selfspec] {method}: {s.new_tokens} tokens in {s.seconds:.2f}s = "
        f"{s.tokens_per_second:.2f} tok/s; {s.target_passes} target passes, mean accepted length "
        f"{s.mean_accepted_length:.2f}, acceptance {s.acceptance_rate:.2f} "
        f"({s.accepted}/{s.drafted})"
        f"{f' [{sources}]' if sources else ''}{fell_back}; stop: {s.stop_reason}"
        f"{f'; speed mode {result.speed_mode}: {numerics}' if numerics else ''}"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from selfspec.runtime.decode import check_request

    prompt = read_prompt(args.prompt)
    sampling = sampling_from(args)
    check_at_least("--max-draft", args.max_draft, 1)
    check_at_least("--max-new-tokens", args.max_new_tokens, 1)
    engine = load_engine(args, _generate_model(args))
    drafter, _ = _drafter_and_plan(engine, args)
    learned_table = engine.learned_table() if args.learn else None
    if learned_table is not None:
        learned_table.resume(drafter)
    method = "autoregressive" if drafter is None else drafter.name
    config = engine.decode_config(
        drafter,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        stop_strings=tuple(args.stop),
        max_draft_tokens=args.max_draft,
        confidence_threshold=args.threshold,
    )

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    prompt_ids = engine.encode(prompt, chat=args.chat)
    check_request(prompt_ids, config, engine.runner)  # before the drafter line, not after
    if drafter is not None and not args.json:
        print(f"[selfspec] {drafter.describe()}", file=sys.stderr)
    on_text = None if args.json else write
    result = engine.generate(prompt_ids, drafter, config=config, on_text=on_text)
    learned = _learn(engine, prompt_ids, result.token_ids) if args.learn else None
    if learned_table is not None:
        learned_table.save(drafter)
    if args.json:
        print(
            json.dumps(
                {
                    "method": method,
                    "model": engine.loaded.name,
                    "drafter": drafter.describe() if drafter is not None else None,
                    **result.to_dict(),
                    "token_ids": result.token_ids,
                    **({"history_tokens": learned} if learned is not None else {}),
                },
                indent=2,
            )
        )
        return 0
    sys.stdout.write("\n")
    print(_stats_line(method, result), file=sys.stderr)
    if learned is not None:
        print(
            f"[selfspec] recorded: the model's history holds {learned} answer tokens to learn "
            f"from (`selfspec train-heads --model {engine.loaded.name} --from-history`)",
            file=sys.stderr,
        )
    return 0


def _learn(engine, prompt_ids: list[int], answer_ids: list[int]) -> int:
    """Record the generation in the model's history; the answer tokens it holds now."""
    from selfspec.training.history import History

    return History.for_model(engine.loaded.key).record(prompt_ids, answer_ids)


# -------------------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line, like every other selfspec error."""

    def error(self, message: str):
        self.exit(2, f"error: {message}. See `{self.prog} --help`.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="selfspec", description=selfspec.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"selfspec {selfspec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", help="list the bundled models and whether each is cached")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--verify", action="store_true", help="checksum every cached file (a start checks sizes)"
    )
    p.add_argument(
        "--check",
        nargs="+",
        metavar="FILE",
        help="say whether each .gguf file (or model folder) loads, in which speed modes, and "
        "which tensor types it holds, without loading it",
    )
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("generate", help="generate text, self-speculatively by default")
    add_generate_arguments(p)
    p.set_defaults(func=cmd_generate)
    for name, (module_name, help_text) in _SUBCOMMAND_MODULES.items():
        module = importlib.import_module(module_name)
        description = getattr(module, "DESCRIPTION", module.__doc__)
        p = sub.add_parser(name, help=help_text, description=description)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The ``selfspec`` command: ``main``, then a quick exit. Tearing the interpreter down module
    by module with torch loaded takes a good part of a second; by the time ``main`` returns every
    file is written (atomically) and every worker joined, so the process flushes its streams, runs
    its exit handlers and ends."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
