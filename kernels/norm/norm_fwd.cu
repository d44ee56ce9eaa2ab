// Fused RMSNorm / LayerNorm forward (dtrain_kernels/norm.h): one block per row. A thread's
// share of the row is read from global memory once and held in registers (unaligned rows
// over 4096 elements are read at each use instead, from L1); float32 statistics, y written once.
#include "norm/norm.cuh"

namespace dtrain_kernels {
namespace {

template <typename T, bool kLayerNorm, int V, int kVecs>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_kernel(dtrain_norm_fwd_params p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  T* y = static_cast<T*>(p.y) + row * p.y_stride;
  const int nv = static_cast<int>(p.cols / V);
  const float inv_n = 1.f / static_cast<float>(p.cols);
  const RowShare<T, V, kVecs> x(static_cast<const T*>(p.x) + row * p.x_stride, nv);
  float mean = 0.f;
  if (kLayerNorm) {
    float s = 0.f;
    each_access<kVecs>(nv, [&](int k, int j) {
#pragma unroll
      for (int i = 0; i < V; ++i) s += x.at(k, j, i);
    });
    mean = block_sum(s, scratch) * inv_n;
  }
  float ss = 0.f;
  each_access<kVecs>(nv, [&](int k, int j) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = x.at(k, j, i) - mean;
      ss += d * d;
    }
  });
  const float rstd = rsqrtf(block_sum(ss, scratch) * inv_n + p.eps);
  each_access<kVecs>(nv, [&](int k, int j) {
    float wv[V], bv[V] = {};
    load_weights<V>(p.weight, p.weight_dtype, j, wv);
    if (kLayerNorm && p.bias != nullptr) load_weights<V>(p.bias, p.weight_dtype, j, bv);
    Vec<T, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) out.v[i] = from_float<T>((x.at(k, j, i) - mean) * rstd * wv[i] + bv[i]);
    store_vec<V>(y + j * V, out);
  });
  if (threadIdx.x == 0) {
    if (p.rstd != nullptr) p.rstd[row] = rstd;
    if (kLayerNorm && p.mean != nullptr) p.mean[row] = mean;
  }
}

template <typename T, int V>
cudaError_t fwd(const dtrain_norm_fwd_params& p, cudaStream_t stream) {
  const int64_t nv = p.cols / V;
  return with_vecs<V>(nv, [&](auto vecs) {
    constexpr int kVecs = decltype(vecs)::value;
    auto* kernel = p.layer_norm ? norm_fwd_kernel<T, true, V, kVecs> : norm_fwd_kernel<T, false, V, kVecs>;
    DTRAIN_LAUNCH(kernel, static_cast<unsigned>(p.rows), row_threads((nv + kVecs - 1) / kVecs), 0, stream, p);
    return launched();
  });
}

template <typename T>
cudaError_t fwd(const dtrain_norm_fwd_params& p, cudaStream_t stream) {
  const bool vec = p.cols % vec16<T>() == 0 && rows_aligned<T>(p.x, p.x_stride) && rows_aligned<T>(p.y, p.y_stride) &&
                   aligned(p.weight, 16) && aligned(p.bias, 16);
  return vec ? fwd<T, vec16<T>()>(p, stream) : fwd<T, 1>(p, stream);
}

}  // namespace
}  // namespace dtrain_kernels

extern "C" int64_t dtrain_norm_max_cols(void) { return dtrain_kernels::kMaxCols; }

extern "C" cudaError_t dtrain_norm_fwd(const dtrain_norm_fwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.cols <= 0 || p.cols > kMaxCols || p.rows > INT32_MAX || !(p.eps >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0) return cudaSuccess;
  if (p.x == nullptr || p.y == nullptr || (!p.layer_norm && p.bias != nullptr)) return cudaErrorInvalidValue;
  if (!known_dtype(p.weight_dtype)) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto t) { return fwd<decltype(t)>(p, stream); });
}

