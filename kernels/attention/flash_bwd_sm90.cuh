// Flash attention backward on Hopper's warpgroup MMA (sm_90a): the mma.sync backward's
// loop (flash_bwd.cuh) with its 4 warps as one warpgroup and wgmma for its five products.
// A block owns 64 keys of one (batch, kv head) and walks every query tile of 64 of every
// query head that reads this kv head. K, V, Q, dO and dS sit in shared memory in wgmma's
// blocked layout, so one tile serves as a K-major operand and as an MN-major one:
// S^T = K Q^T and dP^T = V dO^T (both by descriptor, issued together), dV += P^T dO and
// dK += dS^T Q (P^T and dS^T from registers; dO and Q MN-major), dQ += dS K (dS from
// shared memory, K MN-major) in chunks of 64 columns added to the float32 buffer with
// atomics, while dV and dK are still on the tensor cores.
#pragma once

#include "attention/flash_bwd.cuh"
#include "wgmma.cuh"

namespace dtrain_kernels {

template <int D>
struct FlashBwdSm90Config {
  static constexpr int kThreads = 128;  // one warpgroup
  static constexpr int kBlockN = 64;    // keys
  static constexpr int kBlockM = 64;    // queries per tile
  static constexpr size_t kSmemBytes =
      2 * (static_cast<size_t>(2 * kBlockN + 2 * kBlockM) * D + static_cast<size_t>(kBlockM) * kBlockN) +
      sizeof(float) * 2 * kBlockM;
};

template <typename T, int D>
__global__ void __launch_bounds__(FlashBwdSm90Config<D>::kThreads, 1)
    flash_bwd_sm90_kernel(dtrain_attention_bwd_params p, float* dq_accum, const float* delta) {
#if DTRAIN_HAVE_WGMMA
  using C = FlashBwdSm90Config<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, kThreads = C::kThreads;
  DTRAIN_DYNAMIC_SMEM(T, smem);
  T* ks = smem;
  T* vs = ks + BN * D;
  T* qs = vs + BN * D;
  T* dos = qs + BM * D;
  T* dss = dos + BM * D;  // dS as [query][key], blocked
  float* lse_s = reinterpret_cast<float*>(dss + BM * BN);
  float* delta_s = lse_s + BM;

  const int64_t b = blockIdx.z, hk = blockIdx.y, n0 = int64_t{blockIdx.x} * BN;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int64_t key0 = n0 + warp * 16 + g, key1 = key0 + 8;  // keys of c0,c1 and of c2,c3
  const float scale_log2 = p.scale * kLog2e;

  load_blocked_async<BN, D, kThreads>(ks, static_cast<const T*>(p.k) + b * p.k_stride.batch + hk * p.k_stride.head +
                                              n0 * p.k_stride.seq,
                                      p.k_stride.seq, p.seq_k - n0);
  load_blocked_async<BN, D, kThreads>(vs, static_cast<const T*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head +
                                              n0 * p.v_stride.seq,
                                      p.v_stride.seq, p.seq_k - n0);
  cp_async_commit();
  const uint64_t k_desc = kmajor_desc<D>(ks), v_desc = kmajor_desc<D>(vs), k_mn_desc = mnmajor_desc<D>(ks);
  const uint64_t q_desc = kmajor_desc<D>(qs), q_mn_desc = mnmajor_desc<D>(qs);
  const uint64_t do_desc = kmajor_desc<D>(dos), do_mn_desc = mnmajor_desc<D>(dos);
  const uint64_t ds_desc = kmajor_desc<BN>(dss);

  float dk_tiles[1][D / 8][4], dv_tiles[1][D / 8][4];
  zero_tiles(dk_tiles);
  zero_tiles(dv_tiles);
  auto& dk = dk_tiles[0];
  auto& dv = dv_tiles[0];
  // Causal: query tiles wholly before the first key see none of them.
  const int64_t m_begin = p.causal ? n0 / BM * BM : 0;

  for (int hh = 0; hh < group; ++hh) {
    const int64_t h = hk * group + hh;
    const T* q = static_cast<const T*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head;
    const int64_t stat = (b * p.heads + h) * p.seq_q;  // row of (b, h, query 0) in lse / delta / dq
    for (int64_t m0 = m_begin; m0 < p.seq_q; m0 += BM) {
      __syncthreads();  // the previous tile's shared memory is no longer read
      load_blocked_async<BM, D, kThreads>(qs, q + m0 * p.q_stride.seq, p.q_stride.seq, p.seq_q - m0);
      load_blocked_async<BM, D, kThreads>(dos, dout + m0 * p.dout_stride.seq, p.dout_stride.seq, p.seq_q - m0);
      cp_async_commit();
      stage_row_stats<BM, kThreads>(lse_s, delta_s, p, delta, stat, m0);
      cp_async_wait<0>();
      fence_async_shared();
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T: 64 keys x 64 queries each.
      float st_tiles[1][BM / 8][4], dpt_tiles[1][BM / 8][4];
      auto& st = st_tiles[0];
      auto& dpt = dpt_tiles[0];
      wgmma_fence_regs(dk);
      wgmma_fence_regs(dv);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wgmma_ss<T, BM>(st, desc_advance(k_desc, kk * 256), desc_advance(q_desc, kk * 256), kk);
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wgmma_ss<T, BM>(dpt, desc_advance(v_desc, kk * 256), desc_advance(do_desc, kk * 256), kk);
      }
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_regs(st);
      wgmma_fence_regs(dpt);
      if (n0 + BN > p.seq_k || (p.causal && n0 + BN - 1 > m0)) mask_scores_t(st, key0, key1, m0, p);
      probabilities_t(st, lse_s, scale_log2);
      // dS^T = P^T (dP^T - delta), into registers (A fragments) and shared memory as dS.
      uint32_t pf[BM / 16][4], dsf[BM / 16][4];
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * 8 + 2 * t + (e & 1);
          dpt[nt][e] = st[nt][e] * (dpt[nt][e] - delta_s[qi]);
          dss[blocked_offset<BN>(qi, warp * 16 + g + (e < 2 ? 0 : 8))] = from_float<T>(dpt[nt][e]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        pf[kk][0] = pack2<T>(st[2 * kk][0], st[2 * kk][1]);
        pf[kk][1] = pack2<T>(st[2 * kk][2], st[2 * kk][3]);
        pf[kk][2] = pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]);
        pf[kk][3] = pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3]);
        dsf[kk][0] = pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]);
        dsf[kk][1] = pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]);
        dsf[kk][2] = pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
        dsf[kk][3] = pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
      }
      fence_async_shared();  // dS, written by plain stores, is read by wgmma next
      // dV += P^T dO and dK += dS^T Q (the softmax scale is applied at the end): 16
      // queries (two 8-row core-matrix groups of dO or Q) per step.
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_mn<T, D>(dv, pf[kk], desc_advance(do_mn_desc, kk * 2 * D * 16));
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_mn<T, D>(dk, dsf[kk], desc_advance(q_mn_desc, kk * 2 * D * 16));
      wgmma_commit();
      __syncthreads();  // dS complete
      // dQ += scale dS K, 64 columns at a time: warp w adds query rows [16 w, 16 w + 16).
      const int64_t qrow0 = m0 + warp * 16 + g;
