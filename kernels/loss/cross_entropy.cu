// Fused softmax cross-entropy (dtrain_kernels/cross_entropy.h): one block per row; each
// thread keeps an online (max, sum of exp) over its strided share of the vocabulary, then
// the block merges them. The backward recomputes exp(x - lse) chunk by chunk.
#include "common.cuh"
#include "dtrain_kernels/cross_entropy.h"

namespace dtrain_kernels {
namespace {

constexpr int kThreads = 512;

template <typename T>
__global__ void __launch_bounds__(kThreads) ce_fwd_kernel(dtrain_cross_entropy_fwd_params p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + row * p.logits_stride;
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < p.vocab; c += kThreads) {
    const float v = to_float(x[c]);
    if (v > m) {
      s = s * __expf(m - v) + 1.f;
      m = v;
    } else if (v > -INFINITY) {
      s += __expf(v - m);
    }
  }
  const float bm = block_max(m, scratch);
  // A thread that saw only -inf (or nothing) adds 0.
  const float bs = block_sum(m == -INFINITY ? 0.f : s * __expf(m - bm), scratch);
  if (threadIdx.x != 0) return;
  const float lse = bm + logf(bs);
  p.lse[row] = lse;
  const int64_t t = p.target[row];
  if (t == p.ignore_index) {
    p.loss[row] = 0.f;
  } else if (t < 0 || t >= p.vocab) {
    p.loss[row] = NAN;
  } else {
    p.loss[row] = lse - to_float(x[t]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ce_bwd_kernel(dtrain_cross_entropy_bwd_params p) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + row * p.logits_stride;
  T* dx = static_cast<T*>(p.dlogits) + row * p.dlogits_stride;
  const int64_t t = p.target[row];
  if (t == p.ignore_index) {
    for (int64_t c = threadIdx.x; c < p.vocab; c += kThreads) dx[c] = from_float<T>(0.f);
    return;
  }
  const float count = static_cast<float>(*p.count);
  const float scale = *p.grad_scale / fmaxf(count, 1.f);
  const float lse = p.lse[row];
  for (int64_t c = threadIdx.x; c < p.vocab; c += kThreads) {
    const float prob = __expf(to_float(x[c]) - lse);
    dx[c] = from_float<T>((prob - (c == t ? 1.f : 0.f)) * scale);
  }
}

}  // namespace
}  // namespace dtrain_kernels

extern "C" cudaError_t dtrain_cross_entropy_fwd(const dtrain_cross_entropy_fwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.rows > INT32_MAX || p.vocab <= 0) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (!p.logits || !p.target || !p.loss || !p.lse) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.rows));
  void (*kernel)(dtrain_cross_entropy_fwd_params) = nullptr;
  switch (p.dtype) {
    case DTRAIN_KERNEL_F32: kernel = ce_fwd_kernel<float>; break;
    case DTRAIN_KERNEL_BF16: kernel = ce_fwd_kernel<__nv_bfloat16>; break;
    case DTRAIN_KERNEL_F16: kernel = ce_fwd_kernel<__half>; break;
    default: return cudaErrorInvalidValue;
  }
  DTRAIN_LAUNCH(kernel, grid, kThreads, 0, stream, p);
  return launched();
}

extern "C" cudaError_t dtrain_cross_entropy_bwd(const dtrain_cross_entropy_bwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.rows > INT32_MAX || p.vocab <= 0) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (!p.logits || !p.target || !p.lse || !p.grad_scale || !p.count || !p.dlogits) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.rows));
  void (*kernel)(dtrain_cross_entropy_bwd_params) = nullptr;
  switch (p.dtype) {
    case DTRAIN_KERNEL_F32: kernel = ce_bwd_kernel<float>; break;
    case DTRAIN_KERNEL_BF16: kernel = ce_bwd_kernel<__nv_bfloat16>; break;
    case DTRAIN_KERNEL_F16: kernel = ce_bwd_kernel<__half>; break;
    default: return cudaErrorInvalidValue;
  }
  DTRAIN_LAUNCH(kernel, grid, kThreads, 0, stream, p);
  return launched();
}
