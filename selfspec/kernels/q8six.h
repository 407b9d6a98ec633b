#pragma once

// Speed mode gguf-q8, the K-quants of 16-weight groups as panels of their own bit width (linear.h):
// Q6_K as six-bit panels (SixBitLayout: the file's 6.56 bits a weight instead of the byte layout's
// 10), Q3_K as three-bit ones (ThreeBitLayout: 3.56 instead of 10) and Q2_K as two-bit ones
// (TwoBitLayout: the file's 2.63 instead of Q8_0's 9). Q6_K and Q3_K hold u = q + kBias and sum
// I = sum u * a - kBias * S, the byte layout's integer, so the same bits; Q2_K has float offsets
// (kFloatOffsets: y += I * scale * d, y += offset * d * S). An unpacker (SixBitUnpack,
// ThreeBitUnpack, TwoBitUnpack) rebuilds a group's u step by step; the tiles around it (the
// scalar reference's bits: VNNI, AVX2) are shared.

#include "q8.h"

namespace selfspec {

template <typename L>
inline void q8six_reference_panel(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p,
                                  float* y, int64_t N, const float* bias) {
  const int8_t* aq = a.q;
  const float* ad = a.d;
  const int32_t* as = a.sums16;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    for (int64_t g0 = 0; g0 < K; g0 += 16) {
      alignas(64) float scale[kPanel], offset[kPanel];
      if constexpr (L::kFloatOffsets)
        L::scale_arrays(panel, g0 / 16, scale, offset);
      else
        L::scale_array(panel, g0 / 16, scale);
      const uint8_t* q = L::group(panel, g0 / 16) + L::kGroupHeader;
      const int8_t* am = aq + m * K + g0;
      const float d = ad[m * (K / kActBlock) + g0 / kActBlock];
      const int32_t S = as[m * (K / 16) + g0 / 16];
      for (int j = 0; j < kPanel; ++j) {
        int32_t I = 0;
        for (int kk = 0; kk < 16; ++kk) I += L::u(q, j, kk) * am[kk];
        if constexpr (L::kFloatOffsets) {
          acc[j] = std::fma(static_cast<float>(I), scale[j] * d, acc[j]);
          acc[j] = std::fma(offset[j], d * static_cast<float>(S), acc[j]);
        } else {
          acc[j] = std::fma(static_cast<float>(I - L::kBias * S), scale[j] * d, acc[j]);
        }
      }
    }
    for (int j = 0; j < kPanel; ++j) y[m * N + p * kPanel + j] = bias ? acc[j] + bias[p * kPanel + j] : acc[j];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
// A group's u, step by step (T: k = 4T..4T+3), from its integers q (past the header).
struct SixBitUnpack {
  using L = SixBitLayout;
  __m512i high;
  explicit SixBitUnpack(const uint8_t* q) : high(_mm512_loadu_si512(q + L::kLowBytes)) {}
  template <int T>
  __m512i u(const uint8_t* q) const {
    return six_bit_u<T>(_mm512_loadu_si512(q + T / 2 * 64), high);
  }
};

// The high-bit vector's bytes b and b + 32 both come from byte b: bits 0..3 for the first half of
// a step, bits 4..7 (brought down by a 16-bit shift; the bits that crossed from the neighbouring
// byte land in bits 4..7 and are masked off) for the second.
struct ThreeBitUnpack {
  using L = ThreeBitLayout;
  __m512i pairs, high;
  explicit ThreeBitUnpack(const uint8_t* q) : pairs(_mm512_loadu_si512(q)) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + L::kHighBytes));
    high = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
  }
  template <int T>
  __m512i u(const uint8_t*) const {
    const __m512i lo = T == 0 ? pairs : _mm512_srli_epi16(pairs, 2 * T);
    __m512i hi = high;  // bit T to bit 2
    if constexpr (T < 2) hi = _mm512_slli_epi16(high, 2 - T);
    if constexpr (T == 3) hi = _mm512_srli_epi16(high, 1);
    return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(3)), _mm512_and_si512(hi, _mm512_set1_epi8(4)));
  }
};

struct TwoBitUnpack {
  using L = TwoBitLayout;
  __m512i pairs;
  explicit TwoBitUnpack(const uint8_t* q) : pairs(_mm512_loadu_si512(q)) {}
  template <int T>
  __m512i u(const uint8_t*) const {
    return _mm512_and_si512(T == 0 ? pairs : _mm512_srli_epi16(pairs, 2 * T), _mm512_set1_epi8(3));
  }
};

