// Flash attention forward on Hopper's warpgroup MMA (sm_90a): FlashAttention-2's loop
// order with wgmma in place of mma.sync. A block of two warpgroups owns 128 query rows
// (64 per warpgroup) of one (batch, head) and walks key/value tiles of 128 keys. Q, K and
// V sit in shared memory in wgmma's blocked no-swizzle layout (load_blocked_async, by
// cp.async); S = Q K^T is one m64n128 wgmma chain per warpgroup with both operands read
// by descriptor, the mask and online softmax are the mma.sync kernel's (flash_fwd_tile.cuh:
// the accumulator layouts agree), and O += P V takes P from registers and V by an
// MN-major descriptor. The next K tile loads during softmax and P V, the next V tile
// during the next Q K^T, as in the mma.sync kernel; the warpgroups run in lockstep
// (no producer warp, no ping-pong between them yet).
#pragma once

#include "attention/flash_fwd_tile.cuh"
#include "wgmma.cuh"

namespace dtrain_kernels {

template <int D>
struct FlashSm90Config {
  static constexpr int kWarpGroups = 2;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kBlockM = 64 * kWarpGroups;
  static constexpr int kBlockN = 128;
  static constexpr size_t kSmemElements = static_cast<size_t>(kBlockM + 2 * kBlockN) * D;
};

template <typename T, int D>
__global__ void __launch_bounds__(FlashSm90Config<D>::kThreads, 1)
    flash_fwd_sm90_kernel(dtrain_attention_fwd_params p) {
#if DTRAIN_HAVE_WGMMA
  using C = FlashSm90Config<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, kThreads = C::kThreads;
  DTRAIN_DYNAMIC_SMEM(T, smem);
  T* qs = smem;
  T* ks = qs + BM * D;
  T* vs = ks + BN * D;

  const FwdBlock<T, BM, BN> blk(p);
  const int64_t b = blk.b, h = blk.h, m0 = blk.m0;
  const T *q = blk.q, *k = blk.k, *v = blk.v;
  const int n_tiles = blk.n_tiles;
  const int group = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, g = threadIdx.x % 32 / 4;
  const int64_t row0 = m0 + group * 64 + warp * 16 + g;  // this thread's first row (mask_scores)

  load_blocked_async<BM, D, kThreads>(qs, q, p.q_stride.seq, p.seq_q - m0);
  load_blocked_async<BN, D, kThreads>(ks, k, p.k_stride.seq, p.seq_k);
  cp_async_commit();
  load_blocked_async<BN, D, kThreads>(vs, v, p.v_stride.seq, p.seq_k);
  cp_async_commit();

  float acc[1][D / 8][4];
  zero_tiles(acc);
  float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
  const float scale_log2 = p.scale * kLog2e;
  const uint64_t q_desc = kmajor_desc<D>(qs + group * 64 * D);  // this warpgroup's 64 rows
  const uint64_t k_desc = kmajor_desc<D>(ks), v_desc = mnmajor_desc<D>(vs);

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<1>();  // Q and K_j
    fence_async_shared();
    __syncthreads();
    // S = Q K_j^T: 64 x 128 per warpgroup (unscaled).
    float s[1][BN / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_ss<T, BN>(s[0], desc_advance(q_desc, kk * 256), desc_advance(k_desc, kk * 256), kk);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(s[0]);
    __syncthreads();  // both warpgroups are done with K_j
    const int64_t n0 = int64_t{j} * BN;
    if (j + 1 < n_tiles) {
      load_blocked_async<BN, D, kThreads>(ks, k + (n0 + BN) * p.k_stride.seq, p.k_stride.seq, p.seq_k - n0 - BN);
      cp_async_commit();
    }
    if (n0 + BN > p.seq_k || (p.causal && n0 + BN - 1 > m0)) mask_scores(s, row0, n0, p.seq_k, p.causal);
    online_softmax(s, acc, row_max, row_sum, scale_log2);
    // P as A fragments: chunks 2 kk and 2 kk + 1 of the accumulators are the 16 x 16 A tile kk.
    uint32_t pf[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pf[kk][0] = pack2<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
      pf[kk][1] = pack2<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
      pf[kk][2] = pack2<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
      pf[kk][3] = pack2<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
    }
    if (j + 1 < n_tiles) {
      cp_async_wait<1>();  // V_j (K_{j+1} may still be in flight)
    } else {
      cp_async_wait<0>();
    }
    fence_async_shared();
    __syncthreads();
    // O += P V_j: 16 keys (two 8-row core-matrix groups of V) per step.
    wgmma_fence_regs(acc[0]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs_mn<T, D>(acc[0], pf[kk], desc_advance(v_desc, kk * 2 * D * 16));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(acc[0]);
    wgmma_fence_regs(pf);  // P's registers stay untouched until the wait
    __syncthreads();  // both warpgroups are done with V_j
    if (j + 1 < n_tiles) {
      load_blocked_async<BN, D, kThreads>(vs, v + (n0 + BN) * p.v_stride.seq, p.v_stride.seq, p.seq_k - n0 - BN);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();  // nothing may stay in flight (n_tiles == 0 leaves Q, K, V loads)

  store_output<T>(p, b, h, row0, acc, row_max, row_sum);
#else
  __trap();  // built without sm_90a: the launcher never starts this kernel
#endif
}

template <typename T, int D>
cudaError_t run_flash_fwd_sm90(const dtrain_attention_fwd_params& p, cudaStream_t stream) {
  using C = FlashSm90Config<D>;
  return launch_fwd<C::kBlockM>(flash_fwd_sm90_kernel<T, D>, p, C::kThreads, sizeof(T) * C::kSmemElements, stream);
}

}  // namespace dtrain_kernels
