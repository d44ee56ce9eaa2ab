// Flash attention forward (FlashAttention-2's loop order) on mma.sync: a block owns 128
// query rows (4 warps of two 16-row tiles, so that every K or V fragment read from shared
// memory feeds two MMAs; at D 256, 8 warps of one) of one (batch, head) and walks the
// key/value tiles of 64 keys (32 in the compact tiles of 99 KB devices: flash.cuh).
// Q, K and V fragments come from shared memory by ldmatrix (V transposed); at head dim 64
// Q's stay in registers after the first tile.
// S = Q K^T goes to registers, is masked (only tiles that cross the diagonal or the end of
// the keys), folded into the running row max and sum with the scale in one FFMA (log2
// domain), and reused as P in registers (the accumulator layout of two 16 x 8 tiles is the
// A layout of one 16 x 16) for O += P V. K and V arrive by cp.async: the next K tile loads
// during softmax and P V, the next V tile during the next Q K^T. Causal grids start with
// the last query blocks, which have the most key tiles, so that the short ones fill the tail.
#pragma once

#include "attention/flash_fwd_tile.cuh"

namespace dtrain_kernels {

// kDropout: attention dropout on P before P V (an instance of its own: the hash's
// registers, branched around in one instance, made the D 64 and D 128 forwards spill).
template <typename T, int D, bool kCompact, bool kDropout>
__global__ void __launch_bounds__(FlashConfig<D, kCompact>::kFwdThreads)
    flash_fwd_kernel(dtrain_attention_fwd_params p) {
  using C = FlashConfig<D, kCompact>;
  constexpr int BM = C::kFwdBlockM, BN = C::kFwdBlockN, P = C::kPitch, kThreads = C::kFwdThreads;
  constexpr int kM = C::kFwdRowTiles;  // 16-row tiles per warp
  // At head dim 64 Q's fragments fit in registers for the whole kernel (32 of them); at
  // 128 the accumulators leave no room and Q is read from shared memory every key tile.
  constexpr bool kQInRegs = D <= 64;
  DTRAIN_DYNAMIC_SMEM(T, smem);
  T* qs = smem;
  T* ks = qs + BM * P;
  T* vs = ks + BN * P;

  const FwdBlock<T, BM, BN, false> blk(p);
  const int64_t b = blk.b, h = blk.h, m0 = blk.m0;
  const T *q = blk.q, *k = blk.k, *v = blk.v;
  // The key tiles [k_first, k_end) in steps of BN (k_first > 0: a sliding window's or a document's first).
  const int64_t k_first = int64_t{blk.n_begin} * BN, k_end = k_first + int64_t{blk.n_tiles} * BN;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const int64_t warp_row0 = m0 + warp * 16 * kM + g;  // this thread's first row (mask_scores)

  load_tile_async<BM, D, kThreads>(qs, P, q, p.q_stride.seq, p.seq_q - m0, p.head_dim);
  load_tile_async<BN, D, kThreads>(ks, P, k + k_first * p.k_stride.seq, p.k_stride.seq, p.seq_k - k_first,
                                   p.head_dim);
  cp_async_commit();
  load_tile_async<BN, D, kThreads>(vs, P, v + k_first * p.v_stride.seq, p.v_stride.seq, p.seq_k - k_first,
                                   p.head_dim);
  cp_async_commit();

  float acc[kM][D / 8][4];
  zero_tiles(acc);
  float row_max[kM][2], row_sum[kM][2];
  init_row_stats(p, h, row_max, row_sum);
  const float scale_log2 = p.scale * kLog2e;
  uint32_t qf[kQInRegs ? D / 16 : 1][kM][4];

  for (int64_t n0 = k_first; n0 < k_end; n0 += BN) {
    const bool more = n0 + BN < k_end;
    cp_async_wait<1>();  // Q and K_j
    __syncthreads();
    // S = Q K_j^T: 16 kM x 64 per warp (unscaled).
    float s[kM][BN / 8][4];
    zero_tiles(s);
    if constexpr (kQInRegs) {
      if (n0 == k_first) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
          for (int m = 0; m < kM; ++m) load_a(qf[kk][m], qs + (warp * kM + m) * 16 * P + kk * 16, P);
        }
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) mma_frag_rows<T, kM, BN / 8>(s, qf[kk], ks + kk * 16, P);
    } else {
      mma_rows_rows<T, kM, D, BN / 8>(s, qs + warp * 16 * kM * P, P, ks, P);
    }
    __syncthreads();  // every warp is done with K_j
    if (more) {
      load_tile_async<BN, D, kThreads>(ks, P, k + (n0 + BN) * p.k_stride.seq, p.k_stride.seq, p.seq_k - n0 - BN,
                                       p.head_dim);
      cp_async_commit();
    }
    if (p.softcap > 0.f) {
#pragma unroll
      for (int m = 0; m < kM; ++m) softcap_scores(s[m], p.scale, p.softcap);
    }
    mask_tile<BM, BN>(s, p, b, m0, warp_row0, n0);
    online_softmax(s, acc, row_max, row_sum, scale_log2);
    if constexpr (kDropout) dropout_probabilities(s, p, b, h, warp_row0 + p.query_offset, n0);
    if (more) {
      cp_async_wait<1>();  // V_j (K_{j+1} may still be in flight)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // O += P V_j.
    mma_acc_cols<T, kM, BN, D / 8>(acc, s, vs, P);
    __syncthreads();  // every warp is done with V_j
    if (more) {
      load_tile_async<BN, D, kThreads>(vs, P, v + (n0 + BN) * p.v_stride.seq, p.v_stride.seq, p.seq_k - n0 - BN,
                                       p.head_dim);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();  // nothing may stay in flight

  store_output<T>(p, b, h, warp_row0, acc, row_max, row_sum);
}

template <typename T, int D, bool kCompact>
constexpr size_t fwd_smem_bytes() {  // Q, K and V tiles
  using C = FlashConfig<D, kCompact>;
  return sizeof(T) * static_cast<size_t>(C::kFwdBlockM + 2 * C::kFwdBlockN) * C::kPitch;
}
// Whether this device gets the compact tiles: D 256 where the default ones do not fit.
template <typename T, int D>
bool fwd_compact() {
  return D > 128 && device_block_smem() < fwd_smem_bytes<T, D, false>();
}

template <typename T, int D>
size_t flash_fwd_smem_bytes() {
  return fwd_compact<T, D>() ? fwd_smem_bytes<T, D, (D > 128)>() : fwd_smem_bytes<T, D, false>();
}

template <typename T, int D>
cudaError_t run_flash_fwd(const dtrain_attention_fwd_params& p, cudaStream_t stream) {
  auto launch = [&](auto compact) {
    constexpr bool kCompact = decltype(compact)::value;
    using C = FlashConfig<D, kCompact>;
    auto* kernel = p.dropout_p > 0.f ? flash_fwd_kernel<T, D, kCompact, true> : flash_fwd_kernel<T, D, kCompact, false>;
    return launch_fwd<C::kFwdBlockM>(kernel, p, C::kFwdThreads, fwd_smem_bytes<T, D, kCompact>(), stream);
  };
  if constexpr (D > 128) {
    if (fwd_compact<T, D>()) return launch(std::true_type{});
  }
  return launch(std::false_type{});
}

}  // namespace dtrain_kernels
