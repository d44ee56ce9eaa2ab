// Flash attention forward on Hopper's warpgroup MMA (sm_90a): FlashAttention-2's loop
// order with wgmma in place of mma.sync. A block of two warpgroups owns 128 query rows
// (64 per warpgroup) of one (batch, head) and walks key/value tiles of 128 keys. Q, K and
// V sit in shared memory in wgmma's blocked no-swizzle layout (load_blocked_async, by
// cp.async; K and V double-buffered); S = Q K^T is one m64n128 wgmma chain per warpgroup
// with both operands read by descriptor, the mask and online softmax are the mma.sync
// kernel's (flash_fwd_tile.cuh: the accumulator layouts agree), and O += P V takes P from
// registers and V by an MN-major descriptor. The softmax of the next tile overlaps the
// P V of this one. The warpgroups run in lockstep (no producer warp, no ping-pong between
// them yet).
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
  // Q, then two K and two V buffers (key tile n in buffer n % 2).
  static constexpr size_t kSmemElements = static_cast<size_t>(kBlockM + 4 * kBlockN) * D;
};

template <typename T, int D>
__global__ void __launch_bounds__(FlashSm90Config<D>::kThreads, 1)
    flash_fwd_sm90_kernel(dtrain_attention_fwd_params p) {
#if DTRAIN_HAVE_WGMMA
  using C = FlashSm90Config<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, kThreads = C::kThreads;
  DTRAIN_DYNAMIC_SMEM(T, smem);
  T* qs = smem;
  // Key tile n's K and V buffers (pointer arithmetic: an array of two would sit in local
  // memory, indexed at run time).
  auto kbuf = [&](int n) { return qs + (BM + (n % 2) * BN) * D; };
  auto vbuf = [&](int n) { return qs + (BM + (2 + n % 2) * BN) * D; };

  const FwdBlock<T, BM, BN> blk(p);
  const int64_t b = blk.b, h = blk.h, m0 = blk.m0;
  const T *q = blk.q, *k = blk.k, *v = blk.v;
  const int n_tiles = blk.n_tiles;
  const int group = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, g = threadIdx.x % 32 / 4;
  const int64_t row0 = m0 + group * 64 + warp * 16 + g;  // this thread's first row (mask_scores)
  // Key tile n into its buffer; past the last tile an empty group, so that every thread's
  // cp.async group count stays the same.
  auto load_k = [&](int n) {
    if (n < n_tiles) {
      load_blocked_async<BN, D, kThreads>(kbuf(n), k + int64_t{n} * BN * p.k_stride.seq, p.k_stride.seq,
                                          p.seq_k - int64_t{n} * BN);
    }
    cp_async_commit();
  };
  auto load_v = [&](int n) {
    if (n < n_tiles) {
      load_blocked_async<BN, D, kThreads>(vbuf(n), v + int64_t{n} * BN * p.v_stride.seq, p.v_stride.seq,
                                          p.seq_k - int64_t{n} * BN);
    }
    cp_async_commit();
  };
  const float scale_log2 = p.scale * kLog2e;
  const uint64_t q_desc = kmajor_desc<D>(qs + group * 64 * D);  // this warpgroup's 64 rows
  // S = Q K_n^T, 64 x 128 per warpgroup (unscaled), issued and committed as one group.
  auto issue_s = [&](float (&s)[BN / 8][4], int n) {
    const uint64_t k_desc = kmajor_desc<D>(kbuf(n));
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_ss<T, BN>(s, desc_advance(q_desc, kk * 256), desc_advance(k_desc, kk * 256), kk);
    }
    wgmma_commit();
  };
  // The mask (only tiles past the end of the keys or across the causal diagonal) and the
  // softmax of tile n: s becomes P, alpha the rescale of what O holds so far.
  auto softmax_tile = [&](float (&s)[1][BN / 8][4], int n, float (&row_max)[1][2], float (&row_sum)[1][2],
                          float (&alpha)[1][2]) {
    const int64_t n0 = int64_t{n} * BN;
    if (n0 + BN > p.seq_k || (p.causal && n0 + BN - 1 > m0)) mask_scores(s, row0, n0, p.seq_k, p.causal);
    softmax_step(s, row_max, row_sum, scale_log2, alpha);
  };
  // P as A fragments: accumulator chunks 2 kk and 2 kk + 1 are the 16 x 16 A tile kk.
  auto pack_p = [&](uint32_t (&pf)[BN / 16][4], const float (&s)[1][BN / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pf[kk][0] = pack2<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
      pf[kk][1] = pack2<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
      pf[kk][2] = pack2<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
      pf[kk][3] = pack2<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
    }
  };

  // Prologue: Q with K_0, K_1, V_0 in flight; S_0 and its softmax; then K_2 and V_1.
  load_blocked_async<BM, D, kThreads>(qs, q, p.q_stride.seq, p.seq_q - m0);
  load_k(0);
  load_k(1);
  load_v(0);
  float acc[1][D / 8][4];
  zero_tiles(acc);
  float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}}, alpha[1][2];
  uint32_t pf[BN / 16][4];
  {
    cp_async_wait<2>();  // Q and K_0
    fence_async_shared();
    __syncthreads();
    float s[1][BN / 8][4];
    wgmma_fence();
    issue_s(s[0], 0);
    wgmma_wait<0>();
    wgmma_fence_regs(s[0]);
    softmax_tile(s, 0, row_max, row_sum, alpha);  // alpha is 0 or 1 here: O is still zero
    pack_p(pf, s);
  }
  __syncthreads();  // both warpgroups are done with K_0
  load_k(2);
  load_v(1);

  // Tile j: S_{j+1} = Q K_{j+1}^T and O += P_j V_j go out together; the softmax of S_{j+1}
  // runs while P_j V_j is still in flight (FlashAttention-3's overlap within a
  // warpgroup), and O is rescaled once that is done. The loads run two tiles ahead for K
  // and one for V: at the top of tile j, V_j and K_{j+1} must have landed, K_{j+2} and
  // V_{j+1} may still be in flight.
  auto issue_pv = [&](int n) {
    const uint64_t v_desc = mnmajor_desc<D>(vbuf(n));
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs_mn<T, D>(acc[0], pf[kk], desc_advance(v_desc, kk * 2 * D * 16));
    wgmma_commit();
  };
  auto tile_loaded = [] {
    cp_async_wait<2>();
    fence_async_shared();
    __syncthreads();
  };
  for (int j = 0; j + 1 < n_tiles; ++j) {
    tile_loaded();
    float s[1][BN / 8][4];
    wgmma_fence_regs(acc[0]);
    wgmma_fence();
    issue_s(s[0], j + 1);
    issue_pv(j);
    wgmma_wait<1>();  // S_{j+1}; P_j V_j may still run
    wgmma_fence_regs(s[0]);
    softmax_tile(s, j + 1, row_max, row_sum, alpha);
    wgmma_wait<0>();
    wgmma_fence_regs(acc[0]);
    wgmma_fence_regs(pf);  // P_j's registers stay untouched until the wait
    rescale(acc, alpha);
    pack_p(pf, s);
    __syncthreads();  // both warpgroups are done with K_{j+1} and V_j
    load_k(j + 3);
    load_v(j + 2);
  }
  if (n_tiles > 0) {  // the last tile: P V only
    tile_loaded();
    wgmma_fence_regs(acc[0]);
    wgmma_fence();
    issue_pv(n_tiles - 1);
    wgmma_wait<0>();
    wgmma_fence_regs(acc[0]);
    wgmma_fence_regs(pf);
  }
  cp_async_wait<0>();  // nothing may stay in flight

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
