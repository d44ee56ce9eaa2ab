// Hopper (sm_90) asynchronous copies for the attention kernels: bulk tensor copies (TMA)
// of boxes described by a tensor map, written to shared memory with the 128-byte swizzle
// that wgmma's swizzled descriptors read; the mbarriers whose transaction counts say when
// a copy has landed; bulk reductions from shared into global memory (float32 adds, in
// bulk groups a thread commits and waits for: .read when its source may be written again,
// plain before the block ends); named barriers (bar.sync / bar.arrive on a subset of the
// block's warps) and warpgroup register reconfiguration (setmaxnreg). The emulator runs
// the same calls (kernels/emulator).
#pragma once

#include <cuda.h>  // CUtensorMap

#include "dtrain_kernels/attention.h"
#include "wgmma.cuh"

namespace dtrain_kernels {

// ---- host: tensor maps ---------------------------------------------------------------------
// A tiled map of a 4-d tensor of 16-bit elements, dims[0] contiguous (dims and box
// innermost first, strides in elements for dims 1..3; a stride of a dimension of size 1
// is not used), boxes of box0 x box1 (x 1 x 1) elements with box0 * 2 <= 128 bytes,
// written with the 128-byte swizzle. cudaErrorNotSupported when the driver cannot
// describe these strides or pointer (or no driver has cuTensorMapEncodeTiled).
cudaError_t make_tensor_map_4d(CUtensorMap* map, const void* base, bool bf16, const uint64_t (&dims)[4],
                               const int64_t (&strides)[3], uint32_t box0, uint32_t box1);

// Columns per box with the 128-byte swizzle: one 128-byte row of 16-bit elements.
constexpr int kSwizzleBox = 64;

// The map of an attention operand [batch, heads, seq, d] with element strides s (unit
// along d): boxes of kSwizzleBox columns x `rows` rows.
inline cudaError_t attention_operand_map(CUtensorMap* map, const void* base, bool bf16, int64_t batch, int64_t heads,
                                         int64_t seq, int64_t d, const dtrain_attention_strides& s, uint32_t rows) {
  const uint64_t dims[4] = {static_cast<uint64_t>(d), static_cast<uint64_t>(seq), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(batch)};
  const int64_t strides[3] = {s.seq, s.head, s.batch};
  return make_tensor_map_4d(map, base, bf16, dims, strides, kSwizzleBox, rows);
}

// ---- device --------------------------------------------------------------------------------
#ifdef DTRAIN_KERNELS_EMULATE
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) { ::dtrain_emu::mbarrier_init(bar, count); }
// Makes the initialised barriers visible to the async proxy (TMA); a block barrier follows.
__device__ __forceinline__ void fence_barrier_init() {}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) { ::dtrain_emu::mbarrier_arrive(bar); }
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  ::dtrain_emu::mbarrier_arrive_expect_tx(bar, bytes);
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) { ::dtrain_emu::mbarrier_wait(bar, parity); }
// The emulator reports a wait that can never complete as a deadlock.
__device__ __forceinline__ void mbarrier_wait_or_trap(uint64_t* bar, int parity) { mbarrier_wait(bar, parity); }
// The box at (c0, c1, c2, c3) of `map` into dst (1024-byte aligned), completing on bar.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  const int coords[4] = {c0, c1, c2, c3};
  ::dtrain_emu::tma_load(dst, map, coords, bar);
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  ::dtrain_emu::named_barrier_sync(id, threads);
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  ::dtrain_emu::named_barrier_arrive(id, threads);
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {}
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  ::dtrain_emu::bulk_reduce_add_f32(dst, src, bytes);
}
__device__ __forceinline__ void bulk_commit() { ::dtrain_emu::bulk_commit(); }
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  ::dtrain_emu::bulk_wait(kPending);
}
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  ::dtrain_emu::bulk_wait(kPending);
}
#elif DTRAIN_HAVE_WGMMA
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait(uint32_t addr, int parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(addr), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  const uint32_t addr = shared_address(bar);
  while (!mbarrier_try_wait(addr, parity)) {
  }
}
// A wait longer than kMbarrierTimeoutNs is a pipeline that can never complete (a copy not
// issued, a wrong byte count or parity, a consumer stuck): the kernel traps, so that the
// caller gets an error ("unspecified launch failure") instead of a hang. It costs
// registers, so the producer, which has them to spare, is the one that keeps watch.
constexpr uint64_t kMbarrierTimeoutNs = 10'000'000'000ull;
__device__ __forceinline__ void mbarrier_wait_or_trap(uint64_t* bar, int parity) {
  const uint32_t addr = shared_address(bar);
  if (mbarrier_try_wait(addr, parity)) return;
  const uint64_t start = global_time_ns();
  while (!mbarrier_try_wait(addr, parity)) {
    if (global_time_ns() - start > kMbarrierTimeoutNs) __trap();
  }
}
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(shared_address(bar))
      : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
#endif

// A 128-byte-swizzled K-major descriptor (wgmma): rows of 128 bytes, 8-row atoms 1024
// bytes apart; `tile` + 32 bytes per 16 columns of K inside the atom's row.
__device__ __forceinline__ uint64_t sw128_kmajor_desc(const void* tile) {
  return smem_desc(tile, 16, 1024) | uint64_t{1} << 62;
}
// A 128-byte-swizzled MN-major descriptor: rows (K) of 128 bytes holding 64 of M/N, 8-row
// atoms 1024 bytes apart along K, the next 64 of M/N `mn_bytes` further.
__device__ __forceinline__ uint64_t sw128_mnmajor_desc(const void* tile, uint32_t mn_bytes) {
  return smem_desc(tile, mn_bytes, 1024) | uint64_t{1} << 62;
}

}  // namespace dtrain_kernels
