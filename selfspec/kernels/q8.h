#pragma once

#include <cstring>

#include "linear.h"

namespace selfspec {

// ---------------------------------------------------------------------------------------------
// Speed mode "gguf-q8": the file's integers times activations rounded to 8 bits, summed with
// integer dot products (AVX-512 VNNI: 64 byte products per instruction instead of 16 float
// multiply-adds), as llama.cpp does. This changes the numerics: not the float32 model's logits.
//
// Activations, per row and per block of 32 k: d = max|x| / 127, a = nearbyint(x * (127 / max|x|))
// as int8 (all zero when max|x| is 0), and the sums S of a over each 16 k.
// Weights: the layouts above, except how each group's integers are arranged: per 4 consecutive k,
// 16 lanes x 4 bytes (one vpdpbusd operand). Nibble formats: vector t of a group holds k = 4t..4t+3
// in its low nibbles and k = G/2 + 4t.. in its high nibbles. Byte formats hold q + 128 as uint8.
// Per group g of output n and row m, in k order (one rounding per step, whatever the tile shape or
// instruction set, so rows never depend on each other and the fallback gives the same bits):
//   I = sum_k q[n, k] * a[m, k]  (exact int32)   - 128 * S    for byte formats
//   y = fma(float(I), scale[n, g] * d[m, b(g)], y)
//   y = fma(offset[n, g], d[m, b(g)] * float(S), y)          for formats with an offset
// then y + bias.
constexpr int kActBlock = 32;
constexpr int64_t kSerialRoundingBlocks = 256;  // activation blocks one thread rounds alone

// How the vector paths cut a pass's rows into tiles; the runs below and the activations' layout
// (q8_tile_height) both follow these. A VNNI tile holds up to kVnniRows rows of one panel, an AVX2
// tile kAvx2Rows. One panel at a time, even for one row: each thread then reads its weights as one
// stream, which the memory system serves faster than several panels read side by side (README,
// "2026-11-25 (night)").
//
// An AVX2 tile's time is a share for the tile (the weights' unpacking) and a share for each row
// (its integer products): a tile of 5-8 rows spills some integer sums to the stack, which costs
// less than a second tile for the rows past 4 (docs/history.md, 2026-12-06). Byte formats (Q8_0)
// need more registers a step: their tiles stop at kAvx2ByteRows, and a taller block runs as two.
constexpr int kVnniRows = 12;
constexpr int kAvx2Rows = 8;
constexpr int kAvx2ByteRows = 6;

// Rows of a vector tile: the vector paths take the rows of a pass in blocks of this height (the
// last one shorter), the rows the activations interleave; a block is one tile, or on AVX2 for
// byte formats past kAvx2ByteRows rows two.
inline int64_t q8_tile_height(int64_t M) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  return kVnniRows;
#elif defined(__AVX2__)
  return kAvx2Rows;
#else
  return M;
#endif
}

// Where row m's entries lie in an interleaved array: rows grouped tile by tile (q8_tile_height),
// each tile's entries contiguous step after step, so that a tile starting at row m0 reads step i
// of its row r at (steps * m0) + i * ROWS + r, one pointer plus a constant per row, with no address
// arithmetic in the inner loop (a tile of part of a block, rows r0.. of it: (steps * m0) + i *
// the block's rows + r0 + r). ``at(steps, i)``: step i of an array of ``steps`` steps per row.
struct TileMajor {
  int64_t m0, rows, r;
  TileMajor(int64_t M, int64_t height, int64_t m)
      : m0(m - m % height), rows(std::min(height, M - (m - m % height))), r(m % height) {}
  int64_t at(int64_t steps, int64_t i) const { return steps * m0 + i * rows + r; }
};

struct QuantizedRows {
  at::Tensor storage;  // owns every array below: one allocation a call, not nine tensors
  int64_t M, K;
  int8_t* q;        // [M, K]
  float* d;         // [M, K / 32]
  int32_t* sums16;  // [M, K / 16]
  // The same, interleaved for the vector tiles (TileMajor over M rows, q8_tile_height):
  int32_t* quads;  // K / 4 steps: a[m, 4i..4i+3] as one little-endian int32 word
  float* d_t;      // K / 32 steps: d, float32
  int32_t* s16;    // K / 16 steps: S over those 16 k, int32
  int32_t* s32;    // K / 32 steps: S over those 32 k, int32
  float* ds32;     // K / 32 steps: d * float(S over those 32 k), float32
};

