"""Speed modes gguf and gguf-q8: the GGUF file's integers rebuild exactly the float32 weights
(checked against gguf's own dequantization), the quantized kernel returns packed mode's results bit
for bit, the 8-bit-activation kernel computes its documented formula, and decoding in either mode is
lossless with respect to plain decoding in that mode."""

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from test_engine import PROMPTS, plans_for

from selfspec.errors import SelfSpecError
from selfspec.kernels import KERNEL_MAX_ROWS, PANEL, kernel_available, load_kernel, pack_weight
from selfspec.loading import gguf_reader
from selfspec.runtime.plan import DraftPolicy
from selfspec.speed import blocks, panels, quantized

needs_kernel = pytest.mark.skipif(
    not kernel_available(), reason="the CPU kernel cannot be built here"
)

# type -> (weights per block, bytes per block, byte offsets of its float16 fields)
BLOCKS = {
    "Q4_K": (256, 144, (0, 2)),
    "Q6_K": (256, 210, (208,)),
    "Q8_0": (32, 34, (0,)),
    "Q5_0": (32, 22, (0,)),
    "Q4_1": (32, 20, (0, 2)),
    "Q4_0": (32, 18, (0,)),
    "Q3_K": (256, 110, (108,)),
    "IQ4_NL": (32, 18, (0,)),
    "IQ4_XS": (256, 136, (0,)),
}
# read exactly in gguf-q8 only (their tiles are gguf-q8's)
Q8_BLOCKS = {"Q5_K": (256, 176, (0, 2)), "Q5_1": (32, 24, (0, 2)), "Q2_K": (256, 84, (80, 82))}
# types with no kernel tiles, laid out as Q8_0 in gguf-q8 (the float types are built apart)
RELAID_BLOCKS = {"IQ2_XXS": (256, 66, (0,))}


def random_blocks(type_name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random quantized data of one GGUF type: any bits, with finite float16 scales."""
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16", "BF16"):
        values = rng.normal(0, 0.05, size=(rows, columns)).astype(np.float32)
        if type_name == "F16":
            values = values.astype(np.float16)
        elif type_name == "BF16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        return values.view(np.uint8)
    per_block, block_bytes, f16_fields = {**BLOCKS, **Q8_BLOCKS, **RELAID_BLOCKS}[type_name]
    blocks = rng.integers(0, 256, size=(rows * columns // per_block, block_bytes), dtype=np.uint8)
    for at in f16_fields:
        scales = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@needs_kernel
@pytest.mark.parametrize("type_name", sorted(BLOCKS))
@pytest.mark.parametrize("rows,columns", [(64, 512), (192, 1536)])
def test_rebuilt_weights_equal_gguf_dequantization_and_products_equal_packed(
    type_name, rows, columns
):
    raw = random_blocks(type_name, rows, columns, seed=rows + len(type_name))
    reference = torch.from_numpy(
        dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, columns).copy()
    )
    decoded = blocks.decode(raw, type_name, rows)
    wq, format = panels.pack(decoded), panels.packed_format(decoded)
    kernel = load_kernel()
    assert torch.equal(
        kernel.dequantize_panels(wq, format, decoded.group, columns), pack_weight(reference)
    )
    packed = pack_weight(reference)
    bias = torch.randn(rows)
    x = torch.randn(KERNEL_MAX_ROWS, columns)
    for m in (1, 2, 3, 4, 5, 7, 8, 12, 13, 17, KERNEL_MAX_ROWS):
        got = kernel.quant_linear(x[:m], wq, format, decoded.group, bias)
        assert torch.equal(got, kernel.packed_linear(x[:m], packed, bias)), (type_name, m)
        # rows do not depend on each other: a verify pass gives each token a one-token pass's result
        assert torch.equal(
            got[m - 1 :], kernel.quant_linear(x[m - 1 : m], wq, format, decoded.group, bias)
        )


def eight_bit_activations(x: torch.Tensor) -> torch.Tensor:
    """x as gguf-q8 sees it: per row and block of 32, d * nearbyint(x * 127 / max|x|), d = max|x| /
    127."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    # (torch computes `127 / amax` as 127 * (1 / amax), which rounds differently now and then)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    a = torch.round(x.reshape(blocks.shape) * inverse)  # round: ties to even
    return (a.double() * (amax / 127).double()).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("type_name", sorted(BLOCKS))
def test_q8_kernel_computes_its_formula_on_every_row_alike(type_name):
    """gguf-q8: the vector tiles give the scalar definition's bits, rows never depend on each other,
    and the result is the float64 product of the rounded activations and the file's weights."""
    rows, columns = 192, 1536
    raw = random_blocks(type_name, rows, columns, seed=7 + len(type_name))
    decoded = blocks.decode(raw, type_name, rows)
    wq, format = panels.pack(decoded, vnni=True), panels.packed_format(decoded)
    weight = torch.from_numpy(decoded.weights(0, rows)).double()
    kernel = load_kernel()
    bias = torch.randn(rows)
    gen = torch.Generator().manual_seed(len(type_name))
    x = torch.randn(100, columns, generator=gen) * torch.rand(100, 1, generator=gen) * 4
    x[3, 64:96] = 0  # an all-zero block
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 25, 100):  # every tile shape, whole and cut short
        got = kernel.q8_linear(x[:m], wq, format, decoded.group, bias, False)
        assert torch.equal(got, kernel.q8_linear(x[:m], wq, format, decoded.group, bias, True)), m
        assert torch.equal(
            got[m - 1 :],
            kernel.q8_linear(x[m - 1 : m], wq, format, decoded.group, bias, False),
        )
        expected = eight_bit_activations(x[:m]) @ weight.T + bias.double()
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max(), m
    # a prefix of the panels (the draft head's vocabulary) is the prefix of the outputs
    assert torch.equal(
        kernel.q8_linear(x[:5], wq[:4], format, decoded.group, bias[:64], False),
        kernel.q8_linear(x[:5], wq, format, decoded.group, bias, False)[:, :64],
    )
    empty = kernel.q8_linear(x[:0], wq, format, decoded.group, bias, False)
    assert empty.shape == (0, rows)


