"""Loading straight into the quantized modes (selfspec.loading.gguf_load): the model built from the
GGUF file alone holds exactly what the float32 model put into that mode holds, its panels are built
once and mapped afterwards, damage is rebuilt, and no float32 copy is made until a float32 mode
asks for one."""

import shutil

import pytest
import torch

from selfspec.kernels import kernel_available
from selfspec.loading import cache as modelcache
from selfspec.loading import gguf_load
from selfspec.loading.models import load_model
from selfspec.loading.sources import (
    FLOAT32_FOLDER,
    ensure_bundled,
    ensure_local_gguf,
    gguf_source,
    has_weights,
)
from selfspec.speed import quantized
from selfspec.speed.modes import apply_speed_mode

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernel_available(), reason="the CPU kernel cannot be built here"),
]
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("mode", ["gguf", "gguf-q8"])
def test_direct_load_equals_the_float32_model_put_into_the_mode(smollm2, mode):
    """smollm2: a llama (q/k rows permuted in the file), Q4_1 layers, a Q8_0 embedding and head."""
    name = "smollm2-135m"
    direct = load_model(name, speed=mode, fused=False)  # transformers' modules, run one by one
    converted = load_model(name, speed="torch")
    apply_speed_mode(converted.model, mode, gguf_source(name, converted.path))
    tokenizer = direct.tokenizer
    assert torch.equal(_logits(direct.model, tokenizer), _logits(converted.model, tokenizer))
    # the float32 tensors read from the file (norms) and the embedding rows: the float32 model's
    reference = dict(smollm2.loaded.model.named_parameters())
    for param_name, value in direct.model.named_parameters():
        assert torch.equal(value, reference[param_name]), param_name
    embedding = direct.model.get_input_embeddings()
    assert isinstance(embedding, gguf_load.QuantEmbedding)
    every_id = torch.arange(embedding.num_embeddings)
    weight = smollm2.loaded.model.get_input_embeddings().weight
    assert torch.equal(embedding(every_id), weight)
    # rows looked up a few at a time, as decoding does, come from the rows it keeps decoded: the
    # same values, in any order and with repeats; a returned row is a copy, and what it keeps stays
    # within its bound, also when a call that needs kept rows overflows it
    half = embedding.KEPT_ROWS // 2
    overflow = [5, *range(2000, 2000 + half)]
    for ids in ([5], [5], [7, 5, 7], list(range(100, 100 + half)), overflow, [9, 5]):
        rows = embedding(torch.tensor(ids))
        assert torch.equal(rows, weight[ids])
        rows.zero_()
        assert len(embedding.kept_rows) <= embedding.KEPT_ROWS
    assert torch.equal(embedding(torch.tensor([5, 9])), weight[[5, 9]])


def test_gemma3_direct_load_equals_the_float32_model_put_into_the_mode():
    """gemma3: its GGUF norms are stored plus one (transformers' fix applies), its embedding is
    scaled, its attention alternates sliding and full by layer."""
    name = "gemma3-270m"
    direct = load_model(name, speed="gguf")
    converted = load_model(name, speed="torch")
    reference = {n: p.clone() for n, p in converted.model.named_parameters()}
    apply_speed_mode(converted.model, "gguf", gguf_source(name, converted.path))
    tokenizer = direct.tokenizer
    assert torch.equal(_logits(direct.model, tokenizer), _logits(converted.model, tokenizer))
    for param_name, value in direct.model.named_parameters():
        assert torch.equal(value, reference[param_name]), param_name
    ids = torch.arange(0, direct.model.get_input_embeddings().num_embeddings, 997)
    expected = converted.model.get_input_embeddings()(ids)
    assert torch.equal(direct.model.get_input_embeddings()(ids), expected)


