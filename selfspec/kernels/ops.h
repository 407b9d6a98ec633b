// The kernel's entry points as torch sees them: linear layers over panels (float32, quantized,
// 8-bit activations) and attention one query row at a time.
#pragma once

#include "attention.h"
#include "linear.h"
#include "q8six.h"

namespace selfspec {

// Per row of logits [M, V] float32, the index of its largest value, the first of several: what
// torch.argmax gives, in two vector passes over the row (the maximum, then its first place)
// instead of torch's scalar reduction. A row holding a NaN or an infinity goes to torch.argmax.
inline torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.dtype() == torch::kFloat32, "logits must be [M, V] float32");
  logits = logits.contiguous();
  const int64_t M = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "no logits");
  auto out = torch::empty({M}, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const float* x = logits.data_ptr<float>() + m * V;
    vec best = vset1(-INFINITY), finite = vzero();  // finite stays 0 unless a lane is NaN or +-inf
    int64_t i = 0;
    for (; i + kVec <= V; i += kVec) {
      const vec v = vload(x + i);
      best = vmax(best, v);
      finite = vadd(finite, vmul(v, vzero()));
    }
    alignas(64) float lanes[kVec], zeros[kVec];
    vstore(lanes, best);
    vstore(zeros, finite);
    float top = -INFINITY, check = 0.0f;
    for (int j = 0; j < kVec; ++j) top = std::max(top, lanes[j]), check += zeros[j];
    for (int64_t t = i; t < V; ++t) top = std::max(top, x[t]), check += x[t] * 0.0f;
    if (check != 0.0f) {  // NaN != 0
      op[m] = logits[m].argmax().item<int64_t>();
      continue;
    }
    const vec target = vset1(top);
    int64_t at = -1;
    for (i = 0; i + kVec <= V && at < 0; i += kVec) {
      const unsigned hits = vequal_lanes(vload(x + i), target);
      if (hits) at = i + __builtin_ctz(hits);
    }
    for (int64_t t = i; t < V && at < 0; ++t)
      if (x[t] == top) at = t;
    op[m] = at;
  }
  return out;
}

inline torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && wp.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kPanel && wp.is_contiguous(), "bad shapes");
  TORCH_CHECK(x.size(1) == wp.size(1), "x has ", x.size(1), " features, weight expects ", wp.size(1));
  TORCH_CHECK(wp.size(0) % kGroup == 0, "panel count must be a multiple of ", kGroup);
  x = x.contiguous();
  return run_all_groups(x, wp.data_ptr<float>(), wp.size(0),
                        group_for_rows<float, FloatTiles, 4>(x.size(0)), bias);
}

inline torch::Tensor quant_linear(torch::Tensor x, torch::Tensor wq, int64_t format, int64_t group,
                           c10::optional<torch::Tensor> bias) {
  check_quantized_operands(x, wq, format, group);
  x = x.contiguous();
  const GroupFn run = with_format(format, group, [&](auto f, auto g) {
    using Tiles = QuantTiles<decltype(f)::value, decltype(g)::value>;
    return group_for_rows<uint8_t, Tiles::template With, kQuantMaxPanels>(x.size(0));
  });
  return run_all_groups(x, wq.data_ptr<uint8_t>(), wq.size(0), run, bias);
}

