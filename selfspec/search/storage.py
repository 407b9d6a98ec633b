"""Optuna storages: opening one from a URL with a clear error, and showing URLs without
passwords."""

from __future__ import annotations

import re
from pathlib import Path

from selfspec.errors import SelfSpecError


def redact(url: str) -> str:
    """An URL with its password replaced by ***."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


JOURNAL = "journal:///"  # journal:///relative/path.log or journal:////absolute/path.log


def storage_text(url: str) -> str:
    """The storage URL to show and record: password redacted, a SQLite or journal file under the
    working folder relative."""
    for scheme in ("sqlite:///", JOURNAL):
        if not url.startswith(scheme):
            continue
        path = Path(url[len(scheme) :])
        try:
            if path.is_absolute():
                return scheme + str(path.relative_to(Path.cwd()))
        except ValueError:
            pass
        return url
    return redact(url)


def silence_optuna():
    import logging
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.logging.disable_default_handler()
    logging.getLogger("optuna").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def open_storage(url: str):
    """An Optuna storage for ``url``, or a clear SelfSpecError saying why it cannot be opened.

    Database URLs get Optuna's heartbeat, so a trial whose worker died (on any machine) is failed
    and queued again; ``journal:///file.log`` is Optuna's journal file (one machine, no server),
    where selfspec.search.workers notices dead workers by their process ids."""
    optuna = silence_optuna()
    if not isinstance(url, str) or "://" not in url:
        raise SelfSpecError(
            f"--storage '{url}' is not a storage URL. Use e.g. sqlite:///study.db, "
            "journal:///study.log, postgresql://user:password@host/db or "
            "mysql+pymysql://user:password@host/db."
        )
    for scheme in ("sqlite:///", JOURNAL):
        file = Path(url[len(scheme) :]) if url.startswith(scheme) else None
        if file is not None and str(file) not in ("", ":memory:") and not file.parent.is_dir():
            raise SelfSpecError(
                f"cannot open Optuna storage '{redact(url)}': folder {file.parent} does not exist."
            )
    try:
        if url.startswith(JOURNAL):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(url[len(JOURNAL) :]))
        from selfspec.search.workers import GRACE_PERIOD, HEARTBEAT_INTERVAL, retry_trial

        return optuna.storages.RDBStorage(
            url,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            grace_period=GRACE_PERIOD,
            heartbeat_stale_trial_callback=retry_trial,
        )
    except (Exception, SystemExit) as exc:  # sqlalchemy/driver errors come in many types
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SelfSpecError(
            f"cannot open Optuna storage '{redact(url)}' ({type(exc).__name__}: {detail}). Check "
            "the URL, that the database server is reachable and that its driver is installed "
            "(pip install 'psycopg[binary]' for postgresql://, pymysql for mysql+pymysql://)."
        ) from None
