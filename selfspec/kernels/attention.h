#pragma once

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace selfspec {

// ---------------------------------------------------------------------------------------------
// Attention for the kernel speed modes: each query row's scores, softmax and weighted sum of
// values are computed in a fixed order that depends on nothing but that row and the keys it may
// see. torch's fused attention splits the work by the number of query rows, so a verify pass over
// k+1 tokens gives each row slightly different bits than k+1 one-token passes; harmless in float32
// modes, but in gguf-q8 a last-bit difference can move an activation across a rounding boundary of
// its 8-bit value and change the next token. With this, rows never depend on each other anywhere
// in a pass. The rows of a pass are computed together (attend_queries) only so that each key and
// value is read once for all of them.
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

#if defined(__AVX512F__)
// r[i] becomes column i of the 16 x 16 matrix whose rows were r.
inline void transpose(vec (&r)[kVec]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}
#else
// r[i] becomes column i of the 8 x 8 matrix whose rows were r.
inline void transpose(vec (&r)[kVec]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
#endif

// dot_row(q, k_j, D) for the kVec keys j0..j0+kVec-1, each with dot_row's bits: the same fused
// multiply-adds per lane, then the lanes added one after another from zero, here for kVec keys at
// once (lane jj of the column sums is key jj's sequence of additions).
inline vec dot_rows(const float* q, const float* k, int64_t k_stride, int64_t D) {
  vec acc[kVec];
  for (int jj = 0; jj < kVec; ++jj) acc[jj] = vzero();
  for (int64_t d = 0; d < D; d += kVec) {
    const vec qd = vload(q + d);
    for (int jj = 0; jj < kVec; ++jj) acc[jj] = vfma(qd, vload(k + jj * k_stride + d), acc[jj]);
  }
  transpose(acc);
  vec total = vzero();
  for (int i = 0; i < kVec; ++i) total = vadd(total, acc[i]);
  return total;
}

// Attention for several query rows that share one key-value head (the grouped query heads of a
// row, and the rows of a pass): query i reads q[i], sees keys j < len[i], and writes out[i].
// Each query's arithmetic is the one-query arithmetic below whatever else runs beside it: its
// scores are dot_row's bits, the softmax skips hidden keys, and its values are summed one fused
// multiply-add per key in key order. Queries are batched only so that each key and value is read
// from memory once for all of them, not once per query row and head.
struct QueryRow {
  const float* q;
  float* out;
  int64_t len;
};

// Scores of every query: scores[i * stride + j] = scale * q_i.k_j for j < len[i].
inline void score_keys(const QueryRow* rows, int64_t n, const float* k, int64_t k_stride, int64_t D, float scale,
                       float* scores, int64_t stride) {
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) longest = std::max(longest, rows[i].len);
  const bool blocks = D % kVec == 0;  // whether the keys before len / kVec * kVec come kVec at a time
  if (blocks)
    for (int64_t j0 = 0; j0 + kVec <= longest; j0 += kVec)  // the block in L1 while every query reads it
      for (int64_t i = 0; i < n; ++i)
        if (j0 + kVec <= rows[i].len)
          vstore(scores + i * stride + j0, vmul(dot_rows(rows[i].q, k + j0 * k_stride, k_stride, D), vset1(scale)));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = blocks ? rows[i].len / kVec * kVec : 0; j < rows[i].len; ++j)
      scores[i * stride + j] = dot_row(rows[i].q, k + j * k_stride, D) * scale;
}

// p_j = exp(s_j - max) in place of each score over j < len (0 for a hidden key, -INFINITY), and 0
// for len <= j < width.
inline void softmax_weights(float* s, int64_t len, int64_t width) {
  float best = -INFINITY;
  for (int64_t j = 0; j < len; ++j) best = std::max(best, s[j]);
  if (best == -INFINITY) len = 0;  // nothing visible: all zeros
  const vec shift = vset1(best);
  int64_t j = 0;
  for (; j + kVec <= len; j += kVec) vstore(s + j, vexp_nonpositive(vadd(vload(s + j), vneg(shift))));
  if (j < len) {  // the last few through a vector of their own, padded with hidden keys
    alignas(64) float tail[kVec];
    for (int64_t t = 0; t < kVec; ++t) tail[t] = j + t < len ? s[j + t] - best : -INFINITY;
    vstore(tail, vexp_nonpositive(vload(tail)));
    for (int64_t t = 0; j + t < len; ++t) s[j + t] = tail[t];
  }
  for (j = len; j < width; ++j) s[j] = 0.0f;
}

