"""Training draft heads (``drafters.heads``) on the target's own answers.

Self-distillation, with no data from outside the model: the model writes questions on a list of
topics, answers them (greedy, in its speed mode; ``selfspec.training.answers``), and the chain of
heads learns, from the final hidden state at one answer token and the tokens after it, the answer
tokens 2, 3, ... places later. Spec-Bench's prompts are never used, so bench measures the heads
on text they have not seen.

    data  = answers_for(engine, work, questions, max_new, budget)  # saved as it goes: resumable
    rows  = features(engine, data["prompts"], data["answers"], heads)
    heads = fit(engine, rows, heads, epochs)   # held-out answers: heads.info["heldout_top1"]
    heads_pay(engine, heads, heldout_prompts)  # self-speculation with and without them, timed

With ``--budget MINUTES`` every stage gets a deadline within it (answers end at about 45% of it).

The training arithmetic itself is ``selfspec.training.fit``'s, which the GPU script shares.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.drafters.heads import FREQUENT_IDS, DraftHeads
from selfspec.errors import SelfSpecError
from selfspec.loading.fetch import progress_bar
from selfspec.runtime.sampling import Sampling
from selfspec.training.answers import answer_writers, answered_pairs, answers_for, normed_states
from selfspec.training.budget import Budget, past
from selfspec.training.fit import fit_rows, frequent_ids
from selfspec.training.history import History
from selfspec.training.ranks import Ranks

if TYPE_CHECKING:
    from selfspec.engine import Engine


@torch.inference_mode()
def features(
    engine: Engine,
    prompts: list[list[int]],
    answers: list[list[int]],
    heads: int,
    deadline: float | None = None,
    states: dict | None = None,
    relabel: bool = False,
):
    """Per answer: final hidden states (normed) of its rows [n, hidden] and ``chain_tokens``;
    those kept in ``states`` while answering are not computed again; None for the others past
    ``deadline`` once there are two. ``relabel``: the answers are texts the model did not write
    (``selfspec.training.texts``): the heads are to guess the model's own tokens over them
    (``model_chain_tokens``)."""
    runner = engine.runner
    states = states or {}
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    to_read = sum(relabel or tuple(p + a) not in states for p, a in zip(prompts, answers))
    bar = progress_bar(to_read, "hidden states", unit="answer")
    for prompt, answer in zip(prompts, answers):
        ids = prompt + answer
        rows = torch.arange(len(prompt) - 1, len(ids) - 2)
        # kept once: not held twice (never for texts: their rows' predictions need the pass)
        normed = None if relabel else states.pop(tuple(ids), None)
        if normed is None and past(deadline) and sum(r is not None for r in out) >= 2:
            out.append(None)
            continue
        if normed is None:
            runner.reset(len(ids) + 1)
            _, hidden = runner.forward(
                torch.tensor(ids), 0, capture_at=runner.num_sublayers, last_logits_only=True
            )
            normed = normed_states(runner, hidden[0, rows])
            bar.update()
        if relabel:
            tokens = model_chain_tokens(ids, rows, heads, predictions(runner, hidden, len(prompt)))
        else:
            tokens = chain_tokens(ids, rows, heads)
        out.append((normed, tokens))
    bar.close()
    return out


def chain_tokens(ids: list[int], rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads + 1, n]: per row i (which produced token i + 1), tokens i + 1 ... i + 1 + heads: the
    token the chain starts from, then the one each head should guess (-1 past the end)."""
    tokens = torch.tensor(ids + [-1] * heads)
    return torch.stack([tokens[rows + 1 + j] for j in range(heads + 1)])


def predictions(runner, hidden: torch.Tensor, first: int, chunk: int = 256) -> torch.Tensor:
    """[n]: the model's greedy token after each row of ``hidden`` [1, n, hidden] (the last
    sublayer's output) from row ``first`` on (-1 before it), over the whole vocabulary."""
    picked = torch.full((hidden.shape[1],), -1, dtype=torch.long)
    for start in range(first, hidden.shape[1], chunk):
        logits = runner.adapter.logits(hidden[:, start : start + chunk])[0]
        picked[start : start + len(logits)] = logits.argmax(-1).cpu()
    return picked


