// Hopper (sm_90a) warpgroup MMA for the attention kernels: wgmma.mma_async m64nNk16 with
// float32 accumulators (N = 32 to 256), A from shared memory or registers, B from shared
// memory through matrix descriptors of the no-swizzle layout that load_blocked_async
// writes; the fences and group waits around them. The CPU emulator runs the same calls.
// A warpgroup's accumulators are d[N / 8][4] per thread: warp w of the group holds rows
// 16 w .. 16 w + 15 and each 8-column chunk as mma.sync's 16 x 8 accumulator, so the
// mma.sync code for softmax and masks applies unchanged.
#pragma once

#include "mma.cuh"

// Where wgmma exists: the sm_90a device pass, and the emulator.
#if defined(DTRAIN_KERNELS_EMULATE) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define DTRAIN_HAVE_WGMMA 1
#else
#define DTRAIN_HAVE_WGMMA 0
#endif

namespace dtrain_kernels {

// ---- the blocked shared-memory layout -------------------------------------------------------
// A [rows, kCols] tile of 16-bit elements as 8 x 8 blocks of 128 contiguous bytes: block
// (r / 8, c / 8) at element ((r / 8) (kCols / 8) + c / 8) 64, its row r % 8 at (r % 8) 8.
// That is wgmma's no-swizzle core-matrix layout, K-major when the columns are the
// reduction (Q and K for Q K^T) and MN-major when the rows are (V for P V).

template <int kCols>
__device__ __forceinline__ int blocked_offset(int r, int c) {
  return ((r / 8) * (kCols / 8) + c / 8) * 64 + (r % 8) * 8 + c % 8;
}

// A [kRows, kCols] tile from global memory (row stride `stride` elements) into the blocked
// layout; rows at and after `valid` are zero-filled. Thread i copies 16-byte chunks i +
// n kThreads: chunk i is row (i / kCols) 8 + i % 8 at columns ((i / 8) % (kCols / 8)) 8,
// so that the block's writes to shared memory are contiguous and each warp reads 8 rows
// of 64 bytes.
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_blocked_async(T* dst, const T* src, int64_t stride, int64_t valid) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  constexpr int kChunks = kRows * kCols / 8;
  static_assert(kChunks % kThreads == 0 && kThreads % kCols == 0, "whole rows of blocks per pass");
  const int i0 = threadIdx.x;
  const int r0 = (i0 / kCols) * 8 + i0 % 8, c = ((i0 / 8) % (kCols / 8)) * 8;
  constexpr int kStep = kThreads / kCols * 8;  // rows one pass covers
#pragma unroll
  for (int n = 0; n < kChunks / kThreads; ++n) {
    const int r = r0 + n * kStep;
    const bool ok = r < valid;
    cp_async16(dst + (i0 + n * kThreads) * 8, ok ? src + r * stride + c : src, ok);
  }
}

// ---- matrix descriptors ------------------------------------------------------------------
__device__ __forceinline__ uint32_t shared_address(const void* p) {
#ifdef DTRAIN_KERNELS_EMULATE
  return ::dtrain_emu::shared_address(p);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}

// A no-swizzle descriptor: lbo bytes between core matrices along K, sbo along M or N.
__device__ __forceinline__ uint64_t smem_desc(const void* tile, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((shared_address(tile) >> 4) & 0x3fff) |
         static_cast<uint64_t>((lbo >> 4) & 0x3fff) << 16 | static_cast<uint64_t>((sbo >> 4) & 0x3fff) << 32;
}
// Operands in the blocked layout of a [rows, kCols] tile starting at `tile`:
// K-major (the columns are K): 16 K steps are 256 bytes.
template <int kCols, typename T>
__device__ __forceinline__ uint64_t kmajor_desc(const T* tile) {
  return smem_desc(tile, 128, kCols / 8 * 128);
}
// MN-major (the rows are K): 16 K steps are 2 kCols 16 bytes.
template <int kCols, typename T>
__device__ __forceinline__ uint64_t mnmajor_desc(const T* tile) {
  return smem_desc(tile, kCols / 8 * 128, 128);
}
// The descriptor `bytes` further on (bytes a multiple of 16, inside shared memory).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// ---- wgmma ---------------------------------------------------------------------------------
// d += A B (accumulate == 0: d = A B): A 64 x 16 K-major and B 16 x N K-major, both by
// descriptor (S = Q K^T).
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate);
// The same with B 16 x N MN-major (dQ = dS K in the backward; at D 256 dV and dK too).
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate);
// d += A B: A from registers (mma.sync's A fragment of this warp's 16 rows), B 16 x N
// MN-major by descriptor (O += P V).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_mn(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b);

