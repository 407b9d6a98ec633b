"""What the tuning tools' reports share: matplotlib figures rendered to PNG bytes, off screen."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig: Figure, dpi: int = 110) -> bytes:
    """The figure as PNG bytes; the figure is closed either way."""
    buffer = io.BytesIO()
    try:
        fig.tight_layout()
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    return buffer.getvalue()
