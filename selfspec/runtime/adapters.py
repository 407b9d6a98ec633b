"""Model-family adapters: the one place that knows how a family's decoder layer is wired.

selfspec runs a Hugging Face decoder sublayer by sublayer (so attention and MLP can be
skipped separately) by calling the model's own modules: its embedding, its attention
module (which writes keys and values through our cache object), its MLP, its norms and
its head. Nothing in transformers is patched; an adapter only says how the pieces of one
family fit together.
"""

from __future__ import annotations

import hashlib

import torch

from selfspec.errors import SelfSpecError
from selfspec.runtime.draft_vocab import DraftVocab, head_logits
from selfspec.runtime.plan import ModelIdentity

# A llama-style decoder layer's linear layers as GGUF files name them -> the model's module names
# (llama.cpp's naming, shared by the llama, qwen2, qwen3, mistral and gemma files).
LAYER_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class DecoderAdapter:
    """Pre-norm decoder (llama, qwen2, qwen3, mistral, phi3): h += attn(norm(h)); h += mlp(norm(h)).

    With ``fused`` (the kernel's DecoderLayer per layer, ``selfspec.speed.fused``) each sublayer is
    one native call over the same weights instead of the model's modules."""

    def __init__(self, model, fused: list | None = None):
        self.model = model
        self.fused = fused
        self.config = model.config
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        self.num_layers = len(self.layers)
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.num_kv_heads = self.config.num_key_value_heads
        self.layer_types = list(
            getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers
        )
        self.sliding_window = getattr(self.config, "sliding_window", None)

    # -- pieces of the forward pass -------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """cos/sin per layer type, keyed by layer type ({'full_attention': (cos, sin)} here)."""
        rope = self.decoder.rotary_emb(hidden, position_ids)
        return {t: rope for t in set(self.layer_types)}

    def attention(self, i: int, hidden, rope: dict, mask, cache) -> torch.Tensor:
        if self.fused is not None:
            cos, sin = rope[self.layer_types[i]]
            rows = hidden.reshape(-1, hidden.shape[-1])
            keys, values = cache.layer(i)
            out = self.fused[i].attention(rows, cos, sin, keys, values, cache.write_pos, mask)
            return out.view(hidden.shape)
        layer = self.layers[i]
        out, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden),
            position_embeddings=rope[self.layer_types[i]],
            attention_mask=mask,
            past_key_values=cache,
        )
        return hidden.to(out.device) + out  # a no-op unless the model is spread over devices

    def mlp(self, i: int, hidden) -> torch.Tensor:
        if self.fused is not None:
            return self.fused[i].mlp(hidden.reshape(-1, hidden.shape[-1])).view(hidden.shape)
        layer = self.layers[i]
        out = layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden.to(out.device) + out

    def logits(self, hidden, vocab: int | DraftVocab | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary, over its first ``vocab`` token ids only, or over a
        draft's ``DraftVocab`` (its base ids, then its extra ids)."""
        return self.normed_logits(self.final_norm(hidden), vocab)

    def final_norm(self, hidden) -> torch.Tensor:
        """The last layer's output as the output head reads it."""
        return self.decoder.norm(hidden)

    def normed_logits(self, normed, vocab: int | DraftVocab | None = None) -> torch.Tensor:
        """The output head over ``final_norm``'s output (or anything in its space: draft heads)."""
        return head_logits(self.model.lm_head, normed, vocab)

    # each layer's linear layers as GGUF names them -> module names
    gguf_linears = LAYER_LINEARS
    # the attention transformers builds the family with (SDPA unless only eager is exact)
    attn_implementation = "sdpa"

    def gguf_row_order(self, gguf_name: str, rows: int):
        """For a linear read from a GGUF file: HF row r is the file's row order[r] (None: same
        order)."""
        return None

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    # -- identity --------------------------------------------------------------------------
    def identity(self, name: str) -> ModelIdentity:
        return ModelIdentity(
            name=name,
            architecture=self.config.model_type,
            num_layers=self.num_layers,
            fingerprint=weight_fingerprint(self.model),
        )


class LlamaAdapter(DecoderAdapter):
    """Llama, Mistral: llama.cpp's converter interleaves the rotary halves of q and k rows."""

    def gguf_row_order(self, gguf_name, rows):
        short = gguf_name.split(".")[-2]
        if short not in ("attn_q", "attn_k"):
            return None
        heads = self.config.num_attention_heads if short == "attn_q" else self.num_kv_heads
        return (
            torch.arange(rows)
            .reshape(heads, rows // heads // 2, 2)
            .transpose(1, 2)
            .reshape(rows)
            .numpy()
        )


class Gemma3Adapter(DecoderAdapter):
    """Gemma 3: sandwich norms around each sublayer, local/global RoPE per layer type, logit
    softcap."""

    def position_embeddings(self, hidden, position_ids) -> dict:
        return {t: self.decoder.rotary_emb(hidden, position_ids, t) for t in set(self.layer_types)}

    def attention(self, i, hidden, rope, mask, cache):
        layer = self.layers[i]
        out, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden),
            position_embeddings=rope[self.layer_types[i]],
            attention_mask=mask,
            past_key_values=cache,
        )
        out = layer.post_attention_layernorm(out)
        return hidden.to(out.device) + out

    def mlp(self, i, hidden):
        layer = self.layers[i]
        out = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        return hidden.to(out.device) + out

    def normed_logits(self, normed, vocab=None):
        logits = head_logits(self.model.lm_head, normed, vocab)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Phi3Adapter(DecoderAdapter):
    """Phi-3, Phi-4-mini: q, k and v in one linear layer, gate and up in another (so in the GGUF
    file); rotary on part of each head where the config says so (inside transformers' attention)."""

    gguf_linears = {
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    }


