"""Find a skip plan for a model: an Optuna search over a measured model of decoding speed.

Search space: one boolean "skip" flag per attention sublayer and per MLP sublayer, plus the
draft policy (max_draft_tokens 2..10, confidence_threshold 0..0.9, adaptive_threshold).
The sampler is multivariate TPE; the first trials are warm starts (the plan already at --out
if there is one, nothing skipped, evenly spaced skips in the middle layers and a few seeded
random sparse plans).

Running every trial as a real generation would be far too slow, so each trial is scored by a
speed model built from measured quantities:

  1. once per study, the full model's own greedy continuations of the calibration prompts
     (cached on disk beside the plan, keyed by model fingerprint, prompts and length);
  2. once per study, measured costs (stored in the study, so every trial and every worker
     uses the same ones): a plain decoding step, a verify pass over k = 1..12 tokens and the
     cost of one attention and one MLP sublayer (full step vs. steps with all attention or
     all MLPs skipped), so a draft step with any skip set costs embedding/head + the kept
     sublayers;
  3. per trial, one teacher-forced forward of the draft over each continuation (the prompt's
     keys/values are the full model's, as in real decoding), giving the draft's argmax and top
     probability at every position; greedy speculation is then replayed round by round
     exactly as the decode loop runs it (threshold, adaptive threshold, max draft, room left)
     and the predicted speedup is plain-step time / (round time / tokens per round).

Trials whose draft agrees with the target on fewer than 30% of positions after the first
prompt are pruned. Afterwards the best --confirm distinct trials are timed for real (greedy
generation, interleaved with plain decoding, prompt by prompt, with the decode loop's
fallback to plain decoding off so each plan's own speed is measured) and the truly fastest
one (median per-prompt speedup) is written to --out with its provenance, beside a report.md
and an importance.png.

Resuming: the study lives in an Optuna storage, by default a SQLite file beside the plan
(search/<model>/study.db), under a name derived from the model and the calibration settings.
Re-running the same command resumes it: trials already finished count towards --trials and
only the rest are run. Ctrl-C stops the search and still writes the best plan found so far.

Several machines can share one study: point them all at one database and the same study,
e.g. on each machine

    pip install psycopg2-binary            # or pymysql for MySQL
    selfspec search --model qwen2.5-coder-1.5b --trials 200 \\
        --storage postgresql://user:password@db-host/optuna --study qwen15-shared

Each worker runs trials until the study holds --trials finished ones (counting the others'),
and the cost model measured by the first worker is stored in the study and reused by all, so
their scores stay comparable (use machines of one kind). Any Optuna storage URL works
(sqlite:///path.db, postgresql://..., mysql+pymysql://...). Passwords are never written
into the plan or the report.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import io
import os
import json
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from selfspec.errors import SelfSpecError
from selfspec.plan import atomic_write_bytes

DEFAULT_PROMPTS = "spec-bench:coding,math_reasoning,math"
DEFAULT_LIMIT = 1
DEFAULT_TOKENS = 48
DEFAULT_TRIALS = 60
DEFAULT_CONFIRM = 3
MAX_DRAFT_RANGE = (2, 10)
# Draft heads over the first N token ids (0: the whole vocabulary); sizes at or past the vocabulary drop out.
DRAFT_VOCAB_CHOICES = (0, 16384, 32768, 65536)
THRESHOLD_RANGE = (0.0, 0.9)
THRESHOLD_STEP = 0.05
MIN_AGREEMENT = 0.3  # prune a trial whose draft agrees with the target less often than this
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12)
TARGET_ACCEPTANCE = 0.8  # selfspec.decode.DecodeConfig.target_acceptance (checked in tests)
CALIBRATION_VERSION = 1


# ====================================================================== the speed model


@dataclass
class CostModel:
    """Measured seconds of the passes a speculative round is made of (one device, one context length)."""

    full_step: float  # a plain decoding step: one token through the full model, prefix cached
    base_step: float  # one token with every sublayer skipped: embedding, final norm, head, argmax
    attention: float  # one attention sublayer for one token (mean over layers)
    mlp: float  # one MLP sublayer for one token (mean over layers)
    num_layers: int
    verify_sizes: list[int]
    verify: list[float]  # full forward over k tokens (k in verify_sizes), argmax included
    verify_base: list[float]  # the same with every sublayer skipped (embedding + head over k rows)
    context: int = 0  # cached prefix length the costs were measured at
    draft_overhead: float = 0.0  # softmax/top-prob/argmax per draft step, on top of the forward
    head: float = 0.0  # the output layer over the whole vocabulary, for one token (inside base_step)
    vocab: int = 0  # rows of the output layer

    @staticmethod
    def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
        if x <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]  # extrapolate linearly past the last size
        return y1 + (y1 - y0) * (x - x1) / (x1 - x0)

    def draft_step(self, attention_kept: int, mlp_kept: int, draft_vocab: int = 0) -> float:
        """A draft step; ``draft_vocab`` > 0: its head scores only that many token ids (cost linear in rows)."""
        saved = self.head * (1 - draft_vocab / self.vocab) if 0 < draft_vocab < self.vocab else 0.0
        return self.base_step - saved + self.draft_overhead + attention_kept * self.attention + mlp_kept * self.mlp

    def prefix_fraction(self, first_skipped_sublayer: int) -> float:
        """Share of the layer stack's cost before the first skipped sublayer (the verify pass resumes there)."""
        s = first_skipped_sublayer
        attention_before, mlp_before = (s + 1) // 2, s // 2
        total = self.num_layers * (self.attention + self.mlp)
        return (attention_before * self.attention + mlp_before * self.mlp) / total if total > 0 else 0.0

    def verify_cost(self, rows: int, tail_rows: int, prefix_fraction: float = 0.0) -> float:
        """A verify pass over ``rows`` tokens that resumes from the draft's hidden states at the first
        skipped sublayer; ``tail_rows`` rows (0 or 1) the draft did not cover run the prefix too."""
        total = self._interp(self.verify_sizes, self.verify, rows)
        base = self._interp(self.verify_sizes, self.verify_base, rows)
        stack = max(0.0, total - base)
        stack_one = max(0.0, self._interp(self.verify_sizes, self.verify, 1) - self._interp(
            self.verify_sizes, self.verify_base, 1))
        return base + (1.0 - prefix_fraction) * stack + prefix_fraction * stack_one * tail_rows

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(**data)


