"""GGUF weight blocks decoded into the integer formats of selfspec's quantized kernels.

Each GGUF type is decoded to ``Decoded``: small integers and a float32 scale (and offset) per 16
or 32 weights, whose products are exactly the float32 values ggml dequantizes the block to (one
rounding, ggml's formula). Types read exactly: Q4_K, Q4_1, Q4_0, Q6_K, Q3_K, Q8_0, Q5_0, IQ4_NL and
IQ4_XS (IQ4's 16 non-uniform levels are small integers themselves); Q5_K, Q5_1 and Q2_K in speed
mode gguf-q8, which has their tiles. Every other type ``gguf`` can dequantize (F16, BF16, F32, the
IQ2 and IQ3 types, ...) has no kernel tiles; speed mode gguf-q8 lays it out once as Q8_0 (8 bits
per weight and a scale per 32, as ggml rounds them), and speed mode gguf, which promises the
float32 model's own weights, refuses it with a one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from selfspec.errors import SelfSpecError

# kernel formats (kernels/linear.h); those from SIX_BITS on in mode gguf-q8 only
NIBBLES, BYTES, SUPER_NIBBLES, SIX_BITS, LUT_NIBBLES, FIVE_BITS = 0, 1, 2, 3, 4, 5
HALF_NIBBLES, HALF_LUT_NIBBLES = 6, 7  # Q4_0's and IQ4_NL's indices and float16 scales
HALF_FIVE_BITS = 8  # Q5_0's five bits and float16 scales
HALF_OFFSET_NIBBLES = 9  # Q4_1's nibbles, float16 scales and offsets
HALF_OFFSET_FIVE_BITS = 10  # Q5_1's five bits (q in [0, 31]), float16 scales and offsets
THREE_BITS = 11  # Q3_K's three bits (u = q + 4) with Q6_K's six-bit panels' scales
TWO_BITS = 12  # Q2_K's two bits, with the file's d, dmin (per 256) and 4-bit sc, m (per 16)
RELAID = " as Q8_0"  # a layer's type name ends so when gguf-q8 laid it out as Q8_0


@dataclass
class Decoded:
    """One weight matrix [N, K] as w[n, k] = scale[n, k // G] * q[n, k] + offset[n, k // G].

    SUPER_NIBBLES (Q4_K), FIVE_BITS (Q5_K: q in [0, 31]) and TWO_BITS (Q2_K: q in [0, 3], G = 16)
    keep the file's factors instead of their float32 products:
    scale = d[n, k // 256] * sc[n, k // G], offset = -(dmin[n, k // 256] * m[n, k // G]).
    Q6_K and Q3_K (BYTES, G = 16) and IQ4_XS (BYTES, G = 32) keep them beside their scales: d
    [N, K // 256] float16, sc int8. Q4_0, IQ4_NL and Q5_0 keep their float16 d [N, K // 32] as
    their one factor, Q4_1 and Q5_1 their float16 d and m."""

    q: np.ndarray  # [N, K] uint8 in [0, 15] (NIBBLES, SUPER_NIBBLES) or int8 (BYTES)
    scale: np.ndarray | None  # [N, K // G] float32 (NIBBLES, BYTES)
    offset: np.ndarray | None  # [N, K // G] float32 (NIBBLES)
    group: int
    format: int
    factors: tuple | None = (
        None  # SUPER_NIBBLES: d, dmin [N, K // 256] float16; sc, m [N, K // G] uint8; Q6_K: d, sc
    )
    # IQ4_XS, IQ4_NL, Q4_0: the 16 values a 4-bit index picks (Q4_0: q is the index, level q - 8)
    levels: np.ndarray | None = None

    def weights(self, first: int, last: int) -> np.ndarray:
        """Rows [first, last) as the float32 values the file dequantizes to: scale * q is exact in
        float32, so adding the offset rounds once, like ggml's formula."""
        q = self.q[first:last].astype(np.float32)
        rows, k = q.shape
        if self.format in (SUPER_NIBBLES, FIVE_BITS, TWO_BITS):
            d, dmin, sc, m = (f[first:last].astype(np.float32) for f in self.factors)
            scale = np.repeat(d, 256 // self.group, axis=1) * sc
            offset = -(np.repeat(dmin, 256 // self.group, axis=1) * m)
        else:
            scale = self.scale[first:last]
            offset = self.offset[first:last] if self.offset is not None else None
        w = np.repeat(scale, self.group, axis=1) * q
        return w + np.repeat(offset, self.group, axis=1) if offset is not None else w


def _half(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16)


def _f16(column: np.ndarray) -> np.ndarray:
    return _half(column).astype(np.float32)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(-1, block_bytes)


# ggml's kvalues_iq4nl: the 16 levels an IQ4 nibble selects, times the block's scale
IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)
Q4_LEVELS = np.arange(-8, 8, dtype=np.int8)  # Q4_0's q - 8
_NIBBLE_SHIFTS = np.array([0, 4], np.uint8).reshape(1, 2, 1)
_PAIR_SHIFTS = np.array([0, 2, 4, 6], np.uint8)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32]: low nibbles are values 0-15, high ones 16-31."""
    return ((packed.reshape(-1, 1, 16) >> _NIBBLE_SHIFTS) & 15).reshape(-1, 32)


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes per 256 weights -> 8 six-bit scales and 8 six-bit mins."""
    lo, mid, hi = (packed.reshape(-1, 3, 4)[:, i] for i in range(3))
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 2) & 48)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], axis=1)
    return sc, mins


