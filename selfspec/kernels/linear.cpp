// linear.h's entry points: float32 and quantized panels (modes packed and gguf), argmax.
#include "linear.h"

namespace selfspec {

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.dtype() == at::kFloat, "logits must be [M, V] float32");
  logits = logits.contiguous();
  const int64_t M = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "no logits");
  auto out = at::empty({M}, at::kLong);
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

std::vector<at::Tensor> top_probability_rows(at::Tensor logits) {
  auto ids = argmax_rows(logits);
  logits = logits.contiguous();
  const int64_t M = logits.size(0), V = logits.size(1);
  auto probs = at::empty({M}, at::kFloat);
  float* pp = probs.data_ptr<float>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const float* x = logits.data_ptr<float>() + m * V;
    const float top = x[ip[m]];
    if (!std::isfinite(top)) {  // a row holding an infinity or a NaN: no probability to tell
      pp[m] = 0.0f;
      continue;
    }
    const vec shift = vset1(top);
    vec sum = vzero();
    int64_t i = 0;
    for (; i + kVec <= V; i += kVec) sum = vadd(sum, vexp_nonpositive(vadd(vload(x + i), vneg(shift))));
    alignas(64) float lanes[kVec];
    vstore(lanes, sum);
    float total = 0.0f;
    for (int j = 0; j < kVec; ++j) total += lanes[j];
    for (; i < V; ++i) total += std::exp(x[i] - top);
    pp[m] = 1.0f / total;
  }
  return {ids, probs};
}

// The runners-up after ``first``: a sorted list of k - 1, and a vector pass that looks at a
// chunk's lanes only where one beats the list's last (after the first few chunks, seldom).
static void runners_up(const float* x, int64_t V, int64_t first, int64_t k, int64_t* ids, float* vals) {
  int64_t count = 0;
  float floor = -INFINITY;  // the list's last value once it is full
  auto offer = [&](int64_t i) {
    const float value = x[i];
    if (i == first || !(value > floor || (count < k && value == value))) return;
    int64_t at = count < k ? count++ : k - 1;
    while (at > 0 && vals[at - 1] < value) {  // equal values keep the lower index first
      vals[at] = vals[at - 1], ids[at] = ids[at - 1];
      --at;
    }
    vals[at] = value, ids[at] = i;
    if (count == k) floor = vals[k - 1];
  };
  int64_t i = 0;
  for (; i + kVec <= V; i += kVec) {
    unsigned hits = count < k ? (1u << kVec) - 1 : vgreater_lanes(vload(x + i), vset1(floor));
    for (; hits; hits &= hits - 1) offer(i + __builtin_ctz(hits));
  }
  for (; i < V; ++i) offer(i);
}

std::vector<at::Tensor> top_k_probability_rows(at::Tensor logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.dtype() == at::kFloat, "logits must be [M, V] float32");
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "k must be in 1..V");
  auto top = top_probability_rows(logits);
  logits = logits.contiguous();
  const int64_t M = logits.size(0), V = logits.size(1);
  auto ids = at::empty({M, k}, at::kLong);
  auto probs = at::empty({M, k}, at::kFloat);
  int64_t* ip = ids.data_ptr<int64_t>();
  float* pp = probs.data_ptr<float>();
  std::fill(ip, ip + M * k, int64_t{-1});
  std::fill(pp, pp + M * k, 0.0f);
  std::vector<float> vals(k);
  for (int64_t m = 0; m < M; ++m) {
    const float* x = logits.data_ptr<float>() + m * V;
    const int64_t first = top[0].data_ptr<int64_t>()[m];
    const float p = top[1].data_ptr<float>()[m];
    ip[m * k] = first, pp[m * k] = p;
    if (p == 0.0f || k == 1) continue;
    runners_up(x, V, first, k - 1, ip + m * k + 1, vals.data());
    // p = 1 / sum_j exp(x_j - top): a runner-up's probability is p * exp(x_i - top)
    for (int64_t j = 1; j < k; ++j)
      if (ip[m * k + j] >= 0) pp[m * k + j] = p * std::exp(x[ip[m * k + j]] - x[first]);
  }
  return {ids, probs};
}

