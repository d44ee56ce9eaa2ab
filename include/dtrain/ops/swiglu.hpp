// Fused SwiGLU, silu(gate) * up, with autograd: the CUDA kernel (kernels/activation) for
// CUDA tensors, a reference path with the same float32 math in ATen ops elsewhere. Saves
// gate and up for the backward and nothing else (LibTorch's silu-then-multiply also keeps
// silu(gate)); the backward writes both gradients in one pass.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::ops {

// gate and up of one shape and dtype (float32, bfloat16, float16 or float64); the result
// has both.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

}  // namespace dtrain::ops
