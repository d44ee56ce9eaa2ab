// Flash attention backward (FlashAttention-2's loop order) on mma.sync. A block owns 64
// keys (16 per warp) of one (batch, kv head) and walks every query tile of every query
// head that reads this kv head, so dK and dV accumulate in registers with no atomics
// (grouped-query attention sums its heads here). Per query tile, each warp computes
// S^T = K Q^T for its keys, P^T = exp(S^T - lse), dV += P^T dO, dP^T = V dO^T,
// dS^T = P^T (dP^T - delta) and dK += dS^T Q; dS goes through shared memory so that every
// warp can add its 16 query rows of dQ = dS K into a float32 buffer with atomics.
// Operand fragments come from shared memory by ldmatrix (transposed where the reduction
// runs over the rows of the stored tile); only tiles across the causal diagonal or the end
// of the keys are masked. delta = rowsum(dO * O) comes from a small kernel first; a last
// one converts dQ. Head dims above 128 take flash_bwd_split_kernel (two warps per 16 keys).
// With attention dropout both recompute the forward's keep mask per tile (DropoutT).
// Deterministic (params.deterministic; either kernel, by run_bwd_passes): the key blocks
// run a few per (batch, kv head) per launch, each adding dQ into a float32 buffer of its
// own (BwdLaunch), and the convert pass sums the buffers in order.
#pragma once

#include "attention/flash.cuh"
#include "mma.cuh"

namespace dtrain_kernels {

// delta[row] = sum_d dout[row, d] * o[row, d]; one warp per row.
template <typename T>
__global__ void flash_bwd_prepare_kernel(dtrain_attention_bwd_params p, float* delta) {
  const int64_t rows = p.batch * p.heads * p.seq_q;
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % p.seq_q, h = (row / p.seq_q) % p.heads, b = row / (p.seq_q * p.heads);
  const T* o = static_cast<const T*>(p.o) + b * p.o_stride.batch + h * p.o_stride.head + i * p.o_stride.seq;
  const T* d = static_cast<const T*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head +
               i * p.dout_stride.seq;
  float s = 0.f;
  for (int c = lane; c < p.head_dim; c += 32) s += to_float(o[c]) * to_float(d[c]);
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// Where the float32 dq buffer keeps dq[b, h, i, c] (row = (b heads + h) seq_q + i). Both
// layouts name, for each run of four floats (a quad), the two pairs of adjacent columns
// it holds: pair(p, quad, k, &row, &col), row -1 for padding.
// The mma.sync kernels' and the Hopper kernel's at D 256 (split columns), which add into it
// by atomics: rows of D floats.
template <int D>
struct DqRows {
  __host__ __device__ static int64_t floats(const dtrain_attention_bwd_params& p) {
    return p.batch * p.heads * p.seq_q * D;
  }
  __device__ static void pair(const dtrain_attention_bwd_params&, int64_t quad, int k, int64_t& row, int& col) {
    row = quad / (D / 4);
    col = static_cast<int>(quad % (D / 4)) * 4 + 2 * k;
  }
};
// The Hopper kernel's up to D 128, which adds whole query tiles by one bulk reduction
// each: per (b, h), tiles of kDqTileRows x D floats, each in the order its kConsumers
// warpgroups store their dQ accumulators (kNq = D / kConsumers columns each): quad (f,
// tid) of a tile, f = consumer cg's chunk cg (kNq / 8) + nt, holds thread tid's
// d[nt][0..3] (wgmma.cuh's layout: rows 16 (tid / 32) + (tid % 32) / 4 and 8 below it,
// columns cg kNq + 8 nt + 2 (tid % 4) and the next), so that a warp's stores to the
// staged tile are 512 contiguous bytes.
template <int D, int kConsumers>
struct DqTiles {
  static constexpr int kNq = D / kConsumers;
  static constexpr int kTileQuads = kDqTileRows * D / 4;
  static_assert(kDqTileRows == 64 && kNq % 8 == 0, "a warpgroup's 64 rows, whole 8-column chunks");
  __host__ __device__ static int64_t floats(const dtrain_attention_bwd_params& p) {
    return p.batch * p.heads * ((p.seq_q + kDqTileRows - 1) / kDqTileRows) * kTileQuads * 4;
  }
  __device__ static void pair(const dtrain_attention_bwd_params& p, int64_t quad, int k, int64_t& row, int& col) {
    const int64_t tile = quad / kTileQuads, tiles = (p.seq_q + kDqTileRows - 1) / kDqTileRows;
    const int in = static_cast<int>(quad % kTileQuads), tid = in % 128, f = in / 128;
    const int64_t i = (tile % tiles) * kDqTileRows + 16 * (tid / 32) + (tid % 32) / 4 + 8 * k;
    col = (f / (kNq / 8)) * kNq + (f % (kNq / 8)) * 8 + 2 * (tid % 4);
    row = i < p.seq_q ? tile / tiles * p.seq_q + i : -1;
  }
};

// dq from the float32 buffer in layout L (rows past seq_q and columns past the head dim
// are left): the sum of its `slices` slices (slice floats apart), in their order.
template <typename T, typename L>
__global__ void flash_bwd_convert_dq_kernel(dtrain_attention_bwd_params p, const float* dq_accum, int slices,
                                            int64_t slice) {
  const int64_t quads = L::floats(p) / 4;
  for (int64_t q = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; q < quads; q += int64_t{gridDim.x} * blockDim.x) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      int64_t row;
      int c;
      L::pair(p, q, k, row, c);
      if (row < 0 || c >= p.head_dim) continue;
      const int64_t i = row % p.seq_q, h = (row / p.seq_q) % p.heads, b = row / (p.seq_q * p.heads);
      T* dq = static_cast<T*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head + i * p.dq_stride.seq + c;
      float x = dq_accum[4 * q + 2 * k], y = dq_accum[4 * q + 2 * k + 1];
      for (int s = 1; s < slices; ++s) {
        x += dq_accum[s * slice + 4 * q + 2 * k];
        y += dq_accum[s * slice + 4 * q + 2 * k + 1];
      }
      dq[0] = from_float<T>(x);
      dq[1] = from_float<T>(y);
    }
  }
}

