// What the two flash forward kernels (mma.sync, flash_fwd.cuh; wgmma, flash_fwd_sm90.cuh)
// do alike: which query block a block owns and its launch, and, on a warp's score tiles,
// whose layout both MMAs share (kM tiles of 16 query rows by kN chunks of 8 keys,
// mma.sync's accumulator layout), the mask, one step of the online softmax in the log2
// domain with the scale folded into one FFMA, and the normalised output and log-sum-exp.
#pragma once

#include "attention/flash.cuh"
#include "mma.cuh"

namespace dtrain_kernels {

// The query block a forward block owns, as (b, h, m0): causal grids start with the last
// query blocks, which have the most key tiles, so that the short ones fill the tail; with
// kSectioned, in tile_order's sections of heads whose K and V fit in L2. q is its first
// row; k and v are its kv head's (GQA); n_tiles counts the key tiles of kBlockN it visits
// (causal: none past its last row, all masked there; bidirectional documents: none past
// its last row's document). The one-argument form is this
// block's of a grid launched as (query blocks, heads, batch); the other is query block
// number `block` in that order, for a persistent grid's loop. With a sliding window the
// walk starts at n_begin, the tile of the first row's first key (at most the last tile, so
// that a block whose rows see no key still visits one, all masked: their log-sum-exp is
// +inf and their output 0); with packed documents, at the first row's document's start
// if that is later.
template <typename T, int kBlockM, int kBlockN, bool kSectioned>
struct FwdBlock {
  int64_t b, h, m0;
  const T* q;
  const T* k;
  const T* v;
  int n_begin, n_tiles;
  __device__ __forceinline__ explicit FwdBlock(const dtrain_attention_fwd_params& p)
      : FwdBlock(p, block_coords<kSectioned>(section(p)), gridDim.x) {}
  __device__ __forceinline__ FwdBlock(const dtrain_attention_fwd_params& p, int64_t block)
      : FwdBlock(p, sectioned_coords(block, query_blocks(p), p.heads, p.batch, section(p)), query_blocks(p)) {}

  __host__ __device__ static int64_t query_blocks(const dtrain_attention_fwd_params& p) {
    return (p.seq_q + kBlockM - 1) / kBlockM;
  }

 private:
  __host__ __device__ static int64_t section(const dtrain_attention_fwd_params& p) {
    return section_pairs(p.causal, p.seq_k * p.head_dim * 2 * int64_t{sizeof(T)});
  }
  __device__ __forceinline__ FwdBlock(const dtrain_attention_fwd_params& p, const BlockCoords& c, int64_t tiles) {
    b = c.b, h = c.head, m0 = (p.causal ? tiles - 1 - c.rank : c.rank) * kBlockM;
    const int64_t hk = h / (p.heads / p.kv_heads);
    q = static_cast<const T*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head + m0 * p.q_stride.seq;
    k = static_cast<const T*>(p.k) + b * p.k_stride.batch + hk * p.k_stride.head;
    v = static_cast<const T*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head;
    const int64_t end_tiles = imax(1, (key_end(p, b, m0 + kBlockM - 1) + kBlockN - 1) / kBlockN);
    n_begin = static_cast<int>(imin(first_key(p, b, m0) / kBlockN, end_tiles - 1));
    n_tiles = static_cast<int>(end_tiles - n_begin);
  }
};

// Accumulator element e of tile m of the thread with lane = 4 g + t holds query row
// row0 + 16 m + 8 (e / 2) (row0 = the warp's first row + g) and, in chunk nt, key
// col0 + 8 nt + 2 t + (e & 1).
// row0 and col0 are tokens of the keys' sequence (a query row plus the query offset).
// Only tiles past the end of the keys or across the causal diagonal need it: the
// callers test that first, so that interior tiles carry no per-element compare. Per row,
// the first masked key becomes a 32-bit bound relative to col0 + 2 t, so that an element
// costs one compare with an immediate and a select (64-bit coordinates per element took
// about 4 more instructions each).
template <int kM, int kN>
__device__ __forceinline__ void mask_scores(float (&s)[kM][kN][4], int64_t row0, int64_t col0, int64_t seq_k,
                                            bool causal) {
  const int t2 = 2 * (threadIdx.x % 4);
  // Clamped where the bounds below would mask all or nothing alike, so that int holds them.
  const int end = static_cast<int>(imax(0, imin(seq_k - col0, kN * 8)));          // past the keys
  const int diag = static_cast<int>(imax(-16 * kM, imin(row0 + 1 - col0, kN * 8)));  // after row0
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row_end = diag + m * 16 + r * 8;  // this row's end, relative to col0
      const int first = !causal ? end : row_end < 0 ? 0 : row_end < end ? row_end : end;
      const int bound = first - t2;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          if (nt * 8 + (e & 1) >= bound) s[m][nt][e] = -INFINITY;
        }
      }
    }
  }
}

