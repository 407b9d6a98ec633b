"""`selfspec train-heads`: draft heads for a model, trained on its own answers (the model writes
questions and answers them), with ``--from-history`` on what it was used for (``--learn``), or
with ``--texts`` on any texts (the model's own tokens over them).
The training itself is ``selfspec.training.heads``'s. Under ``accelerate launch`` each process
does a share of it (``selfspec.training.ranks``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.training.budget import Budget
from selfspec.training.heads import train_heads
from selfspec.training.history import History
from selfspec.training.ranks import Ranks
from selfspec.training.texts import BUNDLED_TEXTS, text_pairs


def add_arguments(parser) -> None:
    from selfspec.cliargs import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument(
        "--questions", type=int, default=400, help="questions the model writes and answers (400)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=192,
        help="tokens per answer at most (192); with --texts, a longer answer or text is read in "
        "windows of that many tokens",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="draw the answers at this temperature (default 0: greedy); each answer's draw is "
        "seeded by its prompt",
    )
    parser.add_argument("--heads", type=int, default=2, help="heads to train, token 2, 3, ... (2)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the answers (3)")
    parser.add_argument("--layers", type=int, choices=(1, 2), default=2, help="layers per head (2)")
    parser.add_argument(
        "--soft",
        type=float,
        default=0.5,
        help="share of the loss against the model's own distribution of each token, the rest "
        "against the token itself (0.5)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="MINUTES",
        help="stop gathering answers and training in time to end within MINUTES; a rerun with "
        "the same --out resumes from the answers gathered (default: no limit)",
    )
    add_sources(parser)
    parser.add_argument(
        "--no-measure",
        action="store_true",
        help="skip timing the heads on held-out prompts at the end (about a minute)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="heads file to write (default: the user's heads for the model, which "
        "`selfspec generate`, `bench` and `serve` then use)",
    )


def add_sources(parser) -> None:
    """What to learn from besides the model's own answers."""
    parser.add_argument(
        "--from-history",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="train on what the model was used for (recorded by `selfspec generate --learn` and "
        "`selfspec serve --learn`, or the history FILE) instead of answers to questions it "
        "writes, starting from the heads it has",
    )
    parser.add_argument(
        "--texts",
        nargs="?",
        const=str(BUNDLED_TEXTS),
        default=None,
        metavar="FILE",
        help='train on texts the model did not write (JSONL: {"prompt", "answer"}, '
        '{"messages"} or {"text"} per line; .xz too): the heads learn what the model would say '
        "over them; starts from the heads it has. Without FILE: the 9,216 texts that ship with "
        "selfspec (any model; one without a chat template reads them as plain text)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="with --from-history or --texts: start from zeros, not from the model's current heads",
    )


def run(args) -> int:
    from selfspec.cliargs import check_at_least, load_engine
    from selfspec.paths import user_heads_path

    for flag, value in (
        ("--questions", args.questions),
        ("--max-new-tokens", args.max_new_tokens),
        ("--heads", args.heads),
        ("--epochs", args.epochs),
    ):
        check_at_least(flag, value, 1)
    if args.budget is not None and not args.budget > 0:
        raise SelfSpecError(f"--budget must be a positive number of minutes, not {args.budget}")
    if not 0 <= args.temperature <= 2:
        raise SelfSpecError(f"--temperature must be between 0 and 2, not {args.temperature}")
    if args.temperature and (args.from_history is not None or args.texts):
        raise SelfSpecError(
            "--temperature is for answers train-heads writes, not --from-history or --texts"
        )
    if args.texts and args.from_history is not None:
        raise SelfSpecError("--texts and --from-history are two sources: give one of them")
    if not 0 <= args.soft <= 1:
        raise SelfSpecError(f"--soft must be between 0 and 1, not {args.soft}")
    if args.fresh and args.from_history is None and not args.texts:
        raise SelfSpecError(
            "--fresh goes with --from-history or --texts (other training starts from zeros)"
        )
    ranks = Ranks.current()  # several under `accelerate launch`
    if not ranks.main:
        os.environ["SELFSPEC_NO_PROGRESS"] = "1"  # one process's bars are enough
    engine = load_engine(args)
    history = None
    if args.from_history is not None:
        history = History(Path(args.from_history)) if args.from_history else None
        history = history or History.for_model(engine.loaded.key)
    if history is not None and not history.path.is_file():
        raise SelfSpecError(
            f"no history for {engine.loaded.name} at {history.path}: use the model with --learn "
            "(selfspec generate or serve) first"
        )
    texts, lines = None, None
    if args.texts:
        path = Path(args.texts)
        bundled = path.resolve() == BUNDLED_TEXTS.resolve()
        texts, lines = text_pairs(engine, path, args.max_new_tokens, bundled)
    continues = history is not None or texts is not None
    start = starting_heads(engine, args) if continues and not args.fresh else None
    out = Path(args.out) if args.out else user_heads_path(engine.loaded.key)
    work = out.parent / f".{out.name}.work"  # the answers, kept so a stopped run resumes there
    heads = train_heads(
        engine, out, work, args.questions, args.max_new_tokens, args.heads, args.epochs,
        args.layers, args.soft, Budget(args.budget), measure=not args.no_measure,
        history=history, start=start, ranks=ranks, temperature=args.temperature, texts=texts,
        text_lines=lines,
    )  # fmt: skip
    if ranks.main:
        print(report(out, heads))
    return 0


def starting_heads(engine, args):
    """The model's current heads, where heads of ``args``' shape can start from them."""
    heads = engine.default_heads()
    if heads is None:
        return None
    if len(heads) < args.heads or (args.layers == 1 and heads.layers != 1):
        print(
            f"the model's heads ({len(heads)} of {heads.layers} layer(s)) cannot start "
            f"{args.heads} head(s) of {args.layers}: training from zeros",
            file=sys.stderr,
        )
        return None
    return heads


def report(out: Path, heads) -> str:
    info = heads.info
    lines = [
        f"wrote {out}: {len(heads)} head(s) trained on {info['rows']} answer tokens of "
        f"{info['answers']} answers in {info['seconds']} s ({info['learned_tokens']} in all, "
        f"{info['learned_from_use']} from use); held-out first guesses right: "
        + ", ".join(f"{t:.1%}" for t in info["heldout_top1_by_head"])
    ]
    speedup = info.get("decode_speedup")
    if speedup:
        best = max(speedup["without"], speedup.get("before", 0))
        pays = "they pay here" if speedup["with"] > best else "they do not pay here"
        before = (
            f", {speedup['before']:.2f}x with the heads they started from"
            if "before" in speedup
            else ""
        )
        lines.append(
            f"on held-out prompts, self-speculation decoded at {speedup['with']:.2f}x plain "
            f"decoding with them{before} and {speedup['without']:.2f}x without: {pays}"
        )
    return "\n".join(lines)
