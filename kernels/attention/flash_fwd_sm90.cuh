// Flash attention forward on Hopper (sm_90a), FlashAttention-3's structure: a block of
// three warpgroups owns 128 query rows of one (batch, head). Warpgroup 0 is the producer:
// one thread issues bulk tensor copies (TMA) of Q and of each 128-key (64 at D 256) K and V tile into a
// ring of stages (shared memory, 128-byte swizzle), each stage with a "full" mbarrier
// (the copy's bytes landed) and an "empty" one (both consumers are done with it); it
// gives its registers to the consumers (setmaxnreg). Warpgroups 1 and 2 own 64 query
// rows each: S = Q K^T by wgmma with both operands read by swizzled descriptors, the mask
// and online softmax of the mma.sync kernel (flash_fwd_tile.cuh: the accumulator layouts
// agree), O += P V with P from registers and V read MN-major. Within a warpgroup the
// softmax of tile j + 1 runs while P_j V_j is on the tensor cores; between the two, named
// barriers make them issue their MMAs in turn (ping-pong), so that one's softmax overlaps
// the other's MMAs. The grid is persistent: as many blocks as the GPU holds at once, each
// taking query blocks in tile_order as it finishes them (its first is blockIdx.x, the next
// from an atomic counter in the workspace: heaviest first, dynamically balanced), so that
// the next query block's Q and K/V tiles load, and one warpgroup starts its first S, while
// the last P V and the output stores of this one finish. Attention dropout is an instance
// of its own (kDropout), as in the mma.sync forward: the same mask on the same layout.
#pragma once

#include "attention/flash_fwd_tile.cuh"
#include "tma.cuh"

