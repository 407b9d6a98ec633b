#pragma once

// Speed mode gguf-q8, Q6_K as six-bit panels (SixBitLayout, linear.h): the file's 6.56 bits a
// weight instead of the byte layout's 10. Same integers as the byte layout, so the same bits: the
// scalar reference, the VNNI tiles and the AVX2 tiles.

#include "q8.h"

namespace selfspec {

// The same formula over six-bit panels (SixBitLayout): I = sum u * a - 32 * S, the integer the
// byte layout gives (u = q + 32), so the same bits.
inline void q8six_reference_panel(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p,
                                  float* y, int64_t N, const float* bias) {
  using L = SixBitLayout;
  const int8_t* aq = a.q;
  const float* ad = a.d;
  const int32_t* as = a.sums16;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    for (int64_t g0 = 0; g0 < K; g0 += 16) {
      alignas(64) float scale[kPanel];
      L::scale_array(panel, g0 / 16, scale);
      const uint8_t* q = L::group(panel, g0 / 16) + L::kGroupHeader;
      const int8_t* am = aq + m * K + g0;
      const float d = ad[m * (K / kActBlock) + g0 / kActBlock];
      const int32_t S = as[m * (K / 16) + g0 / 16];
      for (int j = 0; j < kPanel; ++j) {
        int32_t I = 0;
        for (int kk = 0; kk < 16; ++kk) I += L::u(q, j, kk) * am[kk];
        acc[j] = std::fma(static_cast<float>(I - 32 * S), scale[j] * d, acc[j]);
      }
    }
    for (int j = 0; j < kPanel; ++j) y[m * N + p * kPanel + j] = bias ? acc[j] + bias[p * kPanel + j] : acc[j];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
template <int ROWS, int T>
inline void six_bit_step(const uint8_t* q, __m512i high, const int32_t* a, __m512i (&dot)[ROWS]) {
  const __m512i u = six_bit_u<T>(_mm512_loadu_si512(q + T / 2 * 64), high);
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], u, _mm512_set1_epi32(a[T * ROWS + r]));
}

// As q8tile, over six-bit panels (G = 16): rows [0, ROWS) times panel p.
template <int ROWS>
void q8six_tile(const int32_t* quads, const float* d_t, const void* s16_v, int64_t M, int64_t K,
                const uint8_t* wq, int64_t p, float* y, int64_t N, const float* bias) {
  using L = SixBitLayout;
  const int32_t* s16 = static_cast<const int32_t*>(s16_v);
  const uint8_t* panel = wq + p * L::panel_bytes(K);
  __m512 acc[ROWS], d_super = _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 16) {
    const int64_t gi = g0 / 16;
    if (gi % L::kSuperGroups == 0) d_super = f16_to_vec(L::super(panel, gi));
    const uint8_t* rec = L::group_prefetching(panel, gi);
    const __m512 scale = _mm512_mul_ps(d_super, i8_to_vec(rec));
    const uint8_t* q = rec + L::kGroupHeader;
    const __m512i high = _mm512_loadu_si512(q + L::kLowBytes);
    __m512i dot[ROWS];
    zero_dots(dot);
    const int32_t* a = quads + (g0 / 4) * ROWS;
    six_bit_step<ROWS, 0>(q, high, a, dot);
    six_bit_step<ROWS, 1>(q, high, a, dot);
    six_bit_step<ROWS, 2>(q, high, a, dot);
    six_bit_step<ROWS, 3>(q, high, a, dot);
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
    const int32_t* sg = s16 + gi * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m512i I = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(32 * sg[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(scale, _mm512_set1_ps(dg[r])), acc[r]);
    }
  }
  store_tile(acc, y, N, p, bias);
}

template <int... R>
constexpr std::array<Q8TileFn, sizeof...(R)> q8six_table(std::integer_sequence<int, R...>) {
  return {&q8six_tile<R + 1>...};
}

// One panel group of six-bit panels, tile by tile as q8_run_group.
inline void q8six_run_group(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* wq, int64_t p_begin,
                            float* y, int64_t N, const float* bias) {
  static constexpr auto table = q8six_table(std::make_integer_sequence<int, kVnniRows>{});
  q8_run_tiles(table.data(), a, a.s16, K / 16, M, K, wq, p_begin, y, N, bias);
}

constexpr Q8PanelFn kSixBitVector = &q8six_run_group;
constexpr bool kHaveSixBitTiles = true;
#elif defined(__AVX2__)

// Rows [0, ROWS) of a tile times two steps of six-bit weights (u = q + 32 in [0, 63], both halves
// of the panel, steps t and t + 1): u * a needs no sign trick, and the pair sums of both steps add
// up in int16 (at most 4 * 63 * 127), then widen once into dot.
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

