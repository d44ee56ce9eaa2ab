// A CPU emulator of the CUDA execution model, for testing the kernel sources on machines
// without a GPU: the .cu files compile with the host compiler (DTRAIN_KERNELS_EMULATE),
// each block's threads run as fibers in one OS thread, switching at __syncthreads, warp
// shuffles and warp- or warpgroup-level MMA, and blocks run one after another. It checks
// the kernels' logic (indexing, masking, reductions, synchronisation) with the fragment
// and shared-memory layouts of mma.sync, ldmatrix and wgmma as the PTX ISA documents
// them; it says nothing about speed, and a layout this file gets wrong would be wrong in
// the same way here and in the kernels. It reports shared-memory races: a read through
// ldmatrix, a wgmma descriptor or a bulk reduction of bytes that another warp stored with
// no __syncthreads, named barrier or mbarrier between (launch then throws "... race: ...").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>

namespace dtrain_emu {

// ---- the running thread ------------------------------------------------------------------
extern uint3 thread_idx, block_idx;
extern dim3 block_dim, grid_dim;

// Runs body once per thread of every block (blocks in order, x fastest, or in a
// permutation: dtrain_emu_set_block_order). Dynamic shared
// memory of smem bytes is filled with 0xff (NaN for floats) before each block, so a read
// of a slot nobody wrote shows. std::runtime_error on a barrier some threads never reach.
void launch(dim3 grid, dim3 block, std::size_t smem, const std::function<void()>& body);
void* dynamic_smem();

void sync_threads();
void sync_warp();
int lane();
// Every active lane of the calling warp publishes `bytes` of `mine`; each then copies the
// value published by lane `src` into `out`.
void warp_exchange(const void* mine, void* out, int src, std::size_t bytes);

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d = a b + c over the warp, with
// the PTX fragment layout (a: 4 registers of 2 elements, b: 2, c/d: 4 floats).
void mma_m16n8k16(float d[4], const std::uint32_t a[4], const std::uint32_t b[2], const float c[4], bool bf16);

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lanes 8 i .. 8 i + 7 give the row
// addresses (16 bytes each) of matrix i; out[i] gets this lane's two elements of matrix i,
// row lane / 4 and columns 2 (lane % 4) + {0, 1} (transposed: that column, those rows).
void ldmatrix_x4(std::uint32_t out[4], const void* row, bool trans);
// stmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 (sm_90): ldmatrix's inverse. in[i]
// holds this lane's two elements of matrix i (row lane / 4, columns 2 (lane % 4) + {0, 1});
// lanes 8 i .. 8 i + 7 give the row addresses where matrix i's rows are stored (transposed:
// its columns).
void stmatrix_x4(const std::uint32_t in[4], void* row, bool trans);

// ---- warpgroup MMA (wgmma, sm_90a) -------------------------------------------------------
// The shared-memory address (byte offset into the block's dynamic shared memory) that a
// wgmma matrix descriptor holds; throws outside it.
std::uint32_t shared_address(const void* p);
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}, issued by all 128 threads of a
// warpgroup (4 consecutive warps from a multiple of 4): d (this thread's N / 2 floats, the
// accumulator layout: warp w of the group holds rows 16 w.., each 8-column chunk as in
// mma.sync) += A B with A 64 x 16 from the descriptor desc_a (K-major) or, when a_regs is
// set, from registers (warp w's rows, mma.sync's A fragment), and B 16 x N from desc_b
// (K-major, or N-major when trans_b); accumulate == false: d = A B. Descriptors: start
// address, leading and stride byte offsets, no swizzle (anything else throws).
// Like the hardware, the product happens asynchronously: at the wgmma_wait that retires
// its group, reading shared memory (as the async proxy sees it) and d as they are then. Stricter than the hardware, it
// throws when a wgmma follows a wait with no wgmma_fence between them, when d or the A
// fragment's registers changed between the issue and the wait (the hardware may read
// them until then), or when the threads of the group disagree on the shape or the
// descriptors.
void wgmma(float* d, int n, std::uint64_t desc_a, const std::uint32_t* a_regs, std::uint64_t desc_b, bool trans_b,
           bool accumulate, bool bf16);
void wgmma_fence();
// fence.proxy.async: this block's plain stores to shared memory so far become visible to
// the async proxy (wgmma operands, bulk reductions). Without one, those reads see shared
// memory as bulk copies and earlier fences left it (the emulator publishes every thread's
// stores at the next async read after any thread's fence: laxer than the hardware, whose
// fence covers its own thread's stores only).
void fence_proxy_async();
void wgmma_commit();
// Retires all but the newest `pending` committed groups of this thread's warpgroup.
void wgmma_wait(int pending);

