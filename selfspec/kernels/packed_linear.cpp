// y = x @ W^T (+ bias) for few rows of x, with W stored in 16-wide column panels.
//
// Decoding is memory-bound: every weight is read once per forward pass. A verify pass
// scores a handful of rows, and BLAS libraries tuned for big matrices handle such skinny
// products poorly (a pass over 8 rows costs about twice a pass over 1). Here each weight
// panel is streamed once per k-block while it serves every row, so a pass over a few rows
// costs about what one row costs.
//
// Packed layout: wp[p, k, j] = W[16 * p + j, k]   shape [N / 16, K, 16].
// Each output is summed over k in increasing order, whatever the number of rows and
// however the work is split across threads, so row m of the result does not depend on the
// other rows: a verify pass gives bit for bit the logits a one-token pass gives.
//
// quant_linear does the same with the weights kept as a GGUF file's small integers (speed
// mode "gguf"): each weight is rebuilt in registers, just before use, as the exact float32
// value the file dequantizes to, then summed in the same order as packed_linear. Same
// weights, same order, same results, bit for bit, from a fifth to a third of the bytes.
//
// Further down: q8_linear (speed mode "gguf-q8": the same integers times 8-bit activations, with
// integer dot products; its own numerics) and attention_rows (attention one query row at a time,
// so that a whole pass, not only its linear layers, gives every row the bits of a one-row pass).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>
#include <utility>