inline torch::Tensor dequantize_panels(torch::Tensor wq, int64_t format, int64_t group, int64_t K) {
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

inline int64_t panels_per_group() { return kGroup; }

// One q8 layer's part of a parallel region: its units (kGroup panels each) and how to run one.
struct Q8Job {
  using UnitFn = void (*)(const QuantizedRows&, const uint8_t*, int64_t, float*, int64_t, const float*, bool);
  UnitFn unit;
  const uint8_t* wq;
  int64_t units;
  float* y;
  int64_t N;
  const float* bias;
};

// A q8 layer's job over rows ``a``, its output y [M, N] allocated here.
inline Q8Job q8_job(const QuantizedRows& a, const torch::Tensor& wq, int64_t format, int64_t group,
                    const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  const int64_t P = wq.size(0), N = P * kPanel;
  TORCH_CHECK(wq.dtype() == torch::kUInt8 && wq.dim() == 2 && wq.is_contiguous(), "bad quantized weight");
  TORCH_CHECK(wq.size(1) == quant_panel_bytes(format, group, a.K),
              "x has ", a.K, " features, which does not match the quantized weight");
  y = torch::empty({a.M, N}, torch::dtype(torch::kFloat32));
  Q8Job::UnitFn unit = format == kSixBits ? &q8six_run_unit : with_format(format, group, [](auto f, auto g) {
    return static_cast<Q8Job::UnitFn>(&q8_run_unit<decltype(f)::value, decltype(g)::value>);
  });
  return {unit, wq.data_ptr<uint8_t>(), P / kGroup, y.data_ptr<float>(), N, bias_pointer(bias, N)};
}

// Layers over the same rows in one parallel region (q, k and v; gate and up): one wake-up of the
// threads and one wait at the end instead of one per layer.
inline void q8_run_jobs(const QuantizedRows& a, const std::vector<Q8Job>& jobs, bool reference) {
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
inline torch::Tensor q8_linear_rows(const QuantizedRows& a, const torch::Tensor& wq, int64_t format,
                                    int64_t group, const c10::optional<torch::Tensor>& bias, bool reference) {
  torch::Tensor y;
  q8_run_jobs(a, {q8_job(a, wq, format, group, bias, y)}, reference);
  return y;
}

// x [M, K] float32 times quantized panels in the q8 arrangement (speed mode gguf-q8).
// reference: the scalar path (the vector tiles must give the same bits).
inline torch::Tensor q8_linear(torch::Tensor x, torch::Tensor wq, int64_t format, int64_t group,
                               c10::optional<torch::Tensor> bias, bool reference) {
  check_quantized_operands(x, wq, format, group);
  x = x.contiguous();
  return q8_linear_rows(quantize_rows(x), wq, format, group, bias, reference);
}

inline bool q8_vectorized() { return kHaveQ8Vector; }
// Whether mode gguf-q8 holds Q6_K as six-bit panels in this build (the VNNI or AVX2 tiles).
inline bool q8_six_bits() { return kHaveSixBitTiles; }


// q [B, Hq, M, D]; k, v [B, Hkv, L, D] (Hq a multiple of Hkv); mask None or [B|1, Hq|1, M, L], bool
// (true: may attend) or float (added to the scores). Without a mask: row i sees keys 0..i when
// causal and M > 1 (transformers' is_causal), else every key. Returns [B, M, Hq, D].
inline torch::Tensor attention_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
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
  // one task per (batch, key-value head, row): the query heads sharing a key-value head together
  at::parallel_for(0, B * Hkv * M, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(group * L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (Hkv * M), hk = t / M % Hkv, i = t % M, h0 = hk * group;
      const float* qi = qp + b * q.stride(0) + h0 * q.stride(1) + i * q.stride(2);
      const float* kh = kp + b * k.stride(0) + hk * k.stride(1);
      const float* vh = vp + b * v.stride(0) + hk * v.stride(1);
      const int64_t visible = !has_mask && causal && M > 1 ? std::min(L, i + 1) : L;
      const int64_t mask_row = has_mask ? b * ms[0] + h0 * ms[1] + i * ms[2] : 0;
      auto masked = [&](int64_t h, int64_t j, float s) {
        const int64_t at = mask_row + h * ms[1] + j * ms[3];
        return mask_bool ? (mask_bool[at] ? s : -INFINITY) : mask_float ? s + mask_float[at] : s;
      };
      attend_group(qi, q.stride(1), group, kh, k.stride(2), vh, v.stride(2), D, visible, fscale, masked,
                   scores.data(), op + ((b * M + i) * Hq + h0) * D);
    }
  });
  return out;
}

}  // namespace selfspec
