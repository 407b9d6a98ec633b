"""Model families beyond llama/qwen2: small random-weight models of each family, with the family's
real config fields, saved by transformers as a user's folder is, then loaded by selfspec.

Plain decoding gives transformers' own greedy tokens; every speculative path gives plain
decoding's tokens, in the exact torch mode and in the packed kernel mode."""

import pytest
import torch
from tiny_models import TINY_SHAPE, speculation_is_lossless, word_level_tokenizer
from transformers import AutoModelForCausalLM

from selfspec.engine import Engine
from selfspec.loading.models import load_model

SHAPE = dict(TINY_SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _config(family: str):
    from transformers import Gemma2Config, LlamaConfig, Phi3Config, Qwen3Config

    if family == "qwen3":  # q and k normed per head
        return Qwen3Config(**SHAPE, head_dim=16)
    if family == "phi3":  # fused qkv and gate_up; Phi-4-mini's partial rotary
        return Phi3Config(**SHAPE, partial_rotary_factor=0.75)
    if family == "gemma2":  # sandwich norms, both softcaps, alternating 4-token windows
        return Gemma2Config(
            **SHAPE, head_dim=16, sliding_window=4, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )  # fmt: skip
    if family == "llama3-rope":  # llama 3.1's rope scaling
        return LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE)
    raise ValueError(family)


FAMILIES = ["qwen3", "phi3", "gemma2", "llama3-rope"]
PROMPT = [1, 5, 17, 33, 9, 40, 21]
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():  # a sharper head: fewer near-ties between the top two tokens
        model.lm_head.weight.mul_(4)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    word_level_tokenizer().save_pretrained(out)
    return out


def _transformers_greedy(folder) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    out = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
    )
    return out[0, len(PROMPT) :].tolist()


def _lossless(engine: Engine) -> list[int]:
    plan = engine.make_plan([1, 2], [2])  # a draft every round
    return speculation_is_lossless(engine, PROMPT, NEW_TOKENS, plan)


def test_the_family_decodes_as_transformers_does(folder):
    engine = Engine(load_model(str(folder), speed="torch"))
    assert _lossless(engine) == _transformers_greedy(folder)


def test_the_family_runs_in_the_packed_kernel_mode(folder):
    engine = Engine(load_model(str(folder), speed="packed"))
    _lossless(engine)
