// q8.h's entry points (speed mode gguf-q8): every tile of q8.h, q8six.h, q8lut.h and q8five.h is
// compiled here.
#include "q8five.h"
#include "q8lut.h"
#include "q8six.h"

namespace selfspec {

Q8Job q8_job(const QuantizedRows& a, const at::Tensor& wq, int64_t format, int64_t group,
             const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t P = wq.size(0), N = P * kPanel;
  TORCH_CHECK(wq.dtype() == at::kByte && wq.dim() == 2 && wq.is_contiguous(), "bad quantized weight");
  TORCH_CHECK(wq.size(1) == quant_panel_bytes(format, group, a.K),
              "x has ", a.K, " features, which does not match the quantized weight");
  y = at::empty({a.M, N}, at::dtype(at::kFloat));
  Q8Job::UnitFn unit = format == kSixBits      ? &q8six_run_unit<SixBitUnpack>
                       : format == kThreeBits  ? &q8six_run_unit<ThreeBitUnpack>
                       : format == kTwoBits    ? &q8six_run_unit<TwoBitUnpack>
                       : format == kLutNibbles ? &q8lut_run_unit<Iq4XsNibbles>
                       : format == kHalfNibbles ? &q8lut_run_unit<Q4_0Nibbles>
                       : format == kHalfLutNibbles ? &q8lut_run_unit<Iq4NlNibbles>
                       : format == kFiveBits   ? &q8five_run_unit<FiveBitLayout>
                       : format == kHalfFiveBits ? &q8five_run_unit<HalfFiveBitLayout>
                       : format == kHalfOffsetFiveBits ? &q8five_run_unit<HalfOffsetFiveBitLayout>
                                               : with_format(format, group, [](auto f, auto g) {
                                                   return static_cast<Q8Job::UnitFn>(
                                                       &q8_run_unit<decltype(f)::value, decltype(g)::value>);
                                                 });
  return {unit, wq.data_ptr<uint8_t>(), P / kGroup, y.data_ptr<float>(), N, bias_pointer(bias, N)};
}

// Layers over the same rows in one parallel region (q, k and v; gate and up): one wake-up of the
// threads and one wait at the end instead of one per layer.
void q8_run_jobs(const QuantizedRows& a, const std::vector<Q8Job>& jobs, bool reference) {
  if (a.M == 0) return;
  reference = reference || !kHaveQ8Vector;
  int64_t total = 0;
  for (const Q8Job& j : jobs) total += j.units;
  balanced_for(total, [&](int64_t u) {
    size_t i = 0;
    for (; u >= jobs[i].units; ++i) u -= jobs[i].units;
    const Q8Job& j = jobs[i];
    j.unit(a, j.wq, u, j.y, j.N, j.bias, reference);
  });
}

// Rows already rounded to 8 bits (``quantize_rows``) times quantized panels in the q8 arrangement:
// inputs shared by several layers (q, k and v; gate and up) are rounded once.
at::Tensor q8_linear_rows(const QuantizedRows& a, const at::Tensor& wq, int64_t format,
                          int64_t group, const c10::optional<at::Tensor>& bias, bool reference) {
  at::Tensor y;
  q8_run_jobs(a, {q8_job(a, wq, format, group, bias, y)}, reference);
  return y;
}

// x [M, K] float32 times quantized panels in the q8 arrangement (speed mode gguf-q8).
// reference: the scalar path (the vector tiles must give the same bits).
at::Tensor q8_linear(at::Tensor x, at::Tensor wq, int64_t format, int64_t group,
                     c10::optional<at::Tensor> bias, bool reference) {
  check_quantized_operands(x, wq, format, group);
  x = x.contiguous();
  return q8_linear_rows(quantize_rows(x), wq, format, group, bias, reference);
}

bool q8_vectorized() { return kHaveQ8Vector; }
// Whether mode gguf-q8 holds Q6_K, Q3_K and Q2_K as panels of their own bit width in this build
// (the VNNI or AVX2 tiles; else Q3_K as bytes, Q2_K as Q8_0).
bool q8_six_bits() { return kHaveSixBitTiles; }
// Whether mode gguf-q8 holds IQ4_XS, Q4_0 and IQ4_NL as nibble panels in this build (the VNNI or
// AVX2 tiles; the scalar reference alone would be slower than the byte layout).
bool q8_lut_nibbles() { return kHaveLutTiles; }
// Whether mode gguf-q8 holds Q5_K, Q5_0 and Q5_1 as five-bit panels in this build (else Q5_K and
// Q5_1 as Q8_0, Q5_0 as bytes).
bool q8_five_bits() { return kHaveFiveBitTiles; }

}  // namespace selfspec
