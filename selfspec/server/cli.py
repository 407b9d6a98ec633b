"""`selfspec serve`: an OpenAI-compatible HTTP server over one model.

    selfspec serve --model qwen2.5-coder-1.5b --port 8000

then point any OpenAI client at http://127.0.0.1:8000/v1 (any API key, unless --api-key or
SELFSPEC_API_KEY names the one every /v1 route needs). A request alone runs with
the default drafter (context n-gram, draft-head and layer-skip drafts, chosen each round);
concurrent requests share passes: each pass scores every request's next token and the tokens
drafted for it from its own text (selfspec.runtime.batch). A request whose prompt starts with
tokens an earlier one read (a system prompt, a conversation's earlier turns) reads only the rest
(--prefix-cache-mb, selfspec.runtime.prefixes; not in speed mode torch nor for sliding-window
models). Requests wait in a bounded queue and a full queue answers 503. At most --max-batch
requests are generated at once. SIGTERM or Ctrl-C stops accepting, ends what runs and what waits
with an error event, and shuts down.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from selfspec.cliargs import add_model_arguments, check_at_least, load_engine, resolve_plan
from selfspec.errors import SelfSpecError
from selfspec.server.learning import ADOPT_RULES, IdleTraining

DESCRIPTION = __doc__
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 16
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_TOKENS = 1024
DEFAULT_PREFIX_CACHE_MB = 512
DEFAULT_MAX_BODY_KB = 1024
DEFAULT_IDLE_TIMEOUT = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_model_arguments(parser)
    parser.add_argument("--plan", default=None, help="skip plan JSON (default: the model's plan)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"({DEFAULT_PORT})")
    parser.add_argument(
        "--served-name",
        default=None,
        help="model name clients send (default: --model)",
    )
    parser.add_argument(
        "--queue-size",
        type=int,
        default=DEFAULT_QUEUE,
        help=f"requests that may wait; more get 503 (default {DEFAULT_QUEUE})",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"requests generated at once, sharing passes; the rest wait (default "
        f"{DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"new tokens when a request names no max_tokens (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        help="the most new tokens a request may ask for; more get 400 (default: the context "
        "window)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SELFSPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every /v1 route (default: $SELFSPEC_API_KEY; "
        "unset: open)",
    )
    parser.add_argument(
        "--max-body-kb",
        type=int,
        default=DEFAULT_MAX_BODY_KB,
        help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_KB})",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT,
        help="seconds an idle keep-alive connection is held open (default "
        f"{DEFAULT_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for finished requests' keys and values, so a request that starts with the "
        "same tokens (a system prompt, the turns before it) reads only the rest; 0 turns it off; "
        f"not in speed mode torch (default {DEFAULT_PREFIX_CACHE_MB})",
    )
    parser.add_argument(
        "--learn",
        action="store_true",
        help="record each finished request's tokens (bounded, on this machine) for `selfspec "
        "train-heads --from-history`, so the model's draft heads learn from its use, and keep "
        "its recycled drafts' table between runs; off by default, since the record holds what "
        "clients sent",
    )
    defaults = IdleTraining()
    parser.add_argument(
        "--train-idle",
        action="store_true",
        help="with --learn: train the model's draft heads on that record while no request runs "
        "(a process of its own, stopped while requests are served); heads that decode faster "
        "replace the model's",
    )
    parser.add_argument(
        "--train-after",
        type=int,
        default=defaults.after_tokens,
        metavar="TOKENS",
        help="answer tokens recorded since the last training before the next one "
        f"(default {defaults.after_tokens})",
    )
    parser.add_argument(
        "--train-idle-seconds",
        type=float,
        default=defaults.idle_seconds,
        help="seconds without a request before training starts (default "
        f"{defaults.idle_seconds:g})",
    )
    parser.add_argument(
        "--train-budget",
        type=float,
        default=defaults.budget_minutes,
        metavar="MINUTES",
        help=f"time one training may take, pauses aside (default {defaults.budget_minutes:g})",
    )
    parser.add_argument(
        "--train-adopt",
        choices=ADOPT_RULES,
        default=defaults.adopt,
        help="faster: trained heads replace the model's only if they decoded held-out use faster "
        "than the heads before them, than none and than plain decoding; always: whenever a "
        "training finishes (the drafter still uses them only where they pay) (default "
        f"{defaults.adopt})",
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from selfspec.server.app import Limits, Service, create_app
    from selfspec.server.guard import LOOPBACK_HOSTS
    from selfspec.server.scheduler import Scheduler
    from selfspec.training.history import History

    check_at_least("--queue-size", args.queue_size, 1)
    check_at_least("--max-batch", args.max_batch, 1)
    check_at_least("--max-tokens", args.max_tokens, 1)
    check_at_least("--port", args.port, 0)
    check_at_least("--prefix-cache-mb", args.prefix_cache_mb, 0)
    check_at_least("--max-body-kb", args.max_body_kb, 1)
    if args.max_tokens_cap is not None:
        check_at_least("--max-tokens-cap", args.max_tokens_cap, 1)
    if args.idle_timeout <= 0:
        raise SelfSpecError(f"--idle-timeout must be positive, got {args.idle_timeout:g}")
    engine = load_engine(args)
    plan = resolve_plan(engine, args)
    drafter = engine.self_drafter(plan, layer_skip=plan is not None)
    history = History.for_model(engine.loaded.key) if args.learn else None
    learned_table = engine.learned_table() if args.learn else None
    if learned_table is not None:
        learned_table.resume(drafter)
    trainer = idle_trainer(args, engine, history)
    scheduler = Scheduler(
        engine,
        drafter,
        args.queue_size,
        args.max_batch,
        args.prefix_cache_mb << 20,
        history,
        trainer,
        learned_table,
    )
    limits = Limits(args.max_tokens, args.max_tokens_cap, args.max_body_kb << 10, args.api_key)
    service = Service(engine, scheduler, args.served_name or args.model, limits)
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        print(
            f"[selfspec] warning: serving on {args.host} without an API key: anyone who reaches "
            "the port can generate (pass --api-key or set SELFSPEC_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    app = create_app(service)
    app.router.on_shutdown.append(scheduler.stop)
    if trainer is not None:
        app.router.on_shutdown.append(trainer.stop)
    print(
        f"[selfspec] serving {service.model_name} ({engine.loaded.speed}) on "
        f"http://{args.host}:{args.port}/v1"
        f"{' (API key required)' if args.api_key else ''}; {drafter.describe()}"
        f"{f'; recording use in {history.path}' if history else ''}"
        f"{', training the draft heads on it while idle' if trainer else ''}",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the
    # handler it found: ours ends the command with status 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, _terminated)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=args.idle_timeout,
    )
    try:
        _server_class(uvicorn)(config, scheduler).run()
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("[selfspec] server stopped", file=sys.stderr, flush=True)
    return 0


def _server_class(uvicorn):
    """uvicorn's server, ending the running requests' streams as soon as a stop signal comes:
    otherwise an open stream keeps the graceful shutdown waiting until it is cut off.
    (Defined on demand: `selfspec --help` should not import uvicorn.)"""

    class Server(uvicorn.Server):
        def __init__(self, config, scheduler):
            super().__init__(config)
            self.scheduler = scheduler

        def handle_exit(self, sig, frame) -> None:
            self.scheduler.cancel_all()
            super().handle_exit(sig, frame)

    return Server


class _Terminated(Exception):
    pass


def _terminated(_signum, _frame):
    raise _Terminated


def idle_trainer(args: argparse.Namespace, engine, history):
    """The idle training ``--train-idle`` asks for (None without it), its options checked."""
    from selfspec.server.learning import IdleTrainer

    if not args.train_idle:
        return None
    if history is None:
        raise SelfSpecError("--train-idle trains on the record --learn keeps: add --learn")
    check_at_least("--train-after", args.train_after, 1)
    check_at_least("--train-idle-seconds", args.train_idle_seconds, 0)
    if not args.train_budget > 0:
        raise SelfSpecError(f"--train-budget must be a positive number of minutes, got "
                            f"{args.train_budget:g}")  # fmt: skip
    settings = IdleTraining(
        args.train_after, args.train_idle_seconds, args.train_budget, args.train_adopt
    )
    # the training process loads the model as the server did
    model_args = ["--model", args.model, "--device", args.device, "--speed", engine.loaded.speed]
    if args.dtype:
        model_args += ["--dtype", args.dtype]
    hidden = engine.runner.model.config.hidden_size
    return IdleTrainer(engine.loaded.key, model_args, history, settings, hidden)
