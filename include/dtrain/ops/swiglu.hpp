// Fused SwiGLU, silu(gate) * up, with autograd: the CUDA kernel (kernels/activation) for
// CUDA tensors, a reference path with the same float32 math in ATen ops elsewhere. Saves
// gate and up for the backward and nothing else (LibTorch's silu-then-multiply also keeps
// silu(gate)); the backward writes both gradients in one pass.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::ops {

// gate and up of one shape and dtype (float32, bfloat16, float16 or float64); the result
// has both (contiguous). Views with a unit last stride, such as the two halves of one
// fused gate-and-up matrix, are read where they are.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

}  // namespace dtrain::ops
