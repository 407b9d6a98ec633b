"""Texts draft heads can learn from besides the model's own answers (``selfspec train-heads
--texts FILE``): conversations, prompts with answers, or plain text, one JSON object a line.

    {"prompt": "How do I ...?", "answer": "You can ..."}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"text": "Any text at all ..."}

Over a text someone else wrote, the heads learn what this model would say at each place (its
greedy token after the text so far: ``selfspec.training.heads.model_chain_tokens``), never the
text's own next token, so any text teaches them this model. It costs one pass over the text
(a long answer or document: one pass per window, each after the text before it, its last
``PROMPT_TAIL`` ids, so every part of it teaches), less than the model's writing as many tokens
itself, and the texts can be what users send: their chats, their documents, another model's
answers.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.errors import SelfSpecError
from selfspec.training.history import PROMPT_TAIL  # a prompt's last ids: as use is recorded

if TYPE_CHECKING:
    from selfspec.engine import Engine

# Texts that ship with selfspec (`train-heads --texts` without a file): answers and continuations a
# 1.5B model wrote to questions on many topics; data/TEXTS.md says what they are.
BUNDLED_TEXTS = Path(__file__).parents[1] / "data" / "texts.jsonl.xz"

SHAPES = (
    'each line should be one JSON object: {"prompt": ..., "answer": ...}, {"messages": [...]} '
    'ending with the assistant\'s message, or {"text": ...}'
)


def text_pairs(
    engine: Engine, path: Path, window: int, chats_as_text: bool = False
) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """(prompt ids, answer ids) of every text in the JSONL file ``path``, and the line each came
    from: an answer longer than ``window`` tokens gives one pair per window (``windows``), every
    prompt cut to its last ``PROMPT_TAIL`` ids; prompts go through the model's chat template
    (plain text: its first token is the prompt). ``chats_as_text``: for a model without a chat
    template, a prompt and its answer read as one plain text. A file ending in .xz is read
    through xz."""
    if not path.is_file():
        if path.resolve() == BUNDLED_TEXTS.resolve():
            raise SelfSpecError(f"this install of selfspec lacks its texts ({path}): reinstall it")
        raise SelfSpecError(f"no texts file at {path}: give a JSONL file ({SHAPES})")
    plain = chats_as_text and not getattr(engine.tokenizer, "chat_template", None)
    pairs, lines_of = [], []
    for number, line in _numbered_lines(path):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise SelfSpecError(f"{path} line {number} is not JSON: {SHAPES}") from None
        try:
            pair = _pair(engine, _as_text(item) if plain else item)
        except Exception as e:  # the chat template's own errors (jinja's, transformers')
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise SelfSpecError(
                f"{path} line {number}: {engine.loaded.name}'s chat template cannot read it "
                f'({first}); give it as {{"text": ...}}'
            ) from None
        if pair is None:
            raise SelfSpecError(f"{path} line {number} has none of the known shapes: {SHAPES}")
        for prompt, answer in windows(*pair, window):
            pairs.append((prompt, answer))
            lines_of.append(number)
    if len(set(lines_of)) < 2:  # one to train on, one to hold out
        raise SelfSpecError(
            f"{len(set(lines_of))} usable text(s) in {path}: train-heads needs at least two with "
            "an answer of two or more tokens"
        )
    return pairs, lines_of


def _numbered_lines(path: Path):
    """(number, line) of the file's lines, through xz where its name ends in .xz."""
    opener = lzma.open if path.suffix == ".xz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as lines:
            yield from enumerate(lines, 1)
    except (lzma.LZMAError, EOFError) as e:
        raise SelfSpecError(f"{path} is not a whole .xz file ({e}): compress it again") from None


def windows(prompt: list[int], answer: list[int], size: int):
    """``answer`` in windows of ``size`` tokens and the one after them, each with the prompt and
    the answer before it as its prompt (their last ``PROMPT_TAIL`` ids). A window's last token
    opens the next one: a row's targets are the tokens after it, so the row at that token is
    trained on in the next window, and every row of the answer once. An answer of fewer than two
    tokens has none (a head guesses the token after next)."""
    if not prompt:
        return
    for start in range(0, len(answer) - 1, size):
        yield (prompt + answer[:start])[-PROMPT_TAIL:], answer[start : start + size + 1]


def _pair(engine: Engine, item) -> tuple[list[int], list[int]] | None:
    if not isinstance(item, dict):
        return None
    prompt, answer, messages = item.get("prompt"), item.get("answer"), item.get("messages")
    if isinstance(prompt, str) and isinstance(answer, str):
        return _chat(engine, [{"role": "user", "content": prompt}]), _tokens(engine, answer)
    if _is_conversation(messages):
        return _chat(engine, messages[:-1]), _tokens(engine, messages[-1]["content"])
    text = item.get("text")
    if isinstance(text, str):
        ids = engine.tokenizer(text, add_special_tokens=True)["input_ids"]
        return ids[:1], ids[1:]
    return None


def _as_text(item):
    """A prompt and its answer, or a conversation, as one plain text (turns a blank line apart)."""
    if not isinstance(item, dict):
        return item
    if isinstance(item.get("prompt"), str) and isinstance(item.get("answer"), str):
        return {"text": item["prompt"] + "\n\n" + item["answer"]}
    if _is_conversation(item.get("messages")):
        return {"text": "\n\n".join(m["content"] for m in item["messages"])}
    return item


def _is_conversation(messages) -> bool:
    return (
        isinstance(messages, list)
        and len(messages) >= 2
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
        and messages[-1]["role"] == "assistant"
    )


def _chat(engine: Engine, messages: list[dict]) -> list[int]:
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ValueError("it has none")
    return engine.encode_messages(messages)


def _tokens(engine: Engine, text: str) -> list[int]:
    """An answer's tokens as the model writes them: its text, then the end of its turn (the
    tokenizer's end token; where a model ends its turns with another, the heads' chains over the
    text stop there, as the text leaves the model's path)."""
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = engine.tokenizer.eos_token_id
    return ids + ([eos] if eos is not None and ids else [])
