"""Decoded GGUF weights laid out as the kernels' 16-wide panels (kernels/linear.h): ``pack`` for
the layouts both quantized modes share, one ``pack_*`` for each layout of its own (six-, three-
and two-bit, nibbles of level indices, five-bit), and the ``has_*`` tests that say which one a
decoded type takes."""

from __future__ import annotations

import numpy as np
import torch

from selfspec.kernels import PANEL
from selfspec.speed.blocks import (
    BYTES,
    HALF_FIVE_BITS,
    HALF_LUT_NIBBLES,
    HALF_NIBBLES,
    HALF_OFFSET_FIVE_BITS,
    HALF_OFFSET_NIBBLES,
    NIBBLES,
    SUPER_NIBBLES,
    Decoded,
)


def _q_float_arrangement(decoded: Decoded) -> np.ndarray:
    """[N, groups, bytes] in mode gguf's arrangement: per k a byte (BYTES) or per 2 k a byte, k even
    low."""
    n, k = decoded.q.shape
    groups = k // decoded.group
    if decoded.format == BYTES:
        return decoded.q.view(np.uint8).reshape(n, groups, decoded.group)
    pairs = decoded.q.reshape(n, groups, decoded.group // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _q_vnni_arrangement(decoded: Decoded) -> np.ndarray:
    """[P, groups, bytes] in mode gguf-q8's arrangement: per 4 consecutive k, 16 lanes x 4 bytes
    (one VNNI operand, or two AVX2 halves). Nibbles: vector t holds k = 4t.. in its low nibbles
    and k = G/2 + 4t.. in its high ones. Bytes: q + 128 as uint8."""
    n, k = decoded.q.shape
    g, groups = decoded.group, k // decoded.group
    q = decoded.q.reshape(n, groups, g)
    if decoded.format == BYTES:
        q = q.view(np.uint8) ^ np.uint8(0x80)
    else:
        q = q[..., : g // 2] | (q[..., g // 2 :] << 4)
    q = q.reshape(n // PANEL, PANEL, groups, -1, 4)
    return np.ascontiguousarray(q.transpose(0, 2, 3, 1, 4)).reshape(n // PANEL, groups, -1)


def _lanes_last(a: np.ndarray) -> np.ndarray:
    """[N, blocks, ...] -> [N / 16, blocks, ... * 16]: the 16 rows of a panel side by side."""
    panels, blocks = a.shape[0] // PANEL, a.shape[1]
    a = a.reshape(panels, PANEL, blocks, -1)
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)).reshape(panels, blocks, -1)


def _superblocks(groups: np.ndarray, *halves: np.ndarray) -> torch.Tensor:
    """Panels of superblocks: per 256 k, each of ``halves`` (float16 [N, K // 256], its 16 lanes
    side by side), then that superblock's group records (``groups`` [P, groups, bytes])."""
    panels, supers = groups.shape[0], halves[0].shape[1]
    record = np.concatenate(
        [*(_lanes_last(h).view(np.uint8) for h in halves), groups.reshape(panels, supers, -1)],
        axis=2,
    )
    return torch.from_numpy(record.reshape(panels, -1))


def has_six_bits(decoded: Decoded) -> bool:
    """Whether ``decoded`` is Q6_K or Q3_K, which ``pack_six_bits`` lays out (Q3_K's q + 32 in
    [28, 35]: 6.56 bits a weight where the byte layout takes 10)."""
    return decoded.format == BYTES and decoded.group == 16 and decoded.factors is not None


def _sixteen_steps(decoded: Decoded, bias: int) -> np.ndarray:
    """u = q + ``bias`` as uint8 [P, groups, step, lane * 4 + k % 4]: per group of 16 k, 4 steps
    of 16 lanes x 4 k."""
    panels, k = decoded.q.shape[0] // PANEL, decoded.q.shape[1]
    u = (decoded.q.astype(np.int16) + bias).astype(np.uint8).reshape(panels, PANEL, k // 16, 4, 4)
    return u.transpose(0, 2, 3, 1, 4).reshape(panels, k // 16, 4, 64)


def _scaled_superblocks(decoded: Decoded, *payload: np.ndarray) -> torch.Tensor:
    """Per 256 k, d; per group of 16 k, sc and ``payload`` ([P, groups, bytes] each)."""
    d, sc = decoded.factors
    panels, groups = payload[0].shape[:2]
    payload = [p.reshape(panels, groups, -1) for p in payload]
    return _superblocks(np.concatenate([_lanes_last(sc).view(np.uint8), *payload], axis=2), d)


def _bit_pairs(u: np.ndarray) -> np.ndarray:
    """u [P, groups, step, 64] -> its low two bits, step t in bits 2t..2t+1 of each byte."""
    return sum((u[:, :, t] & 3) << (2 * t) for t in range(4)).astype(np.uint8)


def pack_six_bits(decoded: Decoded) -> torch.Tensor:
    """Q6_K (or Q3_K) in the kernel's SIX_BITS layout (kernels/linear.h, SixBitLayout): per 256
    k, d; per group of 16 k, sc, the low nibbles of u = q + 32 (two steps a byte) and its high
    bit pairs (four steps a byte), each step 16 lanes x 4 k."""
    u = _sixteen_steps(decoded, 32)
    low = (u[:, :, 0::2] & 15) | ((u[:, :, 1::2] & 15) << 4)
    return _scaled_superblocks(decoded, low, _bit_pairs(u >> 4))


def pack_three_bits(decoded: Decoded) -> torch.Tensor:
    """Q3_K in the kernel's THREE_BITS layout (kernels/linear.h, ThreeBitLayout): per 256 k, d;
    per group of 16 k, sc, the low bit pairs of u = q + 4 (step t in bits 2t..2t+1) and its high
    bits (step t's bytes b < 32 in bit t of byte b, the rest in bit 4 + t of byte b - 32)."""
    u = _sixteen_steps(decoded, 4)
    high = (u >> 2) & 1  # [P, group, step, 64]
    shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high[..., :32] << shifts) | (high[..., 32:] << (shifts + 4))
    high = high.sum(axis=2, dtype=np.uint8)  # the bits do not overlap
    return _scaled_superblocks(decoded, _bit_pairs(u), high)


def pack_two_bits(decoded: Decoded) -> torch.Tensor:
    """Q2_K in the kernel's TWO_BITS layout (kernels/linear.h, TwoBitLayout): per 256 k, d and
    dmin; per group of 16 k, the file's scale byte (sc | m << 4) and the bit pairs of q (step t in
    bits 2t..2t+1)."""
    d, dmin, sc, m = decoded.factors
    pairs = _bit_pairs(_sixteen_steps(decoded, 0))
    panels, groups = pairs.shape[:2]
    scm = _lanes_last((sc | (m << 4)).astype(np.uint8))
    return _superblocks(np.concatenate([scm, pairs.reshape(panels, groups, -1)], axis=2), d, dmin)


def has_lut_nibbles(decoded: Decoded) -> bool:
    """Whether ``decoded`` is IQ4_XS, which ``pack_lut_nibbles`` lays out."""
    return decoded.levels is not None and len(decoded.factors) == 2


def has_half_nibbles(decoded: Decoded) -> bool:
    """Whether ``decoded`` is Q4_0 or IQ4_NL, which ``pack_half_nibbles`` lays out."""
    return decoded.levels is not None and len(decoded.factors) == 1


def _nibble_indices(decoded: Decoded) -> np.ndarray:
    """Each weight's 4-bit index into ``decoded.levels``, in gguf-q8's nibble arrangement."""
    if decoded.format == NIBBLES:  # Q4_0: q is the index
        index = decoded.q
    else:
        inverse = np.zeros(256, np.uint8)  # level (as its byte) -> its index: a byte a weight
        inverse[decoded.levels.view(np.uint8)] = np.arange(len(decoded.levels), dtype=np.uint8)
        index = inverse[decoded.q.view(np.uint8)]
    return _q_vnni_arrangement(Decoded(index, None, None, 32, NIBBLES))


def pack_lut_nibbles(decoded: Decoded) -> torch.Tensor:
    """IQ4_XS in the kernel's LUT_NIBBLES layout (kernels/linear.h, LutLayout): per 256 k, d; per
    group of 32 k, sc and each level's 4-bit index in gguf-q8's nibble arrangement."""
    d, sc = decoded.factors
    groups = np.concatenate([_lanes_last(sc).view(np.uint8), _nibble_indices(decoded)], axis=2)
    return _superblocks(groups, d)


def pack_half_nibbles(decoded: Decoded) -> tuple[torch.Tensor, int]:
    """Q4_0 or IQ4_NL in the kernel's HalfLutLayout (kernels/linear.h): per group of 32 k, d and
    each weight's 4-bit index in gguf-q8's nibble arrangement; and its format (HALF_NIBBLES or
    HALF_LUT_NIBBLES, which say which levels the indices pick)."""
    (d,) = decoded.factors
    groups = np.concatenate([_lanes_last(d).view(np.uint8), _nibble_indices(decoded)], axis=2)
    format = HALF_NIBBLES if decoded.format == NIBBLES else HALF_LUT_NIBBLES
    return torch.from_numpy(groups.reshape(groups.shape[0], -1)), format


def _five_bit_groups(u: np.ndarray) -> np.ndarray:
    """u [N, K] in [0, 31] -> [P, K // 32, 320]: each group's low nibbles in gguf-q8's nibble
    arrangement and its high bits (bit t of byte b: that of byte b's low nibble in vector t; bit
    4 + t: its high one's), kernels/linear.h's FiveBitGroup."""
    panels, groups = u.shape[0] // PANEL, u.shape[1] // 32
    low = _q_vnni_arrangement(Decoded(u & 15, None, None, 32, NIBBLES))
    high = (u >> 4).reshape(panels, PANEL, groups, 2, 4, 4)  # lane, group, half, t, k % 4
    high = high.transpose(0, 2, 1, 5, 3, 4)  # [P, group, lane, k % 4, half, t]
    shifts = (np.arange(4, dtype=np.uint8) + np.array([[0], [4]], np.uint8)).astype(np.uint8)
    high = (high << shifts).sum(axis=(4, 5), dtype=np.uint8).reshape(panels, groups, 64)
    return np.concatenate([low, high], axis=2)


def pack_five_bits(decoded: Decoded) -> torch.Tensor:
    """Q5_K in the kernel's FIVE_BITS layout (kernels/linear.h, FiveBitLayout): per 256 k, d and
    dmin; per group of 32 k, sc, m and its five-bit integers."""
    d, dmin, sc, m = decoded.factors
    payload = _five_bit_groups(decoded.q)
    groups_record = np.concatenate([_lanes_last(sc), _lanes_last(m), payload], axis=2)
    return _superblocks(groups_record, d, dmin)


def has_half_five_bits(decoded: Decoded) -> bool:
    """Whether ``decoded`` is Q5_0 or Q5_1, which ``pack_half_five_bits`` lays out."""
    if decoded.format == HALF_OFFSET_FIVE_BITS:
        return True
    return decoded.levels is None and decoded.factors is not None and len(decoded.factors) == 1


def pack_half_five_bits(decoded: Decoded) -> tuple[torch.Tensor, int]:
    """Q5_0 or Q5_1 in the kernel's layout (kernels/linear.h: HalfFiveBitLayout, per group of 32
    k, d and the five-bit integers u = q + 16; HalfOffsetFiveBitLayout, d, m and u = q); and its
    format (HALF_FIVE_BITS or HALF_OFFSET_FIVE_BITS)."""
    if decoded.format == HALF_OFFSET_FIVE_BITS:
        u, format = decoded.q, HALF_OFFSET_FIVE_BITS
    else:
        u, format = (decoded.q.astype(np.int16) + 16).astype(np.uint8), HALF_FIVE_BITS
    halves = [_lanes_last(f).view(np.uint8) for f in decoded.factors]
    groups = np.concatenate([*halves, _five_bit_groups(u)], axis=2)
    return torch.from_numpy(groups.reshape(groups.shape[0], -1)), format


def has_half_offsets(decoded: Decoded) -> bool:
    """Whether ``decoded`` is Q4_1, which ``pack`` lays out with its float16 scales and offsets
    (HALF_OFFSET_NIBBLES)."""
    return decoded.format == NIBBLES and decoded.factors is not None and len(decoded.factors) == 2


def packed_format(decoded: Decoded) -> int:
    """The kernel format ``pack`` lays ``decoded`` out in."""
    return HALF_OFFSET_NIBBLES if has_half_offsets(decoded) else decoded.format


def pack(decoded: Decoded, vnni: bool = False) -> torch.Tensor:
    """[N, K] -> [N / 16, bytes per panel] uint8, the kernel's panel layout (``vnni``: mode
    gguf-q8's arrangement of each group's integers; headers and sizes are the same)."""
    panels = decoded.q.shape[0] // PANEL
    q = _q_vnni_arrangement(decoded) if vnni else _lanes_last(_q_float_arrangement(decoded))
    if decoded.format == SUPER_NIBBLES:  # per 256 k: d, dmin; per group: sc, m, q
        d, dmin, sc, m = decoded.factors
        return _superblocks(np.concatenate([_lanes_last(sc), _lanes_last(m), q], axis=2), d, dmin)
    if has_half_offsets(decoded):  # per group: half d, half m, q
        halves = [_lanes_last(f).view(np.uint8) for f in decoded.factors]
        return torch.from_numpy(np.concatenate([*halves, q], axis=2).reshape(panels, -1))
    header = [_lanes_last(decoded.scale).view(np.uint8)]
    if decoded.format == NIBBLES:
        header.append(_lanes_last(decoded.offset).view(np.uint8))
    record = np.concatenate([*header, q], axis=2)
    return torch.from_numpy(record.reshape(panels, -1))
