// Fused SwiGLU forward and backward (dtrain_kernels/swiglu.h): blocks of 256 threads,
// blockIdx.y over the rows (then every gridDim.y-th), blockIdx.x over a row's 16-byte
// accesses with two per thread whose loads are issued before either is used. float32 math.
#include <initializer_list>

#include "common.cuh"
#include "dtrain_kernels/swiglu.h"

namespace dtrain_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 2;  // accesses per thread with their loads in flight together
constexpr int kGroup = kThreads * kUnroll;

// sigmoid(g), the exponential on the special-function unit: 0 far below zero, 1 far above.
__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + fast_exp2(-g * kLog2e)); }

// Calls f(row, j0) once per group of kUnroll accesses this thread owns: accesses j0 + k
// kThreads (k < kUnroll) of the row, those below nv.
template <typename F>
__device__ __forceinline__ void each_group(int64_t rows, int64_t nv, F&& f) {
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kGroup + threadIdx.x; j0 < nv;
         j0 += static_cast<int64_t>(gridDim.x) * kGroup) {
      f(row, j0);
    }
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(dtrain_swiglu_fwd_params p) {
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  T* y = static_cast<T*>(p.y);
  const int64_t nv = p.cols / V;
  each_group(p.rows, nv, [&](int64_t row, int64_t j0) {
    Vec<T, V> g[kUnroll] = {}, u[kUnroll] = {};
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t j = j0 + k * kThreads;
      if (j < nv) {
        g[k] = load_vec<V>(gate + row * p.gate_stride + j * V);
        u[k] = load_vec<V>(up + row * p.up_stride + j * V);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t j = j0 + k * kThreads;
      if (j >= nv) continue;
      Vec<T, V> out;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float gv = to_float_at(g[k], i);
        out.v[i] = from_float<T>(gv * sigmoid(gv) * to_float_at(u[k], i));
      }
      store_vec<V>(y + row * p.y_stride + j * V, out);
    }
  });
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_kernel(dtrain_swiglu_bwd_params p) {
  const T* dy = static_cast<const T*>(p.dy);
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  T* dgate = static_cast<T*>(p.dgate);
  T* dup = static_cast<T*>(p.dup);
  const int64_t nv = p.cols / V;
  each_group(p.rows, nv, [&](int64_t row, int64_t j0) {
    Vec<T, V> d[kUnroll] = {}, g[kUnroll] = {}, u[kUnroll] = {};
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t j = j0 + k * kThreads;
      if (j < nv) {
        d[k] = load_vec<V>(dy + row * p.dy_stride + j * V);
        g[k] = load_vec<V>(gate + row * p.gate_stride + j * V);
        u[k] = load_vec<V>(up + row * p.up_stride + j * V);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t j = j0 + k * kThreads;
      if (j >= nv) continue;
      Vec<T, V> dg, du;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float dv = to_float_at(d[k], i), gv = to_float_at(g[k], i), uv = to_float_at(u[k], i);
        const float s = sigmoid(gv);
        du.v[i] = from_float<T>(dv * gv * s);
        dg.v[i] = from_float<T>(dv * uv * s * (1.f + gv * (1.f - s)));
      }
      store_vec<V>(dgate + row * p.dgate_stride + j * V, dg);
      store_vec<V>(dup + row * p.dup_stride + j * V, du);
    }
  });
}

// The grid for rows of nv accesses: every access of a row covered, rows up to the grid's limit.
dim3 grid_for(int64_t rows, int64_t nv) {
  return dim3(static_cast<unsigned>(imin((nv + kGroup - 1) / kGroup, INT32_MAX)), static_cast<unsigned>(imin(rows, 65535)));
}

// Shapes and strides every pass checks: rows >= 0, cols > 0, each row stride at least cols
// (rows of one matrix do not overlap) where there is more than one row.
bool shape_ok(int64_t rows, int64_t cols, std::initializer_list<int64_t> strides) {
  if (rows < 0 || cols <= 0) return false;
  for (int64_t s : strides) {
    if (rows > 1 && s < cols) return false;
  }
  return true;
}

template <typename T>
cudaError_t fwd(const dtrain_swiglu_fwd_params& p, cudaStream_t stream) {
  constexpr int V = vec16<T>();
  const bool vec = p.cols % V == 0 && rows_aligned<T>(p.gate, p.gate_stride) && rows_aligned<T>(p.up, p.up_stride) &&
                   rows_aligned<T>(p.y, p.y_stride);
  if (vec) {
    auto* kernel = swiglu_fwd_kernel<T, V>;
    DTRAIN_LAUNCH(kernel, grid_for(p.rows, p.cols / V), kThreads, 0, stream, p);
  } else {
    auto* kernel = swiglu_fwd_kernel<T, 1>;
    DTRAIN_LAUNCH(kernel, grid_for(p.rows, p.cols), kThreads, 0, stream, p);
  }
  return launched();
}

template <typename T>
cudaError_t bwd(const dtrain_swiglu_bwd_params& p, cudaStream_t stream) {
  constexpr int V = vec16<T>();
  const bool vec = p.cols % V == 0 && rows_aligned<T>(p.dy, p.dy_stride) && rows_aligned<T>(p.gate, p.gate_stride) &&
                   rows_aligned<T>(p.up, p.up_stride) && rows_aligned<T>(p.dgate, p.dgate_stride) &&
                   rows_aligned<T>(p.dup, p.dup_stride);
  if (vec) {
    auto* kernel = swiglu_bwd_kernel<T, V>;
    DTRAIN_LAUNCH(kernel, grid_for(p.rows, p.cols / V), kThreads, 0, stream, p);
  } else {
    auto* kernel = swiglu_bwd_kernel<T, 1>;
    DTRAIN_LAUNCH(kernel, grid_for(p.rows, p.cols), kThreads, 0, stream, p);
  }
  return launched();
}

}  // namespace
}  // namespace dtrain_kernels

extern "C" cudaError_t dtrain_swiglu_fwd(const dtrain_swiglu_fwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (!shape_ok(p.rows, p.cols, {p.gate_stride, p.up_stride, p.y_stride})) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (p.gate == nullptr || p.up == nullptr || p.y == nullptr) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto t) { return fwd<decltype(t)>(p, stream); });
}

extern "C" cudaError_t dtrain_swiglu_bwd(const dtrain_swiglu_bwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (!shape_ok(p.rows, p.cols, {p.dy_stride, p.gate_stride, p.up_stride, p.dgate_stride, p.dup_stride})) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0) return cudaSuccess;
  if (p.dy == nullptr || p.gate == nullptr || p.up == nullptr || p.dgate == nullptr || p.dup == nullptr) {
    return cudaErrorInvalidValue;
  }
  return dispatch_dtype(p.dtype, [&](auto t) { return bwd<decltype(t)>(p, stream); });
}
