// layers.h's decoder layers and the attention entry point: the norms, the rotary embedding and the
// attention of attention.h are compiled here; the linear layers are linear.cpp's and q8.cpp's.
#include "layers.h"

#include <cstring>

#include "attention.h"
#include "q8.h"

namespace selfspec {

Q8Job LinearRef::job(const QuantizedRows& rows, at::Tensor& y) const { return q8_job(rows, weight, format, group, bias, y); }

at::Tensor LinearRef::forward(const at::Tensor& x, const QuantizedRows* rows) const {
  const int64_t M = x.size(0);
  if (kind == kQ8Kind) {
    if (rows != nullptr) return q8_linear_rows(*rows, weight, format, group, bias, false);
    return q8_linear(x, weight, format, group, bias, false);
  }
  if (M <= max_rows) return kernel(x);
  // A chunk's rows stay in cache while every weight passes by them once.
  std::vector<at::Tensor> chunks;
  for (int64_t m0 = 0; m0 < M; m0 += max_rows) chunks.push_back(kernel(x.slice(0, m0, std::min(M, m0 + max_rows))));
  return at::cat(chunks, 0);
}

at::Tensor LinearRef::kernel(const at::Tensor& x) const {
  return kind == kPackedKind ? packed_linear(x, weight, bias) : quant_linear(x, weight, format, group, bias);
}

at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, float eps) {
  const int64_t M = h.size(0), H = h.size(1);
  auto out = at::empty_like(h);
  const float* hp = h.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* x = hp + m * H;
      const float variance = dot_row(x, x, H) / static_cast<float>(H);
      const float r = 1.0f / std::sqrt(variance + eps);
      for (int64_t i = 0; i < H; ++i) op[m * H + i] = wp[i] * (x[i] * r);
    }
  });
  return out;
}

// Rotary embedding in place on x [M, heads * D] with cos, sin [M, D] (transformers' rotate_half
// layout: the first half of each head's dimensions pairs with the second).
static void rotate(at::Tensor& x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t M = x.size(0), half = D / 2;
  float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = xp + (m * heads + h) * D;
      const float* c = cos + m * D;
      const float* s = sin + m * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
}

// y + h in place (y: a sublayer's fresh output, h: the residual stream, both [M, H]): the bits of
// torch's h + y without a dispatch and an allocation.
static at::Tensor plus_residual(at::Tensor y, const at::Tensor& h) {
  TORCH_CHECK(y.sizes() == h.sizes() && y.is_contiguous() && h.is_contiguous(), "residual shapes differ");
  float* yp = y.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  at::parallel_for(0, y.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) yp[i] = hp[i] + yp[i];
  });
  return y;
}

std::pair<at::Tensor, c10::optional<QuantizedRows>> DecoderLayer::normed(const at::Tensor& h, const at::Tensor& w,
                                                                         std::initializer_list<const LinearRef*> users) const {
  at::Tensor x = rms_norm(h, w, static_cast<float>(eps));
  bool q8 = true;
  for (const LinearRef* l : users) q8 = q8 && l->kind == kQ8Kind;
  if (!q8) return {x, c10::nullopt};
  return {x, quantize_rows(x)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DecoderLayer::rotated_qkv(const at::Tensor& h, at::Tensor cos,
                                                                         at::Tensor sin) const {
  const int64_t M = h.size(0), D = head_dim;
  cos = cos.reshape({M, D}).contiguous();
  sin = sin.reshape({M, D}).contiguous();
  auto [x, rows] = normed(h, input_norm, {&q, &k, &v});
  const QuantizedRows* r = rows.has_value() ? &*rows : nullptr;
  at::Tensor qs, ks, vs;
  if (r != nullptr) {
    q8_run_jobs(*r, {q.job(*r, qs), k.job(*r, ks), v.job(*r, vs)}, false);
  } else {
    qs = q.forward(x), ks = k.forward(x), vs = v.forward(x);
  }
  rotate(qs, heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotate(ks, kv_heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  return {qs, ks, vs};
}

at::Tensor DecoderLayer::attention(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                                   at::Tensor values, int64_t start, c10::optional<at::Tensor> mask) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.dtype() == at::kFloat, "h must be [M, H] float32");
  const int64_t M = h.size(0), D = head_dim, L = start + M;
  TORCH_CHECK(keys.size(1) >= L && keys.stride(2) == 1 && values.stride(2) == 1, "cache too short");
  auto [qs, ks, vs] = rotated_qkv(h, cos, sin);
  write_cache(ks, keys, start);
  write_cache(vs, values, start);
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->reshape({M, L}).contiguous();
    TORCH_CHECK(m.dtype() == at::kBool, "mask must be bool");
  }
  auto out = at::empty({M, heads * D}, h.options());
  attend(qs, keys, values, start, m, out);
  return plus_residual(o.forward(out), h);
}

void DecoderLayer::write_cache(const at::Tensor& rows, const at::Tensor& cache, int64_t start) const {
  TORCH_CHECK(cache.dtype() == at::kFloat, "the cache must be float32");
  const int64_t M = rows.size(0), D = head_dim;
  const float* src = rows.data_ptr<float>();
  float* dst = cache.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t hk = 0; hk < kv_heads; ++hk)
      std::memcpy(dst + hk * cache.stride(0) + (start + m) * cache.stride(1), src + (m * kv_heads + hk) * D,
                  D * sizeof(float));
}

