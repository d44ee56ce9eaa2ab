// Fused softmax cross-entropy (dtrain_kernels/cross_entropy.h): one block per row; each
// thread keeps an online (max, sum of exp) over its strided share of the vocabulary, then
// the block merges them. The backward recomputes exp(x - lse) chunk by chunk. Rows whose
// start is 16-byte aligned are read (and written) in 16-byte accesses, others one element
// per access; a thread loads kUnroll accesses before using any.
#include "common.cuh"
#include "dtrain_kernels/cross_entropy.h"

namespace dtrain_kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;

// Calls f(j, r) for each access j (elements j V .. j V + V - 1, values r) of this thread's
// share of a row of nv accesses: j = threadIdx.x, threadIdx.x + kThreads, ...
template <int V, typename T, typename F>
__device__ __forceinline__ void for_row(const T* x, int64_t nv, F&& f) {
  for (int64_t j0 = threadIdx.x; j0 < nv; j0 += int64_t{kThreads} * kUnroll) {
    Vec<T, V> r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + int64_t{u} * kThreads;
      if (j < nv) r[u] = load_vec<V>(x + j * V);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + int64_t{u} * kThreads;
      if (j < nv) f(j, r[u]);
    }
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) ce_fwd_kernel(dtrain_cross_entropy_fwd_params p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + row * p.logits_stride;
  float m = -INFINITY, s = 0.f;
  for_row<V>(x, p.vocab / V, [&](int64_t, const Vec<T, V>& r) {
    float vmax = -INFINITY;  // fmaxf skips NaN here; the sum below carries it
#pragma unroll
    for (int i = 0; i < V; ++i) vmax = fmaxf(vmax, to_float(r.v[i]));
    if (vmax > m) {
      s *= __expf(m - vmax);
      m = vmax;
    }
    if (m == -INFINITY) return;  // all -inf so far: nothing to add
#pragma unroll
    for (int i = 0; i < V; ++i) s += __expf(to_float(r.v[i]) - m);
  });
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

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) ce_bwd_kernel(dtrain_cross_entropy_bwd_params p) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + row * p.logits_stride;
  T* dx = static_cast<T*>(p.dlogits) + row * p.dlogits_stride;
  const int64_t t = p.target[row], nv = p.vocab / V;
  if (t == p.ignore_index) {
    Vec<T, V> zero;
#pragma unroll
    for (int i = 0; i < V; ++i) zero.v[i] = from_float<T>(0.f);
    for (int64_t j = threadIdx.x; j < nv; j += kThreads) store_vec<V>(dx + j * V, zero);
    return;
  }
  const float count = static_cast<float>(*p.count);
  const float scale = *p.grad_scale / fmaxf(count, 1.f);
  const float lse = p.lse[row];
  for_row<V>(x, nv, [&](int64_t j, const Vec<T, V>& r) {
    Vec<T, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float prob = __expf(to_float(r.v[i]) - lse);
      out.v[i] = from_float<T>((prob - (j * V + i == t ? 1.f : 0.f)) * scale);
    }
    store_vec<V>(dx + j * V, out);
  });
}

// Rows of T at ptr with this stride and length can be read in 16-byte accesses.
template <typename T>
bool rows_aligned(const void* ptr, int64_t stride, int64_t vocab) {
  return aligned(ptr, 16) && stride % vec16<T>() == 0 && vocab % vec16<T>() == 0;
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
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* kernel = rows_aligned<T>(p.logits, p.logits_stride, p.vocab) ? ce_fwd_kernel<T, vec16<T>()>
                                                                        : ce_fwd_kernel<T, 1>;
    DTRAIN_LAUNCH(kernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, p);
    return launched();
  });
}

extern "C" cudaError_t dtrain_cross_entropy_bwd(const dtrain_cross_entropy_bwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.rows > INT32_MAX || p.vocab <= 0) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (!p.logits || !p.target || !p.lse || !p.grad_scale || !p.count || !p.dlogits) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = rows_aligned<T>(p.logits, p.logits_stride, p.vocab) &&
                     rows_aligned<T>(p.dlogits, p.dlogits_stride, p.vocab);
    auto* kernel = vec ? ce_bwd_kernel<T, vec16<T>()> : ce_bwd_kernel<T, 1>;
    DTRAIN_LAUNCH(kernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, p);
    return launched();
  });
}
