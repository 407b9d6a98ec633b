"""`selfspec serve`: an OpenAI-compatible HTTP server over one model.

    selfspec serve --model qwen2.5-coder-1.5b --port 8000

then point any OpenAI client at http://127.0.0.1:8000/v1 (any API key). A request alone runs with
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
import signal
import sys

from selfspec.cliargs import add_model_arguments, check_at_least, load_engine, resolve_plan

DESCRIPTION = __doc__
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 16
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_TOKENS = 1024
DEFAULT_PREFIX_CACHE_MB = 512


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
        "--prefix-cache-mb",
        type=int,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for finished requests' keys and values, so a request that starts with the "
        "same tokens (a system prompt, the turns before it) reads only the rest; 0 turns it off; "
        f"not in speed mode torch (default {DEFAULT_PREFIX_CACHE_MB})",
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from selfspec.server.app import Service, create_app
    from selfspec.server.scheduler import Scheduler

    check_at_least("--queue-size", args.queue_size, 1)
    check_at_least("--max-batch", args.max_batch, 1)
    check_at_least("--max-tokens", args.max_tokens, 1)
    check_at_least("--port", args.port, 0)
    check_at_least("--prefix-cache-mb", args.prefix_cache_mb, 0)
    engine = load_engine(args)
    plan = resolve_plan(engine, args)
    drafter = engine.self_drafter(plan, layer_skip=plan is not None)
    scheduler = Scheduler(
        engine, drafter, args.queue_size, args.max_batch, args.prefix_cache_mb << 20
    )
    service = Service(engine, scheduler, args.served_name or args.model, args.max_tokens)
    app = create_app(service)
    app.router.on_shutdown.append(scheduler.stop)
    print(
        f"[selfspec] serving {service.model_name} ({engine.loaded.speed}) on "
        f"http://{args.host}:{args.port}/v1; {drafter.describe()}",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the
    # handler it found: ours ends the command with status 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, _terminated)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
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
