// Pipeline schedules: for many (p, m, v), every schedule passes validate() (forward before
// backward, one whole backward per micro-batch and chunk, matching message orders between
// adjacent virtual stages) and runs to completion in the simulator (no deadlock); 1f1b holds
// at most min(p - rank, m) micro-batches in flight (gpipe m, zb p); with equal-cost stages
// the simulated bubble equals the closed forms; messages between two ranks leave in the
// order the receiver takes them (NCCL); exact lists for small shapes; validate() and
// simulate() catch broken schedules; shape errors name the option.
#include <gtest/gtest.h>

#include "common/errors.hpp"
#include "dtrain/parallel/pipeline_partition.hpp"
#include "dtrain/parallel/pipeline_schedule.hpp"

namespace dtrain::pp {
namespace {

std::string text(const StageActions& a) {
  std::string s;
  for (const auto& x : a) {
    s += (s.empty() ? "" : " ") + std::string(to_string(x.op)) + std::to_string(x.microbatch);
    if (x.chunk > 0) s += "." + std::to_string(x.chunk);
  }
  return s;
}

// Costs with equal stages: a chunk does 1/v of a stage's work; B = Bi + W = 2 F.
ActionCosts costs_for(const ScheduleShape& s) {
  ActionCosts c;
  const double v = s.virtual_stages;
  c.forward = 1 / v, c.backward = 2 / v, c.backward_input = 1 / v, c.backward_weight = 1 / v;
  return c;
}

TEST(PipelineSchedule, EveryScheduleIsValidAndCompletesForManyShapes) {
  int checked = 0;
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                    ScheduleKind::kZeroBubble}) {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 13; ++m) {
        for (int v = 1; v <= (kind == ScheduleKind::kInterleaved ? 3 : 1); ++v) {
          const ScheduleShape shape{p, m, v};
          if (kind == ScheduleKind::kInterleaved && m % p != 0) continue;
          const auto schedule = make_schedule(kind, shape);
          const std::string where = std::string(to_string(kind)) + " p=" + std::to_string(p) +
                                    " m=" + std::to_string(m) + " v=" + std::to_string(v);
          EXPECT_EQ(validate(schedule, shape), "") << where;
          EXPECT_EQ(check_message_order(schedule, shape), "") << where;
          const auto sim = simulate(schedule, shape, costs_for(shape));
          EXPECT_TRUE(sim.completed) << where << ": " << sim.deadlock;
          for (int r = 0; r < p; ++r) {
            const int peak = sim.peak_in_flight[static_cast<std::size_t>(r)];
            if (kind == ScheduleKind::k1F1B) {
              EXPECT_LE(peak, std::min(p - r, m)) << where << " stage " << r;
            } else if (kind == ScheduleKind::kZeroBubble) {
              EXPECT_LE(peak, p) << where << " stage " << r;
            } else if (kind == ScheduleKind::kGPipe) {
              EXPECT_EQ(peak, m) << where;
            }
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 200);
}

// Order-matched messages (what NCCL, which ignores tags, needs): every generated schedule
// sends between any two ranks in the order the receiver receives (one chunk per rank: one
// kind of message per direction in micro-batch order; interleaved: Megatron's order is the
// same function on every rank; checked with the other properties above). validate() alone
// does not ensure it when several stage pairs share a rank pair: some swaps of two adjacent
// forwards of different chunks keep validate() happy and are caught here.
TEST(PipelineSchedule, MessageOrdersAgreeBetweenRanks) {
  // Every generated schedule: EveryScheduleIsValidAndCompletesForManyShapes.
  int caught = 0;
  for (int p : {2, 3}) {
    const ScheduleShape shape{p, 2 * p, 2};
    const auto good = make_schedule(ScheduleKind::kInterleaved, shape);
    for (int r = 0; r < p; ++r) {
      for (std::size_t i = 0; i + 1 < good[static_cast<std::size_t>(r)].size(); ++i) {
        auto bad = good;
        auto& list = bad[static_cast<std::size_t>(r)];
        if (list[i].op != Op::kForward || list[i + 1].op != Op::kForward || list[i].chunk == list[i + 1].chunk) continue;
        std::swap(list[i], list[i + 1]);
        if (!validate(bad, shape).empty()) continue;
        const auto order = check_message_order(bad, shape);
        EXPECT_NE(order.find("which receives"), std::string::npos) << "p=" << p << " rank " << r << " swap " << i;
        ++caught;
      }
    }
  }
  EXPECT_GT(caught, 0) << "no valid reordering found to check";
}

// Equal-cost stages: the simulated idle fraction is the closed form (enough micro-batches
// for a steady phase: m >= p).
TEST(PipelineSchedule, SimulatedBubbleEqualsTheory) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                    ScheduleKind::kZeroBubble}) {
    for (int p : {2, 3, 4, 8}) {
      for (int k : {1, 2, 4}) {
        for (int v : {1, 2, 4}) {
          if (v > 1 && kind != ScheduleKind::kInterleaved) continue;
          const ScheduleShape shape{p, k * p, v};
          const auto sim = simulate(make_schedule(kind, shape), shape, costs_for(shape));
          EXPECT_NEAR(sim.bubble, theory_bubble(kind, shape), 1e-9)
              << to_string(kind) << " p=" << p << " m=" << k * p << " v=" << v;
        }
      }
    }
  }
  // Zero bubble beats 1F1B at equal work, and interleaving shrinks the bubble v times.
  const ScheduleShape s{4, 8, 1};
  EXPECT_LT(theory_bubble(ScheduleKind::kZeroBubble, s), theory_bubble(ScheduleKind::k1F1B, s) / 2);
}

