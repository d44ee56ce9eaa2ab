// Fused softmax cross-entropy (dtrain_kernels/cross_entropy.h): one block per row; each
// thread keeps an online (max, sum of exp) over its strided share of the vocabulary, the
// block merges them, and the same threads walk their share again, last chunk first, writing
// the gradient (the logits' second read should come from L2). Over a vocabulary split
// across ranks the walks are two launches (statistics, then the gradient for the
// log-sum-exp the caller gathered). Rows whose start is 16-byte aligned are read and
// written in 16-byte accesses, others one element per access; a thread loads kUnroll
// accesses before using any. The kernel is bound by instructions per
// logit more than by memory (Nsight Compute on the H200: 74% of the SM's issue slots, 63%
// of DRAM bandwidth), so the exponentials are ex2.approx.ftz with the shift folded into one
// FFMA (fast_exp2), and bfloat16 logits unpack with one integer operation each (to_floats).
#include <cmath>

#include "common.cuh"
#include "dtrain_kernels/cross_entropy.h"

namespace dtrain_kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;
constexpr int64_t kChunk = int64_t{kThreads} * kUnroll;  // accesses a block makes per step

// Calls f(j, r) for each access j (elements j V .. j V + V - 1, values r) of this thread's
// share of a row of nv accesses, j = c kChunk + u kThreads + threadIdx.x over the row's
// chunks c, first to last, or, when Last (the data's last use: streaming loads), last to
// first. f may overwrite the access it is given.
template <bool Last, int V, typename T, typename F>
__device__ __forceinline__ void for_row(const T* x, int64_t nv, F&& f) {
  const int64_t chunks = (nv + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j0 = (Last ? chunks - 1 - c : c) * kChunk + threadIdx.x;
    Vec<T, V> r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + int64_t{u} * kThreads;
      if (j < nv) r[u] = Last ? load_vec_streaming<V>(x + j * V) : load_vec<V>(x + j * V);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + int64_t{u} * kThreads;
      if (j < nv) f(j, r[u]);
    }
  }
}

// The gradient of row `row` given its log-sum-exp: (softmax (1 + 2 z lse) - onehot(t)) * scale, walking
// the row last chunk first (the forward's last reads may still be in L2); zeros for an
// ignored row. t: the target's column (outside [0, vocab): no onehot term here).
template <int V, typename T>
__device__ __forceinline__ void write_grad(const dtrain_cross_entropy_fwd_params& p, int64_t row, const T* x,
                                           bool ignored, int64_t t, float lse) {
  T* dx = static_cast<T*>(p.dlogits) + row * p.dlogits_stride;
  const int64_t nv = p.vocab / V;
  if (ignored) {
    Vec<T, V> zero;
#pragma unroll
    for (int i = 0; i < V; ++i) zero.v[i] = from_float<T>(0.f);
    for (int64_t j = threadIdx.x; j < nv; j += kThreads) store_vec_streaming<V>(dx + j * V, zero);
    return;
  }
  const float scale = p.grad_scale / fmaxf(static_cast<float>(*p.count), 1.f), shift = -lse * kLog2e;
  const float prob_scale = scale * fmaf(2.f * p.z_loss, lse, 1.f);  // the z-loss's share: softmax 2 z lse
  for_row<true, V>(x, nv, [&](int64_t j, const Vec<T, V>& r) {
    float f[V];
    to_floats(r, f);
    Vec<T, V> out;
    const int64_t k = t - j * V;  // the target's place in this access, if it is in it
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float prob = fast_exp2(fmaf(f[i], kLog2e, shift));  // below 2^-126: 0
      out.v[i] = from_float<T>(fmaf(prob, prob_scale, k == i ? -scale : 0.f));
    }
    store_vec_streaming<V>(dx + j * V, out);
  });
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) ce_fwd_kernel(dtrain_cross_entropy_fwd_params p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + row * p.logits_stride;
  const int64_t target = p.target[row], t = target - p.vocab_start, nv = p.vocab / V;
  const bool ignored = target == p.ignore_index, in_range = t >= 0 && t < p.vocab;
  float lse;
  if (p.given_lse) {  // the whole (split) vocabulary's: the gradient alone
    lse = p.given_lse[row];
  } else {
    // Read before the block's first barrier: after the last one the gradient may replace it.
    const float xt = threadIdx.x == 0 && !ignored && in_range ? to_float(x[t]) : 0.f;
    // The running max m, and the sum of exp(x - m) (terms below 2^-126 of the max's flush to
    // 0: nothing a float32 sum of at least 1 would keep).
    float m = -INFINITY, s = 0.f;
    for_row<false, V>(x, nv, [&](int64_t, const Vec<T, V>& r) {
      float f[V];
      to_floats(r, f);
      float vmax = -INFINITY;  // fmaxf skips NaN here; the sum below carries it
#pragma unroll
      for (int i = 0; i < V; ++i) vmax = fmaxf(vmax, f[i]);
      if (vmax > m) {
        s *= fast_exp2((m - vmax) * kLog2e);
        m = vmax;
      }
      if (m == -INFINITY) return;  // all -inf so far: nothing to add
      const float shift = -m * kLog2e;
#pragma unroll
      for (int i = 0; i < V; ++i) s += fast_exp2(fmaf(f[i], kLog2e, shift));
    });
    const float bm = block_max(m, scratch);
    // A thread that saw only -inf (or nothing) adds 0.
    const float bs = block_sum(m == -INFINITY ? 0.f : s * __expf(m - bm), scratch);
    lse = bm + logf(bs);
    if (threadIdx.x == 0) {
      if (p.lse) p.lse[row] = lse;
      if (p.target_logit) p.target_logit[row] = xt;
      if (p.loss) p.loss[row] = ignored ? 0.f : in_range ? fmaf(p.z_loss * lse, lse, lse - xt) : NAN;
    }
  }
  if (p.dlogits) write_grad<V>(p, row, x, ignored, t, lse);
}