class Gemma2Adapter(Gemma3Adapter):
    """Gemma 2: Gemma 3's sandwich norms and final softcap, one RoPE for every layer, and attention
    logits soft-capped too, which only transformers' eager attention computes (it is set here, and
    masks are handed to it as additive float masks)."""

    attn_implementation = "eager"

    def __init__(self, model, fused: list | None = None):
        super().__init__(model, fused)
        if model.config._attn_implementation != "eager":  # a model built elsewhere
            model.set_attn_implementation("eager")

    def position_embeddings(self, hidden, position_ids) -> dict:
        return DecoderAdapter.position_embeddings(self, hidden, position_ids)

    def attention(self, i, hidden, rope, mask, cache):
        return super().attention(i, hidden, rope, additive_mask(mask, hidden), cache)


def additive_mask(mask: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor | None:
    """The runner's boolean mask (None: one query seeing everything, or a prefill's plain causal
    mask, which SDPA applies itself) as eager attention adds it to the scores."""
    n = hidden.shape[-2]
    if mask is None:
        if n == 1:
            return None
        mask = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()[None, None]
    scores = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device)
    return scores.masked_fill(~mask, torch.finfo(hidden.dtype).min)


_ADAPTERS = {
    "llama": LlamaAdapter,
    "qwen2": DecoderAdapter,
    "qwen3": DecoderAdapter,
    "mistral": LlamaAdapter,
    "phi3": Phi3Adapter,
    "gemma2": Gemma2Adapter,
    "gemma3_text": Gemma3Adapter,
}
ADAPTED_FAMILIES = tuple(sorted(_ADAPTERS))  # transformers model types selfspec runs


def attention_implementation(config) -> str:
    """The attention implementation to build a model of ``config``'s family with."""
    cls = _ADAPTERS.get(getattr(config, "model_type", None), DecoderAdapter)
    return cls.attn_implementation


def adapter_for(model, fused: list | None = None) -> DecoderAdapter:
    """The adapter for ``model``'s family; ``fused``: the kernel's layers, for the families that
    fuse."""
    model_type = model.config.model_type
    cls = _ADAPTERS.get(model_type)
    if cls is None:
        raise SelfSpecError(
            f"selfspec has no adapter for model type '{model_type}'. Supported: "
            f"{', '.join(ADAPTED_FAMILIES)}."
        )
    return cls(model, fused)


def weight_fingerprint(model) -> str:
    """A short hash of config shape and a few weights, stable across float32/bfloat16 loads."""
    config = model.config
    digest = hashlib.sha256()
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "vocab_size",
    ):
        digest.update(f"{key}={getattr(config, key, None)};".encode())
    embed = model.get_input_embeddings()
    vocab = embed.num_embeddings
    ids = torch.tensor([0, vocab // 2, vocab - 1])
    # QuantEmbedding (selfspec.loading.gguf_load) reads rows from the file: the same values
    rows = embed.rows(ids) if hasattr(embed, "rows") else embed.weight[ids]
    for sample in rows[:, :32].detach().to("cpu", torch.bfloat16).float():
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]
