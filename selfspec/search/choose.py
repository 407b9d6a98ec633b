"""After the trials: confirm the best by real generation, write the fastest as the plan,
then the report."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.errors import SelfSpecError
from selfspec.machine import device_text
from selfspec.runtime.plan import DraftPolicy
from selfspec.search.confirm import confirm_plans
from selfspec.search.report import write_importance_plot, write_report_md
from selfspec.search.result import SearchResult
from selfspec.search.space import plan_args
from selfspec.search.storage import redact
from selfspec.search.workers import trial_counts

if TYPE_CHECKING:
    import optuna

    from selfspec.engine import Engine
    from selfspec.search.config import SearchConfig
    from selfspec.search.cost_model import CostModel


@dataclass
class StudyRecord:
    """What a finished study hands to the choice of its plan: where the plan goes, the settings
    its provenance records, the costs the trials were scored with, and whether it was cut short."""

    out: Path
    folder: Path
    settings: dict
    costs: CostModel
    interrupted: bool


def finished_counts(study: optuna.Study) -> tuple[int, int]:
    """(complete, pruned) trials."""
    counts = trial_counts(study)
    return counts["COMPLETE"], counts["PRUNED"]


def ranked_trials(study: optuna.Study, num_layers: int) -> list:
    """Completed trials, best predicted first, one per distinct plan."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    done = sorted((t for t in done if t.value is not None), key=lambda t: (-t.value, t.number))
    seen, out = set(), []
    for t in done:
        key = json.dumps(plan_args(t.params, num_layers), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _confirm(
    engine: Engine,
    items,
    candidates: list,
    make_plan,
    tokens: int,
    fallback: bool,
    log: Callable[[str], None],
) -> tuple[list[dict], int, bool]:
    """(confirmations, index of the chosen candidate, interrupted)."""
    log(f"confirming the best {len(candidates)} trial(s) by real generation against plain decoding")
    try:
        plans = [make_plan(t) for t in candidates]
        confirmations = confirm_plans(engine, items, plans, tokens, log, fallback=fallback)
    except KeyboardInterrupt:
        log("interrupted during confirmation: writing the best predicted plan unconfirmed")
        return [], 0, True
    for c, t in zip(confirmations, candidates):
        c["trial"], c["predicted_speedup"] = t.number, round(t.value, 4)
    chosen = max(range(len(confirmations)), key=lambda i: confirmations[i]["measured_speedup"])
    confirmations[chosen]["chosen"] = True
    return confirmations, chosen, False


def _provenance(engine: Engine, best, chosen: dict | None, settings: dict) -> dict:
    measured = chosen["measured_speedup"] if chosen else None
    return {
        "how": redact(settings["how"]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_text(engine.loaded.device, _torch_threads()),
        "dtype": str(engine.loaded.dtype).replace("torch.", ""),
        "speed_mode": engine.loaded.speed,
        **{
            k: settings[k]
            for k in (
                "prompts",
                "prompt_count",
                "chat_template",
                "tokens",
                "study",
                "storage",
                "trials",
            )
        },
        "trial": best.number,
        "predicted_speedup": round(best.value, 4),
        "predicted_acceptance_rate": best.user_attrs.get("acceptance"),
        "predicted_mean_accepted_length": best.user_attrs.get("mean_accepted_length"),
        "measured_speedup": measured,
        "measured_speedup_end_to_end": chosen["measured_speedup_end_to_end"] if chosen else None,
        "mean_accepted_length": chosen["mean_accepted_length"] if chosen else None,
        "acceptance_rate": chosen["acceptance_rate"] if chosen else None,
        "measured_with_fallback": settings["confirm_fallback"] if chosen else None,
        "beats_plain_decoding": (measured > 1.0) if measured is not None else None,
        "interrupted": settings["interrupted"],
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _write_report(result: SearchResult, study, ranked, folder: Path, log) -> None:
    try:
        result.plot_path = write_importance_plot(
            study, ranked, result.plan, folder / "importance.png"
        )
    except Exception as exc:  # a plot must never lose the plan
        log(f"could not draw importance.png ({type(exc).__name__}: {exc})")
    result.report_path = write_report_md(study, ranked, result, folder / "report.md")


def choose_and_write(
    engine: Engine,
    study,
    items,
    config: SearchConfig,
    record: StudyRecord,
    log,
) -> SearchResult:
    """Confirm the best trials, write the fastest as the plan, then the report."""
    settings = record.settings
    confirm = 0 if record.interrupted else config.confirm
    L = engine.identity.num_layers
    ranked = ranked_trials(study, L)
    if not ranked:
        complete, pruned = finished_counts(study)
        raise SelfSpecError(
            f"study '{settings['study']}' has no completed trial (all {pruned} were "
            "pruned or failed): the drafts disagreed with the model too often. Run "
            "more --trials."
        )

    def make_plan(trial, provenance=None):
        sa, sm, policy = plan_args(trial.params, L)
        return engine.make_plan(
            sa, sm, DraftPolicy(**policy), provenance=provenance or {"how": "selfspec search"}
        )

    # A draft that skips nothing is the model itself: a baseline trial, never a plan worth writing.
    skipping = [t for t in ranked if any(plan_args(t.params, L)[:2])]
    candidates = (skipping or ranked)[: max(1, confirm)]
    confirmations, chosen, stopped = [], 0, False
    if confirm:
        confirmations, chosen, stopped = _confirm(
            engine,
            items,
            candidates,
            make_plan,
            config.tokens,
            config.confirm_fallback,
            log,
        )
    best = candidates[chosen]
    picked = confirmations[chosen] if confirmations else None
    settings["interrupted"] = record.interrupted or stopped
    plan = make_plan(best, _provenance(engine, best, picked, settings))
    plan.save(record.out)
    prov = plan.provenance
    result = SearchResult(
        plan,
        record.out,
        None,
        None,
        settings["study"],
        settings["storage"],
        settings["trials"],
        *finished_counts(study),
        float(best.value),
        prov["measured_speedup"],
        prov["beats_plain_decoding"],
        confirmations,
        settings["interrupted"],
        record.costs,
        best.number,
    )
    if config.write_report:
        _write_report(result, study, ranked, record.folder, log)
    return result
