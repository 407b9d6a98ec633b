"""Prompt sets: a Spec-Bench-style JSONL file, or the bundled Spec-Bench questions.

A prompt spec is a path to a .jsonl file, or ``spec-bench`` optionally followed by a
category filter: ``spec-bench:coding,math``. Each row supplies its prompt as the first of
``turns`` (Spec-Bench) or as ``prompt``; ``category`` is optional.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import SelfSpecError

SPEC_BENCH_PATH = Path(__file__).parent / "data" / "spec_bench.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    follow_up: str = ""  # the second turn, where the file has one (Spec-Bench's MT-bench rows)


def _read_jsonl(path: Path) -> list[Prompt]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise SelfSpecError(f"prompts file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SelfSpecError(f"cannot read prompts file {path}: {exc}") from exc
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SelfSpecError(
                f"{path}, line {number}: not valid JSON ({exc.msg}). Expected one JSON object per "
                "line."
            ) from None
        if not isinstance(row, dict):
            raise SelfSpecError(
                f"{path}, line {number}: expected a JSON object with 'turns' or 'prompt'."
            )
        turns = row.get("turns")
        text = (
            turns[0]
            if isinstance(turns, list) and turns and isinstance(turns[0], str)
            else row.get("prompt")
        )
        if not isinstance(text, str) or not text.strip():
            raise SelfSpecError(
                f"{path}, line {number}: no prompt found. Each row needs a non-empty 'turns' list "
                "(Spec-Bench format) or a 'prompt' string."
            )
        second = turns[1] if isinstance(turns, list) and len(turns) > 1 else ""
        prompts.append(
            Prompt(
                str(row.get("question_id", row.get("id", number))),
                str(row.get("category", "all")),
                text,
                second if isinstance(second, str) else "",
            )
        )
    if not prompts:
        raise SelfSpecError(f"prompts file {path} holds no prompts.")
    return prompts


def load_prompts(spec: str, limit: int | None = None) -> list[Prompt]:
    """Load prompts from a spec; with ``limit``, take up to that many per category, in file
    order."""
    if spec == "spec-bench" or spec.startswith("spec-bench:"):
        prompts = _read_jsonl(SPEC_BENCH_PATH)
        wanted = [c for c in spec.partition(":")[2].split(",") if c]
        if wanted:
            known = sorted({p.category for p in prompts})
            unknown = [c for c in wanted if c not in known]
            if unknown:
                raise SelfSpecError(
                    f"unknown Spec-Bench categor{'y' if len(unknown) == 1 else 'ies'} "
                    f"{', '.join(unknown)}. Known: {', '.join(known)}."
                )
            prompts = [p for p in prompts if p.category in wanted]
    else:
        prompts = _read_jsonl(Path(spec).expanduser())
    if limit is not None:
        taken: dict[str, int] = {}
        kept = []
        for p in prompts:
            if taken.get(p.category, 0) < limit:
                taken[p.category] = taken.get(p.category, 0) + 1
                kept.append(p)
        prompts = kept
    return prompts
