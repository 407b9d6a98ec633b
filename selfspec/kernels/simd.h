// Vector helpers over AVX-512 (16 floats) or AVX2 (8 floats): the rest of the kernels are written
// once against these.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace selfspec {

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
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline unsigned vequal_lanes(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // bit i: lane i equal
inline unsigned vgreater_lanes(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }  // bit i: a > b
inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2(vec n) { return _mm512_scalef_ps(vset1(1.0f), n); }  // 2^n for whole n in [-126, 127]
// x >= bound ? y : 0, lane by lane
inline vec vkeep_at_least(vec x, vec bound, vec y) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, bound, _CMP_GE_OQ), y);
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
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline unsigned vequal_lanes(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
inline unsigned vgreater_lanes(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2(vec n) {  // 2^n for whole n in [-126, 127]: n + 127 as the exponent field
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec vkeep_at_least(vec x, vec bound, vec y) { return _mm256_and_ps(_mm256_cmp_ps(x, bound, _CMP_GE_OQ), y); }
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

// exp(x) for x <= 0 (a score minus the largest score of its row; -INFINITY for a hidden key),
// Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) = 1 + r + r^2 P(r), times 2^n; 0 below
// -87.3 (where expf is 0 or subnormal) and for NaN. A lane's result depends on that lane's x only.
inline vec vexp_nonpositive(vec x) {
  const vec lowest = vset1(-87.3f);
  const vec xc = vmax(x, lowest);
  const vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
  vec r = vfma(n, vset1(-0.693359375f), xc);  // ln2 in two parts: n times the first is exact
  r = vfma(n, vset1(2.12194440e-4f), r);
  vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  const vec e = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
  return vkeep_at_least(x, lowest, vmul(e, vpow2(n)));
}

// silu(g) * u = g * sigmoid(g) * u, lane by lane, with e = exp(-|g|) (never overflows):
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below.
inline vec silu_times(vec g, vec u) {
  const vec e = vexp_nonpositive(vneg(vmax(g, vneg(g))));
  const vec one = vset1(1.0f);
#if defined(__AVX512F__)
  const vec top = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, vzero(), _CMP_GE_OQ), e, one);
  return vmul(vmul(g, _mm512_div_ps(top, vadd(one, e))), u);
#else
  const vec top = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, vzero(), _CMP_GE_OQ));
  return vmul(vmul(g, _mm256_div_ps(top, vadd(one, e))), u);
#endif
}

}  // namespace selfspec