// Room for M rows of K in one byte tensor, each array starting on a cache line.
inline QuantizedRows allocate_rows(int64_t M, int64_t K) {
  const int64_t words[] = {M * K / 4, M * K / kActBlock, M * K / 16, M * K / 4, M * K / kActBlock, M * K / 16,
                           M * K / kActBlock, M * K / kActBlock};
  int64_t offsets[8], total = 0;
  for (int i = 0; i < 8; ++i) {
    offsets[i] = total;
    total += (words[i] * 4 + 63) / 64 * 64;
  }
  QuantizedRows out{at::empty({total + 64}, at::kByte), M, K};
  uint8_t* base = out.storage.data_ptr<uint8_t>();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  out.q = reinterpret_cast<int8_t*>(base + offsets[0]);
  out.d = reinterpret_cast<float*>(base + offsets[1]);
  out.sums16 = reinterpret_cast<int32_t*>(base + offsets[2]);
  out.quads = reinterpret_cast<int32_t*>(base + offsets[3]);
  out.d_t = reinterpret_cast<float*>(base + offsets[4]);
  out.s16 = reinterpret_cast<int32_t*>(base + offsets[5]);
  out.s32 = reinterpret_cast<int32_t*>(base + offsets[6]);
  out.ds32 = reinterpret_cast<float*>(base + offsets[7]);
  return out;
}

inline QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kActBlock == 0, "in_features ", K, " is not a multiple of ", kActBlock);
  QuantizedRows out = allocate_rows(M, K);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = out.q;
  float* dp = out.d;
  int32_t* sp = out.sums16;
  int32_t* quads = out.quads;
  float* d_t = out.d_t;
  int32_t* s16 = out.s16;
  int32_t* s32 = out.s32;
  float* ds32 = out.ds32;
  const int64_t blocks = K / kActBlock;
  const int64_t height = q8_tile_height(M);
  // Work comes as (tile, block) units, every row of the tile: the interleaved arrays interleave a
  // tile's rows word by word, so threads that split a tile's rows would write the same cache lines.
  const int64_t tiles = (M + height - 1) / height;
  // a few rows are less work than waking the other threads
  const int64_t grain = std::max<int64_t>(8, kSerialRoundingBlocks / std::max<int64_t>(1, std::min(M, height)));
  at::parallel_for(0, tiles * blocks, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t m0 = u / blocks * height, i = u % blocks;
      for (int64_t m = m0; m < std::min(M, m0 + height); ++m) {
        const int64_t b = m * blocks + i;
        const TileMajor tm(M, height, m);
        const float* xb = xp + b * kActBlock;
        int8_t* qb = qp + b * kActBlock;
#if defined(__AVX512F__)
        // the same arithmetic 16 lanes at a time: max is exact, the products round alike, and the
        // conversion rounds to nearest even as nearbyint does in the default rounding mode
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        const __m512i a1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(a0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(a1));
        const int32_t s0 = _mm512_reduce_add_epi32(a0), s1 = _mm512_reduce_add_epi32(a1);
#else
        float amax = 0.0f;
        for (int j = 0; j < kActBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s0 = 0, s1 = 0;
        for (int j = 0; j < kActBlock; ++j) {
          const int8_t a = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
          qb[j] = a;
          (j < 16 ? s0 : s1) += a;
        }
#endif
        const float d = amax / 127.0f;
        dp[b] = d;
        sp[2 * b] = s0;
        sp[2 * b + 1] = s1;
        for (int j = 0; j < kActBlock / 4; ++j) {
          int32_t word;
          std::memcpy(&word, qb + 4 * j, 4);
          quads[tm.at(K / 4, i * (kActBlock / 4) + j)] = word;
        }
        d_t[tm.at(blocks, i)] = d;
        s16[tm.at(K / 16, 2 * i)] = s0;
        s16[tm.at(K / 16, 2 * i + 1)] = s1;
        s32[tm.at(blocks, i)] = s0 + s1;
        ds32[tm.at(blocks, i)] = d * static_cast<float>(s0 + s1);
      }
    }
  });
  return out;
}

template <int G>
inline int32_t group_sum(const int32_t* sums16, int64_t g0) {
  return G == 16 ? sums16[g0 / 16] : sums16[g0 / 16] + sums16[g0 / 16 + 1];
}

