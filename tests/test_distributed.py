"""A search shared by several worker processes, on a real PostgreSQL server (started here from the
`pgserver` package) and on Optuna's journal file, with a worker killed by SIGKILL mid-trial."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from selfspec.runtime.plan import load_plan
from selfspec.search.space import plan_args

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
LAYERS = 30


@pytest.fixture(scope="module")
def postgres_url(tmp_path_factory):
    pgserver = pytest.importorskip("pgserver")
    server = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    yield server.get_uri()
    server.cleanup()


def _worker(storage: str, study: str, out, trials: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "selfspec.cli", "search", "--model", MODEL]
    command += ["--trials", str(trials), "--tokens", "32", "--limit", "1", "--confirm", "0"]
    command += ["--storage", storage, "--study", study, "--out", str(out)]
    log = open(out.parent / "worker.log", "w")  # noqa: SIM115 (closed with the process)
    env = dict(os.environ, SELFSPEC_NO_PROGRESS="1")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def _trials(storage: str, study: str):
    import optuna

    from selfspec.search.storage import open_storage

    return optuna.load_study(study_name=study, storage=open_storage(storage)).trials


def _kill_mid_trial(worker: subprocess.Popen, storage: str, study: str, deadline=240) -> None:
    """SIGKILL ``worker`` while it runs a trial, once the study holds two finished ones. The worker
    is stopped (SIGSTOP) while the study is read, so the trial seen running is the one it dies in
    (a short trial would otherwise end between the look and the kill)."""
    start = time.monotonic()
    while time.monotonic() - start < deadline:
        assert worker.poll() is None, "the worker ended before it could be killed"
        worker.send_signal(signal.SIGSTOP)
        try:
            trials = _trials(storage, study)
        except Exception:  # the study does not exist yet
            trials = []
        states = Counter(t.state.name for t in trials)
        mine = [
            t
            for t in trials
            if t.state.name == "RUNNING" and f":{worker.pid}:" in t.user_attrs.get("worker", "")
        ]
        if states["COMPLETE"] + states["PRUNED"] >= 2 and mine:
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            return
        worker.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    worker.kill()
    pytest.fail("no trial was running within the deadline")


def _check_study(storage: str, study: str, trials: int, outs) -> None:
    done = _trials(storage, study)
    states = Counter(t.state.name for t in done)
    assert states["RUNNING"] == 0 and states["WAITING"] == 0, states
    assert states["COMPLETE"] >= trials, states
    assert sum(states.values()) == len(done) == len({t.number for t in done})
    # the killed worker's trial failed, was queued again once and ran to an end
    failed = [t for t in done if t.state.name == "FAIL"]
    assert len(failed) == 1, states
    retries = [t for t in done if t.system_attrs.get("failed_trial") == failed[0].number]
    assert len(retries) == 1 and retries[0].state.name in ("COMPLETE", "PRUNED")
    # the same parameters (the dead trial may have been killed before suggesting all of them)
    assert retries[0].params.items() >= failed[0].params.items()
    # each written plan loads, and is the study's best trial that skips something
    skipping = [
        t for t in done if t.state.name == "COMPLETE" and any(plan_args(t.params, LAYERS)[:2])
    ]
    for out in outs:
        plan = load_plan(out)
        assert plan.model.name == MODEL
        assert done[plan.provenance["trial"]].value == max(t.value for t in skipping)


def _killed_then_two_workers(storage: str, study: str, tmp_path, trials: int) -> None:
    killed = tmp_path / "killed"
    killed.mkdir()
    worker = _worker(storage, study, killed / "plan.json", trials)
    _kill_mid_trial(worker, storage, study)
    folders = [tmp_path / name for name in ("b", "c")]
    for folder in folders:
        folder.mkdir()
    fresh = [_worker(storage, study, f / "plan.json", trials) for f in folders]
    for worker, folder in zip(fresh, folders):
        assert worker.wait(timeout=600) == 0, (folder / "worker.log").read_text()[-2000:]
    assert not list(tmp_path.glob("killed*/plan.json"))  # a killed worker writes nothing
    _check_study(storage, study, trials, [f / "plan.json" for f in folders])
    logs = "".join((f / "worker.log").read_text() for f in folders)
    assert logs.count("died with its worker") == 1


def test_postgres_study_survives_a_killed_worker(postgres_url, tmp_path):
    _killed_then_two_workers(postgres_url, "killed-worker", tmp_path, trials=8)


def test_journal_study_survives_a_killed_worker(tmp_path):
    _killed_then_two_workers(f"journal:///{tmp_path / 'study.log'}", "journal", tmp_path, trials=8)


def test_a_trial_begun_after_the_study_is_done_is_pruned_but_queued_ones_run():
    """A worker may start a trial just after another saw the study done with nothing running and
    chose its plan (CI caught two workers' plans disagreeing so): such a trial is pruned before it
    scores, so it cannot become a best that one plan lacks. Queued trials, a warm start or a dead
    trial's retry, still run."""
    import optuna
    from optuna.distributions import FloatDistribution

    from selfspec.search.workers import retry_trial, unless_done

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    scored = []

    def objective(trial):
        scored.append(trial.number)
        return trial.suggest_float("x", 0.0, 1.0)

    def one_more():
        study.optimize(unless_done(objective, trials=2), n_trials=1)
        return study.trials[-1].state.name

    assert [one_more(), one_more()] == ["COMPLETE", "COMPLETE"]
    assert one_more() == "PRUNED" and scored == [0, 1]  # a third: the study is done
    study.enqueue_trial({"x": 0.5})  # a warm start queued before it ran
    assert one_more() == "COMPLETE" and scored == [0, 1, 3]
    dead = optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL,
        params={"x": 0.25},
        distributions={"x": FloatDistribution(0.0, 1.0)},
    )
    study.add_trial(dead)  # a trial whose worker died
    retry_trial(study, study.trials[-1])
    assert one_more() == "COMPLETE" and scored == [0, 1, 3, 5]
    assert study.trials[-1].params == {"x": 0.25}