template <typename U, int ROWS, int T>
inline void bits_step(const uint8_t* q, const U& unpack, const int32_t* a, __m512i (&dot)[ROWS]) {
  const __m512i u = unpack.template u<T>(q);
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], u, _mm512_set1_epi32(a[T * ROWS + r]));
}

// As q8tile, over panels of layout U::L (G = 16): rows [0, ROWS) times panel p.
template <typename U, int ROWS>
void q8six_tile(const int32_t* quads, const float* d_t, const void* s16_v, int64_t M, int64_t K,
                const uint8_t* wq, int64_t p, float* y, int64_t N, const float* bias) {
  using L = typename U::L;
  const int32_t* s16 = static_cast<const int32_t*>(s16_v);
  const uint8_t* panel = wq + p * L::panel_bytes(K);
  __m512 acc[ROWS], d_super = _mm512_setzero_ps(), dmin_super = _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 16) {
    const int64_t gi = g0 / 16;
    if (gi % L::kSuperGroups == 0) {
      d_super = f16_to_vec(L::super(panel, gi));
      if constexpr (L::kFloatOffsets) dmin_super = f16_to_vec(L::super(panel, gi) + 2 * kPanel);
    }
    const uint8_t* rec = L::group_prefetching(panel, gi);
    __m512 scale, offset;
    if constexpr (L::kFloatOffsets) {
      __m512 sc, m;
      nibbles_to_vec(rec, sc, m);
      scale = _mm512_mul_ps(d_super, sc);
      offset = vneg(_mm512_mul_ps(dmin_super, m));
    } else {
      scale = _mm512_mul_ps(d_super, i8_to_vec(rec));
    }
    const uint8_t* q = rec + L::kGroupHeader;
    const U unpack(q);
    __m512i dot[ROWS];
    zero_dots(dot);
    const int32_t* a = quads + (g0 / 4) * ROWS;
    bits_step<U, ROWS, 0>(q, unpack, a, dot);
    bits_step<U, ROWS, 1>(q, unpack, a, dot);
    bits_step<U, ROWS, 2>(q, unpack, a, dot);
    bits_step<U, ROWS, 3>(q, unpack, a, dot);
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
    const int32_t* sg = s16 + gi * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      if constexpr (L::kFloatOffsets) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, _mm512_set1_ps(dg[r])), acc[r]);
        acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(dg[r] * static_cast<float>(sg[r])), acc[r]);
      } else {
        const __m512i I = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(L::kBias * sg[r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(scale, _mm512_set1_ps(dg[r])), acc[r]);
      }
    }
  }
  store_tile(acc, y, N, p, bias);
}

template <typename U, int... R>
constexpr std::array<Q8TileFn, sizeof...(R)> q8six_table(std::integer_sequence<int, R...>) {
  return {&q8six_tile<U, R + 1>...};
}

// One panel group, tile by tile as q8_run_group.
template <typename U>
inline void q8six_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* wq, int64_t p_begin,
                         float* y, int64_t N, const float* bias) {
  static constexpr auto table = q8six_table<U>(std::make_integer_sequence<int, kVnniRows>{});
  q8_run_tiles(table.data(), a, a.s16, K / 16, M, K, wq, p_begin, y, N, bias);
}

constexpr bool kHaveSixBitTiles = true;
#elif defined(__AVX2__)

