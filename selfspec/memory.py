"""Giving the memory this process freed back to the system."""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """glibc keeps freed heap pages resident for reuse; after a one-off burst of allocations (a
    model's load, a drafter timing its arithmetic) they would stay with the process for its whole
    life. A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
