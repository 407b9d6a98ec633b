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

inline void axpy_row(float alpha, const float* x, float* y, int64_t D) {
  int64_t d = 0;
  const vec va = vset1(alpha);
  for (; d + kVec <= D; d += kVec) vstore(y + d, vfma(va, vload(x + d), vload(y + d)));
  for (; d < D; ++d) y[d] = std::fma(alpha, x[d], y[d]);
}


// One query row of attention: out[D] = sum_j softmax_j(scale * q.k_j) v_j over the keys j < L
// that ``visible(j)`` allows, in increasing j. Hidden keys are skipped, not added as zeros, so a
// row's bits depend only on the keys it sees and their order: a row of a verify pass (or of a
// token tree, whose rows see their ancestors only) equals a one-token pass over the same keys.
// ``scores``: scratch of L floats.
template <typename Visible>
inline void attend_row(const float* q, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                       int64_t D, int64_t L, float scale, Visible visible, float* scores, float* out) {
  float best = -INFINITY;
  for (int64_t j = 0; j < L; ++j) {
    const float s = visible(j) ? dot_row(q, k + j * k_stride, D) * scale : -INFINITY;
    scores[j] = s;
    best = std::max(best, s);
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  if (best == -INFINITY) return;  // nothing visible: zeros
  float total = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    if (scores[j] == -INFINITY) continue;
    const float p = std::exp(scores[j] - best);
    total += p;
    axpy_row(p, v + j * v_stride, out, D);
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

}  // namespace selfspec
