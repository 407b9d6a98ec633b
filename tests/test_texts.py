"""Draft heads trained on texts the model did not write (``train-heads --texts``): over a text the
heads learn the model's own tokens, never the text's, and every shape of line reads as meant."""

from __future__ import annotations

import json
import lzma
import random

import pytest
import torch

from selfspec.errors import SelfSpecError
from selfspec.prompts import SPEC_BENCH_PATH
from selfspec.training.heads import (
    chain_tokens,
    held_out_from,
    held_out_split,
    model_chain_tokens,
    shuffled_share,
)
from selfspec.training.history import PROMPT_TAIL
from selfspec.training.texts import BUNDLED_TEXTS, text_pairs, windows


def test_over_a_text_the_heads_guess_the_models_tokens_while_the_text_follows_them():
    # prompt 10 11, then the text 20..24; predicted[r]: the model's token after ids[:r + 1]
    ids = [10, 11, 20, 21, 22, 23, 24]
    rows = torch.arange(1, len(ids) - 2)  # row i made token i + 1: 20, 21, 22, 23
    predicted = torch.tensor([-1, -1, 21, 99, 23, 24, 7])  # it would not say 22 after 21
    tokens = model_chain_tokens(ids, rows, 2, predicted)
    assert tokens[0].tolist() == [20, 21, 22, 23]  # fed the text's tokens
    assert tokens[1].tolist() == [21, 99, 23, 24]  # the first head: the model's, everywhere
    # the second head only where the text said what the model would before it (and has a token)
    assert tokens[2].tolist() == [99, -1, 24, -1]


def test_over_the_models_own_greedy_text_the_tokens_are_the_texts():
    ids = [10, 11, 20, 21, 22, 23, 24]
    rows = torch.arange(1, len(ids) - 2)
    predicted = torch.tensor([-1, -1, 21, 22, 23, 24, 2])
    assert torch.equal(model_chain_tokens(ids, rows, 3, predicted), chain_tokens(ids, rows, 3))


def test_every_shape_of_line_reads_as_a_prompt_and_its_answer(smollm2, tmp_path):
    engine = smollm2
    lines = [
        {"prompt": "Name a fruit.", "answer": "An apple, say."},
        {"messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue is one."},
        ]},
        {"text": "Once upon a time there was a cat."},
    ]  # fmt: skip
    path = tmp_path / "texts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + json.dumps(lines[2]))
    pairs, lines_of = text_pairs(engine, path, window=64)
    (p1, a1), (p2, a2), (p3, a3) = pairs
    assert lines_of == [1, 2, 4]  # the third text is on line 4, after an empty line
    eos = engine.tokenizer.eos_token_id
    assert p1 == engine.encode("Name a fruit.", chat=True)
    assert engine.tokenizer.decode(a1[:-1]) == "An apple, say." and a1[-1] == eos
    assert p2 == engine.encode_messages(lines[1]["messages"][:3])
    assert engine.tokenizer.decode(a2[:-1]) == "Blue is one."
    assert p3 + a3 == engine.tokenizer("Once upon a time there was a cat.")["input_ids"]
    assert len(p3) == 1
    cut, cut_lines = text_pairs(engine, path, window=3)  # each answer in windows of 3 and 1
    for (prompt, answer), line in zip(pairs, lines_of):
        mine = [pair for pair, at in zip(cut, cut_lines) if at == line]
        assert all(len(w) <= 4 for _, w in mine) and len(mine) == (len(answer) - 2) // 3 + 1
        assert mine[0][1][:1] + [t for _, w in mine for t in w[1:]] == answer  # each token once
        assert [p for p, _ in mine] == [prompt + answer[: 3 * i] for i in range(len(mine))]