// Scalar version of the formula: the reference the vector tiles are tested against.
template <int FORMAT, int G>
void q8_reference_panel(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                        int64_t N, const float* bias) {
  using L = Layout<FORMAT, G>;
  const int8_t* aq = a.q;
  const float* ad = a.d;
  const int32_t* as = a.sums16;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    for (int64_t g0 = 0; g0 < K; g0 += G) {
      float scale[kPanel], offset[kPanel];
      L::scale_arrays(panel, g0 / G, scale, offset);
      const uint8_t* q = L::group(panel, g0 / G) + L::kGroupHeader;
      const int8_t* am = aq + m * K + g0;
      const float d = ad[m * (K / kActBlock) + g0 / kActBlock];
      const int32_t S = group_sum<G>(as + m * (K / 16), g0);
      for (int j = 0; j < kPanel; ++j) {
        int32_t I = 0;
        for (int kk = 0; kk < G; ++kk) {
          int32_t w;
          if constexpr (L::kNibbleQ) {
            const uint8_t byte = q[(kk % (G / 2)) / 4 * 64 + j * 4 + kk % 4];
            w = kk < G / 2 ? (byte & 15) : (byte >> 4);
          } else {
            w = q[kk / 4 * 64 + j * 4 + kk % 4];
          }
          I += w * am[kk];
        }
        if constexpr (!L::kNibbleQ) I -= 128 * S;
        acc[j] = std::fma(static_cast<float>(I), scale[j] * d, acc[j]);
        if constexpr (FORMAT != kBytes) acc[j] = std::fma(offset[j], d * static_cast<float>(S), acc[j]);
      }
    }
    for (int j = 0; j < kPanel; ++j) y[m * N + p * kPanel + j] = bias ? acc[j] + bias[p * kPanel + j] : acc[j];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr bool kHaveVnni = true;

// A tile's integer sums, zeroed at the start of each group.
template <int ROWS>
inline void zero_dots(__m512i (&dot)[ROWS]) {
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_si512();
}

// A tile's rows of panel p, plus the bias, into y.
template <int ROWS>
inline void store_tile(const __m512 (&acc)[ROWS], float* y, int64_t N, int64_t p, const float* bias) {
  for (int r = 0; r < ROWS; ++r) {
    __m512 out = acc[r];
    if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + p * kPanel));
    _mm512_storeu_ps(y + r * N + p * kPanel, out);
  }
}

// Rows [0, ROWS) times panel p over all of K. Per group, the integer sums of every row stay in
// registers, then fold into the float accumulators. Activations come interleaved by row
// (QuantizedRows::quads, d_t and, per group, S for byte formats or d * S for nibble formats; this
// tile's block of each, row stride ROWS: TileMajor), so each step reaches every row from one
// pointer plus a constant.
template <int FORMAT, int G, int ROWS>
void q8tile(const int32_t* quads, const float* d_t, const void* group_sums, int64_t M, int64_t K,
            const uint8_t* wq, int64_t p, float* y, int64_t N, const float* bias) {
  using L = Layout<FORMAT, G>;
  constexpr int kSteps = L::kNibbleQ ? G / 8 : G / 4;  // 64-byte weight vectors per group
  const uint8_t* panel = wq + p * L::panel_bytes(K);
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  typename L::ScaleReader reader;
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    __m512 scale, offset;
    const uint8_t* q = L::group_prefetching(panel, g0 / G) + L::kGroupHeader;
    reader.read(panel, g0 / G, 0, scale, offset);
    __m512i dot[ROWS];
    zero_dots(dot);
    const int32_t* a_lo = quads + (g0 / 4) * ROWS;
    const int32_t* a_hi = quads + ((g0 + G / 2) / 4) * ROWS;
#pragma GCC unroll 8
    for (int t = 0; t < kSteps; ++t) {
      const __m512i v = _mm512_loadu_si512(q + t * 64);
      const __m512i w0 = L::kNibbleQ ? _mm512_and_si512(v, low4) : v;
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        dot[r] = _mm512_dpbusd_epi32(dot[r], w0, _mm512_set1_epi32(a_lo[t * ROWS + r]));
        if constexpr (L::kNibbleQ) dot[r] = _mm512_dpbusd_epi32(dot[r], w1, _mm512_set1_epi32(a_hi[t * ROWS + r]));
      }
    }
    const float* dg = d_t + (g0 / kActBlock) * ROWS;
    const int32_t* sg = static_cast<const int32_t*>(group_sums) + (g0 / G) * ROWS;
    const float* cg = static_cast<const float*>(group_sums) + (g0 / G) * ROWS;
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      __m512i I = dot[r];
      if constexpr (!L::kNibbleQ) I = _mm512_sub_epi32(I, _mm512_set1_epi32(128 * sg[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(scale, _mm512_set1_ps(dg[r])), acc[r]);
      if constexpr (FORMAT != kBytes) acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(cg[r]), acc[r]);
    }
  }
  store_tile(acc, y, N, p, bias);
}

