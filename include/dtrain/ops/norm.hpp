// Fused RMSNorm and LayerNorm over the last dim, with autograd: the CUDA kernel for CUDA
// tensors (rows up to dtrain_norm_max_cols wide), a reference path computing the same
// function with ATen ops elsewhere. Statistics and the affine step in float32; the output
// has x's dtype (weights may be float32 under bfloat16 activations).
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::ops {

// x * rsqrt(mean(x^2) + eps) * weight; weight [D] or undefined (no scale).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// (x - mean) * rsqrt(var + eps) * weight + bias; weight, bias [D] or undefined.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);

}  // namespace dtrain::ops
