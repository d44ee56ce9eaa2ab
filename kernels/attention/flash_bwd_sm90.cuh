// Flash attention backward on Hopper (sm_90a), FlashAttention-3's structure: a block of
// three warpgroups owns the keys of one (batch, kv head) and walks every query tile of 64
// of every query head that reads this kv head (GQA sums its heads in registers).
// Warpgroup 0 produces: one thread loads K and V once and each tile's Q and dO into a ring
// of stages by bulk tensor copies (TMA, 128-byte swizzle) and one warp stages the tile's
// log-sum-exp and delta; it gives its registers to the consumers (setmaxnreg).
// Warpgroups 1 and 2 consume, in one of two ways:
// - up to D 128 (tiled dQ), 128 keys a block, 64 each: S^T = K Q^T and dP^T = V dO^T by
//   wgmma with both operands by swizzled descriptor, P^T and dS^T = P^T (dP^T - delta) in
//   registers, dV += P^T dO and dK += dS^T Q with P^T and dS^T as register operands; dS
//   also goes to shared memory (two buffers, by tile parity), and once both have stored
//   theirs, each computes half of dQ's columns over all 128 keys (dQ = dS K) into a staged
//   float32 tile, which a third producer warp adds to the float32 dQ buffer by one bulk
//   reduction (cp.reduce.async.bulk .add.f32; flash_bwd.cuh: DqTiles);
// - at D 256 (split columns; dK, dV and dQ of 64 keys would not fit one warpgroup's
//   registers), 64 keys a block, both consumers on all of them: each computes S^T and dP^T
//   for half the tile's queries, stores P^T, dS^T and dS to shared memory, and once both
//   have, computes half of dV's, dK's and dQ's columns from there; dQ goes to the buffer
//   by atomics (DqRows: the staged tile would not fit beside the operands).
// Under attention dropout, P^T and dS^T take the forward's mask (flash_bwd.cuh: DropoutT).
#pragma once

#include "attention/flash_bwd.cuh"
#include "tma.cuh"

