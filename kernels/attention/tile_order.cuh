// The order in which an attention grid's blocks take their tiles (pure integer code, for
// host and device alike): causal grids start with their heaviest tiles, pair by pair within
// sections sized for L2, so that they end on light ones.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include <cstdint>

namespace dtrain_kernels {

// A grid has `tiles` blocks for each of `pairs` (batch, head) pairs, launched as
// (tiles, heads, batch); the hardware starts blocks in launch order (x fastest, then y, z)
// as SMs free up, so the order decides how the grid ends. Causal tiles differ in work (a
// forward query block sees as many key tiles as it is deep): one pair's tiles in a row
// would end the grid on the last pair's heaviest tile, an SM busy long after the others
// (7% of the forward at 4 x 16 heads x 4096, in a greedy model of 132 SMs). So causal grids
// go in sections of pairs whose shared operands fit in kL2SectionBytes, and within a
// section every pair's heaviest tile starts before any pair's next heaviest (largest work
// first: the grid ends on light tiles). Work-even grids keep one pair's tiles together.
#ifndef DTRAIN_KERNELS_EMULATE
constexpr int64_t kL2SectionBytes = int64_t{32} << 20;
#else
constexpr int64_t kL2SectionBytes = int64_t{64} << 10;  // so that the emulator's small cases span sections
#endif

// Rank 0 is a pair's heaviest tile (the caller maps ranks to tiles).
struct TileOrder {
  int64_t pair, rank;
};

// The pair and rank of the block with launch index `block`, for sections of at most
// `section` pairs (1: each pair's tiles in a row): as few sections as that allows, their
// sizes differing by one at most, the larger ones last (the grid ends on a full section).
__host__ __device__ inline TileOrder tile_order(int64_t block, int64_t tiles, int64_t pairs, int64_t section) {
  const int64_t sections = (pairs + section - 1) / section;
  const int64_t base = pairs / sections, small = sections - pairs % sections;  // `small` sections of `base`
  const int64_t boundary = small * base * tiles;
  int64_t first, g;  // the block's section: its first pair and its size
  if (block < boundary) {
    g = base;
    first = block / (base * tiles) * base;
  } else {
    g = base + 1;
    first = small * base + (block - boundary) / (g * tiles) * g;
  }
  const int64_t r = block - first * tiles;
  return {first + r % g, r / g};
}

// Pairs per section: as many as fit their `bytes_per_pair` of shared operands in
// kL2SectionBytes when causal, else 1.
__host__ __device__ inline int64_t section_pairs(bool causal, int64_t bytes_per_pair) {
  if (!causal) return 1;
  const int64_t n = kL2SectionBytes / (bytes_per_pair > 0 ? bytes_per_pair : 1);
  return n > 1 ? n : 1;
}

}  // namespace dtrain_kernels
