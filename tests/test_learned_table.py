"""Recycled drafts kept between runs (``RecycledTable.save``/``load``, ``LearnedTable``): a table
comes back as it was saved, pairs in the order they were written; drafting from a kept table
keeps greedy output identical to plain decoding; a file that is not such a table, or one of
another vocabulary, is a one-line error, and ``--learn`` moves it aside instead of failing."""

from __future__ import annotations

import pytest
from test_recycled import recycled_drafter, wrong_table

from selfspec.drafters.recycled import RecycledTable
from selfspec.errors import SelfSpecError
from selfspec.training.history import LearnedTable

VOCAB = 64


def filled_table() -> RecycledTable:
    table = RecycledTable(width=3)
    table.record(None, 4, following=[5, 6, 7], probability=[0.5, 0.25, 0.125])
    table.record(4, 5, following=[9, -1, -1], probability=[0.75, 0.0, 0.0])  # one known
    table.record(3, 4, following=1, probability=0.5)
    table.record(None, 63, following=0, probability=1.0)
    return table


def past_the_vocabulary() -> RecycledTable:
    table = filled_table()
    table.record(4, 5, following=VOCAB + 3, probability=0.5)
    return table


def test_a_saved_table_loads_as_it_was_pairs_oldest_first(tmp_path):
    table = filled_table()
    table.save(tmp_path / "t.safetensors", VOCAB)
    again = RecycledTable.load(tmp_path / "t.safetensors", VOCAB)
    assert again.by_token == table.by_token
    assert list(again.by_pair.items()) == list(table.by_pair.items())
    assert again.chain(3, 4, limit=4) == table.chain(3, 4, limit=4)
    assert again.tree(None, 4, nodes=4, depth=2) == table.tree(None, 4, nodes=4, depth=2)
    kept = RecycledTable.load(tmp_path / "t.safetensors", VOCAB, max_pairs=1)
    assert list(kept.by_pair) == [(3, 4)]  # the bound holds: the newest pair stays
    RecycledTable().save(tmp_path / "empty.safetensors", VOCAB)
    assert len(RecycledTable.load(tmp_path / "empty.safetensors", VOCAB)) == 0


def rewritten(path, name, change) -> None:
    """Rewrite one tensor of the saved table at ``path`` with ``change``, keeping the rest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}
    tensors[name] = change(tensors[name])
    save_file(tensors, str(path), metadata)


NAMES = ("next", "probability")


def first_unknown(nexts):
    nexts[0, 0] = -1  # an entry that knows no next token
    return nexts


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(b"not a table at all"), "cannot read"),
        (lambda p: p.write_bytes(p.read_bytes()[:-9]), "cannot read"),
        (lambda p: filled_table().save(p, VOCAB + 1), "token ids, not 64"),
        (lambda p: past_the_vocabulary().save(p, VOCAB), "damaged"),
        (lambda p: rewritten(p, "tokens", lambda t: t.view(-1, 1)), "damaged"),
        (lambda p: rewritten(p, "token_next", first_unknown), "damaged"),
        (lambda p: rewritten(p, "pair_probability", lambda t: t * float("nan")), "damaged"),
        (lambda p: [rewritten(p, f"token_{n}", lambda t: t[:, :0]) for n in NAMES], "damaged"),
    ],
    ids=[
        "garbage",
        "truncated",
        "another vocabulary",
        "ids past the vocabulary",
        "keys of two dimensions",
        "an entry with no next token",
        "probabilities not numbers",
        "entries of no width",
    ],
)
def test_a_file_that_is_not_a_table_for_this_model_is_a_one_line_error(tmp_path, damage, message):
    path = tmp_path / "t.safetensors"
    filled_table().save(path, VOCAB)
    damage(path)
    with pytest.raises(SelfSpecError, match=message) as caught:
        RecycledTable.load(path, VOCAB)
    assert "\n" not in str(caught.value)


def test_a_kept_table_drafts_from_the_start_and_output_stays_plain_decoding_s(tiny_llama, tmp_path):
    prompt = [5, 17, 33, 2, 9, 41, 12, 5, 17, 60, 3]
    plain = tiny_llama.generate(prompt, None, max_new_tokens=40)
    kept = LearnedTable(tmp_path / "learned.safetensors", VOCAB)
    first = recycled_drafter(tiny_llama, wrong_table())
    assert kept.resume(first) == 0  # nothing kept yet
    assert not kept.save(first) and kept.due_in(first, 60.0) is None  # nothing learnt yet
    assert tiny_llama.generate(prompt, first, max_new_tokens=40).token_ids == plain.token_ids
    assert 30.0 < kept.due_in(first, 60.0) <= 60.0 and kept.due_in(first, 0.0) == 0.0
    assert not kept.save(first, at_most_every=60.0)  # its minute is not up
    assert kept.save(first) and not kept.save(first)  # written once: nothing new the second time
    assert kept.due_in(first, 0.0) is None
    second = recycled_drafter(tiny_llama)  # an empty table of its own, until resumed
    assert kept.resume(second) == len(first.recycled.table)
    out = tiny_llama.generate(prompt, second, max_new_tokens=40)
    assert out.token_ids == plain.token_ids
    _, drafted, accepted = out.stats.sources["recycled"]
    assert accepted > 0  # the first generation's predictions, read back, came true
    assert kept.save(second)


def test_learn_moves_an_unreadable_table_aside_and_starts_again(tiny_llama, tmp_path, capsys):
    path = tmp_path / "learned.safetensors"
    path.write_bytes(b"\x00" * 40)
    drafter = recycled_drafter(tiny_llama)
    assert LearnedTable(path, VOCAB).resume(drafter) == 0
    assert not path.exists() and (tmp_path / "learned.safetensors.unreadable").exists()
    assert "moved it to learned.safetensors.unreadable" in capsys.readouterr().err


def test_the_bench_reads_a_kept_table_and_never_moves_it(tiny_llama, tmp_path):
    path = tmp_path / "learned.safetensors"
    path.write_bytes(b"\x00" * 40)
    with pytest.raises(SelfSpecError, match="cannot read"):
        LearnedTable(path, VOCAB).resume(recycled_drafter(tiny_llama), read_only=True)
    assert path.exists()