namespace dtrain_kernels {

template <int D>
struct FlashBwdSm90Config {
  static constexpr int kConsumers = 2;  // warpgroups
  static constexpr bool kSplitD = D > 128;  // split columns (above), else tiled dQ
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBlockN = kSplitD ? 64 : 64 * kConsumers;  // keys per block
  static constexpr int kBlockM = 64;                              // queries per tile
  static constexpr int kCols = D / kConsumers;  // a consumer's columns of dQ (split: and of dK, dV)
  static constexpr int kStages = D == 64 ? 3 : 2;  // Q / dO ring
  static constexpr int kBox = kSwizzleBox;         // columns per copy
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // Named barriers (0 is __syncthreads'): both consumers' dS stored; tiled: the staged dQ
  // tile written (consumers arrive, the dQ warp waits) and read (the other way round);
  // split: both consumers done with the last tile's score buffers.
  static constexpr int kDsBar = 1, kDqFullBar = 2, kDqEmptyBar = 3, kScoresFreeBar = 4;
  static constexpr int kConsumerThreads = 128 * kConsumers, kDqBarThreads = kConsumerThreads + 32;
  using DqLayout = std::conditional_t<kSplitD, DqRows<D>, DqTiles<D, kConsumers>>;
  // 16-bit tiles, each [D / 64][rows][64]: K and V (kBlockN rows), kStages Q and dO tiles
  // (kBlockM rows), then the score buffers [kBlockM][64] in the blocked layout: tiled, two
  // of dS per consumer (by tile parity); split, one each of P^T, dS^T and dS. Then float32:
  // tiled, the staged dQ tile (kBlockM x D in DqLayout's order); per stage the log-sum-exp
  // and delta [2][kBlockM]; int32 pairs: each consumer's keys' staged query bounds [64]
  // (stage_query_bounds); then the mbarriers (K/V full; per stage full, empty); 1024 bytes of
  // slack to align the tiles to the swizzle's 1024-byte atoms.
  static constexpr size_t kKvElements = static_cast<size_t>(kBlockN) * D;
  static constexpr size_t kTileElements = static_cast<size_t>(kBlockM) * D;
  static constexpr size_t kDsElements = static_cast<size_t>(kBlockM) * 64;
  static constexpr int kScoreBuffers = kSplitD ? 3 : 2 * kConsumers;
  static constexpr size_t kHalfElements = 2 * kKvElements + 2 * kStages * kTileElements + kScoreBuffers * kDsElements;
  static constexpr size_t kDqStageFloats = kSplitD ? 0 : kTileElements;
  static constexpr size_t kFloats = kDqStageFloats + 2 * kStages * kBlockM + 2 * 64 * kConsumers;  // and the ints
  static constexpr size_t kSmemBytes = 1024 + 2 * kHalfElements + 4 * kFloats + 8 * (1 + 2 * kStages);
  static_assert(kSmemBytes <= 232448, "a block's shared memory on Hopper (227 KB)");
};

template <typename T, int D, bool kSliced>
__global__ void __launch_bounds__(FlashBwdSm90Config<D>::kThreads, 1)
    flash_bwd_sm90_kernel(dtrain_attention_bwd_params p, float* dq_accum, const float* delta, BwdLaunch launch,
                          const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do) {
#if DTRAIN_HAVE_WGMMA
  using C = FlashBwdSm90Config<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages, kBox = C::kBox, NQ = C::kCols;
  static_assert(BM == kDqTileRows, "a query tile is one tile of the dQ buffer");
  DTRAIN_DYNAMIC_SMEM(unsigned char, raw);
  T* ks = reinterpret_cast<T*>(raw + (1024 - shared_address(raw) % 1024) % 1024);
  T* vs = ks + C::kKvElements;
  // Stage st's Q and dO tiles (pointer arithmetic: an array would sit in local memory).
  auto qbuf = [&](int st) { return vs + C::kKvElements + st * C::kTileElements; };
  auto dobuf = [&](int st) { return vs + C::kKvElements + (S + st) * C::kTileElements; };
  // The score buffers. Tiled: dS of tile parity `par` and consumer cg. Split: P^T, dS^T
  // ([key][query]) and dS ([query][key]).
  T* ds_all = vs + C::kKvElements + 2 * S * C::kTileElements;
  auto dsbuf = [&](int par, int cg) { return ds_all + (par * C::kConsumers + cg) * C::kDsElements; };
  T *pt_s = ds_all, *dst_s = ds_all + C::kDsElements, *ds_s = ds_all + 2 * C::kDsElements;
  float* dq_stage = reinterpret_cast<float*>(ds_all + C::kScoreBuffers * C::kDsElements);  // tiled
  float* stats = dq_stage + C::kDqStageFloats;  // stage st: log-sum-exp at st 2 BM, delta after
  KeyQueries* bounds_s = reinterpret_cast<KeyQueries*>(stats + 2 * S * BM);  // [kConsumers][64]: stage_query_bounds
  uint64_t* bars = reinterpret_cast<uint64_t*>(bounds_s + 64 * C::kConsumers);
  uint64_t *kv_full = bars, *full = bars + 1, *empty = bars + 1 + S;

  const BwdBlock blk = bwd_block<T, BN, true, kSliced>(p, launch);
  const int64_t b = blk.b, hk = blk.hk, n0 = blk.n0;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const BwdQueryTiles<BM, BN> qtiles(p, b, n0);
  const int64_t m_begin = qtiles.m_begin;
  const int per_head = qtiles.n_tiles;
  const int n_tiles = group * per_head;  // tile i: head hk group + i / per_head, queries m0(i)..
  auto m0_of = [&](int i) { return m_begin + int64_t{i % per_head} * BM; };
  auto head_of = [&](int i) { return hk * group + i / per_head; };
  const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 1);
    for (int st = 0; st < S; ++st) {
      mbarrier_init(full + st, 1 + 32);  // the copies' thread, and the stats warp
      mbarrier_init(empty + st, C::kConsumerThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the only block barrier: from here on the warpgroups go their own ways

  if (wg == 0) {  // the producer
    setmaxnreg_dec<C::kProducerRegs>();
    if (n_tiles == 0 || warp > (C::kSplitD ? 1 : 2)) return;  // split: dQ by the consumers' atomics
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
    } else if (warp == 1) {  // each tile's log-sum-exp and delta
      for (int i = 0; i < n_tiles; ++i) {
        const int st = i % S;
        mbarrier_wait(empty + st, ((i / S) & 1) ^ 1);
        const int64_t stat = (b * p.heads + head_of(i)) * p.seq_q;
        stage_row_stats<BM, 32>(stats + st * 2 * BM, stats + st * 2 * BM + BM, p, delta, stat, m0_of(i), lane);
        mbarrier_arrive(full + st);  // releases the stores to the consumers' wait
      }
    } else {  // warp 2: each tile's dQ into the buffer, one bulk reduction of BM x D floats
      const int64_t tiles = (p.seq_q + BM - 1) / BM;
      for (int i = 0; i < n_tiles; ++i) {
        named_barrier_sync(C::kDqFullBar, C::kDqBarThreads);
        if (lane == 0) {
          const int64_t tile = (b * p.heads + head_of(i)) * tiles + m0_of(i) / BM;
          bulk_reduce_add_f32(launch.dq_of<BN, kSliced>(dq_accum, n0) + tile * BM * D, dq_stage, BM * D * 4);
          bulk_commit();
          bulk_wait_read<0>();  // the staged tile is read: the consumers may write the next
        }
        __syncwarp();
        if (i + 1 < n_tiles) named_barrier_arrive(C::kDqEmptyBar, C::kDqBarThreads);
      }
      if (lane == 0) bulk_wait<0>();  // every reduction done before the block's memory goes away
    }
    return;
  }

  setmaxnreg_inc<C::kConsumerRegs>();
  const int cg = wg - 1, g = lane / 4;
  // This warpgroup's keys, 64 from kc0 (tiled: its own; split: the block's), and the
  // columns of dK and dV it holds, DKV from kv_col0.
  const int key_row0 = C::kSplitD ? 0 : 64 * cg;
  const int64_t kc0 = n0 + key_row0;
  const int64_t key0 = kc0 + warp * 16 + g, key1 = key0 + 8;
  constexpr int DKV = C::kSplitD ? C::kCols : D;
  const int kv_col0 = C::kSplitD ? C::kCols * cg : 0;
  // The queries of a tile its S^T and dP^T cover, kQ from row q_row0 (split: its half).
  constexpr int kQ = C::kSplitD ? BM / C::kConsumers : BM;
  const int q_row0 = C::kSplitD ? kQ * cg : 0;
  const KeyQueries* bounds_w = bounds_s + 64 * cg + warp * 16;  // this warp's keys' query bounds, relative to kc0
  stage_query_bounds(bounds_s + 64 * cg, p, b, kc0, kc0 + warp * 16);
  const float scale_log2 = p.scale * kLog2e;
  // Columns 16 kk .. 16 kk + 15 of a K-major swizzled tile of `rows` rows: box kk / 4, 32
  // bytes per 16 columns inside its rows. This warpgroup's K and V are rows key_row0 .. of
  // each box (tiled, 8192 bytes on for consumer 1: whole 1024-byte swizzle atoms).
  auto k_step = [](int kk, int rows) { return static_cast<uint32_t>((kk / 4) * rows * 128 + (kk % 4) * 32); };
  const uint64_t k_desc = sw128_kmajor_desc(ks + key_row0 * kBox), v_desc = sw128_kmajor_desc(vs + key_row0 * kBox);
  // dQ's B operand: K's columns NQ cg .. as MN-major rows of all BN keys (box NQ cg / 64,
  // NQ cg % 64 columns into its 128-byte rows: a start inside the swizzle's rows, as the
  // K-major steps above), 16 keys (2048 bytes) per step.
  const uint64_t kq_desc = sw128_mnmajor_desc(ks + (NQ * cg / kBox) * BN * kBox + NQ * cg % kBox, BN * 128);

  float dk_tiles[1][DKV / 8][4], dv_tiles[1][DKV / 8][4];
  zero_tiles(dk_tiles);
  zero_tiles(dv_tiles);
  auto& dk = dk_tiles[0];
  auto& dv = dv_tiles[0];
  if (n_tiles > 0) mbarrier_wait(kv_full, 0);
  for (int i = 0; i < n_tiles; ++i) {
    const int st = i % S;
    const int64_t m0 = m0_of(i);
    mbarrier_wait(full + st, (i / S) & 1);
    const float* lse_s = stats + st * 2 * BM;
    const float* delta_s = lse_s + BM;
    // S^T = K Q^T and dP^T = V dO^T, 64 keys by this consumer's kQ queries of the tile (from
    // mq: tiled, all of them; split, its half), in two groups: P^T is computed while dP^T
    // finishes (and, tiled, dV += P^T dO issued).
    const int64_t mq = m0 + q_row0;
    const float* lse_c = lse_s + q_row0;
    const uint64_t q_desc = sw128_kmajor_desc(qbuf(st) + q_row0 * kBox);  // split, consumer 1: 4 whole atoms on
    const uint64_t do_desc = sw128_kmajor_desc(dobuf(st) + q_row0 * kBox);
    float st_tiles[1][kQ / 8][4], dpt_tiles[1][kQ / 8][4];
    auto& s_t = st_tiles[0];
    auto& dp_t = dpt_tiles[0];
    wgmma_fence_regs(dk);
    wgmma_fence_regs(dv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_ss<T, kQ>(s_t, desc_advance(k_desc, k_step(kk, BN)), desc_advance(q_desc, k_step(kk, BM)), kk);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_ss<T, kQ>(dp_t, desc_advance(v_desc, k_step(kk, BN)), desc_advance(do_desc, k_step(kk, BM)), kk);
    }
    wgmma_commit();
    wgmma_wait<1>();  // S^T
    wgmma_fence_regs(s_t);
    if (p.softcap > 0.f) softcap_scores(s_t, p.scale, p.softcap);
    mask_tile_t<64, kQ>(s_t, p, kc0, mq, key0, key1, bounds_w, kc0);
    probabilities_t(s_t, lse_c, scale_log2);
    // P^T as dV's product takes it: under dropout, dropped (flash_bwd.cuh: DropoutT; its
    // hashes run while dP^T is on the tensor cores).
    uint32_t pf[kQ / 16][4], dsf[kQ / 16][4];
    const bool dropout = p.dropout_p > 0.f;
    DropoutT z{};
    if (dropout) {
      z = DropoutT::of<kQ / 8>(p, b * p.heads + head_of(i), key0, key1, mq + p.query_offset);
      float pd[kQ / 8][4];
      dropped_t(pd, s_t, z);
      pack_a_fragments<T>(pf, pd);
    } else {
      pack_a_fragments<T>(pf, s_t);
    }
    // dV += P^T dO and dK += dS^T Q (the softmax scale is applied at the end): dO and Q
    // MN-major, 16 queries (two 8-row swizzle groups, 2048 bytes) per step, columns kv_col0
    // .. (the box kv_col0 / 64; the next 64 columns one box, BM rows of 128 bytes, on).
    const uint64_t do_mn = sw128_mnmajor_desc(dobuf(st) + (kv_col0 / kBox) * BM * kBox, BM * 128);
    const uint64_t q_mn = sw128_mnmajor_desc(qbuf(st) + (kv_col0 / kBox) * BM * kBox, BM * 128);
    if constexpr (C::kSplitD) {
      wgmma_wait<0>();  // dP^T
    } else {  // dV now, P^T in registers
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_mn<T, D>(dv, pf[kk], desc_advance(do_mn, kk * 2048));
      wgmma_commit();
      wgmma_wait<1>();  // dP^T (dV may still run)
    }
    wgmma_fence_regs(dp_t);
    // dS^T = P^T (dP^T - delta), into registers (A fragments).
    if (p.softcap > 0.f) softcap_grad_t(s_t, s_t, lse_c, p.softcap);  // into P^T (pf has it): dS^T carries it
    if (dropout) {
      ds_t(dp_t, s_t, delta_s + q_row0, z);
    } else {
      ds_t(dp_t, s_t, delta_s + q_row0);
    }
    pack_a_fragments<T>(dsf, dp_t);
    // Into shared memory by stmatrix: fragment kk holds queries 16 kk .. of the warp's
    // keys 0-7 and 8-15 (blocks 2 kk, 2 kk + 1), and lane l gives row l % 8 of block l / 8
    // (keys + 8 for blocks 1 and 3, queries + 8 for 2 and 3); dS, [query][key], transposed,
    // four stores a tile instead of 32 of 16 bits. Tiled, dS alone, into this tile parity's
    // buffer: the other one may still be read by the other consumer's dQ products of the
    // previous tile (this one's, of two tiles ago, have retired: both consumers passed the
    // last tile's dS barrier after them). Split, P^T and dS^T too, [key][query] as they
    // are, into the one set of buffers, once both consumers' products of the last tile
    // have retired.
    T* dss = C::kSplitD ? ds_s : dsbuf(i & 1, cg);
    if (C::kSplitD && i > 0) named_barrier_sync(C::kScoresFreeBar, C::kConsumerThreads);
#pragma unroll
    for (int kk = 0; kk < kQ / 16; ++kk) {
      const int key = warp * 16 + 8 * (lane / 8 % 2), query = q_row0 + 16 * kk + 8 * (lane / 16);
      stsm_x4<true>(dsf[kk], dss + blocked_offset<64>(query + lane % 8, key));
      if constexpr (C::kSplitD) {
        stsm_x4<false>(pf[kk], pt_s + blocked_offset<64>(key + lane % 8, query));
        stsm_x4<false>(dsf[kk], dst_s + blocked_offset<64>(key + lane % 8, query));
      }
    }
    fence_async_shared();  // the buffers, written by plain stores, are read by wgmma next
    named_barrier_sync(C::kDsBar, C::kConsumerThreads);
    float dq[NQ / 8][4];
    if constexpr (C::kSplitD) {
      // dV, dQ = dS K and dK, columns kv_col0 .. (NQ of them), A from the buffers (16
      // queries, or for dQ keys, a step); dQ goes out by atomics while dK runs on.
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        wgmma_ss_mn<T, NQ>(dv, desc_advance(kmajor_desc<64>(pt_s), kk * 256), desc_advance(do_mn, kk * 2048), 1);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        wgmma_ss_mn<T, NQ>(dq, desc_advance(kmajor_desc<64>(ds_s), kk * 256), desc_advance(kq_desc, kk * 2048), kk);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        wgmma_ss_mn<T, NQ>(dk, desc_advance(kmajor_desc<64>(dst_s), kk * 256), desc_advance(q_mn, kk * 2048), 1);
      }
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ
      wgmma_fence_regs(dv);
      wgmma_fence_regs(dq);
      const int64_t stat = (b * p.heads + head_of(i)) * p.seq_q;
#pragma unroll
      for (int nt = 0; nt < NQ / 8; ++nt) {
        add_dq<D, true>(launch.dq_of<BN, kSliced>(dq_accum, n0), p, stat, m0 + warp * 16 + g,
                        kv_col0 + nt * 8 + 2 * (lane % 4), dq[nt]);
      }
    } else {
      // dQ[:, NQ cg ..] = dS K over all BN keys (keys 64 c .. from consumer c's buffer);
      // then dK += dS^T Q, which runs on while the staged dQ is written (issued before dQ,
      // its wait would hold dQ's; H200: 2-3% faster).
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        wgmma_ss_mn<T, NQ>(dq, desc_advance(kmajor_desc<64>(dsbuf(i & 1, kk / 4)), (kk % 4) * 256),
                           desc_advance(kq_desc, kk * 2048), kk);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_mn<T, D>(dk, dsf[kk], desc_advance(q_mn, kk * 2048));
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ
      wgmma_fence_regs(pf);
      wgmma_fence_regs(dv);
      wgmma_fence_regs(dq);
      // Into the staged tile once the dQ warp has read the previous one, then hand it over.
      if (i > 0) named_barrier_sync(C::kDqEmptyBar, C::kDqBarThreads);
#pragma unroll
      for (int nt = 0; nt < NQ / 8; ++nt) {
        *reinterpret_cast<float4*>(dq_stage + ((cg * (NQ / 8) + nt) * 128 + threadIdx.x % 128) * 4) =
            make_float4(dq[nt][0] * p.scale, dq[nt][1] * p.scale, dq[nt][2] * p.scale, dq[nt][3] * p.scale);
      }
      fence_async_shared();  // the staged dQ, written by plain stores, is read by the bulk reduction
      named_barrier_arrive(C::kDqFullBar, C::kDqBarThreads);
    }
    wgmma_wait<0>();  // dK: the stage's Q, dO and stats are free (split: and the buffers, here)
    wgmma_fence_regs(dsf);
    wgmma_fence_regs(dk);
    mbarrier_arrive(empty + st);
  }

  store_dk_dv<T>(p, b, hk, key0, key1, dk, dv, kv_col0);
#else
  __trap();  // built without sm_90a: the launcher never starts this kernel
#endif
}

template <typename T, int D>
size_t flash_bwd_sm90_smem_bytes() {
  return FlashBwdSm90Config<D>::kSmemBytes;
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
  return run_bwd_passes<T, typename C::DqLayout, C::kBlockN>(
      p, stream, [&](float* dq_accum, const float* delta, const BwdLaunch& l, unsigned blocks) {
    auto* kernel = l.dq_slice ? flash_bwd_sm90_kernel<T, D, true> : flash_bwd_sm90_kernel<T, D, false>;
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kSmemBytes));
    if (err != cudaSuccess) return err;
    const dim3 grid(blocks, static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
    DTRAIN_LAUNCH(kernel, grid, C::kThreads, C::kSmemBytes, stream, p, dq_accum, delta, l, tm_q, tm_k, tm_v, tm_do);
    return launched();
  });
}

}  // namespace dtrain_kernels
