// The part of torch the kernel's sources use: tensors, three factories and the thread pool.
// <torch/extension.h> takes most of a first build to parse (it brings all of torch's C++ API
// and pybind11); these headers take a few seconds, so only module.cpp pays for pybind11.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
