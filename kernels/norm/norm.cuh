// What the norm kernels' two passes (norm_fwd.cu, norm_bwd.cu) share: the limits, how a
// row is cut into accesses (16 bytes where every row start is aligned, else one element)
// and held in registers, the weights' load at their run-time dtype, and the choice of the
// kernel instance sized for a row's number of accesses per thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "dtrain_kernels/norm.h"

namespace dtrain_kernels {

constexpr int kMaxThreads = 512;
constexpr int kRowThreads = 128;       // threads per row aimed at (see with_vecs) ...
constexpr int kRowVecs = 4;            // ... with up to this many 16-byte accesses each
constexpr int64_t kMaxCols = 16384;    // the backward's partials: 2 x 64 KiB of shared memory
constexpr int kMaxElems = 32;          // per thread: kMaxCols / kMaxThreads
constexpr int kHeldVecs = 8;           // accesses per thread held in registers, at most
constexpr int64_t kMinStripRows = 32;  // keeps the partials a small share of the backward's traffic

// Threads for a row of n accesses: one access each, up to kMaxThreads.
inline int row_threads(int64_t n) {
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (n + 31) / 32 * 32)));
}

// Calls f(k, j) for each access j (V elements) of this thread: j = threadIdx.x +
// k blockDim.x, unrolled over k < kVecs when the row is held, else in a loop (k = 0).
template <int kVecs, typename F>
__device__ __forceinline__ void each_access(int nv, F&& f) {
  if constexpr (kVecs <= kHeldVecs) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) f(k, j);
    }
  } else {
    for (int j = threadIdx.x; j < nv; j += blockDim.x) f(0, j);
  }
}

// This thread's accesses of one row: loaded once and held (kVecs <= kHeldVecs), or read at
// each use. kEachUse: held fp16 converts at each use (to_float_each_use).
template <typename T, int V, int kVecs, bool kEachUse = false>
struct RowShare {
  static constexpr bool kHeld = kVecs <= kHeldVecs;
  const T* row;
  Vec<T, V> held[kHeld ? kVecs : 1] = {};
  __device__ __forceinline__ RowShare(const T* r, int nv) : row(r) {
    if constexpr (kHeld) each_access<kVecs>(nv, [&](int k, int j) { held[k] = load_vec<V>(row + j * V); });
  }
  __device__ __forceinline__ float at(int k, int j, int i) const {
    if constexpr (kHeld) {
      return to_float_at<kEachUse>(held[k], i);
    } else {
      return to_float(row[j * V + i]);
    }
  }
};

// V weights of access j, from w of dtype wt (ones when there is no w); kEachUse: fp16 by
// to_float_each_use.
template <int V, bool kEachUse = false>
__device__ __forceinline__ void load_weights(const void* w, dtrain_kernel_dtype wt, int j, float (&out)[V]) {
  if (w == nullptr) {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = 1.f;
  } else if (wt == DTRAIN_KERNEL_F32) {
    load_floats<V>(static_cast<const float*>(w) + j * V, out);
  } else if (wt == DTRAIN_KERNEL_BF16) {
    load_floats<V>(static_cast<const __nv_bfloat16*>(w) + j * V, out);
  } else {
    load_floats<V, kEachUse>(static_cast<const __half*>(w) + j * V, out);
  }
}

// Calls f(std::integral_constant<int, kVecs>) with the accesses per thread kVecs (1, 2, 4,
// ... up to kMaxElems / V; at one element per access 8, then 32) for a row of nv accesses:
// the fewest for which kRowThreads threads cover the row with at most kRowVecs accesses
// each (64 bytes of the row: the backward holds x, dy and their weights), else the fewest for
// which kMaxThreads do. Registers are sized for kVecs.
// Blocks of 4 warps (a 4096-wide bf16 row: 128 threads of four 16-byte accesses) keep the
// block reductions short and let an SM hold several times more rows at once than one
// thread per access (512 threads: 4 rows per SM, too few loads in flight on an H200).
template <int V, int kVecs = (V == 1 ? 8 : 1), typename F>
cudaError_t with_vecs(int64_t nv, F&& f) {
  constexpr int kNext = kVecs * (V == 1 ? 4 : 2);
  if constexpr (kNext <= kMaxElems / V) {
    const bool fewer_threads = kNext <= kRowVecs && nv > int64_t{kVecs} * kRowThreads;
    if (fewer_threads || nv > int64_t{kVecs} * kMaxThreads) return with_vecs<V, kNext>(nv, f);
  }
  return f(std::integral_constant<int, kVecs>{});
}

}  // namespace dtrain_kernels