using Q8TileFn = void (*)(const int32_t*, const float*, const void*, int64_t, int64_t, const uint8_t*, int64_t,
                          float*, int64_t, const float*);

template <int FORMAT, int G, int... R>
constexpr std::array<Q8TileFn, sizeof...(R)> q8tile_table(std::integer_sequence<int, R...>) {
  return {&q8tile<FORMAT, G, R + 1>...};
}

// One panel group's tiles: the rows in tiles of up to kVnniRows, each tile over each panel of the
// group. ``table``: the tile for each row count; ``sums``: the per-group activation sums the tiles
// read, ``sum_steps`` entries a row (TileMajor, like quads and d_t).
inline void q8_run_tiles(const Q8TileFn* table, const QuantizedRows& a, const void* sums, int64_t sum_steps,
                         int64_t M, int64_t K, const uint8_t* wq, int64_t p_begin, float* y, int64_t N,
                         const float* bias) {
  const int32_t* quads = a.quads;
  const float* d_t = a.d_t;
  const int64_t elem = 4;  // bytes of one row's entry in every interleaved array
  for (int64_t m0 = 0; m0 < M; m0 += kVnniRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kVnniRows, M - m0));
    // each array's block of this tile (TileMajor): its steps times the rows before it
    const void* sums_m0 = static_cast<const uint8_t*>(sums) + sum_steps * m0 * elem;
    for (int64_t p = p_begin; p < p_begin + kGroup; ++p)
      table[rows - 1](quads + K / 4 * m0, d_t + K / kActBlock * m0, sums_m0, M, K, wq, p, y + m0 * N, N, bias);
  }
}

template <int FORMAT, int G>
void q8_run_group(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* wq, int64_t p_begin, float* y,
                  int64_t N, const float* bias) {
  static constexpr auto table = q8tile_table<FORMAT, G>(std::make_integer_sequence<int, kVnniRows>{});
  // per group: S (byte formats subtract 128 * S) or d * S (nibble formats' offsets)
  const void* sums = Layout<FORMAT, G>::kNibbleQ ? static_cast<const void*>(a.ds32)
                     : G == 16                   ? static_cast<const void*>(a.s16)
                                                 : static_cast<const void*>(a.s32);
  q8_run_tiles(table.data(), a, sums, K / G, M, K, wq, p_begin, y, N, bias);
}

#elif defined(__AVX2__)
constexpr bool kHaveVnni = false;

// A pass's rows over one panel in AVX2 tiles of up to kAvx2Rows rows (the activations' layout,
// q8_tile_height): ``tile(m0, rows)`` with rows a std::integral_constant.
template <typename Tile>
inline void avx2_tiles(int64_t M, const Tile& tile) {
  using std::integral_constant;
  static_assert(kAvx2Rows <= 8, "the cases below");
  for (int64_t m0 = 0; m0 < M; m0 += kAvx2Rows) {
    switch (std::min<int64_t>(kAvx2Rows, M - m0)) {
      case 1: tile(m0, integral_constant<int, 1>{}); break;
      case 2: tile(m0, integral_constant<int, 2>{}); break;
      case 3: tile(m0, integral_constant<int, 3>{}); break;
      case 4: tile(m0, integral_constant<int, 4>{}); break;
      case 5: tile(m0, integral_constant<int, 5>{}); break;
      case 6: tile(m0, integral_constant<int, 6>{}); break;
      case 7: tile(m0, integral_constant<int, 7>{}); break;
      default: tile(m0, integral_constant<int, 8>{}); break;
    }
  }
}

// Eight lanes of float16 / int8 / uint8 as float32, whatever width ``vec`` has in this build (on
// AVX-512 CPUs without VNNI these tiles run with a 16-lane vec).
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 neg8(__m256 a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }

// AVX2 has no byte dot product; vpmaddubsw (u8 x s8 pairs, saturating to int16) and vpmaddwd
// do the work of one vpdpbusd on half the width, as in llama.cpp. The integer sums are exact
// (no pair can saturate: nibbles are at most 15, and byte weights go through the sign trick,
// |q| * |a| <= 128 * 127), so the tiles give the VNNI tiles' and the reference's bits.
inline __m256i add_dot4(__m256i dot, __m256i w_u8, __m256i a_s8) {
  return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w_u8, a_s8), _mm256_set1_epi16(1)));
}

// A tile's rows of panel p (both halves), plus the bias, into y.
template <int ROWS>
inline void store_panel_rows(const __m256 (&acc)[ROWS][2], float* y, int64_t N, int64_t p, const float* bias) {
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 out = acc[r][h];
      if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + p * kPanel + h * 8));
      _mm256_storeu_ps(y + r * N + p * kPanel + h * 8, out);
    }
}

// Rows [0, ROWS) times one panel over all of K, both halves (8 lanes each) of the panel at once:
// each weight vector is read and unpacked once for every row of the tile.
// Byte formats hold q + 128: flipping the top bit gives q as int8, so I = sum q * a directly
// (the reference's sum (q + 128) * a - 128 * S, the same integer). Q6_K comes as six-bit panels
// (q8six_tile_avx2 below) on the builds that have these tiles. STRIDE: the height of the block
// of rows the activations interleave (the tile may be part of it).
template <int FORMAT, int G, int ROWS, int STRIDE = ROWS>
void q8tile_avx2(const int32_t* quads, const float* d_t, const float* ds32, int64_t M, int64_t K,
                 const uint8_t* panel, int64_t p, float* y, int64_t N, const float* bias) {
  using L = Layout<FORMAT, G>;
  constexpr int kSteps = L::kNibbleQ ? G / 8 : G / 4;
  static_assert(!L::kNibbleQ || G <= 32, "int16 pair sums would overflow");
  const __m256i low4 = _mm256_set1_epi8(15), top = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[ROWS][2];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    // (through memory: on AVX-512 CPUs without VNNI a vec holds the whole panel's 16 lanes)
    alignas(64) float scales[kPanel], offsets[kPanel];
    L::scale_arrays(panel, g0 / G, scales, offsets);
    const uint8_t* q = L::group_prefetching(panel, g0 / G) + L::kGroupHeader;
    const int32_t* a_lo = quads + (g0 / 4) * STRIDE;
    const int32_t* a_hi = quads + ((g0 + G / 2) / 4) * STRIDE;
    __m256i dot[ROWS][2];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    // Not unrolled: with every step in view GCC computed all the products first and spilled
    // them to the stack, a store and a load per product.
#pragma GCC unroll 1
    for (int t = 0; t < kSteps; ++t) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * 64 + 32));
      if constexpr (L::kNibbleQ) {
        // int16 pair sums of nibbles are at most 2 * 15 * 127: a group's add up without
        // overflow and widen once, after the loop.
        const __m256i w0a = _mm256_and_si256(v0, low4), w0b = _mm256_and_si256(v1, low4);
        const __m256i w1a = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
        const __m256i w1b = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
          const __m256i a0 = _mm256_set1_epi32(a_lo[t * STRIDE + r]);
          const __m256i a1 = _mm256_set1_epi32(a_hi[t * STRIDE + r]);
          dot[r][0] = _mm256_add_epi16(
              dot[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(w0a, a0), _mm256_maddubs_epi16(w1a, a1)));
          dot[r][1] = _mm256_add_epi16(
              dot[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(w0b, a0), _mm256_maddubs_epi16(w1b, a1)));
        }
      } else {
        const __m256i wa = _mm256_xor_si256(v0, top), wb = _mm256_xor_si256(v1, top);
        const __m256i wa_abs = _mm256_sign_epi8(wa, wa), wb_abs = _mm256_sign_epi8(wb, wb);
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
          const __m256i a = _mm256_set1_epi32(a_lo[t * STRIDE + r]);
          dot[r][0] = add_dot4(dot[r][0], wa_abs, _mm256_sign_epi8(a, wa));
          dot[r][1] = add_dot4(dot[r][1], wb_abs, _mm256_sign_epi8(a, wb));
        }
      }
    }
    const float* dg = d_t + (g0 / kActBlock) * STRIDE;
    const float* cg = ds32 + (g0 / kActBlock) * STRIDE;  // per 32 k: the nibble formats' G
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m256 vd = _mm256_set1_ps(dg[r]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i I = dot[r][h];
        if constexpr (L::kNibbleQ) I = _mm256_madd_epi16(I, _mm256_set1_epi16(1));
        const __m256 scale = _mm256_load_ps(scales + h * 8);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(scale, vd), acc[r][h]);
        if constexpr (FORMAT != kBytes)
          acc[r][h] = _mm256_fmadd_ps(_mm256_load_ps(offsets + h * 8), _mm256_set1_ps(cg[r]), acc[r][h]);
      }
    }
  }
  store_panel_rows<ROWS>(acc, y, N, p, bias);
}

