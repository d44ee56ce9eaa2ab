// Fused softmax cross-entropy with autograd: mean over the rows whose target is not
// ignore_index, from [rows, vocab] logits in their own dtype (no float32 copy of the logits
// on CUDA: the kernel reads them in vocabulary chunks). A reference path computes the same
// function with ATen ops in float32 on other devices.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dtrain::ops {

// logits [rows, vocab], target [rows] int64; 0 when every row is ignored. InvalidArgument
// naming the input for other shapes or dtypes.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, std::int64_t ignore_index = -100);

}  // namespace dtrain::ops
