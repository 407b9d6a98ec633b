"""Small random-weight models written as real GGUF files, one family and tensor type at a time,
for loading tests: gguf's own writer, gguf's own quantizer where it has one, and random blocks of
the type (any bits, finite float16 scales) where it has none. The tokenizer's fields are copied
from a bundled model's file, so transformers reads the file as it reads a downloaded one."""

from pathlib import Path

import numpy as np
from test_quantized import random_blocks

# Shapes shrunk from each family's: K of every linear layer a multiple of 256 (the K-quants' block)
HIDDEN, FFN, LAYERS = 256, 512, 2
# family -> (attention heads, key/value heads, head size); qwen3's head size is its config's default
HEADS = {"llama": (4, 2, 64), "qwen3": (2, 1, 128), "phi3": (4, 2, 64), "gemma2": (4, 2, 64)}
FAMILIES = tuple(HEADS)


def _copy_tokenizer(writer, source: Path) -> int:
    """The tokenizer.* fields of ``source`` into ``writer``; the vocabulary's size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    size = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(name, value, kind, sub)
        if name == "tokenizer.ggml.tokens":
            size = len(value)
    return size


def _weight(rng, type_name: str, rows: int, columns: int, seed: int) -> tuple[np.ndarray, object]:
    """(data, raw type) of a [rows, columns] weight of ``type_name``."""
    from gguf import GGMLQuantizationType, quants

    values = rng.normal(0, 0.05, (rows, columns)).astype(np.float32)
    if type_name == "F32":
        return values, None
    kind = GGMLQuantizationType[type_name]
    try:
        return quants.quantize(values, kind), kind
    except NotImplementedError:  # gguf dequantizes this type but cannot write it
        return random_blocks(type_name, rows, columns, seed), kind


def _linears(family: str, vocab: int) -> dict[str, tuple[int, int]]:
    """GGUF name -> [rows, columns] of every quantized weight (llama.cpp's names per family)."""
    heads, kv_heads, head_dim = HEADS[family]
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"token_embd": (vocab, HIDDEN)}
    if family != "gemma2":  # gemma ties its output layer to the embedding
        shapes["output"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}"
        if family == "phi3":  # q, k, v in one layer; gate and up in one layer
            shapes |= {f"{b}.attn_qkv": (q + 2 * kv, HIDDEN), f"{b}.ffn_up": (2 * FFN, HIDDEN)}
        else:
            shapes |= {f"{b}.attn_q": (q, HIDDEN), f"{b}.attn_k": (kv, HIDDEN)}
            shapes |= {f"{b}.attn_v": (kv, HIDDEN), f"{b}.ffn_gate": (FFN, HIDDEN)}
            shapes[f"{b}.ffn_up"] = (FFN, HIDDEN)
        shapes |= {f"{b}.attn_output": (HIDDEN, q), f"{b}.ffn_down": (HIDDEN, FFN)}
    return shapes


def _norms(family: str) -> dict[str, int]:
    """GGUF name -> size of every float32 norm weight."""
    norms = {"attn_norm": HIDDEN, "ffn_norm": HIDDEN}
    if family == "qwen3":  # q and k normed per head
        norms |= {"attn_q_norm": HEADS["qwen3"][2], "attn_k_norm": HEADS["qwen3"][2]}
    if family == "gemma2":  # a norm after each sublayer too
        norms |= {"post_attention_norm": HIDDEN, "post_ffw_norm": HIDDEN}
    out = {f"blk.{i}.{name}": size for i in range(LAYERS) for name, size in norms.items()}
    return out | {"output_norm": HIDDEN}


def _add_config(writer, family: str, vocab: int) -> None:
    heads, kv_heads, head_dim = HEADS[family]
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    if family == "gemma2":
        writer.add_sliding_window(4)  # shorter than the tests' texts: the windows matter
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)


def write_tiny(
    path: Path, type_name: str, tokenizer_source: Path | None, family: str = "llama", seed: int = 0
) -> Path:
    """A 2-layer model of ``family`` whose linear layers and embedding are ``type_name`` (norms
    float32), tokenized as ``tokenizer_source``."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), family)
    # no tokenizer: a file only read from its header (selfspec models --check)
    vocab = _copy_tokenizer(writer, tokenizer_source) if tokenizer_source else 512
    _add_config(writer, family, vocab)
    for n, (name, (rows, columns)) in enumerate(_linears(family, vocab).items()):
        data, kind = _weight(rng, type_name, rows, columns, seed + n)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=kind)
    for name, size in _norms(family).items():
        writer.add_tensor(f"{name}.weight", 1 + rng.normal(0, 0.1, size).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
