// What the ops share around a kernel call: whether a tensor is on a device the kernels
// run on, the kernel dtype of a tensor, the dtype the reference paths compute in, the device guard, current CUDA stream and
// device-to-device copy of its device, and a guard that keeps autocast out of the reference
// paths (they choose their float32 math).
//
// DTRAIN_OPS_EMULATED (tests only, with DTRAIN_KERNELS_EMULATE): the ops compiled against
// the CPU emulator of the kernels (kernels/emulator). Host tensors other than float64 then
// take the kernel paths, with no guard, a null stream and plain copies, so that the ops'
// own code (inputs to params, autograd) runs on machines without a GPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstring>
#include <string>

#include "dtrain/core/error.hpp"

#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dtrain_kernels/common.h"
#endif

namespace dtrain::ops::detail {

// True when this build has the CUDA kernels and t lives on a CUDA device (emulated: on
// the host, unless float64, which keeps the reference paths for the tests' references).
inline bool on_kernel_device(const at::Tensor& t) {
#if defined(DTRAIN_OPS_EMULATED)
  return t.is_cpu() && t.scalar_type() != at::kDouble;
#elif defined(DTRAIN_WITH_CUDA)
  return t.is_cuda();
#else
  (void)t;
  return false;
#endif
}

// The dtype the reference paths compute in: float64 for float64 inputs, else float32.
inline at::ScalarType compute_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// float32, bfloat16 or float16: the element types the kernels take.
inline bool kernel_float(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
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

#ifdef DTRAIN_OPS_EMULATED
struct DeviceGuard {
  explicit DeviceGuard(const at::Device&) {}
};
inline cudaStream_t current_stream(const at::Tensor&) { return nullptr; }
inline cudaError_t copy_device_async(void* dst, const void* src, std::size_t bytes, cudaStream_t) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
#else
// Makes the tensor's device current for the kernel launches in its scope.
using DeviceGuard = c10::cuda::CUDAGuard;
inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
// bytes from src to dst, both on the device, ordered on stream.
inline cudaError_t copy_device_async(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}
#endif
#endif

}  // namespace dtrain::ops::detail