// Rows [0, ROWS) of a tile times two steps of u in [0, 63] (both halves of the panel, steps t and
// t + 1): u * a needs no sign trick, and the pair sums of both steps add up in int16 (at most
// 4 * 63 * 127), then widen once into dot.
template <int ROWS>
inline void six_bit_rows(__m256i u0a, __m256i u0b, __m256i u1a, __m256i u1b, const int32_t* a_t,
                         const int32_t* a_t1, __m256i (&dot)[ROWS][2]) {
  const __m256i ones16 = _mm256_set1_epi16(1);
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    const __m256i a0 = _mm256_set1_epi32(a_t[r]);
    const __m256i a1 = _mm256_set1_epi32(a_t1[r]);
    const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(u0a, a0), _mm256_maddubs_epi16(u1a, a1));
    const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(u0b, a0), _mm256_maddubs_epi16(u1b, a1));
    dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(pa, ones16));
    dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(pb, ones16));
  }
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Bits 2t..2t+1 of h to bits 4..5 (16-bit shifts; the mask drops what crossed from the
// neighbouring byte).
template <int T>
inline __m256i six_bit_high(__m256i h) {
  if constexpr (T == 0) return _mm256_slli_epi16(h, 4);
  if constexpr (T == 1) return _mm256_slli_epi16(h, 2);
  if constexpr (T == 2) return h;
  return _mm256_srli_epi16(h, 2);
}

// A group's u, step by step (T: k = 4T..4T+3), both 32-byte halves of the step, from its integers
// q (past the header): the low nibbles of low-nibble vector T / 2 and bits 2T..2T+1 of the
// high-pair vector.
struct SixBitUnpack {
  using L = SixBitLayout;
  __m256i ha, hb;
  explicit SixBitUnpack(const uint8_t* q) : ha(load32(q + L::kLowBytes)), hb(load32(q + L::kLowBytes + 32)) {}
  template <int T>
  void u(const uint8_t* q, __m256i& ua, __m256i& ub) const {
    const __m256i low4 = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(0x30);
    __m256i la = load32(q + T / 2 * 64), lb = load32(q + T / 2 * 64 + 32);
    if constexpr (T % 2 == 1) la = _mm256_srli_epi16(la, 4), lb = _mm256_srli_epi16(lb, 4);
    ua = _mm256_or_si256(_mm256_and_si256(la, low4), _mm256_and_si256(six_bit_high<T>(ha), high2));
    ub = _mm256_or_si256(_mm256_and_si256(lb, low4), _mm256_and_si256(six_bit_high<T>(hb), high2));
  }
};

// The same for three-bit panels: bits 2T..2T+1 of the pair vector, and bit T (first half) or 4 + T
// (second half, brought down by a 16-bit shift) of the high-bit vector, moved to bit 2.
struct ThreeBitUnpack {
  using L = ThreeBitLayout;
  __m256i pa, pb, ha, hb;
  explicit ThreeBitUnpack(const uint8_t* q)
      : pa(load32(q)), pb(load32(q + 32)), ha(load32(q + L::kHighBytes)), hb(_mm256_srli_epi16(ha, 4)) {}
  template <int T>
  static __m256i bit2(__m256i h) {
    if constexpr (T < 2) return _mm256_slli_epi16(h, 2 - T);
    if constexpr (T == 2) return h;
    return _mm256_srli_epi16(h, 1);
  }
  template <int T>
  void u(const uint8_t*, __m256i& ua, __m256i& ub) const {
    const __m256i low2 = _mm256_set1_epi8(3), bit = _mm256_set1_epi8(4);
    const __m256i la = T == 0 ? pa : _mm256_srli_epi16(pa, 2 * T);
    const __m256i lb = T == 0 ? pb : _mm256_srli_epi16(pb, 2 * T);
    ua = _mm256_or_si256(_mm256_and_si256(la, low2), _mm256_and_si256(bit2<T>(ha), bit));
    ub = _mm256_or_si256(_mm256_and_si256(lb, low2), _mm256_and_si256(bit2<T>(hb), bit));
  }
};

// Two-bit panels: bits 2T..2T+1 of the pair vector.
struct TwoBitUnpack {
  using L = TwoBitLayout;
  __m256i pa, pb;
  explicit TwoBitUnpack(const uint8_t* q) : pa(load32(q)), pb(load32(q + 32)) {}
  template <int T>
  void u(const uint8_t*, __m256i& ua, __m256i& ub) const {
    const __m256i low2 = _mm256_set1_epi8(3);
    ua = _mm256_and_si256(T == 0 ? pa : _mm256_srli_epi16(pa, 2 * T), low2);
    ub = _mm256_and_si256(T == 0 ? pb : _mm256_srli_epi16(pb, 2 * T), low2);
  }
};

// A group's scale (and offset) for both halves of the panel: d * sc (and -(dmin * m)).
template <typename L>
inline void group_scales_avx2(const uint8_t* rec, const __m256 (&d_super)[2], const __m256 (&dmin_super)[2],
                              __m256 (&scale)[2], __m256 (&offset)[2]) {
  for (int h = 0; h < 2; ++h) {
    if constexpr (L::kFloatOffsets) {
      const __m256i scm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 8 * h)));
      scale[h] = _mm256_mul_ps(d_super[h], _mm256_cvtepi32_ps(_mm256_and_si256(scm, _mm256_set1_epi32(15))));
      offset[h] = neg8(_mm256_mul_ps(dmin_super[h], _mm256_cvtepi32_ps(_mm256_srli_epi32(scm, 4))));
    } else {
      scale[h] = _mm256_mul_ps(d_super[h], i8x8(rec + 8 * h));
    }
  }
}