def model_chain_tokens(
    ids: list[int], rows: torch.Tensor, heads: int, predicted: torch.Tensor
) -> torch.Tensor:
    """``chain_tokens`` for a text the model did not write, with the model's own tokens to guess:
    head j's at row i is ``predicted[i + 1 + j]`` (what the model says after the text up to token
    i + 1 + j), fed the text's tokens; kept while the text says what the model would along the
    chain (a head is fed the guesses before it, so a text that leaves the model's path is no chain
    a draft meets), else -1."""
    tokens = chain_tokens(ids, rows, heads)
    relabeled, agree = [tokens[0]], torch.ones(len(rows), dtype=torch.bool)
    for j in range(heads):
        target = predicted[(rows + 1 + j).clamp(max=len(predicted) - 1)]
        valid = agree & (tokens[j + 1] >= 0) & (target >= 0)
        relabeled.append(torch.where(valid, target, -1))
        agree = valid & (tokens[j + 1] == target)
    return torch.stack(relabeled)


def embedding_table(engine: Engine, chunk: int = 4096) -> torch.Tensor:
    """Every token's input embedding, in the engine's own arithmetic: float16 [vocab, hidden]."""
    runner = engine.runner
    size = runner.model.get_input_embeddings().num_embeddings
    parts = []
    with torch.inference_mode():
        for first in range(0, size, chunk):
            ids = torch.arange(first, min(size, first + chunk), device=runner.device)
            parts.append(runner.adapter.embed(ids).half().cpu())
    return torch.cat(parts)


