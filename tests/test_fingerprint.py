"""A GGUF file of a bundled model's weights, quantized another way, borrows that model's draft
heads: the fingerprint (its embedding's shape and a few rows) tells such a file from another
model, on real files written by gguf's writer and on the bundled files themselves."""

from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.numpy import save
from tiny_gguf import write_tiny

from selfspec.drafters.heads import DraftHeads
from selfspec.loading import fingerprint
from selfspec.loading.check import check_model_file
from selfspec.loading.sources import ensure_bundled, gguf_source

HEADS = Path(fingerprint.__file__).parents[1] / "plans"


def test_the_same_weights_quantized_another_way_match_and_other_weights_do_not(tmp_path):
    source = write_tiny(tmp_path / "source.gguf", "Q8_0", None, seed=3)
    known = [("tiny", tmp_path / "tiny.safetensors")]
    fingerprint.write_fingerprint(source, known[0][1])
    for type_name in ("Q8_0", "Q5_0", "Q4_0"):  # gguf quantizes the same values each way
        again = write_tiny(tmp_path / f"{type_name}.gguf", type_name, None, seed=3)
        assert fingerprint.same_weights_as(again, known) == "tiny", type_name
    other = write_tiny(tmp_path / "other.gguf", "Q8_0", None, seed=4)
    assert fingerprint.same_weights_as(other, known) is None
    with safe_open(known[0][1], "numpy") as fh:  # the same rows, said of a wider embedding
        rows, meta = fh.get_tensor("rows"), fh.metadata()
    wider = [("wider", tmp_path / "wider.safetensors")]
    wider[0][1].write_bytes(save({"rows": rows}, metadata={**meta, "hidden": "4096"}))
    assert fingerprint.same_weights_as(source, wider) is None  # another shape is never compared


def test_borrowed_heads_say_whose_they_are_and_do_not_keep_it(tmp_path):
    heads = DraftHeads.load(HEADS / "qwen2.5-coder-0.5b" / "heads.safetensors")
    assert "this file holds its weights" not in heads.describe()
    heads.borrowed_from = "qwen2.5-coder-0.5b"
    assert "qwen2.5-coder-0.5b's (this file holds its weights)" in heads.to("cpu").describe()
    heads.save(tmp_path / "h.safetensors")
    assert DraftHeads.load(tmp_path / "h.safetensors").borrowed_from is None


def test_every_lender_ships_a_fingerprint_of_its_heads_width():
    lenders = sorted(p.parent.name for p in HEADS.glob("*/heads.safetensors"))
    shipped = dict(fingerprint.shipped_fingerprints())
    assert sorted(shipped) == lenders
    for name in lenders:
        with safe_open(shipped[name], "numpy") as fh:
            hidden = int(fh.metadata()["hidden"])
            assert fh.get_tensor("rows").shape == (fingerprint.ROWS, hidden)
        assert DraftHeads.load(HEADS / name / "heads.safetensors").hidden_size == hidden


@pytest.mark.slow
def test_a_bundled_file_matches_its_own_fingerprint_only():
    path = gguf_source("qwen2.5-coder-0.5b", ensure_bundled("qwen2.5-coder-0.5b"))
    assert fingerprint.same_weights_as(path) == "qwen2.5-coder-0.5b"
    assert "draft heads: qwen2.5-coder-0.5b's" in "\n".join(check_model_file(path).lines())
    smollm2 = gguf_source("smollm2-135m", ensure_bundled("smollm2-135m"))
    assert fingerprint.same_weights_as(smollm2) is None
    assert check_model_file(smollm2).heads_of is None