at::Tensor DecoderLayer::attention_many(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                                        std::vector<at::Tensor> values, std::vector<int64_t> starts) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.dtype() == at::kFloat, "h must be [M, H] float32");
  const int64_t M = h.size(0), D = head_dim, group = heads / kv_heads;
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == M && static_cast<int64_t>(values.size()) == M &&
                  static_cast<int64_t>(starts.size()) == M, "one cache and start per row");
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(keys[m].size(1) > starts[m] && keys[m].stride(2) == 1 && values[m].stride(2) == 1, "cache too short");
  auto [qs, ks, vs] = rotated_qkv(h, cos, sin);
  for (int64_t m = 0; m < M; ++m) {
    write_cache(ks.slice(0, m, m + 1), keys[m], starts[m]);
    write_cache(vs.slice(0, m, m + 1), values[m], starts[m]);
  }
  auto out = at::empty({M, heads * D}, h.options());
  const float* qp = qs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, M * kv_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t / kv_heads, hk = t % kv_heads, L = starts[m] + 1;
      scores.resize(group * L);
      const at::Tensor& kc = keys[m];
      const at::Tensor& vc = values[m];
      const int64_t first = (m * heads + hk * group) * D;  // this group's query heads, one after another
      attend_group(qp + first, D, group, kc.data_ptr<float>() + hk * kc.stride(0), kc.stride(1),
                   vc.data_ptr<float>() + hk * vc.stride(0), vc.stride(1), D, L, fscale,
                   [](int64_t, int64_t, float s) { return s; }, scores.data(), op + first);
    }
  });
  return plus_residual(o.forward(out), h);
}

void DecoderLayer::attend(const at::Tensor& qs, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                          const at::Tensor& mask, at::Tensor& out) const {
  const int64_t M = qs.size(0), D = head_dim, L = start + M, group = heads / kv_heads;
  const float* qp = qs.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t wanted = std::min<int64_t>(M, std::max<int64_t>(1, at::get_num_threads() / kv_heads));
  const int64_t run_rows = (M + wanted - 1) / wanted, runs = (M + run_rows - 1) / run_rows;
  at::parallel_for(0, runs * kv_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<QueryRow> rows;
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t hk = t % kv_heads, m0 = t / kv_heads * run_rows, m1 = std::min(M, m0 + run_rows);
      rows.clear();
      int64_t width = 0;
      for (int64_t m = m0; m < m1; ++m) {
        // row m sees keys 0..start+m without a mask, else those its mask row allows (none after
        // the last it allows: those are not even scored)
        int64_t seen = start + m + 1;
        if (mp) for (seen = L; seen > 0 && !mp[m * L + seen - 1];) --seen;
        width = std::max(width, seen);
        for (int64_t h = 0; h < group; ++h) {
          const int64_t at = (m * heads + hk * group + h) * D;
          rows.push_back({qp + at, op + at, seen});
        }
      }
      scores.resize(rows.size() * width);
      auto hide = [&](int64_t i, int64_t j, float s) {
        return mp && !mp[(m0 + i / group) * L + j] ? -INFINITY : s;
      };
      attend_queries(rows.data(), static_cast<int64_t>(rows.size()), kp + hk * keys.stride(0), keys.stride(1),
                     vp + hk * values.stride(0), values.stride(1), D, fscale, hide, scores.data());
    }
  });
}