def _super_factors(b: np.ndarray, rows: int) -> tuple:
    """d, dmin (float16, per 256) and sc, m (uint8, per 32) of Q4_K or Q5_K blocks ``b``."""
    d, dmin = (np.ascontiguousarray(b[:, i : i + 2]).view(np.float16) for i in (0, 2))
    sc, mins = _scales_and_mins(b[:, 4:16])
    return tuple(f.reshape(rows, -1) for f in (d, dmin, sc, mins))


def _chunk_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] bytes -> [blocks, 256]: sub-block 2c from the low nibbles of chunk c (32
    bytes), 2c + 1 from its high ones."""
    return ((qs.reshape(-1, 4, 1, 32) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)) & 15).reshape(-1, 256)


def _q4_k(raw, rows):
    b = _blocks(raw, 144)  # d f16, dmin f16, 12 bytes of 6-bit scales and mins, 128 of nibbles
    q = _chunk_nibbles(b[:, 16:]).reshape(rows, -1)
    return Decoded(q, None, None, 32, SUPER_NIBBLES, _super_factors(b, rows))


def _q5_k(raw, rows):
    b = _blocks(raw, 176)  # Q4_K's fields, with 32 bytes of high bits (bit s: sub-block s) first
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (_chunk_nibbles(b[:, 48:]) | (high.reshape(-1, 256) << 4)).reshape(rows, -1)
    return Decoded(q, None, None, 32, FIVE_BITS, _super_factors(b, rows))


def _q4_1(raw, rows):
    b = _blocks(raw, 20)  # d f16, m f16, 16 bytes of nibbles (low: values 0-15, high: 16-31)
    d, m = _half(b[:, 0:2]).reshape(rows, -1), _half(b[:, 2:4]).reshape(rows, -1)
    q = _nibbles(b[:, 4:]).reshape(rows, -1)
    # the float16 d and m kept for the panels (HALF_OFFSET_NIBBLES: the file's 5 bits a weight)
    return Decoded(q, d.astype(np.float32), m.astype(np.float32), 32, NIBBLES, (d, m))


def _q6_k(raw, rows):
    b = _blocks(raw, 210)  # 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d f16
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (
        b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    ) & 3
    q = (ql.reshape(-1, 256) | (qh.reshape(-1, 256) << 4)).astype(np.int8) - np.int8(32)
    d, sc = np.ascontiguousarray(b[:, 208:210]).view(np.float16), b[:, 192:208].view(np.int8)
    scale = d.astype(np.float32) * sc.astype(np.float32)
    factors = (d.reshape(rows, -1), np.ascontiguousarray(sc).reshape(rows, -1))
    return Decoded(q.reshape(rows, -1), scale.reshape(rows, -1), None, 16, BYTES, factors)


def _q8_0(raw, rows):
    b = _blocks(raw, 34)  # d f16, 32 int8
    return Decoded(
        b[:, 2:].view(np.int8).reshape(rows, -1), _f16(b[:, 0:2]).reshape(rows, -1), None, 32, BYTES
    )


def _five_bits(high_bits: np.ndarray, low_nibbles: np.ndarray) -> np.ndarray:
    """Q5_0's and Q5_1's 4 bytes of high bits (a little-endian uint32, bit j: weight j) and 16 bytes
    of low nibbles -> [blocks, 32] uint8 in [0, 31]."""
    shifts = np.arange(32, dtype=np.uint32)
    high = (np.ascontiguousarray(high_bits).view("<u4") >> shifts) & 1
    return _nibbles(low_nibbles) | (high.astype(np.uint8) << 4)


def _q5_0(raw, rows):
    b = _blocks(raw, 22)  # d f16, 32 high bits (uint32), 16 bytes of low nibbles
    q = _five_bits(b[:, 2:6], b[:, 6:]).astype(np.int8) - np.int8(16)
    half = _half(b[:, 0:2]).reshape(rows, -1)  # kept for gguf-q8's five-bit panels
    return Decoded(q.reshape(rows, -1), half.astype(np.float32), None, 32, BYTES, (half,))


def _q5_1(raw, rows):
    b = _blocks(raw, 24)  # d f16, m f16, 32 high bits (uint32), 16 bytes of low nibbles
    q = _five_bits(b[:, 4:8], b[:, 8:]).reshape(rows, -1)
    d, m = _half(b[:, 0:2]).reshape(rows, -1), _half(b[:, 2:4]).reshape(rows, -1)
    scale, offset = d.astype(np.float32), m.astype(np.float32)  # w = d * q + m, one rounding
    return Decoded(q, scale, offset, 32, HALF_OFFSET_FIVE_BITS, (d, m))


def _q4_0(raw, rows):
    b = _blocks(raw, 18)  # d f16, 16 bytes of nibbles; w = d * (q - 8), exact as d * q - 8 d
    half = _half(b[:, 0:2]).reshape(rows, -1)  # kept for gguf-q8's nibble panels
    d = half.astype(np.float32)
    q = _nibbles(b[:, 2:]).reshape(rows, -1)
    return Decoded(q, d, -8 * d, 32, NIBBLES, (half,), Q4_LEVELS)


def _bit_pairs(packed: np.ndarray) -> np.ndarray:
    """Q3_K's and Q2_K's 64 bytes of 2-bit values per 256 weights -> [blocks, 256]: weight
    128 h + 32 j + l is bits 2j..2j+1 of byte 32 h + l."""
    return ((packed.reshape(-1, 2, 1, 32) >> _PAIR_SHIFTS.reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)


def _q3_k(raw, rows):
    b = _blocks(raw, 110)  # 32 bytes of high bits, 64 of 2-bit pairs, 12 of 6-bit scales, d f16
    low = _bit_pairs(b[:, 32:96])
    high = (b[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low.reshape(-1, 256).astype(np.int8) - ((high.reshape(-1, 256) ^ 1) << 2).astype(np.int8)
    scales = b[:, 96:108]
    sc_low = (scales[:, :8].reshape(-1, 1, 8) >> _NIBBLE_SHIFTS.reshape(1, 2, 1)) & 15
    sc_high = (scales[:, 8:].reshape(-1, 1, 4) >> _PAIR_SHIFTS.reshape(1, 4, 1)) & 3
    sc = (sc_low.reshape(-1, 16) | (sc_high.reshape(-1, 16) << 4)).astype(np.int8) - np.int8(32)
    d = _half(b[:, 108:110])
    scale = d.astype(np.float32) * sc.astype(np.float32)  # d * sc: exact in float32
    # d and sc kept for gguf-q8's three-bit panels (u = q + 4), or Q6_K's six-bit ones (q + 32)
    factors = (d.reshape(rows, -1), np.ascontiguousarray(sc).reshape(rows, -1))
    return Decoded(q.reshape(rows, -1), scale.reshape(rows, -1), None, 16, BYTES, factors)


def _q2_k(raw, rows):
    b = _blocks(raw, 84)  # 16 bytes of 4-bit sc (low) and m (high), 64 of 2-bit pairs, d, dmin f16
    q = _bit_pairs(b[:, 16:80])
    d, dmin = _half(b[:, 80:82]), _half(b[:, 82:84])
    factors = tuple(f.reshape(rows, -1) for f in (d, dmin, b[:, :16] & 15, b[:, :16] >> 4))
    return Decoded(q.reshape(rows, -1), None, None, 16, TWO_BITS, factors)


def _iq4_nl(raw, rows):
    b = _blocks(raw, 18)  # d f16, 16 bytes of nibbles selecting IQ4_LEVELS
    q = IQ4_LEVELS[_nibbles(b[:, 2:])].reshape(rows, -1)
    half = _half(b[:, 0:2]).reshape(rows, -1)  # kept for gguf-q8's nibble panels
    return Decoded(q, half.astype(np.float32), None, 32, BYTES, (half,), IQ4_LEVELS)


def _iq4_xs(raw, rows):
    b = _blocks(raw, 136)  # d f16, 2 + 4 bytes of 6-bit scales (high pairs, low nibbles), 8 x 16
    high = (np.ascontiguousarray(b[:, 2:4]).view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = ((b[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], np.uint8)) & 15).reshape(-1, 8)
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    d = _half(b[:, 0:2])
    scale = d.astype(np.float32) * sc.astype(np.float32)  # per 32 weights, d * sc: exact in float32
    q = IQ4_LEVELS[_nibbles(b[:, 8:].reshape(-1, 16))]
    factors = (d.reshape(rows, -1), sc.reshape(rows, -1))  # for gguf-q8's nibble panels
    scale = scale.reshape(rows, -1)
    return Decoded(q.reshape(rows, -1), scale, None, 32, BYTES, factors, IQ4_LEVELS)


# Types mode gguf-q8 holds as they are where the build has their tiles (kernels/q8five.h,
# kernels/q8six.h); mode gguf (exact) has no tiles for them.
Q8_DECODERS = {"Q5_K": _q5_k, "Q5_1": _q5_1, "Q2_K": _q2_k}
DECODERS = {
    "Q4_K": _q4_k,
    "Q4_1": _q4_1,
    "Q4_0": _q4_0,
    "Q6_K": _q6_k,
    "Q3_K": _q3_k,
    "Q8_0": _q8_0,
    "Q5_0": _q5_0,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}


def round_q8_0(weight: np.ndarray) -> Decoded:
    """``weight`` [N, K] float32 rounded as ggml's Q8_0 rounds it (per 32 inputs, a scale of their
    largest magnitude / 127 and integers in [-127, 127], halves away from zero; the scale kept in
    float32, where a file keeps float16)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // 32, 32)
    scale = (np.abs(blocks).max(-1) / 127).astype(np.float32)
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    scaled = blocks * inverse[..., None]
    q = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127).astype(np.int8)
    return Decoded(q.reshape(n, k), scale, None, 32, BYTES)