TEST(PipelineSchedule, SmallSchedulesInFull) {
  auto one = make_schedule(ScheduleKind::k1F1B, {2, 3, 1});
  EXPECT_EQ(text(one[0]), "F0 F1 B0 F2 B1 B2");
  EXPECT_EQ(text(one[1]), "F0 B0 F1 B1 F2 B2");
  auto gp = make_schedule(ScheduleKind::kGPipe, {2, 2, 1});
  EXPECT_EQ(text(gp[0]), "F0 F1 B0 B1");
  auto zb = make_schedule(ScheduleKind::kZeroBubble, {2, 3, 1});
  EXPECT_EQ(text(zb[0]), "F0 F1 Bi0 W0 F2 Bi1 W1 Bi2 W2");
  EXPECT_EQ(text(zb[1]), "F0 Bi0 F1 Bi1 W0 F2 Bi2 W1 W2");
  auto il = make_schedule(ScheduleKind::kInterleaved, {2, 2, 2});  // m == p: all warm-up
  EXPECT_EQ(text(il[0]), "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1");
  auto il4 = make_schedule(ScheduleKind::kInterleaved, {2, 4, 2});
  EXPECT_EQ(text(il4[1]), "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3");
}

TEST(PipelineSchedule, BrokenSchedulesAreCaught) {
  const ScheduleShape s{2, 2, 1};
  auto bad = make_schedule(ScheduleKind::kGPipe, s);
  std::swap(bad[1][0], bad[1][1]);  // stage 1: F1 before F0: orders differ from stage 0
  EXPECT_NE(validate(bad, s).find("different micro-batch orders"), std::string::npos) << validate(bad, s);
  auto missing = make_schedule(ScheduleKind::kGPipe, s);
  missing[0].pop_back();
  EXPECT_NE(validate(missing, s).find("micro-batch 1 chunk 0 runs [F]"), std::string::npos) << validate(missing, s);
  auto backward_first = make_schedule(ScheduleKind::kGPipe, s);
  std::swap(backward_first[0][0], backward_first[0][2]);
  EXPECT_NE(validate(backward_first, s).find("B of micro-batch 0 chunk 0 after []"), std::string::npos);
  // Valid orders, yet stage 0 waits for B0 while stage 1 waits for F1: a deadlock.
  std::vector<StageActions> dead = {
      {{Op::kForward, 0, 0}, {Op::kBackward, 0, 0}, {Op::kForward, 1, 0}, {Op::kBackward, 1, 0}},
      {{Op::kForward, 0, 0}, {Op::kForward, 1, 0}, {Op::kBackward, 0, 0}, {Op::kBackward, 1, 0}}};
  EXPECT_EQ(validate(dead, s), "");
  const auto sim = simulate(dead, s);
  EXPECT_FALSE(sim.completed);
  EXPECT_EQ(sim.deadlock, "stage 0 waits in B of micro-batch 0 chunk 0; stage 1 waits in F of micro-batch 1 chunk 0");
}

