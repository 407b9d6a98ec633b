"""selfspec: self-speculative decoding for Hugging Face causal language models.

The target model drafts for itself by running a subset of its sublayers (a skip plan),
then verifies the whole draft in one full forward pass over one shared KV cache.
"""

import os as _os

# MKL reads MKL_CBWR once, when it initialises. Its AVX2 code path makes multi-row matmuls
# (the verify pass) much cheaper on AVX2-only CPUs (see docs/performance.md). It only takes
# effect if selfspec is imported before torch; the CLI always is.
_os.environ.setdefault("MKL_CBWR", "AVX2")

from selfspec.errors import SelfSpecError  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Engine", "SelfSpecError", "__version__"]


def __getattr__(name: str):
    # `from selfspec import Engine` without importing torch for every `import selfspec`.
    if name == "Engine":
        from selfspec.engine import Engine

        return Engine
    raise AttributeError(f"module 'selfspec' has no attribute {name!r}")
