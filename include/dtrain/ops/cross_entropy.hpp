// Fused softmax cross-entropy with autograd: mean over the rows whose target is not
// ignore_index, from [rows, vocab] logits in their own dtype. On CUDA one kernel reads the
// logits and, when they need a gradient, writes it in the same call (for the upstream
// gradient the caller announces); the backward returns it. A reference path computes the
// same function with ATen ops in float32 on other devices.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dtrain::ops {

struct CrossEntropyOptions {
  std::int64_t ignore_index = -100;
  // The gradient the caller will give the loss in backward: the factor it multiplies the
  // loss by before backward() (1 for loss.backward()). The CUDA forward writes the logit
  // gradient for it; a backward with another one costs a pass over the gradient to
  // rescale it (same result, one more rounding in 16-bit dtypes). Finite, nonzero.
  double grad_scale = 1.0;
  // CUDA: the gradient replaces the logits (their values are gone after the call, and
  // nothing else may still need them): one logits-sized buffer instead of two. The
  // reference path leaves them as they are.
  bool in_place = false;
};

// logits [rows, vocab], target [rows] int64; 0 when every row is ignored. InvalidArgument
// naming the input or option for other shapes, dtypes or values.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, const CrossEntropyOptions& options = {});

}  // namespace dtrain::ops
