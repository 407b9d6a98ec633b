"""One worker's share of a study that several may run at once: trials run until the study holds
``--trials`` complete ones, and trials whose worker died are failed and queued again.

A dead worker leaves its trial RUNNING for ever. Two ways notice it:
- every trial records its worker (host, pid, process start time); a worker on the same host whose
  process is gone is dead at once (any storage, the journal file included);
- on a database storage every running trial beats a heartbeat; one silent for GRACE_PERIOD
  seconds is dead (Optuna's heartbeat), which covers workers on other machines.
A dead trial is marked FAIL (never counted) and its parameters are queued again, at most
MAX_RETRY times.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

HEARTBEAT_INTERVAL = 10  # seconds between a running trial's heartbeats (database storages)
GRACE_PERIOD = 30  # a trial whose heartbeat is older than this died with its worker
MAX_RETRY = 2  # a trial's parameters are queued again at most this many times
WORKER_ATTR = "worker"  # user attribute: which process runs the trial
POLL_SECONDS = 1.0
SETTLE_SECONDS = 600  # longest wait for other workers' running trials before choosing a plan
ATTEMPTS_PER_TRIAL = 3  # a worker runs at most this many trials per complete one asked for


def worker_id() -> str:
    """host:pid:start time of this process; the start time tells a reused pid apart."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{int(psutil.Process().create_time())}"


def _is_dead(worker: str) -> bool | None:
    """True when ``worker`` ran on this host and its process is gone; None when it ran elsewhere
    (only a heartbeat can tell)."""
    import psutil

    host, pid, started = worker.rsplit(":", 2)
    if host != socket.gethostname():
        return None
    try:
        process = psutil.Process(int(pid))
        return (
            int(process.create_time()) != int(started) or process.status() == psutil.STATUS_ZOMBIE
        )
    except (psutil.NoSuchProcess, ValueError):
        return True


def retry_trial(study: optuna.Study, trial: FrozenTrial) -> None:
    """Queue a dead trial's parameters again (its worker attribute dropped), at most MAX_RETRY
    times for one original trial."""
    import optuna

    history = [*trial.system_attrs.get("retry_history", []), trial.number]
    if len(history) > MAX_RETRY:
        return
    system_attrs = {**trial.system_attrs, "retry_history": history}
    system_attrs.setdefault("failed_trial", trial.number)
    study.add_trial(
        optuna.create_trial(
            state=optuna.trial.TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs={k: v for k, v in trial.user_attrs.items() if k != WORKER_ATTR},
            system_attrs=system_attrs,
        )
    )


def fail_dead_trials(study: optuna.Study, log: Callable[[str], None]) -> int:
    """Fail (and queue again) every running trial whose worker died; how many this call failed."""
    import optuna
    from optuna.trial import TrialState

    failed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get(WORKER_ATTR)
        if worker is None or not _is_dead(worker):
            continue
        try:
            if not study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker failed it first
        retry_trial(study, trial)
        failed += 1
        log(f"trial {trial.number} died with its worker ({worker}): marked failed, queued again")
    optuna.storages.fail_stale_trials(study)  # database storages: heartbeats gone silent
    return failed


def trial_counts(study: optuna.Study) -> Counter:
    """Trials by state name (COMPLETE, PRUNED, FAIL, RUNNING, WAITING)."""
    return Counter(t.state.name for t in study.get_trials(deepcopy=False))


def _done(counts: Counter, trials: int) -> bool:
    return counts["COMPLETE"] >= trials and counts["WAITING"] == 0


def unless_done(objective: Callable, trials: int) -> Callable:
    """``objective``, except that a new trial which begins once the study holds its complete
    trials is pruned at once. Another worker may have seen the study done, with nothing running
    or queued, in the moment between this worker's last count and this trial's start, and chosen
    its plan without it: a trial created after that look must not become the study's best. A
    queued trial (a warm start, a dead trial's retry) still runs: it was asked for before."""
    import optuna

    def run(trial: optuna.Trial):
        attrs = trial.study._storage.get_trial_system_attrs(trial._trial_id)
        queued = "fixed_params" in attrs or "failed_trial" in attrs
        if not queued and _done(trial_counts(trial.study), trials):
            raise optuna.TrialPruned("the study already holds its complete trials")
        return objective(trial)

    return run


def run_share(
    study: optuna.Study,
    objective: Callable,
    *,
    trials: int,
    timeout: float | None,
    callbacks: Sequence[Callable],
    log: Callable[[str], None],
) -> bool:
    """Run trials until the study holds ``trials`` complete ones (any worker's) and none waits,
    then wait for other workers' running trials to end (or die and be retried), so that every
    worker chooses its plan from the finished study. Returns True when interrupted with
    Ctrl-C."""
    deadline = None if timeout is None else time.monotonic() + timeout
    budget = ATTEMPTS_PER_TRIAL * trials  # pruned trials run too; this bounds a hopeless study
    ran = 0

    def count_and_stop(study: optuna.Study, _trial) -> None:
        nonlocal ran
        ran += 1
        if _done(trial_counts(study), trials) or ran >= budget:
            study.stop()

    settle_until = None
    while True:
        fail_dead_trials(study, log)
        left = None if deadline is None else deadline - time.monotonic()
        if (left is not None and left <= 0) or ran >= budget:
            if ran >= budget:
                log(f"ran {ran} trials without reaching {trials} complete ones; stopping")
            return False
        counts = trial_counts(study)
        if not _done(counts, trials):
            settle_until = None
            try:
                study.optimize(
                    unless_done(objective, trials),
                    timeout=left,
                    callbacks=[count_and_stop, *callbacks],
                    gc_after_trial=False,
                )
            except KeyboardInterrupt:
                return True
            continue
        running = counts["RUNNING"]
        if not running:
            return False
        if settle_until is None:
            settle_until = time.monotonic() + SETTLE_SECONDS
            log(f"waiting for {running} trial(s) running on other workers")
        if time.monotonic() > settle_until:
            log("trials still running on other workers; choosing without them")
            return False
        time.sleep(POLL_SECONDS)
