"""GGUF tensor types and families in the quantized modes, on real files: a small random-weight model
written with gguf's writer once per family and type (tests/tiny_gguf.py), loaded as a user's
.gguf is.

Types with an exact decoder: speed mode gguf gives the logits of packed mode on the float32 weights
transformers dequantizes from the same file (bit for bit), and the float32 model's greedy tokens.
Types without kernel tiles: gguf-q8 lays them out as Q8_0 and says so; gguf refuses them in one
line. In both, speculation gives plain decoding's tokens in the same mode."""

import pytest
import torch
from tiny_gguf import write_tiny
from tiny_models import greedy_tokens, speculation_is_lossless

from selfspec.engine import Engine
from selfspec.errors import SelfSpecError
from selfspec.loading.models import load_model
from selfspec.loading.sources import ensure_bundled, gguf_source

pytestmark = pytest.mark.slow  # the tokenizer comes from a bundled model's file

EXACT_TYPES = ["Q4_0", "Q3_K", "IQ4_NL", "IQ4_XS", "Q5_0", "Q4_K"]
Q8_TYPES = ["Q5_K", "Q5_1", "Q2_K"]  # read exactly in gguf-q8 only
RELAID_TYPES = ["F16", "BF16"]
PROMPT = [1, 504, 3216, 30, 2451, 314, 253, 1848]  # token ids: the random model has no language
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer_source():
    return gguf_source("smollm2-135m", ensure_bundled("smollm2-135m"))


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _written(cache, tokenizer_source, type_name, family="llama"):
    path = cache / f"tiny-{family}-{type_name}.gguf"
    return str(write_tiny(path, type_name, tokenizer_source, family))


def _last_logits(loaded) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(torch.tensor([PROMPT])).logits[0, -1]


def _speculation_is_lossless(engine: Engine) -> list[int]:
    plan = engine.make_plan([1], [])  # the second layer's attention skipped: a draft every round
    return speculation_is_lossless(engine, PROMPT, NEW_TOKENS, plan)


@pytest.mark.parametrize(
    "family,type_name",
    [("llama", t) for t in EXACT_TYPES] + [(f, "Q4_K") for f in ("qwen3", "phi3", "gemma2")],
)
def test_exact_types_give_the_float32_model_s_logits_and_tokens(
    cache, tokenizer_source, family, type_name
):
    path = _written(cache, tokenizer_source, type_name, family)
    float32 = load_model(path, speed="torch")
    exact = load_model(path, speed="gguf", fused=False)
    packed = load_model(path, speed="packed", fused=False)
    assert torch.equal(_last_logits(exact), _last_logits(packed))
    assert _speculation_is_lossless(Engine(exact)) == greedy_tokens(
        Engine(float32), PROMPT, NEW_TOKENS
    )
    q8 = Engine(load_model(path, speed="gguf-q8"))
    assert q8.relaid == ()
    _speculation_is_lossless(q8)


@pytest.mark.parametrize(
    "family,type_name", [("llama", t) for t in Q8_TYPES] + [("phi3", "Q5_K"), ("phi3", "Q2_K")]
)
def test_types_with_q8_tiles_only_load_in_gguf_q8_as_they_are_and_are_refused_in_gguf(
    cache, tokenizer_source, family, type_name
):
    path = _written(cache, tokenizer_source, type_name, family)
    with pytest.raises(SelfSpecError, match=f"blk.0.attn_.* in .* is {type_name}. Use"):
        load_model(path, speed="gguf", fused=False)
    engine = Engine(load_model(path, speed="gguf-q8"))
    assert engine.relaid == ()
    assert "laid out as Q8_0" not in (engine.generate(PROMPT, max_new_tokens=2).numerics_note or "")
    _speculation_is_lossless(engine)


@pytest.mark.parametrize(
    "family,type_name", [("llama", t) for t in RELAID_TYPES] + [("phi3", "F16")]
)
def test_types_without_tiles_load_in_gguf_q8_as_q8_0_and_say_so(
    cache, tokenizer_source, family, type_name
):
    path = _written(cache, tokenizer_source, type_name, family)
    with pytest.raises(SelfSpecError, match=f"blk.0.attn_.* in .* is {type_name}. Use"):
        load_model(path, speed="gguf", fused=False)
    engine = Engine(load_model(path, speed="gguf-q8"))
    assert engine.relaid == (type_name,)
    out = engine.generate(PROMPT, max_new_tokens=2)
    assert f"{type_name} weights laid out as Q8_0" in out.numerics_note
    _speculation_is_lossless(engine)
    # the embedding reads the file's rows exactly (gguf's dequantization), not the Q8_0 layout
    float32 = load_model(path, speed="torch")
    ids = torch.tensor(PROMPT)
    expected = float32.model.get_input_embeddings()(ids)
    assert torch.equal(engine.loaded.model.get_input_embeddings()(ids), expected)


def test_a_truncated_file_is_a_one_line_error(cache, tokenizer_source):
    path = _written(cache, tokenizer_source, "Q4_0")
    with open(path, "r+b") as fh:
        fh.truncate(fh.seek(0, 2) - 4096)
    with pytest.raises(SelfSpecError, match="runs past the end of the file") as info:
        load_model(path, speed="gguf-q8")
    assert "\n" not in str(info.value)
