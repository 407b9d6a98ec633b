"""Training draft heads (``drafters.heads``) on the target's own answers.

Self-distillation, with no data from outside the model: the model writes questions on a list of
topics, answers them (greedy, in its speed mode), and the chain of heads learns, from the final
hidden state at one answer token and the tokens after it, the answer tokens 2, 3, ... places later.
Spec-Bench's prompts are never used, so bench measures the heads on text they have not seen.

    data  = answers_for(engine, work, questions, max_new)   # saved atomically: a rerun resumes
    rows  = features(engine, data["prompts"], data["answers"], heads)
    heads = fit(engine, rows, heads, epochs)   # held-out answers: heads.info["heldout_top1"]

The training arithmetic itself is ``selfspec.training.fit``'s, which the GPU script shares.
"""

from __future__ import annotations

import json
import random
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.drafters.heads import DraftHeads
from selfspec.errors import SelfSpecError
from selfspec.fileio import atomic_write_text
from selfspec.loading.fetch import progress_bar
from selfspec.training.fit import fit_rows

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
BATCH = 8  # sequences per pass while answering
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


def generate_greedy(engine: Engine, prompts: list[list[int]], max_new: int, desc: str):
    """Greedy answers, ``BATCH`` prompts per pass where the runner batches, else one by one."""
    runner, eos = engine.runner, set(engine.eos_ids())
    answers: list[list[int]] = []
    bar = progress_bar(len(prompts), desc, unit="answer")
    for first in range(0, len(prompts), BATCH if runner.can_batch else 1):
        group = prompts[first : first + (BATCH if runner.can_batch else 1)]
        if runner.can_batch:
            answers += _answer_group(engine, group, max_new, eos)
        else:
            answers.append(engine.generate(group[0], None, max_new_tokens=max_new).token_ids)
        bar.update(len(group))
    bar.close()
    return answers


def _answer_group(engine: Engine, prompts: list[list[int]], max_new: int, eos: set[int]):
    runner = engine.runner
    caches, pending, answers = [], [], []
    for prompt in prompts:
        cache = runner.new_cache(len(prompt) + max_new + 1)
        with runner.using(cache):
            logits, _ = runner.forward(torch.tensor(prompt), 0, last_logits_only=True)
        caches.append(cache)
        pending.append(int(logits[-1].argmax()))
        answers.append([pending[-1]])
    for _ in range(max_new - 1):
        live = [i for i, a in enumerate(answers) if a[-1] not in eos]
        if not live:
            break
        positions = [len(prompts[i]) + len(answers[i]) - 1 for i in live]
        logits = runner.forward_many(
            [caches[i] for i in live], [answers[i][-1] for i in live], positions
        )
        for row, i in enumerate(live):
            answers[i].append(int(logits[row].argmax()))
    return answers


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


def write_questions(engine: Engine, per_topic: int, topics=TOPICS) -> list[str]:
    prompts = [
        engine.encode(QUESTION_PROMPT.format(n=per_topic, topic=t), chat=True) for t in topics
    ]
    questions: list[str] = []
    for answer in generate_greedy(engine, prompts, 24 * per_topic + 32, "questions"):
        add_questions(questions, engine.tokenizer.decode(answer, skip_special_tokens=True))
    return questions


def add_questions(questions: list[str], text: str) -> None:
    """Adds the questions of a model-written list (one per line) not yet in ``questions``."""
    for line in text.splitlines():
        line = line.strip().lstrip("-*0123456789.) ").strip()
        if len(line) > 15 and line not in questions:
            questions.append(line)


