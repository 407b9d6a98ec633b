// y = x @ W^T (+ bias) for few rows of x, with W stored in 16-wide column panels.
//
// Decoding is memory-bound: every weight is read once per forward pass. A verify pass
// scores a handful of rows, and BLAS libraries tuned for big matrices handle such skinny
// products poorly. Here each weight panel is streamed once per k-block while it serves every
// row, so a pass over a few rows costs about what one row costs.
//
// Packed layout: wp[p, k, j] = W[16 * p + j, k]   shape [N / 16, K, 16].
// Each output is summed over k in increasing order, whatever the number of rows and
// however the work is split across threads, so row m of the result does not depend on the
// other rows: a verify pass gives bit for bit the logits a one-token pass gives.
//
// The quantized tiles do the same with the weights kept as a GGUF file's small integers (speed
// mode "gguf"): each weight is rebuilt in registers, just before use, as the exact float32
// value the file dequantizes to, then summed in the same order as the float tiles. Same
// weights, same order, same results, bit for bit, from a fifth to a third of the bytes.
#pragma once

#include "ops.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "simd.h"

namespace selfspec {

constexpr int kPanel = 16;    // outputs per panel
constexpr int kGroup = 4;     // panels per unit of parallel work (and panel-count granularity)
constexpr int kBlockK = 512;  // k-block: a group's weights for one block stay in L2
#ifndef SELFSPEC_PREFETCH
#define SELFSPEC_PREFETCH 32
#endif
constexpr int kPrefetch = SELFSPEC_PREFETCH;  // k-steps (64 bytes each per panel) to prefetch ahead

constexpr int kVecPerPanel = kPanel / kVec;

// fn(u) for every unit u in [0, n) on the pool's threads. Each thread first takes its own
// contiguous share from the front (one stream through memory), then what is left at the back of
// the others' shares, so no thread waits long at the end for one that got less memory bandwidth
// or more expensive units.
template <typename F>
void balanced_for(int64_t n, const F& fn) {
  TORCH_CHECK(n < (int64_t{1} << 32), "too many units of work: ", n);  // shares pack two 32-bit indices
  const int64_t T = std::min<int64_t>(at::get_num_threads(), n);
  if (T <= 1 || at::in_parallel_region()) {
    for (int64_t u = 0; u < n; ++u) fn(u);
    return;
  }
  // per share: the next unit from the front (high 32 bits) and the end of what is left (low 32)
  std::vector<std::atomic<uint64_t>> shares(T);
  for (int64_t t = 0; t < T; ++t)
    shares[t].store(static_cast<uint64_t>(t * n / T) << 32 | static_cast<uint64_t>((t + 1) * n / T));
  auto take = [](std::atomic<uint64_t>& share, bool front) -> int64_t {
    uint64_t cur = share.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = cur >> 32, b = cur & 0xffffffffu;
      if (f >= b) return -1;
      const uint64_t next = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
      if (share.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return static_cast<int64_t>(front ? f : b - 1);
    }
  };
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t u; (u = take(shares[t], true)) >= 0;) fn(u);
      for (int64_t k = 1; k < T; ++k)
        for (int64_t u; (u = take(shares[(t + k) % T], false)) >= 0;) fn(u);
    }
  });
}

// Blocked summation: each k-block's partial sum is added to the total, in k order.
template <int ROWS, int V>
__attribute__((always_inline)) inline void store_tile(vec (&acc)[ROWS][V], int64_t p0, float* y, int64_t N, const float* bias, bool first,
                       bool last) {
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) {
      float* out = y + r * N + p0 * kPanel + v * kVec;
      vec total = first ? acc[r][v] : vadd(vload(out), acc[r][v]);
      if (last && bias) total = vadd(total, vload(bias + p0 * kPanel + v * kVec));
      vstore(out, total);
    }
}