// What the two backward kernels (mma.sync here, wgmma in flash_bwd_sm90.cuh) do alike on
// a warp's transposed score tile st (16 keys: key0 = the warp's first key + g, key1 =
// key0 + 8; kN chunks of 8 queries from m0), mma.sync's accumulator layout.
// The mask: keys past the end, or (causal) after the query (its row plus the query
// offset). Only a tile past the end of
// the keys or across the causal diagonal needs it (the callers test that first). Per key,
// the queries before a 32-bit bound relative to m0 + 2 t are masked (as in mask_scores).
template <int kN>
__device__ __forceinline__ void mask_scores_t(float (&st)[kN][4], int64_t key0, int64_t key1, int64_t m0,
                                              const dtrain_attention_bwd_params& p) {
  const int t2 = 2 * (threadIdx.x % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = r == 0 ? key0 : key1;
    // queries before it are masked
    const int64_t first = key >= p.seq_k ? kN * 8 : (p.causal ? (key - m0) - p.query_offset : 0);
    const int bound = static_cast<int>(imax(0, imin(first, kN * 8))) - t2;
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        if (nt * 8 + (e & 1) < bound) st[nt][e] = -INFINITY;
      }
    }
  }
}

// The window's and the documents' sides of the mask work from each key's queries [first,
// end): end its query_end, first (without causal, under documents or a window) its
// first_query, else 0 (the causal diagonal is mask_scores_t's). A warp stages them for its 16 keys in
// shared memory before its first tile, relative to the block's first key n0:
// bounds_s[key - n0] = {first - n0, end - n0} (32-bit, clamped: a sequence of 2^31 tokens
// does not fit in memory anyway). Held in registers, or loaded per tile, the end cost the
// mma.sync D 128 backward 4 bytes of spill.
struct KeyQueries {
  int first, end;
};
__device__ __forceinline__ void stage_query_bounds(KeyQueries* bounds_s, const dtrain_attention_bwd_params& p,
                                                   int64_t b, int64_t n0, int64_t warp_key0) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) {
    const int64_t key = warp_key0 + lane;
    const int64_t first = bidirectional_bounds(p) ? first_query(p, b, key) : 0;
    bounds_s[warp_key0 - n0 + lane] = {static_cast<int>(imax(first - n0, INT32_MIN)),
                                       static_cast<int>(imin(query_end(p, b, key) - n0, INT32_MAX))};
  }
  __syncwarp();
}

// Queries before a key's staged first or at and after its end are masked (per key, two
// 32-bit bounds relative to m0 + 2 t, as above; bounds_w: this warp's 16 staged bounds,
// key0's at g).
template <int kN>
__device__ __forceinline__ void mask_query_bounds_t(float (&st)[kN][4], const KeyQueries* bounds_w, int64_t n0,
                                                    int64_t m0) {
  const int t2 = 2 * (threadIdx.x % 4), g = threadIdx.x % 32 / 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const KeyQueries& q = bounds_w[g + 8 * r];
    const int first = static_cast<int>(imax(0, imin(n0 + q.first - m0, kN * 8))) - t2;
    const int end = static_cast<int>(imax(0, imin(n0 + q.end - m0, kN * 8))) - t2;
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        const int c = nt * 8 + (e & 1);
        if (c < first || c >= end) st[nt][e] = -INFINITY;
      }
    }
  }
}

// The mask of a warp's transposed score tile for keys [k0, k0 + kKeys) (its own, key0 and
// key1, among them) against the queries [m0, m0 + kBlockM): only a tile past the end of
// the keys, across the causal diagonal or, with a sliding window or packed documents,
// reaching past its warp's first key's query_end or (without causal) starting before its
// warp's last key's first query (both non-decreasing) has masked entries.
// bounds_w, n0: as for mask_query_bounds_t.
template <int kKeys, int kBlockM, int kN>
__device__ __forceinline__ void mask_tile_t(float (&st)[kN][4], const dtrain_attention_bwd_params& p, int64_t k0,
                                            int64_t m0, int64_t key0, int64_t key1, const KeyQueries* bounds_w,
                                            int64_t n0) {
  if (k0 + kKeys > p.seq_k || (p.causal && (k0 + kKeys - 1 - m0) > p.query_offset)) {
    mask_scores_t(st, key0, key1, m0, p);
  }
  if ((p.window > 0 || p.documents.end != nullptr) &&
      (m0 + kBlockM > n0 + bounds_w[0].end || m0 < n0 + bounds_w[15].first)) {
    mask_query_bounds_t(st, bounds_w, n0, m0);
  }
}

