// The kernel cases (kernel_cases.hpp) on the CPU emulator of the kernels' own sources
// (kernels/emulator): the entry points of the emulated build, host tensors. Runs on every
// machine; proves the kernels' logic (indexing, masking, online softmax, reductions,
// barriers, the batching of launches), not their speed.
#define DTRAIN_KERNELS_EMULATE  // the dtrain_emu_* entry points
#include "kernel_cases.hpp"

#include <set>
#include <utility>

#include "attention/tile_order.cuh"

namespace {

// tile_order's map from launch index to (pair, rank): every tile of every pair exactly
// once; with section 1, the launch order itself (a pair's tiles in a row); else sections
// (runs of launch indices that end where the rank drops) of contiguous pairs in order, as
// few as `section` allows, sizes within one of each other and never shrinking, ranks never
// decreasing within one (every pair's heaviest tile first).
TEST(TileOrder, EveryTileOnceInSectionsHeaviestFirst) {
  using dtrain_kernels::tile_order;
  for (int64_t tiles = 1; tiles <= 7; ++tiles) {
    for (int64_t pairs = 1; pairs <= 13; ++pairs) {
      for (int64_t section = 1; section <= 15; ++section) {
        SCOPED_TRACE(std::to_string(tiles) + " tiles, " + std::to_string(pairs) + " pairs, section " +
                     std::to_string(section));
        std::set<std::pair<int64_t, int64_t>> seen;
        std::vector<std::pair<int64_t, int64_t>> runs;  // (first pair, last pair) of each section
        int64_t prev_rank = -1;
        for (int64_t block = 0; block < tiles * pairs; ++block) {
          const auto o = tile_order(block, tiles, pairs, section);
          ASSERT_TRUE(o.pair >= 0 && o.pair < pairs && o.rank >= 0 && o.rank < tiles) << block;
          EXPECT_TRUE(seen.insert({o.pair, o.rank}).second) << "block " << block << " repeats a tile";
          if (section == 1) {
            EXPECT_EQ(o.pair * tiles + o.rank, block);
          }
          if (tiles == 1) {
            EXPECT_EQ(o.pair, block);
          }
          if (runs.empty() || o.rank < prev_rank) {
            EXPECT_TRUE(runs.empty() || o.pair == runs.back().second + 1) << "block " << block;
            runs.emplace_back(o.pair, o.pair);
          } else {
            EXPECT_GE(o.pair, runs.back().first) << "block " << block << ": a pair of an earlier section";
            runs.back().second = std::max(runs.back().second, o.pair);
          }
          prev_rank = o.rank;
        }
        EXPECT_EQ(static_cast<int64_t>(seen.size()), tiles * pairs);
        if (tiles == 1) continue;  // no rank drops: the runs are not visible
        EXPECT_EQ(static_cast<int64_t>(runs.size()), (pairs + section - 1) / section);
        for (std::size_t s = 0; s < runs.size(); ++s) {
          const int64_t size = runs[s].second - runs[s].first + 1;
          EXPECT_LE(size, section);
          if (s > 0) {
            const int64_t before = runs[s - 1].second - runs[s - 1].first + 1;
            EXPECT_TRUE(size == before || size == before + 1) << "section " << s << ": " << size << " after " << before;
          }
        }
      }
    }
  }
}

// section_pairs: 1 for work-even (non-causal) grids; else as many pairs as fit.
TEST(TileOrder, SectionsHoldWhatFitsTheBudget) {
  using dtrain_kernels::kL2SectionBytes;
  using dtrain_kernels::section_pairs;
  EXPECT_EQ(section_pairs(false, 1), 1);
  EXPECT_EQ(section_pairs(true, kL2SectionBytes / 4), 4);
  EXPECT_EQ(section_pairs(true, kL2SectionBytes / 4 + 1), 3);
  EXPECT_EQ(section_pairs(true, 2 * kL2SectionBytes), 1);
}

}  // namespace