// The per-row sides of the mask: keys before a row's first_key (the sliding window's and
// the packed documents' side) and, without causal, at and after its key_end (the same,
// to the right) are masked; per row (this thread's 2 kM) 32-bit bounds relative to
// col0 + 2 t, as above (with documents, one load of each of the row's bounds).
template <int kM, int kN>
__device__ __forceinline__ void mask_row_bounds(float (&s)[kM][kN][4], const dtrain_attention_fwd_params& p,
                                                int64_t b, int64_t row0, int64_t col0) {
  const int t2 = 2 * (threadIdx.x % 4);
  const bool bidirectional = bidirectional_bounds(p);
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + m * 16 + r * 8;
      const int first = static_cast<int>(imax(0, imin(first_key(p, b, row) - col0, kN * 8))) - t2;
      const int end =
          bidirectional ? static_cast<int>(imax(0, imin(key_end(p, b, row) - col0, kN * 8))) - t2 : kN * 8;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const int c = nt * 8 + (e & 1);
          if (c < first || c >= end) s[m][nt][e] = -INFINITY;
        }
      }
    }
  }
}

// The mask of a warp's score tiles (query rows from row0, as above, before the query
// offset) for key tile [n0, n0 + kBlockN) of the query block [m0, m0 + kBlockM) of batch
// b: only a tile past the end of the keys, across the causal diagonal (shifted by the
// query offset) or, with a sliding window or packed documents, before the block's last
// row's first key or (without causal) past its first row's key_end (both non-decreasing)
// has masked entries, so that interior tiles carry no per-element compare.
template <int kBlockM, int kBlockN, int kM, int kN>
__device__ __forceinline__ void mask_tile(float (&s)[kM][kN][4], const dtrain_attention_fwd_params& p, int64_t b,
                                          int64_t m0, int64_t row0, int64_t n0) {
  if (n0 + kBlockN > p.seq_k || (p.causal && n0 + kBlockN - 1 > m0 + p.query_offset)) {
    mask_scores(s, row0 + p.query_offset, n0, p.seq_k, p.causal);
  }
  if (p.window > 0 || p.documents.start != nullptr) {
    // b and row0 through opaque: the rows' bounds and their documents' addresses are
    // computed again at each masked tile, not held across the loop.
    const int64_t bb = opaque(b);
    if (n0 < first_key(p, bb, m0 + kBlockM - 1) ||
        (bidirectional_bounds(p) && n0 + kBlockN > key_end(p, bb, m0))) {
      mask_row_bounds(s, p, bb, opaque(row0), n0);
    }
  }
}

// Folds the (unscaled) scores s into the running row max and sum; s becomes P
// (unnormalised), alpha the factor by which the output accumulated so far must shrink
// (rescale). row_max holds max(s) * scale * log2(e) (scale > 0, so the max commutes with
// it); a row's four threads (one quad) share it.
template <int kM, int kN>
__device__ __forceinline__ void softmax_step(float (&s)[kM][kN][4], float (&row_max)[kM][2], float (&row_sum)[kM][2],
                                             float scale_log2, float (&alpha)[kM][2]) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) mx = fmaxf(mx, fmaxf(s[m][nt][2 * r], s[m][nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(row_max[m][r], mx * scale_log2);
      const float base = mx == -INFINITY ? 0.f : mx;  // no visible key yet: every p is 0
      alpha[m][r] = fast_exp2(row_max[m][r] - base);
      row_max[m][r] = mx;
      row_sum[m][r] *= alpha[m][r];
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
        s[m][nt][2 * r] = fast_exp2(fmaf(s[m][nt][2 * r], scale_log2, -base));
        s[m][nt][2 * r + 1] = fast_exp2(fmaf(s[m][nt][2 * r + 1], scale_log2, -base));
        row_sum[m][r] += s[m][nt][2 * r] + s[m][nt][2 * r + 1];
      }
    }
  }
}

