"""Two default drafters in one process, one with a change switched off (here
``input_table.patch``'s table): each prompt twice, order alternated; decoding-phase ratio new /
old, passes, identical outputs, through stop 44's ``paired_heads.compare``. Apply the patch
first (``git apply``). paired_table.log was written by an earlier copy of that loop, which printed
each pair and the median only.

    python paired_table.py spec-bench 1 > paired_table.log
"""

import sys
import time
from pathlib import Path

from selfspec.engine import Engine
from selfspec.prompts import load_prompts

STOP44 = Path(__file__).resolve().parent.parent / "cpu-finetune-2026-11-27-stop44"
sys.path.insert(0, str(STOP44))
from paired_heads import compare  # noqa: E402


def main(switch_off, source: str, limit: int) -> None:
    engine = Engine.load("qwen2.5-coder-1.5b")
    began = time.perf_counter()
    new = engine.self_drafter()
    print(f"drafter made in {time.perf_counter() - began:.2f} s")
    old = engine.self_drafter()
    switch_off(old)
    compare(engine, {"old": old, "new": new}, load_prompts(source, limit))


if __name__ == "__main__":

    def off(drafter) -> None:
        drafter.heads._base_inputs = {}

    main(
        off,
        sys.argv[1] if len(sys.argv) > 1 else "spec-bench",
        int(sys.argv[2]) if len(sys.argv) > 2 else 1,
    )
