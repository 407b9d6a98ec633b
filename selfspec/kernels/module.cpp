// selfspec's CPU kernel, compiled for the machine on first use (selfspec/kernels/__init__.py):
//   linear.h     float32 and quantized panels, few rows at a time, rows independent of each other
//   q8.h         the GGUF file's integers times activations rounded to 8 bits (speed mode gguf-q8)
//   attention.h  attention, each query row's bits its own (rows read the keys together)
//   ops.h        the entry points torch calls, each compiled in one of linear.cpp, q8.cpp, layers.cpp
//   layers.h     a whole pre-norm decoder sublayer (norm, projections, rotary, attention, MLP) per call
//                and the whole layer stack of a pass in one call (LayerStack)
// This file holds only the Python bindings: the one source that parses pybind11 and torch's
// Python glue, while the kernels' sources compile beside it.
#include <torch/csrc/utils/pybind.h>

#include "layers.h"

namespace py = pybind11;
using namespace selfspec;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "per row, the first index of the largest value (torch.argmax)");
  m.def("top_probability_rows", &top_probability_rows, "per row, argmax_rows and its softmax probability");
  m.def("top_k_probability_rows", &top_k_probability_rows, "per row, the k largest logits' ids and probabilities");
  m.def("softmax_partition", &softmax_partition, "per row, the largest logit and softmax(x / T)'s normalizer");
  m.def("sample_row", &sample_row, "an index drawn from softmax(row / T), one index left out");
  m.def("packed_linear", &packed_linear, "y = x @ W^T (+ bias), W packed in 16-wide panels");
  m.def("quant_linear", &quant_linear, "y = x @ W^T (+ bias), W as quantized 16-wide panels");
  m.def("dequantize_panels", &dequantize_panels, "quantized panels -> float32 [P, K, 16]");
  m.def("quant_panel_bytes", &quant_panel_bytes, "bytes per quantized panel");
  m.def("panels_per_group", &panels_per_group, "panel count granularity");
  m.def("q8_linear", &q8_linear, "y = x @ W^T (+ bias), x rounded to 8 bits, W as quantized panels (q8 arrangement)");
  m.def("attention_rows", &attention_rows, "attention computed row by row, the same bits whatever the row count");
  m.def("quant_six_bits", &quant_six_bits, "whether mode gguf holds Q6_K as six-bit panels in this build (AVX-512)");
  m.def("q8_six_bits", &q8_six_bits, "whether gguf-q8 holds Q6_K, Q3_K and Q2_K as panels of their own bit width in this build (VNNI or AVX2 tiles)");
  m.def("q8_lut_nibbles", &q8_lut_nibbles,
        "whether gguf-q8 holds IQ4_XS as nibble panels in this build (VNNI or AVX2 tiles)");
  m.def("q8_five_bits", &q8_five_bits, "whether gguf-q8 holds Q5_K as five-bit panels in this build (VNNI or AVX2 tiles)");
  m.def("q8_vectorized", &q8_vectorized, "whether q8_linear has a vector path (AVX-512 VNNI or AVX2) in this build");
  m.def("rms_norm", [](at::Tensor h, at::Tensor w, double eps) { return rms_norm(h.contiguous(), w, eps); },
        "x / sqrt(mean(x^2) + eps) * w, row by row");
  py::class_<LinearRef>(m, "LinearRef")
      .def(py::init<int64_t, at::Tensor, int64_t, int64_t, c10::optional<at::Tensor>, int64_t, int64_t,
                    int64_t>(),
           py::arg("kind"), py::arg("weight"), py::arg("format"), py::arg("group"), py::arg("bias"),
           py::arg("in_features"), py::arg("out_features"), py::arg("max_rows"))
      .def("__call__", [](const LinearRef& l, at::Tensor x) { return l.forward(x.contiguous()); });
  py::class_<DecoderLayer>(m, "DecoderLayer")
      .def(py::init<at::Tensor, at::Tensor, double, LinearRef, LinearRef, LinearRef, LinearRef, LinearRef,
                    LinearRef, LinearRef, int64_t, int64_t, int64_t, double>(),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"), py::arg("q"), py::arg("k"),
           py::arg("v"), py::arg("o"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"))
      .def("attention", &DecoderLayer::attention, "h + the attention sublayer of h (writes this pass's keys/values)",
           py::call_guard<py::gil_scoped_release>())
      .def("attention_many", &DecoderLayer::attention_many,
           "h + the attention sublayer for one token of each of several sequences, each with its own cache",
           py::call_guard<py::gil_scoped_release>())
      .def("mlp", &DecoderLayer::mlp, "h + the MLP sublayer of h", py::call_guard<py::gil_scoped_release>());
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<std::vector<DecoderLayer>>(), py::arg("layers"))
      .def("run", &LayerStack::run, "sublayers [first, stop) of the stack in one call",
           py::call_guard<py::gil_scoped_release>());
  m.attr("PACKED_KIND") = kPackedKind;
  m.attr("QUANT_KIND") = kQuantKind;
  m.attr("Q8_KIND") = kQ8Kind;
}