// This thread's two queries (columns 2 t and 2 t + 1 of chunk nt) of a per-query statistic
// staged in shared memory (the log-sum-exp or delta): one 8-byte load.
__device__ __forceinline__ float2 query_pair(const float* stat_s, int nt) {
  return *reinterpret_cast<const float2*>(stat_s + nt * 8 + 2 * (threadIdx.x % 4));
}

// P^T = exp(S^T scale - lse), lse_s the tile's log-sum-exp in the log2 domain (+inf for
// padding rows, whose p is then 0).
template <int kN>
__device__ __forceinline__ void probabilities_t(float (&st)[kN][4], const float* lse_s, float scale_log2) {
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) {
    const float2 l = query_pair(lse_s, nt);
#pragma unroll
    for (int e = 0; e < 4; ++e) st[nt][e] = fast_exp2(fmaf(st[nt][e], scale_log2, -(e & 1 ? l.y : l.x)));
  }
}

// dS^T = P^T (dP^T - delta), in place of dP^T (delta_s: the tile's delta).
template <int kN>
__device__ __forceinline__ void ds_t(float (&dpt)[kN][4], const float (&pt)[kN][4], const float* delta_s) {
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) {
    const float2 d = query_pair(delta_s, nt);
#pragma unroll
    for (int e = 0; e < 4; ++e) dpt[nt][e] = pt[nt][e] * (dpt[nt][e] - (e & 1 ? d.y : d.x));
  }
}

// Logit soft-capping's derivative, as a factor on dS^T (dst: dS^T, or P^T itself before
// dS^T = P^T (dP^T - delta) takes it): the softmax saw c = cap tanh(u / cap) of u = s
// scale, so dL/du = dS (1 - tanh^2), and tanh = c / cap comes back from P^T and the
// log-sum-exp (lse_s, log2 domain): c log2 e = log2 p + lse. A p of 0 (masked, or a
// padding row's) gives 0, its dS^T being 0 already.
template <int kN>
__device__ __forceinline__ void softcap_grad_t(float (&dst)[kN][4], const float (&pt)[kN][4], const float* lse_s,
                                               float cap) {
  const float inv = 1.f / (cap * kLog2e);
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) {
    const float2 l = query_pair(lse_s, nt);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float t = (fast_log2(pt[nt][e]) + (e & 1 ? l.y : l.x)) * inv;
      dst[nt][e] *= fmaxf(1.f - t * t, 0.f);  // NaN (p 0 on a padding row's +inf) gives 0
    }
  }
}

// Bits 0-7 of x to bits 0, 4, .., 28 (bit i to bit 4 i).
__device__ __forceinline__ uint32_t spread_bits4(uint32_t x) {
  x &= 0xFFu;
  x = (x | (x << 12)) & 0x000F000Fu;
  x = (x | (x << 6)) & 0x03030303u;
  return (x | (x << 3)) & 0x11111111u;
}

// Attention dropout in the backward: which of a warp's transposed probabilities (keys
// key0 and key1, kN chunks of 8 queries from query token q0 = m0 + the query offset) the
// forward kept, bit 4 nt + e (dtrain_attention_dropout_keeps, query head bh), and the
// kept ones' scale 1 / (1 - dropout_p). The four lanes l ^ 4 x (x 0-3: rows g ^ x) hold
// the four keys of key0's quad and of key1's (key0 - g is a multiple of 4) for the same
// queries, and one hash gives a quad's four draws. Of the four hashes a chunk needs there
// (its two queries by the two quads), lane x' = g % 4 computes hash x' (query 2 t + x' %
// 2, key1's quad if x' / 2), which holds element e = x' of every lane of the four: each
// lane keeps its own draw and hands each of the other three theirs by a shuffle.
struct DropoutT {
  uint32_t keep;
  float scale;
  template <int kN>
  __device__ __forceinline__ static DropoutT of(const dtrain_attention_bwd_params& p, int64_t bh, int64_t key0,
                                                int64_t key1, int64_t q0) {
    static_assert(kN * 4 <= 32, "a bit per element in one word");
    const uint32_t threshold = dtrain_attention_dropout_threshold(p.dropout_p);
    const int me = static_cast<int>(key0 & 3);  // this lane's key in its quads, and the element it hashes
    const int64_t q = q0 + 2 * (threadIdx.x % 4) + (me & 1), quad = (me < 2 ? key0 : key1) >> 2;
    uint32_t to[4] = {0, 0, 0, 0};  // to[x], bit nt: draw me ^ x of hash me, lane l ^ 4 x's element me
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
      const uint64_t z = dtrain_attention_dropout_hash(p.dropout_seed, bh, q + nt * 8, quad);
#pragma unroll
      for (int x = 0; x < 4; ++x) to[x] |= dtrain_attention_dropout_keeps_in(z, me ^ x, threshold) << nt;
    }
    // From lane l ^ 4 x: this lane's draws in hash me ^ x, its element me ^ x.
    uint32_t keep = spread_bits4(to[0]) << me;
#pragma unroll
    for (int x = 1; x < 4; ++x) keep |= spread_bits4(__shfl_xor_sync(0xffffffffu, to[x], 4 * x)) << (me ^ x);
    return {keep, 1.f / (1.f - p.dropout_p)};
  }
  __device__ __forceinline__ bool kept(int nt, int e) const { return (keep >> (4 * nt + e)) & 1u; }
  // The probability P V saw: p Z / (1 - dropout_p).
  __device__ __forceinline__ float applied(float p, int nt, int e) const { return kept(nt, e) ? p * scale : 0.f; }
};