def dequantize(raw: np.ndarray, type_name: str, rows: int) -> np.ndarray:
    """Rows of any type ``gguf`` reads as float32 [rows, K]: the values ggml dequantizes them to."""
    decoder = DECODERS.get(type_name) or Q8_DECODERS.get(type_name)
    if decoder is not None:
        return decoder(raw, rows).weights(0, rows).astype(np.float32, copy=False)
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    kind = GGMLQuantizationType.__members__.get(type_name)
    try:
        if kind is None:
            raise NotImplementedError(type_name)
        return np.asarray(gguf_dequantize(raw, kind), np.float32).reshape(rows, -1)
    except NotImplementedError as exc:
        raise SelfSpecError(
            f"GGUF tensor type {type_name} cannot be read (gguf {_gguf_version()} does not "
            "dequantize it); convert the file to another type, such as Q4_K_M or Q8_0."
        ) from exc


def read_problem(tensor) -> str | None:
    """Why ``tensor`` (a GGUFTensor) cannot be read, tried on its first row; None if it can."""
    try:
        dequantize(tensor.read_rows(0, 1), tensor.type_name, 1)
    except SelfSpecError as exc:
        return str(exc)
    return None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def decode(raw: np.ndarray, type_name: str, rows: int, relay: bool = False) -> Decoded:
    """``rows`` rows of ``type_name`` blocks in a kernel format: exactly (``relay``: mode gguf-q8,
    ``Q8_DECODERS`` too), or (``relay``, for types without kernel tiles) rounded to Q8_0 from
    their exact float32 values."""
    decoder = DECODERS.get(type_name) or (Q8_DECODERS.get(type_name) if relay else None)
    if decoder is not None:
        return decoder(raw, rows)
    if not relay:
        raise SelfSpecError(
            f"speed mode gguf reads {', '.join(DECODERS)} weights exactly; this file has "
            f"{type_name}. Use --speed gguf-q8 (which reads it, at 8-bit activations) or --speed "
            "packed."
        )
    weight = dequantize(raw, type_name, rows)
    if weight.shape[1] % 32:
        raise SelfSpecError(
            f"a {type_name} weight with {weight.shape[1]} inputs cannot be laid out as Q8_0 (32 "
            "inputs a block). Use --speed packed."
        )
    return round_q8_0(weight)