template <int FORMAT, int G>
void q8_run_panel_avx2(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                       int64_t N, const float* bias) {
  // each tile reads its block of each interleaved array (TileMajor, height kAvx2Rows); ds32: d * S
  // per 32 k, the nibble formats' offsets
  avx2_tiles(M, [&](int64_t m0, auto rows) {
    constexpr int kRows = decltype(rows)::value;
    const int32_t* quads = a.quads + K / 4 * m0;
    const float *d_t = a.d_t + K / kActBlock * m0, *ds32 = a.ds32 + K / kActBlock * m0;
    if constexpr (FORMAT == kBytes && kRows > kAvx2ByteRows) {
      // rows [0, 4) and [4, kRows) of the block, each reading its rows at the block's stride
      q8tile_avx2<FORMAT, G, 4, kRows>(quads, d_t, ds32, M, K, panel, p, y + m0 * N, N, bias);
      q8tile_avx2<FORMAT, G, kRows - 4, kRows>(quads + 4, d_t + 4, ds32 + 4, M, K, panel, p, y + (m0 + 4) * N, N,
                                               bias);
    } else {
      q8tile_avx2<FORMAT, G, kRows>(quads, d_t, ds32, M, K, panel, p, y + m0 * N, N, bias);
    }
  });
}

#else
constexpr bool kHaveVnni = false;
#endif
#if defined(__AVX2__) || (defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__))
constexpr bool kHaveQ8Vector = true;
#else
constexpr bool kHaveQ8Vector = false;
#endif

// The panel functions of a layout with tiles of its own (q8six.h, q8lut.h, q8five.h): its scalar
// reference and its AVX2 tiles (one panel at p), its VNNI group of tiles (panels from p on).
using Q8PanelFn = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t,
                           const float*);

// Panels [g * kGroup, (g + 1) * kGroup) of such a layout: ``Vector`` (the VNNI group or the AVX2
// panels), or the scalar reference.
template <int64_t (*PanelBytes)(int64_t), Q8PanelFn Reference, Q8PanelFn Vector>
inline void q8_layout_unit(const QuantizedRows& a, const uint8_t* wq, int64_t g, float* y, int64_t N,
                           const float* bias, bool reference) {
  const int64_t M = a.M, K = a.K, panel_bytes = PanelBytes(K);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  if (!reference) return Vector(a, M, K, wq, g * kGroup, y, N, bias);
#endif
  for (int64_t p = g * kGroup; p < (g + 1) * kGroup; ++p) {
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__))
    if (!reference) {
      Vector(a, M, K, wq + p * panel_bytes, p, y, N, bias);
      continue;
    }
#endif
    Reference(a, M, K, wq + p * panel_bytes, p, y, N, bias);
  }
}

// Panels [g * kGroup, (g + 1) * kGroup) of one layer: the unit of parallel work.
template <int FORMAT, int G>
void q8_run_unit(const QuantizedRows& a, const uint8_t* wq, int64_t g, float* y, int64_t N, const float* bias,
                 bool reference) {
  const int64_t M = a.M, K = a.K, panel_bytes = Layout<FORMAT, G>::panel_bytes(K);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  if (!reference) return q8_run_group<FORMAT, G>(a, M, K, wq, g * kGroup, y, N, bias);
#elif defined(__AVX2__)
  if (!reference) {
    for (int64_t p = g * kGroup; p < (g + 1) * kGroup; ++p)
      q8_run_panel_avx2<FORMAT, G>(a, M, K, wq + p * panel_bytes, p, y, N, bias);
    return;
  }
#endif
  for (int64_t p = g * kGroup; p < (g + 1) * kGroup; ++p)
    q8_reference_panel<FORMAT, G>(a, M, K, wq + p * panel_bytes, p, y, N, bias);
}

}  // namespace selfspec