// The dropped P^T that dV += P^T dO takes (pd; pt stays undropped for dS).
template <int kN>
__device__ __forceinline__ void dropped_t(float (&pd)[kN][4], const float (&pt)[kN][4], const DropoutT& z) {
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) pd[nt][e] = z.applied(pt[nt][e], nt, e);
  }
}

// dS^T = P^T (dP^T Z / (1 - dropout_p) - delta) under dropout, in place of dP^T: the
// gradient reaches P through the kept elements only, and delta = rowsum(dO O) is the same
// sum as without (O is the dropped output).
template <int kN>
__device__ __forceinline__ void ds_t(float (&dpt)[kN][4], const float (&pt)[kN][4], const float* delta_s,
                                     const DropoutT& z) {
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) {
    const float2 d = query_pair(delta_s, nt);
#pragma unroll
    for (int e = 0; e < 4; ++e) dpt[nt][e] = pt[nt][e] * (z.applied(dpt[nt][e], nt, e) - (e & 1 ? d.y : d.x));
  }
}

// A query tile's log-sum-exp (log2 domain; +inf for padding rows, whose p is then 0) and
// delta into shared memory, by kThreads threads of which this is number `me`; stat is the
// row of (b, h, query 0) in lse and delta.
template <int kBlockM, int kThreads>
__device__ __forceinline__ void stage_row_stats(float* lse_s, float* delta_s, const dtrain_attention_bwd_params& p,
                                                const float* delta, int64_t stat, int64_t m0, int me) {
  for (int i = me; i < kBlockM; i += kThreads) {
    const bool ok = m0 + i < p.seq_q;
    lse_s[i] = ok ? p.lse[stat + m0 + i] * kLog2e : INFINITY;
    delta_s[i] = ok ? delta[stat + m0 + i] : 0.f;
  }
}

// The mma.sync backward's shared memory, in order: K and V [kBwdBlockN][kPitch], Q and dO
// [kBwdBlockM][kPitch], kBwdSplit score tiles [kBwdBlockM][kPitchS] (dS; split: P^T, then dS^T),
// the query tile's log-sum-exp and delta [kBwdBlockM] floats, and the keys' query bounds
// [kBwdBlockN] (stage_query_bounds). kBytes is what the launch asks for.
template <typename T, int D, bool kCompact = false>
struct BwdSmem {
  using C = FlashConfig<D, kCompact>;
  static constexpr int kTileElems = (2 * C::kBwdBlockN + 2 * C::kBwdBlockM) * C::kPitch;
  static constexpr int kScoreElems = C::kBwdSplit * C::kBwdBlockM * C::kPitchS;
  static constexpr size_t kBytes = sizeof(T) * static_cast<size_t>(kTileElems + kScoreElems) +
                                   sizeof(float) * 2 * C::kBwdBlockM + sizeof(KeyQueries) * C::kBwdBlockN;
  T *ks, *vs, *qs, *dos, *s_tiles;
  float *lse, *delta;
  KeyQueries* bounds;
  __device__ __forceinline__ explicit BwdSmem(T* smem)
      : ks(smem),
        vs(ks + C::kBwdBlockN * C::kPitch),
        qs(vs + C::kBwdBlockN * C::kPitch),
        dos(qs + C::kBwdBlockM * C::kPitch),
        s_tiles(dos + C::kBwdBlockM * C::kPitch),
        lse(reinterpret_cast<float*>(s_tiles + kScoreElems)),
        delta(lse + C::kBwdBlockM),
        bounds(reinterpret_cast<KeyQueries*>(delta + C::kBwdBlockM)) {}
};

// The block's keys [n0, n0 + kBlockN) of kv head hk: K and V into shared memory (row
// pitch `pitch`), one cp.async group, not waited for.
template <int kBlockN, int D, int kThreads, typename T>
__device__ __forceinline__ void load_kv_async(T* ks, T* vs, int pitch, const dtrain_attention_bwd_params& p,
                                              int64_t b, int64_t hk, int64_t n0) {
  load_tile_async<kBlockN, D, kThreads>(ks, pitch, static_cast<const T*>(p.k) + b * p.k_stride.batch +
                                                       hk * p.k_stride.head + n0 * p.k_stride.seq,
                                        p.k_stride.seq, p.seq_k - n0, p.head_dim);
  load_tile_async<kBlockN, D, kThreads>(vs, pitch, static_cast<const T*>(p.v) + b * p.v_stride.batch +
                                                       hk * p.v_stride.head + n0 * p.v_stride.seq,
                                        p.v_stride.seq, p.seq_k - n0, p.head_dim);
  cp_async_commit();
}