namespace dtrain_kernels {

template <int D>
struct FlashSm90Config {
  static constexpr int kConsumers = 2;  // warpgroups of 64 query rows
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBlockM = 64 * kConsumers;
  // Key tiles of 128; of 64 at D 256, where O's accumulators alone take 128 registers a
  // thread (S of 128 keys would leave too few) and two stages of 128-key K and V tiles
  // would not fit in shared memory beside Q.
  static constexpr int kBlockN = D == 256 ? 64 : 128;
  static constexpr int kStages = D == 64 ? 3 : 2;  // K/V ring
  static constexpr int kBox = kSwizzleBox;         // columns per copy
  static constexpr int kProducerRegs = 32, kConsumerRegs = 240;
  // Q, then kStages K and kStages V tiles ([D / 64][rows][64] each), then the mbarriers
  // (Q full, Q empty; per stage K full, V full, K empty, V empty), then the current query
  // block's (batch, head, first row, key tiles, first key tile) as 5 int64; 1024 bytes of
  // slack to align the tiles to the swizzle's 1024-byte atoms.
  static constexpr size_t kTileElements = static_cast<size_t>(kBlockM + 2 * kStages * kBlockN) * D;
  static constexpr size_t kSmemBytes = 1024 + 2 * kTileElements + 8 * (2 + 4 * kStages) + 40;
};

template <typename T, int D, bool kDropout>
__global__ void __launch_bounds__(FlashSm90Config<D>::kThreads, 1)
    flash_fwd_sm90_kernel(dtrain_attention_fwd_params p, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if DTRAIN_HAVE_WGMMA
  using C = FlashSm90Config<D>;
  using Block = FwdBlock<T, C::kBlockM, C::kBlockN, true>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages, kBox = C::kBox;
  constexpr uint32_t kTileBytes = BN * D * 2;
  DTRAIN_DYNAMIC_SMEM(unsigned char, raw);
  T* qs = reinterpret_cast<T*>(raw + (1024 - shared_address(raw) % 1024) % 1024);
  // Stage st's K and V tiles (pointer arithmetic: an array would sit in local memory).
  auto kbuf = [&](int st) { return qs + (BM + st * BN) * D; };
  auto vbuf = [&](int st) { return qs + (BM + (S + st) * BN) * D; };
  uint64_t* bars = reinterpret_cast<uint64_t*>(qs + C::kTileElements);
  uint64_t *q_full = bars, *q_empty = bars + 1, *k_full = bars + 2, *v_full = bars + 2 + S,
           *k_empty = bars + 2 + 2 * S, *v_empty = bars + 2 + 3 * S;
  // The query block whose Q the producer loads, as (b, h, m0, n_tiles, n_begin; n_tiles
  // -1: none left), written before its arrival on q_full, read by the consumers after their wait on
  // it, rewritten only after q_empty: the consumers do no division for it.
  volatile int64_t* current = reinterpret_cast<int64_t*>(bars + 2 + 4 * S);

  // The K/V ring runs on across query blocks: `it` counts the key tiles before the current
  // query block's, and both sides step it alike.
  const int64_t n_blocks = Block::query_blocks(p) * p.heads * p.batch;
  const int group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    mbarrier_init(q_empty, 128 * C::kConsumers);
    for (int st = 0; st < S; ++st) {
      mbarrier_init(k_full + st, 1);
      mbarrier_init(v_full + st, 1);
      mbarrier_init(k_empty + st, 128 * C::kConsumers);
      mbarrier_init(v_empty + st, 128 * C::kConsumers);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the only block barrier: from here on the warpgroups go their own ways

  if (group == 0) {  // the producer
    setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    int it = 0;
    for (int64_t blk_id = blockIdx.x, local = 0;; ++local) {
      // The next query block once the consumers' last S of the previous one has retired
      // (a fresh barrier passes parity 1 at once; its coordinates are worked out before
      // the wait); none left: n_tiles -1, and a plain arrival.
      const bool more = blk_id < n_blocks;
      const Block blk(p, more ? blk_id : 0);
      const int hk = static_cast<int>(blk.h / (p.heads / p.kv_heads));
      mbarrier_wait_or_trap(q_empty, static_cast<int>(local & 1) ^ 1);
      current[0] = blk.b;
      current[1] = blk.h;
      current[2] = blk.m0;
      current[3] = more ? blk.n_tiles : -1;
      current[4] = blk.n_begin;
      if (!more) {
        mbarrier_arrive(q_full);
        break;
      }
      mbarrier_arrive_expect_tx(q_full, BM * D * 2);
#pragma unroll
      for (int c = 0; c < D / kBox; ++c) {
        tma_load_4d(qs + c * BM * kBox, &tm_q, c * kBox, static_cast<int>(blk.m0), static_cast<int>(blk.h),
                    static_cast<int>(blk.b), q_full);
      }
      // Tile it into stage it % S once both consumers have released that stage's previous
      // tile (phase parity flips every S tiles).
      for (int n = blk.n_begin; n < blk.n_begin + blk.n_tiles; ++n, ++it) {
        const int st = it % S, parity = (it / S) & 1;
        mbarrier_wait_or_trap(k_empty + st, parity ^ 1);
        mbarrier_arrive_expect_tx(k_full + st, kTileBytes);
#pragma unroll
        for (int c = 0; c < D / kBox; ++c) {
          tma_load_4d(kbuf(st) + c * BN * kBox, &tm_k, c * kBox, n * BN, hk, static_cast<int>(blk.b), k_full + st);
        }
        mbarrier_wait_or_trap(v_empty + st, parity ^ 1);
        mbarrier_arrive_expect_tx(v_full + st, kTileBytes);
#pragma unroll
        for (int c = 0; c < D / kBox; ++c) {
          tma_load_4d(vbuf(st) + c * BN * kBox, &tm_v, c * kBox, n * BN, hk, static_cast<int>(blk.b), v_full + st);
        }
      }
      blk_id = gridDim.x + atomicAdd(static_cast<int*>(p.workspace), 1);
    }
    // Keep watch until the consumers release the last V tile (after their last MMA), so
    // that a consumer stuck in the pipeline traps too.
    if (it > 0) mbarrier_wait_or_trap(v_empty + (it - 1) % S, ((it - 1) / S) & 1);
    return;
  }

  setmaxnreg_inc<C::kConsumerRegs>();
  const int cg = group - 1, warp = threadIdx.x / 32 % 4, g = threadIdx.x % 32 / 4;
  const float scale_log2 = p.scale * kLog2e;
  // Columns 16 kk .. 16 kk + 15 of a K-major tile of `rows` rows: box kk / 4, 32 bytes per
  // 16 columns inside its rows.
  auto k_step = [](int kk, int rows) { return static_cast<uint32_t>((kk / 4) * rows * 128 + (kk % 4) * 32); };
  const uint64_t q_desc = sw128_kmajor_desc(qs + cg * 64 * kBox);  // this warpgroup's 64 rows
  // S = Q K^T for ring tile t, 64 x 128 per warpgroup (unscaled), issued and committed as
  // one group.
  auto issue_s = [&](float (&s)[BN / 8][4], int t) {
    const uint64_t k_desc = sw128_kmajor_desc(kbuf(t % S));
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_ss<T, BN>(s, desc_advance(q_desc, k_step(kk, BM)), desc_advance(k_desc, k_step(kk, BN)), kk);
    }
    wgmma_commit();
  };
  float acc[1][D / 8][4];
  uint32_t pf[BN / 16][4];
  // O += P V for ring tile t: keys 16 kk .. 16 kk + 15 are two 8-row atoms, 2048 bytes on.
  auto issue_pv = [&](int t) {
    const uint64_t v_desc = sw128_mnmajor_desc(vbuf(t % S), BN * 128);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs_mn<T, D>(acc[0], pf[kk], desc_advance(v_desc, kk * 2048));
    wgmma_commit();
  };
  auto wait_k = [&](int t) { mbarrier_wait(k_full + t % S, (t / S) & 1); };
  auto wait_v = [&](int t) { mbarrier_wait(v_full + t % S, (t / S) & 1); };
  // Ping-pong: warpgroup cg issues its MMAs after passing barrier 1 + cg, which the other
  // warpgroup's last issue (and, for warpgroup 0's first, warpgroup 1 at the start) arrived
  // at. Both take the same number of turns per query block, so the turns alternate across
  // query blocks too; warpgroup 0 takes one more at the end, which warpgroup 1's arrival
  // after its last issue opens.
  auto my_turn = [&] { named_barrier_sync(1 + cg, 256); };
  auto their_turn = [&] { named_barrier_arrive(2 - cg, 256); };
  auto pack_p = [&](const float (&s)[1][BN / 8][4]) { pack_a_fragments<T>(pf, s[0]); };

  if (cg == 1) their_turn();  // warpgroup 0 goes first
  for (int it = 0, local = 0;; ++local) {
    mbarrier_wait(q_full, local & 1);
    const int n_tiles = static_cast<int>(current[3]);
    if (n_tiles < 0) break;
    const int64_t b = current[0], h = current[1], m0 = current[2];
    const int64_t k_first = current[4] * BN;  // the first key tile's (a sliding window's or a document's)
    const int64_t row0 = m0 + cg * 64 + warp * 16 + g;  // this thread's first row
    // The mask (only the tiles that need one: mask_tile) and the softmax of the block's key
    // tile n: s becomes P (under dropout, the dropped P; the row sums stay undropped),
    // alpha the rescale of what O holds so far.
    auto softmax_tile = [&](float (&s)[1][BN / 8][4], int n, float (&row_max)[1][2], float (&row_sum)[1][2],
                            float (&alpha)[1][2]) {
      const int64_t n0 = k_first + int64_t{n} * BN;
      if (p.softcap > 0.f) softcap_scores(s[0], p.scale, p.softcap);
      mask_tile<BM, BN>(s, p, b, m0, row0, n0);
      softmax_step(s, row_max, row_sum, scale_log2, alpha);
      if constexpr (kDropout) dropout_probabilities(s, p, b, h, row0 + p.query_offset, n0);
    };

    zero_tiles(acc);
    float row_max[1][2], row_sum[1][2], alpha[1][2];
    init_row_stats(p, h, row_max, row_sum);
    // s holds S_j, then, after its softmax, P_j in float32 until retire_pv packs it.
    float s[1][BN / 8][4];
    // Before P_j V_j: wait for P_{j-1} V_{j-1} (its P registers and O), release its V
    // stage, pack P_j and rescale O. At the top of the loop, in a block of its own: placed
    // right after the softmax (where the source had it until 2026-12-04), the wait was
    // hoisted by ptxas into the softmax, to fill its first stall on a shuffle, and the
    // softmax of S_{j+1} never ran beside P_j V_j (SASS: WARPGROUP.DEPBAR.LE gsb0, 0x0
    // ahead of the first FMNMX).
    auto retire_pv = [&](int t_done) {
      wgmma_wait<0>();
      wgmma_fence_regs(acc[0]);
      wgmma_fence_regs(pf);
      if (t_done >= 0) mbarrier_arrive(v_empty + t_done % S);
      pack_p(s);
      rescale(acc, alpha);
    };
    {  // S_0 and its softmax
      wait_k(it);
      my_turn();
      wgmma_fence();
      issue_s(s[0], it);
      their_turn();
      wgmma_wait<0>();
      wgmma_fence_regs(s[0]);
      mbarrier_arrive(k_empty + it % S);
      softmax_tile(s, 0, row_max, row_sum, alpha);  // alpha is 0 or 1 here: O is still zero
    }
    // Key tile j: S_{j+1} = Q K_{j+1}^T and O += P_j V_j go out together; the softmax of
    // S_{j+1} runs while P_j V_j is still in flight. Each stage is released as soon as the
    // MMA reading it is known to have retired.
    for (int j = 0; j + 1 < n_tiles; ++j) {
      const int t = it + j;
      retire_pv(j > 0 ? t - 1 : -1);
      wait_k(t + 1);
      wait_v(t);
      my_turn();
      wgmma_fence();
      issue_s(s[0], t + 1);
      issue_pv(t);
      their_turn();
      wgmma_wait<1>();  // S_{j+1}; P_j V_j may still run
      wgmma_fence_regs(s[0]);
      mbarrier_arrive(k_empty + (t + 1) % S);
      softmax_tile(s, j + 1, row_max, row_sum, alpha);
    }
    mbarrier_arrive(q_empty);  // every S of this query block has retired: Q may be replaced
    {  // the last key tile: P V only
      const int t = it + n_tiles - 1;
      retire_pv(n_tiles > 1 ? t - 1 : -1);
      wait_v(t);
      my_turn();
      wgmma_fence();
      issue_pv(t);
      their_turn();
      wgmma_wait<0>();
      wgmma_fence_regs(acc[0]);
      wgmma_fence_regs(pf);
      mbarrier_arrive(v_empty + t % S);  // the last one is what the producer's watch waits for
    }
    store_output<T>(p, b, h, row0, acc, row_max, row_sum);
    it += n_tiles;
  }
  if (cg == 0) my_turn();  // warpgroup 1's arrival after its last issue
#else
  __trap();  // built without sm_90a: the launcher never starts this kernel
#endif
}

template <typename T, int D>
size_t flash_fwd_sm90_smem_bytes() {
  return FlashSm90Config<D>::kSmemBytes;
}

template <typename T, int D>
cudaError_t run_flash_fwd_sm90(const dtrain_attention_fwd_params& p, cudaStream_t stream) {
  using C = FlashSm90Config<D>;
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  CUtensorMap tm_q, tm_k, tm_v;
  // The maps are of the head dim's columns: a smaller one than D's boxes hold reads zeros
  // past it (the out-of-bounds fill), which change no product.
  cudaError_t e =
      attention_operand_map(&tm_q, p.q, bf16, p.batch, p.heads, p.seq_q, p.head_dim, p.q_stride, C::kBlockM);
  if (e == cudaSuccess) e = attention_operand_map(&tm_k, p.k, bf16, p.batch, p.kv_heads, p.seq_k,
                                                  p.head_dim, p.k_stride, C::kBlockN);
  if (e == cudaSuccess) e = attention_operand_map(&tm_v, p.v, bf16, p.batch, p.kv_heads, p.seq_k,
                                                  p.head_dim, p.v_stride, C::kBlockN);
  if (e != cudaSuccess) return e;
  // Persistent: as many blocks as the GPU holds at once (one an SM), each taking query
  // blocks from the counter in the workspace, zeroed here on the stream.
  if ((e = cudaMemsetAsync(p.workspace, 0, sizeof(int), stream)) != cudaSuccess) return e;
  auto* kernel = p.dropout_p > 0.f ? flash_fwd_sm90_kernel<T, D, true> : flash_fwd_sm90_kernel<T, D, false>;
  const int64_t n_blocks = FwdBlock<T, C::kBlockM, C::kBlockN, true>::query_blocks(p) * p.heads * p.batch;
  const Occupancy o = occupancy(kernel, C::kThreads, C::kSmemBytes);
  if ((e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(C::kSmemBytes))) != cudaSuccess) {
    return e;
  }
  const auto grid = static_cast<unsigned>(imin(n_blocks, int64_t{o.sms} * o.per_sm));
  DTRAIN_LAUNCH(kernel, grid, C::kThreads, C::kSmemBytes, stream, p, tm_q, tm_k, tm_v);
  return launched();
}

}  // namespace dtrain_kernels
