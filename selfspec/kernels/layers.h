// A pre-norm decoder layer (llama, qwen2, mistral) as two native calls: the attention sublayer
//   h + o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))     x = rms_norm(h)
// and the MLP sublayer
//   h + down_proj(silu(gate_proj(x)) * up_proj(x))                         x = rms_norm(h)
// each one call from Python instead of a few dozen torch operations. Every step works row by
// row (norms, rotary embedding, attention over the keys a row may see, the linear layers), so a
// row's result never depends on the other rows of its pass: verify passes and token trees give
// each row the bits of a one-token pass.
#pragma once

#include "ops.h"

#include <cstring>
#include <tuple>

namespace selfspec {

constexpr int64_t kPackedKind = 0;  // float32 panels [P, K, 16] (speed mode packed)
constexpr int64_t kQuantKind = 1;   // a GGUF file's integers, float32 arithmetic (gguf)
constexpr int64_t kQ8Kind = 2;      // the same integers times 8-bit activations (gguf-q8)

// One linear layer's weights as the kernel holds them.
struct LinearRef {
  int64_t kind;
  torch::Tensor weight;
  int64_t format, group;
  c10::optional<torch::Tensor> bias;
  int64_t in_features, out_features;
  int64_t max_rows;  // rows per kernel call: longer passes (prefill) go through in chunks

  // This q8 layer's part of a parallel region over ``rows``, writing into y (allocated here).
  Q8Job job(const QuantizedRows& rows, torch::Tensor& y) const { return q8_job(rows, weight, format, group, bias, y); }

  // y = x W^T + b for x [M, K]; ``rows``: x already rounded to 8 bits (q8 only).
  torch::Tensor forward(const torch::Tensor& x, const QuantizedRows* rows = nullptr) const {
    const int64_t M = x.size(0);
    if (kind == kQ8Kind) {
      if (rows != nullptr) return q8_linear_rows(*rows, weight, format, group, bias, false);
      return q8_linear(x, weight, format, group, bias, false);
    }
    if (M <= max_rows) return kernel(x);
    // A chunk's rows stay in cache while every weight passes by them once.
    std::vector<torch::Tensor> chunks;
    for (int64_t m0 = 0; m0 < M; m0 += max_rows) chunks.push_back(kernel(x.slice(0, m0, std::min(M, m0 + max_rows))));
    return torch::cat(chunks, 0);
  }

  torch::Tensor kernel(const torch::Tensor& x) const {
    return kind == kPackedKind ? packed_linear(x, weight, bias) : quant_linear(x, weight, format, group, bias);
  }
};

// x / sqrt(mean(x^2) + eps) * weight, per row, summed in a fixed order.
inline torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& weight, float eps) {
  const int64_t M = h.size(0), H = h.size(1);
  auto out = torch::empty_like(h);
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
inline void rotate(torch::Tensor& x, int64_t heads, int64_t D, const float* cos, const float* sin) {
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
inline torch::Tensor plus_residual(torch::Tensor y, const torch::Tensor& h) {
  TORCH_CHECK(y.sizes() == h.sizes() && y.is_contiguous() && h.is_contiguous(), "residual shapes differ");
  float* yp = y.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  at::parallel_for(0, y.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) yp[i] = hp[i] + yp[i];
  });
  return y;
}

struct DecoderLayer {
  torch::Tensor input_norm, post_attention_norm;
  double eps;
  LinearRef q, k, v, o, gate, up, down;
  int64_t heads, kv_heads, head_dim;
  double scale;  // attention scores are q.k times this

  // x = rms_norm(h) and, when every consumer is a q8 layer, x rounded to 8 bits once.
  std::pair<torch::Tensor, c10::optional<QuantizedRows>> normed(const torch::Tensor& h, const torch::Tensor& w,
                                                                 std::initializer_list<const LinearRef*> users) const {
    torch::Tensor x = rms_norm(h, w, static_cast<float>(eps));
    bool q8 = true;
    for (const LinearRef* l : users) q8 = q8 && l->kind == kQ8Kind;
    if (!q8) return {x, c10::nullopt};
    return {x, quantize_rows(x)};
  }

