// Tensor-core and asynchronous-copy pieces for sm_80 and later: mma.sync m16n8k16 with
// float32 accumulation (bf16 or f16 inputs), packing two values into one 32-bit fragment
// register (the lower column index in the low half, as the PTX fragment layouts expect),
// and 16-byte cp.async global -> shared copies with zero fill.
#pragma once

#include <cstring>
#include <type_traits>

#include "common.cuh"

namespace dtrain_kernels {

// ---- fragments -----------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// Two 16-bit elements from anywhere (a column of a row-major tile).
template <typename T>
__device__ __forceinline__ uint32_t pack_raw(T lo, T hi) {
  uint16_t a, b;
  memcpy(&a, &lo, 2);
  memcpy(&b, &hi, 2);
  return static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
}

// Two consecutive 16-bit elements (4-byte aligned) as one register.
template <typename T>
__device__ __forceinline__ uint32_t ld32(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// d += a b for one 16 x 8 x 16 tile; a: 4 registers, b: 2, d: 4 floats (PTX layouts).
template <typename T>
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#ifdef DTRAIN_KERNELS_EMULATE
  ::dtrain_emu::mma_m16n8k16(d, a, b, d, std::is_same<T, __nv_bfloat16>::value);
#else
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// ---- warp tiles --------------------------------------------------------------------------------
template <int kN>
__device__ __forceinline__ void zero_tiles(float (&acc)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// acc[nt] += A B_nt^T for nt < kN: A is 16 x kK (rows at a, pitch a_pitch), B_nt the 8 x kK
// rows nt*8.. of b (pitch b_pitch); both row-major in shared memory (S = Q K^T shapes).
template <typename T, int kK, int kN>
__device__ __forceinline__ void mma_rows_rows(float (&acc)[kN][4], const T* a, int a_pitch, const T* b,
                                              int b_pitch) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const T* ar = a + g * a_pitch + kk * 16 + 2 * t;
    const uint32_t af[4] = {ld32(ar), ld32(ar + 8 * a_pitch), ld32(ar + 8), ld32(ar + 8 * a_pitch + 8)};
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
      const T* br = b + (nt * 8 + g) * b_pitch + kk * 16 + 2 * t;
      const uint32_t bf[2] = {ld32(br), ld32(br + 8)};
      mma16816<T>(acc[nt], af, bf);
    }
  }
}

// acc[i] += P B_i for i < kD: P is the 16 x kK matrix held as accumulators (p[n] the
// 16 x 8 tile of columns n*8..; two of them form one A fragment), B_i the kK x 8 columns
// i*8.. of b, row-major in shared memory (pitch; O += P V shapes).
template <typename T, int kK, int kD>
__device__ __forceinline__ void mma_acc_cols(float (&acc)[kD][4], const float (&p)[kK / 8][4], const T* b,
                                             int pitch) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const uint32_t af[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                            pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int i = 0; i < kD; ++i) {
      const T* br = b + (kk * 16 + 2 * t) * pitch + i * 8 + g;
      const uint32_t bf[2] = {pack_raw(br[0], br[pitch]), pack_raw(br[8 * pitch], br[9 * pitch])};
      mma16816<T>(acc[i], af, bf);
    }
  }
}

// ---- asynchronous copies -------------------------------------------------------------------
// 16 bytes from global to shared, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#ifdef DTRAIN_KERNELS_EMULATE
  if (valid) {
    memcpy(dst, src, 16);
  } else {
    memset(dst, 0, 16);
  }
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifndef DTRAIN_KERNELS_EMULATE
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most n of this thread's committed groups are still in flight.
template <int n>
__device__ __forceinline__ void cp_async_wait() {
#ifndef DTRAIN_KERNELS_EMULATE
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n));
#endif
}

// A [rows, D] tile (row stride `stride` elements in global memory) into shared memory
// with a row pitch of `pitch` elements; rows at and after `valid` are zero-filled.
template <int kRows, int D, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(T* dst, int pitch, const T* src, int64_t stride, int64_t valid) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerRow = D / kVec;
  for (int i = threadIdx.x; i < kRows * kPerRow; i += kThreads) {
    const int r = i / kPerRow, c = (i % kPerRow) * kVec;
    const bool ok = r < valid;
    cp_async16(dst + r * pitch + c, ok ? src + r * stride + c : src, ok);
  }
}

}  // namespace dtrain_kernels
