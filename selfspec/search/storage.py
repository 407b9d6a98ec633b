"""Optuna storages: opening one from a URL with a clear error, and showing URLs without
passwords."""

from __future__ import annotations

import re
from pathlib import Path

from selfspec.errors import SelfSpecError


def redact(url: str) -> str:
    """An URL with its password replaced by ***."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def storage_text(url: str) -> str:
    """The storage URL to show and record: password redacted, a SQLite file under the working folder
    relative."""
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///") :])
        try:
            if path.is_absolute():
                return "sqlite:///" + str(path.relative_to(Path.cwd()))
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
    """An Optuna storage for ``url``, or a clear SelfSpecError saying why it cannot be opened."""
    optuna = silence_optuna()
    if not isinstance(url, str) or "://" not in url:
        raise SelfSpecError(
            f"--storage '{url}' is not a storage URL. Use e.g. sqlite:///search/study.db, "
            "postgresql://user:password@host/db or mysql+pymysql://user:password@host/db."
        )
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///") :])
        if str(db) not in ("", ":memory:") and not db.parent.is_dir():
            raise SelfSpecError(
                f"cannot open Optuna storage '{redact(url)}': folder {db.parent} does not exist."
            )
    try:
        return optuna.storages.get_storage(url)
    except (Exception, SystemExit) as exc:  # sqlalchemy/driver errors come in many types
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SelfSpecError(
            f"cannot open Optuna storage '{redact(url)}' ({type(exc).__name__}: {detail}). Check "
            "the URL, that the database server is reachable and that its driver is installed "
            "(psycopg2-binary for postgresql://, pymysql for mysql+pymysql://)."
        ) from None