  // q, k and v of rms_norm(h) [M, H], q and k turned by the rotary embedding (cos, sin: [M, D]).
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotated_qkv(const torch::Tensor& h, torch::Tensor cos,
                                                                      torch::Tensor sin) const {
    const int64_t M = h.size(0), D = head_dim;
    cos = cos.reshape({M, D}).contiguous();
    sin = sin.reshape({M, D}).contiguous();
    auto [x, rows] = normed(h, input_norm, {&q, &k, &v});
    const QuantizedRows* r = rows.has_value() ? &*rows : nullptr;
    torch::Tensor qs, ks, vs;
    if (r != nullptr) {
      q8_run_jobs(*r, {q.job(*r, qs), k.job(*r, ks), v.job(*r, vs)}, false);
    } else {
      qs = q.forward(x), ks = k.forward(x), vs = v.forward(x);
    }
    rotate(qs, heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
    rotate(ks, kv_heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
    return {qs, ks, vs};
  }

  // h [M, H] at positions given by cos/sin [M, D]; keys, values [kv_heads, max_len, D] (this
  // layer's cache, strided views are fine); this pass's keys and values are written at rows
  // start..start+M-1. mask: None (row m sees keys 0..start+m) or bool [M, start+M].
  torch::Tensor attention(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                          torch::Tensor values, int64_t start, c10::optional<torch::Tensor> mask) const {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.dtype() == torch::kFloat32, "h must be [M, H] float32");
    const int64_t M = h.size(0), D = head_dim, L = start + M;
    TORCH_CHECK(keys.size(1) >= L && keys.stride(2) == 1 && values.stride(2) == 1, "cache too short");
    auto [qs, ks, vs] = rotated_qkv(h, cos, sin);
    write_cache(ks, keys, start);
    write_cache(vs, values, start);
    torch::Tensor m;
    if (mask.has_value() && mask->defined()) {
      m = mask->reshape({M, L}).contiguous();
      TORCH_CHECK(m.dtype() == torch::kBool, "mask must be bool");
    }
    auto out = torch::empty({M, heads * D}, h.options());
    attend(qs, keys, values, start, m, out);
    return plus_residual(o.forward(out), h);
  }

  // rows [M, kv_heads * D] into cache [kv_heads, max_len, D] at positions start..start+M-1
  void write_cache(const torch::Tensor& rows, const torch::Tensor& cache, int64_t start) const {
    TORCH_CHECK(cache.dtype() == torch::kFloat32, "the cache must be float32");
    const int64_t M = rows.size(0), D = head_dim;
    const float* src = rows.data_ptr<float>();
    float* dst = cache.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t hk = 0; hk < kv_heads; ++hk)
        std::memcpy(dst + hk * cache.stride(0) + (start + m) * cache.stride(1), src + (m * kv_heads + hk) * D,
                    D * sizeof(float));
  }

  // One row per sequence: row m is sequence m's next token, at position starts[m] of its own cache
  // keys[m], values[m] ([kv_heads, max_len, D] each). The linear layers run over all rows at once;
  // each row's rotary embedding (cos/sin row m), cache write and attention over its own keys
  // 0..starts[m] are its own, so every row gets the bits of its sequence's one-token pass.
  torch::Tensor attention_many(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> keys,
                               std::vector<torch::Tensor> values, std::vector<int64_t> starts) const {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.dtype() == torch::kFloat32, "h must be [M, H] float32");
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
    auto out = torch::empty({M, heads * D}, h.options());
    const float* qp = qs.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float fscale = static_cast<float>(scale);
    at::parallel_for(0, M * kv_heads, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t m = t / kv_heads, hk = t % kv_heads, L = starts[m] + 1;
        scores.resize(group * L);
        const torch::Tensor& kc = keys[m];
        const torch::Tensor& vc = values[m];
        const int64_t first = (m * heads + hk * group) * D;  // this group's query heads, one after another
        attend_group(qp + first, D, group, kc.data_ptr<float>() + hk * kc.stride(0), kc.stride(1),
                     vc.data_ptr<float>() + hk * vc.stride(0), vc.stride(1), D, L, fscale,
                     [](int64_t, int64_t, float s) { return s; }, scores.data(), op + first);
      }
    });
    return plus_residual(o.forward(out), h);
  }

  // Each task takes one key-value head and a run of rows: all their grouped query heads read each
  // key and value once (attend_queries), however many rows the pass has.
  void attend(const torch::Tensor& qs, const torch::Tensor& keys, const torch::Tensor& values, int64_t start,
              const torch::Tensor& mask, torch::Tensor& out) const {
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

  torch::Tensor mlp(torch::Tensor h) const {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.dtype() == torch::kFloat32, "h must be [M, H] float32");
    auto [x, rows] = normed(h, post_attention_norm, {&gate, &up});
    const QuantizedRows* r = rows.has_value() ? &*rows : nullptr;
    torch::Tensor g, u;
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
};

// The whole stack of decoder layers in one native call: sublayers [first, stop) (sublayer 2i is
// layer i's attention, 2i + 1 its MLP), those flagged in skip_attention / skip_mlp left out. A
// pass over 28 layers otherwise makes 56 calls from Python, each converting its arguments and
// taking the interpreter's lock again. keys, values: every layer's cache [layers, 1, kv_heads,
// max_len, D]; mask as DecoderLayer::attention's, one for every layer (full attention only).
struct LayerStack {
  std::vector<DecoderLayer> layers;

  explicit LayerStack(std::vector<DecoderLayer> stack) : layers(std::move(stack)) {}

  torch::Tensor run(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys, torch::Tensor values,
                    int64_t start, c10::optional<torch::Tensor> mask, int64_t first, int64_t stop,
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
};

}  // namespace selfspec