at::Tensor DecoderLayer::mlp(at::Tensor h) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.dtype() == at::kFloat, "h must be [M, H] float32");
  auto [x, rows] = normed(h, post_attention_norm, {&gate, &up});
  const QuantizedRows* r = rows.has_value() ? &*rows : nullptr;
  at::Tensor g, u;
  if (r != nullptr) {
    q8_run_jobs(*r, {gate.job(*r, g), up.job(*r, u)}, false);
  } else {
    g = gate.forward(x), u = up.forward(x);
  }
  float* gp = g.data_ptr<float>();
  const float* upp = u.data_ptr<float>();
  const int64_t n = g.numel();
  at::parallel_for(0, (n + kVec - 1) / kVec, 4096 / kVec, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0 * kVec; i < std::min(n, b1 * kVec); i += kVec) {
      if (i + kVec <= n) {
        vstore(gp + i, silu_times(vload(gp + i), vload(upp + i)));
        continue;
      }
      alignas(64) float gs[kVec] = {}, us[kVec] = {};  // the last few, padded with zeros
      for (int64_t t = 0; i + t < n; ++t) gs[t] = gp[i + t], us[t] = upp[i + t];
      vstore(gs, silu_times(vload(gs), vload(us)));
      for (int64_t t = 0; i + t < n; ++t) gp[i + t] = gs[t];
    }
  });
  return plus_residual(down.forward(g), h);
}

at::Tensor LayerStack::run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values,
                           int64_t start, c10::optional<at::Tensor> mask, int64_t first, int64_t stop,
                           std::vector<bool> skip_attention, std::vector<bool> skip_mlp) const {
  const int64_t count = static_cast<int64_t>(layers.size());
  TORCH_CHECK(0 <= first && first <= stop && stop <= 2 * count, "sublayers out of range");
  TORCH_CHECK(static_cast<int64_t>(skip_attention.size()) == count &&
                  static_cast<int64_t>(skip_mlp.size()) == count && keys.size(0) == count && values.size(0) == count,
              "one entry per layer expected");
  for (int64_t sub = first; sub < stop; ++sub) {
    const int64_t i = sub / 2;
    if (sub % 2 == 0) {
      if (!skip_attention[i])
        h = layers[i].attention(h, cos, sin, keys[i][0], values[i][0], start, mask);
    } else if (!skip_mlp[i]) {
      h = layers[i].mlp(h);
    }
  }
  return h;
}

// q [B, Hq, M, D]; k, v [B, Hkv, L, D] (Hq a multiple of Hkv); mask None or [B|1, Hq|1, M, L], bool
// (true: may attend) or float (added to the scores). Without a mask: row i sees keys 0..i when
// causal and M > 1 (transformers' is_causal), else every key. Returns [B, M, Hq, D].
at::Tensor attention_rows(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask,
                          double scale, bool causal) {
  TORCH_CHECK(q.dtype() == at::kFloat && k.dtype() == at::kFloat && v.dtype() == at::kFloat,
              "float32 only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "bad attention shapes");
  const int64_t B = q.size(0), Hq = q.size(1), M = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hq % Hkv == 0, "bad attention shapes");
  // Read in place through strides: the runner's cache hands out views of longer buffers, and a
  // copy of every cached key and value per layer and pass is what this is here to avoid.
  const auto rows_in_place = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  q = rows_in_place(q);
  k = rows_in_place(k);
  v = rows_in_place(v);
  at::Tensor m;
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask) {
    TORCH_CHECK(mask->dim() == 4 && (mask->dtype() == at::kBool || mask->dtype() == at::kFloat),
                "mask must be 4-d bool or float32");
    m = mask->expand({B, Hq, M, L});
  }
  const bool* mask_bool = has_mask && m.scalar_type() == at::kBool ? m.data_ptr<bool>() : nullptr;
  const float* mask_float = has_mask && m.scalar_type() == at::kFloat ? m.data_ptr<float>() : nullptr;
  const std::array<int64_t, 4> ms = has_mask ? std::array<int64_t, 4>{m.stride(0), m.stride(1), m.stride(2), m.stride(3)}
                                             : std::array<int64_t, 4>{0, 0, 0, 0};
  auto out = at::empty({B, M, Hq, D}, q.options());
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