std::vector<at::Tensor> softmax_partition(at::Tensor logits, double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.dtype() == at::kFloat, "logits must be [M, V] float32");
  TORCH_CHECK(temperature > 0, "temperature must be positive");
  logits = logits.contiguous();
  const int64_t M = logits.size(0), V = logits.size(1);
  auto tops = at::empty({M}, at::kFloat), totals = at::empty({M}, at::kFloat);
  float *tp = tops.data_ptr<float>(), *sp = totals.data_ptr<float>();
  const vec scale = vset1(static_cast<float>(1.0 / temperature));
  for (int64_t m = 0; m < M; ++m) {
    const float* x = logits.data_ptr<float>() + m * V;
    vec best = vset1(-INFINITY);
    int64_t i = 0;
    for (; i + kVec <= V; i += kVec) best = vmax(best, vload(x + i));
    alignas(64) float lanes[kVec];
    vstore(lanes, best);
    float top = -INFINITY;
    for (int j = 0; j < kVec; ++j) top = std::max(top, lanes[j]);
    for (; i < V; ++i) top = std::max(top, x[i]);
    tp[m] = top;
    if (!std::isfinite(top)) {  // NaN or infinity: the caller goes to torch
      sp[m] = NAN;
      continue;
    }
    const vec shift = vset1(top);
    vec sum = vzero();
    for (i = 0; i + kVec <= V; i += kVec) sum = vadd(sum, vexp_nonpositive(vmul(vadd(vload(x + i), vneg(shift)), scale)));
    vstore(lanes, sum);
    float total = 0.0f;
    for (int j = 0; j < kVec; ++j) total += lanes[j];
    for (; i < V; ++i) total += std::exp((x[i] - top) / static_cast<float>(temperature));
    sp[m] = total;
  }
  return {tops, totals};
}

int64_t sample_row(at::Tensor row, double temperature, double top, double total, double u, int64_t excluded) {
  TORCH_CHECK(row.dim() == 1 && row.dtype() == at::kFloat, "row must be [V] float32");
  row = row.contiguous();
  const float* x = row.data_ptr<float>();
  const int64_t V = row.size(0);
  const float inv = static_cast<float>(1.0 / temperature);
  const auto weight = [&](int64_t j) { return std::exp((x[j] - static_cast<float>(top)) * inv); };
  double target = u * (total - (excluded >= 0 ? weight(excluded) : 0.0));
  const vec shift = vset1(static_cast<float>(top)), scale = vset1(inv);
  double running = 0.0;
  int64_t last = -1;  // the last index with weight, for a target rounding puts past the end
  int64_t i = 0;
  alignas(64) float lanes[kVec];
  for (; i + kVec <= V; i += kVec) {
    vstore(lanes, vexp_nonpositive(vmul(vadd(vload(x + i), vneg(shift)), scale)));
    float block = 0.0f;
    for (int j = 0; j < kVec; ++j) block += (i + j == excluded) ? 0.0f : lanes[j];
    if (running + block < target) {
      running += block;
      if (block > 0.0f) last = i;  // refined below only where the draw lands
      continue;
    }
    for (int j = 0; j < kVec; ++j) {
      if (i + j == excluded || lanes[j] == 0.0f) continue;
      running += lanes[j];
      last = i + j;
      if (running >= target) return last;
    }
  }
  for (; i < V; ++i) {
    if (i == excluded) continue;
    const float w = std::exp((x[i] - static_cast<float>(top)) * inv);
    if (w == 0.0f) continue;
    running += w;
    last = i;
    if (running >= target) return last;
  }
  // Rounding put the target past the sum: the last token with weight (its block's last one).
  if (last >= 0 && last % kVec == 0 && last + kVec <= V) {
    for (int64_t j = last + kVec - 1; j >= last; --j)
      if (j != excluded && weight(j) > 0.0f) return j;
  }
  return last;
}

at::Tensor packed_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dtype() == at::kFloat && wp.dtype() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kPanel && wp.is_contiguous(), "bad shapes");
  TORCH_CHECK(x.size(1) == wp.size(1), "x has ", x.size(1), " features, weight expects ", wp.size(1));
  TORCH_CHECK(wp.size(0) % kGroup == 0, "panel count must be a multiple of ", kGroup);
  x = x.contiguous();
  return run_all_groups(x, wp.data_ptr<float>(), wp.size(0),
                        group_for_rows<float, FloatTiles, 4>(x.size(0)), bias);
}

