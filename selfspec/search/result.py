"""What a search returns: the plan it wrote, the study's counts and the confirmation figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfspec.runtime.plan import SkipPlan
    from selfspec.search.cost_model import CostModel


@dataclass
class SearchResult:
    plan: SkipPlan
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
        lines = [
            self.plan.describe() if self.plan is not None else "no plan",
            f"study '{self.study_name}': {self.trials} trials ({self.completed} complete, "
            f"{self.pruned} pruned){' - interrupted' if self.interrupted else ''}",
            f"predicted speedup {self.predicted_speedup:.2f}x (trial {self.trial_number})",
        ]
        if self.measured_speedup is not None:
            c = next((c for c in self.confirmations if c.get("chosen")), {})
            lines.append(
                f"measured speedup {self.measured_speedup:.2f}x (median over prompts, decode "
                f"phase), mean accepted length {c.get('mean_accepted_length', 0):.2f}, acceptance "
                f"{c.get('acceptance_rate', 0):.2f}"
            )
            if not self.beats_plain:
                lines.append(
                    "WARNING: no confirmed plan beat plain decoding on this machine; the best one "
                    "was written anyway (decoding falls back to plain when speculation is slower)."
                )
        else:
            lines.append("not confirmed by real generation")
        if self.plan_path:
            written = [self.plan_path, self.report_path, self.plot_path]
            lines.append("wrote " + ", ".join(str(p) for p in written if p))
        return "\n".join(lines)