template <typename U, int ROWS, int T>
inline void bits_steps(const uint8_t* q, const U& unpack, const int32_t* a, __m256i (&dot)[ROWS][2]) {
  __m256i u0a, u0b, u1a, u1b;
  unpack.template u<T>(q, u0a, u0b);
  unpack.template u<T + 1>(q, u1a, u1b);
  six_bit_rows<ROWS>(u0a, u0b, u1a, u1b, a + T * ROWS, a + (T + 1) * ROWS, dot);
}

template <typename U, int ROWS>
void q8six_tile_avx2(const int32_t* quads, const float* d_t, const int32_t* s16, int64_t M, int64_t K,
                     const uint8_t* panel, int64_t p, float* y, int64_t N, const float* bias) {
  using L = typename U::L;
  __m256 acc[ROWS][2], d_super[2], dmin_super[2];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 16) {
    const int64_t gi = g0 / 16;
    if (gi % L::kSuperGroups == 0)
      for (int h = 0; h < 2; ++h) {
        d_super[h] = f16x8(L::super(panel, gi) + 16 * h);
        if constexpr (L::kFloatOffsets) dmin_super[h] = f16x8(L::super(panel, gi) + 2 * kPanel + 16 * h);
      }
    const uint8_t* rec = L::group_prefetching(panel, gi);
    __m256 scale[2], offset[2];
    group_scales_avx2<L>(rec, d_super, dmin_super, scale, offset);
    const uint8_t* q = rec + L::kGroupHeader;
    const U unpack(q);
    const int32_t* a = quads + (g0 / 4) * ROWS;
    __m256i dot[ROWS][2];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    bits_steps<U, ROWS, 0>(q, unpack, a, dot);
    bits_steps<U, ROWS, 2>(q, unpack, a, dot);
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
    const int32_t* sg = s16 + gi * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m256 vd = _mm256_set1_ps(dg[r]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        if constexpr (L::kFloatOffsets) {
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(scale[h], vd), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(offset[h], _mm256_set1_ps(dg[r] * static_cast<float>(sg[r])), acc[r][h]);
        } else {
          const __m256i I = _mm256_sub_epi32(dot[r][h], _mm256_set1_epi32(L::kBias * sg[r]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(scale[h], vd), acc[r][h]);
        }
      }
    }
  }
  store_panel_rows<ROWS>(acc, y, N, p, bias);
}

template <typename U>
inline void q8six_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                         int64_t N, const float* bias) {
  avx2_tiles(M, [&](int64_t m0, auto rows) {
    q8six_tile_avx2<U, decltype(rows)::value>(a.quads + K / 4 * m0, a.d_t + K / kActBlock * m0, a.s16 + K / 16 * m0,
                                              M, K, panel, p, y + m0 * N, N, bias);
  });
}

constexpr bool kHaveSixBitTiles = true;
#else
struct SixBitUnpack {
  using L = SixBitLayout;
};
struct ThreeBitUnpack {
  using L = ThreeBitLayout;
};
struct TwoBitUnpack {
  using L = TwoBitLayout;
};
template <typename U>
inline void q8six_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                         int64_t N, const float* bias) {
  q8six_reference_panel<typename U::L>(a, M, K, panel, p, y, N, bias);
}
constexpr bool kHaveSixBitTiles = false;
#endif

// Panels of layout U::L: the VNNI or AVX2 tiles, or the scalar reference. The tiles unpack each
// weight vector once per tile of rows. Passes gain from the fewer bytes while memory-bound; over
// 16 rows and more the unpacking costs about what the bytes save (docs/history.md: the
// 2026-11-24 and 2026-11-25 kernel changes).
template <typename U>
inline void q8six_run_unit(const QuantizedRows& a, const uint8_t* wq, int64_t g, float* y, int64_t N,
                           const float* bias, bool reference) {
  using L = typename U::L;
  q8_layout_unit<&L::panel_bytes, &q8six_reference_panel<L>, &q8six_vector<U>>(a, wq, g, y, N, bias, reference);
}

}  // namespace selfspec
