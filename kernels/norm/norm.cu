// Fused RMSNorm / LayerNorm (dtrain_kernels/norm.h). Forward: one block per row, the
// statistics in float32 from the row read once into registers-or-L1. Backward: a block
// owns a strip of rows; per row it reduces the two sums dx needs, writes dx, and adds the
// row's dy * xhat (and dy) into the block's per-column partial sums in shared memory;
// the strip's partials go to the workspace and a column kernel sums them over strips.
#include <algorithm>

#include "common.cuh"
#include "dtrain_kernels/norm.h"

namespace dtrain_kernels {
namespace {

constexpr int kMaxThreads = 512;
constexpr int64_t kMaxCols = 16384;  // 2 x 64 KiB of float32 partials in shared memory

int threads_for(int64_t cols) {
  int t = 32;
  while (t < kMaxThreads && t * 4 < cols) t *= 2;
  return t;
}

template <typename T, typename W, bool kLayerNorm>
__global__ void norm_fwd_kernel(dtrain_norm_fwd_params p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  T* y = static_cast<T*>(p.y) + row * p.y_stride;
  const W* w = static_cast<const W*>(p.weight);
  const W* b = static_cast<const W*>(p.bias);
  const int64_t n = p.cols;
  float mean = 0.f;
  if (kLayerNorm) {
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) s += to_float(x[c]);
    mean = block_sum(s, scratch) / static_cast<float>(n);
  }
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    const float d = to_float(x[c]) - mean;
    ss += d * d;
  }
  const float rstd = rsqrtf(block_sum(ss, scratch) / static_cast<float>(n) + p.eps);
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    float v = (to_float(x[c]) - mean) * rstd;
    if (w != nullptr) v *= to_float(w[c]);
    if (kLayerNorm && b != nullptr) v += to_float(b[c]);
    y[c] = from_float<T>(v);
  }
  if (threadIdx.x == 0) {
    if (p.rstd != nullptr) p.rstd[row] = rstd;
    if (kLayerNorm && p.mean != nullptr) p.mean[row] = mean;
  }
}

// The backward's grid: strips of rows, so that partials stay few (about 4 blocks per SM).
int64_t strips(int64_t rows) {
  int device = 0, sms = 108;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaGetLastError();  // a failed query only changes the grid
  return std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{4} * sms));
}

template <typename T, typename W, bool kLayerNorm>
__global__ void norm_bwd_kernel(dtrain_norm_bwd_params p, int64_t rows_per_strip) {
  DTRAIN_DYNAMIC_SMEM(float, partial);  // [cols] dw, then [cols] db (LayerNorm)
  __shared__ float scratch[32];
  const int64_t n = p.cols;
  const bool want_w = p.dweight != nullptr, want_b = kLayerNorm && p.dbias != nullptr;
  float* pw = partial;
  float* pb = partial + n;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    if (want_w) pw[c] = 0.f;
    if (want_b) pb[c] = 0.f;
  }
  const W* w = static_cast<const W*>(p.weight);
  const int64_t first = blockIdx.x * rows_per_strip, last = imin(p.rows, first + rows_per_strip);
  for (int64_t row = first; row < last; ++row) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dy_stride;
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
    const float mean = kLayerNorm ? p.mean[row] : 0.f, rstd = p.rstd[row];
    // g = dy * w, xhat = (x - mean) * rstd: dx = rstd (g - mean(g) - xhat mean(g xhat)),
    // without the mean(g) term for RMSNorm.
    float sg = 0.f, sgx = 0.f;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const float g = to_float(dy[c]) * (w != nullptr ? to_float(w[c]) : 1.f);
      const float xhat = (to_float(x[c]) - mean) * rstd;
      sg += g;
      sgx += g * xhat;
    }
    const float inv_n = 1.f / static_cast<float>(n);
    const float mgx = block_sum(sgx, scratch) * inv_n;
    const float mg = kLayerNorm ? block_sum(sg, scratch) * inv_n : 0.f;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const float d = to_float(dy[c]);
      const float g = d * (w != nullptr ? to_float(w[c]) : 1.f);
      const float xhat = (to_float(x[c]) - mean) * rstd;
      dx[c] = from_float<T>(rstd * (g - mg - xhat * mgx));
      if (want_w) pw[c] += d * xhat;  // each column belongs to one thread: no races
      if (want_b) pb[c] += d;
    }
  }
  if (!want_w && !want_b) return;
  float* out = static_cast<float*>(p.workspace);
  const int64_t nstrips = gridDim.x;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    if (want_w) out[blockIdx.x * n + c] = pw[c];
    if (want_b) out[(nstrips + blockIdx.x) * n + c] = pb[c];
  }
}

