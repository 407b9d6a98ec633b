"""Spec-Bench prompts sharing 8-word sequences with the texts ``human_tasks.py`` reads.

python overlap.py CORPUS_DIR > overlap.log
"""

import json
import re
import sys
from pathlib import Path

corpus = Path(sys.argv[1])
text = (corpus / "enwiki.xml").read_text(errors="ignore")
text += (corpus / "lee_background.cor").read_text(errors="ignore")
words = re.findall(r"\w+", text.lower())
grams = {tuple(words[i : i + 8]) for i in range(len(words) - 8)}
shared = 0
for line in open("../shared/data/spec_bench/question.jsonl"):
    q = json.loads(line)
    w = re.findall(r"\w+", " ".join(q["turns"]).lower())
    n = sum(tuple(w[i : i + 8]) in grams for i in range(len(w) - 8))
    if n:
        shared += 1
        print(q["category"], n, "of", len(w) - 8, "8-word sequences")
print("prompts sharing any:", shared)
