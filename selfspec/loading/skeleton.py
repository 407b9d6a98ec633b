"""A model skeleton of selfspec's own for the fused families, so a quantized start skips
transformers' modeling code.

Importing transformers' model classes costs seconds on a small CPU (they pull in
torch.distributed and torch._dynamo), yet in the fused kernel modes a pass runs none of their
forward code: each sublayer is one native call (``selfspec.speed.fused``). What a pass still needs
of the model is the module tree that holds the weights, named as transformers names it (so the GGUF
name map and the fused layers find every weight), the rotary embedding, the final norm and the head.
This module builds that tree on the meta device from the model's ``config.json``, with the same
rotary and norm arithmetic as transformers' llama/qwen2/mistral code (tested bit for bit against
it). Anything it does not cover (another family or rotary type, an unfused run) is loaded through
transformers as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

LIGHT_FAMILIES = ("llama", "qwen2", "mistral")


class ModelConfig:
    """A model's ``config.json`` as attributes (what selfspec reads of a transformers config)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)
        self._attn_implementation = "selfspec"  # not transformers' attention: no SDPA swap

    @classmethod
    def from_folder(cls, folder: str | Path, name: str) -> ModelConfig:
        path = Path(folder) / name
        return cls(json.loads(path.read_text()) if path.is_file() else {})

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        return f"ModelConfig({self.to_dict()})"


def rope_settings(config: ModelConfig) -> dict | None:
    """The rotary parameters when they are the plain kind this skeleton computes, else None."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in params or params.get("rope_type", "default") != "default":
        return None
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    return params


_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
)


def supports(config: ModelConfig) -> bool:
    """Whether this skeleton can stand in for transformers' model class of ``config`` (a config
    short of a field transformers would default is left to transformers)."""
    return (
        getattr(config, "model_type", None) in LIGHT_FAMILIES
        and all(getattr(config, key, None) is not None for key in _REQUIRED)
        and getattr(config, "hidden_act", None) == "silu"
        and rope_settings(config) is not None
        and not getattr(config, "use_sliding_window", False)
        and getattr(config, "sliding_window", None) is None
    )


def _head_dim(config: ModelConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _EmptyLinear(nn.Linear):
    def reset_parameters(self) -> None:
        pass  # the weights come from the file (initializing even meta tensors imports dynamo)


class _EmptyEmbedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


def _linear(rows: int, columns: int, bias: bool) -> nn.Linear:
    return _EmptyLinear(columns, rows, bias=bias, device="meta")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm, step for step (the same bits)
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin) [batch, positions, dim] in ``x``'s dtype, as transformers computes them."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = _head_dim(config)
        self.scaling = self.head_dim**-0.5
        width, kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        self.q_proj = _linear(width, config.hidden_size, qkv_bias)
        self.k_proj = _linear(kv * self.head_dim, config.hidden_size, qkv_bias)
        self.v_proj = _linear(kv * self.head_dim, config.hidden_size, qkv_bias)
        o_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        self.o_proj = _linear(config.hidden_size, width, o_bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = _linear(config.intermediate_size, config.hidden_size, bias)
        self.up_proj = _linear(config.intermediate_size, config.hidden_size, bias)
        self.down_proj = _linear(config.hidden_size, config.intermediate_size, bias)


class DecoderLayer(nn.Module):
    """Weights only: the fused kernel layer runs it (``selfspec.speed.fused``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = _EmptyEmbedding(config.vocab_size, config.hidden_size, device="meta")
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), rope_settings(config)["rope_theta"])


class CausalLM(nn.Module):
    """The decoder and its head, with transformers' module names and accessors."""

    def __init__(self, config: ModelConfig, generation_config: ModelConfig):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = Decoder(config)
        self.lm_head = _linear(config.vocab_size, config.hidden_size, False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise NotImplementedError(
            "selfspec's own skeleton holds weights for the fused kernel layers; run it through "
            "selfspec.runtime.runner.ModelRunner"
        )


def build_skeleton(folder: str | Path) -> CausalLM | None:
    """The model in ``folder`` as selfspec's own skeleton (weights on the meta device), or None
    where transformers' model class is needed."""
    config = ModelConfig.from_folder(folder, "config.json")
    if not supports(config):
        return None
    return CausalLM(config, ModelConfig.from_folder(folder, "generation_config.json"))
