// Tensor-core and asynchronous-copy pieces for sm_80 and later: mma.sync m16n8k16 with
// float32 accumulation (bf16 or f16 inputs), packing two values into one 32-bit fragment
// register (the lower column index in the low half, as the PTX fragment layouts expect),
// fragments loaded from shared memory by ldmatrix, and 16-byte cp.async global -> shared
// copies with zero fill.
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

// ---- shared-memory fragments (ldmatrix) -------------------------------------------------------
// Four 8 x 8 matrices of 16-bit elements from shared memory: lane l gives the address of
// row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); r[i] gets this lane's fragment
// of matrix i: row lane / 4, columns 2 (lane % 4) + {0, 1}, or with kTrans that column and
// those rows (the fragment of the transposed matrix).
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* row) {
#ifdef DTRAIN_KERNELS_EMULATE
  ::dtrain_emu::ldmatrix_x4(r, row, kTrans);
#else
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
#endif
}

// ldsm_x4's inverse (stmatrix, sm_90 and later): this lane's fragments r[i] of four 8 x 8
// matrices to shared memory, lane l giving the address of row l % 8 of matrix l / 8 (with
// kTrans: the matrices are stored transposed, lane l's address taking column l % 8).
template <bool kTrans>
__device__ __forceinline__ void stsm_x4(const uint32_t (&r)[4], void* row) {
#ifdef DTRAIN_KERNELS_EMULATE
  ::dtrain_emu::stmatrix_x4(r, row, kTrans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
  }
#else
  __trap();  // no stmatrix before sm_90: only the Hopper kernels call it
#endif
}

// The A fragment of the 16 x 16 tile at `tile` (row-major, `pitch` elements).
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int pitch) {
  const int l = threadIdx.x % 32, m = l / 8;
  ldsm_x4<false>(a, tile + ((m % 2) * 8 + l % 8) * pitch + (m / 2) * 8);
}

// The same from the transpose of that tile, stored row-major [k][m] (16 k rows by 16 m
// columns at `tile`).
template <typename T>
__device__ __forceinline__ void load_a_t(uint32_t (&a)[4], const T* tile, int pitch) {
  const int l = threadIdx.x % 32, m = l / 8;
  ldsm_x4<true>(a, tile + ((m / 2) * 8 + l % 8) * pitch + (m % 2) * 8);
}

// The B fragments of two 16 x 8 tiles from a row-major [n][k] tile of 16 n rows by 16 k
// columns (K as stored, for Q K^T): b[0..1] for n rows 0..7, b[2..3] for rows 8..15.
template <typename T>
__device__ __forceinline__ void load_b2_nk(uint32_t (&b)[4], const T* tile, int pitch) {
  const int l = threadIdx.x % 32, m = l / 8;
  ldsm_x4<false>(b, tile + ((m / 2) * 8 + l % 8) * pitch + (m % 2) * 8);
}

// The same from a row-major [k][n] tile of 16 k rows by 16 n columns (V as stored, for
// P V): b[0..1] for n columns 0..7, b[2..3] for columns 8..15.
template <typename T>
__device__ __forceinline__ void load_b2_kn(uint32_t (&b)[4], const T* tile, int pitch) {
  const int l = threadIdx.x % 32, m = l / 8;
  ldsm_x4<true>(b, tile + ((m % 2) * 8 + l % 8) * pitch + (m / 2) * 8);
}

// ---- warp tiles --------------------------------------------------------------------------------
// A warp's operands are kM 16-row tiles (acc[m] for rows 16 m .. 16 m + 15 of its block);
// each B fragment read from shared memory feeds all kM of them.
template <int kN>
__device__ __forceinline__ void zero_tiles(float (&acc)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}
template <int kM, int kN>
__device__ __forceinline__ void zero_tiles(float (&acc)[kM][kN][4]) {
#pragma unroll
  for (int m = 0; m < kM; ++m) zero_tiles(acc[m]);
}

