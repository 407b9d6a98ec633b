"""Skip plans: which sublayers the draft skips, and how it drafts. A versioned JSON document.

A plan names the model it was made for (name, architecture, layer count and a weight
fingerprint), so it is never silently applied to another model. Loading validates every
field and explains each problem it finds.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.fileio import atomic_write_text

FORMAT_VERSION = 1


@dataclass
class DraftPolicy:
    max_draft_tokens: int = 6
    # Stop drafting when the drafter's top probability falls below this (0 = never stop early).
    confidence_threshold: float = 0.5
    # Nudge the threshold after each round towards a target acceptance (Draft & Verify's rule).
    adaptive_threshold: bool = True
    # Draft steps score only the first draft_vocab token ids (BPE vocabularies put frequent tokens
    # first), plus the stop tokens and the ids the context has used (selfspec.runtime.draft_vocab);
    # the verify pass still scores all. None: the whole vocabulary.
    draft_vocab: int | None = None


@dataclass
class ModelIdentity:
    name: str
    architecture: str
    num_layers: int
    fingerprint: str


@dataclass
class SkipPlan:
    model: ModelIdentity
    skip_attention: list[int] = field(default_factory=list)
    skip_mlp: list[int] = field(default_factory=list)
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    provenance: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def skipped_fraction(self) -> float:
        return (len(self.skip_attention) + len(self.skip_mlp)) / (2 * self.model.num_layers)

    def first_skipped_sublayer(self) -> int:
        """Index in execution order (2*layer for attention, 2*layer+1 for MLP) of the first skipped
        sublayer."""
        candidates = [2 * i for i in self.skip_attention] + [2 * i + 1 for i in self.skip_mlp]
        return min(candidates) if candidates else 2 * self.model.num_layers

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "model": asdict(self.model),
            "skip_attention": sorted(self.skip_attention),
            "skip_mlp": sorted(self.skip_mlp),
            "policy": asdict(self.policy),
            "provenance": self.provenance,
        }

    def describe(self) -> str:
        vocab = self.policy.draft_vocab
        head = f", draft head over the first {vocab} token ids and the context's" if vocab else ""
        return (
            f"plan for {self.model.name}: skips {len(self.skip_attention)} attention and "
            f"{len(self.skip_mlp)} MLP sublayers of {self.model.num_layers} layers; "
            f"draft up to {self.policy.max_draft_tokens} tokens, threshold "
            f"{self.policy.confidence_threshold:g}"
            f"{' (adaptive)' if self.policy.adaptive_threshold else ''}"
            f"{head}"
        )

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")


def _layer_list(value, key: str, num_layers: int, problems: list[str]) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        problems.append(f"'{key}' must be a list of layer indices (integers), got {value!r}")
        return []
    bad = [v for v in value if not 0 <= v < num_layers]
    if bad:
        problems.append(
            f"'{key}' names layer(s) {bad} but the model has layers 0..{num_layers - 1}"
        )
    if len(set(value)) != len(value):
        problems.append(f"'{key}' lists a layer more than once: {value}")
    return sorted(set(v for v in value if 0 <= v < num_layers))


def _identity(model, problems: list[str]) -> ModelIdentity | None:
    fields = {"name": str, "architecture": str, "num_layers": int, "fingerprint": str}
    if not isinstance(model, dict) or not fields.keys() <= model.keys():
        problems.append(
            "'model' must be an object with name, architecture, num_layers and fingerprint"
        )
        return None
    wrong = [k for k, kind in fields.items() if type(model[k]) is not kind]
    if wrong:
        problems.append(
            f"'model' field(s) {wrong} have the wrong type (name, architecture and fingerprint "
            "are strings, num_layers an integer)"
        )
        return None
    if model["num_layers"] <= 0:
        problems.append(f"'model.num_layers' must be positive, got {model['num_layers']}")
        return None
    return ModelIdentity(**{k: model[k] for k in fields})


def _policy(data, problems: list[str]) -> DraftPolicy:
    policy = DraftPolicy()
    if not isinstance(data, dict):
        problems.append("'policy' must be an object")
        return policy
    unknown = set(data) - set(asdict(policy))
    if unknown:
        problems.append(f"'policy' has unknown field(s) {sorted(unknown)}")
    policy = DraftPolicy(**{k: v for k, v in data.items() if k not in unknown})
    draft = policy.max_draft_tokens
    if type(draft) is not int or not 1 <= draft <= 64:
        problems.append(f"'policy.max_draft_tokens' must be an integer in 1..64, got {draft!r}")
    vocab = policy.draft_vocab
    if vocab is not None and (type(vocab) is not int or vocab < 64 or vocab % 64):
        problems.append(
            f"'policy.draft_vocab' must be null or a positive multiple of 64, got {vocab!r}"
        )
    threshold = policy.confidence_threshold
    if type(threshold) not in (int, float) or not 0 <= threshold < 1:
        problems.append(f"'policy.confidence_threshold' must be in [0, 1), got {threshold!r}")
    if type(policy.adaptive_threshold) is not bool:
        problems.append(
            f"'policy.adaptive_threshold' must be true or false, got {policy.adaptive_threshold!r}"
        )
    return policy


def plan_from_dict(data, source: str = "plan") -> SkipPlan:
    """Validate a decoded JSON plan, collecting every problem into one clear one-line error."""
    if not isinstance(data, dict):
        raise SelfSpecError(f"{source}: a plan must be a JSON object, got {type(data).__name__}")
    version = data.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise SelfSpecError(
            f"{source}: unknown plan format_version {version!r}; this selfspec reads version "
            f"{FORMAT_VERSION}. Re-create the plan with `selfspec search` or upgrade selfspec."
        )
    problems: list[str] = []
    identity = _identity(data.get("model"), problems)
    n = identity.num_layers if identity else 0
    skip_attention = _layer_list(data.get("skip_attention", []), "skip_attention", n, problems)
    skip_mlp = _layer_list(data.get("skip_mlp", []), "skip_mlp", n, problems)
    policy = _policy(data.get("policy", {}), problems)
    provenance = data.get("provenance", {})
    if not isinstance(provenance, dict):
        problems.append("'provenance' must be an object")
    if n and len(skip_attention) == n and len(skip_mlp) == n:
        problems.append(
            "the plan skips every sublayer, so the draft would ignore its input entirely"
        )
    if problems:
        raise SelfSpecError(f"{source} is not a valid skip plan: " + "; ".join(problems) + ".")
    return SkipPlan(identity, skip_attention, skip_mlp, policy, dict(provenance), version)


def load_plan(path) -> SkipPlan:
    """Read and validate a plan file (a path, or a packaged resource with ``read_text``)."""
    path = path if hasattr(path, "read_text") else Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SelfSpecError(
            f"plan file {path} does not exist. Create one with `selfspec search`, pass another "
            "--plan, or decode without one (--baseline)."
        ) from None
    except OSError as exc:
        raise SelfSpecError(f"cannot read plan file {path}: {exc}") from exc
    except UnicodeDecodeError:
        raise SelfSpecError(
            f"plan file {path} is not UTF-8 text (is it a plan?). Pass the plan.json that "
            "`selfspec search` wrote."
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SelfSpecError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})."
        ) from exc
    return plan_from_dict(data, source=str(path))


def check_plan_matches(plan: SkipPlan, identity: ModelIdentity, source: str = "plan") -> None:
    """Refuse a plan made for another model: layer indices only mean something for their model."""
    mine = plan.model
    if (mine.architecture, mine.num_layers) != (identity.architecture, identity.num_layers) or (
        mine.fingerprint != identity.fingerprint
    ):
        raise SelfSpecError(
            f"{source} was made for model '{mine.name}' ({mine.architecture}, {mine.num_layers} "
            f"layers, fingerprint {mine.fingerprint}) but the loaded model is '{identity.name}' "
            f"({identity.architecture}, {identity.num_layers} layers, fingerprint "
            f"{identity.fingerprint}). Run `selfspec search` for this model, or pass --model to "
            "match the plan."
        )


def build_plan(
    identity: ModelIdentity,
    skip_attention=(),
    skip_mlp=(),
    policy: DraftPolicy | None = None,
    provenance: dict | None = None,
) -> SkipPlan:
    """Make a plan from layer lists, validating it exactly as a loaded plan is validated."""
    data = {
        "format_version": FORMAT_VERSION,
        "model": asdict(identity),
        "skip_attention": list(skip_attention),
        "skip_mlp": list(skip_mlp),
        "policy": asdict(policy or DraftPolicy()),
        "provenance": provenance or {"how": "built by hand", "date": _dt.date.today().isoformat()},
    }
    return plan_from_dict(data, source="the layers to skip")


def parse_layer_list(text: str, flag: str, what: str = "a layer index") -> list[int]:
    """Parse '3,5,7' or '3-7' or '' into layer indices (or other whole numbers: ``what``), with
    an error naming the flag."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise SelfSpecError(
                f"{flag}: '{part}' is not {what} or range (use e.g. 3,5,7 or 10-14)"
            ) from None
    return out
