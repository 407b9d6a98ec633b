"""The machine a bench ran on, and how much memory each method needed."""

from __future__ import annotations

import os
import platform
import sys
import threading
from typing import TYPE_CHECKING

from selfspec.machine import cpu_name

if TYPE_CHECKING:
    from selfspec.engine import Engine

MEMORY_METHOD = (
    "peak_rss_mb: highest resident set size in MiB (psutil memory_info().rss, sampled every 5 ms "
    "by a background thread) of this one process during the method's warm-up generation. All "
    "methods share the process, so the figure includes everything loaded when that warm-up ran: "
    "warm-ups run before the draft model is loaded for methods that need only the target "
    "(hf_generate, autoregressive, self_speculative, prompt_lookup), then the draft model is "
    "loaded for dual_model and hf_assisted, then the GGUF for llama_cpp. When selfspec runs a "
    "speed mode other than torch, transformers' own methods (hf_generate, prompt_lookup, "
    "hf_assisted) get an unmodified copy of the model, loaded after selfspec's methods of the "
    "same phase were measured, so their figures include that copy too. Memory freed by earlier "
    "methods may stay with the allocator, so later figures are upper bounds."
)


class PeakRss:
    """Highest RSS of this process while the block runs, sampled by a background thread."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while True:
            self.peak = max(self.peak, self.process.memory_info().rss)
            if self._stop.wait(self.interval):
                break

    def __enter__(self):
        self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def process_peak_rss_mb() -> float:
    """The kernel's high-water mark of this process's RSS (ru_maxrss), over its whole life."""
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
    except (ImportError, OSError):
        return float("nan")


def describe_machine(engine: Engine | None = None) -> dict:
    import psutil
    import torch
    import transformers

    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if engine is not None:
        info["device"] = str(engine.loaded.device)
        info["dtype"] = str(engine.loaded.dtype).replace("torch.", "")
        info["speed_mode"] = engine.loaded.speed
        if engine.loaded.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(engine.loaded.device)
    return info
