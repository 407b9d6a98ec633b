#pragma once

// Speed mode gguf-q8, five-bit panels: Q5_K (FiveBitLayout, linear.h: the file's 5.5 bits a weight
// as 5.63 instead of Q8_0's 9), Q5_0 (HalfFiveBitLayout: 5.5 instead of the byte layout's 9) and
// Q5_1 (HalfOffsetFiveBitLayout: 6 instead of Q8_0's 9). Q5_K's and Q5_1's formula is the Q4_K
// panels' with u in [0, 31]: I = sum u * a, y += I * scale * d, y += offset * d * S (their
// layouts' kFloatOffsets). Q5_0's is the byte layout's: I = sum u * a - 16 * S = sum q * a,
// y += I * scale * d, so its tiles give the byte layout's bits.

#include "q8.h"

namespace selfspec {

template <typename L>
void q8five_reference_panel(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                            int64_t N, const float* bias) {
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    for (int64_t g0 = 0; g0 < K; g0 += 32) {
      alignas(64) float scale[kPanel], offset[kPanel];
      if constexpr (L::kFloatOffsets)
        L::scale_arrays(panel, g0 / 32, scale, offset);
      else
        L::scale_array(panel, g0 / 32, scale);
      const uint8_t* q = L::group(panel, g0 / 32) + L::kGroupHeader;
      const int8_t* am = a.q + m * K + g0;
      const float d = a.d[m * (K / kActBlock) + g0 / kActBlock];
      const int32_t S = group_sum<32>(a.sums16 + m * (K / 16), g0);
      for (int j = 0; j < kPanel; ++j) {
        int32_t I = 0;
        for (int kk = 0; kk < 32; ++kk) I += L::u(q, j, kk) * am[kk];
        if constexpr (L::kFloatOffsets) {
          acc[j] = std::fma(static_cast<float>(I), scale[j] * d, acc[j]);
          acc[j] = std::fma(offset[j], d * static_cast<float>(S), acc[j]);
        } else {
          acc[j] = std::fma(static_cast<float>(I - 16 * S), scale[j] * d, acc[j]);
        }
      }
    }
    for (int j = 0; j < kPanel; ++j) y[m * N + p * kPanel + j] = bias ? acc[j] + bias[p * kPanel + j] : acc[j];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
// Step t's two vectors of u: its low nibbles and its high ones, each with its high bit (bit t, or
// 4 + t, of the group's high-bit vector, brought to bit 4 by a 16-bit shift; the mask drops what
// crossed from the neighbouring byte).
template <int T>
inline void five_bit_u(__m512i v, __m512i high, __m512i& u0, __m512i& u1) {
  const __m512i low4 = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
  const __m512i h0 = _mm512_slli_epi16(high, 4 - T);
  const __m512i h1 = T == 0 ? high : _mm512_srli_epi16(high, T);
  u0 = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(h0, bit4));
  u1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(h1, bit4));
}

template <int ROWS, int T>
inline void five_bit_step(const uint8_t* q, __m512i high, const int32_t* a_lo, const int32_t* a_hi,
                          __m512i (&dot)[ROWS]) {
  __m512i u0, u1;
  five_bit_u<T>(_mm512_loadu_si512(q + T * 64), high, u0, u1);
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    dot[r] = _mm512_dpbusd_epi32(dot[r], u0, _mm512_set1_epi32(a_lo[T * ROWS + r]));
    dot[r] = _mm512_dpbusd_epi32(dot[r], u1, _mm512_set1_epi32(a_hi[T * ROWS + r]));
  }
}

