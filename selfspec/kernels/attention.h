#pragma once

#include "simd.h"

#include <algorithm>
#include <cmath>

namespace selfspec {

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

#if defined(__AVX512F__)
// r[i] becomes column i of the 16 x 16 matrix whose rows were r.
inline void transpose16(__m512 (&r)[16]) {
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

// dot_row(q, k_j, D) for the 16 keys j0..j0+15, each with dot_row's bits: the same fused
// multiply-adds per lane, then the lanes added one after another from zero, here for 16 keys at
// once (lane jj of the column sums is key jj's sequence of additions).
inline __m512 dot_rows16(const float* q, const float* k, int64_t k_stride, int64_t D) {
  __m512 acc[16];
  for (int jj = 0; jj < 16; ++jj) acc[jj] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int jj = 0; jj < 16; ++jj) acc[jj] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + jj * k_stride + d), acc[jj]);
  }
  transpose16(acc);
  __m512 total = _mm512_setzero_ps();
  for (int i = 0; i < 16; ++i) total = _mm512_add_ps(total, acc[i]);
  return total;
}
#endif

// Columns [0, NV * kVec) of out = sum over the keys j not hidden (p[j] != -INFINITY) of p[j] v_j,
// each column's multiply-adds one fused step per key in j order, in NV registers.
template <int NV>
inline void weigh_columns(const float* p, const float* v, int64_t v_stride, int64_t L, float* out) {
  vec acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = vzero();
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == -INFINITY) continue;
    const vec pj = vset1(p[j]);
    for (int c = 0; c < NV; ++c) acc[c] = vfma(pj, vload(v + j * v_stride + c * kVec), acc[c]);
  }
  for (int c = 0; c < NV; ++c) vstore(out + c * kVec, acc[c]);
}

// out[D] = sum_j p[j] v_j over the keys not hidden, column block by column block (each column's
// sum is the same whatever block holds it), the last D % kVec columns one at a time.
inline void weigh_values(const float* p, const float* v, int64_t v_stride, int64_t D, int64_t L, float* out) {
  int64_t d = 0;
  for (; d + 8 * kVec <= D; d += 8 * kVec) weigh_columns<8>(p, v + d, v_stride, L, out + d);
  if (d + 4 * kVec <= D) {
    weigh_columns<4>(p, v + d, v_stride, L, out + d);
    d += 4 * kVec;
  }
  for (; d + kVec <= D; d += kVec) weigh_columns<1>(p, v + d, v_stride, L, out + d);
  for (; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t j = 0; j < L; ++j)
      if (p[j] != -INFINITY) acc = std::fma(p[j], v[j * v_stride + d], acc);
    out[d] = acc;
  }
}

// One query row of attention for each of the G heads that share a key-value head (head h's query
// at q + h * q_stride, its output at out + h * D): out[h] = sum_j softmax_j(s_hj) v_j over the keys
// j < L, where s_hj = mask(h, j, scale * q[h].k_j) and -INFINITY hides key j. Hidden keys are
// skipped, not added as zeros, so a row's bits depend only on the keys it sees and their order: a
// row of a verify pass (or of a token tree, whose rows see their ancestors only) equals a
// one-token pass over the same keys. Every sum runs in one fixed order (dot_row's for the scores,
// key order for the values), whatever the vector path.
// ``scores``: scratch of G * L floats; ``best``: scratch of G floats.
template <typename Mask>
inline void attend_group(const float* q, int64_t q_stride, int64_t G, const float* k, int64_t k_stride,
                         const float* v, int64_t v_stride, int64_t D, int64_t L, float scale, Mask mask,
                         float* scores, float* best, float* out) {
  for (int64_t h = 0; h < G; ++h) {
    const float* qh = q + h * q_stride;
    float* sh = scores + h * L;
    int64_t j = 0;
#if defined(__AVX512F__)
    if (D % 16 == 0)
      for (; j + 16 <= L; j += 16)
        _mm512_storeu_ps(sh + j, _mm512_mul_ps(dot_rows16(qh, k + j * k_stride, k_stride, D), _mm512_set1_ps(scale)));
#endif
    for (; j < L; ++j) sh[j] = dot_row(qh, k + j * k_stride, D) * scale;
    best[h] = -INFINITY;
    for (j = 0; j < L; ++j) {
      sh[j] = mask(h, j, sh[j]);
      best[h] = std::max(best[h], sh[j]);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* sh = scores + h * L;
    float* oh = out + h * D;
    if (best[h] == -INFINITY) {  // nothing visible: zeros
      for (int64_t d = 0; d < D; ++d) oh[d] = 0.0f;
      continue;
    }
    // p_j = exp(s_j - best) in place of s_j; hidden keys keep -INFINITY and are skipped
    float total = 0.0f;
    for (int64_t j = 0; j < L; ++j) {
      if (sh[j] == -INFINITY) continue;
      sh[j] = std::exp(sh[j] - best[h]);
      total += sh[j];
    }
    weigh_values(sh, v, v_stride, D, L, oh);
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
  }
}

}  // namespace selfspec