namespace {

constexpr int kPanel = 16;    // outputs per panel
constexpr int kGroup = 4;     // panels per unit of parallel work (and panel-count granularity)
constexpr int kBlockK = 512;  // k-block: a group's weights for one block stay in L2
#ifndef SELFSPEC_PREFETCH
#define SELFSPEC_PREFETCH 32
#endif
constexpr int kPrefetch = SELFSPEC_PREFETCH;  // k-steps (64 bytes each per panel) to prefetch ahead

#if defined(__AVX512F__)
using vec = __m512;
constexpr int kVec = 16;
constexpr int kAccumulators = 24;  // of 32 registers, leaving room for weights and broadcasts
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vset1(float s) { return _mm512_set1_ps(s); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vneg(vec a) {  // flips the sign bit (a zero becomes -0, as in ggml's -(dmin * m))
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}
inline vec u8_to_vec(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec f16_to_vec(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// kVec bytes -> kVec floats
inline vec i8_to_vec(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// kVec bytes -> their low and high nibbles as floats
inline void nibbles_to_vec(const uint8_t* p, vec& lo, vec& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int kVec = 8;
constexpr int kAccumulators = 12;  // of 16 registers
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vset1(float s) { return _mm256_set1_ps(s); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vneg(vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
inline vec u8_to_vec(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec f16_to_vec(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vec i8_to_vec(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void nibbles_to_vec(const uint8_t* p, vec& lo, vec& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#else
#error "packed_linear needs AVX2 and FMA"
#endif

constexpr int kVecPerPanel = kPanel / kVec;

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
//   kNibbles (G = 32; Q4_1): per group float scale[16], float offset[16], uint8 q[16][16].
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

#ifndef SELFSPEC_QPREFETCH
#define SELFSPEC_QPREFETCH 4096
#endif
constexpr int kQuantPrefetch = SELFSPEC_QPREFETCH;  // bytes ahead in each panel's stream

template <int FORMAT, int G>
struct Layout {
  static constexpr bool kNibbleQ = FORMAT != kBytes;
  static constexpr int64_t kGroupHeader = FORMAT == kNibbles ? 8 * kPanel : FORMAT == kBytes ? 4 * kPanel : 2 * kPanel;
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
  // As group(), asking for the bytes kQuantPrefetch ahead in the panel's stream: with many rows the
  // loop is compute-bound, and the hardware prefetcher alone lets the memory bus idle.
  static const uint8_t* group_prefetching(const uint8_t* panel, int64_t gi) {
    const uint8_t* rec = group(panel, gi);
    for (int64_t line = 0; line < kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + kQuantPrefetch + line), _MM_HINT_T0);
    return rec;
  }
  // Lanes [v * kVec, (v + 1) * kVec) of group gi's scale and offset.
  static void scales(const uint8_t* panel, int64_t gi, int v, vec& scale, vec& offset) {
    const uint8_t* rec = group(panel, gi);
    if constexpr (FORMAT == kSuperNibbles) {
      const uint8_t* super = panel + gi / kSuperGroups * kSuperBytes;
      scale = vmul(f16_to_vec(super + 2 * v * kVec), u8_to_vec(rec + v * kVec));
      offset = vneg(vmul(f16_to_vec(super + 2 * kPanel + 2 * v * kVec), u8_to_vec(rec + kPanel + v * kVec)));
    } else {
      const float* header = reinterpret_cast<const float*>(rec);
      scale = vload(header + v * kVec);
      offset = FORMAT == kNibbles ? vload(header + kPanel + v * kVec) : vzero();
    }
  }
};

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
  for (int64_t g0 = k0; g0 < k1; g0 += G) {
    const uint8_t* q[PANELS];
    vec scale[V], offset[V];
#pragma GCC unroll 4
    for (int g = 0; g < PANELS; ++g) {
      const uint8_t* panel = wq + (p0 + g) * panel_bytes;
      const uint8_t* rec = L::group_prefetching(panel, g0 / G);
#pragma GCC unroll 2
      for (int v = 0; v < kVecPerPanel; ++v)
        L::scales(panel, g0 / G, v, scale[g * kVecPerPanel + v], offset[g * kVecPerPanel + v]);
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

const float* bias_pointer(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->numel() == N && bias->is_contiguous(),
              "bias must be ", N, " contiguous float32 values");
  return bias->data_ptr<float>();
}

torch::Tensor run_all_groups(const torch::Tensor& x, const void* wp, int64_t P, GroupFn run,
                             const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = P * kPanel;
  auto y = torch::empty({M, N}, x.options());
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
  TORCH_CHECK((format != kBytes && group == 32) || (format == kBytes && (group == 16 || group == 32)),
              "unsupported quantized format ", format, " with groups of ", group);
  if (format == kSuperNibbles) return f(integral_constant<int, kSuperNibbles>{}, integral_constant<int, 32>{});
  if (format == kNibbles) return f(integral_constant<int, kNibbles>{}, integral_constant<int, 32>{});
  if (group == 16) return f(integral_constant<int, kBytes>{}, integral_constant<int, 16>{});
  return f(integral_constant<int, kBytes>{}, integral_constant<int, 32>{});
}

int64_t quant_panel_bytes(int64_t format, int64_t group, int64_t K) {
  const int64_t multiple = format == kSuperNibbles ? 256 : group;
  TORCH_CHECK(K % multiple == 0, "in_features ", K, " is not a multiple of ", multiple);
  return with_format(format, group, [&](auto f, auto g) { return Layout<decltype(f)::value, decltype(g)::value>::panel_bytes(K); });
}

void check_quantized_operands(const torch::Tensor& x, const torch::Tensor& wq, int64_t format, int64_t group) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be 2-d float32");
  TORCH_CHECK(wq.dtype() == torch::kUInt8 && wq.dim() == 2 && wq.is_contiguous(), "bad quantized weight");
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

struct QuantizedRows {
  torch::Tensor q;       // [M, K] int8
  torch::Tensor d;       // [M, K / 32] float32
  torch::Tensor sums16;  // [M, K / 16] int32
};

QuantizedRows quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kActBlock == 0, "in_features ", K, " is not a multiple of ", kActBlock);
  QuantizedRows out{torch::empty({M, K}, torch::kInt8), torch::empty({M, K / kActBlock}, torch::kFloat32),
                    torch::empty({M, K / 16}, torch::kInt32)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = out.q.data_ptr<int8_t>();
  float* dp = out.d.data_ptr<float>();
  int32_t* sp = out.sums16.data_ptr<int32_t>();
  at::parallel_for(0, M * (K / kActBlock), 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = xp + b * kActBlock;
      int8_t* qb = qp + b * kActBlock;
      float amax = 0.0f;
      for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      dp[b] = amax / 127.0f;
      int32_t s0 = 0, s1 = 0;
      for (int i = 0; i < kActBlock; ++i) {
        const int8_t a = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
        qb[i] = a;
        (i < 16 ? s0 : s1) += a;
      }
      sp[2 * b] = s0;
      sp[2 * b + 1] = s1;
    }
  });
  return out;
}

template <int G>
inline int32_t group_sum(const int32_t* sums16, int64_t g0) {
  return G == 16 ? sums16[g0 / 16] : sums16[g0 / 16] + sums16[g0 / 16 + 1];
}

// Scalar version of the formula: the reference the vector tiles are tested against, and the
// path on CPUs without AVX-512 VNNI.
template <int FORMAT, int G>
void q8_reference_panel(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* panel, int64_t p, float* y,
                        int64_t N, const float* bias) {
  using L = Layout<FORMAT, G>;
  const int8_t* aq = a.q.data_ptr<int8_t>();
  const float* ad = a.d.data_ptr<float>();
  const int32_t* as = a.sums16.data_ptr<int32_t>();
  for (int64_t m = 0; m < M; ++m) {
    float acc[kPanel] = {};
    for (int64_t g0 = 0; g0 < K; g0 += G) {
      float scale[kPanel], offset[kPanel];
      for (int v = 0; v < kVecPerPanel; ++v) {
        vec s, o;
        L::scales(panel, g0 / G, v, s, o);
        vstore(scale + v * kVec, s);
        vstore(offset + v * kVec, o);
      }
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

// Rows [0, ROWS) times panels [p0, p0 + PANELS) over all of K. Per group, the integer sums of
// every (row, panel) pair stay in registers, then fold into the float accumulators.
template <int FORMAT, int G, int ROWS, int PANELS>
void q8tile(const int8_t* aq, const float* ad, const int32_t* as, int64_t K, const uint8_t* wq, int64_t p0, float* y,
            int64_t N, const float* bias) {
  using L = Layout<FORMAT, G>;
  constexpr int kSteps = L::kNibbleQ ? G / 8 : G / 4;  // 64-byte weight vectors per group and panel
  const int64_t panel_bytes = L::panel_bytes(K);
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[ROWS][PANELS];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < PANELS; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    const uint8_t* q[PANELS];
    __m512 scale[PANELS], offset[PANELS];
#pragma GCC unroll 4
    for (int g = 0; g < PANELS; ++g) {
      const uint8_t* panel = wq + (p0 + g) * panel_bytes;
      const uint8_t* rec = L::group_prefetching(panel, g0 / G);
      L::scales(panel, g0 / G, 0, scale[g], offset[g]);
      q[g] = rec + L::kGroupHeader;
    }
    __m512i dot[ROWS][PANELS];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int g = 0; g < PANELS; ++g) dot[r][g] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < kSteps; ++t) {
      __m512i w0[PANELS], w1[PANELS];
#pragma GCC unroll 4
      for (int g = 0; g < PANELS; ++g) {
        const __m512i v = _mm512_loadu_si512(q[g] + t * 64);
        if constexpr (L::kNibbleQ) {
          w0[g] = _mm512_and_si512(v, low4);
          w1[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        } else {
          w0[g] = v;
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* am = aq + r * K + g0 + 4 * t;
        const __m512i a0 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(am));
#pragma GCC unroll 4
        for (int g = 0; g < PANELS; ++g) dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], w0[g], a0);
        if constexpr (L::kNibbleQ) {
          const __m512i a1 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(am + G / 2));
#pragma GCC unroll 4
          for (int g = 0; g < PANELS; ++g) dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], w1[g], a1);
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const float d = ad[r * (K / kActBlock) + g0 / kActBlock];
      const int32_t S = group_sum<G>(as + r * (K / 16), g0);
      const __m512 vd = _mm512_set1_ps(d);
      const __m512 vc = _mm512_set1_ps(d * static_cast<float>(S));
#pragma GCC unroll 4
      for (int g = 0; g < PANELS; ++g) {
        __m512i I = dot[r][g];
        if constexpr (!L::kNibbleQ) I = _mm512_sub_epi32(I, _mm512_set1_epi32(128 * S));
        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(scale[g], vd), acc[r][g]);
        if constexpr (FORMAT != kBytes) acc[r][g] = _mm512_fmadd_ps(offset[g], vc, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < PANELS; ++g) {
      __m512 out = acc[r][g];
      if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + (p0 + g) * kPanel));
      _mm512_storeu_ps(y + r * N + (p0 + g) * kPanel, out);
    }
}

using Q8TileFn = void (*)(const int8_t*, const float*, const int32_t*, int64_t, const uint8_t*, int64_t, float*,
                          int64_t, const float*);

template <int FORMAT, int G, int PANELS, int... R>
constexpr std::array<Q8TileFn, sizeof...(R)> q8tile_table(std::integer_sequence<int, R...>) {
  return {&q8tile<FORMAT, G, R + 1, PANELS>...};
}

// Integer and float accumulators for every (row, panel) pair, beside each panel's scale, offset and
// two weight vectors: at most 12 pairs.
template <int FORMAT, int G, int PANELS>
struct Q8Tiles {
  static constexpr int kRows = 12 / PANELS;
  static Q8TileFn get(int rows) {
    static constexpr auto table = q8tile_table<FORMAT, G, PANELS>(std::make_integer_sequence<int, kRows>{});
    return table[rows - 1];
  }
};

template <int FORMAT, int G, int PANELS>
void q8_run_group(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* wq, int64_t p_begin, float* y,
                  int64_t N, const float* bias) {
  using T = Q8Tiles<FORMAT, G, PANELS>;
  const int8_t* aq = a.q.data_ptr<int8_t>();
  const float* ad = a.d.data_ptr<float>();
  const int32_t* as = a.sums16.data_ptr<int32_t>();
  for (int64_t m0 = 0; m0 < M; m0 += T::kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(T::kRows, M - m0));
    for (int64_t p0 = p_begin; p0 < p_begin + kGroup; p0 += PANELS)
      T::get(rows)(aq + m0 * K, ad + m0 * (K / kActBlock), as + m0 * (K / 16), K, wq, p0, y + m0 * N, N, bias);
  }
}
#else
constexpr bool kHaveVnni = false;
#endif

template <int FORMAT, int G>
void q8_run(const QuantizedRows& a, int64_t M, int64_t K, const uint8_t* wq, int64_t P, float* y, int64_t N,
            const float* bias, bool reference) {
  const int64_t panel_bytes = Layout<FORMAT, G>::panel_bytes(K);
  at::parallel_for(0, P / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
      if (!reference) {
        if (M == 1) q8_run_group<FORMAT, G, 4>(a, M, K, wq, g * kGroup, y, N, bias);
        else if (M <= 6) q8_run_group<FORMAT, G, 2>(a, M, K, wq, g * kGroup, y, N, bias);
        else q8_run_group<FORMAT, G, 1>(a, M, K, wq, g * kGroup, y, N, bias);
        continue;
      }
#endif
      for (int64_t p = g * kGroup; p < (g + 1) * kGroup; ++p)
        q8_reference_panel<FORMAT, G>(a, M, K, wq + p * panel_bytes, p, y, N, bias);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Attention for the kernel speed modes, one query row at a time: each row's scores, softmax and
// weighted sum of values are computed in a fixed order that depends on nothing but that row and
// the keys it may see. torch's fused attention splits the work by the number of query rows, so a
// verify pass over k+1 tokens gives each row slightly different bits than k+1 one-token passes;
// harmless in float32 modes, but in gguf-q8 a last-bit difference can move an activation across a
// rounding boundary of its 8-bit value and change the next token. With this, rows never depend on
// each other anywhere in a pass.
inline float dot_row(const float* a, const float* b, int64_t D) {
  vec acc = vzero();
  int64_t d = 0;
  for (; d + kVec <= D; d += kVec) acc = vfma(vload(a + d), vload(b + d), acc);
  alignas(64) float lanes[kVec];
  vstore(lanes, acc);
  float total = 0.0f;
  for (int i = 0; i < kVec; ++i) total += lanes[i];
  for (; d < D; ++d) total = std::fma(a[d], b[d], total);
  return total;
}

inline void axpy_row(float alpha, const float* x, float* y, int64_t D) {
  int64_t d = 0;
  const vec va = vset1(alpha);
  for (; d + kVec <= D; d += kVec) vstore(y + d, vfma(va, vload(x + d), vload(y + d)));
  for (; d < D; ++d) y[d] = std::fma(alpha, x[d], y[d]);
}

}  // namespace

// q [B, Hq, M, D]; k, v [B, Hkv, L, D] (Hq a multiple of Hkv); mask None or [B|1, Hq|1, M, L], bool
// (true: may attend) or float (added to the scores). Without a mask: row i sees keys 0..i when
// causal and M > 1 (transformers' is_causal), else every key. Returns [B, M, Hq, D].
torch::Tensor attention_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                             double scale, bool causal) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32,
              "float32 only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "bad attention shapes");
  const int64_t B = q.size(0), Hq = q.size(1), M = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hq % Hkv == 0, "bad attention shapes");
  // Read in place through strides: the runner's cache hands out views of longer buffers, and a
  // copy of every cached key and value per layer and pass is what this is here to avoid.
  const auto rows_in_place = [](const torch::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  q = rows_in_place(q);
  k = rows_in_place(k);
  v = rows_in_place(v);
  torch::Tensor m;
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask) {
    TORCH_CHECK(mask->dim() == 4 && (mask->dtype() == torch::kBool || mask->dtype() == torch::kFloat32),
                "mask must be 4-d bool or float32");
    m = mask->expand({B, Hq, M, L});
  }
  const bool* mask_bool = has_mask && m.scalar_type() == torch::kBool ? m.data_ptr<bool>() : nullptr;
  const float* mask_float = has_mask && m.scalar_type() == torch::kFloat32 ? m.data_ptr<float>() : nullptr;
  const std::array<int64_t, 4> ms = has_mask ? std::array<int64_t, 4>{m.stride(0), m.stride(1), m.stride(2), m.stride(3)}
                                             : std::array<int64_t, 4>{0, 0, 0, 0};
  auto out = torch::empty({B, M, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = Hq / Hkv;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * Hq * M, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (Hq * M), h = t / M % Hq, i = t % M;
      const float* qi = qp + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
      const float* kh = kp + b * k.stride(0) + h / group * k.stride(1);
      const float* vh = vp + b * v.stride(0) + h / group * v.stride(1);
      const int64_t visible = !has_mask && causal && M > 1 ? std::min(L, i + 1) : L;
      const int64_t mask_row = has_mask ? b * ms[0] + h * ms[1] + i * ms[2] : 0;
      float best = -INFINITY;
      for (int64_t j = 0; j < visible; ++j) {
        float s = dot_row(qi, kh + j * k.stride(2), D) * fscale;
        if (mask_bool) {
          if (!mask_bool[mask_row + j * ms[3]]) s = -INFINITY;
        } else if (mask_float) {
          s += mask_float[mask_row + j * ms[3]];
        }
        scores[j] = s;
        best = std::max(best, s);
      }
      float* oi = op + ((b * M + i) * Hq + h) * D;
      std::fill(oi, oi + D, 0.0f);
      if (best == -INFINITY) continue;  // nothing visible: zeros
      float total = 0.0f;
      for (int64_t j = 0; j < visible; ++j) {
        if (scores[j] == -INFINITY) continue;
        const float p = std::exp(scores[j] - best);
        total += p;
        axpy_row(p, vh + j * v.stride(2), oi, D);
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) oi[d] *= inv;
    }
  });
  return out;
}

namespace {
}  // namespace

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && wp.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kPanel && wp.is_contiguous(), "bad shapes");
  TORCH_CHECK(x.size(1) == wp.size(1), "x has ", x.size(1), " features, weight expects ", wp.size(1));
  TORCH_CHECK(wp.size(0) % kGroup == 0, "panel count must be a multiple of ", kGroup);
  x = x.contiguous();
  return run_all_groups(x, wp.data_ptr<float>(), wp.size(0),
                        group_for_rows<float, FloatTiles, 4>(x.size(0)), bias);
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor wq, int64_t format, int64_t group,
                           c10::optional<torch::Tensor> bias) {
  check_quantized_operands(x, wq, format, group);
  x = x.contiguous();
  const GroupFn run = with_format(format, group, [&](auto f, auto g) {
    using Tiles = QuantTiles<decltype(f)::value, decltype(g)::value>;
    return group_for_rows<uint8_t, Tiles::template With, kQuantMaxPanels>(x.size(0));
  });
  return run_all_groups(x, wq.data_ptr<uint8_t>(), wq.size(0), run, bias);
}

torch::Tensor dequantize_panels(torch::Tensor wq, int64_t format, int64_t group, int64_t K) {
  TORCH_CHECK(wq.dtype() == torch::kUInt8 && wq.dim() == 2 && wq.is_contiguous(), "bad quantized weight");
  const int64_t panel_bytes = quant_panel_bytes(format, group, K);
  TORCH_CHECK(wq.size(1) == panel_bytes, "quantized weight does not hold ", K, " features");
  const int64_t P = wq.size(0);
  auto out = torch::empty({P, K, kPanel}, torch::dtype(torch::kFloat32));
  const uint8_t* src = wq.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  auto fn = with_format(format, group, [](auto f, auto g) { return &dequantize_panel<decltype(f)::value, decltype(g)::value>; });
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) fn(src + p * panel_bytes, K, dst + p * K * kPanel);
  });
  return out;
}

