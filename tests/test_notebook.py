"""The tour notebook runs top to bottom (small, with SELFSPEC_NOTEBOOK_FAST=1), in this
interpreter's kernel."""

import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "selfspec_tour.ipynb"


@pytest.mark.slow
def test_tour_notebook_executes(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("SELFSPEC_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("SELFSPEC_NO_PROGRESS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Raises CellExecutionError (with the cell's traceback) if any cell fails, asserts included.
    nbclient.NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    # A cell's printed text may come back in several stream chunks, split anywhere (by when the
    # kernel flushed): join a cell's chunks as they are, cells by line breaks.
    text = "\n".join(
        "".join(
            out.get("text", "")
            for out in cell.get("outputs", [])
            if out.get("output_type") == "stream"
        )
        for cell in nb.cells
        if cell.cell_type == "code"
    )
    prefix = next(line for line in text.splitlines() if line.startswith("environment: "))
    # The kernel ran in this interpreter's environment (the venv), not some other python3 on the
    # PATH.
    assert Path(prefix.removeprefix("environment: ")) == Path(sys.prefix)
    assert "fast mode: True" in text
    assert "identical token ids: True" in text
    images = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert len(images) == 2
