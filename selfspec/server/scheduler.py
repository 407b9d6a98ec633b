"""One worker thread owns the engine: it admits requests from a bounded queue and decodes them,
together in one batch when several are active (``Scheduler``).

Requests wait in a queue of ``queue_size``; a full queue refuses new ones (the server answers
503) instead of growing without limit. A request's text goes back through ``Job.on_event``
(called on the worker thread) as it is accepted; a request whose client went away leaves the
batch at the next pass. It keeps the counters for /metrics (``selfspec.server.metrics``).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from selfspec.errors import SelfSpecError
from selfspec.server.metrics import Metrics
from selfspec.server.protocol import APIError

if TYPE_CHECKING:
    from selfspec.drafters import Drafter
    from selfspec.engine import Engine
    from selfspec.runtime.batch import Sequence
    from selfspec.runtime.decode import DecodeConfig
    from selfspec.server.learning import IdleTrainer
    from selfspec.training.history import History, LearnedTable


TABLE_SAVE_SECONDS = 60.0


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
class _Running:
    """A job being decoded in the batch."""

    job: Job
    sequence: Sequence
    trimmer: StopTrimmer
    prefilled_apart: bool = True  # False: its prompt was read in chunks inside the batch's passes


def _shut_out(jobs: list[Job | None]) -> None:
    """End each job not already cancelled with the shutdown's error event (None: the worker's
    wake-up, skipped)."""
    for job in jobs:
        if job is not None and not job.cancelled.is_set():
            job.cancelled.set()
            job.on_event("error", "the server is shutting down")


class Scheduler:
    """The engine's only user: a worker thread that admits queued jobs and decodes them.

    A job alone runs speculatively with the drafter. When others arrive it is paused after its
    current round and goes on with them in a batch: one pass per step serves every active job's
    next token and the tokens drafted for it from its own text (``selfspec.runtime.batch``; no
    drafts when the server runs without a drafter), jobs joining and leaving between passes. Where
    the runner cannot batch (speed mode torch, sliding-window attention) jobs run one after another.
    At most ``max_batch`` jobs run at once; the others wait in the queue. Where the runner
    batches, a finished job's keys and values stay in a prefix cache of ``prefix_cache_bytes``
    (``selfspec.runtime.prefixes``), and a job whose prompt starts the same way reads only the
    rest."""

    def __init__(
        self,
        engine: Engine,
        drafter: Drafter | None,
        queue_size: int,
        max_batch: int = 8,
        prefix_cache_bytes: int = 0,
        history: History | None = None,
        trainer: IdleTrainer | None = None,
        learned_table: LearnedTable | None = None,
    ):
        from selfspec.drafters.batched import BatchDrafter
        from selfspec.runtime.prefixes import PrefixStore

        self.engine, self.drafter = engine, drafter
        self.history = history  # finished requests are recorded there for the heads to learn
        self.trainer = trainer  # trains the heads on that record while no request runs
        self.learned_table = learned_table  # where the recycled drafts' table is kept, if it is
        # shares the solo drafter's pass costs and context-draft acceptance
        self.batch_drafter = BatchDrafter.following(drafter) if drafter is not None else None
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.max_batch = max_batch
        # rows are the same bits whichever pass wrote them only where the runner batches
        keep = engine.runner.can_batch and prefix_cache_bytes > 0
        self.prefixes = PrefixStore(prefix_cache_bytes) if keep else None
        self.metrics = Metrics()
        self.batch: list[_Running] = []
        self.solo: Job | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._work, name="selfspec-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self._count(rejected=1)
            raise APIError(
                503,
                f"the server is busy: {self.jobs.maxsize} requests are already waiting. Retry "
                "later.",
                code="server_busy",
                kind="server_error",
            ) from None
        self._gauges()

    def cancel_all(self) -> None:
        """Stop taking jobs; end what runs and what waits with an error event (their streams
        close at once instead of holding the server's shutdown). Safe to call twice."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        ended = [r.job for r in list(self.batch)] + ([self.solo] if self.solo else [])
        while True:
            try:
                ended.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        _shut_out(ended)
        # wakes a worker waiting for a job; a full queue (a job slipped in after the draining)
        # wakes it as well, and _take ends that job
        with contextlib.suppress(queue.Full):
            self.jobs.put_nowait(None)

    def stop(self) -> None:
        """Cancel what runs and what waits; end the worker."""
        self.cancel_all()
        self.thread.join(timeout=30)

    # -- the worker thread ------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            if not self.batch and self.jobs.empty():
                self._keep_table()
                if self.trainer is not None:
                    self.trainer.idle()
            new = self._take(wait=not self.batch)
            if new is None:
                self._keep_table(now=True)
                return
            if self.trainer is not None:
                self.trainer.busy()
                self._take_up_heads()
            busy_from = time.perf_counter()
            if not self.batch and len(new) == 1:
                self._solo(new[0])
            else:
                for job in new:
                    self._start(job)
            if self.batch:
                self._step()
            self._count(busy=time.perf_counter() - busy_from)
            self._gauges()

    def _keep_table(self, now: bool = False) -> None:
        """Write the recycled drafts' table where ``--learn`` keeps it: while the server is idle,
        once its last write is ``TABLE_SAVE_SECONDS`` old, and when it stops."""
        try:
            if self.learned_table is not None:
                self.learned_table.save(self.drafter, 0.0 if now else TABLE_SAVE_SECONDS)
        except Exception as exc:  # a full disk (or any fault) ends the keeping, never the server
            print(f"[selfspec] not keeping the recycled table any more: {exc}", file=sys.stderr)
            self.learned_table = None

    def _take_up_heads(self) -> None:
        """Draft with heads the idle training adopted; between generations, so a request drafts
        with one set of heads from start to end."""
        from selfspec.drafters.heads import HeadDrafter

        heads = self.trainer.take_heads()
        if heads is not None and hasattr(self.drafter, "use_heads"):
            runner = self.engine.runner
            self.drafter.use_heads(HeadDrafter(runner, heads, self.engine.eos_ids()))
            print(f"[selfspec] drafting with the new heads: {heads.describe()}", file=sys.stderr)

    def _take(self, wait: bool) -> list[Job] | None:
        """Queued jobs, as many as the batch has room for (waiting for one when ``wait``); None
        once stopped."""
        taken = [self._next_job()] if wait else []
        while len(taken) < self.max_batch - len(self.batch):
            try:
                taken.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        if None in taken or self.stopping.is_set():
            _shut_out(taken)
            return None
        live = [job for job in taken if not job.cancelled.is_set()]
        self._count(cancelled=len(taken) - len(live))
        return live

    def _next_job(self) -> Job | None:
        """The next queued job, waiting for it; an idle server writes its recycled table when
        its minute is up, not only as it goes idle."""
        while True:
            table = self.learned_table
            due = table.due_in(self.drafter, TABLE_SAVE_SECONDS) if table is not None else None
            try:
                return self.jobs.get(timeout=due)  # None: no write pending, wait for a job
            except queue.Empty:
                self._keep_table()

    def _emitter(self, job: Job, trimmer: StopTrimmer):
        from selfspec.engine import TextStream

        def on_text(delta: str) -> None:
            out = trimmer.feed(delta)
            if out:
                job.on_event("text", out)

        return TextStream(self.engine.tokenizer, on_text)

    def _solo(self, job: Job) -> None:
        """Speculative decoding while the job is alone; paused into the batch when others come."""
        from selfspec.runtime.batch import resume_sequence
        from selfspec.runtime.decode import generate_ids

        runner, trimmer = self.engine.runner, StopTrimmer(job.config.stop_strings)
        stream = self._emitter(job, trimmer)
        batching = runner.can_batch and self.max_batch > 1

        def pause() -> bool:
            return job.cancelled.is_set() or (batching and not self.jobs.empty())

        with self.lock:
            self.metrics.active = 1
        self.solo = job
        try:
            generated, stats = generate_ids(
                runner,
                job.prompt_ids,
                job.config,
                self.drafter,
                self.engine.tokenizer,
                on_tokens=stream,
                pause=pause,
                prefixes=self.prefixes,
            )
        except Exception as exc:  # the request fails, the server goes on
            self._fail(job, exc)
            return
        finally:
            self.solo = None
        if job.cancelled.is_set() or stats.stop_reason != "paused":
            # the runner's cache holds every token but the pending one
            self._keep((job.prompt_ids + generated)[:-1], runner.cache)
        if job.cancelled.is_set():
            self._count(cancelled=1)
        elif stats.stop_reason != "paused":
            self._done(job, trimmer, stats, generated)
        else:
            sequence = resume_sequence(
                runner,
                job.prompt_ids,
                generated,
                stats,
                job.config,
                self.engine.tokenizer,
                on_tokens=stream,
            )
            self.batch.append(_Running(job, sequence, trimmer))

    def _start(self, job: Job) -> None:
        """A job joins the batch with its prompt to be read in chunks inside the batch's passes,
        so the others need not wait for it."""
        from selfspec.runtime.batch import admit_sequence

        runner = self.engine.runner
        if not runner.can_batch:
            self._solo(job)
            return
        trimmer = StopTrimmer(job.config.stop_strings)
        try:
            sequence = admit_sequence(
                runner,
                job.prompt_ids,
                job.config,
                self.engine.tokenizer,
                on_tokens=self._emitter(job, trimmer),
                prefixes=self.prefixes,
            )
        except Exception as exc:
            self._fail(job, exc)
            return
        # nothing is committed before its prompt is read, so nothing can have stopped it yet
        self.batch.append(_Running(job, sequence, trimmer, prefilled_apart=False))

    def _step(self) -> None:
        """One pass for the whole batch; finished and cancelled jobs leave it."""
        from selfspec.runtime.batch import step

        cancelled = [r for r in self.batch if r.job.cancelled.is_set()]
        self.batch = [r for r in self.batch if not r.job.cancelled.is_set()]
        self._count(cancelled=len(cancelled))
        for running in cancelled:  # a chat whose answer was stopped goes on from it
            self._keep(running.sequence.cached_tokens(), running.sequence.cache)
        if not self.batch:
            return
        started = time.perf_counter()
        try:
            rows = step(self.engine.runner, [r.sequence for r in self.batch], self.batch_drafter)
        except Exception as exc:
            failed, self.batch = self.batch, []
            for running in failed:
                self._fail(running.job, exc)
            return
        self._count(
            batch_steps=1,
            batch_rows=rows,
            batch_requests=len(self.batch),
            batch_seconds=time.perf_counter() - started,
        )
        for running in [r for r in self.batch if r.sequence.gen.stop]:
            self.batch.remove(running)
            self._keep(running.sequence.cached_tokens(), running.sequence.cache)
            stats = running.sequence.finish()
            answer = running.sequence.gen.generated
            self._done(running.job, running.trimmer, stats, answer, running.prefilled_apart)

    def _keep(self, tokens: list[int], cache) -> None:
        """Keep the keys and values of ``tokens`` (at the first positions of ``cache``) for the
        requests that start with them; not while shutting down."""
        if self.prefixes is not None and not self.stopping.is_set():
            self.prefixes.save(tokens, cache)
            self.metrics.prefix_cache_bytes = self.prefixes.nbytes
            self.metrics.prefix_cache_evictions = self.prefixes.evictions

    def _done(
        self, job: Job, trimmer: StopTrimmer, stats, answer: list[int], prefilled_apart=True
    ) -> None:
        """``answer``: the ids generated. ``prefilled_apart``: the prompt was read in a pass of its
        own (its time counts as prefill), not in chunks inside the batch's passes (already
        counted there)."""
        tail = trimmer.finish()
        if tail:
            job.on_event("text", tail)
        finish = "length" if stats.stop_reason == "max_new_tokens" else "stop"
        self._count(
            requests=1,
            prompt_tokens=len(job.prompt_ids),
            prompt_tokens_cached=stats.cached_prompt_tokens,
            completion_tokens=stats.new_tokens,
            target_passes=stats.target_passes + 1,  # the prefill gave the first token
            drafted=stats.drafted,
            accepted=stats.accepted,
            seconds=stats.seconds,
            prefill_seconds=stats.prefill_seconds if prefilled_apart else 0.0,
        )
        self._gauges()  # before the client hears of it: /metrics never lags behind a reply
        if self.history is not None:  # before the reply: a client that reads it finds it
            try:
                self.history.record(job.prompt_ids, answer)
                if self.trainer is not None:
                    self.trainer.recorded(len(answer))
            except (OSError, SelfSpecError) as exc:  # a full disk ends the record, never the server
                print(f"[selfspec] not recording use any more: {exc}", file=sys.stderr)
                self.history = None
        job.on_event("done", (trimmer.whole(), finish, stats))

    def _fail(self, job: Job, exc: Exception) -> None:
        self._count(failed=1)
        self._gauges()
        job.on_event("error", f"generation failed: {type(exc).__name__}: {exc}")

    def _gauges(self) -> None:
        with self.lock:
            self.metrics.active = len(self.batch)
            self.metrics.queued = self.jobs.qsize()

    def _count(self, **amounts) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self.metrics, name, getattr(self.metrics, name) + amount)
