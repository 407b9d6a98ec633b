"""Faults injected for real: two processes building one cache entry at once, a plan saved onto a
full disk (a file-size limit set on the writing process) or into a folder the writer may not
write to. The search worker killed with SIGKILL is in test_distributed.py."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.loading import cache as modelcache
from selfspec.runtime.plan import load_plan

SAVE_PLAN = """
import sys
from selfspec.errors import SelfSpecError
from selfspec.runtime.plan import load_plan
plan = load_plan(sys.argv[1])
plan.provenance["note"] = "x" * 4096  # a bigger file than the old one
try:
    plan.save(sys.argv[1])
except SelfSpecError as exc:
    print(exc)
    sys.exit(1)
"""


@pytest.fixture
def old_plan(tmp_path) -> Path:
    shipped = Path(__file__).parents[1] / "selfspec" / "plans" / "smollm2-135m" / "plan.json"
    folder = tmp_path / "plans"
    folder.mkdir()
    path = folder / "plan.json"
    path.write_bytes(shipped.read_bytes())
    return path


def _save_in_child(path: Path, **popen) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SAVE_PLAN, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        **popen,
    )


def _disk_full():
    """In the child: files may not grow past 2 KB (as on a full disk, writes fail)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))


def test_saving_a_plan_onto_a_full_disk_keeps_the_old_plan(old_plan):
    before = old_plan.read_bytes()
    result = _save_in_child(old_plan, preexec_fn=_disk_full)
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith(f"cannot write {old_plan}: File too large.")
    assert "The previous file is unchanged." in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert old_plan.read_bytes() == before
    assert sorted(p.name for p in old_plan.parent.iterdir()) == ["plan.json"]  # no temp file left
    load_plan(old_plan)


def _without_root_override():
    """In the child: drop the capabilities that let root write into a folder it may not write to
    (CAP_DAC_OVERRIDE, CAP_FOWNER) from the bounding set, so they are gone after exec."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 3):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_saving_a_plan_into_a_read_only_folder_keeps_the_old_plan(old_plan):
    before = old_plan.read_bytes()
    old_plan.parent.chmod(0o555)
    try:
        drop = _without_root_override if os.geteuid() == 0 else None
        result = _save_in_child(old_plan, preexec_fn=drop)
    except subprocess.SubprocessError as exc:
        pytest.skip(f"cannot drop root's override capabilities here: {exc}")
    finally:
        old_plan.parent.chmod(0o755)
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith(f"cannot write {old_plan}: Permission denied.")
    assert "The previous file is unchanged." in result.stdout
    assert old_plan.read_bytes() == before


@pytest.mark.slow
def test_two_processes_building_one_model_build_it_once(tmp_path):
    env = dict(os.environ, SELFSPEC_CACHE=str(tmp_path), SELFSPEC_NO_PROGRESS="1")
    code = (
        "from selfspec.loading.sources import ensure_bundled; print(ensure_bundled('smollm2-135m'))"
    )
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [w.communicate(timeout=900) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], results
    entry = tmp_path / "models" / "smollm2-135m"
    assert [out.strip() for out, _ in results] == [str(entry)] * 2
    waited = [err for _, err in results if "another process is preparing smollm2-135m" in err]
    assert len(waited) == 1  # one built it, the other waited for it
    assert modelcache.entry_damage(entry, full=True) is None
    assert list((tmp_path / "staging").iterdir()) == []


@pytest.mark.slow
def test_a_read_only_cache_still_loads_a_quantized_mode(tmp_path):
    """The cache holds the model's entry but this process may not write there: the panels of
    speed mode gguf are built for this process only, and the answer is the one a writable cache
    gives."""
    import shutil

    from selfspec.loading.sources import ensure_bundled, gguf_source
    from selfspec.paths import kernel_build_root

    gguf = tmp_path / "smollm2.gguf"
    shutil.copy(gguf_source("smollm2-135m", ensure_bundled("smollm2-135m")), gguf)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(kernel_build_root())  # compiled already, and writable
    env = dict(os.environ, SELFSPEC_CACHE=str(cache), SELFSPEC_NO_PROGRESS="1")
    describe = "import sys, pathlib; from selfspec.loading.sources import ensure_local_gguf; "
    describe += "ensure_local_gguf(pathlib.Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", describe, str(gguf)], env=env, check=True, timeout=600)
    generate = [sys.executable, "-m", "selfspec.cli", "generate", "def add(a, b):"]
    generate += ["--model", str(gguf), "--speed", "gguf", "--max-new-tokens", "12"]
    folders = [cache, *(p for p in cache.rglob("*") if p.is_dir() and not p.is_symlink())]
    for folder in folders:
        folder.chmod(0o555)
    try:
        drop = _without_root_override if os.geteuid() == 0 else None
        read_only = subprocess.run(
            generate, env=env, capture_output=True, text=True, timeout=600, preexec_fn=drop
        )
    except subprocess.SubprocessError as exc:
        pytest.skip(f"cannot drop root's override capabilities here: {exc}")
    finally:
        for folder in folders:
            folder.chmod(0o755)
    assert read_only.returncode == 0, read_only.stderr
    assert "Traceback" not in read_only.stderr
    assert not list(cache.glob("models/*/panels-*"))  # nothing was written
    writable = subprocess.run(generate, env=env, capture_output=True, text=True, timeout=600)
    assert writable.returncode == 0, writable.stderr
    assert list(cache.glob("models/*/panels-gguf-v*"))
    assert read_only.stdout == writable.stdout and read_only.stdout.strip()


def test_filelock_is_imported_before_the_kernel_build_thread_starts():
    """A first run builds the kernel in a thread while the main thread fetches the model, and both
    take file locks: when the two threads imported filelock at the same moment, one of them failed
    with "No module named 'filelock._core._registry'" (seen on a first run). The main thread now
    imports it before it starts the build thread."""
    code = "import sys, threading\n"
    code += "seen, start = [], threading.Thread.start\n"
    code += "def recorded(self):\n"
    code += "    seen.append('filelock' in sys.modules)\n"
    code += "    start(self)\n"
    code += "threading.Thread.start = recorded\n"
    code += "from selfspec.loading.models import compile_kernel_meanwhile\n"
    code += "compile_kernel_meanwhile()\n"
    code += "print(seen)\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    assert out.stdout.strip() == "[True]"
