"""Command-line pieces every subcommand shares: model flags, plan flags, number checks.

Each subcommand module (``selfspec.cli`` for generate and models, ``selfspec.search.cli``,
``selfspec.bench.cli``, ``selfspec.bench.profiler``) builds its parser from these, so a flag means
the same everywhere and a bad value gets the same one-line error.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from selfspec.errors import SelfSpecError
from selfspec.loading.models import DEFAULT_MODEL
from selfspec.speed.modes import SPEED_MODES

if TYPE_CHECKING:
    import torch

    from selfspec.drafters.heads import DraftHeads
    from selfspec.engine import Engine
    from selfspec.runtime.plan import SkipPlan
    from selfspec.runtime.sampling import Sampling

SPEED_HELP = (
    "weight layout and kernels: packed (selfspec's CPU kernel, float32), gguf (the same results "
    "from the GGUF file's quantized weights, a fifth of the memory traffic), gguf-q8 (those "
    "weights times activations rounded to 8 bits, as llama.cpp does: faster, but not the float32 "
    "model's numerics), torch (the model as transformers builds it), cuda-graphs (CUDA: "
    "fixed-shape passes replayed as CUDA graphs), cuda-compiled (the same through torch.compile: "
    "faster passes, a minute of compiling first) or auto (the fastest this machine runs: "
    "cuda-graphs on CUDA; on a CPU gguf-q8 for a GGUF model, else gguf, packed "
    "for other models; default)"
)


def add_model_arguments(
    parser: argparse.ArgumentParser, model_default: str | None = DEFAULT_MODEL
) -> None:
    parser.add_argument(
        "--model",
        default=model_default,
        help=(
            f"bundled model name, local HF folder, local .gguf or hub id (default {model_default})"
        ),
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weights dtype (default float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--speed", choices=SPEED_MODES, default="auto", help=SPEED_HELP)
    parser.add_argument(
        "--max-memory",
        default=None,
        help="spread the model over devices, e.g. 0=10GiB,1=10GiB,cpu=30GiB (the rest goes to "
        "disk); speed mode torch",
    )


def add_plan_arguments(parser: argparse.ArgumentParser, purpose: str) -> None:
    """--plan and the --skip-* overrides; ``purpose`` says what the plan is for in the help."""
    parser.add_argument(
        "--plan", default=None, help=f"skip plan JSON {purpose} (default: the model's plan)"
    )
    parser.add_argument(
        "--skip-attention",
        default=None,
        help="attention sublayers to skip, e.g. 3,5,7 or 10-14 (overrides the plan)",
    )
    parser.add_argument(
        "--skip-mlp", default=None, help="MLP sublayers to skip (overrides the plan)"
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, seed_default: int | None) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=seed_default)


def sampling_from(args: argparse.Namespace) -> Sampling:
    from selfspec.runtime.sampling import Sampling

    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def torch_dtype(name: str | None) -> torch.dtype | None:
    import torch

    return getattr(torch, name) if name else None


def load_engine(args: argparse.Namespace, model: str | None = None) -> Engine:
    """The engine the model flags ask for."""
    from selfspec.engine import Engine

    target = model is None or model == args.model  # a separate draft model is not spread
    return Engine.load(
        model or args.model,
        device=args.device,
        dtype=torch_dtype(args.dtype),
        speed=args.speed,
        max_memory=getattr(args, "max_memory", None) if target else None,
    )


def check_at_least(flag: str, value: int | float | None, low: int | float) -> None:
    if value is not None and value < low:
        raise SelfSpecError(f"{flag} must be at least {low}, got {value}")


def read_prompt(arg: str | None) -> str:
    """The prompt argument, or standard input for '-'."""
    if arg is None:
        raise SelfSpecError("no prompt given: pass the prompt text, or - to read it from stdin.")
    where = "standard input" if arg == "-" else "the prompt argument"
    try:
        text = sys.stdin.buffer.read().decode("utf-8") if arg == "-" else arg
        text.encode("utf-8")  # an argument of undecodable bytes holds surrogates
    except UnicodeError as exc:
        raise SelfSpecError(
            f"{where} is not UTF-8 text ({exc.reason} at position {exc.start}); convert it first, "
            "e.g. with iconv -t UTF-8."
        ) from None
    if not text.strip():
        raise SelfSpecError("the prompt is empty: give some text to continue.")
    return text


def resolve_heads(engine: Engine, args: argparse.Namespace) -> bool | DraftHeads:
    """--heads as ``Engine.self_drafter`` takes it: True (the model's own), a file's heads (read
    now, once, so a missing or unreadable one is said before any work), or False for "none"."""
    heads = {None: True, "none": False}.get(args.heads, args.heads)
    return engine.load_heads(heads) if isinstance(heads, str) else heads


def resolve_plan(engine: Engine, args: argparse.Namespace) -> SkipPlan | None:
    """The plan a command should use: --plan, else the model's default, with --skip-* overrides."""
    from selfspec.runtime.plan import DraftPolicy, parse_layer_list

    if getattr(args, "no_plan", False):
        plan = None
    elif getattr(args, "plan", None):
        plan = engine.load_plan(args.plan)
    else:
        plan = engine.default_plan()
    skip_attention = getattr(args, "skip_attention", None)
    skip_mlp = getattr(args, "skip_mlp", None)
    if skip_attention is None and skip_mlp is None:
        return plan
    policy = plan.policy if plan else DraftPolicy()
    return engine.make_plan(
        parse_layer_list(skip_attention, "--skip-attention")
        if skip_attention is not None
        else (plan.skip_attention if plan else []),
        parse_layer_list(skip_mlp, "--skip-mlp")
        if skip_mlp is not None
        else (plan.skip_mlp if plan else []),
        policy,
        provenance={"how": "command-line --skip-* flags"},
    )
