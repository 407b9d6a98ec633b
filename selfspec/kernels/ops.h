// The kernel's entry points as torch sees them: linear layers over panels (float32, quantized,
// 8-bit activations) and attention one query row at a time. Each is compiled in one source file
// (linear.cpp, q8.cpp, layers.cpp), so a first build compiles them side by side.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor.h"

namespace selfspec {

struct QuantizedRows;  // activations rounded to 8 bits (q8.h)

// linear.cpp

// Per row of logits [M, V] float32, the index of its largest value, the first of several: what
// torch.argmax gives, in two vector passes over the row (the maximum, then its first place)
// instead of torch's scalar reduction. A row holding a NaN or an infinity goes to torch.argmax.
at::Tensor argmax_rows(at::Tensor logits);
// Per row, argmax_rows' index and that logit's softmax probability (1 / sum_j exp(x_j - max));
// 0 for a row whose largest value is not finite.
std::vector<at::Tensor> top_probability_rows(at::Tensor logits);
// Per row, its k largest logits' indices [M, k] (argmax_rows' first, then by value, ties to the
// lower index) and their softmax probabilities [M, k]; a row whose largest value is not finite
// gets argmax_rows' index, probability 0, and -1 after it.
std::vector<at::Tensor> top_k_probability_rows(at::Tensor logits, int64_t k);
// Per row of logits [M, V] float32: its largest value and sum_j exp((x_j - max) / temperature),
// the normalizer of softmax(x / temperature) (NaN where the largest value is not finite).
std::vector<at::Tensor> softmax_partition(at::Tensor logits, double temperature);
// An index drawn from softmax(row / temperature) with ``excluded`` left out (-1: none), by the
// inverse of its cumulative sum at u * (total less the excluded weight), u uniform in [0, 1);
// ``top`` and ``total`` are softmax_partition's for the row.
int64_t sample_row(at::Tensor row, double temperature, double top, double total, double u, int64_t excluded);
// y = x @ W^T (+ bias), W as float32 panels [P, K, 16] (pack_weight).
at::Tensor packed_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias);
// The same with W as a GGUF file's integers in quantized panels (speed mode gguf).
at::Tensor quant_linear(at::Tensor x, at::Tensor wq, int64_t format, int64_t group, c10::optional<at::Tensor> bias);
// Quantized panels rebuilt as float32 [P, K, 16].
at::Tensor dequantize_panels(at::Tensor wq, int64_t format, int64_t group, int64_t K);
int64_t quant_panel_bytes(int64_t format, int64_t group, int64_t K);
int64_t panels_per_group();
// Whether mode gguf holds Q6_K as six-bit panels in this build (its float tiles need AVX-512).
bool quant_six_bits();

// q8.cpp

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
Q8Job q8_job(const QuantizedRows& a, const at::Tensor& wq, int64_t format, int64_t group,
             const c10::optional<at::Tensor>& bias, at::Tensor& y);
// Layers over the same rows in one parallel region (q, k and v; gate and up).
void q8_run_jobs(const QuantizedRows& a, const std::vector<Q8Job>& jobs, bool reference);
// Rows already rounded to 8 bits times quantized panels in the q8 arrangement.
at::Tensor q8_linear_rows(const QuantizedRows& a, const at::Tensor& wq, int64_t format, int64_t group,
                          const c10::optional<at::Tensor>& bias, bool reference);
// x [M, K] float32 times quantized panels in the q8 arrangement (speed mode gguf-q8).
at::Tensor q8_linear(at::Tensor x, at::Tensor wq, int64_t format, int64_t group, c10::optional<at::Tensor> bias,
                     bool reference);
bool q8_vectorized();
bool q8_six_bits();
bool q8_lut_nibbles();
bool q8_five_bits();

// layers.cpp

// q [B, Hq, M, D]; k, v [B, Hkv, L, D]; the bits of each query row its own (attention.h).
at::Tensor attention_rows(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask, double scale,
                          bool causal);

}  // namespace selfspec
