// Rotary position embedding (dtrain_kernels/rope.h): a grid of (seq x accesses of half a
// head, heads, batch); each thread rotates V elements of the first half of a head's row
// with the V matching ones of the second half. The angles (seq x head_dim / 2 floats)
// are re-read by every head, from L2.
#include "common.cuh"
#include "dtrain_kernels/rope.h"

namespace dtrain_kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) rope_kernel(dtrain_rope_params p) {
  const int64_t half = p.head_dim / 2, nj = half / V;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.seq * nj) return;
  const int64_t t = idx / nj, j = idx % nj, h = blockIdx.y, b = blockIdx.z;
  const T* x = static_cast<const T*>(p.x) + b * p.x_stride[0] + h * p.x_stride[1] + t * p.x_stride[2] + j * V;
  T* y = static_cast<T*>(p.y) + b * p.y_stride[0] + h * p.y_stride[1] + t * p.y_stride[2] + j * V;
  const int64_t a = b * p.angle_stride[0] + t * p.angle_stride[1] + j * V;
  const Vec<T, V> x1 = load_vec<V>(x), x2 = load_vec<V>(x + half);
  float c[V], s[V];
  load_floats<V>(p.cos + a, c);
  load_floats<V>(p.sin + a, s);
  const float sign = p.inverse ? -1.f : 1.f;
  Vec<T, V> y1, y2;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float u = to_float_at(x1, i), w = to_float_at(x2, i), si = sign * s[i];
    y1.v[i] = from_float<T>(u * c[i] - w * si);
    y2.v[i] = from_float<T>(u * si + w * c[i]);
  }
  store_vec<V>(y, y1);
  store_vec<V>(y + half, y2);
}

template <typename T>
cudaError_t run(const dtrain_rope_params& p, cudaStream_t stream) {
  constexpr int V = vec16<T>();
  const int64_t half = p.head_dim / 2;
  bool vec = half % V == 0 && aligned(p.x, 16) && aligned(p.y, 16) && aligned(p.cos, 16) && aligned(p.sin, 16) &&
             p.angle_stride[0] % 4 == 0 && p.angle_stride[1] % 4 == 0;
  for (int d = 0; d < 3; ++d) vec = vec && p.x_stride[d] % V == 0 && p.y_stride[d] % V == 0;
  const auto grid = [&](int v) {
    return dim3(static_cast<unsigned>((p.seq * (half / v) + kThreads - 1) / kThreads), static_cast<unsigned>(p.heads),
                static_cast<unsigned>(p.batch));
  };
  if (vec) {
    auto* kernel = rope_kernel<T, V>;
    DTRAIN_LAUNCH(kernel, grid(V), kThreads, 0, stream, p);
  } else {
    auto* kernel = rope_kernel<T, 1>;
    DTRAIN_LAUNCH(kernel, grid(1), kThreads, 0, stream, p);
  }
  return launched();
}

}  // namespace
}  // namespace dtrain_kernels

extern "C" cudaError_t dtrain_rope(const dtrain_rope_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.batch < 0 || p.heads < 0 || p.seq < 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 || p.batch > 65535 ||
      p.heads > 65535 || (p.seq * (p.head_dim / 2) + kThreads - 1) / kThreads > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.heads == 0 || p.seq == 0) return cudaSuccess;
  if (p.x == nullptr || p.y == nullptr || p.cos == nullptr || p.sin == nullptr) return cudaErrorInvalidValue;
  return dispatch_dtype(p.dtype, [&](auto t) { return run<decltype(t)>(p, stream); });
}