def test_qwen_biases_norms_and_embedding_equal_the_float32_models(qwen05, qwen05_gguf_direct):
    """qwen2: q/k/v biases, a Q8_0 embedding; every row of the 151936-token vocabulary."""
    model = qwen05_gguf_direct.model
    reference = dict(qwen05.loaded.model.named_modules())
    biased = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, quantized.QuantLinear) and m.bias is not None
    ]
    assert len(biased) == 3 * 24  # q, k and v of every layer
    for name, module in biased:
        assert torch.equal(module.bias, reference[name].bias), name
    for name, value in model.named_parameters():
        assert torch.equal(value, reference[name.removesuffix(".weight")].weight), name
    embedding, expected = model.get_input_embeddings(), reference["model.embed_tokens"].weight
    for first in range(0, embedding.num_embeddings, 16384):
        ids = torch.arange(first, min(first + 16384, embedding.num_embeddings))
        assert torch.equal(embedding(ids), expected[ids]), first


@pytest.fixture(scope="module")
def qwen05_gguf_direct():
    return load_model("qwen2.5-coder-0.5b", speed="gguf")


@pytest.fixture()
def local_cache(tmp_path, monkeypatch):
    """A fresh cache holding smollm2 as a local .gguf describes it: its config and tokenizer, no
    weights of its own (no download)."""
    gguf = tmp_path / "smollm2.gguf"
    shutil.copy(gguf_source("smollm2-135m", ensure_bundled("smollm2-135m")), gguf)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return gguf, ensure_local_gguf(gguf)


def test_panels_are_built_once_then_mapped_and_no_float32_copy_is_made(
    local_cache, smollm2, monkeypatch, capsys
):
    gguf, entry = local_cache
    assert not has_weights(entry) and (entry / "config.json").is_file()
    older, other_mode = entry / "panels-gguf-q8-v4", entry / "panels-gguf-v1"
    older.mkdir()
    other_mode.mkdir()
    first = load_model(str(gguf), speed="gguf-q8", fused=False)
    panels = entry / f"panels-gguf-q8-v{gguf_load.layout_version('gguf-q8')}"
    assert modelcache.entry_damage(panels, full=True) is None
    assert not older.exists() and other_mode.exists()  # an older layout's panels are removed
    assert not (entry / FLOAT32_FOLDER).exists()  # a quantized mode made no float32 copy

    def no_build(*args):
        raise AssertionError("the panels were built again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_load, "build_panels", no_build)
        second = load_model(str(gguf), speed="gguf-q8", fused=False)
    tokenizer = first.tokenizer
    expected = _logits(first.model, tokenizer)
    assert torch.equal(_logits(second.model, tokenizer), expected)

    # same size, other bytes (seen by the models above too: their pages map the file)
    with open(panels / gguf_load.PANELS_FILE, "r+b") as fh:
        fh.seek(4096)
        fh.write(b"\x55" * 4096)
    third = load_model(str(gguf), speed="gguf-q8", fused=False)
    err = capsys.readouterr().err
    assert "is damaged (panels.bin does not match its checksum); rebuilding it" in err
    assert torch.equal(_logits(third.model, tokenizer), expected)

    # a float32 mode builds the float32 copy inside the entry, once: the float32 model's weights
    float32 = load_model(str(gguf), speed="torch")
    assert has_weights(entry / FLOAT32_FOLDER)
    reference = smollm2.loaded.model.state_dict()
    for name, value in float32.model.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_a_folder_outside_the_cache_is_loaded_without_writing_to_it(local_cache, tmp_path):
    gguf, entry = local_cache
    folder = tmp_path / "mine"
    shutil.copytree(entry, folder)
    shutil.copy(gguf, folder / "model.gguf")
    before = sorted(p.name for p in folder.iterdir())
    loaded = load_model(str(folder), speed="gguf", fused=False)
    assert sorted(p.name for p in folder.iterdir()) == before
    reference = load_model(str(gguf), speed="gguf", fused=False)
    assert torch.equal(
        _logits(loaded.model, loaded.tokenizer), _logits(reference.model, loaded.tokenizer)
    )
