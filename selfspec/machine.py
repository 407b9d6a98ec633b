"""What machine this is: the CPU's name and instruction-set flags, read once from /proc/cpuinfo."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _first_field(name: str) -> str | None:
    for line in _cpuinfo_lines():
        if line.lower().startswith(name):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> str:
    """The CPU's feature flags as one space-separated string ("avx2 avx512f ..."); empty if
    unknown."""
    return _first_field("flags") or platform.processor()


def cpu_name() -> str:
    return _first_field("model name") or platform.processor() or platform.machine()


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def has_flag(flag: str) -> bool:
    return flag in cpu_flags().split()


def device_text(device, threads: int) -> str:
    """A device as reports name it: the GPU's name on CUDA, the CPU's name and core count
    otherwise."""
    device = str(device)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({cpu_name()}; {os.cpu_count()} cores, {threads} torch threads)"