// out = dlogits * *grad / *written (a ratio within 1e-6 of 1 is 1, and in place then
// nothing); blocks stride over the rows.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) ce_bwd_kernel(dtrain_cross_entropy_bwd_params p) {
  const float g = *p.grad, w = *p.written;
  const bool same = fabsf(g - w) <= 1e-6f * fabsf(w);  // NaN or inf in g: rescaled, as autograd would
  if (same && p.out == p.dlogits) return;
  const float ratio = same ? 1.f : g / w;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* dx = static_cast<const T*>(p.dlogits) + row * p.dlogits_stride;
    T* out = static_cast<T*>(p.out) + row * p.out_stride;
    for_row<false, V>(dx, p.vocab / V, [&](int64_t j, const Vec<T, V>& r) {
      Vec<T, V> o;
#pragma unroll
      for (int i = 0; i < V; ++i) o.v[i] = from_float<T>(to_float(r.v[i]) * ratio);
      store_vec<V>(out + j * V, o);
    });
  }
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
  if (p.rows < 0 || p.rows > INT32_MAX || p.vocab <= 0 || p.logits_stride < p.vocab) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (!p.logits || !p.target || p.vocab_start < 0 || !(p.z_loss >= 0.f) || !std::isfinite(p.z_loss)) {
    return cudaErrorInvalidValue;
  }
  if (p.given_lse && !p.dlogits) return cudaErrorInvalidValue;
  if (p.dlogits) {
    if (!p.count || !std::isfinite(p.grad_scale) || p.grad_scale == 0.f || p.dlogits_stride < p.vocab) {
      return cudaErrorInvalidValue;
    }
    // In place: the very rows, or the walks would read what other threads wrote.
    if (p.dlogits == p.logits && p.dlogits_stride != p.logits_stride) return cudaErrorInvalidValue;
  }
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = rows_aligned<T>(p.logits, p.logits_stride, p.vocab) &&
                     (!p.dlogits || rows_aligned<T>(p.dlogits, p.dlogits_stride, p.vocab));
    auto* kernel = vec ? ce_fwd_kernel<T, vec16<T>()> : ce_fwd_kernel<T, 1>;
    DTRAIN_LAUNCH(kernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, p);
    return launched();
  });
}

extern "C" cudaError_t dtrain_cross_entropy_bwd(const dtrain_cross_entropy_bwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.vocab <= 0 || p.dlogits_stride < p.vocab || p.out_stride < p.vocab) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0) return cudaSuccess;
  if (!p.dlogits || !p.out || !p.grad || !p.written) return cudaErrorInvalidValue;
  if (p.out == p.dlogits && p.out_stride != p.dlogits_stride) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = rows_aligned<T>(p.dlogits, p.dlogits_stride, p.vocab) &&
                     rows_aligned<T>(p.out, p.out_stride, p.vocab);
    auto* kernel = vec ? ce_bwd_kernel<T, vec16<T>()> : ce_bwd_kernel<T, 1>;
    // As many blocks as the GPU holds at once: each reads two scalars and most often returns.
    const Occupancy o = occupancy(kernel, kThreads, 0);
    const int64_t grid = imin(p.rows, int64_t{o.sms} * o.per_sm);
    DTRAIN_LAUNCH(kernel, static_cast<unsigned>(grid), kThreads, 0, stream, p);
    return launched();
  });
}
