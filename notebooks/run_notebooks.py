"""Execute the notebooks in this folder in place, saving their outputs (run from the repo's venv).

    python notebooks/run_notebooks.py            # every notebook, full size
    SELFSPEC_NOTEBOOK_FAST=1 python notebooks/run_notebooks.py --check   # small, outputs not saved

The kernel is `python3`; jupyter_client starts it with this interpreter (sys.executable), so the
notebook sees the same environment as the command.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def execute(path: Path, timeout: int = 1800):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        coalesce_streams=True,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, default=sorted(HERE.glob("*.ipynb")))
    parser.add_argument(
        "--check", action="store_true", help="execute only; do not save the outputs"
    )
    args = parser.parse_args()
    import nbformat

    for path in args.notebooks:
        t0 = time.perf_counter()
        nb = execute(path)
        print(f"{path}: executed in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        if not args.check:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.close(fd)
            os.chmod(tmp, path.stat().st_mode & 0o777)
            nbformat.write(nb, tmp)
            os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