// Rows [0, ROWS) of x times panels [p0, p0 + PANELS) over k in [k0, k1), into y.
// All rows share each weight load, so the weights stream from memory once per tile.
template <int ROWS, int PANELS>
void tile(const float* x, int64_t K, const float* wp, int64_t p0, int64_t k0, int64_t k1,
          float* y, int64_t N, const float* bias, bool first, bool last) {
  constexpr int V = PANELS * kVecPerPanel;
  vec acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    vec w[V];
    // Ask for weights a few hundred bytes ahead: when many rows make the loop compute-bound,
    // the hardware prefetcher alone lets the memory bus idle.
    for (int g = 0; g < PANELS; ++g)
      _mm_prefetch(reinterpret_cast<const char*>(wp + ((p0 + g) * K + k + kPrefetch) * kPanel), _MM_HINT_T0);
    for (int g = 0; g < PANELS; ++g)
      for (int v = 0; v < kVecPerPanel; ++v)
        w[g * kVecPerPanel + v] = vload(wp + ((p0 + g) * K + k) * kPanel + v * kVec);
    for (int r = 0; r < ROWS; ++r) {
      vec xb = vset1(x[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(xb, w[v], acc[r][v]);
    }
  }
  store_tile<ROWS, V>(acc, p0, y, N, bias, first, last);
}

// Quantized panels: each panel's weights as groups of G consecutive k (G = 16 or 32), each
// group with its own scale (and offset) per lane:
//   kNibbles (G = 32; Q4_0 in mode gguf): per group float scale[16], float offset[16], uint8
//       q[16][16].
//   kHalfOffsetNibbles (G = 32; Q4_1): per group half d[16], half m[16], uint8 q[16][16]: the
//       file's 5 bits a weight; scale = d and offset = m, the float32 values of the halves.
//   kBytes (G = 16 or 32; Q6_K, Q8_0, Q5_0): per group float scale[16], int8 q[G][16].
//   kSuperNibbles (G = 32; Q4_K): per 256 k, half d[16], half dmin[16], then 8 groups of
//       uint8 sc[16], uint8 m[16], uint8 q[16][16]; scale = d * sc, offset = -(dmin * m),
//       float32 products as ggml computes them (a quarter fewer bytes than float scales).
// In nibble formats byte j of q[t] holds lane j's integer for k = 2t (low nibble) and k = 2t + 1.
// w = scale * q + offset: scale * q is exact in float32 (scale has at most 18 significant bits,
// q at most 8), so the fused multiply-add rounds once, like ggml's dequantization does: w is
// the float32 weight of the dequantized model, exactly.
constexpr int kNibbles = 0;
constexpr int kBytes = 1;
constexpr int kSuperNibbles = 2;
constexpr int kSixBits = 3;  // mode gguf-q8 only: see SixBitLayout
constexpr int kLutNibbles = 4;  // mode gguf-q8 only: see LutLayout
constexpr int kFiveBits = 5;    // mode gguf-q8 only: see FiveBitLayout
constexpr int kHalfNibbles = 6;     // mode gguf-q8 only: see HalfLutLayout (Q4_0)
constexpr int kHalfLutNibbles = 7;  // mode gguf-q8 only: see HalfLutLayout (IQ4_NL)
constexpr int kHalfFiveBits = 8;    // mode gguf-q8 only: see HalfFiveBitLayout (Q5_0)
constexpr int kHalfOffsetNibbles = 9;   // both quantized modes: see Layout (Q4_1)
constexpr int kHalfOffsetFiveBits = 10;  // mode gguf-q8 only: see HalfOffsetFiveBitLayout (Q5_1)
constexpr int kThreeBits = 11;           // mode gguf-q8 only: see ThreeBitLayout (Q3_K)
constexpr int kTwoBits = 12;             // mode gguf-q8 only: see TwoBitLayout (Q2_K)

// Formats mode gguf-q8 alone holds (their own tiles, no float tiles)
constexpr bool q8_only_format(int64_t format) {
  return format == kLutNibbles || format == kFiveBits || format == kHalfNibbles || format == kHalfLutNibbles ||
         format == kHalfFiveBits || format == kHalfOffsetFiveBits || format == kThreeBits || format == kTwoBits;
}

#ifndef SELFSPEC_QPREFETCH
#define SELFSPEC_QPREFETCH 4096
#endif
constexpr int kQuantPrefetch = SELFSPEC_QPREFETCH;  // bytes ahead in each panel's stream

// rec, asking for its record's BYTES bytes kQuantPrefetch ahead in its panel's stream: with many
// rows the loop is compute-bound, and the hardware prefetcher alone lets the memory bus idle.
template <int64_t BYTES>
inline const uint8_t* prefetching(const uint8_t* rec) {
  for (int64_t line = 0; line < BYTES; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec + kQuantPrefetch + line), _MM_HINT_T0);
  return rec;
}

template <int FORMAT, int G>
struct Layout {
  static constexpr bool kNibbleQ = FORMAT != kBytes;
  static constexpr int64_t kGroupHeader = FORMAT == kNibbles                                     ? 8 * kPanel
                                          : FORMAT == kBytes || FORMAT == kHalfOffsetNibbles ? 4 * kPanel
                                                                                              : 2 * kPanel;
  static constexpr int64_t kGroupBytes = kGroupHeader + (kNibbleQ ? G / 2 : G) * kPanel;
  static constexpr int64_t kSuperGroups = 256 / G;
  static constexpr int64_t kSuperHeader = 4 * kPanel;  // d and dmin, 16 halves each
  static constexpr int64_t kSuperBytes = kSuperHeader + kSuperGroups * kGroupBytes;