// ---- bulk tensor copies (TMA) and transaction barriers (mbarrier), sm_90 -------------------
// What the emulator keeps inside a CUtensorMap (its 128 opaque bytes): a tiled map of a
// tensor of up to 5 dimensions, dimension 0 contiguous, strides in bytes, one box per copy,
// and the swizzle (0 or 128 bytes) the copy writes shared memory with.
struct TensorMap {
  const void* base;
  int rank, elem_bytes, swizzle;
  std::uint64_t dims[5], strides[5];
  std::uint32_t box[5];
};
// Fills the 128-byte map (a CUtensorMap) or throws on what the driver would refuse.
void encode_tensor_map(void* map, const TensorMap& m);
// mbarrier in shared memory: `count` arrivals and the transaction bytes expected on it
// complete its current phase. mbarrier_wait(parity) returns once the phase of that parity
// has completed (a fresh barrier is in phase 0: waiting for parity 1 returns at once).
void mbarrier_init(void* bar, int count);
void mbarrier_arrive(void* bar);
void mbarrier_arrive_expect_tx(void* bar, std::uint32_t bytes);
void mbarrier_wait(void* bar, int parity);
// cp.async.bulk.tensor: the box at coords (dimension 0 first) into dst, zero past the
// tensor's bounds, completing box bytes of transactions on bar. Like the hardware it is
// asynchronous: the copy lands when a thread waits on bar (as late as it may), so a read
// of dst before that wait sees what was there before.
void tma_load(void* dst, const void* map, const int* coords, void* bar);
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: adds `bytes` (a multiple of
// 16) of float32 at src (shared memory) into dst (global memory), both 16-byte aligned, in
// this thread's current bulk group. Like the hardware it is asynchronous: the adds happen
// at the bulk_wait that retires the group, reading shared memory as it is then (as the
// async proxy sees it: see fence_proxy_async). A thread
// that ends with reductions not waited for throws (the block's shared memory goes away).
void bulk_reduce_add_f32(float* dst, const void* src, std::uint32_t bytes);
void bulk_commit();
// Retires all but the newest `pending` committed bulk groups of this thread (wait_group and
// wait_group.read alike).
void bulk_wait(int pending);
// bar.sync / bar.arrive on named barrier id (1..15) of `threads` threads.
void named_barrier_sync(int id, int threads);
void named_barrier_arrive(int id, int threads);

// What the kernels' launch checks read.
cudaError_t get_last_error();
cudaError_t func_set_attribute(cudaFuncAttribute attr, int value);
cudaError_t get_device(int* device);
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int device);

}  // namespace dtrain_emu

// ---- what device code sees -----------------------------------------------------------------
// Function qualifiers vanish; a __shared__ variable is a static local, which all fibers
// of the running block share (blocks run one at a time).
#undef __device__
#undef __global__
#undef __host__
#undef __shared__
#undef __grid_constant__
#define __device__
#define __global__
#define __host__
#define __shared__ static
#define threadIdx (::dtrain_emu::thread_idx)
#define blockIdx (::dtrain_emu::block_idx)
#define blockDim (::dtrain_emu::block_dim)
#define gridDim (::dtrain_emu::grid_dim)
#define __syncthreads() ::dtrain_emu::sync_threads()
#define __syncwarp(...) ::dtrain_emu::sync_warp()
#define __launch_bounds__(...)
#define __grid_constant__
#define cudaGetLastError ::dtrain_emu::get_last_error
#define cudaFuncSetAttribute(kernel, attr, value) ::dtrain_emu::func_set_attribute(attr, value)
#define cudaGetDevice ::dtrain_emu::get_device
#define cudaDeviceGetAttribute ::dtrain_emu::device_get_attribute
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, ...) (*(blocks) = 2, cudaSuccess)

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  T out;
  ::dtrain_emu::warp_exchange(&v, &out, ::dtrain_emu::lane() ^ mask, sizeof(T));
  return out;
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) {
  T out;
  ::dtrain_emu::warp_exchange(&v, &out, src, sizeof(T));
  return out;
}
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
using std::isfinite;
// Fibers switch only at barriers, so plain read-modify-writes are atomic here.
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline int atomicMax(int* p, int v) {
  const int old = *p;
  *p = old > v ? old : v;
  return old;
}
#define cudaMemsetAsync(ptr, value, bytes, stream) (std::memset((ptr), (value), (bytes)), cudaSuccess)