// Query tile m0 of a head (q, dout: its first rows; stat: as for stage_row_stats): Q and
// dO into shared memory and its log-sum-exp and delta staged, all of it (and every group
// before) complete for the whole block on return.
template <int kBlockM, int D, int kThreads, typename T>
__device__ __forceinline__ void load_query_tile(T* qs, T* dos, int pitch, float* lse_s, float* delta_s, const T* q,
                                                const T* dout, const dtrain_attention_bwd_params& p,
                                                const float* delta, int64_t stat, int64_t m0) {
  load_tile_async<kBlockM, D, kThreads>(qs, pitch, q + m0 * p.q_stride.seq, p.q_stride.seq, p.seq_q - m0,
                                        p.head_dim);
  load_tile_async<kBlockM, D, kThreads>(dos, pitch, dout + m0 * p.dout_stride.seq, p.dout_stride.seq,
                                        p.seq_q - m0, p.head_dim);
  cp_async_commit();
  stage_row_stats<kBlockM, kThreads>(lse_s, delta_s, p, delta, stat, m0, threadIdx.x);
  cp_async_wait<0>();
  __syncthreads();
}

// scale a into the float32 dq buffer: a is one 8-column chunk (columns c, c + 1 of this
// thread) of query rows qrow0 and qrow1 = qrow0 + 8; rows past seq_q are skipped. kPairs:
// one 8-byte reduction per row (atomic_add_pair; dq_accum 8-byte aligned), else two.
template <int D, bool kPairs = false>
__device__ __forceinline__ void add_dq(float* dq_accum, const dtrain_attention_bwd_params& p, int64_t stat,
                                       int64_t qrow0, int c, const float (&a)[4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (qrow0 + 8 * r >= p.seq_q) continue;
    float* at = &dq_accum[(stat + qrow0 + 8 * r) * D + c];
    if constexpr (kPairs) {
      atomic_add_pair(at, a[2 * r] * p.scale, a[2 * r + 1] * p.scale);
    } else {
      atomicAdd(at, a[2 * r] * p.scale);
      atomicAdd(at + 1, a[2 * r + 1] * p.scale);
    }
  }
}

// dK (times the softmax scale) and dV of this thread's two keys: kChunks chunks of 8 of
// the head dim's columns from c0.
template <typename T, int kChunks>
__device__ __forceinline__ void store_dk_dv(const dtrain_attention_bwd_params& p, int64_t b, int64_t hk, int64_t key0,
                                            int64_t key1, const float (&dk)[kChunks][4], const float (&dv)[kChunks][4],
                                            int c0 = 0) {
  const int t = threadIdx.x % 4;
  T* dkp = static_cast<T*>(p.dk) + b * p.dk_stride.batch + hk * p.dk_stride.head;
  T* dvp = static_cast<T*>(p.dv) + b * p.dv_stride.batch + hk * p.dv_stride.head;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = r == 0 ? key0 : key1;
    if (key >= p.seq_k) continue;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = c0 + i * 8 + 2 * t;
      if (c >= p.head_dim) continue;
      *reinterpret_cast<uint32_t*>(dkp + key * p.dk_stride.seq + c) =
          pack2<T>(dk[i][2 * r] * p.scale, dk[i][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvp + key * p.dv_stride.seq + c) = pack2<T>(dv[i][2 * r], dv[i][2 * r + 1]);
    }
  }
}

// The backward's passes: delta and a zeroed dq buffer in layout L, the main kernel over
// key blocks of kBlockN (launch_main(dq_accum, delta, launch, blocks) launches `blocks` of
// them from launch.first_tile per (batch, kv head)), dq converted. All key blocks in one
// launch, or, deterministic, `slices` at a time into as many dq slices (BwdLaunch).
template <typename T, typename L, int kBlockN, typename Launch>
cudaError_t run_bwd_passes(const dtrain_attention_bwd_params& p, cudaStream_t stream, Launch launch_main) {
  const int64_t tiles = (p.seq_k + kBlockN - 1) / kBlockN, slices = flash_bwd_dq_slices(p);
  const int64_t per_launch = p.deterministic ? imin(slices, tiles) : tiles;
  const int64_t slice = static_cast<int64_t>(flash_bwd_dq_slice_floats(p));
  float* dq_accum = static_cast<float*>(p.workspace);
  float* delta = dq_accum + slices * slice;
  const int64_t rows = p.batch * p.heads * p.seq_q, dq_floats = L::floats(p);
  const int64_t zeroed = p.deterministic ? per_launch * slice : dq_floats;
  cudaError_t e = cudaMemsetAsync(dq_accum, 0, sizeof(float) * static_cast<size_t>(zeroed), stream);
  if (e != cudaSuccess) return e;
  auto* prepare = flash_bwd_prepare_kernel<T>;
  DTRAIN_LAUNCH(prepare, static_cast<unsigned>((rows + 7) / 8), 256, 0, stream, p, delta);
  if ((e = launched()) != cudaSuccess) return e;
  for (int64_t first = 0; first < tiles; first += per_launch) {
    const BwdLaunch launch{first, p.deterministic ? slice : 0};
    if ((e = launch_main(dq_accum, delta, launch, static_cast<unsigned>(imin(per_launch, tiles - first)))) !=
        cudaSuccess) {
      return e;
    }
  }
  const unsigned blocks = static_cast<unsigned>(imin((dq_floats / 4 + 255) / 256, 65535));
  auto* convert = flash_bwd_convert_dq_kernel<T, L>;
  DTRAIN_LAUNCH(convert, blocks, 256, 0, stream, p, dq_accum, static_cast<int>(p.deterministic ? per_launch : 1),
                slice);
  return launched();
}