// Keeps the compiler from moving accesses to x across the wgmma issue, fence and wait.
template <int kN>
__device__ __forceinline__ void wgmma_fence_regs(float (&x)[kN][4]) {
#ifndef DTRAIN_KERNELS_EMULATE
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(x[i][e])::"memory");
  }
#endif
}
template <int kN>
__device__ __forceinline__ void wgmma_fence_regs(uint32_t (&x)[kN][4]) {
#ifndef DTRAIN_KERNELS_EMULATE
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(x[i][e])::"memory");
  }
#endif
}

#ifdef DTRAIN_KERNELS_EMULATE
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
  ::dtrain_emu::wgmma(&d[0][0], N, a, nullptr, b, false, accumulate != 0, std::is_same<T, __nv_bfloat16>::value);
}
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
  ::dtrain_emu::wgmma(&d[0][0], N, a, nullptr, b, true, accumulate != 0, std::is_same<T, __nv_bfloat16>::value);
}
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_mn(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b) {
  ::dtrain_emu::wgmma(&d[0][0], N, 0, a, b, true, true, std::is_same<T, __nv_bfloat16>::value);
}
__device__ __forceinline__ void wgmma_fence() { ::dtrain_emu::wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { ::dtrain_emu::wgmma_commit(); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  ::dtrain_emu::wgmma_wait(kPending);
}
// Orders this thread's generic-proxy writes to shared memory (cp.async, stores) before
// the async proxy's reads (wgmma); a barrier must follow.
__device__ __forceinline__ void fence_async_shared() { ::dtrain_emu::fence_proxy_async(); }
#elif DTRAIN_HAVE_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The specialisations (wgmma_ss and wgmma_ss_mn: N = 32, 64, 128; wgmma_rs_mn: 64, 128,
// 256; bf16, f16), one asm statement each: N / 2 accumulator operands (%0 ..), then A (a
// descriptor, or 4 registers), B, and the flag that sets scale-d (wgmma_ss's accumulate;
// 1 for rs). The immediates after it are scale-a, scale-b, then for ss trans-a (0) and
// trans-b, for rs trans-b (1: B is MN-major).
#define DTRAIN_ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define DTRAIN_ACC_32 DTRAIN_ACC4(0), DTRAIN_ACC4(1), DTRAIN_ACC4(2), DTRAIN_ACC4(3)
#define DTRAIN_ACC_64 DTRAIN_ACC_32, DTRAIN_ACC4(4), DTRAIN_ACC4(5), DTRAIN_ACC4(6), DTRAIN_ACC4(7)
#define DTRAIN_ACC_128 DTRAIN_ACC_64, DTRAIN_ACC4(8), DTRAIN_ACC4(9), DTRAIN_ACC4(10), DTRAIN_ACC4(11), \
                       DTRAIN_ACC4(12), DTRAIN_ACC4(13), DTRAIN_ACC4(14), DTRAIN_ACC4(15)
#define DTRAIN_ACC_256 DTRAIN_ACC_128, DTRAIN_ACC4(16), DTRAIN_ACC4(17), DTRAIN_ACC4(18), DTRAIN_ACC4(19), \
                       DTRAIN_ACC4(20), DTRAIN_ACC4(21), DTRAIN_ACC4(22), DTRAIN_ACC4(23), \
                       DTRAIN_ACC4(24), DTRAIN_ACC4(25), DTRAIN_ACC4(26), DTRAIN_ACC4(27), DTRAIN_ACC4(28), \
                       DTRAIN_ACC4(29), DTRAIN_ACC4(30), DTRAIN_ACC4(31)
#define DTRAIN_REGS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define DTRAIN_REGS_64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define DTRAIN_REGS_128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, " \
  "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define DTRAIN_REGS_256 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, " \
  "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
  "%124, %125, %126, %127}"
#define DTRAIN_WGMMA_PTX(type, n) "wgmma.mma_async.sync.aligned.m64n" #n "k16.f32." type "." type " "

// NAME<T, N>(d, a, b, accumulate) with A and B by descriptor; A is %N/2, B the next, the flag the one after.
#define DTRAIN_WGMMA_SS(name, T, type, n, trans_b, ia, ib, iflag)                                           \
  template <>                                                                                                \
  __device__ __forceinline__ void name<T, n>(float (&d)[n / 8][4], uint64_t a, uint64_t b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #iflag ", 0;\n" DTRAIN_WGMMA_PTX(type, n)             \
                     DTRAIN_REGS_##n ", %" #ia ", %" #ib ", p, 1, 1, 0, " #trans_b ";\n}\n"                  \
                 : DTRAIN_ACC_##n                                                                            \
                 : "l"(a), "l"(b), "r"(accumulate));                                                         \
  }
