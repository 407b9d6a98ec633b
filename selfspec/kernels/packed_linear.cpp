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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <array>
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
#else
#error "packed_linear needs AVX2 and FMA"
#endif

constexpr int kVecPerPanel = kPanel / kVec;

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
  // Blocked summation: each k-block's partial sum is added to the total, in k order.
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) {
      float* out = y + r * N + p0 * kPanel + v * kVec;
      vec total = first ? acc[r][v] : vadd(vload(out), acc[r][v]);
      if (last && bias) total = vadd(total, vload(bias + p0 * kPanel + v * kVec));
      vstore(out, total);
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t,
                        const float*, bool, bool);

// kMaxRows[PANELS]: the most rows whose accumulators fit in registers beside PANELS panels.
template <int PANELS>
constexpr int max_rows() { return kAccumulators / (PANELS * kVecPerPanel); }

template <int PANELS, int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, PANELS>...};
}

template <int PANELS>
TileFn tile_for(int rows) {
  static constexpr auto table = tile_table<PANELS>(std::make_integer_sequence<int, max_rows<PANELS>()>{});
  return table[rows - 1];
}

// Fewer rows: more panels per tile (more independent accumulators to hide FMA latency).
// More rows: fewer panels, so every row still shares each weight load.
template <int PANELS>
void run_group(const float* x, int64_t M, int64_t K, const float* wp, int64_t p_begin, float* y,
               int64_t N, const float* bias) {
  constexpr int R = max_rows<PANELS>();
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = std::min(K, k0 + kBlockK);
    for (int64_t p0 = p_begin; p0 < p_begin + kGroup; p0 += PANELS)
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const int rows = static_cast<int>(std::min<int64_t>(R, M - m0));
        tile_for<PANELS>(rows)(x + m0 * K, K, wp, p0, k0, k1, y + m0 * N, N, bias, k0 == 0, k1 == K);
      }
  }
}

}  // namespace

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && wp.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kPanel, "bad shapes");
  TORCH_CHECK(x.size(1) == wp.size(1), "x has ", x.size(1), " features, weight expects ", wp.size(1));
  TORCH_CHECK(wp.size(0) % kGroup == 0, "panel count must be a multiple of ", kGroup);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0), N = P * kPanel;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wptr = wp.data_ptr<float>();
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "bias must have ", N, " elements");
    bp = bias->data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  const int64_t groups = P / kGroup;
  // Tile shape by row count; the choice never changes the order of any output's sum.
  auto run = M <= max_rows<4>() && kGroup % 4 == 0 ? &run_group<4>
           : M <= max_rows<2>() ? &run_group<2> : &run_group<1>;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) run(xp, M, K, wptr, g * kGroup, yp, N, bp);
  });
  return y;
}

int64_t panels_per_group() { return kGroup; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_linear", &packed_linear, "y = x @ W^T (+ bias), W packed in 16-wide panels");
  m.def("panels_per_group", &panels_per_group, "panel count granularity");
}