// A 16 x 8 kN matrix held as accumulators (acc[n] the 16 x 8 tile of columns 8 n ..) as A
// fragments: chunks 2 kk and 2 kk + 1 are the 16 x 16 tile kk (16-bit, in that order).
template <typename T, int kN>
__device__ __forceinline__ void pack_a_fragment(uint32_t (&af)[4], const float (&acc)[kN][4], int kk) {
  af[0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
  af[1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
  af[2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  af[3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}
template <typename T, int kN>
__device__ __forceinline__ void pack_a_fragments(uint32_t (&af)[kN / 2][4], const float (&acc)[kN][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 2; ++kk) pack_a_fragment<T>(af[kk], acc, kk);
}

// One 16-deep step of acc[m][nt] += A_m B_nt^T for nt < kN: A_m's fragment in registers,
// B_nt the 8 x 16 rows nt*8.. of b (row-major, pitch; the k columns already offset).
template <typename T, int kM, int kN>
__device__ __forceinline__ void mma_frag_rows(float (&acc)[kM][kN][4], const uint32_t (&af)[kM][4], const T* b,
                                              int pitch) {
  static_assert(kN % 2 == 0, "B tiles come in pairs");
#pragma unroll
  for (int nt = 0; nt < kN; nt += 2) {
    uint32_t bf[4];
    load_b2_nk(bf, b + nt * 8 * pitch, pitch);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      mma16816<T>(acc[m][nt], af[m], bf);
      mma16816<T>(acc[m][nt + 1], af[m], bf + 2);
    }
  }
}

// One 16-deep step of acc[m][i] += A_m B_i for i < kD: A_m's fragment in registers, B_i
// the 16 x 8 columns i*8.. of b (row-major [k][n], pitch; the k rows already offset).
template <typename T, int kM, int kD>
__device__ __forceinline__ void mma_frag_cols(float (&acc)[kM][kD][4], const uint32_t (&af)[kM][4], const T* b,
                                              int pitch) {
  static_assert(kD % 2 == 0, "B tiles come in pairs");
#pragma unroll
  for (int i = 0; i < kD; i += 2) {
    uint32_t bf[4];
    load_b2_kn(bf, b + i * 8, pitch);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      mma16816<T>(acc[m][i], af[m], bf);
      mma16816<T>(acc[m][i + 1], af[m], bf + 2);
    }
  }
}

// acc[m][nt] += A_m B_nt^T for nt < kN: A_m the 16 x kK rows 16 m.. of a (pitch a_pitch),
// B_nt the 8 x kK rows nt*8.. of b (pitch b_pitch); both row-major in shared memory
// (S = Q K^T shapes).
template <typename T, int kM, int kK, int kN>
__device__ __forceinline__ void mma_rows_rows(float (&acc)[kM][kN][4], const T* a, int a_pitch, const T* b,
                                              int b_pitch) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t af[kM][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) load_a(af[m], a + m * 16 * a_pitch + kk * 16, a_pitch);
    mma_frag_rows<T, kM, kN>(acc, af, b + kk * 16, b_pitch);
  }
}

// acc[m][i] += P_m B_i for i < kD: P_m is a 16 x kK matrix held as accumulators (p[m][n]
// the 16 x 8 tile of columns n*8..; two of them form one A fragment), B_i the kK x 8
// columns i*8.. of b, row-major in shared memory (pitch; O += P V shapes).
template <typename T, int kM, int kK, int kD>
__device__ __forceinline__ void mma_acc_cols(float (&acc)[kM][kD][4], const float (&p)[kM][kK / 8][4], const T* b,
                                             int pitch) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t af[kM][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) pack_a_fragment<T>(af[m], p[m], kk);
    mma_frag_cols<T, kM, kD>(acc, af, b + kk * 16 * pitch, pitch);
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

// Columns [kC0, kC0 + kCols) of a [rows, D] tile (row stride `stride` elements in global
// memory) into shared memory with a row pitch of `pitch` elements; rows at and after
// `valid` and columns at and after `cols` (a multiple of 8) are zero-filled. Thread i
// copies the 16 bytes at chunk (i % per_row) of rows i / per_row + n * step.
template <int kRows, int kC0, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_cols_async(T* dst, int pitch, const T* src, int64_t stride, int64_t valid,
                                                int64_t cols) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerRow = kCols / kVec;
  static_assert(kCols % kVec == 0 && kThreads % kPerRow == 0 && kRows % (kThreads / kPerRow) == 0,
                "whole rows per pass");
  constexpr int kStep = kThreads / kPerRow;  // rows one pass of the block covers
  const int r0 = threadIdx.x / kPerRow, c = kC0 + (threadIdx.x % kPerRow) * kVec;
  const bool col_ok = c < cols;
  const T* s = src + r0 * stride + c;
  T* d = dst + r0 * pitch + c;
#pragma unroll
  for (int n = 0; n < kRows / kStep; ++n) {
    const bool ok = col_ok && r0 + n * kStep < valid;
    cp_async16(d + n * kStep * pitch, ok ? s + n * kStep * stride : src, ok);
  }
}

// A whole [kRows, D] tile (load_cols_async's conventions). A row of chunks that does not
// divide the block (D 96: 12 of them) goes as ranges of 32 columns, each at a fixed column
// per thread: one address per range, no per-chunk division. (ptxas, sm_90a: no spill in
// the D 96 forward, 12 bytes in the backward; a division per chunk spilled 44 bytes in the
// forward, ranges of 64 + 32 columns 32 in the backward.)
template <int kRows, int D, int kThreads, typename T, int kC0 = 0>
__device__ __forceinline__ void load_tile_async(T* dst, int pitch, const T* src, int64_t stride, int64_t valid,
                                                int64_t cols) {
  constexpr int kCols = kThreads % (D / (16 / sizeof(T))) == 0 ? D : 32;
  load_cols_async<kRows, kC0, kCols, kThreads>(dst, pitch, src, stride, valid, cols);
  if constexpr (kC0 + kCols < D) {
    load_tile_async<kRows, D, kThreads, T, kC0 + kCols>(dst, pitch, src, stride, valid, cols);
  }
}

}  // namespace dtrain_kernels
