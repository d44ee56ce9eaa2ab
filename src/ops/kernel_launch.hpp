// What the ops share around a kernel call: whether a tensor is on a device the kernels
// run on, the kernel dtype of a tensor, the current CUDA stream of its device, and a guard
// that keeps autocast out of the reference paths (they choose their float32 math).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <string>

#include "dtrain/core/error.hpp"

#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dtrain_kernels/common.h"
#endif

namespace dtrain::ops::detail {

// True when this build has the CUDA kernels and t lives on a CUDA device.
inline bool on_kernel_device(const at::Tensor& t) {
#ifdef DTRAIN_WITH_CUDA
  return t.is_cuda();
#else
  (void)t;
  return false;
#endif
}

// The reference paths compute in the dtypes they name, whatever autocast is on.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// "q must be ..." checks: InvalidArgument naming the op, the tensor and what it is.
#define DTRAIN_OP_CHECK(cond, op, ...) DTRAIN_CHECK_ARG(cond, op, ": ", __VA_ARGS__)

inline std::string dtype_name(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

#ifdef DTRAIN_WITH_CUDA
// F32, BF16 or F16; InvalidArgument naming op and what for any other dtype.
inline dtrain_kernel_dtype kernel_dtype(const at::Tensor& t, const char* op, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DTRAIN_KERNEL_F32;
    case at::kBFloat16: return DTRAIN_KERNEL_BF16;
    case at::kHalf: return DTRAIN_KERNEL_F16;
    default: break;
  }
  DTRAIN_OP_CHECK(false, op, what, " is ", dtype_name(t), "; allowed: float32, bfloat16, float16");
  return DTRAIN_KERNEL_F32;
}

inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

}  // namespace dtrain::ops::detail
