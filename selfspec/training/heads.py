"""Training draft heads (``drafters.heads``) on the target's own answers.

Self-distillation, with no data from outside the model: the model writes questions on a list of
topics, answers them (greedy, in its speed mode), and the chain of heads learns, from the final
hidden state at one answer token and the tokens after it, the answer tokens 2, 3, ... places later.
Spec-Bench's prompts are never used, so bench measures the heads on text they have not seen.

    data  = answers_for(engine, work, questions, max_new, budget)  # saved as it goes: resumable
    rows  = features(engine, data["prompts"], data["answers"], heads)
    heads = fit(engine, rows, heads, epochs)   # held-out answers: heads.info["heldout_top1"]
    heads_pay(engine, heads, heldout_prompts)  # self-speculation with and without them, timed

With ``--budget MINUTES`` every stage gets a deadline within it (answers end at about 45% of it).

The training arithmetic itself is ``selfspec.training.fit``'s, which the GPU script shares.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.drafters.heads import FREQUENT_IDS, DraftHeads
from selfspec.errors import SelfSpecError
from selfspec.fileio import atomic_write_text
from selfspec.loading.fetch import progress_bar
from selfspec.training.budget import Budget, past
from selfspec.training.fit import fit_rows, frequent_ids
from selfspec.training.history import History
from selfspec.training.ranks import Ranks, prefix

if TYPE_CHECKING:
    from selfspec.engine import Engine

TOPICS = (
    "cooking", "travel", "personal finance", "history", "physics", "biology", "chemistry",
    "programming in Python", "JavaScript and web development", "databases and SQL",
    "machine learning", "mathematics homework", "logic puzzles", "writing stories",
    "writing emails", "poetry", "music", "health and fitness", "psychology", "philosophy",
    "economics", "law", "geography", "astronomy", "language learning and translation",
    "job interviews", "startups", "movies and books", "data analysis", "the Linux command line",
    "algorithms", "everyday advice", "sports", "art", "parenting", "climate", "electronics",
    "statistics", "role-play as a character", "summarizing articles", "C and C++ programming",
    "debugging code", "shell scripting", "unit testing", "writing documentation", "ethics",
    "gardening", "cars", "trivia and general knowledge", "explaining science to a child",
    "world religions and mythology", "architecture", "nutrition", "pets", "video games",
    "project management", "marketing", "public speaking", "spreadsheets", "networking and the "
    "internet", "cybersecurity", "chess and board games", "fashion", "home repair",
)  # fmt: skip
QUESTION_PROMPT = (
    "Write {n} different, specific questions or requests that people might send to an AI "
    "assistant about {topic}. Vary their style and length. One per line, no numbering, "
    "nothing else."
)
BATCH = 8  # answers written in one pass at a time (more rows cost about as much each)
# Tasks over a text the model wrote itself (one of its answers): what users ask of a model about a
# document (summaries, answers from a passage, extraction, translation, rewriting), whose answers
# copy and transform their prompt in ways answers to short questions do not.
TASKS = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "Answer the question using only the text below.\n\nText:\n{text}\n\nQuestion: {question}",
    "List the key facts, names and numbers in the text below as a bulleted list.\n\n{text}",
    "Translate the following text into {language}.\n\n{text}",
    "Rewrite the following text so that a twelve-year-old can understand it.\n\n{text}",
    "Write three questions a reader could answer from the text below, each with its answer."
    "\n\n{text}",
)
LANGUAGES = ("French", "German", "Spanish", "Chinese", "Japanese", "Russian", "Italian", "Korean")


def generate_greedy(
    engine: Engine,
    prompts: list[list[int]],
    max_new: int,
    desc: str,
    done: list[list[int]] | None = None,
    save: Callable[[list[list[int]]], None] | None = None,
    deadline: float | None = None,
    budget: Budget | None = None,
    states: dict | None = None,
):
    """Greedy answers, after the ``done`` ones (an earlier run's), in order, handed to ``save`` as
    they come; none begins past ``deadline`` once there are two (one to train on, one held out),
    so there may be fewer answers than prompts. Where the runner batches, up to ``BATCH`` answers
    are written at once, a new one begun as soon as one ends; ``states`` gets their hidden states
    as ``features`` would compute them (``keep_states``)."""
    runner, eos = engine.runner, set(engine.eos_ids())
    answers: list[list[int]] = list(done or [])
    bar = progress_bar(len(prompts), desc, unit="answer")
    bar.update(len(answers))
    first, waiting, saved = len(answers), {}, len(answers)
    todo = prompts[first:]

    def may_begin(begun: int) -> bool:  # begun: of ``todo``
        return not (past(deadline) and first + begun >= 2)

    if runner.can_batch:
        finished = _answer_stream(engine, todo, max_new, eos, states, may_begin)
    else:
        finished = (
            (i, engine.generate(p, None, max_new_tokens=max_new).token_ids)
            for i, p in enumerate(todo)
            if may_begin(i)
        )
    for index, answer in finished:
        waiting[first + index] = answer
        while len(answers) in waiting:  # in the prompts' order
            answers.append(waiting.pop(len(answers)))
        if save and len(answers) >= saved + BATCH:
            save(answers)
            saved = len(answers)
        if budget:
            budget.show(bar)
        bar.update()
    if save and len(answers) > saved:
        save(answers)
    bar.close()
    return answers


@dataclass
class _Answering:
    """One answer being written: its cache, its tokens so far and their final hidden states."""

    prompt: list[int]
    cache: object
    answer: list[int]
    rows: list[torch.Tensor]

    def ended(self, eos: set[int], max_new: int) -> bool:
        return self.answer[-1] in eos or len(self.answer) >= max_new


def _answer_stream(engine: Engine, prompts, max_new: int, eos: set[int], states, may_begin):
    """(index, answer) of ``prompts``' greedy answers as each ends, ``BATCH`` of them written in
    one pass at a time; prompt ``i`` begins while ``may_begin(i)``."""
    runner = engine.runner
    live: dict[int, _Answering] = {}
    begun = 0
    while True:
        while len(live) < BATCH and begun < len(prompts) and may_begin(begun):
            live[begun] = _begin_answer(runner, prompts[begun], max_new, states is not None)
            begun += 1
        for i in [i for i, a in live.items() if a.ended(eos, max_new)]:
            done = live.pop(i)
            if states is not None:
                keep_states(states, done.prompt, done.answer, torch.cat(done.rows))
            yield i, done.answer
        if not live:
            if begun == len(prompts) or not may_begin(begun):
                return
            continue
        writing = list(live.values())
        positions = [len(a.prompt) + len(a.answer) - 1 for a in writing]
        logits = runner.forward_many(
            [a.cache for a in writing], [a.answer[-1] for a in writing], positions
        )
        normed = _normed(runner, runner.last_rows_hidden) if states is not None else None
        for row, a in enumerate(writing):
            a.answer.append(int(logits[row].argmax()))
            if normed is not None:
                a.rows.append(normed[row : row + 1])


def _begin_answer(runner, prompt: list[int], max_new: int, keep: bool) -> _Answering:
    """The prompt's pass into a cache of its own: its answer's first token."""
    cache = runner.new_cache(len(prompt) + max_new + 1)
    with runner.using(cache):
        logits, _ = runner.forward(torch.tensor(prompt), 0, last_logits_only=True)
    rows = [_normed(runner, runner.last_hidden)] if keep else []
    return _Answering(prompt, cache, [int(logits[-1].argmax())], rows)


@torch.inference_mode()
def _normed(runner, hidden: torch.Tensor) -> torch.Tensor:
    """Final hidden states [rows, hidden] as the heads read them: normed, float16, on the CPU."""
    return runner.adapter.final_norm(hidden).float().half().cpu()


def keep_states(states: dict, prompt: list[int], answer: list[int], normed: torch.Tensor) -> None:
    """Keep an answer's hidden states, from the one that produced its first token on ([len(answer)
    or more, hidden], normed), for ``features``: those of the rows it trains on."""
    states[tuple(prompt + answer)] = normed[: len(answer) - 1]


def task_prompt(text: str, question: str, rng: random.Random) -> str:
    """A task over ``text`` (an answer the model wrote to ``question``), chosen with ``rng``."""
    task = rng.choice(TASKS)
    if "{language}" in task:
        text = "\n".join(text.splitlines()[:6])  # translations: a few lines, not a whole answer
    return task.format(text=text.strip(), question=question, language=rng.choice(LANGUAGES))


def task_texts(questions, answers, decode, rng: random.Random, count: int, min_tokens: int):
    """Up to ``count`` task prompts (``task_prompt``, as text) over the answers (token ids, read
    with ``decode``) of at least ``min_tokens`` tokens, each with the question it answered."""
    return [
        task_prompt(decode(a), q, rng) for q, a in zip(questions, answers) if len(a) >= min_tokens
    ][:count]


def write_questions(engine: Engine, per_topic: int, topics=TOPICS, ranks=Ranks()) -> list[str]:
    prompts = [
        engine.encode(QUESTION_PROMPT.format(n=per_topic, topic=t), chat=True) for t in topics
    ]
    questions: list[str] = []
    for answer in answered(engine, ranks, prompts, 24 * per_topic + 32, "questions"):
        add_questions(questions, engine.tokenizer.decode(answer, skip_special_tokens=True))
    return questions


def answered(engine, ranks: Ranks, prompts, max_new, desc, done=None, save=None, deadline=None,
             budget=None, states=None) -> list[list[int]]:  # fmt: skip
    """``generate_greedy`` over several processes: each answers every ``world``-th prompt, and
    every process gets the answers of the prompts all answered, in order (saved once at the end:
    a stopped run of several processes resumes from where the last stage it finished left).
    ``states``: the hidden states of the answers this process wrote."""
    if ranks.world == 1:
        return generate_greedy(engine, prompts, max_new, desc, done, save, deadline, budget, states)
    share = ranks.share(prompts)
    done = list(done or [])
    mine = [done[i] for i, _ in share if i < len(done)]
    prompts = [p for _, p in share]
    got = generate_greedy(engine, prompts, max_new, desc, mine, None, deadline, budget, states)
    answers = prefix(ranks.gather(list(zip((i for i, _ in share), got))))
    if save and ranks.main:
        save(answers)
    return answers


def add_questions(questions: list[str], text: str) -> None:
    """Adds the questions of a model-written list (one per line) not yet in ``questions``."""
    for line in text.splitlines():
        line = line.strip().lstrip("-*0123456789.) ").strip()
        if len(line) > 15 and line not in questions:
            questions.append(line)


def answers_for(
    engine: Engine,
    work: Path,
    questions: int,
    max_new: int,
    budget: Budget | None = None,
    ranks: Ranks = Ranks(),
    states: dict | None = None,
) -> dict:
    """The questions and the model's answers, then tasks over a quarter of those answers and the
    model's answers to them (``TASKS``), from ``work`` as far as an earlier run saved them. Saved
    after every group of answers; with a ``budget``, answers stop at 45% of it and tasks at 60%,
    so that the hidden states and the fit get the rest. ``states`` gets the hidden states of the
    answers written now (``generate_greedy``)."""
    budget = budget or Budget(None)
    path = work / "answers.json"
    data = json.loads(path.read_text()) if ranks.main and path.is_file() else {}
    data = ranks.broadcast(data)  # the main process's folder holds the answers
    if (
        data.get("max_new") != max_new
        or data.get("asked_for", len(data.get("answers", ()))) < questions
    ):
        per_topic = max(2, -(-questions // len(TOPICS)))  # a model may write fewer than asked
        topics = TOPICS[: -(-questions // per_topic) + 4]
        asked = write_questions(engine, per_topic, topics, ranks)
        random.Random(0).shuffle(asked)
        asked = asked[:questions]
        prompts = [engine.encode(q, chat=True) for q in asked]
        data = {"questions": asked, "prompts": prompts, "answers": [], "max_new": max_new}
        data["asked_for"] = questions
        if ranks.main:
            atomic_write_text(path, json.dumps(data))

    def saver(key: str) -> Callable[[list[list[int]]], None]:
        def save(answers: list[list[int]]) -> None:
            data[key] = answers
            atomic_write_text(path, json.dumps(data))

        return save

    data["answers"] = answered(
        engine, ranks, data["prompts"], max_new, "answers", data.get("answers"),
        saver("answers"), budget.until(0.45), budget, states,
    )  # fmt: skip
    if "task_prompts" not in data or len(data["task_prompts"]) < len(data["answers"]) // 4:
        texts = task_texts(
            data["questions"],
            data["answers"],
            partial(engine.tokenizer.decode, skip_special_tokens=True),
            random.Random(0),
            count=max(1, len(data["answers"]) // 4),
            min_tokens=32,
        )
        data["task_prompts"] = [engine.encode(text, chat=True) for text in texts]
        # a task list grown from more answers keeps its first tasks: same seed, same order
        data["task_answers"] = data.get("task_answers", [])[: len(data["task_prompts"])]
    data["task_answers"] = answered(
        engine, ranks, data["task_prompts"], max_new, "tasks", data.get("task_answers"),
        saver("task_answers"), budget.until(0.27), budget, states,
    )  # fmt: skip
    return data


@torch.inference_mode()
def features(
    engine: Engine,
    prompts: list[list[int]],
    answers: list[list[int]],
    heads: int,
    deadline: float | None = None,
    states: dict | None = None,
):
    """Per answer: final hidden states (normed) of its rows [n, hidden] and ``chain_tokens``;
    those kept in ``states`` while answering are not computed again; None for the others past
    ``deadline`` once there are two."""
    runner = engine.runner
    states = states or {}
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    bar = progress_bar(len(prompts), "hidden states", unit="answer")
    for prompt, answer in zip(prompts, answers):
        ids = prompt + answer
        rows = torch.arange(len(prompt) - 1, len(ids) - 2)
        normed = states.get(tuple(ids))
        if normed is None and past(deadline) and sum(r is not None for r in out) >= 2:
            out.append(None)
            continue
        if normed is None:
            runner.reset(len(ids) + 1)
            _, hidden = runner.forward(
                torch.tensor(ids), 0, capture_at=runner.num_sublayers, last_logits_only=True
            )
            normed = _normed(runner, hidden[0, rows])
        out.append((normed, chain_tokens(ids, rows, heads)))
        bar.update()
    bar.close()
    return out


def chain_tokens(ids: list[int], rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads + 1, n]: per row i (which produced token i + 1), tokens i + 1 ... i + 1 + heads: the
    token the chain starts from, then the one each head should guess (-1 past the end)."""
    tokens = torch.tensor(ids + [-1] * heads)
    return torch.stack([tokens[rows + 1 + j] for j in range(heads + 1)])


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
) -> DraftHeads:
    """Train a chain of ``heads`` heads of ``layers`` layers (cross-entropy over ``scored`` ids,
    the training answers' most frequent as ``frequent_ids`` picks them, ``soft`` of it against the
    model's own distribution; a draft scores the most frequent and the context's, so the others are
    left out) on all but the last ``heldout`` share of answers, measured on those; no batch
    begins past ``deadline``. ``init``: heads to start from (default: zeros). ``ranks``: each
    batch split over several processes."""
    if len(answers) < 2:
        raise SelfSpecError(
            f"only {len(answers)} answer(s) to train draft heads on: ask for more --questions "
            "(the model wrote too few usable questions)"
        )
    torch.manual_seed(seed)
    split = held_out_from(len(answers), heldout)
    train, test = answers[:split], answers[split:] or answers[-1:]
    owner = torch.cat([torch.full((len(h),), k) for k, (h, _) in enumerate(train)])
    tokens = torch.cat([y for _, y in train], dim=1)[: heads + 1]
    embed = embedding_table(engine)
    vocab = min(engine.runner.head_rows, len(embed))
    earlier = init.frequent if init is not None else None
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
) -> DraftHeads:
    """Answers (resumed from ``work``; or ``history``'s, what the model was used for), their
    hidden states, the fit (from ``start``'s heads, if given), saved to ``out``; within ``budget``
    when given. ``measure``: time them on held-out prompts on this machine first (``heads_pay``;
    in ``info["decode_speedup"]``). ``ranks``: this process's share of the work of several
    (``selfspec.training.ranks``); the main one measures and saves."""
    started = time.time()
    budget = budget or Budget(None)
    states: dict = {}  # the hidden states of the answers written now: computed once
    if history is None:
        data = answers_for(engine, work, questions, max_new, budget, ranks, states)
        pairs = answered_pairs(data)
    else:
        pairs = history_pairs(engine, history)
    random.Random(0).shuffle(pairs)  # tasks among the held-out answers too
    # hidden states not kept while answering (a history's, a resumed run's) cost about what the
    # fit does: each gets a little under half of what is left
    until = budget.until(0.45)
    share = ranks.share(pairs)
    got = features(
        engine, [p for _, (p, _) in share], [a for _, (_, a) in share], heads, until, states
    )
    # a process may stop sooner
    kept = ranks.gather([(i, rows) for (i, _), rows in zip(share, got) if rows is not None])
    pairs, rows = [pairs[i] for i, _ in kept], [r for _, r in kept]
    fit_until = budget.until(0.85)
    trained = fit(
        engine, rows, heads, epochs, layers=layers, soft=soft, deadline=fit_until, init=start,
        ranks=ranks,
    )  # fmt: skip
    trained.info["seconds"] = round(time.time() - started)
    trained.info["processes"] = ranks.world
    learned_from(trained, start, from_use=history is not None)
    if ranks.main:
        if measure:
            heldout = [p for p, _ in pairs[held_out_from(len(rows)) :]][:4]
            trained.info["decode_speedup"] = heads_pay(engine, trained, heldout, before=start)
        trained.save(out)
    ranks.wait()
    return trained


def answered_pairs(data: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) of every answer ``answers_for`` gathered (fewer than asked past a
    budget)."""
    answered = len(data["answers"]), len(data["task_answers"])
    prompts = data["prompts"][: answered[0]] + data["task_prompts"][: answered[1]]
    return list(zip(prompts, data["answers"] + data["task_answers"]))


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
