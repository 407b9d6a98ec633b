"""Paired runs in one process: the two-layer heads trained at stop 42 against stop 41's heads.

    python search/qwen2.5-coder-1.5b/paired-2026-11-27-stop42/heads.py NEW OLD   # -> heads.log

26 Spec-Bench prompts (--limit 2), 128 tokens, twice, the two drafters' order alternated, plain
decoding run beside each pair; the ratio is of decode tokens/s (after the first token). NEW and
OLD are heads files (the default drafter otherwise as committed).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "paired-2026-11-27-stop41"))
from paired import compare

from selfspec.engine import Engine

new_path, old_path = sys.argv[1:3]
e = Engine.load("qwen2.5-coder-1.5b")
new, old = e.self_drafter(heads=new_path), e.self_drafter(heads=old_path)
print(new.heads.describe(), "|", old.heads.describe(), flush=True)
compare(e, new, old, "new", "old")