// As q8tile over five-bit panels: rows [0, ROWS) times panel p. sums: per group and row, d * S
// (float offsets: Q5_K, Q5_1) or S (Q5_0's, int32).
template <typename L, int ROWS>
void q8five_tile(const int32_t* quads, const float* d_t, const void* sums, int64_t M, int64_t K,
                 const uint8_t* wq, int64_t p, float* y, int64_t N, const float* bias) {
  const uint8_t* panel = wq + p * L::panel_bytes(K);
  __m512 acc[ROWS], d_super = _mm512_setzero_ps(), dmin_super = _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 32) {
    const int64_t gi = g0 / 32;
    const uint8_t* rec = L::group_prefetching(panel, gi);
    __m512 scale, offset = _mm512_setzero_ps();
    if constexpr (L::kHalfScales) {
      scale = f16_to_vec(rec);
      if constexpr (L::kFloatOffsets) offset = f16_to_vec(rec + 2 * kPanel);
    } else {
      if (gi % L::kSuperGroups == 0) {
        d_super = f16_to_vec(L::super(panel, gi));
        dmin_super = f16_to_vec(L::super(panel, gi) + 2 * kPanel);
      }
      scale = _mm512_mul_ps(d_super, u8_to_vec(rec));
      offset = vneg(_mm512_mul_ps(dmin_super, u8_to_vec(rec + kPanel)));
    }
    const uint8_t* q = rec + L::kGroupHeader;
    const __m512i high = _mm512_loadu_si512(q + L::kLowBytes);
    __m512i dot[ROWS];
    zero_dots(dot);
    const int32_t* a_lo = quads + (g0 / 4) * ROWS;
    const int32_t* a_hi = quads + ((g0 + 16) / 4) * ROWS;
    five_bit_step<ROWS, 0>(q, high, a_lo, a_hi, dot);
    five_bit_step<ROWS, 1>(q, high, a_lo, a_hi, dot);
    five_bit_step<ROWS, 2>(q, high, a_lo, a_hi, dot);
    five_bit_step<ROWS, 3>(q, high, a_lo, a_hi, dot);
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      if constexpr (!L::kFloatOffsets) {
        const int32_t* sg = static_cast<const int32_t*>(sums) + gi * ROWS;
        dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(16 * sg[r]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, _mm512_set1_ps(dg[r])), acc[r]);
      if constexpr (L::kFloatOffsets) {
        const float* cg = static_cast<const float*>(sums) + gi * ROWS;
        acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(cg[r]), acc[r]);
      }
    }
  }
  store_tile(acc, y, N, p, bias);
}

template <typename L, int... R>
constexpr std::array<Q8TileFn, sizeof...(R)> q8five_table(std::integer_sequence<int, R...>) {
  return {&q8five_tile<L, R + 1>...};
}

template <typename L>
void q8five_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* wq, int64_t p_begin, float* y,
                   int64_t N, const float* bias) {
  static constexpr auto table = q8five_table<L>(std::make_integer_sequence<int, kVnniRows>{});
  const void* sums = L::kFloatOffsets ? static_cast<const void*>(a.ds32) : static_cast<const void*>(a.s32);
  q8_run_tiles(table.data(), a, sums, K / 32, M, K, wq, p_begin, y, N, bias);
}

constexpr bool kHaveFiveBitTiles = true;
#elif defined(__AVX2__)

// One 32-byte half of step t's two vectors of u (see the VNNI five_bit_u).
template <int T>
inline void five_bit_u_avx2(__m256i v, __m256i high, __m256i& u0, __m256i& u1) {
  const __m256i low4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
  const __m256i h0 = _mm256_slli_epi16(high, 4 - T);
  const __m256i h1 = T == 0 ? high : _mm256_srli_epi16(high, T);
  u0 = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(h0, bit4));
  u1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(h1, bit4));
}

// Rows [0, ROWS) times step t of both halves: u * a needs no sign trick (u <= 31), and a step's
// pair sums add up in int16 (at most 4 * 31 * 127) before they widen into dot.
template <int ROWS, int T>
inline void five_bit_step_avx2(const uint8_t* q, __m256i ha, __m256i hb, const int32_t* a_lo, const int32_t* a_hi,
                               __m256i (&dot)[ROWS][2]) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256i u0a, u1a, u0b, u1b;
  five_bit_u_avx2<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + T * 64)), ha, u0a, u1a);
  five_bit_u_avx2<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + T * 64 + 32)), hb, u0b, u1b);
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    const __m256i a0 = _mm256_set1_epi32(a_lo[T * ROWS + r]);
    const __m256i a1 = _mm256_set1_epi32(a_hi[T * ROWS + r]);
    const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(u0a, a0), _mm256_maddubs_epi16(u1a, a1));
    const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(u0b, a0), _mm256_maddubs_epi16(u1b, a1));
    dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(pa, ones16));
    dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(pb, ones16));
  }
}