def answers_for(engine: Engine, work: Path, questions: int, max_new: int) -> dict:
    """The questions and the model's answers, then tasks over a quarter of those answers and the
    model's answers to them (``TASKS``), from ``work`` as far as an earlier run saved them."""
    path = work / "answers.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    if data.get("max_new") != max_new or len(data.get("answers", ())) < questions:
        per_topic = max(2, -(-questions // len(TOPICS)))  # a model may write fewer than asked
        asked = write_questions(engine, per_topic, TOPICS[: -(-questions // per_topic) + 4])
        random.Random(0).shuffle(asked)
        asked = asked[:questions]
        prompts = [engine.encode(q, chat=True) for q in asked]
        data = {
            "questions": asked,
            "prompts": prompts,
            "answers": generate_greedy(engine, prompts, max_new, "answers"),
            "max_new": max_new,
        }
        atomic_write_text(path, json.dumps(data))
    if "task_answers" not in data:
        texts = task_texts(
            data["questions"],
            data["answers"],
            partial(engine.tokenizer.decode, skip_special_tokens=True),
            random.Random(0),
            count=max(1, len(data["answers"]) // 4),
            min_tokens=32,
        )
        tasks = [engine.encode(text, chat=True) for text in texts]
        data["task_prompts"] = tasks
        data["task_answers"] = generate_greedy(engine, tasks, max_new, "tasks")
        atomic_write_text(path, json.dumps(data))
    return data


@torch.inference_mode()
def features(engine: Engine, prompts: list[list[int]], answers: list[list[int]], heads: int):
    """Per answer: final hidden states (normed) of its rows [n, hidden] and ``chain_tokens``."""
    runner = engine.runner
    out = []
    bar = progress_bar(len(prompts), "hidden states", unit="answer")
    for prompt, answer in zip(prompts, answers):
        ids = prompt + answer
        runner.reset(len(ids) + 1)
        _, hidden = runner.forward(
            torch.tensor(ids), 0, capture_at=runner.num_sublayers, last_logits_only=True
        )
        rows = torch.arange(len(prompt) - 1, len(ids) - 2)
        normed = runner.adapter.final_norm(hidden[0, rows]).float()
        out.append((normed.half().cpu(), chain_tokens(ids, rows, heads)))
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


def output_rows(engine: Engine, count: int) -> torch.Tensor:
    """The output head's first ``count`` rows as float32 [count, hidden] (the head over the unit
    vectors, in the engine's own arithmetic)."""
    runner = engine.runner
    head = runner.model.get_output_embeddings()
    from selfspec.kernels import linear_prefix

    eye = torch.eye(head.in_features, device=runner.device, dtype=runner.dtype)
    with torch.inference_mode():
        rows = linear_prefix(head, eye, count).float().T.cpu()
    return rows.clone()  # outside inference mode: training saves it for the backward pass


def fit(
    engine: Engine,
    answers: list[tuple[torch.Tensor, torch.Tensor]],
    heads: int,
    epochs: int = 3,
    vocab_prefix: int = 32768,
    heldout: float = 0.1,
    seed: int = 0,
    layers: int = 2,
    soft: float = 0.5,
) -> DraftHeads:
    """Train a chain of ``heads`` heads of ``layers`` layers (cross-entropy over the first
    ``vocab_prefix`` ids, ``soft`` of it against the model's own distribution; guesses past them
    are left out) on all but the last ``heldout`` share of answers, measured on those."""
    if len(answers) < 2:
        raise SelfSpecError(
            f"only {len(answers)} answer(s) to train draft heads on: ask for more --questions "
            "(the model wrote too few usable questions)"
        )
    torch.manual_seed(seed)
    vocab_prefix = min(vocab_prefix, engine.runner.head_rows)
    split = max(1, int(len(answers) * (1 - heldout)))
    train, test = answers[:split], answers[split:] or answers[-1:]
    owner = torch.cat([torch.full((len(h),), k) for k, (h, _) in enumerate(train)])
    trained = fit_rows(
        torch.cat([h for h, _ in train]),
        torch.cat([y for _, y in train], dim=1)[: heads + 1],
        torch.cat([h for h, _ in test]),
        torch.cat([y for _, y in test], dim=1)[: heads + 1],
        output_rows(engine, vocab_prefix),
        embedding_table(engine),
        epochs,
        layers=layers,
        soft=soft,
        owner=owner,
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
) -> DraftHeads:
    started = time.time()
    data = answers_for(engine, work, questions, max_new)
    prompts = data["prompts"] + data["task_prompts"]
    pairs = list(zip(prompts, data["answers"] + data["task_answers"]))
    random.Random(0).shuffle(pairs)  # tasks among the held-out answers too
    rows = features(engine, [p for p, _ in pairs], [a for _, a in pairs], heads)
    trained = fit(engine, rows, heads, epochs, layers=layers, soft=soft)
    trained.info["seconds"] = round(time.time() - started)
    trained.save(out)
    return trained


# -- `selfspec train-heads` -----------------------------------------------------------------------
def add_arguments(parser) -> None:
    from selfspec.cliargs import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument(
        "--questions", type=int, default=400, help="questions the model writes and answers (400)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=192, help="tokens per answer at most (192)"
    )
    parser.add_argument("--heads", type=int, default=2, help="heads to train, token 2, 3, ... (2)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the answers (3)")
    parser.add_argument("--layers", type=int, choices=(1, 2), default=2, help="layers per head (2)")
    parser.add_argument(
        "--soft",
        type=float,
        default=0.5,
        help="share of the loss against the model's own distribution of each token, the rest "
        "against the token itself (0.5)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="heads file to write (default: the user's heads for the model, which "
        "`selfspec generate`, `bench` and `serve` then use)",
    )


def run(args) -> int:
    from selfspec.cliargs import check_at_least, load_engine
    from selfspec.paths import user_heads_path

    for flag, value in (
        ("--questions", args.questions),
        ("--max-new-tokens", args.max_new_tokens),
        ("--heads", args.heads),
        ("--epochs", args.epochs),
    ):
        check_at_least(flag, value, 1)
    if not 0 <= args.soft <= 1:
        raise SelfSpecError(f"--soft must be between 0 and 1, not {args.soft}")
    engine = load_engine(args)
    out = Path(args.out) if args.out else user_heads_path(engine.loaded.name)
    work = out.parent / f".{out.name}.work"  # the answers, kept so a stopped run resumes there
    heads = train_heads(
        engine,
        out,
        work,
        args.questions,
        args.max_new_tokens,
        args.heads,
        args.epochs,
        args.layers,
        args.soft,
    )
    info = heads.info
    print(
        f"wrote {out}: {len(heads)} head(s) trained on {info['rows']} answer tokens of "
        f"{info['answers']} answers in {info['seconds']} s; held-out first guesses right: "
        + ", ".join(f"{t:.1%}" for t in info["heldout_top1_by_head"])
    )
    return 0
