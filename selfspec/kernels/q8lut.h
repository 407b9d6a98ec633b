#pragma once

// Speed mode gguf-q8, 4-bit indices into 16 levels as nibble panels: IQ4_XS (LutLayout, linear.h:
// 4.31 bits a weight instead of the byte layout's 9), Q4_0 and IQ4_NL (HalfLutLayout: 4.5 instead
// of 6 and 9). Each tile looks the levels up in registers (one byte shuffle per vector) and then
// multiplies as the byte layout does: the same integers, so the same bits as the byte layout's
// tiles and the scalar reference.

#include "q8.h"

namespace selfspec {

// ggml's kvalues_iq4nl (IQ4_XS, IQ4_NL), and Q4_0's q - 8.
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kQ4Levels[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

// A nibble panel layout and the 16 levels its nibbles select.
template <typename LAYOUT, const int8_t* LEVELS>
struct LutFormat {
  using L = LAYOUT;
  static constexpr const int8_t* kLevels = LEVELS;
  // level + 128 of lane j, k = kk of a group record (past its header)
  static int32_t u(const uint8_t* q, int j, int kk) {
    const uint8_t byte = q[(kk % 16) / 4 * 64 + j * 4 + kk % 4];
    return LEVELS[kk < 16 ? (byte & 15) : (byte >> 4)] + 128;
  }
};
using Iq4XsNibbles = LutFormat<LutLayout, kIq4Levels>;
using Iq4NlNibbles = LutFormat<HalfLutLayout, kIq4Levels>;
using Q4_0Nibbles = LutFormat<HalfLutLayout, kQ4Levels>;

// The byte layout's formula over nibble panels: I = sum (level + 128) * a - 128 * S.
template <typename F>
void q8lut_reference_panel(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                           int64_t N, const float* bias) {
  using L = typename F::L;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    for (int64_t g0 = 0; g0 < K; g0 += 32) {
      alignas(64) float scale[kPanel];
      L::scale_array(panel, g0 / 32, scale);
      const uint8_t* q = L::group(panel, g0 / 32) + L::kGroupHeader;
      const int8_t* am = a.q + m * K + g0;
      const float d = a.d[m * (K / kActBlock) + g0 / kActBlock];
      const int32_t S = group_sum<32>(a.sums16 + m * (K / 16), g0);
      for (int j = 0; j < kPanel; ++j) {
        int32_t I = 0;
        for (int kk = 0; kk < 32; ++kk) I += F::u(q, j, kk) * am[kk];
        acc[j] = std::fma(static_cast<float>(I - 128 * S), scale[j] * d, acc[j]);
      }
    }
    for (int j = 0; j < kPanel; ++j) y[m * N + p * kPanel + j] = bias ? acc[j] + bias[p * kPanel + j] : acc[j];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
// As q8tile over nibble panels: each 64-byte vector gives two vectors of levels + 128 (a byte
// shuffle per 128-bit lane), multiplied as the byte layout's, then 128 * S subtracted per group.
template <typename F, int ROWS>
void q8lut_tile(const int32_t* quads, const float* d_t, const void* s32_v, int64_t M, int64_t K,
                const uint8_t* wq, int64_t p, float* y, int64_t N, const float* bias) {
  using L = typename F::L;
  const int32_t* s32 = static_cast<const int32_t*>(s32_v);
  const uint8_t* panel = wq + p * L::panel_bytes(K);
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i levels = _mm512_broadcast_i32x4(
      _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F::kLevels)), _mm_set1_epi8(-128)));
  __m512 acc[ROWS], d_super = _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 32) {
    const int64_t gi = g0 / 32;
    const uint8_t* rec = L::group_prefetching(panel, gi);
    __m512 scale;
    if constexpr (L::kHalfScales) {
      scale = f16_to_vec(rec);
    } else {
      if (gi % L::kSuperGroups == 0) d_super = f16_to_vec(L::super(panel, gi));
      scale = _mm512_mul_ps(d_super, i8_to_vec(rec));
    }
    const uint8_t* q = rec + L::kGroupHeader;
    __m512i dot[ROWS];
    zero_dots(dot);
    const int32_t* a_lo = quads + (g0 / 4) * ROWS;
    const int32_t* a_hi = quads + ((g0 + 16) / 4) * ROWS;
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(q + t * 64);
      const __m512i u0 = _mm512_shuffle_epi8(levels, _mm512_and_si512(v, low4));
      const __m512i u1 = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        dot[r] = _mm512_dpbusd_epi32(dot[r], u0, _mm512_set1_epi32(a_lo[t * ROWS + r]));
        dot[r] = _mm512_dpbusd_epi32(dot[r], u1, _mm512_set1_epi32(a_hi[t * ROWS + r]));
      }
    }
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
    const int32_t* sg = s32 + (g0 / 32) * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m512i I = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * sg[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(scale, _mm512_set1_ps(dg[r])), acc[r]);
    }
  }
  store_tile(acc, y, N, p, bias);
}