TEST(PipelineSchedule, ShapeErrorsNameTheOption) {
  EXPECT_NE(testing::error_message([] { parse_schedule("pipedream"); }).find("--pp-schedule 'pipedream' is not known; allowed: gpipe, 1f1b, interleaved, zb"), std::string::npos);
  EXPECT_NE(testing::error_message([] { make_schedule(ScheduleKind::kInterleaved, {4, 6, 2}); }).find("--microbatches=6 is not a multiple of --pp=4"), std::string::npos);
  EXPECT_NE(testing::error_message([] { make_schedule(ScheduleKind::k1F1B, {4, 8, 2}); }).find("--virtual-stages=2 needs --pp-schedule interleaved"), std::string::npos);
  EXPECT_NE(testing::error_message([] { make_schedule(ScheduleKind::kGPipe, {0, 8, 1}); }).find("--pp=0 must be at least 1"), std::string::npos);
  EXPECT_EQ(parse_schedule("zb"), ScheduleKind::kZeroBubble);
}

}  // namespace
}  // namespace dtrain::pp

namespace dtrain::pp {
namespace {

TEST(PipelinePartition, BalancesCostWithEmbeddingAndHead) {
  const std::vector<double> equal(8, 1.0);
  EXPECT_EQ(balanced_partition(equal, 0, 0, 3), (std::vector<int>{2, 3, 3}));
  EXPECT_EQ(balanced_partition(equal, 0, 0, 4), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(balanced_partition(equal, 0, 0, 8), (std::vector<int>(8, 1)));
  EXPECT_EQ(balanced_partition(equal, 0, 0, 1), (std::vector<int>{8}));
  // A heavy embedding on stage 0 (3 blocks' worth): the optimum max is 4 = embedding + 1
  // block; the rest spread evenly.
  EXPECT_EQ(balanced_partition(equal, 3, 0, 4), (std::vector<int>{1, 2, 2, 3}));
  // Embedding and head of 2 blocks each on 12 blocks over 4 stages: 16 units, 4 each.
  const std::vector<double> twelve(12, 1.0);
  EXPECT_EQ(balanced_partition(twelve, 2, 2, 4), (std::vector<int>{2, 4, 4, 2}));
  // Uneven block costs: the max stage cost is the smallest possible.
  const std::vector<double> uneven = {5, 1, 1, 1, 1, 5};
  const auto cut = balanced_partition(uneven, 0, 0, 3);
  EXPECT_EQ(cut, (std::vector<int>{1, 4, 1}));
}

TEST(PipelinePartition, ErrorsNameTheSizes) {
  const std::vector<double> four(4, 1.0);
  EXPECT_NE(testing::error_message([&] { balanced_partition(four, 0, 0, 5); })
                .find("5 virtual stages (--pp x --virtual-stages) but the model has 4 blocks"),
            std::string::npos);
  EXPECT_EQ(parse_partition("3,3,2", 8, 3), (std::vector<int>{3, 3, 2}));
  EXPECT_NE(testing::error_message([] { parse_partition("3,3,3", 8, 3); })
                .find("--pp-layers '3,3,3' lists 3 stages holding 9 blocks; allowed: 3 positive counts"),
            std::string::npos);
  EXPECT_NE(testing::error_message([] { parse_partition("4,x", 8, 2); }).find("'x' is not a positive block count"),
            std::string::npos);
  EXPECT_NE(testing::error_message([] { parse_partition("8,0", 8, 2); }).find("'0' is not a positive block count"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::pp