#pragma unroll
      for (int c0 = 0; c0 < D; c0 += 64) {
        float dq[8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          // K's columns c0.. are core-matrix chunks c0 / 8.., 128 bytes apart.
          wgmma_ss_mn<T, 64>(dq, desc_advance(ds_desc, kk * 256),
                             desc_advance(k_mn_desc, c0 / 8 * 128 + kk * 2 * D * 16), kk);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(dq);
#pragma unroll
        for (int i = 0; i < 8; ++i) add_dq<D>(dq_accum, p, stat, qrow0, c0 + i * 8 + 2 * t, dq[i]);
      }
      wgmma_fence_regs(dk);
      wgmma_fence_regs(dv);
      wgmma_fence_regs(pf);  // P^T and dS^T stay untouched until the wait
      wgmma_fence_regs(dsf);
    }
  }
  cp_async_wait<0>();  // an empty loop leaves the K, V loads in flight

  store_dk_dv<T, D>(p, b, hk, key0, key1, dk, dv);
#else
  __trap();  // built without sm_90a: the launcher never starts this kernel
#endif
}

template <typename T, int D>
cudaError_t run_flash_bwd_sm90(const dtrain_attention_bwd_params& p, cudaStream_t stream) {
  using C = FlashBwdSm90Config<D>;
  return run_bwd_passes<T, D>(p, stream, [&](float* dq_accum, const float* delta) {
    auto* kernel = flash_bwd_sm90_kernel<T, D>;
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmemBytes));
    if (e != cudaSuccess) return e;
    const dim3 grid(static_cast<unsigned>((p.seq_k + C::kBlockN - 1) / C::kBlockN), static_cast<unsigned>(p.kv_heads),
                    static_cast<unsigned>(p.batch));
    DTRAIN_LAUNCH(kernel, grid, C::kThreads, C::kSmemBytes, stream, p, dq_accum, delta);
    return launched();
  });
}

}  // namespace dtrain_kernels
