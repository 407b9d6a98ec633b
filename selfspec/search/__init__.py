"""Find a skip plan for a model: an Optuna search over a measured model of decoding speed.

Search space: one boolean "skip" flag per attention sublayer and per MLP sublayer, plus the
draft policy (max_draft_tokens 2..10, confidence_threshold 0..0.9, adaptive_threshold).
The sampler is multivariate TPE; the first trials are warm starts (the plan already at --out
if there is one, nothing skipped, evenly spaced skips in the middle layers and a few seeded
random sparse plans).

Running every trial as a real generation would be far too slow, so each trial is scored by a
speed model built from measured quantities:

  1. once per study, the full model's own greedy continuations of the calibration prompts
     (cached on disk beside the plan, keyed by model fingerprint, prompts and length);
  2. once per study, measured costs (stored in the study, so every trial and every worker
     uses the same ones): a plain decoding step, a verify pass over k = 1..12 tokens and the
     cost of one attention and one MLP sublayer (full step vs. steps with all attention or
     all MLPs skipped), so a draft step with any skip set costs embedding/head + the kept
     sublayers;
  3. per trial, one teacher-forced forward of the draft over each continuation (the prompt's
     keys/values are the full model's, as in real decoding), giving the draft's argmax and top
     probability at every position; greedy speculation is then replayed round by round
     exactly as the decode loop runs it (threshold, adaptive threshold, max draft, room left)
     and the predicted speedup is plain-step time / (round time / tokens per round).

Trials whose draft agrees with the target on fewer than 30% of positions after the first
prompt are pruned. Afterwards the best --confirm distinct trials are timed for real (greedy
generation, interleaved with plain decoding, prompt by prompt, with the decode loop's
fallback to plain decoding off so each plan's own speed is measured) and the truly fastest
one (median per-prompt speedup) is written to --out with its provenance, beside a report.md
and an importance.png.

Where: without --out, a bundled model's plan goes to the user's plan folder
(~/.cache/selfspec/plans/<model>/[<mode>/]plan.json), where `selfspec generate` looks before the
plan shipped with selfspec; any other model's to ./plan.json.

Resuming: the study lives in an Optuna storage, by default a SQLite file beside the plan
(study.db), under a name derived from the model and the calibration settings.
Re-running the same command resumes it: trials already complete count towards --trials and
only the rest are run. Ctrl-C stops the search and still writes the best plan found so far.

Several machines can share one study: point them all at one database and the same study,
e.g. on each machine

    pip install 'psycopg[binary]'          # or pymysql for MySQL
    selfspec search --model qwen2.5-coder-1.5b --trials 200 \\
        --storage postgresql://user:password@db-host/optuna --study qwen15-shared

(or ``--storage journal:///study.log``: Optuna's journal file, one machine, no server).
Each worker runs trials until the study holds --trials complete ones (counting the others'),
and the cost model measured by the first worker is stored in the study and reused by all, so
their scores stay comparable (use machines of one kind). A trial whose worker died is failed
and queued again (selfspec.search.workers). Passwords are never written into the plan or the
report.
"""

from selfspec.search.config import SearchConfig
from selfspec.search.study import SearchResult, search_plan

__all__ = ["SearchConfig", "SearchResult", "search_plan"]
