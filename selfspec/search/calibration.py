"""Calibration data: the full model's own greedy continuations of the search's prompts.

Made once per study and cached beside the plan (``calibration-<key>.json``), keyed by the
model's fingerprint, speed mode, prompts and length, so a resumed search does not regenerate it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.fileio import atomic_write_text

if TYPE_CHECKING:
    from selfspec.engine import Engine
    from selfspec.prompts import Prompt

CALIBRATION_VERSION = 1


@dataclass
class CalibrationItem:
    id: str
    category: str
    prompt_ids: list[int]
    continuation: list[int]  # the full model's greedy continuation, c_0 (from prefill) first


def calibration_key(engine: Engine, prompt_ids: list[list[int]], tokens: int) -> str:
    loaded = engine.loaded
    payload = json.dumps(
        {
            "version": CALIBRATION_VERSION,
            "fingerprint": engine.identity.fingerprint,
            "architecture": engine.identity.architecture,
            "layers": engine.identity.num_layers,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype),
            "speed": loaded.speed,
            "tokens": tokens,
            "prompts": prompt_ids,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def load_or_make_calibration(
    engine: Engine,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    tokens: int,
    key: str,
    folder: Path | None,
    log: Callable[[str], None] | None = None,
) -> list[CalibrationItem]:
    """The full model's greedy continuations, from ``folder``/calibration-<key>.json when it is
    there."""
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
            log(
                f"calibration {number}/{len(prompts)}: greedy continuation of prompt {prompt.id} "
                f"({prompt.category}, {len(ids)} prompt tokens)"
            )
        result = engine.generate(list(ids), None, max_new_tokens=tokens)
        items.append(CalibrationItem(prompt.id, prompt.category, list(ids), list(result.token_ids)))
    if path is not None:
        atomic_write_text(
            path,
            json.dumps(
                {
                    "key": key,
                    "model": engine.loaded.name,
                    "fingerprint": engine.identity.fingerprint,
                    "tokens": tokens,
                    "items": [asdict(i) for i in items],
                }
            )
            + "\n",
        )
    return items
