"""Paired runs in one process: head drafts over 8192 ids against 16384 (stop 41).

    python search/qwen2.5-coder-1.5b/paired-2026-11-27-stop41/vocab.py   # output: vocab.log

26 Spec-Bench prompts (--limit 2), 128 tokens, twice, the two drafters' order alternated, plain
decoding run beside each pair; the ratio is of decode tokens/s (after the first token).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from paired import compare

import selfspec.drafters.heads as H
from selfspec.engine import Engine

e = Engine.load("qwen2.5-coder-1.5b")
H.FREQUENT_IDS = 16384  # the default when this ran; 8192 since
base = e.self_drafter()
H.FREQUENT_IDS = 8192
small = e.self_drafter()
print("vocab sizes", len(base.heads.vocab.base_ids), len(small.heads.vocab.base_ids))
compare(e, small, base, "8192", "16384")
