// Rotary position embedding, half-split convention (GPT-NeoX, Llama), with autograd: the
// CUDA kernel (kernels/position) for CUDA tensors, a reference path with the same float32
// math in ATen ops elsewhere. One read and one write of x each way; the backward rotates
// the gradient back and saves nothing but the angles.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::ops {

// x [B, H, T, D] (any strides, D even) rotated by the angles whose cosines and sines are
// cos and sin: [>= T, D / 2] (row t for position t, the batch sharing them) or
// [B, 1, T, D / 2] (each token's own), float32 (float64 for float64 x). The result has x's
// dtype and shape, stored as [B, T, H, D] (the layout attention's output is read back in).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace dtrain::ops