def tile_activations(seed: int) -> torch.Tensor:
    """100 rows of varied scale, one with an all-zero block: enough for every tile shape."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(100, 1536, generator=gen) * torch.rand(100, 1, generator=gen) * 4
    x[2, :32] = 0
    return x


def assert_byte_layout_bits(kernel, x, byte_panels, panels, format, group, bias, module) -> None:
    """``panels`` of ``format`` give the byte layout's bits at every tile shape, whole and cut
    short, tiles and scalar reference alike; so does ``module``, which holds them."""
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 100):
        expected = kernel.q8_linear(x[:m], byte_panels, blocks.BYTES, group, bias, False)
        for reference in (False, True):
            got = kernel.q8_linear(x[:m], panels, format, group, bias, reference)
            assert torch.equal(got, expected), (m, reference)
        assert torch.equal(module(x[:m]), expected)
        assert torch.equal(module(x[:m], 64), expected[:, :64])  # a draft head's prefix


# K-quants of 16-weight groups held at their own bit width in gguf-q8: (format, packer, bits a
# weight there; the byte layout takes 10)
SIXTEEN_PANELS = {
    "Q6_K": (blocks.SIX_BITS, panels.pack_six_bits, 6.5625),
    "Q3_K": (blocks.THREE_BITS, panels.pack_three_bits, 3.5625),
}


@needs_kernel
@pytest.mark.parametrize("type_name", sorted(SIXTEEN_PANELS))
def test_six_and_three_bit_panels_give_the_byte_layout_s_bits(type_name):
    """Q6_K as six-bit and Q3_K as three-bit panels in gguf-q8 (where the build has their tiles):
    about the file's bits a weight, the same integers, so every row's bits equal the byte
    layout's, tiles and scalar reference alike, and Q8Linear's, which holds them, too."""
    kernel = load_kernel()
    format, pack_panels, bits = SIXTEEN_PANELS[type_name]
    rows, columns = 192, 1536
    decoded = blocks.decode(random_blocks(type_name, rows, columns, seed=11), type_name, rows)
    assert panels.has_six_bits(decoded)
    wq = panels.pack(decoded, vnni=True)
    packed = pack_panels(decoded)
    assert packed.shape[1] == kernel.quant_panel_bytes(format, 16, columns)
    assert packed.shape[1] * 8 / (PANEL * columns) == pytest.approx(bits)
    assert wq.shape[1] * 8 / (PANEL * columns) == 10
    bias = torch.randn(rows)
    module = quantized.Q8Linear.from_decoded(decoded, type_name, bias, kernel)
    assert (module.format == format) == kernel.q8_six_bits()
    assert module.quant_weight.shape == (packed if kernel.q8_six_bits() else wq).shape
    x = tile_activations(3)
    assert_byte_layout_bits(kernel, x, wq, packed, format, 16, bias, module)
    # the file's type decides, never the values: Q6_K rows that fit in three bits stay six-bit
    small = dataclasses.replace(decoded, q=np.clip(decoded.q, -4, 3))
    expected = blocks.SIX_BITS if type_name == "Q6_K" else blocks.THREE_BITS
    layout = quantized.Q8Linear.lay_out(small, type_name, kernel)[1]
    assert layout == (expected if kernel.q8_six_bits() else blocks.BYTES)


# 4-bit indices held as nibble panels in gguf-q8: (format, bits a weight there, in the byte layout)
NIBBLE_PANELS = {
    "IQ4_XS": (blocks.LUT_NIBBLES, 4.3125, 9),
    "IQ4_NL": (blocks.HALF_LUT_NIBBLES, 4.5, 9),
    "Q4_0": (blocks.HALF_NIBBLES, 4.5, 9),
}


def as_bytes(decoded: blocks.Decoded) -> blocks.Decoded:
    """The byte layout of the same weights: each level as an int8 and its float32 scale."""
    if decoded.format == blocks.BYTES:
        return decoded
    levels = decoded.levels[decoded.q]  # Q4_0: q - 8
    return blocks.Decoded(levels, decoded.scale, None, decoded.group, blocks.BYTES)


@needs_kernel
@pytest.mark.parametrize("type_name", sorted(NIBBLE_PANELS))
def test_nibble_panels_of_4_bit_indices_give_the_byte_layout_s_bits(type_name):
    """IQ4_XS, IQ4_NL and Q4_0 in gguf-q8 as nibble panels of indices into their 16 levels (where
    the build has their tiles): about the file's bits a weight instead of 9, the same integers, so
    every row's bits equal the byte layout's, tiles and scalar reference alike, and Q8Linear's,
    which holds them."""
    kernel = load_kernel()
    format, bits, byte_bits = NIBBLE_PANELS[type_name]
    rows, columns = 192, 1536
    raw = random_blocks(type_name, rows, columns, seed=13 + len(type_name))
    decoded = blocks.decode(raw, type_name, rows)
    assert panels.has_lut_nibbles(decoded) == (type_name == "IQ4_XS")
    assert panels.has_half_nibbles(decoded) == (type_name != "IQ4_XS")
    assert not panels.has_six_bits(decoded)
    wq = panels.pack(as_bytes(decoded), vnni=True)
    if type_name == "IQ4_XS":
        nibbles = panels.pack_lut_nibbles(decoded)
    else:
        nibbles, packed_format = panels.pack_half_nibbles(decoded)
        assert packed_format == format
    assert nibbles.shape[1] == kernel.quant_panel_bytes(format, 32, columns)
    assert nibbles.shape[1] * 8 / (PANEL * columns) == pytest.approx(bits)
    assert wq.shape[1] * 8 / (PANEL * columns) == byte_bits
    bias = torch.randn(rows)
    module = quantized.Q8Linear.from_decoded(decoded, type_name, bias, kernel)
    assert (module.format == format) == kernel.q8_lut_nibbles()
    assert_byte_layout_bits(kernel, tile_activations(4), wq, nibbles, format, 32, bias, module)


@needs_kernel
def test_q4_1_panels_hold_the_file_s_half_scales_and_offsets_with_the_same_bits():
    """Q4_1 as nibble panels with the file's float16 scales and offsets per 32 (5 bits a weight, as
    the file) gives the bits of float32 ones (6 bits a weight), in both quantized modes."""
    kernel = load_kernel()
    rows, columns = 192, 1536
    decoded = blocks.decode(random_blocks("Q4_1", rows, columns, seed=16), "Q4_1", rows)
    wider = blocks.Decoded(decoded.q, decoded.scale, decoded.offset, 32, blocks.NIBBLES)
    assert panels.packed_format(decoded) == blocks.HALF_OFFSET_NIBBLES
    assert panels.packed_format(wider) == blocks.NIBBLES
    bias = torch.randn(rows)
    x = torch.randn(13, columns, generator=torch.Generator().manual_seed(7))
    for vnni, run in ((False, kernel.quant_linear), (True, kernel.q8_linear)):
        half, full = panels.pack(decoded, vnni), panels.pack(wider, vnni)
        bits = [panels.shape[1] * 8 / (PANEL * columns) for panels in (half, full)]
        assert bits == [5, 6]
        for m in (1, 4, 13):
            args = (32, bias, False) if vnni else (32, bias)
            got = run(x[:m], half, blocks.HALF_OFFSET_NIBBLES, *args)
            assert torch.equal(got, run(x[:m], full, blocks.NIBBLES, *args)), (vnni, m)


@needs_kernel
def test_q5_0_five_bit_panels_give_the_byte_layout_s_bits():
    """Q5_0 in gguf-q8 as five-bit panels (the file's 5.5 bits a weight instead of the byte
    layout's 9, where the build has the five-bit tiles): the same integers, so every row's bits
    equal the byte layout's, tiles and scalar reference alike, and Q8Linear's, which holds them."""
    kernel = load_kernel()
    rows, columns = 192, 1536
    raw = random_blocks("Q5_0", rows, columns, seed=15)
    decoded = blocks.decode(raw, "Q5_0", rows)
    assert panels.has_half_five_bits(decoded) and decoded.q.min() == -16
    assert not (panels.has_half_nibbles(decoded) or panels.has_six_bits(decoded))
    wq = panels.pack(decoded, vnni=True)
    five, format = panels.pack_half_five_bits(decoded)
    assert format == blocks.HALF_FIVE_BITS
    assert five.shape[1] == kernel.quant_panel_bytes(blocks.HALF_FIVE_BITS, 32, columns)
    assert five.shape[1] * 8 / (PANEL * columns) == 5.5
    bias = torch.randn(rows)
    module = quantized.Q8Linear.from_decoded(decoded, "Q5_0", bias, kernel)
    assert (module.format == blocks.HALF_FIVE_BITS) == kernel.q8_five_bits()
    x = tile_activations(6)
    assert_byte_layout_bits(kernel, x, wq, five, blocks.HALF_FIVE_BITS, 32, bias, module)


def _half_five_bits(decoded: blocks.Decoded) -> torch.Tensor:
    five, format = panels.pack_half_five_bits(decoded)
    assert format == blocks.HALF_OFFSET_FIVE_BITS
    return five


# gguf-q8's panels of types read there only: (format, group, largest q, packer, bits a weight
# there, the kernel's test for their tiles)
OFFSET_PANELS = {
    "Q5_K": (blocks.FIVE_BITS, 32, 31, panels.pack_five_bits, 5.625, "q8_five_bits"),
    "Q5_1": (blocks.HALF_OFFSET_FIVE_BITS, 32, 31, _half_five_bits, 6, "q8_five_bits"),
    "Q2_K": (blocks.TWO_BITS, 16, 3, panels.pack_two_bits, 2.625, "q8_six_bits"),
}


@needs_kernel
@pytest.mark.parametrize("type_name", sorted(OFFSET_PANELS))
def test_offset_panels_compute_the_formula_on_the_file_s_exact_weights(type_name):
    """Q5_K (5.63 bits a weight, the file's 5.5), Q5_1 (6, as the file) and Q2_K (2.63, as the
    file) in gguf-q8 as panels of their own width: the decoder gives gguf's own values; the
    vector tiles give the scalar reference's bits at every tile shape, rows never depend on each
    other, and the result is the float64 product of the rounded activations and the file's
    weights; mode gguf still refuses the type."""
    kernel = load_kernel()
    format, group, top, pack_panels, bits, has_tiles = OFFSET_PANELS[type_name]
    rows, columns = 192, 1536
    raw = random_blocks(type_name, rows, columns, seed=14)
    exact = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, columns)
    decoded = blocks.decode(raw, type_name, rows, relay=True)
    assert decoded.q.max() == top and decoded.q.min() == 0
    assert np.array_equal(decoded.weights(0, rows), exact)
    assert np.array_equal(blocks.dequantize(raw, type_name, rows), exact)
    with pytest.raises(SelfSpecError, match=f"this file has {type_name}. Use --speed gguf-q8"):
        blocks.decode(raw, type_name, rows)
    five = pack_panels(decoded)
    assert five.shape[1] == kernel.quant_panel_bytes(format, group, columns)
    assert five.shape[1] * 8 / (PANEL * columns) == pytest.approx(bits)
    module = quantized.Q8Linear.from_decoded(decoded, type_name, None, kernel)
    assert (module.format == format) == getattr(kernel, has_tiles)()
    weight = torch.from_numpy(exact).double()
    bias = torch.randn(rows)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(100, columns, generator=gen) * torch.rand(100, 1, generator=gen) * 4
    x[3, 64:96] = 0  # an all-zero block
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 100):  # every tile shape, whole and cut short
        got = kernel.q8_linear(x[:m], five, format, group, bias, False)
        assert torch.equal(got, kernel.q8_linear(x[:m], five, format, group, bias, True))
        one = kernel.q8_linear(x[m - 1 : m], five, format, group, bias, False)
        assert torch.equal(got[m - 1 :], one), m
        expected = eight_bit_activations(x[:m]) @ weight.T + bias.double()
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max(), m
        assert torch.equal(module(x[:m]) + bias, got)


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K"])
def test_six_bit_panels_give_the_byte_layout_s_bits_in_the_exact_mode(type_name):
    """Q6_K and Q3_K in mode gguf as six-bit panels (where the build has their float tiles): the
    same weights rebuilt (ggml's dequantization, every one), so every product's bits are the byte
    layout's and the packed float32 weights', at every tile shape; QuantLinear holds them."""
    kernel = load_kernel()
    rows, columns = 192, 1536
    raw = random_blocks(type_name, rows, columns, seed=12)
    decoded = blocks.decode(raw, type_name, rows)
    reference = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, columns).copy()
    packed = pack_weight(torch.from_numpy(reference))
    six = panels.pack_six_bits(decoded)
    module = quantized.QuantLinear.from_decoded(decoded, type_name, None, kernel)
    assert (module.format == blocks.SIX_BITS) == kernel.quant_six_bits()
    if not kernel.quant_six_bits():
        with pytest.raises(RuntimeError, match="AVX-512"):
            kernel.quant_linear(torch.randn(1, columns), six, blocks.SIX_BITS, 16, None)
        return
    assert torch.equal(kernel.dequantize_panels(six, blocks.SIX_BITS, 16, columns), packed)
    bias = torch.randn(rows)
    x = torch.randn(KERNEL_MAX_ROWS, columns)
    x[2, :32] = 0
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 17, KERNEL_MAX_ROWS):  # every tile shape
        got = kernel.quant_linear(x[:m], six, blocks.SIX_BITS, 16, bias)
        assert torch.equal(got, kernel.packed_linear(x[:m], packed, bias)), m
        assert torch.equal(module(x[:m]) + bias, got)
        assert torch.equal(
            got[m - 1 :], kernel.quant_linear(x[m - 1 : m], six, blocks.SIX_BITS, 16, bias)
        )


def test_q8_mode_needs_vnni(monkeypatch):
    from selfspec.speed import modes as speed

    class NoVnni:
        @staticmethod
        def q8_vectorized():
            return False

    monkeypatch.setattr(speed, "load_kernel", lambda: NoVnni())
    with pytest.raises(SelfSpecError, match="needs integer dot products.*use --speed gguf"):
        speed.resolve_speed_mode("gguf-q8", "cpu", torch.float32)


@pytest.mark.parametrize("type_name", [*sorted(RELAID_BLOCKS), "F16", "BF16", "F32"])
def test_types_without_tiles_are_laid_out_as_q8_0_in_gguf_q8_only(type_name):
    """The exact values are gguf's own; gguf-q8 holds them rounded to Q8_0 (each weight within
    half a step of its block's scale, the largest at +-127); mode gguf refuses the type."""
    rows, columns = 64, 512
    raw = random_blocks(type_name, rows, columns, seed=3 + len(type_name))
    exact = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, columns)
    assert np.array_equal(blocks.dequantize(raw, type_name, rows), exact)
    decoded = blocks.decode(raw, type_name, rows, relay=True)
    assert (decoded.format, decoded.group) == (blocks.BYTES, 32)
    step = np.repeat(decoded.scale, 32, axis=1)
    assert np.all(np.abs(decoded.weights(0, rows) - exact) <= step * 0.5001)
    assert np.all(np.abs(decoded.q.reshape(rows, -1, 32)).max(-1) == 127)
    with pytest.raises(SelfSpecError, match=f"this file has {type_name}. Use --speed gguf-q8"):
        blocks.decode(raw, type_name, rows)


def test_a_type_gguf_cannot_read_is_a_clear_error():
    with pytest.raises(SelfSpecError, match="GGUF tensor type Q4_2 cannot be read"):
        blocks.decode(np.zeros((64, 40), np.uint8), "Q4_2", 64, relay=True)


@pytest.mark.slow
def test_tensor_index_agrees_with_gguf_reader(smollm2):
    from gguf import GGUFReader

    from selfspec.loading.sources import gguf_source

    path = gguf_source("smollm2-135m", smollm2.loaded.path)
    ours = gguf_reader.gguf_tensors(path)
    theirs = GGUFReader(str(path)).tensors
    assert len(ours) == len(theirs)
    for tensor in theirs:
        mine = ours[tensor.name]
        assert mine.type_name == tensor.tensor_type.name
        assert np.array_equal(
            mine.data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1)
        )


