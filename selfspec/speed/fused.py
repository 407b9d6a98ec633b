"""Whole decoder sublayers in one native call each, for the kernel speed modes.

Run module by module, a pass of a 1.5B model makes thousands of small torch calls (norms, views,
the rotary embedding, cache writes, additions) between its matrix products, and on a small CPU
they cost a third of a pass. For the common pre-norm layer (llama, qwen2, mistral: RMSNorm,
rotary attention, SiLU-gated MLP) the kernel's ``DecoderLayer`` runs a whole sublayer in one
call over the same weights the speed mode laid out; the adapter calls it instead of the
modules, and the runner runs a whole pass's sublayers through the kernel's ``LayerStack`` (the
same calls, made from native code). Every step works row by row, so rows stay independent of
each other (verify passes and token trees give each row the bits of a one-token pass).

The arithmetic of the norms and the activation is the kernel's own (the same formulas, summed in
a fixed order), so logits can differ from the module-by-module path in the last bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfspec.kernels import KERNEL_MAX_ROWS, load_kernel
from selfspec.speed.modes import KERNEL_MODES, PackedLinear
from selfspec.speed.quantized import Q8Linear, QuantLinear

if TYPE_CHECKING:
    from torch import nn

FUSED_FAMILIES = ("llama", "qwen2", "mistral")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _linear_ref(kernel, module: nn.Module):
    """The kernel's view of one linear layer, or None when it is not one of the kernel's modules."""
    if isinstance(module, Q8Linear):
        kind, weight = kernel.Q8_KIND, module.quant_weight
    elif isinstance(module, QuantLinear):
        kind, weight = kernel.QUANT_KIND, module.quant_weight
    elif isinstance(module, PackedLinear):
        kind, weight = kernel.PACKED_KIND, module.packed_weight
    else:
        return None
    return kernel.LinearRef(
        kind=kind,
        weight=weight,
        format=getattr(module, "format", 0),
        group=getattr(module, "group", 0),
        bias=module.bias,
        in_features=module.in_features,
        out_features=module.out_features,
        max_rows=KERNEL_MAX_ROWS,
    )


def _fused_layer(kernel, layer: nn.Module, config):
    attn, mlp = layer.self_attn, layer.mlp
    refs = [_linear_ref(kernel, getattr(attn, n, None)) for n in _PROJECTIONS]
    refs += [_linear_ref(kernel, getattr(mlp, n, None)) for n in _MLP]
    if any(r is None for r in refs):
        return None
    heads = config.num_attention_heads
    return kernel.DecoderLayer(
        input_norm=layer.input_layernorm.weight.detach(),
        post_attention_norm=layer.post_attention_layernorm.weight.detach(),
        eps=float(getattr(layer.input_layernorm, "variance_epsilon", config.rms_norm_eps)),
        q=refs[0],
        k=refs[1],
        v=refs[2],
        o=refs[3],
        gate=refs[4],
        up=refs[5],
        down=refs[6],
        heads=heads,
        kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        scale=float(attn.scaling),
    )


def fuse_layers(model: nn.Module, speed: str) -> list | None:
    """One kernel ``DecoderLayer`` per decoder layer, or None when this model or mode cannot fuse
    (another family or activation, a speed mode without the kernel, a layer left unpacked)."""
    config = model.config
    if speed not in KERNEL_MODES or config.model_type not in FUSED_FAMILIES:
        return None
    if getattr(config, "hidden_act", None) != "silu":
        return None
    kernel = load_kernel()
    layers = [_fused_layer(kernel, layer, config) for layer in model.model.layers]
    return layers if all(layer is not None for layer in layers) else None
