// Device helpers every kernel shares: element conversion to and from float32, warp and
// block reductions, and the launch-error convention of the C API.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "dtrain_kernels/common.h"

#ifdef DTRAIN_KERNELS_EMULATE
#include "emulator/simt.hpp"
// kernel is a name or a function pointer (template arguments would split the macro).
#define DTRAIN_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::dtrain_emu::launch(dim3(grid), dim3(block), (smem), [&] { kernel(__VA_ARGS__); })
#define DTRAIN_DYNAMIC_SMEM(type, name) type* name = static_cast<type*>(::dtrain_emu::dynamic_smem())
#else
#define DTRAIN_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define DTRAIN_DYNAMIC_SMEM(type, name)                     \
  extern __shared__ __align__(16) unsigned char name##_raw_[]; \
  type* name = reinterpret_cast<type*>(name##_raw_)
#endif

namespace dtrain_kernels {

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// ---- element conversion ------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// ---- vector access -----------------------------------------------------------------------
// N consecutive elements of T as one aligned access of N * sizeof(T) bytes (at most 16: one
// 128-bit load or store). The memory-bound kernels take N = vec16<T>() where every row
// start is 16-byte aligned and N = 1 otherwise, so one kernel body serves both.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};
template <typename T>
__host__ __device__ constexpr int vec16() {
  return static_cast<int>(16 / sizeof(T));
}
template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}
// The same for data used once more at most (ld.global.cs / st.global.cs: cached with
// eviction first), so that it does not push out of L2 what a kernel reads again. Plain
// accesses below 16 bytes and in the emulator.
template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec_streaming(const T* p) {
#ifndef DTRAIN_KERNELS_EMULATE
  if constexpr (sizeof(Vec<T, N>) == 16) {
    const int4 r = __ldcs(reinterpret_cast<const int4*>(p));
    return *reinterpret_cast<const Vec<T, N>*>(&r);
  } else
#endif
  {
    return load_vec<N>(p);
  }
}
template <int N, typename T>
__device__ __forceinline__ void store_vec_streaming(T* p, const Vec<T, N>& v) {
#ifndef DTRAIN_KERNELS_EMULATE
  if constexpr (sizeof(Vec<T, N>) == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
  } else
#endif
  {
    store_vec<N>(p, v);
  }
}
// x by a move the compiler may neither hoist nor merge (asm volatile), so that what is
// computed from it is computed again at each use, never held in registers across a loop
// (the attention forward's document rows' addresses).
__device__ __forceinline__ int64_t opaque(int64_t x) {
#ifdef DTRAIN_KERNELS_EMULATE
  return x;
#else
  int64_t y;
  asm volatile("mov.b64 %0, %1;" : "=l"(y) : "l"(x));
  return y;
#endif
}
// An fp16 value as float32 by a conversion the compiler may neither hoist nor merge (asm
// volatile): converted again at each use, never held as a float32 copy.
__device__ __forceinline__ float to_float_each_use(__half x) {
#ifdef DTRAIN_KERNELS_EMULATE
  return to_float(x);
#else
  unsigned short h;
  std::memcpy(&h, &x, sizeof h);
  float f;
  asm volatile("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}
// Element i of r as float32. A bfloat16 pair's halves unpack with one integer operation
// each (the high one masked, the low one shifted up) instead of a byte permute and a shift.
// kEachUse: fp16 by to_float_each_use, for a kernel in which ptxas would otherwise keep
// converted copies live across a long stretch and spill (the norm backward: norm.cuh).
template <bool kEachUse = false, typename T, int N>
__device__ __forceinline__ float to_float_at(const Vec<T, N>& r, int i) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value && N % 2 == 0) {
    uint32_t w;
    std::memcpy(&w, &r.v[i & ~1], sizeof w);
    w = i & 1 ? w & 0xffff0000u : w << 16;
    float f;
    std::memcpy(&f, &w, sizeof f);
    return f;
  } else if constexpr (kEachUse && std::is_same<T, __half>::value) {
    return to_float_each_use(r.v[i]);
  } else {
    return to_float(r.v[i]);
  }
}
// All N of them.
template <bool kEachUse = false, typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& r, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float_at<kEachUse>(r, i);
}
// N elements of T at p as float32, in accesses of at most 16 bytes (p aligned to one).
template <int N, bool kEachUse = false, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  constexpr int C = N < vec16<T>() ? N : vec16<T>();
#pragma unroll
  for (int a = 0; a < N / C; ++a) {
    float f[C];
    to_floats<kEachUse>(load_vec<C>(p + a * C), f);
#pragma unroll
    for (int i = 0; i < C; ++i) out[a * C + i] = f[i];
  }
}
template <int N, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  constexpr int C = N < vec16<T>() ? N : vec16<T>();
#pragma unroll
  for (int a = 0; a < N / C; ++a) {
    Vec<T, C> r;
#pragma unroll
    for (int i = 0; i < C; ++i) r.v[i] = from_float<T>(in[a * C + i]);
    store_vec<C>(p + a * C, r);
  }
}