at::Tensor quant_linear(at::Tensor x, at::Tensor wq, int64_t format, int64_t group,
                        c10::optional<at::Tensor> bias) {
  check_quantized_operands(x, wq, format, group);
  x = x.contiguous();
  if (format == kSixBits) {
#if defined(__AVX512BW__) && defined(__AVX512F__)
    return run_all_groups(x, wq.data_ptr<uint8_t>(), wq.size(0),
                          group_for_rows<uint8_t, SixBitTiles::With, kQuantMaxPanels>(x.size(0)), bias);
#else
    TORCH_CHECK(false, "six-bit panels need an AVX-512 build in speed mode gguf");
#endif
  }
  const GroupFn run = with_format(format, group, [&](auto f, auto g) {
    using Tiles = QuantTiles<decltype(f)::value, decltype(g)::value>;
    return group_for_rows<uint8_t, Tiles::template With, kQuantMaxPanels>(x.size(0));
  });
  return run_all_groups(x, wq.data_ptr<uint8_t>(), wq.size(0), run, bias);
}

at::Tensor dequantize_panels(at::Tensor wq, int64_t format, int64_t group, int64_t K) {
  TORCH_CHECK(wq.dtype() == at::kByte && wq.dim() == 2 && wq.is_contiguous(), "bad quantized weight");
  const int64_t panel_bytes = quant_panel_bytes(format, group, K);
  TORCH_CHECK(wq.size(1) == panel_bytes, "quantized weight does not hold ", K, " features");
  const int64_t P = wq.size(0);
  auto out = at::empty({P, K, kPanel}, at::dtype(at::kFloat));
  const uint8_t* src = wq.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  void (*fn)(const uint8_t*, int64_t, float*) =
      format == kSixBits ? &dequantize_six_panel
                         : with_format(format, group, [](auto f, auto g) { return &dequantize_panel<decltype(f)::value, decltype(g)::value>; });
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) fn(src + p * panel_bytes, K, dst + p * K * kPanel);
  });
  return out;
}

int64_t quant_panel_bytes(int64_t format, int64_t group, int64_t K) {
  const int64_t multiple =
      format == kSuperNibbles || format == kSixBits || format == kThreeBits || format == kTwoBits ||
              format == kLutNibbles || format == kFiveBits
          ? 256
          : group;
  if (format == kHalfNibbles || format == kHalfLutNibbles || format == kHalfFiveBits || format == kHalfOffsetFiveBits) {
    TORCH_CHECK(group == 32 && K % 32 == 0, "Q4_0, IQ4_NL, Q5_0 and Q5_1 panels hold groups of 32, of ", K,
                " features");
    return format == kHalfFiveBits         ? HalfFiveBitLayout::panel_bytes(K)
           : format == kHalfOffsetFiveBits ? HalfOffsetFiveBitLayout::panel_bytes(K)
                                           : HalfLutLayout::panel_bytes(K);
  }
  TORCH_CHECK(K % multiple == 0, "in_features ", K, " is not a multiple of ", multiple);
  if (format == kSixBits || format == kThreeBits || format == kTwoBits) {
    TORCH_CHECK(group == 16, "Q6_K, Q3_K and Q2_K panels hold groups of 16");
    return format == kSixBits     ? SixBitLayout::panel_bytes(K)
           : format == kThreeBits ? ThreeBitLayout::panel_bytes(K)
                                  : TwoBitLayout::panel_bytes(K);
  }
  if (format == kLutNibbles || format == kFiveBits) {
    TORCH_CHECK(group == 32, "IQ4_XS and Q5_K panels hold groups of 32");
    return format == kLutNibbles ? LutLayout::panel_bytes(K) : FiveBitLayout::panel_bytes(K);
  }
  return with_format(format, group, [&](auto f, auto g) { return Layout<decltype(f)::value, decltype(g)::value>::panel_bytes(K); });
}

int64_t panels_per_group() { return kGroup; }

bool quant_six_bits() { return kHaveSixBitFloatTiles; }

}  // namespace selfspec
