"""``search_plan``: the study from end to end (calibrate, measure costs, run trials, confirm,
write).

The objective, the study and its storage URL follow Optuna's own examples, so several workers
sharing one storage share one study for free.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.errors import SelfSpecError
from selfspec.paths import user_plan_path
from selfspec.prompts import Prompt, load_prompts
from selfspec.runtime.decode import check_context
from selfspec.runtime.plan import SkipPlan, check_plan_matches, load_plan
from selfspec.search.calibration import CalibrationItem, calibration_key, load_or_make_calibration
from selfspec.search.choose import StudyRecord, choose_and_write, finished_counts
from selfspec.search.config import SearchConfig
from selfspec.search.cost_model import CostModel, measure_costs
from selfspec.search.result import SearchResult
from selfspec.search.space import (
    DRAFT_VOCAB_CHOICES,
    MAX_DRAFT_RANGE,
    THRESHOLD_RANGE,
    THRESHOLD_STEP,
    param_name,
    plan_key,
    warm_starts,
)
from selfspec.search.speedmodel import SpeedModel
from selfspec.search.storage import open_storage, silence_optuna, storage_text
from selfspec.search.workers import WORKER_ATTR, run_share, trial_counts, worker_id

if TYPE_CHECKING:
    import optuna

    from selfspec.engine import Engine


def stderr_log(message: str) -> None:
    print(f"[selfspec search] {message}", file=sys.stderr, flush=True)


def default_out(model_key: str, speed: str | None = None) -> Path:
    """Every model's plan goes to the user's plan folder, under its key (``paths.model_key``),
    where `generate` looks first."""
    return user_plan_path(model_key, speed)


def _study_slug(model_name: str) -> str:
    name = Path(model_name).name if ("/" in model_name or os.sep in model_name) else model_name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _check_settings(trials: int, tokens: int, confirm: int, limit, timeout) -> None:
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


def _prompt_list(prompts, limit: int | None) -> tuple[list[Prompt], str]:
    """(prompts, how to describe them) from a prompt spec or a list of Prompt objects or strings."""
    if isinstance(prompts, (str, Path)):
        spec = f"{prompts} (limit {limit} per category)" if limit else str(prompts)
        return load_prompts(str(prompts), limit=limit), spec
    given = [
        p if isinstance(p, Prompt) else Prompt(str(i), "all", str(p)) for i, p in enumerate(prompts)
    ]
    return given, f"{len(given)} prompts given in Python"


def _current_plan(out: Path, engine: Engine) -> SkipPlan | None:
    """The plan already at ``out`` (the search's first warm start), refusing one for another
    model."""
    if not out.exists():
        return None
    try:
        current = load_plan(out)
        check_plan_matches(current, engine.identity, source=str(out))
    except SelfSpecError as exc:
        raise SelfSpecError(
            f"--out {out} already holds a plan this search would overwrite, but it cannot be used "
            f"for {engine.loaded.name}: {exc}\nPass another --out or remove the file."
        ) from None
    return current


# A journal file's lock left by a killed worker is broken by whoever waits for it longest; two
# workers starting together can both break it, and the loser's release then fails ("did not
# possess lock") though the storage is fine: opening the study again succeeds.
_LOCK_RACE_TRIES = 3


def _lost_journal_lock_race(exc: Exception) -> bool:
    return isinstance(exc, RuntimeError) and "did not possess lock" in str(exc)


def _open_study(storage, folder: Path, study_name: str, meta: dict, min_agreement: float):
    """(study, storage as shown): create or resume the study, refusing one made for other
    settings."""
    optuna = silence_optuna()
    if storage is None:
        storage = f"sqlite:///{folder / 'study.db'}"
    shown = storage_text(storage) if isinstance(storage, str) else type(storage).__name__
    storage_obj = open_storage(storage) if isinstance(storage, str) else storage
    pruner = optuna.pruners.ThresholdPruner(lower=min_agreement)
    for attempt in range(_LOCK_RACE_TRIES):
        try:
            study = optuna.create_study(
                storage=storage_obj,
                study_name=study_name,
                direction="maximize",
                load_if_exists=True,
                pruner=pruner,
            )
            break
        except Exception as exc:
            if _lost_journal_lock_race(exc) and attempt + 1 < _LOCK_RACE_TRIES:
                time.sleep(1.0)
                continue
            raise SelfSpecError(
                f"cannot create or load study '{study_name}' in '{shown}' "
                f"({type(exc).__name__}: {exc})."
            ) from None
    existing = study.user_attrs.get("selfspec")
    if existing is None:
        study.set_user_attr("selfspec", meta)
    elif existing.get("calibration_key") != meta["calibration_key"]:
        raise SelfSpecError(
            f"study '{study_name}' in '{shown}' was made for other settings (model "
            f"{existing.get('model')}, prompts {existing.get('prompts')}, {existing.get('tokens')} "
            "tokens); its scores are not comparable. Pass another --study, or drop --study to get "
            "one named after these settings."
        )
    return study, shown


def _study_costs(
    study: optuna.Study,
    engine: Engine,
    items: list[CalibrationItem],
    repeats: int,
    log: Callable[[str], None],
) -> CostModel:
    """The cost model stored in the study, measured by whichever worker came first."""
    if "costs" in study.user_attrs:
        costs = CostModel.from_dict(study.user_attrs["costs"])
    else:
        log("measuring costs: plain step, sublayers, verify passes over 1..12 tokens")
        longest = max(items, key=lambda i: len(i.prompt_ids))
        context = longest.prompt_ids + longest.continuation[: len(longest.continuation) // 2]
        costs = measure_costs(engine.runner, context, repeats=repeats)
        study.set_user_attr("costs", costs.to_dict())
    log(
        f"costs: plain step {costs.full_step * 1e3:.1f} ms, attention {costs.attention * 1e3:.2f} "
        f"ms, MLP {costs.mlp * 1e3:.2f} ms, embed+head {costs.base_step * 1e3:.1f} ms per token; "
        f"verify over 4 tokens {costs.verify_cost(4, 1) * 1e3:.1f} ms"
    )
    return costs


class _Objective:
    """Scores a trial with the speed model; identical parameter sets (TPE repeats itself on
    booleans) reuse the earlier score instead of evaluating again."""

    def __init__(self, model: SpeedModel, study: optuna.Study, num_layers: int, vocab_choices):
        self.model, self.L, self.vocab_choices = model, num_layers, list(vocab_choices)
        self.known: dict[str, tuple] = {}  # params key -> (value or None if pruned, attrs, number)
        self.worker = worker_id()
        for t in study.get_trials(deepcopy=False):
            if t.state.name in ("COMPLETE", "PRUNED"):
                value = t.value if t.state.name == "COMPLETE" else None
                attrs = {k: v for k, v in t.user_attrs.items() if k != WORKER_ATTR}
                self.known.setdefault(plan_key(t.params), (value, attrs, t.number))

    def _suggest(self, trial: optuna.Trial):
        L = self.L
        flag = trial.suggest_categorical
        skip_attention = [i for i in range(L) if flag(param_name("attn", i), [False, True])]
        skip_mlp = [i for i in range(L) if flag(param_name("mlp", i), [False, True])]
        max_draft = trial.suggest_int("max_draft_tokens", *MAX_DRAFT_RANGE)
        threshold = trial.suggest_float(
            "confidence_threshold", *THRESHOLD_RANGE, step=THRESHOLD_STEP
        )
        adaptive = flag("adaptive_threshold", [False, True])
        draft_vocab = flag("draft_vocab", self.vocab_choices)
        return skip_attention, skip_mlp, max_draft, round(threshold, 4), adaptive, draft_vocab

    def __call__(self, trial: optuna.Trial) -> float:
        import optuna

        trial.set_user_attr(WORKER_ATTR, self.worker)
        skip_attention, skip_mlp, max_draft, threshold, adaptive, draft_vocab = self._suggest(trial)
        key = plan_key(trial.params)
        if key in self.known:
            value, attrs, number = self.known[key]
            for k, v in {**attrs, "duplicate_of": number}.items():
                trial.set_user_attr(k, v)
            if value is None:
                raise optuna.TrialPruned()
            return value
        if len(skip_attention) == self.L and len(skip_mlp) == self.L:
            trial.set_user_attr("agreement", 0.0)
            self.known[key] = (None, {"agreement": 0.0}, trial.number)
            raise optuna.TrialPruned()

        def on_prompt(index: int, agreement: float) -> bool:
            trial.report(agreement, index)
            return trial.should_prune()

        ev = self.model.evaluate(
            skip_attention, skip_mlp, max_draft, threshold, adaptive, on_prompt, draft_vocab
        )
        attrs = {
            "agreement": round(ev.agreement, 4),
            "acceptance": round(ev.sim.acceptance_rate, 4),
            "mean_accepted_length": round(ev.sim.mean_accepted_length, 4),
            "draft_step_ms": round(ev.draft_step * 1e3, 3),
            "skipped_attention": len(skip_attention),
            "skipped_mlp": len(skip_mlp),
        }
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        self.known[key] = (None if ev.pruned else ev.sim.speedup, attrs, trial.number)
        if ev.pruned:
            raise optuna.TrialPruned()
        return ev.sim.speedup


def _enqueue_warm_starts(
    study: optuna.Study, starts: list[dict], known: dict, remaining: int
) -> None:
    enqueued = 0
    existing = {plan_key(t.params) for t in study.trials}
    for params in starts:
        if enqueued >= remaining:
            break
        if plan_key(params) in known or plan_key(params) in existing:
            continue
        study.enqueue_trial(params, skip_if_exists=True)
        enqueued += 1


def _progress_bar(remaining: int, progress: bool | None):
    from tqdm.auto import tqdm

    if progress is None:
        progress = os.environ.get("SELFSPEC_NO_PROGRESS") != "1"
    bar = tqdm(
        total=remaining, desc="search", unit="trial", disable=not progress, dynamic_ncols=True
    )

    def update(study, trial) -> None:
        if trial.state.name == "COMPLETE":
            bar.update(1)
        try:
            best = study.best_trial
            bar.set_postfix_str(
                f"best {best.value:.2f}x acc {best.user_attrs.get('acceptance', 0):.2f}"
            )
        except ValueError:
            pass

    return bar, update


def _run_trials(
    study: optuna.Study,
    objective: _Objective,
    starts: list[dict],
    *,
    trials: int,
    remaining: int,
    seed: int,
    timeout,
    progress,
    callbacks,
    log: Callable[[str], None],
) -> bool:
    """Run trials until the study holds ``trials`` complete ones, counting other workers'.
    Returns True when interrupted with Ctrl-C."""
    import optuna

    _enqueue_warm_starts(study, starts, objective.known, remaining)
    # The warm starts are the startup trials; TPE models the study from then on.
    study.sampler = optuna.samplers.TPESampler(
        multivariate=True, seed=seed + len(study.trials), n_startup_trials=len(starts)
    )
    bar, update_bar = _progress_bar(remaining, progress)
    try:
        interrupted = run_share(
            study,
            objective,
            trials=trials,
            timeout=timeout,
            callbacks=[update_bar, *callbacks],
            log=log,
        )
    finally:
        bar.close()
    if interrupted:
        log("interrupted: keeping the best plan found so far")
    return interrupted


@dataclass
class _Prepared:
    """What a search needs before its first trial."""

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    prompts_spec: str
    chat: bool
    out: Path
    folder: Path
    current: SkipPlan | None


def _prepare(engine: Engine, prompts, limit, tokens, out, chat, prompts_label) -> _Prepared:
    prompt_list, spec = _prompt_list(prompts, limit)
    if not prompt_list:
        raise SelfSpecError("no calibration prompts: the prompt set is empty.")
    if chat is None:
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
    prompt_ids = [engine.encode(p.text, chat=chat) for p in prompt_list]
    lengths = {f"prompt {p.id}": len(ids) for p, ids in zip(prompt_list, prompt_ids)}
    # 16 spare positions: a draft can run past the continuation's end
    check_context(lengths, tokens + 16, engine.runner.context_window, "--tokens")
    out = Path(out) if out is not None else default_out(engine.loaded.key, engine.loaded.speed)
    current = _current_plan(out, engine)
    folder = out.parent if str(out.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    return _Prepared(prompt_list, prompt_ids, prompts_label or spec, chat, out, folder, current)


def _study_meta(engine: Engine, key: str, prep: _Prepared, tokens: int) -> dict:
    """What a study records about itself, so a resumed study must match it."""
    return {
        "model": engine.loaded.name,
        "fingerprint": engine.identity.fingerprint,
        "num_layers": engine.identity.num_layers,
        "calibration_key": key,
        "prompts": prep.prompts_spec,
        "tokens": tokens,
        "chat": prep.chat,
    }


def search_plan(
    engine: Engine,
    config: SearchConfig | None = None,
    *,
    callbacks: Sequence[Callable] = (),
    log: Callable[[str], None] | None = stderr_log,
) -> SearchResult:
    """Search skip plans for ``engine``'s model as ``config`` says (default: ``SearchConfig()``);
    write the best to ``config.out`` (with report.md and importance.png beside it).
    ``callbacks`` go to study.optimize."""
    c = config or SearchConfig()
    log = log or (lambda message: None)
    _check_settings(c.trials, c.tokens, c.confirm, c.limit, c.timeout)
    prep = _prepare(engine, c.prompts, c.limit, c.tokens, c.out, c.chat, c.prompts_label)
    L = engine.identity.num_layers
    key = calibration_key(engine, prep.prompt_ids, c.tokens)
    study_name = c.study_name or f"{_study_slug(engine.loaded.name)}-{key[:8]}"
    meta = _study_meta(engine, key, prep, c.tokens)
    study, shown = _open_study(c.storage, prep.folder, study_name, meta, c.min_agreement)
    counts = trial_counts(study)
    remaining = max(0, c.trials - counts["COMPLETE"])
    log(
        f"study '{study_name}' in {shown}: {counts['COMPLETE']} complete, {counts['PRUNED']} "
        f"pruned, {counts['FAIL']} failed trials; {remaining} more complete ones to run"
    )

    items = load_or_make_calibration(
        engine, prep.prompts, prep.prompt_ids, c.tokens, key, prep.folder, log
    )
    costs = _study_costs(study, engine, items, c.cost_repeats, log)
    vocab_choices = [v for v in DRAFT_VOCAB_CHOICES if v < engine.runner.head_rows]
    objective = _Objective(SpeedModel(engine, items, costs), study, L, vocab_choices)
    starts = warm_starts(L, prep.current, seed=c.seed, vocab_choices=vocab_choices)
    interrupted = _run_trials(
        study,
        objective,
        starts,
        trials=c.trials,
        remaining=remaining,
        seed=c.seed,
        timeout=c.timeout,
        progress=c.progress,
        callbacks=callbacks,
        log=log,
    )
    complete, pruned = finished_counts(study)
    how = c.how or (
        f"selfspec.search.search_plan(prompts={prep.prompts_spec!r}, "
        f"trials={c.trials}, tokens={c.tokens})"
    )
    settings = {
        "how": how,
        "prompts": prep.prompts_spec,
        "prompt_count": len(items),
        "chat_template": prep.chat,
        "tokens": c.tokens,
        "study": study_name,
        "storage": shown,
        "trials": complete + pruned,
        "confirm_fallback": c.confirm_fallback,
    }
    record = StudyRecord(prep.out, prep.folder, settings, costs, interrupted)
    return choose_and_write(engine, study, items, c, record, log)
