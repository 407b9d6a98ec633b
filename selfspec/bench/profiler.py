"""Measure what speculation costs: cached forward passes over 1..16 tokens, a layer-skip draft
step, a draft of the draft heads' guesses, and whether that draft would pay running beside the
verify pass (speculating ahead) instead of before it.

Speculative decoding pays only when scoring k+1 tokens in one pass costs about one pass,
and a draft step costs much less than a target step. This prints both, for selfspec's
runner and for plain transformers on the same weights (200-token cached prefix, median of
several repeats), and the draft length those costs imply for a given acceptance rate.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from selfspec.cliargs import (
    add_model_arguments,
    add_plan_arguments,
    check_at_least,
    load_engine,
    resolve_heads,
    resolve_plan,
)
from selfspec.errors import SelfSpecError
from selfspec.runtime.plan import parse_layer_list

if TYPE_CHECKING:
    from selfspec.drafters.heads import DraftHeads

SIZES = (1, 2, 4, 8, 16)
MAX_ROWS = 64


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    add_plan_arguments(parser, "whose draft step to time")
    parser.add_argument(
        "--prefix",
        type=int,
        default=200,
        help="cached prefix length (default 200); a pass's cost grows with the context it reads",
    )
    parser.add_argument(
        "--rows",
        default=",".join(map(str, SIZES)),
        help="pass sizes to time, in tokens, e.g. 1-8,12,16 (default %(default)s; 1 is always "
        f"timed; at most {MAX_ROWS})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=9,
        help="rounds of measurements (each pass size and the draft step take turns in a round); "
        "medians are reported",
    )
    parser.add_argument(
        "--fastest",
        action="store_true",
        help="report each measurement's fastest round instead of the median: on a machine shared "
        "with others (a VM), the fastest of several rounds measures the code, the median the "
        "neighbours too; for comparing two builds one after the other",
    )
    parser.add_argument(
        "--acceptance",
        type=float,
        default=None,
        help=(
            "per-token draft acceptance for the best-draft-length estimate (default: the plan's "
            "measured one, else 0.8)"
        ),
    )
    parser.add_argument(
        "--heads",
        default=None,
        help="draft heads file whose guesses to time (default: the model's, if any; none: not "
        "timed)",
    )
    parser.add_argument("--json", action="store_true")


def _timed_ms(fn) -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000


def summary(fastest: bool):
    """How several rounds' timings become one figure: their median, or with ``fastest`` the
    least."""
    return min if fastest else statistics.median


def _summary_ms(fn, repeats: int, summarize) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    return summarize([_timed_ms(fn) for _ in range(repeats)])


def _interleaved_ms(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Each function timed ``repeats`` times, taking turns (one call of each per round), so that
    a machine whose speed drifts from minute to minute slows them all alike."""
    for fn in fns.values():
        fn()  # warm-up: first calls allocate and pick kernels
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed_ms(fn))
    return times