  static int64_t panel_bytes(int64_t K) {
    return FORMAT == kSuperNibbles ? K / 256 * kSuperBytes : K / G * kGroupBytes;
  }
  static const uint8_t* group(const uint8_t* panel, int64_t gi) {
    if constexpr (FORMAT == kSuperNibbles)
      return panel + gi / kSuperGroups * kSuperBytes + kSuperHeader + gi % kSuperGroups * kGroupBytes;
    return panel + gi * kGroupBytes;
  }
  // As group(), its record asked for ahead (prefetching)
  static const uint8_t* group_prefetching(const uint8_t* panel, int64_t gi) {
    return prefetching<kGroupBytes>(group(panel, gi));
  }
  // Group gi's scale and offset for all kPanel lanes, as floats in memory (for code that does not
  // work in vec-wide steps: the scalar reference, the AVX2 q8 tiles on any vec width).
  static void scale_arrays(const uint8_t* panel, int64_t gi, float* scale, float* offset) {
    for (int v = 0; v < kVecPerPanel; ++v) {
      vec s, o;
      scales(panel, gi, v, s, o);
      vstore(scale + v * kVec, s);
      vstore(offset + v * kVec, o);
    }
  }
  // Lanes [v * kVec, (v + 1) * kVec) of group gi's scale and offset.
  static void scales(const uint8_t* panel, int64_t gi, int v, vec& scale, vec& offset) {
    ScaleReader().read(panel, gi, v, scale, offset);
  }
  // The same for one panel's lanes read group after group (a tile's walk through K): a
  // superblock's d and dmin are converted once, not once per group.
  struct ScaleReader {
    int64_t super = -1;
    vec d, dmin;
    void read(const uint8_t* panel, int64_t gi, int v, vec& scale, vec& offset) {
      const uint8_t* rec = group(panel, gi);
      if constexpr (FORMAT == kSuperNibbles) {
        if (gi / kSuperGroups != super) {
          super = gi / kSuperGroups;
          d = f16_to_vec(panel + super * kSuperBytes + 2 * v * kVec);
          dmin = f16_to_vec(panel + super * kSuperBytes + 2 * kPanel + 2 * v * kVec);
        }
        scale = vmul(d, u8_to_vec(rec + v * kVec));
        offset = vneg(vmul(dmin, u8_to_vec(rec + kPanel + v * kVec)));
      } else if constexpr (FORMAT == kHalfOffsetNibbles) {
        scale = f16_to_vec(rec + 2 * v * kVec);
        offset = f16_to_vec(rec + 2 * kPanel + 2 * v * kVec);
      } else {
        const float* header = reinterpret_cast<const float*>(rec);
        scale = vload(header + v * kVec);
        offset = FORMAT == kNibbles ? vload(header + kPanel + v * kVec) : vzero();
      }
    }
  };
};

// Panels of superblocks (256 k): a header of SUPER_HEADER bytes, then GROUPS groups of GROUP_BYTES
// (the layouts below add what a group holds).
template <int64_t SUPER_HEADER, int64_t GROUP_BYTES, int64_t GROUPS>
struct SuperBlocks {
  static constexpr int64_t kSuperHeader = SUPER_HEADER;
  static constexpr int64_t kGroupBytes = GROUP_BYTES;
  static constexpr int64_t kSuperGroups = GROUPS;
  static constexpr int64_t kSuperBytes = kSuperHeader + kSuperGroups * kGroupBytes;

  static int64_t panel_bytes(int64_t K) { return K / 256 * kSuperBytes; }
  static const uint8_t* super(const uint8_t* panel, int64_t gi) { return panel + gi / kSuperGroups * kSuperBytes; }
  static const uint8_t* group(const uint8_t* panel, int64_t gi) {
    return super(panel, gi) + kSuperHeader + gi % kSuperGroups * kGroupBytes;
  }
  static const uint8_t* group_prefetching(const uint8_t* panel, int64_t gi) {
    return prefetching<kGroupBytes>(group(panel, gi));
  }
};

// Superblocks headed by half d[16], each group by int8 sc[16]: scale = d * sc, the float32
// product (exact: d has 11 significant bits, sc 6).
template <int64_t GROUP_BYTES, int64_t GROUPS>
struct ScaledSuperBlocks : SuperBlocks<2 * kPanel, GROUP_BYTES, GROUPS> {
  using Base = SuperBlocks<2 * kPanel, GROUP_BYTES, GROUPS>;
  // Lanes [v * kVec, (v + 1) * kVec) of group gi's scale.
  static vec scale(const uint8_t* panel, int64_t gi, int v) {
    return vmul(f16_to_vec(Base::super(panel, gi) + 2 * v * kVec), i8_to_vec(Base::group(panel, gi) + v * kVec));
  }
  static void scale_array(const uint8_t* panel, int64_t gi, float* out) {
    for (int v = 0; v < kVecPerPanel; ++v) vstore(out + v * kVec, scale(panel, gi, v));
  }
};

// kSixBits (G = 16; Q6_K in mode gguf-q8, VNNI and AVX2 builds): the file's 6.56 bits a weight
// instead of kBytes' 10. Per 256 k: half d[16]; then 16 groups of int8 sc[16], 128 bytes of low
// nibbles and 64 bytes of high bit pairs of u = q + 32 in [0, 63]. Step t of a group (k = 4t..4t+3)
// is lane j's bytes 4j..4j+3 of a 64-byte vector, as in the q8 arrangement: its low nibbles are in
// low-nibble vector t / 2 (the low nibbles for even t, the high ones for odd t), its high bits are
// bits 2t..2t+1 of the high-pair vector. scale = d * sc, the float32 product (kBytes' float).
struct SixBitLayout : ScaledSuperBlocks<kPanel + 12 * kPanel, 16> {
  static constexpr int64_t kGroupHeader = kPanel;
  static constexpr int64_t kLowBytes = 8 * kPanel;
  static constexpr int32_t kBias = 32;  // u = q + kBias
  static constexpr bool kFloatOffsets = false;