def output_rows(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """The output head's rows of token ``ids`` as float32 [len(ids), hidden] (the head over the
    unit vectors, in the engine's own arithmetic)."""
    runner = engine.runner
    head = runner.model.get_output_embeddings()
    from selfspec.kernels import linear_rows

    eye = torch.eye(head.in_features, device=runner.device, dtype=runner.dtype)
    with torch.inference_mode():
        rows = linear_rows(head, ids.to(runner.device))(eye).float().T.cpu()
    return rows.clone()  # outside inference mode: training saves it for the backward pass


HELDOUT = 0.1  # the share of answers (the last ones, shuffled) the heads are measured on


def held_out_from(count: int, heldout: float = HELDOUT) -> int:
    """The index of the first held-out answer of ``count`` (at least one is trained on)."""
    return max(1, int(count * (1 - heldout)))


def held_out_split(groups: list) -> int:
    """``held_out_from`` for answers of ``groups`` (a text's windows, together), moved to where
    a group begins, so that a group is all trained on or all held out: the first such place at
    or after it, else the last before it."""
    split = held_out_from(len(groups))
    starts = [i for i in range(1, len(groups)) if groups[i] != groups[i - 1]]
    later = [i for i in starts if i >= split]
    return later[0] if later else (starts[-1] if starts else split)


def fit(
    engine: Engine,
    answers: list[tuple[torch.Tensor, torch.Tensor]],
    heads: int,
    epochs: int = 3,
    scored: int = 2 * FREQUENT_IDS,
    heldout: float = HELDOUT,
    seed: int = 0,
    layers: int = 2,
    soft: float = 0.5,
    deadline: float | None = None,
    init: DraftHeads | None = None,
    ranks: Ranks = Ranks(),
    split: int | None = None,
) -> DraftHeads:
    """Train a chain of ``heads`` heads of ``layers`` layers (cross-entropy over ``scored`` ids,
    the training answers' most frequent as ``frequent_ids`` picks them, ``soft`` of it against the
    model's own distribution; a draft scores the most frequent and the context's, so the others are
    left out) on all but the last ``heldout`` share of answers (or those from ``split`` on),
    measured on those; no batch begins past ``deadline``. ``init``: heads to start from
    (default: zeros). ``ranks``: each batch split over several processes."""
    if len(answers) < 2:
        raise SelfSpecError(
            f"only {len(answers)} answer(s) to train draft heads on: ask for more --questions "
            "(the model wrote too few usable questions)"
        )
    torch.manual_seed(seed)
    split = split if split is not None else held_out_from(len(answers), heldout)
    train, test = answers[:split], answers[split:] or answers[-1:]
    owner = torch.cat([torch.full((len(h),), k) for k, (h, _) in enumerate(train)])
    tokens = torch.cat([y for _, y in train], dim=1)[: heads + 1]
    embed = embedding_table(engine)
    vocab = min(engine.runner.head_rows, len(embed))
    earlier = init.frequent if init is not None else None
    if earlier is not None:
        earlier = earlier[earlier < vocab]
    ids = frequent_ids(tokens[1], vocab, min(scored, vocab), earlier)
    trained = fit_rows(
        torch.cat([h for h, _ in train]),
        tokens,
        torch.cat([h for h, _ in test]),
        torch.cat([y for _, y in test], dim=1)[: heads + 1],
        output_rows(engine, ids),
        embed,
        epochs,
        layers=layers,
        soft=soft,
        owner=owner,
        deadline=deadline,
        init=init,
        ranks=ranks,
        ids=ids,
    )
    trained.info.update(
        model=engine.loaded.name,
        speed=engine.loaded.speed,
        answers=len(answers),
        epochs=epochs,
    )
    return trained


def train_heads(
    engine: Engine,
    out: Path,
    work: Path,
    questions: int = 400,
    max_new: int = 192,
    heads: int = 2,
    epochs: int = 3,
    layers: int = 2,
    soft: float = 0.5,
    budget: Budget | None = None,
    measure: bool = False,
    history: History | None = None,
    start: DraftHeads | None = None,
    ranks: Ranks = Ranks(),
    temperature: float = 0.0,
    texts: list[tuple[list[int], list[int]]] | None = None,
    text_lines: list[int] | None = None,
) -> DraftHeads:
    """Answers (resumed from ``work``, drawn at ``temperature``; or ``history``'s, what the
    model was used for; or ``texts``, (prompt, answer) ids the model did not write, over which the
    heads learn its own tokens; ``text_lines``: the text each came from, so that a text's windows
    are trained on or held out together), their hidden states, the fit (from ``start``'s heads,
    if given), saved to ``out``; within ``budget`` when given. ``measure``: time them on held-out
    prompts on this machine first (``heads_pay``; in ``info["decode_speedup"]``). ``ranks``: this
    process's share of the work of several (``selfspec.training.ranks``); the main one measures
    and saves."""
    started = time.time()
    budget = budget or Budget(None)
    sampling = Sampling(temperature=temperature)
    sampling = Sampling() if sampling.greedy else sampling  # recorded as 0: how it is drawn
    states: dict = {}  # the hidden states of the answers written now: computed once
    if texts is None and history is None:
        data = answers_for(engine, work, questions, max_new, budget, ranks, states, sampling)
        pairs, writers = answered_pairs(data), answer_writers(data, ranks.world)
    else:
        pairs = texts if texts is not None else history_pairs(engine, history)
        writers = [i % ranks.world for i in range(len(pairs))]
    pairs, share, groups = shuffled_share(pairs, writers, ranks.rank, text_lines)
    # hidden states not kept while answering (a history's, a resumed run's) cost about what the
    # fit does: each gets a little under half of what is left
    until = budget.until(0.45)
    got = features(
        engine, [p for _, (p, _) in share], [a for _, (_, a) in share], heads, until, states,
        relabel=texts is not None,
    )  # fmt: skip
    # a process may stop sooner
    kept = ranks.gather([(i, rows) for (i, _), rows in zip(share, got) if rows is not None])
    pairs, groups = ([x[i] for i, _ in kept] for x in (pairs, groups))
    rows = [r for _, r in kept]
    split = held_out_split(groups)
    fit_until = budget.until(0.85)
    trained = fit(
        engine, rows, heads, epochs, layers=layers, soft=soft, deadline=fit_until, init=start,
        ranks=ranks, split=split,
    )  # fmt: skip
    trained.info["seconds"] = round(time.time() - started)
    trained.info["processes"] = ranks.world
    if texts is not None:
        trained.info["texts"] = len(set(groups))
    elif history is None:
        trained.info["temperature"] = sampling.temperature
    learned_from(trained, start, from_use=history is not None)
    if ranks.main:
        if measure:
            heldout = timing_prompts(pairs, groups, split)
            trained.info["decode_speedup"] = heads_pay(engine, trained, heldout, before=start)
        trained.save(out)
    ranks.wait()
    return trained


def timing_prompts(pairs: list, groups: list, split: int, count: int = 4) -> list[list[int]]:
    """Prompts to time heads from: the first pair of each of the first ``count`` held-out
    groups (pairs from ``split`` on; a text's windows are a group)."""
    firsts = [pairs[i] for i in range(split, len(pairs)) if groups[i] != groups[i - 1]]
    return [timing_prompt(p, a) for p, a in firsts[:count]]


def timing_prompt(prompt: list[int], answer: list[int]) -> list[int]:
    """A held-out pair's prompt to time heads from: a plain text's (its first token) with the
    first half of the text."""
    return prompt if len(prompt) > 1 else prompt + answer[: len(answer) // 2]


def shuffled_share(
    pairs: list, writers: list[int], rank: int, groups: list[int] | None = None
) -> tuple[list, list, list]:
    """``pairs`` shuffled (the same way in every process: tasks among the held-out answers too),
    and (index, pair) of those process ``rank`` wrote (``writers``): it holds their states.
    ``groups``: pairs of one group (a text's windows) stay together, in their order; the groups
    come back in the pairs' new order (each pair its own group where None)."""
    groups = list(groups) if groups is not None else list(range(len(pairs)))
    members: dict = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    keys = list(members)
    random.Random(0).shuffle(keys)
    order = [i for key in keys for i in members[key]]
    share = [(i, pairs[k]) for i, k in enumerate(order) if writers[k] == rank]
    return [pairs[k] for k in order], share, [groups[k] for k in order]


def history_pairs(engine: Engine, history: History) -> list[tuple[list[int], list[int]]]:
    """(prompt tail, answer) of every generation ``history`` recorded that fits this model."""
    vocab = engine.runner.model.get_input_embeddings().num_embeddings
    pairs = [(p, a) for p, a in history.entries() if max(p + a) < vocab]
    if len(pairs) < 2:
        raise SelfSpecError(
            f"{len(pairs)} generation(s) recorded in {history.path} to train draft heads on: use "
            f"the model with `--learn` (selfspec generate or serve) first, or train on its own "
            "answers without --from-history"
        )
    return pairs


def learned_from(trained: DraftHeads, start: DraftHeads | None, from_use: bool) -> None:
    """Answer tokens the heads learned from in all, and of those from use (``History``), counting
    the heads they started from."""
    before = start.info if start is not None else {}
    rows = trained.info["rows"]
    trained.info["learned_tokens"] = before.get("learned_tokens", before.get("rows", 0)) + rows
    trained.info["learned_from_use"] = before.get("learned_from_use", 0) + (rows if from_use else 0)


def decode_rate(engine: Engine, prompt: list[int], drafter, max_new: int) -> float:
    """The decoding phase's tokens per second of one greedy generation."""
    return engine.generate(prompt, drafter, max_new_tokens=max_new).stats.decode_tokens_per_second


def heads_pay(
    engine: Engine,
    heads: DraftHeads,
    prompts: list[list[int]],
    max_new: int = 96,
    before: DraftHeads | None = None,
):
    """Whether the heads pay on this machine: self-speculation's decoding speed with and without
    them (and with the heads they started from, ``before``) over plain decoding's, medians over
    held-out ``prompts`` (each method once per prompt, in turn, after a warm-up); None if every
    plain generation ended at its first token."""
    drafters = {
        "plain": lambda: None,
        "without": lambda: engine.self_drafter(heads=False),
        "with": lambda: engine.self_drafter(heads=heads),
    }
    if before is not None:
        drafters["before"] = lambda: engine.self_drafter(heads=before)
    for make in drafters.values():
        decode_rate(engine, prompts[0], make(), 16)
    rates: dict[str, list[float]] = {name: [] for name in drafters}
    bar = progress_bar(len(prompts), "timing the heads", unit="prompt")
    for prompt in prompts:
        for name, make in drafters.items():
            rates[name].append(decode_rate(engine, prompt, make(), max_new))
        bar.update()
    bar.close()
    timed = [i for i, plain in enumerate(rates["plain"]) if plain > 0]  # not ended at once
    if not timed:
        return None
    return {
        name: round(statistics.median(rates[name][i] / rates["plain"][i] for i in timed), 3)
        for name in drafters
        if name != "plain"
    }
