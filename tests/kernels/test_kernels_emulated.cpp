// The kernel cases (kernel_cases.hpp) on the CPU emulator of the kernels' own sources
// (kernels/emulator): the entry points of the emulated build, host tensors. Runs on every
// machine; proves the kernels' logic (indexing, masking, online softmax, reductions,
// barriers, the batching of launches), not their speed.
#define DTRAIN_KERNELS_EMULATE  // the dtrain_emu_* entry points
#include "kernel_cases.hpp"

#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <utility>

#include "attention/tile_order.cuh"
#include "emulator/simt.hpp"

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

// The emulator's race check (kernels/emulator/simt.cpp): a read of shared memory through
// ldmatrix, a wgmma descriptor or a bulk reduction must be ordered after every store another
// warp made there, by __syncthreads, a named barrier or an mbarrier. The barriers the
// emulator adds inside ldmatrix and wgmma order nothing (the hardware's wgmma issue is not a
// barrier). A race shows when the emulator runs the store before the read, as the first
// pass here does (warp 0 first).
namespace emu = dtrain_emu;

// What a launch of `body` on one block of `threads` threads throws ("" when nothing).
std::string launch_error(int threads, const std::function<void()>& body) {
  try {
    emu::launch(dim3(1), dim3(threads), 4096, body);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
unsigned char* smem() { return static_cast<unsigned char*>(emu::dynamic_smem()); }
int tid() { return static_cast<int>(emu::thread_idx.x); }
int warp() { return tid() / 32; }
void store_my_row() { std::memset(smem() + 16 * tid(), tid() + 1, 16); }  // thread t: bytes [16 t, 16 t + 16)
void ldmatrix_rows_of(int w) {  // lane l gives row 32 w + l
  std::uint32_t out[4];
  emu::ldmatrix_x4(out, smem() + 16 * (32 * w + emu::lane()), false);
}
void expect_race(const std::string& error, const std::string& what) {
  EXPECT_NE(error.find("race: " + what + " of warp"), std::string::npos) << error;
}

// The emulated stmatrix (the Hopper backward stores dS with it) is checked against the PTX
// ISA's fragment layout directly and against ldmatrix, whose emulation the GPU runs of the
// mma.sync kernels confirm: a warp stores four matrices of distinct values, each lane finds
// its row where the layout puts it, and ldmatrix of the same rows gives the fragments back.
TEST(EmulatorFragments, StmatrixStoresWhatLdmatrixLoads) {
  for (bool trans : {false, true}) {
    const std::string error = launch_error(32, [trans] {
      const int l = emu::lane();
      auto elem = [](int m, int r, int c) { return static_cast<std::uint32_t>(256 * m + 8 * r + c + 1); };
      std::uint32_t in[4], back[4];
      for (int m = 0; m < 4; ++m) in[m] = elem(m, l / 4, 2 * (l % 4)) | elem(m, l / 4, 2 * (l % 4) + 1) << 16;
      void* row = smem() + 16 * l;  // row l % 8 of matrix l / 8
      emu::stmatrix_x4(in, row, trans);
      std::uint16_t got[8];
      std::memcpy(got, row, sizeof got);
      for (int c = 0; c < 8; ++c) {
        const std::uint32_t want = trans ? elem(l / 8, c, l % 8) : elem(l / 8, l % 8, c);
        if (got[c] != want) throw std::runtime_error("lane " + std::to_string(l) + " element " + std::to_string(c));
      }
      emu::ldmatrix_x4(back, row, trans);
      for (int m = 0; m < 4; ++m) {
        if (back[m] != in[m]) throw std::runtime_error("ldmatrix gives back another fragment");
      }
    });
    EXPECT_EQ(error, "") << (trans ? "trans" : "plain");
  }
}

TEST(EmulatorRaceCheck, LdmatrixOfAnotherWarpsStoresNeedsABarrier) {
  EXPECT_EQ(launch_error(64, [] {
              store_my_row();
              ldmatrix_rows_of(warp());  // its own warp's stores
            }),
            "");
  expect_race(launch_error(64,
                           [] {
                             store_my_row();
                             ldmatrix_rows_of(1 - warp());
                           }),
              "ldmatrix");
  EXPECT_EQ(launch_error(64, [] {
              store_my_row();
              __syncthreads();
              ldmatrix_rows_of(1 - warp());
            }),
            "");
}

TEST(EmulatorRaceCheck, NamedBarriersAndMbarriersOrderTheirArrivalsBeforeTheirWaits) {
  auto producer_consumer = [](int sync) {  // warp 0 stores, warp 1 reads
    return launch_error(64, [sync] {
      void* bar = smem() + 2048;
      if (sync == 2) {  // (the next pass runs warp 1 first: it waits before warp 0 stores)
        if (tid() == 0) emu::mbarrier_init(bar, 32);
        __syncthreads();
      }
      if (warp() == 0) {
        store_my_row();
        if (sync == 1) emu::named_barrier_arrive(1, 64);
        if (sync == 2) emu::mbarrier_arrive(bar);
      } else {
        if (sync == 1) emu::named_barrier_sync(1, 64);
        if (sync == 2) emu::mbarrier_wait(bar, 0);
        ldmatrix_rows_of(0);
      }
    });
  };
  expect_race(producer_consumer(0), "ldmatrix");
  EXPECT_EQ(producer_consumer(1), "");
  EXPECT_EQ(producer_consumer(2), "");
}

TEST(EmulatorRaceCheck, BulkReductionSourcesNeedABarrier) {
  std::vector<float> sums(4, 0.f);
  auto run = [&](bool barrier) {
    return launch_error(64, [&, barrier] {
      if (warp() == 0) std::memset(smem() + 4 * tid(), 0, 4);  // 32 floats of 0
      if (barrier) __syncthreads();
      if (tid() == 32) {
        emu::fence_proxy_async();
        emu::bulk_reduce_add_f32(sums.data(), smem() + 16, 16);
        emu::bulk_commit();
        emu::bulk_wait(0);
      }
    });
  };
  expect_race(run(false), "a bulk reduction");
  EXPECT_EQ(run(true), "");
  EXPECT_EQ(sums, std::vector<float>(4, 0.f));
}

// B (16 x 8, K-major, no swizzle: two 8 x 8 core matrices of 128 bytes, the second 128 bytes
// on along K) stored by warp 0 and read by the whole warpgroup's wgmma; A from registers.
TEST(EmulatorRaceCheck, WgmmaOperandsStoredByOtherWarpsNeedABarrier) {
  auto run = [](bool barrier) {
    return launch_error(128, [barrier] {
      if (warp() == 0) std::memset(smem() + 8 * emu::lane(), 0, 8);  // bytes [0, 256)
      if (barrier) __syncthreads();
      const std::uint64_t desc_b = (std::uint64_t{128} >> 4) << 16 | (std::uint64_t{256} >> 4) << 32;
      const std::uint32_t a[4] = {0, 0, 0, 0};
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      emu::fence_proxy_async();
      emu::wgmma_fence();
      emu::wgmma(d, 8, 0, a, desc_b, false, false, true);
      emu::wgmma_commit();
      emu::wgmma_wait(0);
      if (d[0] != 0.f) throw std::runtime_error("wrong product");
    });
  };
  expect_race(run(false), "a wgmma");
  EXPECT_EQ(run(true), "");
}

}  // namespace