// Columns [c0, c0 + NV * kVec) of NQ queries' outputs: out_i = sum_j p_ij v_j, one fused
// multiply-add per key in key order from zero. A hidden key's p is 0 and adds exactly nothing
// (v is finite), so these are the bits of a sum that skips it.
template <int NQ, int NV>
inline void weigh_block(const float* const* p, float* const* out, const float* v, int64_t v_stride, int64_t c0,
                        int64_t width) {
  vec acc[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = vzero();
  for (int64_t j = 0; j < width; ++j) {
    vec pj[NQ];
    for (int i = 0; i < NQ; ++i) pj[i] = vset1(p[i][j]);
    for (int c = 0; c < NV; ++c) {
      const vec vj = vload(v + j * v_stride + c0 + c * kVec);
      for (int i = 0; i < NQ; ++i) acc[i][c] = vfma(pj[i], vj, acc[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NV; ++c) vstore(out[i] + c0 + c * kVec, acc[i][c]);
}

constexpr int kValueQueries = 3;              // queries weighed together
constexpr int kValueVecs = kAccumulators / 3;  // vectors of columns per query (8 with AVX-512)

// NQ queries' outputs over all D columns, up to ``width`` keys each (p zero past a query's own).
template <int NQ>
inline void weigh_queries(const float* const* p, float* const* out, const float* v, int64_t v_stride, int64_t D,
                          int64_t width) {
  int64_t c0 = 0;
  for (; c0 + kValueVecs * kVec <= D; c0 += kValueVecs * kVec) weigh_block<NQ, kValueVecs>(p, out, v, v_stride, c0, width);
  if constexpr (kValueVecs > 4)
    for (; c0 + 4 * kVec <= D; c0 += 4 * kVec) weigh_block<NQ, 4>(p, out, v, v_stride, c0, width);
  for (; c0 + 2 * kVec <= D; c0 += 2 * kVec) weigh_block<NQ, 2>(p, out, v, v_stride, c0, width);
  for (; c0 + kVec <= D; c0 += kVec) weigh_block<NQ, 1>(p, out, v, v_stride, c0, width);
  for (; c0 < D; ++c0)
    for (int i = 0; i < NQ; ++i) {
      float acc = 0.0f;
      for (int64_t j = 0; j < width; ++j) acc = std::fma(p[i][j], v[j * v_stride + c0], acc);
      out[i][c0] = acc;
    }
}

// The queries of ``rows`` (sharing one key-value head): out_i = sum_j softmax_j(s_ij) v_j over the
// keys j < len_i, where s_ij = mask(i, j, scale * q_i.k_j) and -INFINITY hides key j. A query that
// sees no key gets zeros. ``scores``: scratch of n * max(len) floats.
template <typename Mask>
inline void attend_queries(const QueryRow* rows, int64_t n, const float* k, int64_t k_stride, const float* v,
                           int64_t v_stride, int64_t D, float scale, Mask mask, float* scores) {
  int64_t width = 0;
  for (int64_t i = 0; i < n; ++i) width = std::max(width, rows[i].len);
  score_keys(rows, n, k, k_stride, D, scale, scores, width);
  for (int64_t i = 0; i < n; ++i) {
    float* s = scores + i * width;
    for (int64_t j = 0; j < rows[i].len; ++j) s[j] = mask(i, j, s[j]);
    softmax_weights(s, rows[i].len, width);
  }
  // each query's sum of p in key order (the zeros of hidden keys add nothing), the queries side
  // by side so that their additions overlap
  std::vector<float> inv(n, 0.0f);
  for (int64_t j = 0; j < width; ++j)
    for (int64_t i = 0; i < n; ++i) inv[i] += scores[i * width + j];
  for (int64_t i = 0; i < n; ++i) inv[i] = inv[i] > 0.0f ? 1.0f / inv[i] : 0.0f;
  for (int64_t i0 = 0; i0 < n; i0 += kValueQueries) {
    const float* p[kValueQueries];
    float* out[kValueQueries];
    const int64_t count = std::min<int64_t>(kValueQueries, n - i0);
    int64_t reach = 0;  // the keys any of these queries sees
    for (int64_t i = 0; i < count; ++i) {
      p[i] = scores + (i0 + i) * width;
      out[i] = rows[i0 + i].out;
      reach = std::max(reach, rows[i0 + i].len);
    }
    if (count == 3) weigh_queries<3>(p, out, v, v_stride, D, reach);
    else if (count == 2) weigh_queries<2>(p, out, v, v_stride, D, reach);
    else weigh_queries<1>(p, out, v, v_stride, D, reach);
  }
  // + 0: a sum of nothing but zero products is +0 whether or not hidden keys' zeros were added
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) rows[i].out[d] = rows[i].out[d] * inv[i] + 0.0f;
}

// One query row of attention for each of the G heads that share a key-value head (head h's query
// at q + h * q_stride, its output at out + h * D), over the keys j < L, s_hj = mask(h, j, scale *
// q[h].k_j): attend_queries for one row. ``scores``: scratch of G * L floats.
template <typename Mask>
inline void attend_group(const float* q, int64_t q_stride, int64_t G, const float* k, int64_t k_stride,
                         const float* v, int64_t v_stride, int64_t D, int64_t L, float scale, Mask mask,
                         float* scores, float* out) {
  std::vector<QueryRow> rows(G);
  for (int64_t h = 0; h < G; ++h) rows[h] = {q + h * q_stride, out + h * D, L};
  attend_queries(rows.data(), G, k, k_stride, v, v_stride, D, scale, mask, scores);
}

}  // namespace selfspec