// kSoftcap: logit soft-capping, an instance of its own (branched at run time, its
// constants held across the loop made D 64 spill 20 bytes at the 168-register cap).
template <typename T, int D, bool kSoftcap, bool kSliced>
// At D <= 64, three blocks an SM: ptxas took 168 registers for D 64 on its own until the
// documents' load (2026-12-05), then 208 (two blocks); held to 170, it spills 8 bytes (two
// stores and two loads a query tile). Untimed, like the documents.
__global__ void __launch_bounds__(FlashConfig<D>::kThreads, D <= 64 ? 3 : 1)
    flash_bwd_kernel(dtrain_attention_bwd_params p, float* dq_accum, const float* delta, BwdLaunch launch) {
  using C = FlashConfig<D>;
  constexpr int BM = C::kBwdBlockM, BN = C::kBwdBlockN, P = C::kPitch, PS = C::kPitchS, kThreads = C::kThreads;
  DTRAIN_DYNAMIC_SMEM(T, smem);
  const BwdSmem<T, D> sm(smem);
  T *ks = sm.ks, *vs = sm.vs, *qs = sm.qs, *dos = sm.dos;
  T* dss = sm.s_tiles;  // [BM][PS]: dS as [query][key]
  float *lse_s = sm.lse, *delta_s = sm.delta;
  KeyQueries* bounds_s = sm.bounds;

  const BwdBlock blk = bwd_block<T, BN, false, kSliced>(p, launch);
  const int64_t b = blk.b, hk = blk.hk, n0 = blk.n0;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t key0 = n0 + warp * 16 + g, key1 = key0 + 8;  // keys of c0,c1 and of c2,c3
  stage_query_bounds(bounds_s, p, b, n0, n0 + warp * 16);
  const float scale_log2 = p.scale * kLog2e;

  load_kv_async<BN, D, kThreads>(ks, vs, P, p, b, hk, n0);

  // One 16-row tile per warp: the [1][..] arrays are what the warp-tile helpers take.
  float dk_tiles[1][D / 8][4], dv_tiles[1][D / 8][4];
  zero_tiles(dk_tiles);
  zero_tiles(dv_tiles);
  auto& dk = dk_tiles[0];
  auto& dv = dv_tiles[0];
  const BwdQueryTiles<BM, BN> qtiles(p, b, n0);
  const int64_t m_begin = qtiles.m_begin;

  for (int hh = 0; hh < group; ++hh) {
    const int64_t h = hk * group + hh;
    const T* q = static_cast<const T*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head;
    const int64_t stat = (b * p.heads + h) * p.seq_q;  // row of (b, h, query 0) in lse / delta / dq
    for (int i = 0; i < qtiles.n_tiles; ++i) {
      const int64_t m0 = m_begin + int64_t{i} * BM;
      __syncthreads();  // the previous tile's shared memory is no longer read
      load_query_tile<BM, D, kThreads>(qs, dos, P, lse_s, delta_s, q, dout, p, delta, stat, m0);

      // S^T = K Q^T (16 keys x BM queries per warp), then P^T.
      float st_tiles[1][BM / 8][4];
      auto& st = st_tiles[0];
      zero_tiles(st);
      mma_rows_rows<T, 1, D, BM / 8>(st_tiles, ks + warp * 16 * P, P, qs, P);
      // Mask only the tiles that need one (mask_tile_t); padding query rows have lse = inf,
      // so their p is 0 without one.
      if constexpr (kSoftcap) softcap_scores(st, p.scale, p.softcap);
      mask_tile_t<BN, BM>(st, p, n0, m0, key0, key1, bounds_s + warp * 16, n0);
      probabilities_t(st, lse_s, scale_log2);
      const bool dropout = p.dropout_p > 0.f;
      DropoutT z{};
      // dV += P^T dO (under dropout, the dropped P^T).
      if (dropout) {
        z = DropoutT::of<BM / 8>(p, b * p.heads + h, key0, key1, m0 + p.query_offset);
        float pd_tiles[1][BM / 8][4];
        dropped_t(pd_tiles[0], st, z);
        mma_acc_cols<T, 1, BM, D / 8>(dv_tiles, pd_tiles, dos, P);
      } else {
        mma_acc_cols<T, 1, BM, D / 8>(dv_tiles, st_tiles, dos, P);
      }
      // dP^T = V dO^T, then dS^T = P^T (dP^T - delta).
      float dpt_tiles[1][BM / 8][4];
      auto& dpt = dpt_tiles[0];
      zero_tiles(dpt);
      mma_rows_rows<T, 1, D, BM / 8>(dpt_tiles, vs + warp * 16 * P, P, dos, P);
      // Soft-capping's factor into P^T in place (dV has taken it): dS^T then carries it.
      if constexpr (kSoftcap) softcap_grad_t(st, st, lse_s, p.softcap);
      if (dropout) {
        ds_t(dpt, st, delta_s, z);
      } else {
        ds_t(dpt, st, delta_s);
      }
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dss[(nt * 8 + 2 * t + (e & 1)) * PS + warp * 16 + g + (e < 2 ? 0 : 8)] = from_float<T>(dpt[nt][e]);
        }
      }
      // dK += dS^T Q (the softmax scale is applied at the end).
      mma_acc_cols<T, 1, BM, D / 8>(dk_tiles, dpt_tiles, qs, P);
      __syncthreads();  // dS complete
      // dQ += scale dS K: warp w adds query rows [16 w, 16 w + 16) of the tile.
      const int64_t qrow0 = m0 + warp * 16 + g;
      uint32_t dsf[BN / 16][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) load_a(dsf[kk], dss + warp * 16 * PS + kk * 16, PS);
#pragma unroll
      for (int i = 0; i < D / 8; i += 2) {
        float acc[2][4];
        zero_tiles(acc);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          uint32_t bf[4];
          load_b2_kn(bf, ks + kk * 16 * P + i * 8, P);
          mma16816<T>(acc[0], dsf[kk], bf);
          mma16816<T>(acc[1], dsf[kk], bf + 2);
        }
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          add_dq<D>(launch.dq_of<BN, kSliced>(dq_accum, n0), p, stat, qrow0, (i + h2) * 8 + 2 * t, acc[h2]);
        }
      }
    }
  }
  cp_async_wait<0>();  // an empty loop leaves the K, V loads in flight

  store_dk_dv<T>(p, b, hk, key0, key1, dk, dv);
}

