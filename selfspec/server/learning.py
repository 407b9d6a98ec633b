"""Draft heads trained while the server is idle (``selfspec serve --learn --train-idle``).

The server records every finished request (``selfspec.training.history``). Once it has recorded
``after_tokens`` answer tokens since its last training and no request has come for
``idle_seconds``, it runs ``selfspec train-heads --from-history`` in a process of its own, at a
lower priority, starting from the heads the model has. A request that arrives stops that process
where it is (SIGSTOP) and the server serves at full speed; the next idle moment lets it go on
(SIGCONT). When it ends, the new heads replace the model's heads (in the user's heads file,
atomically) if they decoded held-out use faster than plain decoding, than no heads and than the
heads before them (``adopt="faster"``), or whenever the training finished (``adopt="always"``);
the drafter takes them up between requests. Output never changes: whatever drafts, the target
decides every token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfspec.paths import user_heads_path

if TYPE_CHECKING:
    from selfspec.drafters.heads import DraftHeads
    from selfspec.training.history import History

ADOPT_RULES = ("faster", "always")
POLL_SECONDS = 0.5  # how often the watcher looks at the clock and the training process


@dataclass(frozen=True)
class IdleTraining:
    """When to train and how long: answer tokens recorded since the last training, seconds without
    a request, the training's budget in minutes, and which heads replace the model's."""

    after_tokens: int = 20_000
    idle_seconds: float = 60.0
    budget_minutes: float = 20.0
    adopt: str = "faster"


def heads_pay(info: dict) -> bool:
    """Whether trained heads decoded held-out use faster than plain decoding, than self-speculation
    without heads and than the heads they started from (``train-heads``' closing timing)."""
    speedup = info.get("decode_speedup")
    if not speedup:
        return False  # never timed: no evidence they pay
    rivals = (1.0, speedup.get("without", 0.0), speedup.get("before", 0.0))
    return speedup.get("with", 0.0) > max(rivals)


class IdleTrainer:
    """Starts, pauses, resumes and reaps the training process; hands finished heads over.

    The server's worker calls ``busy`` when it takes requests and ``idle`` before it waits for
    one; ``recorded`` after each request the history kept; ``take_heads`` between requests."""

    def __init__(
        self,
        model_key: str,
        model_args: list[str],
        history: History,
        settings: IdleTraining,
        hidden_size: int,
        say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    ):
        self.model_args, self.history, self.settings = model_args, history, settings
        self.hidden_size, self.say = hidden_size, say
        self.heads_path = user_heads_path(model_key)
        self.out = self.heads_path.with_name(".heads.training.safetensors")
        self.log = history.path.with_suffix(".training.log")
        self.lock = threading.Lock()
        self.recorded_tokens = 0  # since the last training started
        self.serving = False
        self.idle_since = time.monotonic()
        self.process: subprocess.Popen | None = None
        self.paused = False
        self.started = self.finished = self.adopted = 0
        self.ready: DraftHeads | None = None  # adopted, not yet taken up by the drafter
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="selfspec-learning", daemon=True)
        self.watcher.start()

    # -- the server's worker ----------------------------------------------------------------------
    def recorded(self, tokens: int) -> None:
        with self.lock:
            self.recorded_tokens += tokens

    def busy(self) -> None:
        with self.lock:
            self.serving = True
            if self.process is not None and not self.paused:
                self._signal(signal.SIGSTOP)
                self.paused = True

    def idle(self) -> None:
        with self.lock:
            self.serving = False
            self.idle_since = time.monotonic()
            if self.process is not None and self.paused:
                self._signal(signal.SIGCONT)
                self.paused = False

    def take_heads(self) -> DraftHeads | None:
        with self.lock:
            heads, self.ready = self.ready, None
        return heads

    def stop(self) -> None:
        """End the training (its partial heads are dropped); the model's heads stay as they are."""
        self.stopping.set()
        with self.lock:
            process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.out.unlink(missing_ok=True)
        self.watcher.join(timeout=5)

    def gauges(self) -> list[tuple[str, str, str, int]]:
        """Prometheus rows: (name, kind, help, value)."""
        with self.lock:
            running = self.process is not None
            return [
                ("heads_trainings_total", "counter", "idle trainings started", self.started),
                ("heads_trainings_finished_total", "counter", "idle trainings ended",
                 self.finished),
                ("heads_adopted_total", "counter", "trained heads that replaced the model's",
                 self.adopted),
                ("heads_training_running", "gauge", "1 while a training runs", int(running)),
                ("heads_training_paused", "gauge", "1 while requests hold it stopped",
                 int(running and self.paused)),
                ("heads_recorded_tokens", "gauge", "answer tokens recorded since the last "
                 "training started", self.recorded_tokens),
            ]  # fmt: skip

    # -- the watcher thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.stopping.wait(POLL_SECONDS):
            with self.lock:
                if self.process is not None:
                    if self.process.poll() is not None:
                        self._reap()
                elif self._due():
                    self._start()

    def _due(self) -> bool:
        quiet = time.monotonic() - self.idle_since
        return (
            not self.serving
            and quiet >= self.settings.idle_seconds
            and self.recorded_tokens >= self.settings.after_tokens
        )

    def _start(self) -> None:
        command = [sys.executable, "-m", "selfspec.server.learning", "train-heads"]
        command += [*self.model_args, "--from-history", str(self.history.path)]
        command += ["--budget", f"{self.settings.budget_minutes:g}", "--out", str(self.out)]
        env = dict(os.environ, SELFSPEC_NO_PROGRESS="1")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        with contextlib.suppress(OSError):  # requests come first whenever both want the cores
            os.setpriority(os.PRIO_PROCESS, self.process.pid, 10)
        self.paused = False
        self.started += 1
        self.say(
            f"[selfspec] idle: training draft heads on {self.recorded_tokens:,} newly recorded "
            f"answer tokens of {self.history.path} (budget {self.settings.budget_minutes:g} min, "
            f"log {self.log})"
        )
        self.recorded_tokens = 0

    def _reap(self) -> None:
        code, self.process = self.process.returncode, None
        self.finished += 1
        if code != 0 or not self.out.is_file():
            self.say(f"[selfspec] heads training ended with status {code}: see {self.log}")
            self.out.unlink(missing_ok=True)
            return
        from selfspec.drafters.heads import DraftHeads

        heads = DraftHeads.load(self.out, self.hidden_size)
        timed = heads.info.get("decode_speedup") or {}
        figures = ", ".join(f"{name} {value:.2f}x" for name, value in timed.items()) or "not timed"
        if self.settings.adopt == "always" or heads_pay(heads.info):
            os.replace(self.out, self.heads_path)
            self.ready, self.adopted = heads, self.adopted + 1
            self.say(f"[selfspec] new draft heads in {self.heads_path} ({figures}); in use from "
                     "the next request")  # fmt: skip
        else:
            self.out.unlink()
            self.say(f"[selfspec] heads trained while idle do not pay here ({figures}): kept the "
                     "model's heads")  # fmt: skip

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended; the watcher reaps it
            self.process.send_signal(sig)


def _die_with_parent() -> None:
    """Linux: end this process when the server that started it dies (even by kill -9), so no
    training outlives its server."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request took hold
        sys.exit(1)


if __name__ == "__main__":  # the training process: `selfspec train-heads ...` tied to its server
    _die_with_parent()
    from selfspec.cli import main

    sys.exit(main(sys.argv[1:]))