// wgmma_rs_mn<T, N>(d, a, b): A's 4 registers from %N/2, B after them, then the flag.
#define DTRAIN_WGMMA_RS(T, type, n, ia0, ia1, ia2, ia3, ib, iflag)                                           \
  template <>                                                                                                \
  __device__ __forceinline__ void wgmma_rs_mn<T, n>(float (&d)[n / 8][4], const uint32_t (&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #iflag ", 0;\n" DTRAIN_WGMMA_PTX(type, n)             \
                     DTRAIN_REGS_##n ", {%" #ia0 ", %" #ia1 ", %" #ia2 ", %" #ia3 "}, %" #ib ", p, 1, 1, 1;\n}\n" \
                 : DTRAIN_ACC_##n                                                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                              \
  }

DTRAIN_WGMMA_SS(wgmma_ss, __nv_bfloat16, "bf16", 32, 0, 16, 17, 18)
DTRAIN_WGMMA_SS(wgmma_ss, __half, "f16", 32, 0, 16, 17, 18)
DTRAIN_WGMMA_SS(wgmma_ss, __nv_bfloat16, "bf16", 64, 0, 32, 33, 34)
DTRAIN_WGMMA_SS(wgmma_ss, __half, "f16", 64, 0, 32, 33, 34)
DTRAIN_WGMMA_SS(wgmma_ss, __nv_bfloat16, "bf16", 128, 0, 64, 65, 66)
DTRAIN_WGMMA_SS(wgmma_ss, __half, "f16", 128, 0, 64, 65, 66)
DTRAIN_WGMMA_SS(wgmma_ss_mn, __nv_bfloat16, "bf16", 32, 1, 16, 17, 18)
DTRAIN_WGMMA_SS(wgmma_ss_mn, __half, "f16", 32, 1, 16, 17, 18)
DTRAIN_WGMMA_SS(wgmma_ss_mn, __nv_bfloat16, "bf16", 64, 1, 32, 33, 34)
DTRAIN_WGMMA_SS(wgmma_ss_mn, __half, "f16", 64, 1, 32, 33, 34)
DTRAIN_WGMMA_SS(wgmma_ss_mn, __nv_bfloat16, "bf16", 128, 1, 64, 65, 66)
DTRAIN_WGMMA_SS(wgmma_ss_mn, __half, "f16", 128, 1, 64, 65, 66)
DTRAIN_WGMMA_RS(__nv_bfloat16, "bf16", 64, 32, 33, 34, 35, 36, 37)
DTRAIN_WGMMA_RS(__half, "f16", 64, 32, 33, 34, 35, 36, 37)
DTRAIN_WGMMA_RS(__nv_bfloat16, "bf16", 128, 64, 65, 66, 67, 68, 69)
DTRAIN_WGMMA_RS(__half, "f16", 128, 64, 65, 66, 67, 68, 69)
DTRAIN_WGMMA_RS(__nv_bfloat16, "bf16", 256, 128, 129, 130, 131, 132, 133)
DTRAIN_WGMMA_RS(__half, "f16", 256, 128, 129, 130, 131, 132, 133)

#undef DTRAIN_WGMMA_RS
#undef DTRAIN_WGMMA_SS
#undef DTRAIN_WGMMA_PTX
#undef DTRAIN_REGS_256
#undef DTRAIN_REGS_128
#undef DTRAIN_REGS_64
#undef DTRAIN_REGS_32
#undef DTRAIN_ACC_256
#undef DTRAIN_ACC_128
#undef DTRAIN_ACC_64
#undef DTRAIN_ACC_32
#undef DTRAIN_ACC4
#endif

}  // namespace dtrain_kernels