def _one_tensor_gguf(path, rows: int, columns: int):
    """A GGUF file holding one Q8_0 tensor "t" [rows, columns] of random values; its tensor."""
    from gguf import GGUFWriter, quants

    values = np.random.default_rng(0).normal(size=(rows, columns)).astype(np.float32)
    writer = GGUFWriter(str(path), "llama")
    quantized = quants.quantize(values, GGMLQuantizationType.Q8_0)
    writer.add_tensor("t", quantized, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_reader.gguf_tensors(path)["t"]


def _mapped_resident_kib(path) -> int:
    """KiB of ``path``'s mapped pages resident in this process."""
    resident, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            resident += int(line.split()[1])
    return resident


def test_gathered_rows_are_the_file_s_rows_and_leave_its_pages_unmapped(tmp_path):
    tensor = _one_tensor_gguf(tmp_path / "one.gguf", rows=32768, columns=256)  # 8.5 MiB
    rng = np.random.default_rng(1)
    for ids in ([5], [7, 7, 3], rng.integers(0, tensor.rows, 500), np.arange(tensor.rows)[::-3]):
        assert np.array_equal(tensor.gather_rows(ids), np.asarray(tensor.data[np.asarray(ids)]))
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps to read resident pages from")
    fresh = _one_tensor_gguf(tmp_path / "fresh.gguf", rows=32768, columns=256)
    fresh.gather_rows(np.arange(fresh.rows))
    assert _mapped_resident_kib(tmp_path / "fresh.gguf") < 1024  # the header's pages, no rows
    np.array(fresh.data[np.arange(fresh.rows)])  # what reading through the mapping does
    assert _mapped_resident_kib(tmp_path / "fresh.gguf") > 8 * 1024


def test_rows_past_a_truncated_file_s_end_are_a_clear_error(tmp_path):
    path = tmp_path / "cut.gguf"
    tensor = _one_tensor_gguf(path, rows=4096, columns=64)
    os.truncate(path, path.stat().st_size - 1000)
    with pytest.raises(SelfSpecError, match="truncated"):
        tensor.gather_rows([tensor.rows - 1])


@pytest.mark.slow
def test_damaged_or_foreign_gguf_file_is_a_clear_error(tmp_path, tiny_llama):
    from selfspec.loading.sources import cached_model_dir, gguf_source

    source = cached_model_dir("smollm2-135m") / "model.gguf"
    if not source.is_file():
        source = gguf_source("smollm2-135m", cached_model_dir("smollm2-135m"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    with pytest.raises(SelfSpecError, match="cannot read .*cut.gguf as a GGUF file"):
        gguf_reader.gguf_tensors(cut)
    # smollm2's file onto another llama: refused before anything is swapped
    model = tiny_llama.loaded.model
    before = [type(m) for m in model.modules()]
    for activations8 in (False, True):
        with pytest.raises(SelfSpecError, match="not the model's"):
            quantized.quantize_model(model, source, load_kernel(), activations8=activations8)
        assert [type(m) for m in model.modules()] == before
    with pytest.raises(SelfSpecError, match="did not come from one"):
        gguf_source(str(tmp_path), tmp_path)


def every_row(engine, ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of ``ids`` [n], through the engine's runner (its default path)."""
    engine.runner.reset(ids.numel() + 1)
    return engine.runner.forward(ids, 0)[0]


@pytest.fixture(scope="session")
def qwen05_gguf():
    from selfspec.engine import Engine

    if not kernel_available():
        pytest.skip("the CPU kernel cannot be built on this machine")
    return Engine.load("qwen2.5-coder-0.5b", speed="gguf")


@needs_kernel
@pytest.mark.slow
def test_gguf_mode_holds_every_weight_exactly(qwen05, qwen05_gguf):
    """Every weight of every quantized layer equals the float32 model's (the load checks a
    sample)."""
    reference = dict(qwen05.loaded.model.named_modules())
    layers = [
        (name, m)
        for name, m in qwen05_gguf.loaded.model.named_modules()
        if isinstance(m, quantized.QuantLinear)
    ]
    assert len(layers) == 7 * 24 + 1
    assert {m.type_name for _, m in layers} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for name, layer in layers:
        assert torch.equal(layer.dequantized_panels(), pack_weight(reference[name].weight)), name


@needs_kernel
@pytest.mark.slow
def test_gguf_mode_gives_packed_logits_bit_for_bit(qwen05_packed):
    """Module by module (transformers' skeleton, unfused): the quantized linear layers compute
    what the float32 panels compute, to the bit."""
    from selfspec.loading.models import load_model

    gguf = load_model("qwen2.5-coder-0.5b", speed="gguf", fused=False)
    long_prompt = " ".join(PROMPTS) * 3  # past KERNEL_MAX_ROWS tokens: the prefill path too
    for prompt in (PROMPTS[0], long_prompt):
        ids = torch.tensor([qwen05_packed.encode(prompt, chat=True)])
        with torch.inference_mode():
            assert torch.equal(gguf.model(ids).logits, qwen05_packed.loaded.model(ids).logits)


@needs_kernel
@pytest.mark.slow
def test_gguf_mode_speculation_is_lossless(qwen05_packed, qwen05_gguf):
    engine = qwen05_gguf
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        plain = engine.generate(ids, None, max_new_tokens=24)
        assert plain.token_ids == qwen05_packed.generate(ids, None, max_new_tokens=24).token_ids
        for name, plan in plans_for(engine).items():
            result = engine.generate(ids, engine.layer_skip_drafter(plan), max_new_tokens=24)
            assert result.token_ids == plain.token_ids, (
                f"plan {name} changed the output in gguf mode"
            )


@pytest.fixture(scope="session")
def qwen05_q8():
    from selfspec.engine import Engine

    if not kernel_available() or not load_kernel().q8_vectorized():
        pytest.skip("speed mode gguf-q8 needs integer dot products (AVX-512 VNNI or AVX2)")
    return Engine.load("qwen2.5-coder-0.5b", speed="gguf-q8")


@pytest.mark.slow
def test_q8_mode_is_close_to_the_float32_model_and_speculation_is_lossless(qwen05_gguf, qwen05_q8):
    engine = qwen05_q8
    ids = torch.tensor([engine.encode(" ".join(PROMPTS), chat=True)])
    exact, rounded = every_row(qwen05_gguf, ids[0]), every_row(engine, ids[0])
    # 8-bit activations change the numerics, a little: same next token at nearly every position
    assert (exact.argmax(-1) == rounded.argmax(-1)).float().mean() > 0.9
    assert not torch.equal(exact, rounded)
    # rows stand alone in this mode too: a rounding boundary makes any last-bit difference visible
    runner, start = engine.runner, ids.shape[1] - 6
    runner.reset(ids.shape[1] + 1)
    runner.forward(ids[0, :start], 0, last_logits_only=True)
    together = runner.forward(ids[0, start:], start)[0].reshape(6, -1)
    for i in range(6):
        assert torch.equal(
            together[i], runner.forward(ids[0, start + i : start + i + 1], start + i)[0].reshape(-1)
        )
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        plain = engine.generate(ids, None, max_new_tokens=24)
        assert (
            plain.to_dict()["speed_mode"] == "gguf-q8" and "8 bits" in plain.to_dict()["numerics"]
        )
        for name, plan in plans_for(engine).items():
            result = engine.generate(ids, engine.layer_skip_drafter(plan), max_new_tokens=24)
            assert result.token_ids == plain.token_ids, (
                f"plan {name} changed the output in gguf-q8 mode"
            )


def test_gguf_modes_have_their_own_default_plans():
    """Their costs differ from packed's, so each was searched separately; other modes keep
    theirs."""
    from selfspec.paths import packaged_plan
    from selfspec.runtime.plan import load_plan

    for mode in ("gguf", "gguf-q8"):
        plan = packaged_plan("qwen2.5-coder-1.5b", mode)
        assert plan.parent.name == mode and plan.is_file()
        assert load_plan(plan).provenance["speed_mode"] == mode
    assert packaged_plan("qwen2.5-coder-1.5b", "packed") == packaged_plan("qwen2.5-coder-1.5b")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["torch", "packed", "gguf", "gguf-q8"])
def test_draft_vocab_of_given_ids_reads_only_their_rows_with_the_full_head_s_bits(mode, request):
    """A draft vocabulary of given ids (the most frequent, scattered over the vocabulary), plus
    the context's: every id gets the full head's logits (bit for bit in the kernel's modes), from
    a head holding only those rows, and ``id_at`` / ``spread`` put them back where they belong."""
    from selfspec.kernels import PANEL, load_kernel
    from selfspec.runtime.draft_vocab import DraftVocab

    fixture = {"torch": "qwen05", "packed": "qwen05_packed", "gguf": "qwen05_gguf"}
    engine = request.getfixturevalue(fixture.get(mode, "qwen05_q8"))
    head, rows = engine.loaded.model.lm_head, engine.runner.head_rows
    base = torch.randperm(rows, generator=torch.Generator().manual_seed(1))[:300]
    vocab = DraftVocab(base.tolist(), rows, always=engine.eos_ids())
    context = [int(base[0]), 7, int(base[5]), 70000]
    vocab.follow(context)
    assert vocab.extra == [t for t in [*engine.eos_ids(), 7, 70000] if t not in set(base.tolist())]
    x = torch.randn(2, head.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full, part = head(x), vocab.logits(head, x)
    ids = torch.tensor(vocab.base_ids + vocab.extra)
    same = torch.equal if mode != "torch" else lambda a, b: torch.allclose(a, b, atol=1e-5)
    assert same(part, full[:, ids])
    assert [vocab.id_at(i) for i in range(len(ids))] == ids.tolist()
    spread = vocab.spread(part[0])
    assert same(spread[ids], full[0, ids]) and int(torch.isinf(spread).sum()) == rows - len(ids)
    if mode != "torch":  # the base ids' rows in a module of their own, not their panels copied
        compact = head.rows_module(base)
        group = PANEL * load_kernel().panels_per_group()
        assert compact.out_features == -(-300 // group) * group < rows


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["torch", "packed", "gguf", "gguf-q8"])
def test_draft_head_scores_context_ids_with_the_full_head_s_bits(mode, request):
    """A draft head over the first ids plus the ids the context used (and the stop tokens): those
    ids get the full head's logits (bit for bit in the kernel's modes), every other id -inf; a
    draft can then propose them, and decoding stays identical to plain decoding."""
    from selfspec.runtime.draft_vocab import DraftVocab

    fixture = {"torch": "qwen05", "packed": "qwen05_packed", "gguf": "qwen05_gguf"}
    engine = request.getfixturevalue(fixture.get(mode, "qwen05_q8"))
    head, rows = engine.loaded.model.lm_head, engine.runner.head_rows
    vocab = DraftVocab(1024, rows, always=engine.eos_ids())
    vocab.follow([5, 70000, 2000, 70000, 3000, rows - 1])
    assert vocab.extra == [*engine.eos_ids(), 70000, 2000, 3000, rows - 1]
    x = torch.randn(2, head.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full, part = head(x), vocab.logits(head, x)
    # the kernel's rows stand alone; torch's float matmul blocks a smaller product differently
    same = torch.equal if mode != "torch" else lambda a, b: torch.allclose(a, b, atol=1e-5)
    assert same(part, torch.cat([full[:, :1024], full[:, vocab.extra]], dim=1))
    spread = vocab.spread(part[0])
    scored = torch.zeros(rows, dtype=torch.bool)
    scored[:1024], scored[vocab.extra] = True, True
    assert same(spread[scored], full[0, scored]) and bool(torch.isinf(spread[~scored]).all())

    # a prefix too small for the text: the extra ids are what lets most drafts through
    ids = engine.encode(PROMPTS[0], chat=True)
    plain = engine.generate(ids, None, max_new_tokens=24)
    plan = engine.make_plan([12], [], DraftPolicy(draft_vocab=64))
    drafter = engine.layer_skip_drafter(plan)
    drafted = []
    draft = drafter.draft
    drafter.draft = lambda request: drafted.append(draft(request)) or drafted[-1]
    result = engine.generate(ids, drafter, max_new_tokens=24)
    assert result.token_ids == plain.token_ids
    assert any(t >= 64 for d in drafted for t in d.tokens)