  // u of lane j, k = kk of group record rec (past its header)
  static int32_t u(const uint8_t* q, int j, int kk) {
    const int t = kk / 4, b = j * 4 + kk % 4;
    const int low = (q[t / 2 * 64 + b] >> (4 * (t % 2))) & 15;
    return low | (((q[kLowBytes + b] >> (2 * t)) & 3) << 4);
  }
};

// kThreeBits (G = 16; Q3_K in mode gguf-q8): the file's 3.44 bits a weight as 3.56 instead of the
// six-bit panels' 6.56. Per 256 k: half d[16]; then 16 groups of int8 sc[16], 64 bytes of low bit
// pairs and 32 bytes of high bits of u = q + 4 in [0, 7]. Step t of a group (k = 4t..4t+3) is a
// 64-byte vector as in SixBitLayout: its low bits are bits 2t..2t+1 of the pair vector, its high
// bit of byte b is bit t (b < 32) or 4 + t (b >= 32) of high byte b % 32. scale = d * sc.
struct ThreeBitLayout : ScaledSuperBlocks<kPanel + 6 * kPanel, 16> {
  static constexpr bool kFloatOffsets = false;
  static constexpr int64_t kGroupHeader = kPanel;
  static constexpr int64_t kHighBytes = 4 * kPanel;  // after the pairs
  static constexpr int32_t kBias = 4;

  static int32_t u(const uint8_t* q, int j, int kk) {
    const int t = kk / 4, b = j * 4 + kk % 4;
    const int high = (q[kHighBytes + b % 32] >> (t + 4 * (b / 32))) & 1;
    return ((q[b] >> (2 * t)) & 3) | (high << 2);
  }
};

// kTwoBits (G = 16; Q2_K in mode gguf-q8): the file's 2.63 bits a weight as they are, instead of
// Q8_0's 9. Per 256 k: half d[16], half dmin[16]; then 16 groups of the file's scale bytes
// scm[16] (sc in the low nibble, m in the high one) and 64 bytes of bit pairs of u = q in [0, 3]
// (ThreeBitLayout's pairs). scale = d * sc and offset = -(dmin * m), float32 products as ggml's
// (Q5_K's formula: I = sum u * a, y += I * scale * d, y += offset * d * S).
struct TwoBitLayout : SuperBlocks<4 * kPanel, 5 * kPanel, 16> {
  static constexpr bool kFloatOffsets = true;
  static constexpr int64_t kGroupHeader = kPanel;

  static int32_t u(const uint8_t* q, int j, int kk) { return (q[j * 4 + kk % 4] >> (2 * (kk / 4))) & 3; }
  static void scale_arrays(const uint8_t* panel, int64_t gi, float* scale, float* offset) {
    for (int v = 0; v < kVecPerPanel; ++v) {
      vec sc, m;
      nibbles_to_vec(group(panel, gi) + v * kVec, sc, m);
      vstore(scale + v * kVec, vmul(f16_to_vec(super(panel, gi) + 2 * v * kVec), sc));
      vstore(offset + v * kVec, vneg(vmul(f16_to_vec(super(panel, gi) + 2 * kPanel + 2 * v * kVec), m)));
    }
  }
};

// kLutNibbles (G = 32; IQ4_XS in mode gguf-q8): the file's 4.25 bits a weight as 4.31 instead of
// the byte layout's 9. Per 256 k: half d[16]; then 8 groups of int8 sc[16] and 4 vectors of 16
// lanes x 4 k: vector t holds k = 4t..4t+3 in its low nibbles and k = 16 + 4t.. in its high ones,
// each nibble an index into ggml's 16 IQ4 levels (q8lut.h). scale = d * sc, the float32 product
// (exact: the byte layout's float).
struct LutLayout : ScaledSuperBlocks<kPanel + 16 * kPanel, 8> {
  static constexpr bool kHalfScales = false;
  static constexpr int64_t kGroupHeader = kPanel;
};

// kHalfNibbles (Q4_0) and kHalfLutNibbles (IQ4_NL), G = 32, mode gguf-q8: the file's 4.5 bits a
// weight as 4.5 instead of 6 (Q4_0 as kNibbles) or 9 (IQ4_NL as kBytes). Per group of 32 k: half
// d[16], then kLutNibbles' 4 vectors of nibbles, each an index into the format's 16 levels
// (q8lut.h: Q4_0's q - 8, IQ4_NL's ggml levels). scale = d (the byte layout's float, exactly).
template <int64_t PAYLOAD>
struct HalfScaledGroups {
  static constexpr bool kHalfScales = true;
  static constexpr int64_t kGroupHeader = 2 * kPanel;
  static constexpr int64_t kGroupBytes = kGroupHeader + PAYLOAD;

  static int64_t panel_bytes(int64_t K) { return K / 32 * kGroupBytes; }
  static const uint8_t* group(const uint8_t* panel, int64_t gi) { return panel + gi * kGroupBytes; }
  static const uint8_t* group_prefetching(const uint8_t* panel, int64_t gi) {
    return prefetching<kGroupBytes>(group(panel, gi));
  }
  static void scale_array(const uint8_t* panel, int64_t gi, float* out) {
    for (int v = 0; v < kVecPerPanel; ++v) vstore(out + v * kVec, f16_to_vec(group(panel, gi) + 2 * v * kVec));
  }
};
using HalfLutLayout = HalfScaledGroups<16 * kPanel>;