constexpr float kLog2e = 1.4426950408889634f;
// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp; results below 2^-126
// flush to 0, and 2^-inf = 0), as the softmaxes of the attention and cross-entropy kernels
// use it (exp(x) = 2^(x log2 e): one FFMA folds the shift in).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef DTRAIN_KERNELS_EMULATE
  const float y = std::exp2(x);
  return y < 1.17549435e-38f ? 0.f : y;
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// tanh(x) on the special-function unit (tanh.approx.f32, sm_75 and later: relative error
// about 2^-11), as FlashAttention's softcap takes it.
__device__ __forceinline__ float fast_tanh(float x) {
#ifdef DTRAIN_KERNELS_EMULATE
  return std::tanh(x);
#else
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// log2(x) on the special-function unit (lg2.approx.ftz.f32; log2(0) = -inf).
__device__ __forceinline__ float fast_log2(float x) {
#ifdef DTRAIN_KERNELS_EMULATE
  return std::log2(x < 1.17549435e-38f ? 0.f : x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// ---- reductions --------------------------------------------------------------------------
// at[0] += a, at[1] += b in global memory (at 8-byte aligned): one vector reduction on
// sm_90 and later (atomicAdd of a float2), two atomics before it and in the emulator.
__device__ __forceinline__ void atomic_add_pair(float* at, float a, float b) {
#if !defined(DTRAIN_KERNELS_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(at), make_float2(a, b));
#else
  atomicAdd(at, a);
  atomicAdd(at + 1, b);
#endif
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` holds 32 floats of shared memory; the call synchronises the block.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(x);
}
// Two sums over the block in one exchange (one pair of barriers instead of two).
__device__ __forceinline__ float2 block_sum2(float2 x, float2* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x.x = warp_sum(x.x);
  x.y = warp_sum(x.y);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : make_float2(0.f, 0.f);
  return make_float2(warp_sum(x.x), warp_sum(x.y));
}
__device__ __forceinline__ float block_max(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : -INFINITY;
  return warp_max(x);
}

// ---- launch convention -------------------------------------------------------------------
// The error of the launch just made (configuration errors show here; faults later).
inline cudaError_t launched() { return cudaGetLastError(); }

// An SM count and how many blocks of `kernel` (threads, smem) an SM holds at once (after
// allowing the kernel that much dynamic shared memory, which the launch does again), for
// grids of as many blocks as the GPU holds. Cached per device, kernel and size: launches
// ask on every call. A failed query gives 108 SMs or 1 block per SM: it only changes the grid.
struct Occupancy {
  int sms, per_sm;
};
template <typename... Args>
Occupancy occupancy(void (*kernel)(Args...), int threads, size_t smem) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  const auto key = std::make_tuple(device, reinterpret_cast<std::uintptr_t>(kernel), threads, smem);
  static std::mutex mu;
  static std::map<decltype(key), Occupancy> cache;
  {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  Occupancy o{108, 1};
  if (device >= 0) cudaDeviceGetAttribute(&o.sms, cudaDevAttrMultiProcessorCount, device);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.per_sm, kernel, threads, smem) != cudaSuccess) {
    o.per_sm = 1;
  }
  o.per_sm = std::max(o.per_sm, 1);
  cudaGetLastError();  // a failed query only changes the grid
  const std::lock_guard<std::mutex> lock(mu);
  cache.emplace(key, o);
  return o;
}

inline bool aligned(const void* p, std::uintptr_t bytes) {
  return (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0;
}

// Rows of T at ptr with this stride (elements) start 16-byte aligned: with a row length
// that is a multiple of 16 bytes, they move in 16-byte accesses.
template <typename T>
bool rows_aligned(const void* ptr, int64_t stride) {
  return aligned(ptr, 16) && stride % vec16<T>() == 0;
}

inline bool known_dtype(dtrain_kernel_dtype d) {
  return d == DTRAIN_KERNEL_F32 || d == DTRAIN_KERNEL_BF16 || d == DTRAIN_KERNEL_F16;
}

// Returns f(T{}) for the element type T of dtype (float, __nv_bfloat16, __half), or
// cudaErrorInvalidValue for anything else.
template <typename F>
cudaError_t dispatch_dtype(dtrain_kernel_dtype dtype, F&& f) {
  switch (dtype) {
    case DTRAIN_KERNEL_F32: return f(float{});
    case DTRAIN_KERNEL_BF16: return f(__nv_bfloat16{});
    case DTRAIN_KERNEL_F16: return f(__half{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace dtrain_kernels