template <typename F, int... R>
constexpr std::array<Q8TileFn, sizeof...(R)> q8lut_table(std::integer_sequence<int, R...>) {
  return {&q8lut_tile<F, R + 1>...};
}

template <typename F>
void q8lut_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* wq, int64_t p_begin, float* y,
                  int64_t N, const float* bias) {
  static constexpr auto table = q8lut_table<F>(std::make_integer_sequence<int, kVnniRows>{});
  q8_run_tiles(table.data(), a, a.s32, K / 32, M, K, wq, p_begin, y, N, bias);
}

constexpr bool kHaveLutTiles = true;
#elif defined(__AVX2__)

// As q8tile_avx2's byte formats over nibble panels: the levels themselves (int8) looked up by a
// byte shuffle, then the sign trick (|level| <= 127, so no pair of vpmaddubsw saturates).
template <typename F, int ROWS>
void q8lut_tile_avx2(const int32_t* quads, const float* d_t, int64_t M, int64_t K, const uint8_t* panel,
                     int64_t p, float* y, int64_t N, const float* bias) {
  using L = typename F::L;
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i levels =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F::kLevels)));
  __m256 acc[ROWS][2], d_super[2];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 32) {
    const int64_t gi = g0 / 32;
    const uint8_t* rec = L::group_prefetching(panel, gi);
    __m256 scale[2];
    if constexpr (L::kHalfScales) {
      scale[0] = f16x8(rec), scale[1] = f16x8(rec + 16);
    } else {
      if (gi % L::kSuperGroups == 0)
        for (int h = 0; h < 2; ++h) d_super[h] = f16x8(L::super(panel, gi) + 16 * h);
      scale[0] = _mm256_mul_ps(d_super[0], i8x8(rec)), scale[1] = _mm256_mul_ps(d_super[1], i8x8(rec + 8));
    }
    const uint8_t* q = rec + L::kGroupHeader;
    const int32_t* a_lo = quads + (g0 / 4) * ROWS;
    const int32_t* a_hi = quads + ((g0 + 16) / 4) * ROWS;
    __m256i dot[ROWS][2];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int t = 0; t < 4; ++t) {
      __m256i w[2][2], w_abs[2][2];  // [nibble half][panel half]
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * 64 + 32 * h));
        w[0][h] = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, low4));
        w[1][h] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
        w_abs[0][h] = _mm256_sign_epi8(w[0][h], w[0][h]);
        w_abs[1][h] = _mm256_sign_epi8(w[1][h], w[1][h]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        const __m256i a0 = _mm256_set1_epi32(a_lo[t * ROWS + r]);
        const __m256i a1 = _mm256_set1_epi32(a_hi[t * ROWS + r]);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          dot[r][h] = add_dot4(dot[r][h], w_abs[0][h], _mm256_sign_epi8(a0, w[0][h]));
          dot[r][h] = add_dot4(dot[r][h], w_abs[1][h], _mm256_sign_epi8(a1, w[1][h]));
        }
      }
    }
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m256 vd = _mm256_set1_ps(dg[r]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(scale[h], vd), acc[r][h]);
    }
  }
  store_panel_rows<ROWS>(acc, y, N, p, bias);
}

template <typename F>
void q8lut_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y, int64_t N,
                  const float* bias) {
  avx2_tiles(M, [&](int64_t m0, auto rows) {
    q8lut_tile_avx2<F, decltype(rows)::value>(a.quads + K / 4 * m0, a.d_t + K / kActBlock * m0, M, K, panel, p,
                                              y + m0 * N, N, bias);
  });
}

constexpr bool kHaveLutTiles = true;
#else
template <typename F>
void q8lut_vector(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y, int64_t N,
                  const float* bias) {
  q8lut_reference_panel<F>(a, M, K, panel, p, y, N, bias);
}
constexpr bool kHaveLutTiles = false;
#endif

// Nibble panels of format F: the VNNI or AVX2 tiles, or the scalar reference.
template <typename F>
void q8lut_run_unit(const QuantizedRows& a, const uint8_t* wq, int64_t g, float* y, int64_t N, const float* bias,
                    bool reference) {
  q8_layout_unit<&F::L::panel_bytes, &q8lut_reference_panel<F>, &q8lut_vector<F>>(a, wq, g, y, N, bias,
                                                                                   reference);
}

}  // namespace selfspec