def test_a_chat_line_for_a_model_without_a_chat_template_is_a_one_line_error(tiny_llama, tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text(json.dumps({"prompt": "t1 t2", "answer": "t3 t4 t5"}) + "\n")
    with pytest.raises(SelfSpecError, match=r"line 1: .*chat template cannot read it") as caught:
        text_pairs(tiny_llama, path, window=8)
    assert "\n" not in str(caught.value) and '{"text": ...}' in str(caught.value)
    path.write_text("\n".join(json.dumps({"text": f"t{i} t5 t6 t7"}) for i in range(3)))
    assert len(text_pairs(tiny_llama, path, window=8)[0]) == 3  # plain text needs no template


def test_a_long_text_is_read_in_windows_each_after_the_text_before_it():
    prompt, answer = [1, 2, 3], list(range(10, 10 + PROMPT_TAIL + 7))
    got = list(windows(prompt, answer, 256))
    assert [len(a) for _, a in got] == [257, 257, 7]  # a window's last token opens the next
    assert [a[0] for _, a in got] == [answer[0], answer[256], answer[512]]
    assert got[0][1] + got[1][1][1:] + got[2][1][1:] == answer  # every token, each row once
    for start, (p, _) in zip((0, 256, 512), got):
        assert p == (prompt + answer[:start])[-PROMPT_TAIL:]
    assert len(got[2][0]) == PROMPT_TAIL and got[2][0][-1] == answer[511]
    assert [a for _, a in windows(prompt, [7, 8, 9], 2)] == [[7, 8, 9]]
    assert [a for _, a in windows(prompt, [7, 8, 9, 10], 2)] == [[7, 8, 9], [9, 10]]
    assert list(windows(prompt, [7], 2)) == [] and list(windows([], [7, 8, 9], 2)) == []


def test_a_texts_windows_are_shuffled_together_and_held_out_together():
    groups = [0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4, 5, 6, 6, 7, 8, 9, 9, 9, 10]
    pairs = [f"{g}.{i}" for i, g in enumerate(groups)]
    shuffled, share, moved = shuffled_share(pairs, [0] * len(pairs), 0, groups)
    assert sorted(shuffled) == sorted(pairs) and [p for _, p in share] == shuffled
    assert moved == [int(p.split(".")[0]) for p in shuffled]  # the groups follow their pairs
    keys = sorted(set(groups))
    random.Random(0).shuffle(keys)  # the groups' order is the seeded shuffle's, every process alike
    assert moved == [g for g in keys for _ in range(groups.count(g))]
    assert [p for p in shuffled if p.startswith("4.")] == ["4.7", "4.8", "4.9", "4.10"]  # in order
    split = held_out_split(moved)
    assert split >= held_out_from(len(moved)) or split == max(
        i for i in range(1, len(moved)) if moved[i] != moved[i - 1]
    )
    assert not set(moved[:split]) & set(moved[split:])  # no group on both sides
    plain, _, own = shuffled_share(pairs, [0] * len(pairs), 0)  # no groups: pair by pair
    order = list(range(len(pairs)))
    random.Random(0).shuffle(order)  # as before windows: older runs shuffle the same
    assert plain == [pairs[k] for k in order] and own == order
    assert held_out_split(list(range(20))) == held_out_from(20)
    assert held_out_split([0] * 17 + [1] * 3) == 17 and held_out_split([0] * 5 + [1] * 15) == 5


def test_for_a_model_without_a_chat_template_chats_can_read_as_plain_text(tiny_llama, tmp_path):
    chat = {"prompt": "t1 t2", "answer": "t3 t4 t5"}
    talk = {"messages": [
        {"role": "user", "content": "t1"}, {"role": "assistant", "content": "t2 t3"},
    ]}  # fmt: skip
    plain = [{"text": "t1 t2\n\nt3 t4 t5"}, {"text": "t1\n\nt2 t3"}]
    path, expected = tmp_path / "chats.jsonl", tmp_path / "plain.jsonl"
    path.write_text(json.dumps(chat) + "\n" + json.dumps(talk) + "\n")
    expected.write_text("\n".join(json.dumps(x) for x in plain) + "\n")
    read = text_pairs(tiny_llama, path, window=8, chats_as_text=True)
    assert read == text_pairs(tiny_llama, expected, window=8)
    assert len(read[0]) == 2


def test_a_texts_file_compressed_with_xz_reads_as_the_file_itself(tiny_llama, tmp_path):
    lines = [{"text": "t1 t2 t3 t4"}, {"text": "t5 t6 t7"}]
    body = "\n".join(json.dumps(x) for x in lines) + "\n"
    path = tmp_path / "texts.jsonl"
    path.write_text(body)
    packed = tmp_path / "texts.jsonl.xz"
    packed.write_bytes(lzma.compress(body.encode()))
    assert text_pairs(tiny_llama, packed, window=2) == text_pairs(tiny_llama, path, window=2)
    packed.write_bytes(lzma.compress(body.encode())[:-8])  # cut short
    with pytest.raises(SelfSpecError, match=r"is not a whole \.xz file"):
        text_pairs(tiny_llama, packed, window=2)


def test_the_bundled_texts_are_each_a_prompt_and_answer_or_a_text():
    assert BUNDLED_TEXTS.is_file()  # package data: shipped with the wheel
    with lzma.open(BUNDLED_TEXTS, "rt", encoding="utf-8") as lines:
        items = [json.loads(line) for line in lines]
    chats = [x for x in items if set(x) == {"prompt", "answer"}]
    plain = [x for x in items if set(x) == {"text"}]
    assert len(chats) + len(plain) == len(items) == 9216
    assert all(x["prompt"].strip() and x["answer"].strip() for x in chats)
    assert all(x["text"].strip() for x in plain)
    lines = SPEC_BENCH_PATH.read_text(encoding="utf-8").splitlines()
    spec_bench = {json.loads(line)["turns"][0] for line in lines}
    assert not spec_bench & {x["prompt"] for x in chats}  # never what bench measures


def test_texts_without_a_file_means_the_bundled_ones():
    from selfspec.cli import build_parser

    args = build_parser().parse_args(["train-heads", "--texts", "--budget", "5"])
    assert args.texts == str(BUNDLED_TEXTS) and args.budget == 5