def cached_prefix(runner, prefix: int, new: int, vocab: int = 30000):
    """A fresh cache holding ``prefix`` random token ids (seed 0), with room for ``new`` more:
    returns those ids and ``new`` further ones to time passes over."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(100, min(vocab, 30000), (prefix,), generator=gen)
    new_ids = torch.randint(100, min(vocab, 30000), (new,), generator=gen)
    runner.reset(prefix + new + 1)
    runner.forward(prefix_ids, 0, last_logits_only=True)
    return prefix_ids, new_ids


def profile_engine(
    engine,
    plan=None,
    prefix: int = 200,
    repeats: int = 9,
    acceptance: float | None = None,
    heads: DraftHeads | None = None,
    rows: Sequence[int] = SIZES,
    fastest: bool = False,
) -> dict:
    """What passes over each of ``rows`` tokens after a ``prefix``-token cached prefix cost, and
    (given them) the plan's draft step and the heads' draft, medians of ``repeats`` rounds (with
    ``fastest``: their fastest round)."""
    import torch

    from selfspec.loading.models import unmodified

    runner, loaded = engine.runner, engine.loaded
    model = unmodified(loaded).model  # "plain transformers on the same weights"
    rows = sorted({1, *rows})
    prefix_ids, new_ids = cached_prefix(runner, prefix, max(rows), model.config.vocab_size)

    times = _interleaved_ms(_passes(runner, prefix_ids, new_ids, rows, plan, heads), repeats)
    summarize = summary(fastest)
    forward_ms = {str(n): summarize(times[str(n)]) for n in rows}
    hf_forward_ms = _hf_forward_ms(
        model, runner.device, prefix_ids, new_ids, rows, repeats, summarize
    )
    result = {
        "model": engine.loaded.name,
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "speed_mode": loaded.speed,
        "threads": torch.get_num_threads(),
        "prefix": prefix,
        "statistic": "fastest" if fastest else "median",
        "forward_ms": forward_ms,
        "hf_forward_ms": hf_forward_ms,
        "speedup_vs_hf_1_token": hf_forward_ms["1"] / forward_ms["1"],
    }
    if "8" in forward_ms:
        result["verify_ratio_8_over_1"] = forward_ms["8"] / forward_ms["1"]
    if plan is not None:
        alpha = acceptance
        if alpha is None:
            alpha = plan.provenance.get("acceptance_rate") or 0.8
        result.update(_draft_figures(times, alpha, forward_ms, summarize))
    if heads is not None:
        result.update(_head_figures(times, len(heads), max(rows), summarize))
    return result


def _passes(runner, prefix_ids, new_ids, rows, plan, heads: DraftHeads | None) -> dict:
    """What to time, by name: cached passes over each of ``rows`` tokens after ``prefix_ids``, the
    plan's draft step (as its drafter runs it: capture, draft head) and the heads' draft with the
    rounds around it."""
    prefix = len(prefix_ids)
    passes = {str(n): lambda n=n: runner.forward(new_ids[:n], prefix) for n in rows}
    if plan is not None:
        from selfspec.drafters import SelfSkipDrafter

        drafter = SelfSkipDrafter(runner, plan)
        passes["draft"] = lambda: runner.forward(
            new_ids[:1],
            prefix,
            drafter.skip_attention,
            drafter.skip_mlp,
            capture_at=drafter.resume_at,
            vocab=drafter.vocab,
        )
    if heads is not None:
        head_draft = _head_draft(runner, heads, prefix_ids.tolist())
        passes["heads"] = head_draft
        # a round's verify pass over the pending token and every guess
        round_rows = min(len(heads) + 1, max(rows))
        round_pass = partial(runner.forward, new_ids[:round_rows], prefix)
        passes.update(_ahead_rounds(round_pass, head_draft, runner.device))
    return passes


def _hf_forward_ms(
    model, device, prefix_ids, new_ids, rows, repeats: int, summarize
) -> dict[str, float]:
    """Plain transformers' cached passes over each of ``rows`` tokens after ``prefix_ids``."""
    import torch
    from transformers import DynamicCache

    hf_cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(prefix_ids[None].to(device), past_key_values=hf_cache, use_cache=True)

    def hf_step(n):
        with torch.inference_mode():
            model(new_ids[None, :n].to(device), past_key_values=hf_cache, use_cache=True)
        # drop the n new tokens again (negative: works across transformers versions)
        hf_cache.crop(-n)

    return {str(n): _summary_ms(lambda n=n: hf_step(n), repeats, summarize) for n in rows}


def _draft_figures(times: dict, alpha: float, forward_ms: dict, summarize) -> dict:
    draft_ms = summarize(times["draft"])
    # each draft step over the one-token pass timed beside it: robust to drift between rounds
    ratio = summarize([d / f for d, f in zip(times["draft"], times["1"])])
    return dict(
        draft_step_ms=draft_ms,
        draft_cost_ratio=ratio,
        acceptance_assumed=alpha,
        **best_draft_length(alpha, draft_ms, forward_ms),
    )


def _head_figures(times: dict, guesses: int, most_rows: int, summarize) -> dict:
    return dict(
        head_guesses=guesses,
        head_draft_ms=summarize(times["heads"]),
        head_guess_cost_ratio=summarize(
            [h / guesses / f for h, f in zip(times["heads"], times["1"])]
        ),
        ahead_pass_tokens=min(guesses + 1, most_rows),
        ahead_sequential_ms=summarize(times["draft, then pass"]),
        ahead_beside_ms=summarize(times["draft beside pass"]),
    )


def _ahead_rounds(round_pass, draft, device) -> dict:
    """A round with the draft made before its verify pass, and with the draft made beside it, in a
    thread of its own (on CUDA, on a stream of its own): speculating ahead, as if the next draft's
    inputs were known before the pass ends. It pays only where the second is faster."""
    import torch

    def own_thread():
        if device.type != "cuda":
            return draft()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            draft()
        stream.synchronize()

    def beside():
        worker = threading.Thread(target=own_thread)
        worker.start()
        round_pass()
        worker.join()

    return {"draft, then pass": lambda: (draft(), round_pass()), "draft beside pass": beside}


