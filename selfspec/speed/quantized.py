"""Speed mode ``gguf``: the linear layers keep the GGUF file's own quantized weights.

The bundled models are GGUF files whose weights are small integers with a float scale (and
offset) per 16 or 32 weights. Converting them to float32 makes every decoding step read 4-7x
more bytes than the file holds. In this mode each linear layer keeps the file's integers,
repacked into the 16-wide panels of the ``packed`` mode, and the kernel rebuilds every weight
in registers as exactly the float32 value the file dequantizes to (ggml's formula, one
rounding), then sums in ``packed``'s order: logits identical to ``packed`` bit for bit, from
a fifth of the bytes (docs/speed-modes.md). At load, the first and
last panels of every layer are compared with the float32 model (every weight, in the tests).

Speed mode ``gguf-q8`` (``Q8Linear``) keeps the same integers, arranged for integer dot
products, and multiplies them by the activations rounded to 8 bits: llama.cpp's arithmetic, not
the float32 model's (see ``selfspec.speed.modes``).

Formats read (``selfspec.speed.blocks``): Q4_K (4-bit with the file's own scale factors), Q4_1
(4-bit, the file's float16 scale and offset per 32), Q4_0 (4-bit, float scale and offset per 32),
Q6_K and Q3_K (int8 per 16, or six bits where the build has the six-bit tiles: both modes on
AVX-512), Q8_0, Q5_0, IQ4_NL and IQ4_XS (int8 per 32). Mode gguf-q8 also holds IQ4_XS, IQ4_NL and
Q4_0 as their 4-bit indices, Q5_K, Q5_0 and Q5_1 as five-bit panels, Q3_K as three-bit and Q2_K as
two-bit ones (``pack_lut_nibbles``, ``pack_half_nibbles``, ``pack_five_bits``,
``pack_half_five_bits``, ``pack_three_bits``, ``pack_two_bits``); other types gguf reads are laid
out as Q8_0 in mode gguf-q8 only. The embedding and the norms stay float32 (they are not
streamed per step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.kernels import PANEL, in_row_chunks, pack_weight, padded_rows
from selfspec.loading.gguf_reader import gguf_tensors
from selfspec.runtime.adapters import adapter_for
from selfspec.speed.blocks import (
    DECODERS,
    FIVE_BITS,
    HALF_OFFSET_FIVE_BITS,
    LUT_NIBBLES,
    Q8_DECODERS,
    RELAID,
    SIX_BITS,
    THREE_BITS,
    TWO_BITS,
    Decoded,
    decode,
    dequantize,
    read_problem,
    round_q8_0,
)
from selfspec.speed.panels import (
    has_half_five_bits,
    has_lut_nibbles,
    has_six_bits,
    pack,
    pack_five_bits,
    pack_half_five_bits,
    pack_half_nibbles,
    pack_lut_nibbles,
    pack_six_bits,
    pack_three_bits,
    pack_two_bits,
    packed_format,
)

_CHECK_PANELS = 8  # panels compared with the float32 weights at each end of every layer


class QuantLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` whose weight is held as quantized 16-wide panels."""

    reads_prefix = True  # forward(x, out_features) reads only the first outputs' weights

    vnni = False  # the arrangement of each group's integers (see pack)
    # (GGUF tensor, row order or None) the weights were read from: where rows_module reads rows
    source: tuple | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        panels: torch.Tensor,
        layout: tuple[int, int, str],
        bias: torch.Tensor | None,
        kernel,
    ):
        """``panels``: [out_features / 16, bytes per panel] uint8 as ``pack`` (or, format
        SIX_BITS, ``pack_six_bits``) lays them out; ``layout``: (kernel format, group size, the
        file's type name)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kernel = kernel
        self.format, self.group, self.type_name = layout
        self.register_buffer("quant_weight", panels)
        self.register_buffer("bias", bias)

    @classmethod
    def wants_six_bits(cls, kernel) -> bool:
        """Whether this mode holds Q6_K as six-bit panels: where the build has their tiles (in
        mode gguf the float tiles rebuild the byte layout's weights from them, bit for bit, and
        read two thirds of its bytes)."""
        return kernel.q8_six_bits() if cls.vnni else kernel.quant_six_bits()

    @classmethod
    def lay_out(cls, decoded: Decoded, type_name: str, kernel) -> tuple[torch.Tensor, int, int]:
        """(panels, kernel format, group size) of ``decoded``, the file's ``type_name``, in this
        mode (the same for every chunk of a tensor: the type decides, never the values)."""
        if cls.wants_six_bits(kernel) and has_six_bits(decoded):
            if cls.vnni and type_name == "Q3_K":
                return pack_three_bits(decoded), THREE_BITS, 16
            return pack_six_bits(decoded), SIX_BITS, 16
        if cls.vnni and decoded.levels is not None and kernel.q8_lut_nibbles():
            if has_lut_nibbles(decoded):
                return pack_lut_nibbles(decoded), LUT_NIBBLES, 32
            return (*pack_half_nibbles(decoded), 32)
        if cls.vnni and has_half_five_bits(decoded) and kernel.q8_five_bits():
            return (*pack_half_five_bits(decoded), 32)
        if decoded.format in (FIVE_BITS, HALF_OFFSET_FIVE_BITS, TWO_BITS):
            if decoded.format == FIVE_BITS and kernel.q8_five_bits():
                return pack_five_bits(decoded), FIVE_BITS, 32
            if decoded.format == TWO_BITS and kernel.q8_six_bits():
                return pack_two_bits(decoded), TWO_BITS, 16
            decoded = round_q8_0(decoded.weights(0, len(decoded.q)))  # no tiles in this build
        return pack(decoded, vnni=cls.vnni), packed_format(decoded), decoded.group

    @classmethod
    def from_decoded(cls, decoded: Decoded, type_name: str, bias: torch.Tensor | None, kernel):
        out_features, in_features = decoded.q.shape
        panels, format, group = cls.lay_out(decoded, type_name, kernel)
        return cls(in_features, out_features, panels, (format, group, type_name), bias, kernel)

    def rows_module(self, ids: torch.Tensor) -> QuantLinear | None:
        """A module of this kind over output rows ``ids`` only (padded: ``padded_rows``), read
        from the file again; None when the module does not know its file."""
        if self.source is None:
            return None
        tensor, order = self.source
        ids = padded_rows(ids)
        rows = ids.numpy() if order is None else np.asarray(order)[ids.numpy()]
        decoded = decode(tensor.gather_rows(rows), tensor.type_name, len(rows), self.vnni)
        bias = self.bias[ids] if self.bias is not None else None
        return type(self).from_decoded(decoded, self.type_name, bias, self.kernel)

    def dequantized_panels(self, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Panels [first, last) as float32 [P, K, 16], the layout of the packed mode."""
        return self.kernel.dequantize_panels(
            self.quant_weight[first:last], self.format, self.group, self.in_features
        )

    @property
    def panel_weight(self) -> torch.Tensor:
        return self.quant_weight

    def run_panels(self, rows: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        """rows [M, in_features] times ``weight`` (some of this layer's panels) + ``bias``."""
        format, group = self.format, self.group
        return in_row_chunks(
            lambda chunk: self.kernel.quant_linear(chunk, weight, format, group, bias), rows
        )

    def forward(self, x: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
        n = out_features or self.out_features
        bias = self.bias[:n] if self.bias is not None else None
        weight = self.quant_weight[: n // PANEL]
        out = self.run_panels(x.reshape(-1, self.in_features), weight, bias)
        return out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights={self.type_name} as 16-wide panels"
        )


class Q8Linear(QuantLinear):
    """Speed mode gguf-q8: the file's integers times the activations rounded to 8 bits per 32
    values, summed with integer dot products (AVX-512 VNNI, or AVX2's vpmaddubsw), as llama.cpp
    does. Not the float32 model's numerics, so not its logits; every pass, prefill included, runs
    the same per-row arithmetic, so speculation in this mode is still identical to plain decoding
    in this mode. Where the build has their tiles (VNNI, AVX2) Q6_K layers hold six-bit panels (the
    file's 6.56 bits a weight instead of the byte layout's 10; the same integers, so the same
    bits)."""

    vnni = True

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel) -> Q8Linear:
        """``weight`` [N, K] rounded as ggml's Q8_0 rounds it (``blocks.round_q8_0``)."""
        decoded = round_q8_0(weight.detach().float().cpu().numpy())
        bias = None if bias is None else bias.detach().float().cpu().contiguous()
        return cls.from_decoded(decoded, "Q8_0", bias, kernel)

    def dequantized_panels(self, first: int = 0, last: int | None = None) -> torch.Tensor:
        raise NotImplementedError("gguf-q8 panels are arranged for integer dot products")

    def run_panels(self, rows: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        return self.kernel.q8_linear(rows, weight, self.format, self.group, bias, False)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", activations rounded to 8 bits"


def _module(model: nn.Module, dotted: str) -> nn.Module:
    try:
        return model.get_submodule(dotted)
    except AttributeError as exc:
        raise SelfSpecError(
            f"the model has no module {dotted}; speed mode gguf cannot map its GGUF file onto "
            "it. Use --speed packed."
        ) from exc


def linear_sources(model: nn.Module, tensors: dict, gguf_path: Path, kernel) -> list[tuple]:
    """(module name, GGUF tensor name, tensor) of every linear layer of the decoder and the head
    that the file's integers replace, each checked to be in the file with the module's shape."""
    adapter = adapter_for(model)
    head_source = (
        "token_embd.weight"
        if getattr(model.config, "tie_word_embeddings", False)
        else "output.weight"
    )
    targets = [
        (f"blk.{i}.{short}.weight", f"model.layers.{i}.{module}")
        for i in range(adapter.num_layers)
        for short, module in adapter.gguf_linears.items()
    ]
    targets.append((head_source if head_source in tensors else "token_embd.weight", "lm_head"))
    sources = []
    for gguf_name, module_name in targets:
        linear = _module(model, module_name)
        tensor = tensors.get(gguf_name)
        if tensor is None or not isinstance(linear, nn.Linear):
            raise SelfSpecError(
                f"{gguf_path.name} has no tensor {gguf_name} for {module_name}; "
                "speed mode gguf cannot map this file onto the model. Use --speed packed."
            )
        if linear.out_features % (PANEL * kernel.panels_per_group()):
            continue  # stays float32 (never the case for the bundled models)
        if (tensor.rows, tensor.columns) != (linear.out_features, linear.in_features):
            raise SelfSpecError(
                f"{gguf_name} in {gguf_path.name} is [{tensor.rows}, {tensor.columns}], but "
                f"{module_name} is [{linear.out_features}, {linear.in_features}]: this GGUF file "
                "is not the model's. Use --speed packed."
            )
        sources.append((module_name, gguf_name, tensor))
    return sources


def check_types(sources: list[tuple], relay: bool, gguf_path: Path) -> None:
    """Refuse, before any work, a layer whose type this mode cannot read: in mode gguf a type
    without an exact decoder, in gguf-q8 a type ``gguf`` cannot dequantize."""
    for _, gguf_name, tensor in sources:
        if tensor.type_name in DECODERS:
            continue
        if not relay:
            raise SelfSpecError(
                f"speed mode gguf reads {', '.join(DECODERS)} weights exactly; {gguf_name} in "
                f"{gguf_path.name} is {tensor.type_name}. Use --speed gguf-q8 (which reads it, "
                "at 8-bit activations) or --speed packed."
            )
        problem = read_problem(tensor)
        if problem:
            raise SelfSpecError(f"{gguf_name} in {gguf_path.name}: {problem}")


def layer_type(type_name: str, relay: bool) -> str:
    """What a layer of the file's ``type_name`` holds: the type, or (``relay``, a type without
    kernel tiles) the type laid out as Q8_0."""
    exact = DECODERS.keys() | (Q8_DECODERS.keys() if relay else set())
    return f"{type_name}{RELAID}" if relay and type_name not in exact else type_name


def raw_rows(model: nn.Module, tensor, first: int, last: int) -> np.ndarray:
    """Rows [first, last) of a linear layer's weight as the file's blocks, in the model's row
    order (read, not mapped: see ``GGUFTensor.read_rows``)."""
    order = adapter_for(model).gguf_row_order(tensor.name, tensor.rows)
    if order is None:
        return tensor.read_rows(first, last)
    return tensor.gather_rows(order[first:last])  # rows from all over the tensor


def decode_rows(
    model: nn.Module, tensor, first: int = 0, last: int | None = None, relay: bool = False
) -> Decoded:
    """Rows [first, last) of a linear layer's weight, in the model's row order, decoded from the
    file (``relay``: types without kernel tiles rounded to Q8_0)."""
    last = tensor.rows if last is None else last
    return decode(raw_rows(model, tensor, first, last), tensor.type_name, last - first, relay)


def swap_module(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, child = dotted.rpartition(".")
    setattr(_module(model, parent) if parent else model, child, module)


def quantize_model(model: nn.Module, gguf_path: Path, kernel, activations8: bool = False) -> int:
    """Swap the decoder's and the head's nn.Linear modules of a float32 model for QuantLinear
    (``activations8``: Q8Linear) built from the file, each checked against the float32 weights."""
    swaps = []  # made once every layer is built and checked: a bad file leaves the model untouched
    sources = linear_sources(model, gguf_tensors(gguf_path), gguf_path, kernel)
    check_types(sources, activations8, gguf_path)
    for module_name, gguf_name, tensor in sources:
        linear = _module(model, module_name)
        decoded = decode_rows(model, tensor, relay=activations8)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        kind = layer_type(tensor.type_name, activations8)
        if activations8:
            _check_rows(model, tensor, linear.weight, gguf_path)
            quant = Q8Linear.from_decoded(decoded, kind, bias, kernel)
        else:
            quant = QuantLinear.from_decoded(decoded, kind, bias, kernel)
            _check_exact(quant, linear.weight, gguf_name, gguf_path)
        quant.source = (tensor, adapter_for(model).gguf_row_order(gguf_name, tensor.rows))
        swaps.append((module_name, quant))
    for module_name, quant in swaps:
        swap_module(model, module_name, quant)
    return len(swaps)


def _not_the_models(gguf_name: str, gguf_path: Path) -> SelfSpecError:
    return SelfSpecError(
        f"{gguf_name} in {gguf_path} does not hold the loaded model's weights. The file is not "
        "this model's, or changed since it was converted. Use --speed packed, or remove the "
        "model's cache folder to convert it again."
    )


def _check_rows(model: nn.Module, tensor, weight: torch.Tensor, gguf_path: Path) -> None:
    """As _check_exact, on the file's rows dequantized (gguf-q8 panels are not arranged to be
    rebuilt, and may hold the weights rounded to Q8_0)."""
    rows = weight.shape[0]
    span = _CHECK_PANELS * PANEL
    for first, last in ((0, min(rows, span)), (max(0, rows - span), rows)):
        values = dequantize(raw_rows(model, tensor, first, last), tensor.type_name, last - first)
        if not np.array_equal(values, weight[first:last].detach().numpy()):
            raise _not_the_models(tensor.name, gguf_path)


def _check_exact(quant: QuantLinear, weight: torch.Tensor, gguf_name: str, gguf_path: Path) -> None:
    """The rebuilt weights must equal the float32 model's: the file is the model's own,
    mapped right.

    The first and last panels of every layer are compared, which catches a wrong file, tensor or row
    order at a fraction of the cost; the tests compare every weight of the bundled models."""
    panels = quant.quant_weight.shape[0]
    for first, last in ((0, min(panels, _CHECK_PANELS)), (max(0, panels - _CHECK_PANELS), panels)):
        expected = pack_weight(weight[first * PANEL : last * PANEL])
        if not torch.equal(quant.dequantized_panels(first, last), expected):
            raise _not_the_models(gguf_name, gguf_path)
