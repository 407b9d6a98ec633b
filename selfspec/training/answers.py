"""The answers draft heads learn from (``selfspec.training.heads``): the model's own, to questions
it writes itself on a list of topics and to tasks over its own answers.

    data  = answers_for(engine, work, questions, max_new, budget)  # saved as it goes: resumable
    pairs = answered_pairs(data)                                   # (prompt, answer) ids

Answers are written ``BATCH`` at a time in one pass, a new one begun as soon as one ends
(``generate_answers``), greedy or drawn at a temperature; each row's final hidden state can be
kept as it is made (``keep_states``), so the fit needs no second pass over them.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.fileio import atomic_write_text
from selfspec.loading.fetch import progress_bar
from selfspec.runtime.sampling import Sampling
from selfspec.training.budget import Budget, past
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
    "Write {n} different, specific questions or requests that {who} might send to an AI "
    "assistant about {topic}. Vary their style and length. One per line, no numbering, "
    "nothing else."
)
# Asked for many questions on one topic at once, a small model repeats itself (a 0.5B model asked
# for 47 wrote 600 usable of 3,000); more questions come from asking for a few at a time, each
# time for someone else.
QUESTIONS_PER_LIST = 10
ASKERS = ("people", "beginners", "experts", "students", "busy professionals", "curious children",
          "writers", "programmers", "teachers", "small business owners")  # fmt: skip
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


def generate_answers(
    engine: Engine,
    prompts: list[list[int]],
    max_new: int,
    desc: str,
    done: list[list[int]] | None = None,
    save: Callable[[list[list[int]]], None] | None = None,
    deadline: float | None = None,
    budget: Budget | None = None,
    states: dict | None = None,
    sampling: Sampling | None = None,
):
    """Answers, greedy or drawn with ``sampling`` (each from a generator seeded by its prompt, so
    the same prompt gets the same answer whoever writes it), after the ``done`` ones (an earlier
    run's), in order, handed to ``save`` as
    they come; none begins past ``deadline`` once there are two (one to train on, one held out),
    so there may be fewer answers than prompts. Where the runner batches, up to ``BATCH`` answers
    are written at once, a new one begun as soon as one ends; ``states`` gets their hidden states
    as ``features`` would compute them (``keep_states``)."""
    runner, eos = engine.runner, set(engine.eos_ids())
    sampling = sampling or Sampling()
    answers: list[list[int]] = list(done or [])
    bar = progress_bar(len(prompts), desc, unit="answer")
    bar.update(len(answers))
    first, waiting, saved = len(answers), {}, len(answers)
    todo = prompts[first:]

    def may_begin(begun: int) -> bool:  # begun: of ``todo``
        return not (past(deadline) and first + begun >= 2)

    if runner.can_batch:
        finished = _answer_stream(engine, todo, max_new, eos, states, may_begin, sampling)
    else:
        finished = (
            (i, engine.generate(p, None, max_new_tokens=max_new, sampling=sampling,
                                seed=_prompt_seed(p)).token_ids)
            for i, p in enumerate(todo)
            if may_begin(i)
        )  # fmt: skip
    for index, answer in finished:
        waiting[first + index] = answer
        while len(answers) in waiting:  # in the prompts' order
            answers.append(waiting.pop(len(answers)))
        if save and len(answers) >= saved + (BATCH if runner.can_batch else 1):
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
    generator: torch.Generator | None

    def ended(self, eos: set[int], max_new: int) -> bool:
        return self.answer[-1] in eos or len(self.answer) >= max_new


def _answer_stream(engine: Engine, prompts, max_new: int, eos: set[int], states, may_begin,
                   sampling: Sampling):  # fmt: skip
    """(index, answer) of ``prompts``' answers as each ends, ``BATCH`` of them written in one
    pass at a time; prompt ``i`` begins while ``may_begin(i)``."""
    runner = engine.runner
    live: dict[int, _Answering] = {}
    begun = 0
    while True:
        while len(live) < BATCH and begun < len(prompts) and may_begin(begun):
            live[begun] = _begin_answer(
                runner, prompts[begun], max_new, states is not None, sampling
            )
            begun += 1
        ended = [i for i, a in live.items() if a.ended(eos, max_new)]
        for i in ended:
            done = live.pop(i)
            if states is not None:
                keep_states(states, done.prompt, done.answer, torch.cat(done.rows))
            yield i, done.answer
        if ended:  # their places are taken before the next pass
            continue
        if not live:
            return
        writing = list(live.values())
        positions = [len(a.prompt) + len(a.answer) - 1 for a in writing]
        logits = runner.forward_many(
            [a.cache for a in writing], [a.answer[-1] for a in writing], positions
        )
        normed = normed_states(runner, runner.last_rows_hidden) if states is not None else None
        for row, a in enumerate(writing):
            a.answer.append(_pick(sampling, logits[row], a.generator))
            if normed is not None:
                a.rows.append(normed[row : row + 1])


def _begin_answer(runner, prompt: list[int], max_new: int, keep: bool, sampling) -> _Answering:
    """The prompt's pass into a cache of its own: its answer's first token."""
    cache = runner.new_cache(len(prompt) + max_new + 1)
    with runner.using(cache):
        logits, _ = runner.forward(torch.tensor(prompt), 0, last_logits_only=True)
    rows = [normed_states(runner, runner.last_hidden)] if keep else []
    generator = None
    if not sampling.greedy:
        generator = torch.Generator().manual_seed(_prompt_seed(prompt))
    return _Answering(prompt, cache, [_pick(sampling, logits[-1], generator)], rows, generator)


def _pick(sampling: Sampling, logits: torch.Tensor, generator) -> int:
    return int(logits.argmax()) if sampling.greedy else sampling.pick(logits, generator)


def _prompt_seed(prompt: list[int]) -> int:
    """A sampled answer's seed: its prompt's, the same in every process."""
    return zlib.crc32(json.dumps(prompt).encode())


@torch.inference_mode()
def normed_states(runner, hidden: torch.Tensor) -> torch.Tensor:
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
    """About ``per_topic`` questions on each topic, asked for ``QUESTIONS_PER_LIST`` at a time
    (as many lists as that takes, each for one of ``ASKERS``)."""
    lists = min(len(ASKERS), -(-per_topic // QUESTIONS_PER_LIST))
    n = -(-per_topic // lists)
    prompts = [
        engine.encode(QUESTION_PROMPT.format(n=n, who=who, topic=t), chat=True)
        for t in topics
        for who in ASKERS[:lists]
    ]
    questions: list[str] = []
    for answer in answered(engine, ranks, prompts, 24 * n + 32, "questions"):
        add_questions(questions, engine.tokenizer.decode(answer, skip_special_tokens=True))
    return questions


def answered(engine, ranks: Ranks, prompts, max_new, desc, done=None, save=None, deadline=None,
             budget=None, states=None, sampling=None) -> list[list[int]]:  # fmt: skip
    """``generate_answers`` over several processes: each answers every ``world``-th prompt, and
    every process gets the answers of the prompts all answered, in order (saved once at the end:
    a stopped run of several processes resumes from where the last stage it finished left).
    ``states``: the hidden states of the answers this process wrote."""
    if ranks.world == 1:
        return generate_answers(
            engine, prompts, max_new, desc, done, save, deadline, budget, states, sampling
        )
    share = ranks.share(prompts)
    done = list(done or [])
    mine = [done[i] for i, _ in share if i < len(done)]
    prompts = [p for _, p in share]
    got = generate_answers(
        engine, prompts, max_new, desc, mine, None, deadline, budget, states, sampling
    )
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


def new_questions(engine: Engine, questions: int, max_new: int, ranks: Ranks) -> dict:
    """``answers_for``'s data with up to ``questions`` new questions the model wrote (shuffled)
    and no answers yet."""
    per_topic = max(2, -(-questions // len(TOPICS)))  # a model may write fewer than asked
    topics = TOPICS[: -(-questions // per_topic) + 4]
    asked = write_questions(engine, per_topic, topics, ranks)
    random.Random(0).shuffle(asked)
    asked = asked[:questions]
    prompts = [engine.encode(q, chat=True) for q in asked]
    return {
        "questions": asked, "prompts": prompts, "answers": [], "max_new": max_new,
        "asked_for": questions,
    }  # fmt: skip


def answers_for(
    engine: Engine,
    work: Path,
    questions: int,
    max_new: int,
    budget: Budget | None = None,
    ranks: Ranks = Ranks(),
    states: dict | None = None,
    sampling: Sampling | None = None,
) -> dict:
    """The questions and the model's answers, then tasks over a quarter of those answers and the
    model's answers to them (``TASKS``), from ``work`` as far as an earlier run saved them. Saved
    as they come; with a ``budget``, answers stop at 45% of it and tasks at 60%, so that the fit
    gets the rest. ``states`` gets the hidden states of the answers written now
    (``generate_answers``); ``sampling``: how the answers are drawn (greedy by default; saved
    answers drawn otherwise are written again)."""
    budget = budget or Budget(None)
    sampling = sampling or Sampling()
    path = work / "answers.json"
    data = json.loads(path.read_text()) if ranks.main and path.is_file() else {}
    data = ranks.broadcast(data)  # the main process's folder holds the answers
    if (
        data.get("max_new") != max_new
        or data.get("asked_for", len(data.get("answers", ()))) < questions
    ):
        data = new_questions(engine, questions, max_new, ranks)
        if ranks.main:
            atomic_write_text(path, json.dumps(data))
    if data.get("temperature", 0.0) != sampling.temperature:
        for key in ("answers", "task_prompts", "task_answers"):
            data.pop(key, None)
        data["temperature"] = sampling.temperature

    def saver(key: str) -> Callable[[list[list[int]]], None]:
        def save(answers: list[list[int]]) -> None:
            data[key] = answers
            atomic_write_text(path, json.dumps(data))

        return save

    data["answers"] = answered(
        engine, ranks, data["prompts"], max_new, "answers", data.get("answers"),
        saver("answers"), budget.until(0.45), budget, states, sampling,
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
        saver("task_answers"), budget.until(0.27), budget, states, sampling,
    )  # fmt: skip
    return data


def answered_pairs(data: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) of every answer ``answers_for`` gathered (fewer than asked past a
    budget)."""
    answered = len(data["answers"]), len(data["task_answers"])
    prompts = data["prompts"][: answered[0]] + data["task_prompts"][: answered[1]]
    return list(zip(prompts, data["answers"] + data["task_answers"]))


def answer_writers(data: dict, world: int) -> list[int]:
    """The process of ``world`` that wrote each of ``answered_pairs(data)``'s answers (``answered``
    gives process r every world-th prompt from r): it holds their hidden states."""
    return [i % world for i in range(len(data["answers"]))] + [
        i % world for i in range(len(data["task_answers"]))
    ]