// A five-bit group's integers (after its header): 4 vectors of low nibbles (kLutNibbles'
// arrangement) and one vector of high bits: bit t of byte b is the high bit of byte b's low
// nibble in vector t, bit 4 + t that of its high nibble.
struct FiveBitGroup {
  static constexpr int64_t kLowBytes = 16 * kPanel;
  static constexpr int64_t kPayload = 20 * kPanel;  // bytes after the header

  // u in [0, 31] of lane j, k = kk of a group record (past its header)
  static int32_t u(const uint8_t* q, int j, int kk) {
    const int t = (kk % 16) / 4, b = j * 4 + kk % 4, half = kk < 16 ? 0 : 4;
    return ((q[t * 64 + b] >> half) & 15) | (((q[kLowBytes + b] >> (half + t)) & 1) << 4);
  }
};

// kFiveBits (G = 32; Q5_K in mode gguf-q8): the file's 5.5 bits a weight as 5.63 instead of the
// Q8_0 layout's 9. Per 256 k: half d[16], half dmin[16]; then 8 groups of uint8 sc[16], uint8
// m[16] and a FiveBitGroup. u = q in [0, 31]; scale = d * sc and offset = -(dmin * m), float32
// products as ggml's.
struct FiveBitLayout : SuperBlocks<4 * kPanel, 2 * kPanel + FiveBitGroup::kPayload, 8>, FiveBitGroup {
  static constexpr bool kHalfScales = false;
  static constexpr bool kFloatOffsets = true;
  static constexpr int64_t kGroupHeader = 2 * kPanel;

  static void scale_arrays(const uint8_t* panel, int64_t gi, float* scale, float* offset) {
    for (int v = 0; v < kVecPerPanel; ++v) {
      const uint8_t* sup = super(panel, gi);
      vstore(scale + v * kVec, vmul(f16_to_vec(sup + 2 * v * kVec), u8_to_vec(group(panel, gi) + v * kVec)));
      vstore(offset + v * kVec,
             vneg(vmul(f16_to_vec(sup + 2 * kPanel + 2 * v * kVec), u8_to_vec(group(panel, gi) + kPanel + v * kVec))));
    }
  }
};

// kHalfFiveBits (G = 32; Q5_0 in mode gguf-q8): the file's 5.5 bits a weight as 5.5 instead of the
// byte layout's 9. Per group of 32 k: half d[16], then a FiveBitGroup of u = q + 16 in [0, 31].
// scale = d (the byte layout's float, exactly); the tiles subtract 16 * S from the integer sum, so
// they give the byte layout's integers.
struct HalfFiveBitLayout : HalfScaledGroups<FiveBitGroup::kPayload>, FiveBitGroup {
  static constexpr bool kFloatOffsets = false;
};

// kHalfOffsetFiveBits (G = 32; Q5_1 in mode gguf-q8): the file's 6 bits a weight as 6 instead of
// Q8_0's 9. Per group of 32 k: half d[16], half m[16], then a FiveBitGroup of u = q in [0, 31].
// scale = d and offset = m, the float32 values of the halves (Q5_K's formula).
struct HalfOffsetFiveBitLayout : HalfScaledGroups<2 * kPanel + FiveBitGroup::kPayload>, FiveBitGroup {
  static constexpr bool kFloatOffsets = true;
  static constexpr int64_t kGroupHeader = 4 * kPanel;  // d, then m
  static void scale_arrays(const uint8_t* panel, int64_t gi, float* scale, float* offset) {
    for (int v = 0; v < kVecPerPanel; ++v) {
      vstore(scale + v * kVec, f16_to_vec(group(panel, gi) + 2 * v * kVec));
      vstore(offset + v * kVec, f16_to_vec(group(panel, gi) + 2 * kPanel + 2 * v * kVec));
    }
  }
};

#if defined(__AVX512BW__) && defined(__AVX512F__)
// Six-bit panels (SixBitLayout): step t's u (in [0, 63], so no sign trick) rebuilt from its
// low-nibble vector and bits 2t..2t+1 of the group's high-pair vector (16-bit shifts bring them
// to bits 4..5; the mask drops what crossed from the neighbouring byte). The q8 tiles take its
// bytes as they are; the float tiles (qtile_six) take q = u - 32 out of them one k at a time.
template <int T>
inline __m512i six_bit_u(__m512i low_nibbles, __m512i high_pairs) {
  const __m512i lo = T % 2 == 0 ? low_nibbles : _mm512_srli_epi16(low_nibbles, 4);
  __m512i hi = high_pairs;
  if constexpr (T == 0) hi = _mm512_slli_epi16(high_pairs, 4);
  if constexpr (T == 1) hi = _mm512_slli_epi16(high_pairs, 2);
  if constexpr (T == 3) hi = _mm512_srli_epi16(high_pairs, 2);
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(15)), _mm512_and_si512(hi, _mm512_set1_epi8(0x30)));
}
#endif