// Head dims above 128 (D 256): one warp's dK and dV of 16 keys by D columns would take
// 256 registers a thread. So kBwdSplit = 2 warps share each 16 keys (8 warps a block, 4
// in the compact tiles): with G key groups (4; compact 2), warp w owns keys 16 (w % G)..
// and columns [c0, c0 + D / 2), c0 = (D / 2) (w / G), of dK and dV, and of dQ for query
// rows 16 (w % G).. of each tile (16 G of them). The two split a tile's 16 G
// queries for S^T and dP^T (8 G each, the key group's 16 keys over the whole head dim) and
// exchange P^T and dS^T through shared memory ([key][query]), from which both read them
// as A fragments for dV += P^T dO and dK += dS^T Q, and (transposed) dS for dQ = dS K.
template <typename T, int D, bool kCompact, bool kSliced>
__global__ void __launch_bounds__(FlashConfig<D, kCompact>::kBwdThreads, 1)
    flash_bwd_split_kernel(dtrain_attention_bwd_params p, float* dq_accum, const float* delta, BwdLaunch launch) {
  using C = FlashConfig<D, kCompact>;
  constexpr int BM = C::kBwdBlockM, BN = C::kBwdBlockN, P = C::kPitch, PS = C::kPitchS, kThreads = C::kBwdThreads;
  constexpr int kGroups = C::kBwdGroups;
  static_assert(C::kBwdSplit == 2 && BN == 16 * kGroups, "two warps for each key group of 16");
  constexpr int kQueries = BM / 2, kChunks = D / 16;  // a warp's queries of S^T, its 8-column chunks
  DTRAIN_DYNAMIC_SMEM(T, smem);
  const BwdSmem<T, D, kCompact> sm(smem);
  T *ks = sm.ks, *vs = sm.vs, *qs = sm.qs, *dos = sm.dos;
  T* pts = sm.s_tiles;      // [BN][PS]: P^T as [key][query]
  T* dsts = pts + BN * PS;  // [BN][PS]: dS^T as [key][query]
  float *lse_s = sm.lse, *delta_s = sm.delta;
  KeyQueries* bounds_s = sm.bounds;

  const BwdBlock blk = bwd_block<T, BN, false, kSliced>(p, launch);
  const int64_t b = blk.b, hk = blk.hk, n0 = blk.n0;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kw = warp % kGroups, part = warp / kGroups;  // key group; half of the queries (S^T), of the columns
                                                        // (dK, dV, dQ)
  const int mq = part * kQueries, c0 = part * (D / 2);
  const int64_t key0 = n0 + kw * 16 + g, key1 = key0 + 8;
  if (part == 0) stage_query_bounds(bounds_s, p, b, n0, n0 + kw * 16);  // read after the first tile's barrier
  const float scale_log2 = p.scale * kLog2e;

  load_kv_async<BN, D, kThreads>(ks, vs, P, p, b, hk, n0);

  float dk_tiles[1][kChunks][4], dv_tiles[1][kChunks][4];
  zero_tiles(dk_tiles);
  zero_tiles(dv_tiles);
  const BwdQueryTiles<BM, BN> qtiles(p, b, n0);

  for (int hh = 0; hh < group; ++hh) {
    const int64_t h = hk * group + hh;
    const T* q = static_cast<const T*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head;
    const int64_t stat = (b * p.heads + h) * p.seq_q;  // row of (b, h, query 0) in lse / delta / dq
    for (int i = 0; i < qtiles.n_tiles; ++i) {
      const int64_t m0 = qtiles.m_begin + int64_t{i} * BM;
      __syncthreads();  // the previous tile's shared memory is no longer read
      load_query_tile<BM, D, kThreads>(qs, dos, P, lse_s, delta_s, q, dout, p, delta, stat, m0);

      {  // S^T, P^T, dP^T and dS^T of the key group's 16 keys by this warp's 32 queries.
        float st_tiles[1][kQueries / 8][4], dpt_tiles[1][kQueries / 8][4];
        auto &st = st_tiles[0], &dpt = dpt_tiles[0];
        zero_tiles(st_tiles);
        mma_rows_rows<T, 1, D, kQueries / 8>(st_tiles, ks + kw * 16 * P, P, qs + mq * P, P);
        if (p.softcap > 0.f) softcap_scores(st, p.scale, p.softcap);
        mask_tile_t<BN, kQueries>(st, p, n0, m0 + mq, key0, key1, bounds_s + kw * 16, n0);
        probabilities_t(st, lse_s + mq, scale_log2);
        zero_tiles(dpt_tiles);
        mma_rows_rows<T, 1, D, kQueries / 8>(dpt_tiles, vs + kw * 16 * P, P, dos + mq * P, P);
        const bool dropout = p.dropout_p > 0.f;
        DropoutT z{};
        if (dropout) {
          z = DropoutT::of<kQueries / 8>(p, b * p.heads + h, key0, key1, m0 + mq + p.query_offset);
          ds_t(dpt, st, delta_s + mq, z);
        } else {
          ds_t(dpt, st, delta_s + mq);
        }
        if (p.softcap > 0.f) softcap_grad_t(dpt, st, lse_s + mq, p.softcap);
        // Element (nt, e): key kw 16 + g + 8 (e / 2), query mq + 8 nt + 2 t + (e & 1). P^T
        // as dV takes it: dropped under dropout.
#pragma unroll
        for (int nt = 0; nt < kQueries / 8; ++nt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int at = (kw * 16 + g + 8 * r) * PS + mq + nt * 8 + 2 * t;
            float p0 = st[nt][2 * r], p1 = st[nt][2 * r + 1];
            if (dropout) p0 = z.applied(p0, nt, 2 * r), p1 = z.applied(p1, nt, 2 * r + 1);
            *reinterpret_cast<uint32_t*>(pts + at) = pack2<T>(p0, p1);
            *reinterpret_cast<uint32_t*>(dsts + at) = pack2<T>(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
          }
        }
      }
      __syncthreads();  // P^T and dS^T complete
      // dV += P^T dO and dK += dS^T Q (the softmax scale is applied at the end), columns c0..
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t pf[1][4], dsf[1][4];
        load_a(pf[0], pts + kw * 16 * PS + kk * 16, PS);
        load_a(dsf[0], dsts + kw * 16 * PS + kk * 16, PS);
        mma_frag_cols<T, 1, kChunks>(dv_tiles, pf, dos + kk * 16 * P + c0, P);
        mma_frag_cols<T, 1, kChunks>(dk_tiles, dsf, qs + kk * 16 * P + c0, P);
      }
      // dQ += scale dS K: query rows [16 kw, 16 kw + 16) of the tile, columns c0..
      const int64_t qrow0 = m0 + kw * 16 + g;
      uint32_t dsf[BN / 16][1][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) load_a_t(dsf[kk][0], dsts + kk * 16 * PS + kw * 16, PS);
#pragma unroll
      for (int i = 0; i < kChunks; i += 2) {
        float acc[1][2][4];
        zero_tiles(acc);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) mma_frag_cols<T, 1, 2>(acc, dsf[kk], ks + kk * 16 * P + c0 + i * 8, P);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          add_dq<D>(launch.dq_of<BN, kSliced>(dq_accum, n0), p, stat, qrow0, c0 + (i + h2) * 8 + 2 * t, acc[0][h2]);
        }
      }
    }
  }
  cp_async_wait<0>();  // an empty loop leaves the K, V loads in flight

  store_dk_dv<T>(p, b, hk, key0, key1, dk_tiles[0], dv_tiles[0], c0);
}