// Attention dropout on a warp's probability tiles p (after softmax_step; rows from row0
// and keys from col0 as for mask_scores, row0 a token of the keys' sequence, col0 a
// multiple of 8): each is kept and scaled by 1 / (1 - dropout_p), or zeroed, by
// dtrain_attention_dropout_keeps. Lanes t and t ^ 1 (t = lane % 4) hold the two halves of
// each quad of keys (keys 4 (t / 2) .. of a chunk of 8) for the same rows, and one hash
// gives a quad's four draws: each lane hashes one of its two rows (the even lane row r 0),
// applies its own keys' draws and hands the other lane theirs by one shuffle. The row
// sums stay the undropped ones, as dropout's softmax has them.
template <int kM, int kN>
__device__ __forceinline__ void dropout_probabilities(float (&s)[kM][kN][4], const dtrain_attention_fwd_params& p,
                                                      int64_t b, int64_t h, int64_t row0, int64_t col0) {
  static_assert(kM * kN * 2 <= 32, "two bits per (row tile, chunk) in one word");
  const uint32_t threshold = dtrain_attention_dropout_threshold(p.dropout_p);
  const float keep_scale = 1.f / (1.f - p.dropout_p);
  const int t = threadIdx.x % 4, half = t & 1;  // this lane's keys: draws 2 half, 2 half + 1 of their quad
  const int64_t bh = b * p.heads + h, quad0 = col0 / 4 + t / 2;
  uint32_t mine = 0, theirs = 0;  // bits 2 (m kN + nt) + j: key j of this lane's pair (the other's), row half
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
      const uint64_t z = dtrain_attention_dropout_hash(p.dropout_seed, bh, row0 + m * 16 + 8 * half, quad0 + nt * 2);
      const int at = 2 * (m * kN + nt);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mine |= dtrain_attention_dropout_keeps_in(z, 2 * half + j, threshold) << (at + j);
        theirs |= dtrain_attention_dropout_keeps_in(z, 2 * (1 - half) + j, threshold) << (at + j);
      }
    }
  }
  const uint32_t other = __shfl_xor_sync(0xffffffffu, theirs, 1);  // this lane's keys in the other row
  const uint32_t rows[2] = {half ? other : mine, half ? mine : other};
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = s[m][nt][e];
        x = (rows[e / 2] >> (2 * (m * kN + nt) + e % 2)) & 1u ? x * keep_scale : 0.f;
      }
    }
  }
}

template <int kM, int kD>
__device__ __forceinline__ void rescale(float (&acc)[kM][kD][4], const float (&alpha)[kM][2]) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int i = 0; i < kD; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][i][e] *= alpha[m][e / 2];
    }
  }
}

// The running row max and sum before the first key tile: no key seen (-inf, 0), or with
// attention sinks (p.sinks) head h's sink as a key seen already whose value is 0 (its
// logit in log2 units; a weight of 1 in the sum, held by the quad's first thread), which
// the online softmax then rescales like any other key, so that the output and the
// log-sum-exp take it in and a row that sees no key ends with o 0 and lse the sink.
template <int kM>
__device__ __forceinline__ void init_row_stats(const dtrain_attention_fwd_params& p, int64_t h,
                                               float (&row_max)[kM][2], float (&row_sum)[kM][2]) {
  const bool sinks = p.sinks != nullptr;
  const float first = sinks ? p.sinks[h] * kLog2e : -INFINITY;
  const float weight = sinks && threadIdx.x % 4 == 0 ? 1.f : 0.f;
#pragma unroll
  for (int m = 0; m < kM; ++m) row_max[m][0] = row_max[m][1] = first, row_sum[m][0] = row_sum[m][1] = weight;
}

// softmax_step, then the rescale of the output accumulators.
template <int kM, int kN, int kD>
__device__ __forceinline__ void online_softmax(float (&s)[kM][kN][4], float (&acc)[kM][kD][4],
                                               float (&row_max)[kM][2], float (&row_sum)[kM][2], float scale_log2) {
  float alpha[kM][2];
  softmax_step(s, row_max, row_sum, scale_log2, alpha);
  rescale(acc, alpha);
}

// o (this thread's rows, row0 as for mask_scores) = acc / row sum, and the log-sum-exp
// (+inf for a row that saw no key); rows at and past seq_q, and columns at and past the
// head dim (a kernel of a larger D), are skipped.
template <typename T, int kM, int kD>
__device__ __forceinline__ void store_output(const dtrain_attention_fwd_params& p, int64_t b, int64_t h, int64_t row0,
                                             const float (&acc)[kM][kD][4], const float (&row_max)[kM][2],
                                             const float (&row_sum)[kM][2]) {
  const int t = threadIdx.x % 4;
  T* o = static_cast<T*>(p.o) + b * p.o_stride.batch + h * p.o_stride.head;
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[m][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int64_t row = row0 + m * 16 + r * 8;
      if (row >= p.seq_q) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int i = 0; i < kD; ++i) {
        const int c = i * 8 + 2 * t;
        if (c < p.head_dim) {
          *reinterpret_cast<uint32_t*>(o + row * p.o_stride.seq + c) =
              pack2<T>(acc[m][i][2 * r] * inv, acc[m][i][2 * r + 1] * inv);
        }
      }
      if (t == 0) {
        p.lse[(b * p.heads + h) * p.seq_q + row] = l > 0.f ? (row_max[m][r] + log2f(l)) / kLog2e : INFINITY;
      }
    }
  }
}

// Launches a forward kernel with `smem` bytes of dynamic shared memory: one block of
// `threads` per (query block of kBlockM, head, batch); `extra` follow the params.
template <int kBlockM, typename... Extra>
cudaError_t launch_fwd(void (*kernel)(dtrain_attention_fwd_params, Extra...), const dtrain_attention_fwd_params& p,
                       int threads, size_t smem, cudaStream_t stream, const Extra&... extra) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.seq_q + kBlockM - 1) / kBlockM), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(p.batch));
  DTRAIN_LAUNCH(kernel, grid, threads, smem, stream, p, extra...);
  return launched();
}

}  // namespace dtrain_kernels
