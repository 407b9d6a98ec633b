"""One worker thread owns the engine and runs requests from a bounded queue, one at a time.

Requests wait in a queue of ``queue_size``; a full queue refuses new ones (the server answers
503) instead of growing without limit. A request's text goes back through ``Job.on_event``
(called on the worker thread) as it is accepted; a request whose client went away is
cancelled at its next text and its slot freed. Counters for /metrics live here too.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from selfspec.server.protocol import APIError

if TYPE_CHECKING:
    from selfspec.decode import DecodeConfig
    from selfspec.drafters import Drafter
    from selfspec.engine import Engine


class _Cancelled(Exception):
    pass


@dataclass
class Job:
    """One request: its prompt, decode settings and where its events go: ("text", str),
    ("done", (text, finish_reason, stats)) or ("error", message)."""

    prompt_ids: list[int]
    config: DecodeConfig
    on_event: Callable[[str, object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class StopTrimmer:
    """Text deltas with stop strings cut off: holds back the last few characters until it is
    sure they do not start a stop string, and ends the text where the first stop string
    begins (OpenAI's convention: the stop string is not returned)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.sent = stops, "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def _end(self) -> int:
        cuts = [self.text.find(s) for s in self.stops if s in self.text]
        return min(cuts) if cuts else len(self.text)

    def feed(self, delta: str) -> str:
        self.text += delta
        end = self._end()
        ready = end if end < len(self.text) else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : ready], max(self.sent, ready)
        return out

    def finish(self) -> str:
        end = self._end()
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def whole(self) -> str:
        return self.text[: self._end()]


@dataclass
class Metrics:
    """Counters and gauges, shown in Prometheus' text format at /metrics."""

    requests: int = 0
    rejected: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    active: int = 0
    queued: int = 0

    def prometheus(self) -> str:
        speed = self.completion_tokens / self.seconds if self.seconds else 0.0
        acceptance = self.accepted / self.drafted if self.drafted else 0.0
        mal = self.completion_tokens / self.target_passes if self.target_passes else 0.0
        rows = [
            ("requests_total", "counter", "requests finished", self.requests),
            ("requests_rejected_total", "counter", "refused with 503 (queue full)", self.rejected),
            ("requests_cancelled_total", "counter", "clients gone before the end", self.cancelled),
            ("requests_failed_total", "counter", "ended by an error", self.failed),
            ("prompt_tokens_total", "counter", "prompt tokens read", self.prompt_tokens),
            ("completion_tokens_total", "counter", "tokens generated", self.completion_tokens),
            ("target_passes_total", "counter", "full-model passes", self.target_passes),
            ("drafted_tokens_total", "counter", "tokens drafted", self.drafted),
            ("accepted_tokens_total", "counter", "drafted tokens accepted", self.accepted),
            ("generation_seconds_total", "counter", "time spent generating", self.seconds),
            ("tokens_per_second", "gauge", "completion tokens / generation seconds", speed),
            ("acceptance_rate", "gauge", "accepted / drafted", acceptance),
            ("mean_accepted_length", "gauge", "tokens per full-model pass", mal),
            ("requests_running", "gauge", "requests being generated", self.active),
            ("queue_depth", "gauge", "requests waiting", self.queued),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [
                f"# HELP selfspec_{name} {help_text}",
                f"# TYPE selfspec_{name} {kind}",
                f"selfspec_{name} {value:g}"
                if isinstance(value, float)
                else f"selfspec_{name} {value}",
            ]
        return "\n".join(lines) + "\n"


class Scheduler:
    """The engine's only user: runs queued jobs one by one on a worker thread."""

    def __init__(self, engine: Engine, drafter: Drafter | None, queue_size: int):
        self.engine, self.drafter = engine, drafter
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.metrics = Metrics()
        self.current: Job | None = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._work, name="selfspec-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            with self.lock:
                self.metrics.rejected += 1
            raise APIError(
                503,
                f"the server is busy: {self.jobs.maxsize} requests are already waiting. Retry "
                "later.",
                code="server_busy",
                kind="server_error",
            ) from None
        with self.lock:
            self.metrics.queued = self.jobs.qsize()

    def stop(self) -> None:
        """Cancel what runs and what waits; end the worker."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.on_event("error", "the server is shutting down")
        if self.current is not None:
            self.current.cancelled.set()
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                self.metrics.queued = self.jobs.qsize()
            if job.cancelled.is_set():
                with self.lock:
                    self.metrics.cancelled += 1
                continue
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        trimmer = StopTrimmer(job.config.stop_strings)

        def on_text(delta: str) -> None:
            if job.cancelled.is_set():
                raise _Cancelled
            out = trimmer.feed(delta)
            if out:
                job.on_event("text", out)

        with self.lock:
            self.metrics.active = 1
        t0 = time.perf_counter()
        try:
            result = self.engine.generate(
                job.prompt_ids, self.drafter, config=job.config, on_text=on_text
            )
        except _Cancelled:
            self._count(cancelled=1)
            return
        except Exception as exc:  # the request fails, the server goes on
            self._count(failed=1)
            job.on_event("error", f"generation failed: {type(exc).__name__}: {exc}")
            return
        finally:
            with self.lock:
                self.metrics.active = 0
        tail = trimmer.finish()
        if tail:
            job.on_event("text", tail)
        stats = result.stats
        finish = "length" if stats.stop_reason == "max_new_tokens" else "stop"
        self._count(
            requests=1,
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=stats.new_tokens,
            target_passes=stats.target_passes + 1,  # the prefill gave the first token
            drafted=stats.drafted,
            accepted=stats.accepted,
            seconds=time.perf_counter() - t0,
        )
        job.on_event("done", (trimmer.whole(), finish, stats))

    def _count(self, **amounts) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self.metrics, name, getattr(self.metrics, name) + amount)