def _head_draft(runner, heads: DraftHeads, context: list[int]):
    """A draft of every head's guess, as the default drafter makes it (from the last pass's final
    hidden state; the chain not cut short), to time."""
    from selfspec.drafters.base import DraftRequest, DraftSettings
    from selfspec.drafters.heads import HeadDrafter
    from selfspec.runtime.sampling import Sampling

    drafter = HeadDrafter(runner, heads)
    drafter.begin(context, len(context) + 1, DraftSettings())
    request = DraftRequest(context, len(heads), Sampling(), None)
    return lambda: drafter.draft(request)


def best_draft_length(alpha: float, draft_ms: float, forward_ms: dict) -> dict:
    """Draft length k maximising expected tokens per ms with i.i.d. per-token acceptance alpha.

    Expected tokens per round = (1 - alpha^(k+1)) / (1 - alpha); a round costs k draft steps
    plus one verify pass over k+1 tokens (interpolated from the measured sizes).
    """
    sizes = sorted(int(s) for s in forward_ms)

    def verify_ms(m):
        lo = max([s for s in sizes if s <= m], default=sizes[0])
        hi = min([s for s in sizes if s >= m], default=sizes[-1])
        if hi == lo:
            return forward_ms[str(lo)]
        w = (m - lo) / (hi - lo)
        return forward_ms[str(lo)] * (1 - w) + forward_ms[str(hi)] * w

    best = (0, 1.0 / forward_ms["1"])
    for k in range(1, 16):
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        rate = tokens / (k * draft_ms + verify_ms(k + 1))
        if rate > best[1]:
            best = (k, rate)
    return {"best_draft_length": best[0], "predicted_speedup": best[1] * forward_ms["1"]}


def run(args) -> int:
    check_at_least("--repeats", args.repeats, 1)
    check_at_least("--prefix", args.prefix, 1)
    rows = parse_layer_list(args.rows, "--rows", "a number of tokens")
    if not rows or min(rows) < 1 or max(rows) > MAX_ROWS:
        raise SelfSpecError(f"--rows: give pass sizes from 1 to {MAX_ROWS}, e.g. 1,2,4,8,16")
    engine = load_engine(args)
    plan = resolve_plan(engine, args)
    heads = engine.resolve_heads(resolve_heads(engine, args))
    result = profile_engine(
        engine,
        plan,
        prefix=args.prefix,
        repeats=args.repeats,
        acceptance=args.acceptance,
        heads=heads,
        rows=rows,
        fastest=args.fastest,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['model']} on {result['device']} ({result['dtype']}, speed mode "
        f"{result['speed_mode']}, "
        f"{result['threads']} threads), "
        f"{result['prefix']}-token cached prefix, "
        f"{'the fastest' if args.fastest else 'medians'} of {args.repeats} rounds"
    )
    print(f"{'tokens':>6} {'selfspec ms':>12} {'transformers ms':>16} {'ratio to 1 token':>17}")
    for n in map(int, result["forward_ms"]):
        s, h = result["forward_ms"][str(n)], result["hf_forward_ms"][str(n)]
        print(f"{n:>6} {s:>12.1f} {h:>16.1f} {s / result['forward_ms']['1']:>17.2f}")
    if plan is not None:
        print(
            f"draft step ({len(plan.skip_attention)} attention + {len(plan.skip_mlp)} MLP "
            f"sublayers skipped): {result['draft_step_ms']:.1f} ms = "
            f"{result['draft_cost_ratio']:.2f} of a full step"
        )
        print(
            f"at acceptance {result['acceptance_assumed']:.2f}: best draft length "
            f"{result['best_draft_length']}, "
            f"predicted speedup {result['predicted_speedup']:.2f}x"
        )
    if "head_draft_ms" in result:
        print(
            f"head draft ({result['head_guesses']} chained guesses): "
            f"{result['head_draft_ms']:.1f} ms = {result['head_guess_cost_ratio']:.3f} of a full "
            "step per guess"
        )
        sequential, beside = result["ahead_sequential_ms"], result["ahead_beside_ms"]
        print(
            f"speculating ahead (that draft in a thread of its own beside the verify pass over "
            f"{result['ahead_pass_tokens']} tokens): {beside:.1f} ms a round, "
            f"against {sequential:.1f} ms one after the other: "
            + ("would pay here" if beside < sequential else "does not pay here")
        )
    return 0