// Whether this device gets the compact tiles: D 256 where the default ones do not fit.
template <typename T, int D>
bool bwd_compact() {
  return D > 128 && device_block_smem() < BwdSmem<T, D>::kBytes;
}

template <typename T, int D>
size_t flash_bwd_smem_bytes() {
  return bwd_compact<T, D>() ? BwdSmem<T, D, (D > 128)>::kBytes : BwdSmem<T, D>::kBytes;
}

template <typename T, int D>
cudaError_t run_flash_bwd(const dtrain_attention_bwd_params& p, cudaStream_t stream) {
  auto launch = [&](auto compact, float* dq_accum, const float* delta, const BwdLaunch& l, unsigned blocks) {
    constexpr bool kCompact = decltype(compact)::value;
    using C = FlashConfig<D, kCompact>;
    const size_t smem = BwdSmem<T, D, kCompact>::kBytes;
    auto* kernel = [&] {
      if constexpr (C::kBwdSplit == 1) {
        if (p.softcap > 0.f) {
          return l.dq_slice ? flash_bwd_kernel<T, D, true, true> : flash_bwd_kernel<T, D, true, false>;
        }
        return l.dq_slice ? flash_bwd_kernel<T, D, false, true> : flash_bwd_kernel<T, D, false, false>;
      } else {
        return l.dq_slice ? flash_bwd_split_kernel<T, D, kCompact, true>
                          : flash_bwd_split_kernel<T, D, kCompact, false>;
      }
    }();
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    const dim3 grid(blocks, static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
    DTRAIN_LAUNCH(kernel, grid, C::kBwdThreads, smem, stream, p, dq_accum, delta, l);
    return launched();
  };
  auto passes = [&](auto compact) {
    return run_bwd_passes<T, DqRows<D>, FlashConfig<D, decltype(compact)::value>::kBwdBlockN>(
        p, stream, [&](float* dq_accum, const float* delta, const BwdLaunch& l, unsigned blocks) {
          return launch(compact, dq_accum, delta, l, blocks);
        });
  };
  if constexpr (D > 128) {
    if (bwd_compact<T, D>()) return passes(std::true_type{});
  }
  return passes(std::false_type{});
}

}  // namespace dtrain_kernels
