"""Where selfspec keeps things: the user's cache, plans shipped with the package, plans a search
wrote.

- The cache (``$SELFSPEC_CACHE``, else ``~/.cache/selfspec``) holds converted models, compiled
  kernels and, under ``plans/``, the plans ``selfspec search`` writes by default.
- Plans shipped with selfspec live inside the package (``selfspec/plans/<model>/plan.json``, one
  searched in a quantized speed mode in ``<model>/<mode>/plan.json``) and are read with
  ``importlib.resources``, so they work from a wheel as from a checkout.

A plan the user searched wins over the shipped one for the same model and mode.
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path

CACHE_ENV = "SELFSPEC_CACHE"
# Speed modes with plans of their own (their costs differ); other modes use the model's main plan.
PLAN_MODES = ("gguf", "gguf-q8")
# Where a mode without a plan of its own borrows one: the closest costs (same weights) first.
PLAN_FALLBACKS = {"gguf-q8": ("gguf-q8", "gguf", None), "gguf": ("gguf", None)}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "selfspec")


def cached_model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def model_key(model_name: str, model_dir: str | Path) -> str:
    """The name a model's own files go under in the cache (its heads, plans and record of use),
    never a path, so they stay out of the user's folders: a bundled model's or hub id's name (a
    hub id's "/" as "--"); a local .gguf file's cache entry, named by its content hash, so a
    renamed or moved file keeps them; a local folder's name and a hash of where it is."""
    folder = Path(model_dir)
    if folder.parent == cache_dir() / "models":  # a bundled model, or a local .gguf's entry
        return folder.name
    if Path(model_name).expanduser().exists():
        where = folder.resolve()
        return f"{where.name}-{hashlib.sha256(str(where).encode()).hexdigest()[:12]}"
    return model_name.replace("/", "--")


def staging_root() -> Path:
    """Work folders for cache entries being built (same filesystem: finished ones are renamed
    in)."""
    return cache_dir() / "staging"


def kernel_build_root() -> Path:
    return cache_dir() / "kernels"


def _mode_folder(folder: Path, speed: str | None) -> Path:
    return folder / speed if speed in PLAN_MODES else folder


def user_plan_path(model_name: str, speed: str | None = None) -> Path:
    """Where `selfspec search` writes a bundled model's plan unless told otherwise."""
    return _mode_folder(cache_dir() / "plans" / model_name, speed) / "plan.json"


def packaged_plan(model_name: str, speed: str | None = None):
    """The plan shipped inside the package (an importlib.resources Traversable; may not exist)."""
    folder = resources.files("selfspec") / "plans" / model_name
    if speed in PLAN_MODES:
        folder = folder / speed
    return folder / "plan.json"


def default_plan_candidates(model_name: str, speed: str | None = None) -> list:
    """Plan files to try for a model in a speed mode, best first: for each mode the mode borrows
    from, the user's searched plan, then the shipped one."""
    candidates = []
    for mode in PLAN_FALLBACKS.get(speed, (None,)):
        candidates += [user_plan_path(model_name, mode), packaged_plan(model_name, mode)]
    return candidates


def find_default_plan(model_name: str, speed: str | None = None):
    """The first existing default plan file for the model and mode, or None."""
    return next((p for p in default_plan_candidates(model_name, speed) if p.is_file()), None)


def user_heads_path(model_name: str) -> Path:
    """Where `selfspec train-heads` writes a model's draft heads unless told otherwise."""
    return cache_dir() / "plans" / model_name / "heads.safetensors"


def find_heads(model_name: str):
    """The model's draft heads file, the user's trained ones before the shipped ones, or None."""
    shipped = resources.files("selfspec") / "plans" / model_name / "heads.safetensors"
    return next((p for p in (user_heads_path(model_name), shipped) if p.is_file()), None)