// One weight vector rebuilt from its integers: lanes [v * kVec, (v + 1) * kVec) of a panel.
inline void nibble_weights(const uint8_t* q, vec scale, vec offset, vec& w_even, vec& w_odd) {
  vec lo, hi;
  nibbles_to_vec(q, lo, hi);
  w_even = vfma(scale, lo, offset);
  w_odd = vfma(scale, hi, offset);
}
inline vec byte_weights(const uint8_t* q, vec scale) { return vmul(scale, i8_to_vec(q)); }

// As tile(), over quantized panels: same accumulation order, so the same sums bit for bit.
template <int FORMAT, int G, int ROWS, int PANELS>
void qtile(const float* x, int64_t K, const uint8_t* wq, int64_t p0, int64_t k0, int64_t k1,
           float* y, int64_t N, const float* bias, bool first, bool last) {
  using L = Layout<FORMAT, G>;
  constexpr int V = PANELS * kVecPerPanel;
  const int64_t panel_bytes = L::panel_bytes(K);
  vec acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  typename L::ScaleReader readers[V];
  for (int64_t g0 = k0; g0 < k1; g0 += G) {
    const uint8_t* q[PANELS];
    vec scale[V], offset[V];
#pragma GCC unroll 4
    for (int g = 0; g < PANELS; ++g) {
      const uint8_t* panel = wq + (p0 + g) * panel_bytes;
      const uint8_t* rec = L::group_prefetching(panel, g0 / G);
#pragma GCC unroll 2
      for (int v = 0; v < kVecPerPanel; ++v) {
        const int i = g * kVecPerPanel + v;
        readers[i].read(panel, g0 / G, v, scale[i], offset[i]);
      }
      q[g] = rec + L::kGroupHeader;
    }
    // Every loop inside a group is fully unrolled: the accumulators then stay in registers for the
    // whole k-block (GCC otherwise stores them to the stack after each step of an inner loop).
    if constexpr (L::kNibbleQ) {
#pragma GCC unroll 16
      for (int t = 0; t < G / 2; ++t) {
        vec w0[V], w1[V];
#pragma GCC unroll 16
        for (int i = 0; i < V; ++i)
          nibble_weights(q[i / kVecPerPanel] + t * kPanel + i % kVecPerPanel * kVec, scale[i], offset[i], w0[i],
                         w1[i]);
        const float* xk = x + g0 + 2 * t;
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
          const vec xb = vset1(xk[r * K]);
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) acc[r][v] = vfma(xb, w0[v], acc[r][v]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
          const vec xb = vset1(xk[r * K + 1]);
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) acc[r][v] = vfma(xb, w1[v], acc[r][v]);
        }
      }
    } else {
#pragma GCC unroll 32
      for (int t = 0; t < G; ++t) {
        vec w[V];
#pragma GCC unroll 16
        for (int i = 0; i < V; ++i)
          w[i] = byte_weights(q[i / kVecPerPanel] + t * kPanel + i % kVecPerPanel * kVec, scale[i]);
        const float* xk = x + g0 + t;
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
          const vec xb = vset1(xk[r * K]);
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) acc[r][v] = vfma(xb, w[v], acc[r][v]);
        }
      }
    }
  }
  store_tile<ROWS, V>(acc, p0, y, N, bias, first, last);
}

#if defined(__AVX512BW__) && defined(__AVX512F__)
constexpr bool kHaveSixBitFloatTiles = true;

// Byte I of each 32-bit lane of s, sign-extended: k = 4t + I of a six-bit step, 16 lanes.
template <int I>
__attribute__((always_inline)) inline vec step_byte(__m512i s) {
  if constexpr (I == 3) return _mm512_cvtepi32_ps(_mm512_srai_epi32(s, 24));
  else return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 24 - 8 * I), 24));
}

// Step T of a six-bit group (k = 4T..4T+3) for rows [0, ROWS) and PANELS panels: w = scale * q,
// the byte layout's product (kBytes: scale * q with q = u - 32), then one multiply-add per row and
// k in k order, as every tile does.
template <int T, int I, int ROWS, int PANELS>
__attribute__((always_inline)) inline void six_bit_k(const float* xg, int64_t K, const __m512i (&q)[PANELS],
                                                     const vec (&scale)[PANELS], vec (&acc)[ROWS][PANELS]) {
  vec w[PANELS];
#pragma GCC unroll 4
  for (int g = 0; g < PANELS; ++g) w[g] = vmul(scale[g], step_byte<I>(q[g]));
  const float* xk = xg + 4 * T + I;
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    const vec xb = vset1(xk[r * K]);
#pragma GCC unroll 4
    for (int g = 0; g < PANELS; ++g) acc[r][g] = vfma(xb, w[g], acc[r][g]);
  }
}

template <int T, int ROWS, int PANELS>
__attribute__((always_inline)) inline void six_bit_float_step(const float* xg, int64_t K, const uint8_t* const (&q)[PANELS],
                                                              const __m512i (&high)[PANELS], const vec (&scale)[PANELS],
                                                              vec (&acc)[ROWS][PANELS]) {
  __m512i signed_q[PANELS];
#pragma GCC unroll 4
  for (int g = 0; g < PANELS; ++g)
    signed_q[g] = _mm512_sub_epi8(six_bit_u<T>(_mm512_loadu_si512(q[g] + T / 2 * 64), high[g]), _mm512_set1_epi8(32));
  six_bit_k<T, 0>(xg, K, signed_q, scale, acc);
  six_bit_k<T, 1>(xg, K, signed_q, scale, acc);
  six_bit_k<T, 2>(xg, K, signed_q, scale, acc);
  six_bit_k<T, 3>(xg, K, signed_q, scale, acc);
}

