"""`selfspec train-heads` under `accelerate launch`: two CPU processes on gloo share the work (each
writes half the questions, answers half of them, reads the hidden states of half the answers and
takes half of every batch) and write the answers and the heads one process writes, the heads up to
float rounding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from live_server import ENV, free_port
from test_history import PROMPTS

from selfspec.drafters.heads import DraftHeads
from selfspec.training.history import History
from selfspec.training.ranks import Ranks, prefix

# Two processes sum the same products in another order (a batch's halves, then their sum), and
# AdamW's first steps divide by tiny second moments, so a few weights move by a step apart: each
# tensor agrees with one process's to this share of its norm (3e-5 measured).
TOLERANCE = 1e-3


def test_one_process_is_every_item_in_order():
    ranks = Ranks()
    items = ["a", "b", "c"]
    assert ranks.share(items) == [(0, "a"), (1, "b"), (2, "c")]
    assert ranks.gather(ranks.share(items)) == ranks.share(items)
    assert prefix([(0, "a"), (1, "b"), (3, "d")]) == ["a", "b"]  # 2 missing: stop there
    assert Ranks(1, 2).share(items) == [(1, "b")]


@pytest.mark.slow  # two trainings, one of them on two processes
def run_train_heads(args: list[str], out, processes: int) -> subprocess.CompletedProcess:
    train = ["-m", "selfspec.cli", "train-heads", "--model", "smollm2-135m", "--no-measure"]
    launch = []
    if processes > 1:
        # --multi_gpu: accelerate's launcher of several processes (torch.distributed.run); with no
        # GPU they are CPU processes on gloo
        launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1"]
        launch += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
        launch += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    command = [sys.executable, *launch, *train, *args, "--out", str(out)]
    env = {**ENV, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1  # the main process reports; the others are quiet
    return done


@pytest.mark.slow  # two short trainings, one of them on two processes
def test_two_processes_write_and_answer_one_process_s_questions(tmp_path):
    args = ["--questions", "12", "--max-new-tokens", "24", "--epochs", "1"]
    answers = {}
    for processes in (1, 2):
        out = tmp_path / str(processes) / "heads.safetensors"
        run_train_heads(args, out, processes)
        answers[processes] = json.loads((out.parent / f".{out.name}.work/answers.json").read_text())
    assert len(answers[1]["answers"]) == 12
    for key in ("questions", "prompts", "answers", "task_answers"):  # greedy: all the same
        assert answers[2].get(key, []) == answers[1].get(key, []), key


@pytest.mark.slow  # two trainings, one of them on two processes
def test_two_processes_under_accelerate_launch_write_one_process_s_heads(smollm2, tmp_path):
    history = History(tmp_path / "smollm2-135m.jsonl")
    for prompt in PROMPTS:
        ids = smollm2.encode(prompt)
        history.record(ids, smollm2.generate(ids, None, max_new_tokens=48).token_ids)
    args = ["--fresh", "--from-history", str(history.path), "--epochs", "2"]
    run_train_heads(args, tmp_path / "one.safetensors", 1)
    run_train_heads(args, tmp_path / "two.safetensors", 2)
    size = smollm2.loaded.model.config.hidden_size
    alone = DraftHeads.load(tmp_path / "one.safetensors", size)
    shared = DraftHeads.load(tmp_path / "two.safetensors", size)
    assert (alone.info["processes"], shared.info["processes"]) == (1, 2)
    assert alone.info["rows"] == shared.info["rows"] > 0
    assert torch.equal(alone.frequent, shared.frequent)
    pairs = [
        *zip(alone.weights, shared.weights),
        *zip(alone.biases, shared.biases),
        *zip(alone.downs or [], shared.downs or []),
    ]
    assert pairs
    for a, b in pairs:
        assert (a.float() - b.float()).norm() <= TOLERANCE * a.float().norm()
    assert shared.info["heldout_top1_by_head"] == alone.info["heldout_top1_by_head"]
