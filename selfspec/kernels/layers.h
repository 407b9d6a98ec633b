// A pre-norm decoder layer (llama, qwen2, mistral) as two native calls: the attention sublayer
//   h + o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))     x = rms_norm(h)
// and the MLP sublayer
//   h + down_proj(silu(gate_proj(x)) * up_proj(x))                         x = rms_norm(h)
// each one call from Python instead of a few dozen torch operations. Every step works row by
// row (norms, rotary embedding, attention over the keys a row may see, the linear layers), so a
// row's result never depends on the other rows of its pass: verify passes and token trees give
// each row the bits of a one-token pass.
#pragma once

#include <initializer_list>
#include <tuple>
#include <utility>

#include "ops.h"

namespace selfspec {

constexpr int64_t kPackedKind = 0;  // float32 panels [P, K, 16] (speed mode packed)
constexpr int64_t kQuantKind = 1;   // a GGUF file's integers, float32 arithmetic (gguf)
constexpr int64_t kQ8Kind = 2;      // the same integers times 8-bit activations (gguf-q8)

// One linear layer's weights as the kernel holds them.
struct LinearRef {
  int64_t kind;
  at::Tensor weight;
  int64_t format, group;
  c10::optional<at::Tensor> bias;
  int64_t in_features, out_features;
  int64_t max_rows;  // rows per kernel call: longer passes (prefill) go through in chunks

  // This q8 layer's part of a parallel region over ``rows``, writing into y (allocated here).
  Q8Job job(const QuantizedRows& rows, at::Tensor& y) const;
  // y = x W^T + b for x [M, K]; ``rows``: x already rounded to 8 bits (q8 only).
  at::Tensor forward(const at::Tensor& x, const QuantizedRows* rows = nullptr) const;
  at::Tensor kernel(const at::Tensor& x) const;
};

// x / sqrt(mean(x^2) + eps) * weight, per row, summed in a fixed order.
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, float eps);

struct DecoderLayer {
  at::Tensor input_norm, post_attention_norm;
  double eps;
  LinearRef q, k, v, o, gate, up, down;
  int64_t heads, kv_heads, head_dim;
  double scale;  // attention scores are q.k times this

  // h [M, H] at positions given by cos/sin [M, D]; keys, values [kv_heads, max_len, D] (this
  // layer's cache, strided views are fine); this pass's keys and values are written at rows
  // start..start+M-1. mask: None (row m sees keys 0..start+m) or bool [M, start+M].
  at::Tensor attention(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values,
                       int64_t start, c10::optional<at::Tensor> mask) const;
  // One row per sequence: row m is sequence m's next token, at position starts[m] of its own cache
  // keys[m], values[m] ([kv_heads, max_len, D] each). The linear layers run over all rows at once;
  // each row's rotary embedding (cos/sin row m), cache write and attention over its own keys
  // 0..starts[m] are its own, so every row gets the bits of its sequence's one-token pass.
  at::Tensor attention_many(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                            std::vector<at::Tensor> values, std::vector<int64_t> starts) const;
  at::Tensor mlp(at::Tensor h) const;

 private:
  // x = rms_norm(h) and, when every consumer is a q8 layer, x rounded to 8 bits once.
  std::pair<at::Tensor, c10::optional<QuantizedRows>> normed(const at::Tensor& h, const at::Tensor& w,
                                                             std::initializer_list<const LinearRef*> users) const;
  // q, k and v of rms_norm(h) [M, H], q and k turned by the rotary embedding (cos, sin: [M, D]).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> rotated_qkv(const at::Tensor& h, at::Tensor cos,
                                                             at::Tensor sin) const;
  // rows [M, kv_heads * D] into cache [kv_heads, max_len, D] at positions start..start+M-1
  void write_cache(const at::Tensor& rows, const at::Tensor& cache, int64_t start) const;
  // Each task takes one key-value head and a run of rows: all their grouped query heads read each
  // key and value once (attend_queries), however many rows the pass has.
  void attend(const at::Tensor& qs, const at::Tensor& keys, const at::Tensor& values, int64_t start,
              const at::Tensor& mask, at::Tensor& out) const;
};

// The whole stack of decoder layers in one native call: sublayers [first, stop) (sublayer 2i is
// layer i's attention, 2i + 1 its MLP), those flagged in skip_attention / skip_mlp left out. A
// pass over 28 layers otherwise makes 56 calls from Python, each converting its arguments and
// taking the interpreter's lock again. keys, values: every layer's cache [layers, 1, kv_heads,
// max_len, D]; mask as DecoderLayer::attention's, one for every layer (full attention only).
struct LayerStack {
  std::vector<DecoderLayer> layers;

  explicit LayerStack(std::vector<DecoderLayer> stack) : layers(std::move(stack)) {}

  at::Tensor run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values, int64_t start,
                 c10::optional<at::Tensor> mask, int64_t first, int64_t stop, std::vector<bool> skip_attention,
                 std::vector<bool> skip_mlp) const;
};

}  // namespace selfspec
