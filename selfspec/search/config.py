"""``SearchConfig``: how a search runs, one field per ``selfspec search`` flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = "spec-bench:coding,math_reasoning,math"
DEFAULT_LIMIT = 1
DEFAULT_TOKENS = 48
DEFAULT_TRIALS = 60
DEFAULT_CONFIRM = 3
MIN_AGREEMENT = 0.3  # prune a trial whose draft agrees with the target less often than this


@dataclass
class SearchConfig:
    """How ``search_plan`` searches.

    ``prompts``: a prompt spec (``spec-bench:coding,math`` or a .jsonl path; ``limit`` per
    category), or a list of selfspec.prompts.Prompt or strings. ``out``: default the user's plan
    folder for a bundled model (``selfspec.paths.user_plan_path``), else ./plan.json.
    ``storage``: an Optuna storage URL or object (default a SQLite file beside ``out``); the study
    named ``study_name`` (default from the model and calibration) is resumed if it exists, and
    trials run until it holds ``trials`` complete ones (pruned and failed ones do not count; see
    selfspec.search.workers for trials whose worker died). ``chat``: wrap prompts in the chat
    template (None: when the tokenizer has one, as `selfspec bench` does). ``confirm``: how many of
    the best distinct trials to time for real (0: trust the speed model), with the decode loop's
    fallback to plain decoding off unless ``confirm_fallback``. ``how``: the command recorded in
    the plan's provenance; ``prompts_label``: the prompt set as the report names it.
    """

    prompts: object = DEFAULT_PROMPTS
    limit: int | None = DEFAULT_LIMIT
    trials: int = DEFAULT_TRIALS
    tokens: int = DEFAULT_TOKENS
    out: str | Path | None = None
    storage: object = None
    study_name: str | None = None
    seed: int = 0
    timeout: float | None = None
    confirm: int = DEFAULT_CONFIRM
    confirm_fallback: bool = False
    chat: bool | None = None
    min_agreement: float = MIN_AGREEMENT
    cost_repeats: int = 5
    write_report: bool = True
    progress: bool | None = None
    how: str | None = None
    prompts_label: str | None = None