// Sums the strips' partials per column: [strips, cols] -> [cols] (and the bias block after).
template <typename W>
__global__ void column_sum_kernel(const float* partial, int64_t nstrips, int64_t cols, W* dw, W* db) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  const int which = blockIdx.y;  // 0: weight, 1: bias
  W* out = which == 0 ? dw : db;
  if (out == nullptr) return;
  const float* src = partial + which * nstrips * cols;
  float s = 0.f;
  for (int64_t r = 0; r < nstrips; ++r) s += src[r * cols + c];
  out[c] = from_float<W>(s);
}

template <typename T, typename W>
cudaError_t fwd(const dtrain_norm_fwd_params& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  const int threads = threads_for(p.cols);
  auto* kernel = p.layer_norm ? norm_fwd_kernel<T, W, true> : norm_fwd_kernel<T, W, false>;
  DTRAIN_LAUNCH(kernel, grid, threads, 0, stream, p);
  return launched();
}

template <typename T, typename W>
cudaError_t bwd(const dtrain_norm_bwd_params& p, cudaStream_t stream) {
  const int64_t nstrips = strips(p.rows);
  const int64_t per = (p.rows + nstrips - 1) / nstrips;
  const int64_t used = (p.rows + per - 1) / per;
  const int threads = threads_for(p.cols);
  const size_t smem = sizeof(float) * static_cast<size_t>(p.cols) * (p.layer_norm ? 2 : 1);
  auto* kernel = p.layer_norm ? norm_bwd_kernel<T, W, true> : norm_bwd_kernel<T, W, false>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  DTRAIN_LAUNCH(kernel, static_cast<unsigned>(used), threads, smem, stream, p, per);
  if ((e = launched()) != cudaSuccess) return e;
  if (p.dweight == nullptr && p.dbias == nullptr) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((p.cols + 255) / 256), p.layer_norm && p.dbias != nullptr ? 2 : 1);
  auto* sum = column_sum_kernel<W>;
  DTRAIN_LAUNCH(sum, grid, 256, 0, stream, static_cast<const float*>(p.workspace), used, p.cols,
                static_cast<W*>(p.dweight), static_cast<W*>(p.dbias));
  return launched();
}

// Calls f.template operator()<T, W>() for the (dtype, weight dtype) pair.
template <typename F>
cudaError_t dispatch(dtrain_kernel_dtype t, dtrain_kernel_dtype w, F&& f) {
  auto with_w = [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    switch (w) {
      case DTRAIN_KERNEL_F32: return f(T{}, float{});
      case DTRAIN_KERNEL_BF16: return f(T{}, __nv_bfloat16{});
      case DTRAIN_KERNEL_F16: return f(T{}, __half{});
    }
    return cudaErrorInvalidValue;
  };
  switch (t) {
    case DTRAIN_KERNEL_F32: return with_w(float{});
    case DTRAIN_KERNEL_BF16: return with_w(__nv_bfloat16{});
    case DTRAIN_KERNEL_F16: return with_w(__half{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace dtrain_kernels

extern "C" int64_t dtrain_norm_max_cols(void) { return dtrain_kernels::kMaxCols; }

extern "C" size_t dtrain_norm_workspace_bytes(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t nstrips = dtrain_kernels::strips(rows);
  return sizeof(float) * 2 * static_cast<size_t>(nstrips) * static_cast<size_t>(cols);
}

extern "C" cudaError_t dtrain_norm_fwd(const dtrain_norm_fwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.cols <= 0 || p.cols > kMaxCols || p.rows > INT32_MAX || !(p.eps >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0) return cudaSuccess;
  if (p.x == nullptr || p.y == nullptr || (!p.layer_norm && p.bias != nullptr)) return cudaErrorInvalidValue;
  return dispatch(p.dtype, p.weight_dtype, [&](auto t, auto w) { return fwd<decltype(t), decltype(w)>(p, stream); });
}

extern "C" cudaError_t dtrain_norm_bwd(const dtrain_norm_bwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.cols <= 0 || p.cols > kMaxCols || p.rows > INT32_MAX) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (!p.dy || !p.x || !p.dx || !p.rstd || (p.layer_norm && !p.mean)) return cudaErrorInvalidValue;
  if ((p.dweight != nullptr || p.dbias != nullptr) && p.workspace == nullptr) return cudaErrorInvalidValue;
  if (p.dweight != nullptr && p.weight == nullptr) return cudaErrorInvalidValue;
  if (!p.layer_norm && p.dbias != nullptr) return cudaErrorInvalidValue;
  return dispatch(p.dtype, p.weight_dtype, [&](auto t, auto w) { return bwd<decltype(t), decltype(w)>(p, stream); });
}
