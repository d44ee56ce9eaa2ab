// The flash attention kernels' shared configuration and the per-(dtype, head dim) entry
// points that flash_api.cu dispatches to; each instantiation lives in its own .cu file so
// that they compile in parallel.
#pragma once

#include <type_traits>

#include "attention/tile_order.cuh"
#include "common.cuh"
#include "dtrain_kernels/attention.h"

namespace dtrain_kernels {

// The head dims the kernels are instantiated for (D): mma.sync 32, 64, 96, 128, 256; wgmma
// 64, 128, 256 (its tiles are whole 64-column boxes). Any multiple of 8 up to 256 runs in
// the smallest D that holds it: the extra columns load as zeros (cp.async's zero fill, the
// tensor maps' out-of-bounds fill), which changes no score and no product, and are never
// stored. Each pass's largest wgmma head dim is its own (kMaxWgmma*HeadDim), so that a
// pass may have fewer: a launch asking for wgmma above it is refused, AUTO runs mma.sync.
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxWgmmaFwdHeadDim = 256, kMaxWgmmaBwdHeadDim = 256;
inline int mma_kernel_dim(int64_t head_dim) {
  return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 96 ? 96 : head_dim <= 128 ? 128 : 256;
}
inline int wgmma_kernel_dim(int64_t head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }

// kCompact (D 256 only): tiles for devices that give a block 99 KB of shared memory
// (sm_86, sm_89), where the default tiles need 132 KB (forward) and 151 KB (backward);
// the launchers pick them by the device's number (flash_fwd.cuh, flash_bwd.cuh).
template <int D, bool kCompact = false>
struct FlashConfig {
  static_assert(!kCompact || D > 128, "the compact tiles are for head dims above 128");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kPitch = D + 8;  // shared-memory row pitch (elements): no bank conflicts
  // Forward: a warp owns kFwdRowTiles x 16 query rows, so that each K or V fragment read
  // from shared memory feeds that many MMAs; key tiles of kFwdBlockN. At D 256 one tile
  // (its output accumulators alone take 128 registers a thread) and 8 warps, so that a
  // block still owns 128 rows: each K and V tile comes from L2 once per 128 queries.
  // Compact: key tiles of 32, (128 + 2 x 32) rows of 264 bf16 = 99 KB.
  static constexpr int kFwdRowTiles = D <= 128 ? 2 : 1;
  static constexpr int kFwdWarps = kWarps * (D <= 128 ? 1 : 2);
  static constexpr int kFwdThreads = 32 * kFwdWarps;
  static constexpr int kFwdBlockM = 16 * kFwdRowTiles * kFwdWarps;
  static constexpr int kFwdBlockN = kCompact ? 32 : 64;
  // Backward: a warp owns 16 keys (kBwdGroups groups of 16 a block); query tiles of
  // kBwdBlockM. Above D 128, kBwdSplit warps share each 16 keys, one part of the head
  // dim's columns each (flash_bwd.cuh). Compact: 2 groups, 32 keys by 32 queries (71 KB).
  static constexpr int kBwdGroups = kCompact ? 2 : kWarps;
  static constexpr int kBwdBlockN = 16 * kBwdGroups;
  static constexpr int kBwdBlockM = kBwdBlockN;
  static constexpr int kBwdSplit = D <= 128 ? 1 : 2;
  static constexpr int kBwdThreads = 32 * kBwdGroups * kBwdSplit;
  static_assert(kBwdBlockM == kBwdBlockN, "kPitchS pitches dS both ways");
  static constexpr int kPitchS = kBwdBlockN + 8;  // the backward's dS tile ([query][key], or [key][query])
};

// The most dynamic shared memory a launch may give a block here: the current device's (0
// without a device), at most the cap set by dtrain_attention_set_smem_cap (flash_api.cu).
size_t device_block_smem();

template <typename T, int D>
cudaError_t run_flash_fwd(const dtrain_attention_fwd_params& p, cudaStream_t stream);
template <typename T, int D>
cudaError_t run_flash_fwd_sm90(const dtrain_attention_fwd_params& p, cudaStream_t stream);  // wgmma
template <typename T, int D>
cudaError_t run_flash_bwd(const dtrain_attention_bwd_params& p, cudaStream_t stream);
template <typename T, int D>
cudaError_t run_flash_bwd_sm90(const dtrain_attention_bwd_params& p, cudaStream_t stream);  // wgmma
// The dynamic shared memory of a block of each, in the tiles its launcher picks on the
// current device (instantiated with it).
template <typename T, int D>
size_t flash_fwd_smem_bytes();
template <typename T, int D>
size_t flash_fwd_sm90_smem_bytes();
template <typename T, int D>
size_t flash_bwd_smem_bytes();
template <typename T, int D>
size_t flash_bwd_sm90_smem_bytes();

// A block's (batch, head, rank) in a grid launched as (tiles, heads, batch) (heads: the q
// heads in the forward, the kv heads in the backward). kSectioned: in tile_order, for
// sections of `section` pairs. Else the launch order as it is (rank = blockIdx.x), which
// costs no division: the mma.sync kernels take that, since at 255 registers they have no
// room to hold divided-out coordinates (blockIdx is re-read at will).
struct BlockCoords {
  int64_t b, head, rank;
};
// Block number `block` of such a grid in tile_order (a persistent kernel's loop index).
__host__ __device__ inline BlockCoords sectioned_coords(int64_t block, int64_t tiles, int64_t heads, int64_t batch,
                                                        int64_t section) {
  const TileOrder o = tile_order(block, tiles, heads * batch, section);
  return {o.pair / heads, o.pair % heads, o.rank};
}
template <bool kSectioned>
__device__ __forceinline__ BlockCoords block_coords(int64_t section) {
  if constexpr (kSectioned) {
    const int64_t block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    return sectioned_coords(block, gridDim.x, gridDim.y, gridDim.z, section);
  } else {
    return {blockIdx.z, blockIdx.y, blockIdx.x};
  }
}

// Query row i is token i + query_offset of the keys' sequence (causal only; 0 otherwise):
// causal attention lets it see keys j <= i + query_offset.
// Sliding windows (window W > 0): query i sees keys i + O - W < j <= i + O, or without
// causal (O = 0) i - W < j < i + W.
// window_first_key: the first key query `row` sees (0 without a window).
// window_query_end: one past the last query that sees key `key` (seq_q without one).
template <typename Params>
__host__ __device__ __forceinline__ int64_t window_first_key(const Params& p, int64_t row) {
  return p.window > 0 ? imax(0, row + p.query_offset - p.window + 1) : 0;
}
template <typename Params>
__host__ __device__ __forceinline__ int64_t window_query_end(const Params& p, int64_t key) {
  return p.window > 0 ? imax(0, imin(p.seq_q, key + p.window - p.query_offset)) : p.seq_q;
}

// Packed documents (p.documents): token t of batch b's row (the keys are tokens [0,
// seq_k), the queries [query_offset, query_offset + seq_q)) belongs to [start, end).
// document_start: the first key of query row i's document; document_end: one past the last
// query row that key j's document holds. Without causal (and so without a query offset,
// a token being query and key alike) a query sees its whole document, the later keys too:
// document_key_end, one past the last key query row i's document holds, and
// document_first_query, the first query row of key j's document, bound the other sides.
// Positions past the row read its last token's (a padding row or key, masked anyway);
// values are clamped into the sequence, so that wrong ones give a wrong mask but never a
// read out of bounds.
template <typename Params>
__host__ __device__ __forceinline__ int64_t document_row_tokens(const Params& p) {
  return p.documents.stride > 0 ? p.documents.stride : p.seq_k;
}
template <typename Params>
__device__ __forceinline__ const int32_t* document_row(const int32_t* a, const Params& p, int64_t b, int64_t token) {
  const int64_t row = document_row_tokens(p);
  return a + b * row + imin(token, row - 1);
}
template <typename Params>
__device__ __forceinline__ int64_t document_start(const Params& p, int64_t b, int64_t i) {
  return imax(0, *document_row(p.documents.start, p, b, i + p.query_offset));
}
template <typename Params>
__device__ __forceinline__ int64_t document_end(const Params& p, int64_t b, int64_t j) {
  return imax(0, imin(p.seq_q, *document_row(p.documents.end, p, b, j) - p.query_offset));
}
template <typename Params>
__device__ __forceinline__ int64_t document_key_end(const Params& p, int64_t b, int64_t i) {
  return imax(0, imin(p.seq_k, *document_row(p.documents.end, p, b, i + p.query_offset)));
}
template <typename Params>
__device__ __forceinline__ int64_t document_first_query(const Params& p, int64_t b, int64_t j) {
  return imax(0, imin(p.seq_q, *document_row(p.documents.start, p, b, j) - p.query_offset));
}
// Whether the documents or the window bound a query's keys from the right and a key's
// queries from the left (without causal), where causal attention has its diagonal.
template <typename Params>
__host__ __device__ __forceinline__ bool bidirectional_bounds(const Params& p) {
  return !p.causal && (p.window > 0 || p.documents.start != nullptr);
}

// What a query row sees of the keys from the left, and a key of the queries to the right,
// under the window and the documents together: the first key `row` sees, and one past the
// last query that sees `key`. Both are non-decreasing, so a block's first row and last key
// bound its walk.
template <typename Params>
__device__ __forceinline__ int64_t first_key(const Params& p, int64_t b, int64_t row) {
  const int64_t w = window_first_key(p, row);
  return p.documents.start != nullptr ? imax(w, document_start(p, b, row)) : w;
}
template <typename Params>
__device__ __forceinline__ int64_t query_end(const Params& p, int64_t b, int64_t key) {
  const int64_t w = window_query_end(p, key);
  return p.documents.end != nullptr ? imin(w, document_end(p, b, key)) : w;
}
// The other sides: one past the last key `row` sees (causal: its diagonal; else the
// earlier of its document's end and its window's, or every key), and the first query that
// sees `key` (causal: the diagonal's; else the later of its document's start and its
// window's, or 0). Both are non-decreasing too, so a block's last row and first key bound
// its walk. (A padding row past seq_q reads a later token's end: a longer walk for the
// last block, masked; its clamp cost the Hopper forward's producer 8 bytes more of spill.)
template <typename Params>
__device__ __forceinline__ int64_t key_end(const Params& p, int64_t b, int64_t row) {
  if (p.causal) return imin(p.seq_k, row + p.query_offset + 1);
  const int64_t w = p.window > 0 ? imin(p.seq_k, row + p.window) : p.seq_k;
  return p.documents.end != nullptr ? imin(w, document_key_end(p, b, row)) : w;
}
template <typename Params>
__device__ __forceinline__ int64_t first_query(const Params& p, int64_t b, int64_t key) {
  if (p.causal) return imax(0, key - p.query_offset);
  const int64_t w = p.window > 0 ? imax(0, key - p.window + 1) : 0;
  return p.documents.start != nullptr ? imax(w, document_first_query(p, b, key)) : w;
}

// The query tiles of kBlockM a backward block of keys [n0, n0 + kBlockN) of batch b walks,
// per query head: from m_begin (the tile holding the first query that sees its first key,
// since the queries before it see none of its keys), n_tiles of them, up to the last query
// that sees its last key.
template <int kBlockM, int kBlockN>
struct BwdQueryTiles {
  int64_t m_begin;
  int n_tiles;
  __device__ __forceinline__ BwdQueryTiles(const dtrain_attention_bwd_params& p, int64_t b, int64_t n0)
      : m_begin(first_query(p, b, n0) / kBlockM * kBlockM) {
    const int64_t m_end = query_end(p, b, n0 + kBlockN - 1);
    n_tiles = m_begin < m_end ? static_cast<int>((m_end - m_begin + kBlockM - 1) / kBlockM) : 0;
  }
};

// One launch of a backward kernel: the block of rank r (of gridDim.x key blocks) takes key
// block first_tile + r. In the deterministic backward (run_bwd_passes), which launches the
// key blocks `slices` at a time, it adds its dQ into a float32 buffer of its own, r
// dq_slice floats on (dq_of; the kernels' kSliced instances): each element of a slice then
// gets at most one addition per launch, and launches follow each other on the stream.
// Otherwise every block adds into the same one, in whatever order they finish.
struct BwdLaunch {
  int64_t first_tile, dq_slice;
  // The dq buffer of the block of keys n0.. (an instance of its own: the register-bound
  // kernels spilled with it computed in their loops, even where dq_slice is 0).
  template <int kBlockN, bool kSliced>
  __device__ __forceinline__ float* dq_of(float* dq_accum, int64_t n0) const {
    return kSliced ? dq_accum + (n0 / kBlockN - first_tile) * dq_slice : dq_accum;
  }
};

// The keys a backward block owns, as (b, hk, n0): a causal key block sees fewer query
// tiles the later it starts, so rank r is key block first_tile + r; a section's pairs
// share their heads' Q, dO and float32 dQ in L2.
struct BwdBlock {
  int64_t b, hk, n0;
};
template <typename T, int kBlockN, bool kSectioned, bool kSliced>
__device__ __forceinline__ BwdBlock bwd_block(const dtrain_attention_bwd_params& p, const BwdLaunch& l) {
  const int64_t group = p.heads / p.kv_heads;
  const BlockCoords c =
      block_coords<kSectioned>(section_pairs(p.causal, group * p.seq_q * p.head_dim * (2 * int64_t{sizeof(T)} + 4)));
  return {c.b, c.head, ((kSliced ? l.first_tile : 0) + c.rank) * kBlockN};  // one launch unless sliced
}

// The backward's workspace: float32 dq, then delta = rowsum(dout * o) [batch, heads,
// seq_q]. dq's part is sized for the larger of its two layouts (flash_bwd.cuh: DqRows,
// DqTiles): each (batch, head)'s rows rounded up to whole tiles of kDqTileRows, of the
// larger of the two kernels' head dims floats each.
constexpr int kDqTileRows = 64;
inline size_t flash_bwd_dq_floats(const dtrain_attention_bwd_params& p) {
  const size_t rows = static_cast<size_t>((p.seq_q + kDqTileRows - 1) / kDqTileRows * kDqTileRows);
  return static_cast<size_t>(p.batch) * static_cast<size_t>(p.heads) * rows *
         static_cast<size_t>(imax(wgmma_kernel_dim(p.head_dim), mma_kernel_dim(p.head_dim)));
}
// The deterministic backward keeps one dq buffer per key block of a launch (BwdLaunch):
// slices of flash_bwd_dq_slice_floats (a multiple of every kernel head dim and of 4), as
// many as make a launch's grid cover the device's SMs once (device_sms), at most one per
// key tile of 32 keys (the smallest any backward kernel takes), and no more than
// kDqSlicesBytes together unless one alone is more; 1 otherwise.
int device_sms();
constexpr size_t kDqSlicesBytes = size_t{2} << 30;
inline size_t flash_bwd_dq_slice_floats(const dtrain_attention_bwd_params& p) {
  return (flash_bwd_dq_floats(p) + 767) / 768 * 768;
}
inline int64_t flash_bwd_dq_slices(const dtrain_attention_bwd_params& p) {
  if (!p.deterministic) return 1;
  const int64_t pairs = p.batch * p.kv_heads;
  const int64_t fit = static_cast<int64_t>(kDqSlicesBytes / (sizeof(float) * flash_bwd_dq_slice_floats(p)));
  return imax(1, imin(imin((p.seq_k + 31) / 32, (device_sms() + pairs - 1) / pairs), fit));
}
inline size_t flash_bwd_workspace_floats(const dtrain_attention_bwd_params& p) {
  return static_cast<size_t>(flash_bwd_dq_slices(p)) * flash_bwd_dq_slice_floats(p) +
         static_cast<size_t>(p.batch) * static_cast<size_t>(p.heads) * static_cast<size_t>(p.seq_q);
}

// Logit soft-capping on score tiles (either pass's layout): s, before the softmax scale,
// becomes (c / scale) tanh(s scale / c), so that the softmax sees c tanh(s scale / c). It
// comes before the mask, whose -inf it would turn into -c.
template <int kN>
__device__ __forceinline__ void softcap_scores(float (&s)[kN][4], float scale, float cap) {
  const float in = scale / cap, out = cap / scale;
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = out * fast_tanh(s[nt][e] * in);
  }
}

}  // namespace dtrain_kernels