int64_t panels_per_group() { return kGroup; }

// x [M, K] float32 times quantized panels in the q8 arrangement (speed mode gguf-q8).
// reference: the scalar path (the vector tiles must give the same bits).
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor wq, int64_t format, int64_t group,
                        c10::optional<torch::Tensor> bias, bool reference) {
  check_quantized_operands(x, wq, format, group);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = wq.size(0), N = P * kPanel;
  const float* bp = bias_pointer(bias, N);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows a = quantize_rows(x);
  with_format(format, group, [&](auto f, auto g) {
    q8_run<decltype(f)::value, decltype(g)::value>(a, M, K, wq.data_ptr<uint8_t>(), P, y.data_ptr<float>(), N, bp,
                                                   reference || !kHaveVnni);
    return 0;
  });
  return y;
}

bool q8_vectorized() { return kHaveVnni; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "y = x @ W^T (+ bias), W packed in 16-wide panels");
  m.def("quant_linear", &quant_linear, "y = x @ W^T (+ bias), W as quantized 16-wide panels");
  m.def("dequantize_panels", &dequantize_panels, "quantized panels -> float32 [P, K, 16]");
  m.def("quant_panel_bytes", &quant_panel_bytes, "bytes per quantized panel");
  m.def("panels_per_group", &panels_per_group, "panel count granularity");
  m.def("q8_linear", &q8_linear, "y = x @ W^T (+ bias), x rounded to 8 bits, W as quantized panels (q8 arrangement)");
  m.def("attention_rows", &attention_rows, "attention computed row by row, the same bits whatever the row count");
  m.def("q8_vectorized", &q8_vectorized, "whether q8_linear has its AVX-512 VNNI path in this build");
}