@dataclass
class SimResult:
    """Outcome of replaying greedy speculation along a known continuation."""

    tokens: int = 0  # tokens emitted by target passes (the prefill's token excluded)
    rounds: int = 0  # target passes
    drafted: int = 0
    accepted: int = 0
    draft_steps: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0  # the same tokens by plain decoding

    def __add__(self, other: "SimResult") -> "SimResult":
        return SimResult(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 0.0


def simulate(
    agree: Sequence[bool],
    confidence: Sequence[float],
    *,
    max_draft: int,
    threshold: float,
    adaptive: bool,
    draft_step_cost: float,
    verify_cost: Callable[[int, int], float],
    plain_step_cost: float,
    target_acceptance: float = TARGET_ACCEPTANCE,
) -> SimResult:
    """Replay selfspec's greedy decode loop along a continuation c_0..c_n of the target.

    ``agree[i]``: the draft's argmax after c_0..c_i equals c_{i+1}; ``confidence[i]``: its top
    probability there (i = 0..n-1). c_0 comes from prefill, so n tokens are left to emit. Each
    round starting with pending token c_j drafts while confidence >= threshold (a step that
    falls below it is still paid) and up to min(max_draft, room - 1) tokens; the longest agreeing
    prefix is accepted, plus the target's own token. ``verify_cost(rows, tail_rows)`` is the
    verify pass over rows = drafted + 1 tokens, of which ``tail_rows`` had no draft step.
    The adaptive threshold moves exactly as in selfspec.decode.generate_ids.
    """
    n = len(agree)
    if len(confidence) != n:
        raise ValueError("agree and confidence must have the same length")
    result = SimResult()
    total = n + 1  # continuation length, c_0 included
    generated = 1
    j = 0  # index of the pending token
    thr = threshold
    ema = target_acceptance
    while generated < total:
        room = total - generated
        limit = min(max_draft, room - 1) if room > 1 else 0
        drafted = steps = 0
        for offset in range(limit):
            steps += 1
            if confidence[j + offset] < thr:
                break
            drafted += 1
        accepted = 0
        while accepted < drafted and agree[j + accepted]:
            accepted += 1
        rows = drafted + 1
        tail = rows - min(steps, rows)
        result.seconds += steps * draft_step_cost + verify_cost(rows, tail)
        result.rounds += 1
        result.drafted += drafted
        result.accepted += accepted
        result.draft_steps += steps
        result.tokens += accepted + 1
        generated += accepted + 1
        j += accepted + 1
        if adaptive and drafted:
            ema = 0.7 * ema + 0.3 * (accepted / drafted)
            step = 0.05 if ema < target_acceptance else -0.05
            thr = min(0.95, max(0.0, thr + step))
    result.plain_seconds = result.tokens * plain_step_cost
    return result


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _non_decreasing(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): a pass over more tokens never costs less."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]
    return [m for m, c in blocks for _ in range(c)]


def measure_costs(runner, context_ids: list[int], repeats: int = 5, sizes: Sequence[int] = VERIFY_SIZES) -> CostModel:
    """Time the passes of a round on ``runner`` with ``context_ids`` cached.

    Every measurement is repeated ``repeats`` times, interleaved, and the fastest repeat is kept: on a
    shared machine the fastest run is the one least disturbed by other work, so it estimates the
    pass's own cost far more stably than the median (which drifts with the machine's load).
    """
    import torch

    L = runner.num_layers
    every = frozenset(range(L))
    context = list(context_ids)
    start = len(context)
    runner.reset(start + max(sizes) + 4)
    runner.forward(torch.tensor(context), 0, last_logits_only=True)
    token = torch.tensor([context[-1]])
    ids_k = {k: torch.tensor((context * (1 + k // max(1, len(context))))[-k:]) for k in sizes}

    vocab = runner.head_rows

    def single(skip_attention, skip_mlp, head_rows=None) -> float:
        t0 = time.perf_counter()
        logits, _ = runner.forward(token, start, skip_attention, skip_mlp, vocab=head_rows)
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - t0

    def overhead() -> float:
        logits = torch.randn(1, runner.loaded.model.config.vocab_size)
        t0 = time.perf_counter()
        q = torch.softmax(logits[-1], dim=-1)
        float(q.max())
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - t0

    def verify(k: int, skip: frozenset) -> float:
        t0 = time.perf_counter()
        logits, _ = runner.forward(ids_k[k], start, skip, skip)
        torch.argmax(logits, dim=-1).tolist()
        return time.perf_counter() - t0

    variants = {"full": (frozenset(), frozenset(), None), "no_attention": (every, frozenset(), None),
                "no_mlp": (frozenset(), every, None), "none": (every, every, None),
                "none_tiny_head": (every, every, 64)}
    for sa, sm, rows in variants.values():  # warm-up
        single(sa, sm, rows)
    verify(max(sizes), frozenset())
    times: dict[str, list[float]] = {name: [] for name in variants}
    times["overhead"] = []
    vt: dict[int, list[float]] = {k: [] for k in sizes}
    vb: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(repeats):
        for name, (sa, sm, rows) in variants.items():
            times[name].append(single(sa, sm, rows))
        times["overhead"].append(overhead())
        for k in sizes:
            vt[k].append(verify(k, frozenset()))
            vb[k].append(verify(k, every))
    med = {name: min(v) for name, v in times.items()}
    verify_med = _non_decreasing([min(vt[k]) for k in sizes])
    verify_base_med = _non_decreasing([min(vb[k]) for k in sizes])
    # Split the layer stack's cost (full minus nothing) between attention and MLP in the measured
    # proportion, so a draft that skips nothing costs exactly a plain step.
    stack = max(0.0, med["full"] - med["none"])
    raw_attention = max(0.0, med["full"] - med["no_attention"])
    raw_mlp = max(0.0, med["full"] - med["no_mlp"])
    share = raw_attention / (raw_attention + raw_mlp) if raw_attention + raw_mlp > 0 else 0.5
    return CostModel(
        full_step=med["full"],
        base_step=med["none"],
        attention=stack * share / L,
        mlp=stack * (1 - share) / L,
        num_layers=L,
        verify_sizes=list(sizes),
        verify=verify_med,
        verify_base=verify_base_med,
        context=start,
        draft_overhead=med["overhead"],
        head=max(0.0, med["none"] - med["none_tiny_head"]) * vocab / max(1, vocab - 64),
        vocab=vocab,
    )


# ====================================================================== calibration data


@dataclass
class CalibrationItem:
    id: str
    category: str
    prompt_ids: list[int]
    continuation: list[int]  # the full model's greedy continuation, c_0 (from prefill) first


@dataclass
class TrialEval:
    """A skip set and policy scored by the speed model."""

    sim: SimResult
    agreement: float  # share of positions where the draft's argmax equals the target's token
    draft_step: float
    pruned: bool = False

    @property
    def predicted_speedup(self) -> float:
        return self.sim.speedup


class SpeedModel:
    """Scores a skip set and draft policy: teacher-forced draft passes + replayed speculation."""

    def __init__(self, engine, items: list[CalibrationItem], costs: CostModel):
        import torch

        self.engine, self.items, self.costs = engine, [i for i in items if len(i.continuation) >= 2], costs
        if not self.items:
            raise SelfSpecError("every calibration continuation is shorter than 2 tokens (the model stopped at once); "
                                "use other prompts or more --tokens.")
        self.runner = engine.runner
        self.max_len = max(len(i.prompt_ids) + len(i.continuation) for i in self.items) + 2
        self.runner.reset(self.max_len)
        self.snapshots = []  # the full model's keys/values over each prompt
        for item in self.items:
            P = len(item.prompt_ids)
            self.runner.forward(torch.tensor(item.prompt_ids), 0, last_logits_only=True)
            cache = self.runner.cache
            self.snapshots.append((cache.keys[:, :, :, :P].clone(), cache.values[:, :, :, :P].clone()))

    def draft_predictions(self, index: int, skip_attention, skip_mlp, draft_vocab: int = 0):
        """(agree [n] bool list, top probability [n] list) of the draft along item ``index``'s continuation."""
        import torch

        item = self.items[index]
        P = len(item.prompt_ids)
        self.runner.reset(self.max_len)
        keys, values = self.snapshots[index]
        self.runner.cache.keys[:, :, :, :P].copy_(keys)
        self.runner.cache.values[:, :, :, :P].copy_(values)
        logits, _ = self.runner.forward(torch.tensor(item.continuation[:-1]), P,
                                        frozenset(skip_attention), frozenset(skip_mlp), vocab=draft_vocab or None)
        top, arg = torch.softmax(logits, dim=-1).max(dim=-1)
        agree = (arg == torch.tensor(item.continuation[1:])).tolist()
        return agree, top.tolist()

    def evaluate(self, skip_attention, skip_mlp, max_draft: int, threshold: float, adaptive: bool,
                 on_prompt: Callable[[int, float], bool] | None = None, draft_vocab: int = 0) -> TrialEval:
        """Score a plan. ``on_prompt(index, agreement so far)`` may return True to stop early (pruned)."""
        from selfspec.plan import SkipPlan, ModelIdentity

        L = self.costs.num_layers
        skip_attention, skip_mlp = sorted(set(skip_attention)), sorted(set(skip_mlp))
        probe = SkipPlan(ModelIdentity("", "", L, ""), skip_attention, skip_mlp)
        costs = self.costs
        draft_step = costs.draft_step(L - len(skip_attention), L - len(skip_mlp), draft_vocab)
        fraction = costs.prefix_fraction(probe.first_skipped_sublayer())

        def verify_cost(rows, tail):
            return costs.verify_cost(rows, tail, fraction)

        total, agreed, positions = SimResult(), 0, 0
        for index in range(len(self.items)):
            agree, confidence = self.draft_predictions(index, skip_attention, skip_mlp, draft_vocab)
            agreed += sum(agree)
            positions += len(agree)
            total = total + simulate(agree, confidence, max_draft=max_draft, threshold=threshold, adaptive=adaptive,
                                     draft_step_cost=draft_step, verify_cost=verify_cost,
                                     plain_step_cost=costs.full_step)
            if on_prompt is not None and on_prompt(index, agreed / positions):
                return TrialEval(total, agreed / positions, draft_step, pruned=True)
        return TrialEval(total, agreed / positions if positions else 0.0, draft_step)


def calibration_key(engine, prompt_ids: list[list[int]], tokens: int) -> str:
    loaded = engine.loaded
    payload = json.dumps({
        "version": CALIBRATION_VERSION, "fingerprint": engine.identity.fingerprint,
        "architecture": engine.identity.architecture, "layers": engine.identity.num_layers,
        "device": str(loaded.device), "dtype": str(loaded.dtype), "speed": loaded.speed, "tokens": tokens,
        "prompts": prompt_ids,
    }, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def load_or_make_calibration(engine, prompts, prompt_ids: list[list[int]], tokens: int, key: str,
                             folder: Path | None, log=None) -> list[CalibrationItem]:
    """The full model's greedy continuations, from ``folder``/calibration-<key>.json when it is there."""
    from selfspec.plan import atomic_write_text

    path = folder / f"calibration-{key[:12]}.json" if folder is not None else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return [CalibrationItem(**row) for row in data["items"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache is simply rebuilt
    items = []
    for number, (prompt, ids) in enumerate(zip(prompts, prompt_ids), 1):
        if log:
            log(f"calibration {number}/{len(prompts)}: greedy continuation of prompt {prompt.id} ({prompt.category}, "
                f"{len(ids)} prompt tokens)")
        result = engine.generate(list(ids), None, max_new_tokens=tokens)
        items.append(CalibrationItem(prompt.id, prompt.category, list(ids), list(result.token_ids)))
    if path is not None:
        atomic_write_text(path, json.dumps({
            "key": key, "model": engine.loaded.name, "fingerprint": engine.identity.fingerprint, "tokens": tokens,
            "items": [asdict(i) for i in items]}) + "\n")
    return items


# ====================================================================== studies


def redact(url: str) -> str:
    """An URL with its password replaced by ***."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def _storage_text(url: str) -> str:
    """The storage URL to show and record: password redacted, a SQLite file under the working folder relative."""
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        try:
            if path.is_absolute():
                return "sqlite:///" + str(path.relative_to(Path.cwd()))
        except ValueError:
            pass
        return url
    return redact(url)


def _silence_optuna():
    import logging
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.logging.disable_default_handler()
    logging.getLogger("optuna").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def open_storage(url: str):
    """An Optuna storage for ``url``, or a clear SelfSpecError saying why it cannot be opened."""
    optuna = _silence_optuna()
    if not isinstance(url, str) or "://" not in url:
        raise SelfSpecError(
            f"--storage '{url}' is not a storage URL. Use e.g. sqlite:///search/study.db, "
            "postgresql://user:password@host/db or mysql+pymysql://user:password@host/db.")
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///"):])
        if str(db) not in ("", ":memory:") and not db.parent.is_dir():
            raise SelfSpecError(f"cannot open Optuna storage '{redact(url)}': folder {db.parent} does not exist.")
    try:
        return optuna.storages.get_storage(url)
    except (Exception, SystemExit) as exc:  # sqlalchemy/driver errors come in many types
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SelfSpecError(
            f"cannot open Optuna storage '{redact(url)}' ({type(exc).__name__}: {detail}). Check the URL, that "
            "the database server is reachable and that its driver is installed (psycopg2-binary for postgresql://, "
            "pymysql for mysql+pymysql://)."
        ) from None


def param_name(kind: str, layer: int) -> str:
    return f"{kind}_{layer:02d}"


def params_for(num_layers: int, skip_attention=(), skip_mlp=(), max_draft: int = 4, threshold: float = 0.5,
               adaptive: bool = True, draft_vocab: int = 0) -> dict:
    """Trial parameters describing a plan (used to enqueue warm starts)."""
    lo, hi = MAX_DRAFT_RANGE
    steps = round((min(max(threshold, THRESHOLD_RANGE[0]), THRESHOLD_RANGE[1]) - THRESHOLD_RANGE[0]) / THRESHOLD_STEP)
    params = {param_name("attn", i): i in set(skip_attention) for i in range(num_layers)}
    params.update({param_name("mlp", i): i in set(skip_mlp) for i in range(num_layers)})
    params.update(max_draft_tokens=min(max(int(max_draft), lo), hi),
                  confidence_threshold=round(THRESHOLD_RANGE[0] + steps * THRESHOLD_STEP, 4),
                  adaptive_threshold=bool(adaptive), draft_vocab=int(draft_vocab or 0))
    return params


def plan_args(params: dict, num_layers: int) -> tuple[list[int], list[int], dict]:
    """(skip_attention, skip_mlp, policy kwargs) from a trial's parameters."""
    skip_attention = [i for i in range(num_layers) if params.get(param_name("attn", i))]
    skip_mlp = [i for i in range(num_layers) if params.get(param_name("mlp", i))]
    policy = dict(max_draft_tokens=int(params["max_draft_tokens"]),
                  confidence_threshold=round(float(params["confidence_threshold"]), 4),
                  adaptive_threshold=bool(params["adaptive_threshold"]),
                  draft_vocab=int(params.get("draft_vocab", 0)) or None)
    return skip_attention, skip_mlp, policy


def warm_starts(num_layers: int, current=None, seed: int = 0, random_starts: int = 5,
                vocab_choices=(0,)) -> list[dict]:
    """The first trials of a study, in order: the plan already at --out, nothing skipped, evenly spaced
    skips in the middle half (every third / every other attention, every other MLP, every other whole
    layer), then a few seeded random sparse plans (10-35% of the sublayers between the first two and the
    last layer). Independent random flags would skip half the model and prune; these start TPE nearby."""
    import random

    L = num_layers
    lo, hi = L // 4, L - L // 4
    starts = [
        params_for(L),
        params_for(L, range(lo, hi, 3), max_draft=4, threshold=0.5),
        params_for(L, range(lo, hi, 2), max_draft=4, threshold=0.5),
        params_for(L, [], range(lo, hi, 2), max_draft=3, threshold=0.6),
        params_for(L, range(lo, hi, 2), range(lo, hi, 2), max_draft=3, threshold=0.6),
        params_for(L, range(L // 2, L - 1, 2), range(L // 2 + 1, L - 1, 2), max_draft=5, threshold=0.4),
    ]
    rng = random.Random(seed)
    pool = [("attn", i) for i in range(2, L - 1)] + [("mlp", i) for i in range(2, L - 1)]
    for _ in range(random_starts if L >= 4 else 0):
        chosen = rng.sample(pool, max(1, round(rng.uniform(0.10, 0.35) * len(pool))))
        starts.append(params_for(
            L, [i for kind, i in chosen if kind == "attn"], [i for kind, i in chosen if kind == "mlp"],
            max_draft=rng.randint(3, 6), threshold=rng.choice([0.3, 0.4, 0.5, 0.6, 0.7]), adaptive=rng.random() < 0.5,
            draft_vocab=rng.choice(list(vocab_choices))))
    if current is not None:
        p = current.policy
        vocab = p.draft_vocab if p.draft_vocab in vocab_choices else 0
        starts.insert(0, params_for(L, current.skip_attention, current.skip_mlp, p.max_draft_tokens,
                                    p.confidence_threshold, p.adaptive_threshold, vocab))
    return starts


def _plan_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


# ====================================================================== confirmation


def confirm_plans(engine, items: list[CalibrationItem], plans: list, tokens: int, log=None,
                  fallback: bool = False) -> list[dict]:
    """Real greedy generation with each plan vs plain decoding, interleaved prompt by prompt.

    With ``fallback`` False (the default) the decode loop's switch to plain decoding is off, so
    the figures are each plan's own speed (what the speed model predicts), not a blend with
    plain decoding. Returns one dict per plan: median per-prompt decode speedup (prefill
    excluded), the same end to end, mean accepted length, acceptance rate and whether every
    output was identical to plain decoding.
    """
    drafters = [engine.self_drafter(plan) for plan in plans]
    configs = [engine.decode_config(plan, max_new_tokens=tokens, fallback=fallback) for plan in plans]
    warm_configs = [engine.decode_config(plan, max_new_tokens=min(8, tokens), fallback=fallback) for plan in plans]
    runs = [[] for _ in plans]
    plain_runs = []
    # Warm-up: the first generations after a search pay for allocations.
    warm = items[0].prompt_ids
    engine.generate(list(warm), None, max_new_tokens=min(8, tokens))
    for d, c in zip(drafters, warm_configs):
        engine.generate(list(warm), d, config=c)
    for p_index, item in enumerate(items):
        order = list(range(-1, len(plans)))
        shift = p_index % len(order)
        order = order[shift:] + order[:shift]  # rotate so no method always runs first
        results = {}
        for m in order:
            if m < 0:
                results[m] = engine.generate(list(item.prompt_ids), None, max_new_tokens=tokens)
            else:
                results[m] = engine.generate(list(item.prompt_ids), drafters[m], config=configs[m])
        plain_runs.append(results[-1])
        for m in range(len(plans)):
            runs[m].append(results[m])
        if log:
            plain = results[-1].stats
            parts = ", ".join(
                f"#{m + 1} {(plain.seconds - plain.prefill_seconds) / max(1e-9, results[m].stats.seconds - results[m].stats.prefill_seconds):.2f}x"
                for m in range(len(plans)))
            log(f"confirm prompt {p_index + 1}/{len(items)} ({item.category}): {parts}")
    out = []
    for m, plan in enumerate(plans):
        decode_ratios, e2e_ratios = [], []
        drafted = accepted = passes = new_tokens = 0
        identical = True
        for plain, run in zip(plain_runs, runs[m]):
            ps, rs = plain.stats, run.stats
            decode_ratios.append((ps.seconds - ps.prefill_seconds) / max(1e-9, rs.seconds - rs.prefill_seconds))
            e2e_ratios.append(ps.seconds / max(1e-9, rs.seconds))
            drafted += rs.drafted
            accepted += rs.accepted
            passes += rs.target_passes
            new_tokens += max(0, rs.new_tokens - 1)
            identical &= run.token_ids == plain.token_ids
        out.append({
            "measured_speedup": round(_median(decode_ratios), 4),
            "measured_speedup_end_to_end": round(_median(e2e_ratios), 4),
            "per_prompt_speedup": [round(r, 3) for r in decode_ratios],
            "mean_accepted_length": round(new_tokens / passes, 4) if passes else 0.0,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "fallback": fallback,
            "fell_back": sum(1 for run in runs[m] if run.stats.fell_back),
            "identical_output": identical,
            "plain_tokens_per_second": round(_median([p.stats.tokens_per_second for p in plain_runs]), 3),
            "tokens_per_second": round(_median([r.stats.tokens_per_second for r in runs[m]]), 3),
        })
    return out


# ====================================================================== the search


@dataclass
class SearchResult:
    plan: object  # selfspec.plan.SkipPlan
    plan_path: Path | None
    report_path: Path | None
    plot_path: Path | None
    study_name: str
    storage: str  # password redacted
    trials: int  # finished trials in the study (complete + pruned)
    completed: int
    pruned: int
    predicted_speedup: float
    measured_speedup: float | None
    beats_plain: bool | None
    confirmations: list[dict] = field(default_factory=list)
    interrupted: bool = False
    costs: CostModel | None = None
    trial_number: int | None = None

    def summary(self) -> str:
        lines = [self.plan.describe() if self.plan is not None else "no plan",
                 f"study '{self.study_name}': {self.trials} trials ({self.completed} complete, {self.pruned} pruned)"
                 f"{' - interrupted' if self.interrupted else ''}",
                 f"predicted speedup {self.predicted_speedup:.2f}x (trial {self.trial_number})"]
        if self.measured_speedup is not None:
            c = next((c for c in self.confirmations if c.get("chosen")), {})
            lines.append(f"measured speedup {self.measured_speedup:.2f}x (median over prompts, decode phase), "
                         f"mean accepted length {c.get('mean_accepted_length', 0):.2f}, "
                         f"acceptance {c.get('acceptance_rate', 0):.2f}")
            if not self.beats_plain:
                lines.append("WARNING: no confirmed plan beat plain decoding on this machine; the best one was "
                             "written anyway (decoding falls back to plain when speculation is slower).")
        else:
            lines.append("not confirmed by real generation")
        if self.plan_path:
            lines.append(f"wrote {self.plan_path}" + (f", {self.report_path}" if self.report_path else "")
                         + (f", {self.plot_path}" if self.plot_path else ""))
        return "\n".join(lines)


def _stderr(message: str) -> None:
    print(f"[selfspec search] {message}", file=sys.stderr, flush=True)


def _device_text(engine) -> str:
    import platform

    import torch

    device = str(engine.loaded.device)
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(engine.loaded.device)})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{device} ({cpu}; {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _default_out(model_name: str, speed: str | None = None) -> Path:
    from selfspec.engine import default_plan_path
    from selfspec.models import KNOWN_MODELS

    return default_plan_path(model_name, speed) if model_name in KNOWN_MODELS else Path("plan.json")


def _study_slug(model_name: str) -> str:
    name = Path(model_name).name if ("/" in model_name or os.sep in model_name) else model_name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _finished(study) -> tuple[int, int]:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    complete = sum(1 for t in trials if t.state == TrialState.COMPLETE)
    return complete, len(trials) - complete


def _ranked(study, num_layers: int) -> list:
    """Completed trials, best predicted first, one per distinct plan."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    done.sort(key=lambda t: (-t.value, t.number))
    seen, out = set(), []
    for t in done:
        key = json.dumps(plan_args(t.params, num_layers), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def search_plan(
    engine,
    prompts="spec-bench:coding,math_reasoning,math",
    *,
    limit: int | None = DEFAULT_LIMIT,
    trials: int = DEFAULT_TRIALS,
    tokens: int = DEFAULT_TOKENS,
    out: str | Path | None = None,
    storage=None,
    study_name: str | None = None,
    seed: int = 0,
    timeout: float | None = None,
    confirm: int = DEFAULT_CONFIRM,
    confirm_fallback: bool = False,
    chat: bool | None = None,
    min_agreement: float = MIN_AGREEMENT,
    cost_repeats: int = 5,
    write_report: bool = True,
    progress: bool | None = None,
    how: str | None = None,
    callbacks: Sequence[Callable] = (),
    log: Callable[[str], None] | None = _stderr,
    prompts_label: str | None = None,
) -> SearchResult:
    """Search skip plans for ``engine``'s model; write the best to ``out`` (with report.md and importance.png).

    ``prompts``: a prompt spec (``spec-bench:coding,math`` or a .jsonl path; ``limit`` per category), or a list
    of selfspec.prompts.Prompt or strings. ``storage``: an Optuna storage URL or object (default a SQLite file
    beside ``out``); the study named ``study_name`` (default from the model and calibration) is resumed if it
    exists, and only ``trials`` minus its finished trials are run. ``chat``: wrap prompts in the chat template
    (None: when the tokenizer has one, as `selfspec bench` does). ``confirm``: how many of the best distinct
    trials to time for real (0: trust the speed model), with the decode loop's fallback to plain decoding off
    unless ``confirm_fallback``. ``callbacks`` go to study.optimize.
    """
    from selfspec.plan import DraftPolicy, check_plan_matches, load_plan
    from selfspec.prompts import Prompt, load_prompts

    log = log or (lambda message: None)
    if trials < 1:
        raise SelfSpecError(f"--trials must be at least 1, got {trials}")
    if tokens < 4:
        raise SelfSpecError(f"--tokens must be at least 4, got {tokens}")
    if confirm < 0:
        raise SelfSpecError(f"--confirm must be 0 or more, got {confirm}")
    if limit is not None and limit < 1:
        raise SelfSpecError(f"--limit must be at least 1, got {limit}")
    if timeout is not None and timeout <= 0:
        raise SelfSpecError(f"--timeout must be positive, got {timeout}")
    if isinstance(prompts, (str, Path)):
        prompts_spec = f"{prompts} (limit {limit} per category)" if limit else str(prompts)
        prompt_list = load_prompts(str(prompts), limit=limit)
    else:
        prompt_list = [p if isinstance(p, Prompt) else Prompt(str(i), "all", str(p)) for i, p in enumerate(prompts)]
        prompts_spec = f"{len(prompt_list)} prompts given in Python"
    prompts_spec = prompts_label or prompts_spec
    if not prompt_list:
        raise SelfSpecError("no calibration prompts: the prompt set is empty.")
    if chat is None:
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
    prompt_ids = [engine.encode(p.text, chat=chat) for p in prompt_list]
    window = engine.runner.context_window
    if window:
        too_long = [p.id for p, ids in zip(prompt_list, prompt_ids) if len(ids) + tokens + 16 > window]
        if too_long:
            raise SelfSpecError(f"prompt(s) {', '.join(too_long)} plus {tokens} tokens exceed the context window "
                                f"of {window} tokens; use shorter prompts or fewer --tokens.")

    model_name = engine.loaded.name
    L = engine.identity.num_layers
    vocab_choices = [v for v in DRAFT_VOCAB_CHOICES if v < engine.runner.head_rows]
    out = Path(out) if out is not None else _default_out(model_name, engine.loaded.speed)
    current = None
    if out.exists():
        try:
            current = load_plan(out)
            check_plan_matches(current, engine.identity, source=str(out))
        except SelfSpecError as exc:
            raise SelfSpecError(f"--out {out} already holds a plan this search would overwrite, but it cannot be "
                                f"used for {model_name}: {exc}\nPass another --out or remove the file.") from None
    folder = out.parent if str(out.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)

    optuna = _silence_optuna()
    if storage is None:
        storage = f"sqlite:///{folder / 'study.db'}"
    storage_text = _storage_text(storage) if isinstance(storage, str) else type(storage).__name__
    storage_obj = open_storage(storage) if isinstance(storage, str) else storage

    key = calibration_key(engine, prompt_ids, tokens)
    study_name = study_name or f"{_study_slug(model_name)}-{key[:8]}"
    pruner = optuna.pruners.ThresholdPruner(lower=min_agreement)
    try:
        study = optuna.create_study(storage=storage_obj, study_name=study_name, direction="maximize",
                                    load_if_exists=True, pruner=pruner)
    except Exception as exc:
        raise SelfSpecError(f"cannot create or load study '{study_name}' in '{storage_text}' "
                            f"({type(exc).__name__}: {exc}).") from None
    meta = {"model": model_name, "fingerprint": engine.identity.fingerprint, "num_layers": L,
            "calibration_key": key, "prompts": prompts_spec, "tokens": tokens, "chat": chat}
    existing = study.user_attrs.get("selfspec")
    if existing is None:
        study.set_user_attr("selfspec", meta)
    elif existing.get("calibration_key") != key:
        raise SelfSpecError(
            f"study '{study_name}' in '{storage_text}' was made for other settings (model {existing.get('model')}, "
            f"prompts {existing.get('prompts')}, {existing.get('tokens')} tokens); its scores are not comparable. "
            "Pass another --study, or drop --study to get one named after these settings.")
    complete, pruned = _finished(study)
    remaining = max(0, trials - complete - pruned)
    log(f"study '{study_name}' in {storage_text}: {complete + pruned} trials done, {remaining} to run")

    # 1. the target's continuations, 2. the cost model, both once per study.
    items = load_or_make_calibration(engine, prompt_list, prompt_ids, tokens, key, folder, log)
    if "costs" in study.user_attrs:
        costs = CostModel.from_dict(study.user_attrs["costs"])
    else:
        log("measuring costs: plain step, sublayers, verify passes over 1..12 tokens")
        longest = max(items, key=lambda i: len(i.prompt_ids))
        context = longest.prompt_ids + longest.continuation[: len(longest.continuation) // 2]
        costs = measure_costs(engine.runner, context, repeats=cost_repeats)
        study.set_user_attr("costs", costs.to_dict())
    log(f"costs: plain step {costs.full_step * 1e3:.1f} ms, attention {costs.attention * 1e3:.2f} ms, "
        f"MLP {costs.mlp * 1e3:.2f} ms, embed+head {costs.base_step * 1e3:.1f} ms per token; verify over 4 tokens "
        f"{costs.verify_cost(4, 1) * 1e3:.1f} ms")
    model = SpeedModel(engine, items, costs)

    # Identical parameter sets (TPE repeats itself on booleans) reuse the earlier score.
    known: dict[str, tuple] = {}  # params key -> (value or None when pruned, user attrs, trial number)
    for t in study.get_trials(deepcopy=False):
        if t.state.name in ("COMPLETE", "PRUNED"):
            known.setdefault(_plan_key(t.params), (t.value if t.state.name == "COMPLETE" else None,
                                                   dict(t.user_attrs), t.number))

    def objective(trial):
        skip_attention = [i for i in range(L) if trial.suggest_categorical(param_name("attn", i), [False, True])]
        skip_mlp = [i for i in range(L) if trial.suggest_categorical(param_name("mlp", i), [False, True])]
        max_draft = trial.suggest_int("max_draft_tokens", *MAX_DRAFT_RANGE)
        threshold = trial.suggest_float("confidence_threshold", *THRESHOLD_RANGE, step=THRESHOLD_STEP)
        adaptive = trial.suggest_categorical("adaptive_threshold", [False, True])
        draft_vocab = trial.suggest_categorical("draft_vocab", vocab_choices)
        key = _plan_key(trial.params)
        previous = known.get(key)
        if previous is not None:
            value, attrs, number = previous
            for k, v in attrs.items():
                trial.set_user_attr(k, v)
            trial.set_user_attr("duplicate_of", number)
            if value is None:
                raise optuna.TrialPruned()
            return value
        if len(skip_attention) == L and len(skip_mlp) == L:
            trial.set_user_attr("agreement", 0.0)
            known[key] = (None, {"agreement": 0.0}, trial.number)
            raise optuna.TrialPruned()

        def on_prompt(index, agreement):
            trial.report(agreement, index)
            return trial.should_prune()

        ev = model.evaluate(skip_attention, skip_mlp, max_draft, round(threshold, 4), adaptive, on_prompt, draft_vocab)
        attrs = {"agreement": round(ev.agreement, 4), "acceptance": round(ev.sim.acceptance_rate, 4),
                 "mean_accepted_length": round(ev.sim.mean_accepted_length, 4),
                 "draft_step_ms": round(ev.draft_step * 1e3, 3),
                 "skipped_attention": len(skip_attention), "skipped_mlp": len(skip_mlp)}
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        known[key] = (None if ev.pruned else ev.sim.speedup, attrs, trial.number)
        if ev.pruned:
            raise optuna.TrialPruned()
        return ev.sim.speedup

    interrupted = False
    if remaining:
        starts = warm_starts(L, current, seed=seed, vocab_choices=vocab_choices)
        enqueued = 0
        for params in starts:
            if enqueued >= remaining:
                break
            if _plan_key(params) in known or any(_plan_key(t.params) == _plan_key(params) for t in study.trials):
                continue
            study.enqueue_trial(params, skip_if_exists=True)
            enqueued += 1
        # The warm starts are the startup trials; TPE models the study from then on.
        study.sampler = optuna.samplers.TPESampler(multivariate=True, seed=seed + complete + pruned,
                                                   n_startup_trials=len(starts))
        if progress is None:
            progress = os.environ.get("SELFSPEC_NO_PROGRESS") != "1"
        from tqdm.auto import tqdm

        bar = tqdm(total=remaining, desc="search", unit="trial", disable=not progress, dynamic_ncols=True)

        def update_bar(study_, trial_):
            bar.update(1)
            try:
                best = study_.best_trial
                bar.set_postfix_str(f"best {best.value:.2f}x acc {best.user_attrs.get('acceptance', 0):.2f}")
            except ValueError:
                pass

        try:
            from optuna.study import MaxTrialsCallback
            from optuna.trial import TrialState

            # n_trials bounds this process; MaxTrialsCallback stops it too once other workers sharing
            # the study have brought it to --trials finished trials.
            stop_at_total = MaxTrialsCallback(trials, states=(TrialState.COMPLETE, TrialState.PRUNED))
            study.optimize(objective, n_trials=remaining, timeout=timeout,
                           callbacks=[update_bar, stop_at_total, *callbacks], gc_after_trial=False)
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: keeping the best plan found so far")
        finally:
            bar.close()

    complete, pruned = _finished(study)
    ranked = _ranked(study, L)
    if not ranked:
        raise SelfSpecError(f"study '{study_name}' has no completed trial (all {pruned} were pruned or failed): "
                            "the drafts disagreed with the model too often. Run more --trials.")

    def make_plan(trial, extra=None):
        sa, sm, policy = plan_args(trial.params, L)
        return engine.make_plan(sa, sm, DraftPolicy(**policy), provenance=extra or {"how": "selfspec search"})

    # A draft that skips nothing is the model itself: a baseline trial, never a plan worth writing.
    skipping = [t for t in ranked if any(plan_args(t.params, L)[:2])]
    candidates = (skipping or ranked)[: max(1, confirm)]
    confirmations: list[dict] = []
    chosen_index = 0
    if confirm and not interrupted:
        log(f"confirming the best {len(candidates)} trial(s) by real generation against plain decoding")
        try:
            confirmations = confirm_plans(engine, items, [make_plan(t) for t in candidates], tokens, log,
                                          fallback=confirm_fallback)
            for c, t in zip(confirmations, candidates):
                c["trial"] = t.number
                c["predicted_speedup"] = round(t.value, 4)
            chosen_index = max(range(len(confirmations)), key=lambda i: confirmations[i]["measured_speedup"])
            confirmations[chosen_index]["chosen"] = True
        except KeyboardInterrupt:
            interrupted = True
            confirmations = []
            log("interrupted during confirmation: writing the best predicted plan unconfirmed")
    best = candidates[chosen_index]
    chosen = confirmations[chosen_index] if confirmations else None
    measured = chosen["measured_speedup"] if chosen else None
    beats = (measured > 1.0) if measured is not None else None

    how = how or f"selfspec.search.search_plan(prompts={prompts_spec!r}, trials={trials}, tokens={tokens})"
    provenance = {
        "how": redact(how),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": _device_text(engine),
        "dtype": str(engine.loaded.dtype).replace("torch.", ""),
        "speed_mode": engine.loaded.speed,
        "prompts": prompts_spec,
        "prompt_count": len(items),
        "chat_template": chat,
        "tokens": tokens,
        "study": study_name,
        "storage": storage_text,
        "trials": complete + pruned,
        "trial": best.number,
        "predicted_speedup": round(best.value, 4),
        "predicted_acceptance_rate": best.user_attrs.get("acceptance"),
        "predicted_mean_accepted_length": best.user_attrs.get("mean_accepted_length"),
        "measured_speedup": measured,
        "measured_speedup_end_to_end": chosen["measured_speedup_end_to_end"] if chosen else None,
        "mean_accepted_length": chosen["mean_accepted_length"] if chosen else None,
        "acceptance_rate": chosen["acceptance_rate"] if chosen else None,
        "measured_with_fallback": confirm_fallback if chosen else None,
        "beats_plain_decoding": beats,
        "interrupted": interrupted,
    }
    plan = make_plan(best, provenance)
    plan.save(out)
    result = SearchResult(plan, out, None, None, study_name, storage_text, complete + pruned, complete, pruned,
                          float(best.value), measured, beats, confirmations, interrupted, costs, best.number)
    if write_report:
        try:
            result.plot_path = write_importance_plot(study, L, plan, folder / "importance.png")
        except Exception as exc:  # a plot must never lose the plan
            log(f"could not draw importance.png ({type(exc).__name__}: {exc})")
        result.report_path = write_report_md(study, ranked, result, engine, folder / "report.md")
    return result


# ====================================================================== reports


def sublayer_importances(study, num_layers: int) -> tuple[dict[str, float], str]:
    """Optuna parameter importances (fANOVA, else PED-ANOVA); ({}, reason) when they cannot be computed."""
    import optuna

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if len(complete) < 5:
        return {}, f"only {len(complete)} completed trials (need 5)"
    errors = []
    for name in ("FanovaImportanceEvaluator", "PedAnovaImportanceEvaluator"):
        try:
            evaluator = getattr(optuna.importance, name)()
            return dict(optuna.importance.get_param_importances(study, evaluator=evaluator)), name
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return {}, "; ".join(errors)


def skip_effects(ranked: list, num_layers: int) -> dict[str, float]:
    """Mean predicted speedup of completed trials skipping a sublayer minus that of those keeping it."""
    effects = {}
    for kind in ("attn", "mlp"):
        for i in range(num_layers):
            name = param_name(kind, i)
            on = [t.value for t in ranked if t.params.get(name)]
            off = [t.value for t in ranked if not t.params.get(name)]
            if on and off:
                effects[name] = statistics.fmean(on) - statistics.fmean(off)
    return effects


def write_importance_plot(study, num_layers: int, plan, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    importances, method = sublayer_importances(study, num_layers)
    ranked = _ranked(study, num_layers)
    top = ranked[:10]
    layers = list(range(num_layers))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, num_layers * 0.32), 7), sharex=True)
    width = 0.4
    ax = axes[0]
    if importances:
        ax.bar([i - width / 2 for i in layers], [importances.get(param_name("attn", i), 0) for i in layers],
               width, label="attention", color="tab:blue")
        ax.bar([i + width / 2 for i in layers], [importances.get(param_name("mlp", i), 0) for i in layers],
               width, label="MLP", color="tab:orange")
        policy = ", ".join(f"{k} {importances.get(k, 0):.2f}"
                           for k in ("max_draft_tokens", "confidence_threshold", "adaptive_threshold"))
        ax.set_title(f"skip-flag importance for predicted speedup ({method.replace('ImportanceEvaluator', '')})\n"
                     f"policy: {policy}", fontsize=9)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"importances unavailable: {method}", ha="center", va="center", transform=ax.transAxes,
                fontsize=8, wrap=True)
    ax.set_ylabel("importance")
    ax = axes[1]
    if top:
        ax.bar([i - width / 2 for i in layers],
               [sum(bool(t.params.get(param_name("attn", i))) for t in top) / len(top) for i in layers],
               width, label="attention", color="tab:blue")
        ax.bar([i + width / 2 for i in layers],
               [sum(bool(t.params.get(param_name("mlp", i))) for t in top) / len(top) for i in layers],
               width, label="MLP", color="tab:orange")
    for i in plan.skip_attention:
        ax.plot(i - width / 2, 1.05, "v", color="tab:blue")
    for i in plan.skip_mlp:
        ax.plot(i + width / 2, 1.05, "v", color="tab:orange")
    ax.set_ylim(0, 1.15)
    ax.set_ylabel(f"skipped in top {len(top)} trials")
    ax.set_xlabel("layer (triangles: skipped by the written plan)")
    ax.set_xticks(layers)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.suptitle(f"{plan.model.name}: which sublayers mattered", fontsize=11)
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _layers_text(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if layers else "-"


def write_report_md(study, ranked: list, result: SearchResult, engine, path: Path) -> Path:
    from selfspec.plan import atomic_write_text

    plan, prov, costs = result.plan, result.plan.provenance, result.costs
    L = plan.model.num_layers
    lines = [f"# selfspec search report: {plan.model.name}", ""]
    lines += [
        f"- command: `{prov.get('how')}`",
        f"- date: {prov.get('date')}; device: {prov.get('device')}; dtype: {prov.get('dtype')}",
        f"- study: `{result.study_name}` in `{result.storage}`: {result.trials} trials "
        f"({result.completed} complete, {result.pruned} pruned){'; interrupted' if result.interrupted else ''}",
        f"- calibration: {prov.get('prompts')} ({prov.get('prompt_count')} prompts, chat template "
        f"{'on' if prov.get('chat_template') else 'off'}), {prov.get('tokens')} greedy tokens each",
        "",
        "## Result", "",
        f"{plan.describe()}", "",
        f"- skip attention: {_layers_text(plan.skip_attention)}",
        f"- skip MLP: {_layers_text(plan.skip_mlp)}",
        f"- predicted speedup (speed model): {result.predicted_speedup:.2f}x, predicted acceptance "
        f"{prov.get('predicted_acceptance_rate')}, predicted mean accepted length {prov.get('predicted_mean_accepted_length')}",
    ]
    if result.measured_speedup is not None:
        fallback_note = ("with the decode loop's fallback to plain decoding on" if prov.get("measured_with_fallback")
                         else "fallback to plain decoding off, so this is the plan's own speed")
        lines += [
            f"- measured speedup (real greedy generation, median over prompts, decode phase, {fallback_note}): "
            f"**{result.measured_speedup:.2f}x** ({prov.get('measured_speedup_end_to_end'):.2f}x end to end with prefill)",
            f"- measured mean accepted length {prov.get('mean_accepted_length'):.2f}, acceptance "
            f"{prov.get('acceptance_rate'):.2f}",
        ]
        if not result.beats_plain:
            lines += ["", "**No confirmed plan beat plain decoding on this machine.** The fastest one was written "
                          "anyway; the decode loop falls back to plain decoding when speculation is measurably slower."]
    else:
        lines.append("- not confirmed by real generation (--confirm 0 or interrupted)")
    if costs is not None:
        lines += ["", "## Cost model (measured once per study)", "",
                  f"- plain decoding step: {costs.full_step * 1e3:.1f} ms (context {costs.context} tokens)",
                  f"- one attention sublayer {costs.attention * 1e3:.2f} ms, one MLP sublayer {costs.mlp * 1e3:.2f} ms, "
                  f"embedding+head {costs.base_step * 1e3:.1f} ms",
                  f"- output layer over the whole vocabulary: {costs.head * 1e3:.1f} ms of that",
                  f"- this plan's draft step: {costs.draft_step(L - len(plan.skip_attention), L - len(plan.skip_mlp), plan.policy.draft_vocab or 0) * 1e3:.1f} ms",
                  "- verify pass over k tokens: " + ", ".join(
                      f"k={k}: {v * 1e3:.0f} ms" for k, v in zip(costs.verify_sizes, costs.verify))]
    if result.confirmations:
        lines += ["", "## Confirmation (real generation vs plain decoding, interleaved)", "",
                  "Each candidate and plain decoding generate on every calibration prompt, prompt by prompt in "
                  "rotating order; speedup = plain decode seconds / plan decode seconds (prefill excluded), median "
                  "over prompts. The speed model predicts speculation throughout; "
                  + ("here the fallback to plain decoding was on, which lifts plans slower than plain towards 1.0x."
                     if result.confirmations[0].get("fallback") else "so is this measurement (fallback off)."), "",
                  "| trial | predicted | measured (median) | end to end | per prompt | mean accepted | acceptance | fell back | identical | chosen |",
                  "|---:|---:|---:|---:|---|---:|---:|---:|:---:|:---:|"]
        for c in result.confirmations:
            lines.append(
                f"| {c['trial']} | {c['predicted_speedup']:.2f}x | {c['measured_speedup']:.2f}x | "
                f"{c['measured_speedup_end_to_end']:.2f}x | {' '.join(f'{r:.2f}' for r in c['per_prompt_speedup'])} | "
                f"{c['mean_accepted_length']:.2f} | {c['acceptance_rate']:.2f} | "
                f"{c['fell_back'] if c.get('fallback') else 'off'} | "
                f"{'yes' if c['identical_output'] else 'NO'} | {'yes' if c.get('chosen') else ''} |")
    lines += ["", "## Top trials (predicted)", "",
              "| trial | predicted | acceptance | accepted/round | agreement | attn skipped | MLP skipped | max draft | threshold | adaptive |",
              "|---:|---:|---:|---:|---:|---|---|---:|---:|:---:|"]
    for t in ranked[:10]:
        sa, sm, pol = plan_args(t.params, L)
        lines.append(
            f"| {t.number} | {t.value:.2f}x | {t.user_attrs.get('acceptance', 0):.2f} | "
            f"{t.user_attrs.get('mean_accepted_length', 0):.2f} | {t.user_attrs.get('agreement', 0):.2f} | "
            f"{_layers_text(sa)} | {_layers_text(sm)} | {pol['max_draft_tokens']} | {pol['confidence_threshold']:g} | "
            f"{'yes' if pol['adaptive_threshold'] else 'no'} |")
    importances, method = sublayer_importances(study, L)
    lines += ["", "## Which sublayers mattered", ""]
    if importances:
        lines += [f"Parameter importance for the predicted speedup ({method}), top 15:", "",
                  "| parameter | importance |", "|---|---:|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in list(importances.items())[:15]]
    else:
        lines.append(f"Optuna importances unavailable ({method}).")
    effects = skip_effects(ranked, L)
    if effects:
        order = sorted(effects.items(), key=lambda kv: kv[1])
        lines += ["", "Mean predicted speedup of completed trials that skip a sublayer minus those that keep it "
                      "(most harmful to skip first, cheapest to skip last):", "",
                  "- most harmful: " + ", ".join(f"{k} {v:+.2f}" for k, v in order[:6]),
                  "- cheapest: " + ", ".join(f"{k} {v:+.2f}" for k, v in order[::-1][:6])]
    if result.plot_path:
        lines += ["", f"![importance]({result.plot_path.name})"]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


# ====================================================================== CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from selfspec.cli import add_model_arguments

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_model_arguments(parser)
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS,
                        help=f"calibration prompts: a .jsonl file or spec-bench[:cat,...] (default {DEFAULT_PROMPTS})")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                        help=f"prompts per category (default {DEFAULT_LIMIT})")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help=f"greedy continuation length per prompt (default {DEFAULT_TOKENS})")
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                        help=f"trials the study should hold; finished ones count (default {DEFAULT_TRIALS})")
    parser.add_argument("--timeout", type=float, default=None, help="stop searching after this many seconds")
    parser.add_argument("--storage", default=None,
                        help="Optuna storage URL (default sqlite:///<out folder>/study.db)")
    parser.add_argument("--study", default=None, help="study name (default: from the model and calibration)")
    parser.add_argument("--out", default=None,
                        help="plan to write (default search/<model>/plan.json for a bundled model, else ./plan.json)")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    parser.add_argument("--confirm", type=int, default=DEFAULT_CONFIRM,
                        help=f"best distinct trials to confirm by real generation (default {DEFAULT_CONFIRM}; 0: none)")
    parser.add_argument("--no-chat", action="store_true",
                        help="feed prompts as raw text (default: the model's chat template if it has one)")


def run(args) -> int:
    from selfspec.cli import torch_dtype
    from selfspec.engine import Engine
    from selfspec.prompts import load_prompts

    for flag, value, low in (("--trials", args.trials, 1), ("--tokens", args.tokens, 4), ("--limit", args.limit, 1),
                             ("--confirm", args.confirm, 0)):
        if value < low:
            raise SelfSpecError(f"{flag} must be at least {low}, got {value}")
    prompts = load_prompts(args.prompts, limit=args.limit)  # a bad prompts file fails before the model loads
    out = Path(args.out) if args.out else _default_out(args.model, args.speed)
    storage = args.storage
    if storage is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        storage = f"sqlite:///{out.parent / 'study.db'}"
    open_storage(storage)  # so does a bad storage URL
    if sys.argv[1:2] == ["search"]:
        how = shlex.join(["selfspec", *sys.argv[1:]])
    else:
        how = shlex.join(["selfspec", "search", *_args_as_argv(args)])
    if args.speed == "cuda-compiled":  # every trial's skip set is a new kind of pass to compile
        raise SelfSpecError("search with --speed cuda-graphs: under cuda-compiled every trial's draft would be "
                            "compiled anew (about a minute each). The plan it finds serves both modes.")
    engine = Engine.load(args.model, device=args.device, dtype=torch_dtype(args.dtype), speed=args.speed)
    result = search_plan(
        engine, prompts, trials=args.trials, tokens=args.tokens, out=out, storage=storage,
        study_name=args.study, seed=args.seed, timeout=args.timeout, confirm=args.confirm,
        chat=False if args.no_chat else None, how=how,
        prompts_label=f"{args.prompts} (limit {args.limit} per category)")
    print(result.summary())
    return 0


def _args_as_argv(args) -> list[str]:
    argv = []
    for key, value in sorted(vars(args).items()):
        if key in ("func", "command") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv
