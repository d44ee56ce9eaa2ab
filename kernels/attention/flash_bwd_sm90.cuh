// Flash attention backward on Hopper (sm_90a), FlashAttention-3's structure: a block of
// three warpgroups owns 128 keys of one (batch, kv head) and walks every query tile of 64
// of every query head that reads this kv head (GQA sums its heads in registers).
// Warpgroup 0 produces: one thread loads K and V once and each tile's Q and dO into a ring
// of stages by bulk tensor copies (TMA, 128-byte swizzle), one warp stages the tile's
// log-sum-exp and delta; it gives its registers to the consumers (setmaxnreg). Warpgroups
// 1 and 2 own 64 keys each: S^T = K Q^T and dP^T = V dO^T by wgmma with both operands by
// swizzled descriptor, P^T and dS^T = P^T (dP^T - delta) in registers, dV += P^T dO and
// dK += dS^T Q with P^T and dS^T as register operands, then dQ = dS K (dS through shared
// memory) 64 columns at a time into a float32 staging tile, whose rows each warp adds to
// the dQ buffer by bulk reductions (cp.reduce.async.bulk .add.f32): no per-element atomics.
#pragma once

#include "attention/flash_bwd.cuh"
#include "tma.cuh"

namespace dtrain_kernels {

template <int D>
struct FlashBwdSm90Config {
  static constexpr int kConsumers = 2;  // warpgroups of 64 keys
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBlockN = 64 * kConsumers;  // keys per block
  static constexpr int kBlockM = 64;               // queries per tile
  static constexpr int kStages = D == 64 ? 3 : 2;  // Q / dO ring
  static constexpr int kBox = kSwizzleBox;         // columns per copy
  // Floats per staged dQ row. The stores are 8 bytes a lane, so a half-warp (rows g 0..3,
  // column pairs t 0..3) must hit 16 distinct bank pairs: rows 32 bytes apart in the banks
  // (D + 8). D + 4 put rows g and g + 1 one pair-step apart, a 2-way conflict on every
  // store (14% of the kernel's shared-memory wavefronts on the H200, Nsight Compute).
  static constexpr int kDqPitch = D + 8;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // 16-bit tiles, each [D / 64][rows][64]: K and V (kBlockN rows), kStages Q and dO tiles
  // (kBlockM rows), then per consumer dS [kBlockM][64] in the blocked layout; then float32:
  // per consumer the staged dQ [kBlockM][kDqPitch], per stage the log-sum-exp and delta
  // [2][kBlockM]; then the mbarriers (K/V full; per stage full, empty); 1024 bytes of slack
  // to align the tiles to the swizzle's 1024-byte atoms.
  static constexpr size_t kKvElements = static_cast<size_t>(kBlockN) * D;
  static constexpr size_t kTileElements = static_cast<size_t>(kBlockM) * D;
  static constexpr size_t kDsElements = static_cast<size_t>(kBlockM) * 64;
  static constexpr size_t kHalfElements = 2 * kKvElements + 2 * kStages * kTileElements + kConsumers * kDsElements;
  static constexpr size_t kFloats = static_cast<size_t>(kConsumers) * kBlockM * kDqPitch + 2 * kStages * kBlockM;
  static constexpr size_t kSmemBytes = 1024 + 2 * kHalfElements + 4 * kFloats + 8 * (1 + 2 * kStages);
};

template <typename T, int D>
__global__ void __launch_bounds__(FlashBwdSm90Config<D>::kThreads, 1)
    flash_bwd_sm90_kernel(dtrain_attention_bwd_params p, float* dq_accum, const float* delta,
                          const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do) {
#if DTRAIN_HAVE_WGMMA
  using C = FlashBwdSm90Config<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages, kBox = C::kBox, kPitch = C::kDqPitch;
  DTRAIN_DYNAMIC_SMEM(unsigned char, raw);
  T* ks = reinterpret_cast<T*>(raw + (1024 - shared_address(raw) % 1024) % 1024);
  T* vs = ks + C::kKvElements;
  // Stage st's Q and dO tiles (pointer arithmetic: an array would sit in local memory).
  auto qbuf = [&](int st) { return vs + C::kKvElements + st * C::kTileElements; };
  auto dobuf = [&](int st) { return vs + C::kKvElements + (S + st) * C::kTileElements; };
  T* ds_all = vs + C::kKvElements + 2 * S * C::kTileElements;
  float* dq_all = reinterpret_cast<float*>(ds_all + C::kConsumers * C::kDsElements);
  float* stats = dq_all + C::kConsumers * BM * kPitch;  // stage st: log-sum-exp at st 2 BM, delta after
  uint64_t* bars = reinterpret_cast<uint64_t*>(stats + 2 * S * BM);
  uint64_t *kv_full = bars, *full = bars + 1, *empty = bars + 1 + S;

  const BwdBlock blk = bwd_block<T, BN, true>(p);
  const int64_t b = blk.b, hk = blk.hk, n0 = blk.n0;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  // Causal: query tiles wholly before the block's first key see none of its keys.
  const int64_t m_begin = p.causal ? n0 / BM * BM : 0;
  const int per_head = m_begin < p.seq_q ? static_cast<int>((p.seq_q - m_begin + BM - 1) / BM) : 0;
  const int n_tiles = group * per_head;  // tile i: head hk group + i / per_head, queries m0(i)..
  auto m0_of = [&](int i) { return m_begin + int64_t{i % per_head} * BM; };
  auto head_of = [&](int i) { return hk * group + i / per_head; };
  const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 1);
    for (int st = 0; st < S; ++st) {
      mbarrier_init(full + st, 1 + 32);  // the copies' thread, and the stats warp
      mbarrier_init(empty + st, 128 * C::kConsumers);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the only block barrier: from here on the warpgroups go their own ways

  if (wg == 0) {  // the producer
    setmaxnreg_dec<C::kProducerRegs>();
    if (n_tiles == 0 || warp > 1) return;
    if (warp == 0) {
      if (lane != 0) return;
      mbarrier_arrive_expect_tx(kv_full, 2 * BN * D * 2);
#pragma unroll
      for (int c = 0; c < D / kBox; ++c) {
        tma_load_4d(ks + c * BN * kBox, &tm_k, c * kBox, static_cast<int>(n0), static_cast<int>(hk),
                    static_cast<int>(b), kv_full);
        tma_load_4d(vs + c * BN * kBox, &tm_v, c * kBox, static_cast<int>(n0), static_cast<int>(hk),
                    static_cast<int>(b), kv_full);
      }
      // Tile i into stage i % S once both consumers have released that stage's previous
      // tile (phase parity flips every S tiles; a fresh barrier passes parity 1 at once).
      for (int i = 0; i < n_tiles; ++i) {
        const int st = i % S, m0 = static_cast<int>(m0_of(i)), h = static_cast<int>(head_of(i));
        mbarrier_wait_or_trap(empty + st, ((i / S) & 1) ^ 1);
        mbarrier_arrive_expect_tx(full + st, 2 * BM * D * 2);
#pragma unroll
        for (int c = 0; c < D / kBox; ++c) {
          tma_load_4d(qbuf(st) + c * BM * kBox, &tm_q, c * kBox, m0, h, static_cast<int>(b), full + st);
          tma_load_4d(dobuf(st) + c * BM * kBox, &tm_do, c * kBox, m0, h, static_cast<int>(b), full + st);
        }
      }
      // Keep watch until the consumers release the last tile, so that a consumer stuck in
      // the pipeline traps too.
      const int last = n_tiles - 1;
      mbarrier_wait_or_trap(empty + last % S, (last / S) & 1);
    } else {  // warp 1: each tile's log-sum-exp and delta
      for (int i = 0; i < n_tiles; ++i) {
        const int st = i % S;
        mbarrier_wait(empty + st, ((i / S) & 1) ^ 1);
        const int64_t stat = (b * p.heads + head_of(i)) * p.seq_q;
        stage_row_stats<BM, 32>(stats + st * 2 * BM, stats + st * 2 * BM + BM, p, delta, stat, m0_of(i), lane);
        mbarrier_arrive(full + st);  // releases the stores to the consumers' wait
      }
    }
    return;
  }

  setmaxnreg_inc<C::kConsumerRegs>();
  const int cg = wg - 1, g = lane / 4, t = lane % 4;
  const int64_t kc0 = n0 + 64 * cg;  // this warpgroup's first key
  const int64_t key0 = kc0 + warp * 16 + g, key1 = key0 + 8;
  const float scale_log2 = p.scale * kLog2e;
  T* dss = ds_all + cg * C::kDsElements;     // dS [query][key] of this warpgroup's keys, blocked
  float* dqs = dq_all + cg * BM * kPitch;    // this warpgroup's staged dQ
  const int bar = 1 + cg;                    // its named barrier (128 threads)
  // Columns 16 kk .. 16 kk + 15 of a K-major swizzled tile of `rows` rows: box kk / 4, 32
  // bytes per 16 columns inside its rows. This warpgroup's K and V are rows 64 cg .. of
  // each box (8192 bytes on: whole 1024-byte swizzle atoms).
  auto k_step = [](int kk, int rows) { return static_cast<uint32_t>((kk / 4) * rows * 128 + (kk % 4) * 32); };
  const uint64_t k_desc = sw128_kmajor_desc(ks + 64 * cg * kBox), v_desc = sw128_kmajor_desc(vs + 64 * cg * kBox);
  const uint64_t ds_desc = kmajor_desc<64>(dss);

  float dk_tiles[1][D / 8][4], dv_tiles[1][D / 8][4];
  zero_tiles(dk_tiles);
  zero_tiles(dv_tiles);
  auto& dk = dk_tiles[0];
  auto& dv = dv_tiles[0];
  if (n_tiles > 0) mbarrier_wait(kv_full, 0);
  for (int i = 0; i < n_tiles; ++i) {
    const int st = i % S;
    const int64_t m0 = m0_of(i), stat = (b * p.heads + head_of(i)) * p.seq_q;
    mbarrier_wait(full + st, (i / S) & 1);
    const float* lse_s = stats + st * 2 * BM;
    const float* delta_s = lse_s + BM;
    const uint64_t q_desc = sw128_kmajor_desc(qbuf(st)), do_desc = sw128_kmajor_desc(dobuf(st));

    // S^T = K Q^T and dP^T = V dO^T: 64 keys x 64 queries each, issued together.
    float st_tiles[1][BM / 8][4], dpt_tiles[1][BM / 8][4];
    auto& s_t = st_tiles[0];
    auto& dp_t = dpt_tiles[0];
    wgmma_fence_regs(dk);
    wgmma_fence_regs(dv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_ss<T, BM>(s_t, desc_advance(k_desc, k_step(kk, BN)), desc_advance(q_desc, k_step(kk, BM)), kk);
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_ss<T, BM>(dp_t, desc_advance(v_desc, k_step(kk, BN)), desc_advance(do_desc, k_step(kk, BM)), kk);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(s_t);
    wgmma_fence_regs(dp_t);
    if (kc0 + 64 > p.seq_k || (p.causal && kc0 + 63 > m0)) mask_scores_t(s_t, key0, key1, m0, p);
    probabilities_t(s_t, lse_s, scale_log2);
    // dS^T = P^T (dP^T - delta), into registers (A fragments) and shared memory as dS. The
    // previous tile's dQ products, which read dS, have retired.
    uint32_t pf[BM / 16][4], dsf[BM / 16][4];
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * t + (e & 1);
        dp_t[nt][e] = s_t[nt][e] * (dp_t[nt][e] - delta_s[qi]);
        dss[blocked_offset<64>(qi, warp * 16 + g + (e < 2 ? 0 : 8))] = from_float<T>(dp_t[nt][e]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      pf[kk][0] = pack2<T>(s_t[2 * kk][0], s_t[2 * kk][1]);
      pf[kk][1] = pack2<T>(s_t[2 * kk][2], s_t[2 * kk][3]);
      pf[kk][2] = pack2<T>(s_t[2 * kk + 1][0], s_t[2 * kk + 1][1]);
      pf[kk][3] = pack2<T>(s_t[2 * kk + 1][2], s_t[2 * kk + 1][3]);
      dsf[kk][0] = pack2<T>(dp_t[2 * kk][0], dp_t[2 * kk][1]);
      dsf[kk][1] = pack2<T>(dp_t[2 * kk][2], dp_t[2 * kk][3]);
      dsf[kk][2] = pack2<T>(dp_t[2 * kk + 1][0], dp_t[2 * kk + 1][1]);
      dsf[kk][3] = pack2<T>(dp_t[2 * kk + 1][2], dp_t[2 * kk + 1][3]);
    }
    fence_async_shared();  // dS, written by plain stores, is read by wgmma next
    named_barrier_sync(bar, 128);
    // dV += P^T dO and dK += dS^T Q (the softmax scale is applied at the end): dO and Q
    // MN-major, 16 queries (two 8-row swizzle groups, 2048 bytes) per step, the second 64
    // columns one box (BM rows of 128 bytes) on.
    const uint64_t do_mn = sw128_mnmajor_desc(dobuf(st), BM * 128), q_mn = sw128_mnmajor_desc(qbuf(st), BM * 128);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_mn<T, D>(dv, pf[kk], desc_advance(do_mn, kk * 2048));
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_mn<T, D>(dk, dsf[kk], desc_advance(q_mn, kk * 2048));
    wgmma_commit();
    // dQ = scale dS K, 64 columns (one box of K) at a time, into the staging tile: warp w's
    // rows 16 w + g and + 8.
#pragma unroll
    for (int c0 = 0; c0 < D; c0 += 64) {
      const uint64_t k_mn = sw128_mnmajor_desc(ks + c0 * BN + 64 * cg * kBox, BN * 128);
      float dq[8][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 64 / 16; ++kk) {
        wgmma_ss_mn<T, 64>(dq, desc_advance(ds_desc, kk * 256), desc_advance(k_mn, kk * 2048), kk);
      }
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_regs(dq);
      if (c0 == 0) {  // dV and dK have retired too: the stage's Q, dO and stats are free
        wgmma_fence_regs(pf);
        wgmma_fence_regs(dsf);
        mbarrier_arrive(empty + st);
        // This warp's bulk reductions of the previous tile have read its rows of the staged
        // dQ before they are written again.
        bulk_wait_read<0>();
        __syncwarp();
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int r = warp * 16 + g, c = c0 + nt * 8 + 2 * t;
        *reinterpret_cast<float2*>(dqs + r * kPitch + c) = make_float2(dq[nt][0] * p.scale, dq[nt][1] * p.scale);
        *reinterpret_cast<float2*>(dqs + (r + 8) * kPitch + c) =
            make_float2(dq[nt][2] * p.scale, dq[nt][3] * p.scale);
      }
    }
    wgmma_fence_regs(dk);
    wgmma_fence_regs(dv);
    fence_async_shared();  // the staged dQ, written by plain stores, is read by the bulk reductions
    __syncwarp();
    // Each warp adds the 16 rows it wrote (and no other warp did) to the dQ buffer, one bulk
    // reduction per valid row from lanes 0..15. (One warp issuing all 64, which the compiler
    // serializes lane by lane, held its three siblings at the next tile's first wgmma: the
    // largest stall in the H200 profile, docs/kernels.md.)
    const int64_t r = warp * 16 + lane;
    if (lane < 16 && m0 + r < p.seq_q) {
      bulk_reduce_add_f32(dq_accum + (stat + m0 + r) * D, dqs + r * kPitch, D * 4);
      bulk_commit();
    }
  }
  bulk_wait<0>();  // every reduction done before the block's memory goes away

  store_dk_dv<T, D>(p, b, hk, key0, key1, dk, dv);
#else
  __trap();  // built without sm_90a: the launcher never starts this kernel
#endif
}

// cudaErrorNotSupported when the tensor maps cannot describe q, k, v or dout (the caller
// then runs mma.sync), before anything is launched.
template <typename T, int D>
cudaError_t run_flash_bwd_sm90(const dtrain_attention_bwd_params& p, cudaStream_t stream) {
  using C = FlashBwdSm90Config<D>;
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  if (!aligned(p.workspace, 16)) return cudaErrorNotSupported;  // the bulk reductions' rows
  CUtensorMap tm_q, tm_k, tm_v, tm_do;
  // The maps are of the head dim's columns: a smaller one than D's boxes hold reads zeros
  // past it (the out-of-bounds fill), which change no product.
  cudaError_t e =
      attention_operand_map(&tm_q, p.q, bf16, p.batch, p.heads, p.seq_q, p.head_dim, p.q_stride, C::kBlockM);
  if (e == cudaSuccess) e = attention_operand_map(&tm_k, p.k, bf16, p.batch, p.kv_heads, p.seq_k,
                                                  p.head_dim, p.k_stride, C::kBlockN);
  if (e == cudaSuccess) e = attention_operand_map(&tm_v, p.v, bf16, p.batch, p.kv_heads, p.seq_k,
                                                  p.head_dim, p.v_stride, C::kBlockN);
  if (e == cudaSuccess) e = attention_operand_map(&tm_do, p.dout, bf16, p.batch, p.heads, p.seq_q,
                                                  p.head_dim, p.dout_stride, C::kBlockM);
  if (e != cudaSuccess) return e;
  return run_bwd_passes<T, D>(p, stream, [&](float* dq_accum, const float* delta) {
    auto* kernel = flash_bwd_sm90_kernel<T, D>;
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmemBytes));
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>((p.seq_k + C::kBlockN - 1) / C::kBlockN), static_cast<unsigned>(p.kv_heads),
                    static_cast<unsigned>(p.batch));
    DTRAIN_LAUNCH(kernel, grid, C::kThreads, C::kSmemBytes, stream, p, dq_accum, delta, tm_q, tm_k, tm_v, tm_do);
    return launched();
  });
}

}  // namespace dtrain_kernels