template <typename L, int ROWS>
void q8five_tile_avx2(const int32_t* quads, const float* d_t, const void* sums, int64_t M, int64_t K,
                      const uint8_t* panel, int64_t p, float* y, int64_t N, const float* bias) {
  __m256 acc[ROWS][2], d_super[2], dmin_super[2];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 32) {
    const int64_t gi = g0 / 32;
    const uint8_t* rec = L::group_prefetching(panel, gi);
    __m256 scale[2], offset[2];
    if constexpr (L::kHalfScales) {
      for (int h = 0; h < 2; ++h) {
        scale[h] = f16x8(rec + 16 * h);
        if constexpr (L::kFloatOffsets) offset[h] = f16x8(rec + 2 * kPanel + 16 * h);
      }
    } else {
      if (gi % L::kSuperGroups == 0)
        for (int h = 0; h < 2; ++h) {
          d_super[h] = f16x8(L::super(panel, gi) + 16 * h);
          dmin_super[h] = f16x8(L::super(panel, gi) + 2 * kPanel + 16 * h);
        }
      for (int h = 0; h < 2; ++h) {
        scale[h] = _mm256_mul_ps(d_super[h], u8x8(rec + 8 * h));
        offset[h] = neg8(_mm256_mul_ps(dmin_super[h], u8x8(rec + kPanel + 8 * h)));
      }
    }
    const uint8_t* q = rec + L::kGroupHeader;
    const __m256i ha = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + L::kLowBytes));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + L::kLowBytes + 32));
    const int32_t* a_lo = quads + (g0 / 4) * ROWS;
    const int32_t* a_hi = quads + ((g0 + 16) / 4) * ROWS;
    __m256i dot[ROWS][2];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    five_bit_step_avx2<ROWS, 0>(q, ha, hb, a_lo, a_hi, dot);
    five_bit_step_avx2<ROWS, 1>(q, ha, hb, a_lo, a_hi, dot);
    five_bit_step_avx2<ROWS, 2>(q, ha, hb, a_lo, a_hi, dot);
    five_bit_step_avx2<ROWS, 3>(q, ha, hb, a_lo, a_hi, dot);
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m256 vd = _mm256_set1_ps(dg[r]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        if constexpr (!L::kFloatOffsets) {
          const int32_t S = static_cast<const int32_t*>(sums)[gi * ROWS + r];
          dot[r][h] = _mm256_sub_epi32(dot[r][h], _mm256_set1_epi32(16 * S));
        }
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(scale[h], vd), acc[r][h]);
        if constexpr (L::kFloatOffsets) {
          const float dS = static_cast<const float*>(sums)[gi * ROWS + r];
          acc[r][h] = _mm256_fmadd_ps(offset[h], _mm256_set1_ps(dS), acc[r][h]);
        }
      }
    }
  }
  store_panel_rows<ROWS>(acc, y, N, p, bias);
}

template <typename L>
void q8five_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                   int64_t N, const float* bias) {
  avx2_tiles(M, [&](int64_t m0, auto rows) {
    // per group and row: d * S (float offsets: Q5_K, Q5_1) or S (Q5_0, int32), a word each
    const void* sums = L::kFloatOffsets ? static_cast<const void*>(a.ds32 + K / kActBlock * m0)
                                        : static_cast<const void*>(a.s32 + K / 32 * m0);
    q8five_tile_avx2<L, decltype(rows)::value>(a.quads + K / 4 * m0, a.d_t + K / kActBlock * m0, sums, M, K, panel,
                                               p, y + m0 * N, N, bias);
  });
}

constexpr bool kHaveFiveBitTiles = true;
#else
template <typename L>
void q8five_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                   int64_t N, const float* bias) {
  q8five_reference_panel<L>(a, M, K, panel, p, y, N, bias);
}
constexpr bool kHaveFiveBitTiles = false;
#endif

// Five-bit panels of layout L: the VNNI or AVX2 tiles, or the scalar reference.
template <typename L>
void q8five_run_unit(const QuantizedRows& a, const uint8_t* wq, int64_t g, float* y, int64_t N, const float* bias,
                     bool reference) {
  q8_layout_unit<&L::panel_bytes, &q8five_reference_panel<L>, &q8five_vector<L>>(a, wq, g, y, N, bias, reference);
}

}  // namespace selfspec
