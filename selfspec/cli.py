"""The `selfspec` command: a thin layer over the Python API.

Subcommands: models, generate, search, bench, profile. Problems the user can fix are
printed as one `error:` line (exit 2), never as a traceback.
"""

from __future__ import annotations

import selfspec  # noqa: F401  (sets MKL_CBWR before torch is imported)

import argparse
import importlib
import json
import sys

from selfspec.errors import SelfSpecError
from selfspec.models import DEFAULT_MODEL
from selfspec.speed import SPEED_MODES, numerics_note

# Each of these modules provides add_arguments(parser) and run(args) -> int.
_SUBCOMMAND_MODULES = {
    "search": ("selfspec.search", "find a skip plan for a model with an Optuna search"),
    "bench": ("selfspec.bench", "compare plain, self-speculative and dual-model decoding side by side"),
    "profile": ("selfspec.profile", "measure forward-pass costs over 1..16 tokens and a draft step"),
}


def add_model_arguments(parser: argparse.ArgumentParser, model_default: str | None = DEFAULT_MODEL) -> None:
    parser.add_argument("--model", default=model_default,
                        help=f"bundled model name, local HF folder, local .gguf or hub id (default {model_default})")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights dtype (default float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--speed", choices=SPEED_MODES, default="auto",
                        help="weight layout and kernels: packed (selfspec's CPU kernel, float32), gguf (the same "
                             "results from the GGUF file's quantized weights, a fifth of the memory traffic), "
                             "gguf-q8 (those weights times activations rounded to 8 bits, as llama.cpp does: "
                             "faster, but not the float32 model's numerics), torch (the model as transformers "
                             "builds it), cuda-graphs (CUDA: fixed-shape passes replayed as CUDA graphs), cuda-compiled "
                             "(the same through torch.compile: faster passes, a minute of compiling first) or auto "
                             "(cuda-graphs on CUDA, packed on a CPU where it builds; default)")


def torch_dtype(name: str | None):
    import torch

    return getattr(torch, name) if name else None


# ------------------------------------------------------------------------------------ models


def cmd_models(args) -> int:
    from selfspec.models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<20} {'architecture':<12} {'layers':>6} {'GGUF MB':>8}  {'cached':<6} description")
    for r in rows:
        print(f"{r['name']:<20} {r['architecture']:<12} {r['layers']:>6} {r['gguf_mb']:>8}  "
              f"{'yes' if r['cached'] else 'no':<6} {r['description']}")
    return 0


# ---------------------------------------------------------------------------------- generate


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text, or - to read it from stdin")
    add_model_arguments(p, model_default=None)
    plan = p.add_mutually_exclusive_group()
    plan.add_argument("--plan", help="skip plan JSON (default: the committed plan for the model)")
    plan.add_argument("--no-plan", action="store_true", help="start from an empty plan (use with --skip-*)")
    p.add_argument("--skip-attention", default=None, help="attention sublayers to skip, e.g. 3,5,7 or 10-14 (overrides the plan)")
    p.add_argument("--skip-mlp", default=None, help="MLP sublayers to skip (overrides the plan)")
    p.add_argument("--draft-model", default=None, help="draft with a separate model instead of layer skipping")
    p.add_argument("--max-draft", type=int, default=None, help="most tokens drafted per round (default: the plan's)")
    p.add_argument("--threshold", type=float, default=None, help="draft confidence threshold (default: the plan's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--baseline", action="store_true", help="plain autoregressive decoding of the same model")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and stats instead of streaming")


def _read_prompt(arg: str | None) -> str:
    if arg is None:
        raise SelfSpecError("no prompt given: pass the prompt text, or - to read it from stdin.")
    text = sys.stdin.read() if arg == "-" else arg
    if not text.strip():
        raise SelfSpecError("the prompt is empty: give some text to continue.")
    return text


def resolve_plan(engine, args):
    """The plan a command should use: --plan, else the committed default, with --skip-* overrides."""
    from selfspec.plan import DraftPolicy, parse_layer_list

    if getattr(args, "no_plan", False):
        plan = None
    elif getattr(args, "plan", None):
        plan = engine.load_plan(args.plan)
    else:
        plan = engine.default_plan()
    skip_attention = args.skip_attention if getattr(args, "skip_attention", None) is not None else None
    skip_mlp = args.skip_mlp if getattr(args, "skip_mlp", None) is not None else None
    if skip_attention is not None or skip_mlp is not None:
        base_attn = plan.skip_attention if plan else []
        base_mlp = plan.skip_mlp if plan else []
        policy = plan.policy if plan else DraftPolicy()
        plan = engine.make_plan(
            parse_layer_list(skip_attention, "--skip-attention") if skip_attention is not None else base_attn,
            parse_layer_list(skip_mlp, "--skip-mlp") if skip_mlp is not None else base_mlp,
            policy, provenance={"how": "command-line --skip-* flags"})
    return plan


def cmd_generate(args) -> int:
    from selfspec.engine import Engine
    from selfspec.sampling import Sampling

    prompt = _read_prompt(args.prompt)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.max_draft is not None and args.max_draft < 1:
        raise SelfSpecError(f"--max-draft must be at least 1, got {args.max_draft}")
    model = args.model
    if model is None and args.plan:  # a plan knows its model
        from selfspec.plan import load_plan

        model = load_plan(args.plan).model.name
    engine = Engine.load(model or DEFAULT_MODEL, device=args.device, dtype=torch_dtype(args.dtype), speed=args.speed)
    plan, drafter = None, None
    if args.draft_model:
        drafter = engine.model_drafter(args.draft_model)
    elif not args.baseline:
        plan = resolve_plan(engine, args)
        if plan is None:
            raise SelfSpecError(
                f"no skip plan for {engine.loaded.name}: pass --plan, --skip-attention/--skip-mlp, "
                f"--baseline, or run `selfspec search --model {engine.loaded.name}`.")
        drafter = engine.self_drafter(plan)
    method = "autoregressive" if drafter is None else drafter.name
    if plan is not None and not args.json:
        print(f"[selfspec] {plan.describe()}", file=sys.stderr)
    config = engine.decode_config(
        plan, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
        stop_strings=tuple(args.stop), max_draft_tokens=args.max_draft, confidence_threshold=args.threshold)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(prompt, drafter, chat=args.chat, config=config, on_text=None if args.json else write)
    if args.json:
        print(json.dumps({"method": method, "model": engine.loaded.name, **result.to_dict()}, indent=2))
        return 0
    sys.stdout.write("\n")
    s = result.stats
    print(
        f"[selfspec] {method}: {s.new_tokens} tokens in {s.seconds:.2f}s = {s.tokens_per_second:.2f} tok/s; "
        f"{s.target_passes} target passes, mean accepted length {s.mean_accepted_length:.2f}, "
        f"acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted})"
        f"{'; fell back to plain decoding at token %d' % s.fell_back_at_token if s.fell_back else ''}; "
        f"stop: {s.stop_reason}"
        f"{f'; speed mode {result.speed_mode}: {result.numerics}' if numerics_note(result.speed_mode, result.device_type) else ''}",
        file=sys.stderr,
    )
    return 0


# -------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description=selfspec.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"selfspec {selfspec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", help="list the bundled models and whether each is cached")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("generate", help="generate text, self-speculatively by default")
    add_generate_arguments(p)
    p.set_defaults(func=cmd_generate)
    for name, (module_name, help_text) in _SUBCOMMAND_MODULES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
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


if __name__ == "__main__":
    sys.exit(main())