// As qtile, over six-bit panels (Q6_K in speed mode gguf: two thirds of the byte layout's bytes):
// the same weights rebuilt, the same order, so the byte layout's bits.
template <int ROWS, int PANELS>
void qtile_six(const float* x, int64_t K, const uint8_t* wq, int64_t p0, int64_t k0, int64_t k1, float* y,
               int64_t N, const float* bias, bool first, bool last) {
  using L = SixBitLayout;
  const int64_t panel_bytes = L::panel_bytes(K);
  vec acc[ROWS][PANELS];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < PANELS; ++g) acc[r][g] = vzero();
  for (int64_t g0 = k0; g0 < k1; g0 += 16) {
    const int64_t gi = g0 / 16;
    const uint8_t* q[PANELS];
    __m512i high[PANELS];
    vec scale[PANELS];
#pragma GCC unroll 4
    for (int g = 0; g < PANELS; ++g) {
      const uint8_t* panel = wq + (p0 + g) * panel_bytes;
      const uint8_t* rec = L::group_prefetching(panel, gi);
      scale[g] = L::scale(panel, gi, 0);
      q[g] = rec + L::kGroupHeader;
      high[g] = _mm512_loadu_si512(q[g] + L::kLowBytes);
    }
    six_bit_float_step<0>(x + g0, K, q, high, scale, acc);
    six_bit_float_step<1>(x + g0, K, q, high, scale, acc);
    six_bit_float_step<2>(x + g0, K, q, high, scale, acc);
    six_bit_float_step<3>(x + g0, K, q, high, scale, acc);
  }
  store_tile<ROWS, PANELS>(acc, p0, y, N, bias, first, last);
}
#else
constexpr bool kHaveSixBitFloatTiles = false;
#endif

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, int64_t, float*, int64_t,
                        const float*, bool, bool);

// max_rows<ACC, PANELS>: the most rows whose accumulators fit in registers beside PANELS panels.
template <int ACC, int PANELS>
constexpr int max_rows() { return ACC / (PANELS * kVecPerPanel) > 0 ? ACC / (PANELS * kVecPerPanel) : 1; }

// Rebuilding quantized weights needs registers for scales, offsets and two weight vectors per panel.
constexpr int kQuantAccumulators = kVec == 16 ? 12 : 6;
constexpr int kQuantMaxPanels = kVec == 16 ? 4 : 1;

template <int PANELS, int... R>
constexpr std::array<TileFn<float>, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, PANELS>...};
}

template <int FORMAT, int G, int PANELS, int... R>
constexpr std::array<TileFn<uint8_t>, sizeof...(R)> qtile_table(std::integer_sequence<int, R...>) {
  return {&qtile<FORMAT, G, R + 1, PANELS>...};
}

#if defined(__AVX512BW__) && defined(__AVX512F__)
template <int PANELS, int... R>
constexpr std::array<TileFn<uint8_t>, sizeof...(R)> qtile_six_table(std::integer_sequence<int, R...>) {
  return {&qtile_six<R + 1, PANELS>...};
}

struct SixBitTiles {
  template <int PANELS>
  struct With {
    static constexpr int kRows = max_rows<kQuantAccumulators, PANELS>();
    static TileFn<uint8_t> get(int rows) {
      static constexpr auto table = qtile_six_table<PANELS>(std::make_integer_sequence<int, kRows>{});
      return table[rows - 1];
    }
  };
};
#endif

template <int PANELS>
struct FloatTiles {
  static constexpr int kRows = max_rows<kAccumulators, PANELS>();
  static TileFn<float> get(int rows) {
    static constexpr auto table = tile_table<PANELS>(std::make_integer_sequence<int, kRows>{});
    return table[rows - 1];
  }
};

template <int FORMAT, int G>
struct QuantTiles {
  template <int PANELS>
  struct With {
    static constexpr int kRows = max_rows<kQuantAccumulators, PANELS>();
    static TileFn<uint8_t> get(int rows) {
      static constexpr auto table = qtile_table<FORMAT, G, PANELS>(std::make_integer_sequence<int, kRows>{});
      return table[rows - 1];
    }
  };
};

// Fewer rows: more panels per tile (more independent accumulators to hide FMA latency).
// More rows: fewer panels, so every row still shares each weight load.
// The tile shape never changes the order of any output's sum.
template <typename W, template <int> class Tiles, int PANELS>
void run_group(const float* x, int64_t M, int64_t K, const W* wp, int64_t p_begin, float* y, int64_t N,
               const float* bias) {
  constexpr int R = Tiles<PANELS>::kRows;
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = std::min(K, k0 + kBlockK);
    for (int64_t p0 = p_begin; p0 < p_begin + kGroup; p0 += PANELS)
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const int rows = static_cast<int>(std::min<int64_t>(R, M - m0));
        Tiles<PANELS>::get(rows)(x + m0 * K, K, wp, p0, k0, k1, y + m0 * N, N, bias, k0 == 0, k1 == K);
      }
  }
}

