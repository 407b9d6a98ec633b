"""selfspec's own model skeleton and tokenizer (the quick start of the quantized modes): each gives
exactly what transformers' gives, and a start through them imports no transformers at all."""

import json
import subprocess
import sys

import pytest
import torch
from test_engine import PROMPTS

from selfspec.kernels import kernel_available
from selfspec.loading.models import load_weights
from selfspec.loading.skeleton import CausalLM
from selfspec.loading.sources import KNOWN_MODELS, ensure_bundled
from selfspec.loading.tokenizer import FastTokenizer, load_tokenizer_from
from selfspec.runtime.runner import ModelRunner

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="the CPU kernel cannot be built")
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "  leading spaces, ünïcödé, emoji 🚀 and CJK 中文字符\t\ttabs\r\n",
    "<|im_start|>user\nspecial tokens typed as text<|im_end|><|endoftext|>",
    "",
    "x" * 300 + " 12345678901234567890",
]
CHATS = [
    [{"role": "user", "content": PROMPTS[0]}],
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "And sunsets?", "name": None},
    ],
]


@pytest.mark.slow  # each bundled model is downloaded on first use
@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_the_tokenizer_reads_as_transformers_reads(name):
    from transformers import AutoTokenizer

    folder = ensure_bundled(name)
    ours, reference = load_tokenizer_from(folder), AutoTokenizer.from_pretrained(folder)
    if not isinstance(ours, FastTokenizer):
        assert name == "gemma3-270m"  # GemmaTokenizer adds its BOS itself: transformers reads it
        return
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == reference(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = reference(text)["input_ids"] + [reference.eos_token_id]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id", "chat_template"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert ours.get_vocab() == reference.get_vocab()
    if reference.chat_template:
        for chat in CHATS:
            for prompt in (True, False):
                kwargs = {"add_generation_prompt": prompt, "tokenize": True, "return_dict": False}
                assert ours.apply_chat_template(chat, **kwargs) == list(
                    reference.apply_chat_template(chat, **kwargs)
                )
            text = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            assert text == reference.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=False
            )


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_own_skeleton_computes_transformers_skeleton_s_logits_bit_for_bit(name):
    """llama (q/k rows permuted in the file, no biases) and qwen2 (q/k/v biases): the same
    weights under the same names, the same rotary and final norm, so the same bits."""
    folder = ensure_bundled(name)
    loads = {}
    for own in (True, False):
        model, layers = load_weights(name, folder, "cpu", torch.float32, "gguf-q8", True, own)
        assert isinstance(model, CausalLM) == own and layers is not None
        loads[own] = (model, layers)
    ours, theirs = (dict(loads[own][0].named_parameters()) for own in (True, False))
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
    tokenizer = load_tokenizer_from(folder)
    ids = torch.tensor(tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True))
    results = []
    for own in (True, False):
        loaded = _loaded(name, folder, tokenizer, *loads[own])
        runner = ModelRunner(loaded)
        runner.reset(ids.numel() + 8)
        prefill = runner.forward(ids, 0)[0]
        verify = runner.forward(torch.tensor([7, 8, 9, 10]), ids.numel())[0]
        results.append((prefill, verify))
    for mine, reference in zip(*results):
        assert torch.equal(mine, reference)


def _loaded(name, folder, tokenizer, model, layers):
    from selfspec.loading.models import LoadedModel

    return LoadedModel(name, model, tokenizer, str(folder), speed="gguf-q8", fused=layers)


@needs_kernel
@pytest.mark.slow
def test_a_quantized_start_imports_no_transformers():
    """The quick start stays quick: loading and generating in the default mode never imports
    transformers (whose modeling code takes seconds to import on a small CPU)."""
    code = (
        "import sys, json\n"
        "from selfspec.engine import Engine\n"
        "engine = Engine.load('qwen2.5-coder-0.5b', speed='gguf-q8')\n"
        "ids = engine.encode('Write a haiku about tests.', chat=True)\n"
        "result = engine.generate(ids, engine.self_drafter(), max_new_tokens=8)\n"
        "print(json.dumps([len(result.token_ids), sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('transformers', 'accelerate'))]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    tokens, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert tokens == 8 and imported == []


@pytest.mark.slow
@needs_kernel
def test_own_skeleton_is_not_run_module_by_module():
    folder = ensure_bundled("smollm2-135m")
    model, _ = load_weights("smollm2-135m", folder, "cpu", torch.float32, "gguf-q8", True, True)
    with pytest.raises(NotImplementedError, match="ModelRunner"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.slow  # reads the bundled model's config
def test_only_configs_the_skeleton_computes_exactly_are_taken():
    """Another rotary kind, a sliding window, another family or a missing field: transformers'
    model class is used instead."""
    from selfspec.loading.skeleton import ModelConfig, supports

    base = json.loads((ensure_bundled("qwen2.5-coder-0.5b") / "config.json").read_text())
    assert supports(ModelConfig(base))
    llama3_rope = {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}
    for change in (
        {"rope_parameters": llama3_rope},
        {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        {"use_sliding_window": True, "sliding_window": 4096},
        {"model_type": "gemma3_text"},
        {"hidden_act": "gelu"},
        {"rms_norm_eps": None},
    ):
        assert not supports(ModelConfig({**base, **change})), change