// Six-bit panels (SixBitLayout): per pair of steps, u rebuilt from a low-nibble vector and the
// group's high-pair vector (16-bit shifts bring bits 2t..2t+1 to bits 4..5; the mask drops what
// crossed from the neighbouring byte), then six_bit_rows.
template <int T>
inline __m256i six_bit_high(__m256i h) {
  if constexpr (T == 0) return _mm256_slli_epi16(h, 4);
  if constexpr (T == 1) return _mm256_slli_epi16(h, 2);
  if constexpr (T == 2) return h;
  return _mm256_srli_epi16(h, 2);
}

template <int ROWS, int T>
inline void six_bit_steps(const uint8_t* q, __m256i ha, __m256i hb, const int32_t* a,
                          __m256i (&dot)[ROWS][2]) {
  const __m256i low4 = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(0x30);
  const __m256i la = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + T / 2 * 64));
  const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + T / 2 * 64 + 32));
  const __m256i u0a = _mm256_or_si256(_mm256_and_si256(la, low4), _mm256_and_si256(six_bit_high<T>(ha), high2));
  const __m256i u0b = _mm256_or_si256(_mm256_and_si256(lb, low4), _mm256_and_si256(six_bit_high<T>(hb), high2));
  const __m256i u1a = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4),
                                      _mm256_and_si256(six_bit_high<T + 1>(ha), high2));
  const __m256i u1b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                                      _mm256_and_si256(six_bit_high<T + 1>(hb), high2));
  six_bit_rows<ROWS>(u0a, u0b, u1a, u1b, a + T * ROWS, a + (T + 1) * ROWS, dot);
}

template <int ROWS>
void q8six_tile_avx2(const int32_t* quads, const float* d_t, const int32_t* s16, int64_t M, int64_t K,
                     const uint8_t* panel, int64_t p, float* y, int64_t N, const float* bias) {
  using L = SixBitLayout;
  __m256 acc[ROWS][2], d_super[2];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += 16) {
    const int64_t gi = g0 / 16;
    if (gi % L::kSuperGroups == 0)
      for (int h = 0; h < 2; ++h) d_super[h] = f16x8(L::super(panel, gi) + 16 * h);
    const uint8_t* rec = L::group_prefetching(panel, gi);
    const __m256 scale[2] = {_mm256_mul_ps(d_super[0], i8x8(rec)), _mm256_mul_ps(d_super[1], i8x8(rec + 8))};
    const uint8_t* q = rec + L::kGroupHeader;
    const __m256i ha = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + L::kLowBytes));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + L::kLowBytes + 32));
    const int32_t* a = quads + (g0 / 4) * ROWS;
    __m256i dot[ROWS][2];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    six_bit_steps<ROWS, 0>(q, ha, hb, a, dot);
    six_bit_steps<ROWS, 2>(q, ha, hb, a, dot);
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
    const int32_t* sg = s16 + gi * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m256 vd = _mm256_set1_ps(dg[r]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i I = _mm256_sub_epi32(dot[r][h], _mm256_set1_epi32(32 * sg[r]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(scale[h], vd), acc[r][h]);
      }
    }
  }
  store_panel_rows<ROWS>(acc, y, N, p, bias);
}

inline void q8six_panel_avx2(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p,
                             float* y, int64_t N, const float* bias) {
  constexpr int kRows = kAvx2Rows;
  const int32_t* quads = a.quads;
  const float* d_t = a.d_t;
  const int32_t* s16 = a.s16;
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
    auto* tile = rows == 4   ? &q8six_tile_avx2<4>
                 : rows == 3 ? &q8six_tile_avx2<3>
                 : rows == 2 ? &q8six_tile_avx2<2>
                             : &q8six_tile_avx2<1>;
    tile(quads + K / 4 * m0, d_t + K / kActBlock * m0, s16 + K / 16 * m0, M, K, panel, p, y + m0 * N, N, bias);
  }
}

constexpr Q8PanelFn kSixBitVector = &q8six_panel_avx2;
constexpr bool kHaveSixBitTiles = true;
#else
constexpr Q8PanelFn kSixBitVector = &q8six_reference_panel;
constexpr bool kHaveSixBitTiles = false;
#endif

// Six-bit panels: the VNNI or AVX2 tiles, or the scalar reference. The tiles unpack each weight
// vector once per tile of rows. Passes gain from the fewer bytes while memory-bound; over 16 rows
// and more the unpacking costs about what the bytes save (README: the 2026-11-24 and 2026-11-25
// kernel changes).
inline void q8six_run_unit(const QuantizedRows& a, const uint8_t* wq, int64_t g, float* y, int64_t N,
                           const float* bias, bool reference) {
  q8_layout_unit<&SixBitLayout::panel_bytes, &q8six_reference_panel, kSixBitVector>(a, wq, g, y, N, bias, reference);
}

}  // namespace selfspec