using GroupFn = void (*)(const float*, int64_t, int64_t, const void*, int64_t, float*, int64_t, const float*);

template <typename W, template <int> class Tiles, int PANELS>
void run_group_erased(const float* x, int64_t M, int64_t K, const void* wp, int64_t p_begin, float* y, int64_t N,
                      const float* bias) {
  run_group<W, Tiles, PANELS>(x, M, K, static_cast<const W*>(wp), p_begin, y, N, bias);
}

template <typename W, template <int> class Tiles, int MAX_PANELS>
GroupFn group_for_rows(int64_t M) {
  if (MAX_PANELS >= 4 && M <= Tiles<4>::kRows) return &run_group_erased<W, Tiles, 4>;
  if (MAX_PANELS >= 2 && M <= Tiles<2>::kRows) return &run_group_erased<W, Tiles, 2>;
  return &run_group_erased<W, Tiles, 1>;
}

inline const float* bias_pointer(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dtype() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
              "bias must be ", N, " contiguous float32 values");
  return bias->data_ptr<float>();
}

inline at::Tensor run_all_groups(const at::Tensor& x, const void* wp, int64_t P, GroupFn run,
                             const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = P * kPanel;
  auto y = at::empty({M, N}, x.options());
  const float* bp = bias_pointer(bias, N);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) run(xp, M, K, wp, g * kGroup, yp, N, bp);
  });
  return y;
}

// f(format, group) with both as compile-time constants, for a runtime (format, group).
template <typename F>
auto with_format(int64_t format, int64_t group, F&& f) {
  using std::integral_constant;
  TORCH_CHECK(format != kSixBits, "six-bit panels have tiles of their own (qtile_six, the q8 tiles)");
  TORCH_CHECK(!q8_only_format(format), "IQ4_XS, Q5_K, Q4_0, IQ4_NL, Q5_0, Q5_1, Q3_K and Q2_K panels have q8 tiles only");
  TORCH_CHECK((format != kBytes && group == 32) || (format == kBytes && (group == 16 || group == 32)),
              "unsupported quantized format ", format, " with groups of ", group);
  if (format == kSuperNibbles) return f(integral_constant<int, kSuperNibbles>{}, integral_constant<int, 32>{});
  if (format == kNibbles) return f(integral_constant<int, kNibbles>{}, integral_constant<int, 32>{});
  if (format == kHalfOffsetNibbles) return f(integral_constant<int, kHalfOffsetNibbles>{}, integral_constant<int, 32>{});
  if (group == 16) return f(integral_constant<int, kBytes>{}, integral_constant<int, 16>{});
  return f(integral_constant<int, kBytes>{}, integral_constant<int, 32>{});
}

inline void check_quantized_operands(const at::Tensor& x, const at::Tensor& wq, int64_t format, int64_t group) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "x must be 2-d float32");
  TORCH_CHECK(wq.dtype() == at::kByte && wq.dim() == 2 && wq.is_contiguous(), "bad quantized weight");
  TORCH_CHECK(wq.size(1) == quant_panel_bytes(format, group, x.size(1)),
              "x has ", x.size(1), " features, which does not match the quantized weight");
  TORCH_CHECK(wq.size(0) % kGroup == 0, "panel count must be a multiple of ", kGroup);
}

// Panels [0, P) rebuilt as float32, laid out like pack_weight: [P, K, 16].
template <int FORMAT, int G>
void dequantize_panel(const uint8_t* panel, int64_t K, float* out) {
  using L = Layout<FORMAT, G>;
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    const uint8_t* q = L::group(panel, g0 / G) + L::kGroupHeader;
    for (int v = 0; v < kVecPerPanel; ++v) {
      vec scale, offset;
      L::scales(panel, g0 / G, v, scale, offset);
      for (int t = 0; t < (L::kNibbleQ ? G / 2 : G); ++t) {
        if constexpr (L::kNibbleQ) {
          vec w0, w1;
          nibble_weights(q + t * kPanel + v * kVec, scale, offset, w0, w1);
          vstore(out + (g0 + 2 * t) * kPanel + v * kVec, w0);
          vstore(out + (g0 + 2 * t + 1) * kPanel + v * kVec, w1);
        } else {
          vstore(out + (g0 + t) * kPanel + v * kVec, byte_weights(q + t * kPanel + v * kVec, scale));
        }
      }
    }
  }
}

// Six-bit panels rebuilt as float32 [K, 16]: w = scale * (u - 32), as the tiles rebuild them.
inline void dequantize_six_panel(const uint8_t* panel, int64_t K, float* out) {
  using L = SixBitLayout;
  for (int64_t gi = 0; gi < K / 16; ++gi) {
    alignas(64) float scale[kPanel];
    L::scale_array(panel, gi, scale);
    const uint8_t* q = L::group(panel, gi) + L::kGroupHeader;
    for (int kk = 0; kk < 16; ++kk)
      for (int j = 0; j < kPanel; ++j)
        out[(gi * 16 + kk) * kPanel + j] = scale[j] * static_cast<float>(L::u(q, j, kk) - 32);
  }
}

}  // namespace selfspec
