// The size-1 (Self) communicator: every collective is the identity or a local copy, and
// argument validation is the same as on every backend.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/core/error.hpp"

namespace dtrain {
namespace {

TEST(SelfCommunicator, CollectivesAreIdentities) {
  auto c = make_self_communicator("solo", 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->backend(), Backend::kSelf);
  at::Tensor t = at::arange(6, at::kFloat);
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    auto w = c->all_reduce(t, {op});
    EXPECT_TRUE(w->completed());
    w->wait();
    EXPECT_TRUE(at::equal(t, at::arange(6, at::kFloat)));
  }
  at::Tensor out = at::zeros({6});
  c->all_gather(out, t)->wait();
  EXPECT_TRUE(at::equal(out, t));
  out.zero_();
  c->reduce_scatter(out, t)->wait();
  EXPECT_TRUE(at::equal(out, t));
  out.zero_();
  c->all_to_all(out.view({6, 1}), t.view({6, 1}), {{6}, {6}})->wait();
  EXPECT_TRUE(at::equal(out, t));
  c->broadcast(t, {0})->wait();
  c->barrier()->wait();
  EXPECT_EQ(c->seq(), 9u);
  auto child = c->split(0, 0, "child");
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->backend(), Backend::kSelf);
  EXPECT_EQ(c->split(-1, 0, "none"), nullptr);
}

TEST(SelfCommunicator, ValidationNamesArgumentAndAllowedValues) {
  auto c = make_self_communicator("solo", 0);
  auto msg = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(msg([&] { c->broadcast(at::ones({2}), {1}); })
                .find("root=1 is out of range; allowed: 0..0"),
            std::string::npos);
  EXPECT_NE(msg([&] { c->all_reduce(at::ones({2}, at::kComplexFloat)); })
                .find("allowed: float32, float64, bfloat16, float16, int32, int64, uint8"),
            std::string::npos);
  EXPECT_NE(msg([&] { c->all_gather(at::ones({3}), at::ones({2})); })
                .find("'output' has 3 elements; it must hold size() x input.numel() = 1 x 2 = 2"),
            std::string::npos);
  EXPECT_NE(msg([&] { c->all_gather(at::ones({2}, at::kDouble), at::ones({2})); })
                .find("'output' dtype Double differs from 'input' dtype Float"),
            std::string::npos);
  EXPECT_NE(msg([&] { c->all_to_all(at::ones({2, 1}), at::ones({2, 1}), {{2}, {1}}); })
                .find("input_splits [1] add up to 1 rows but the tensor has 2 rows"),
            std::string::npos);
  EXPECT_NE(msg([&] { c->all_to_all(at::ones({2, 1}), at::ones({2, 1}), {{2}, {-1}}); })
                .find("input_splits[0]=-1 is negative"),
            std::string::npos);
  EXPECT_NE(msg([&] { c->send(at::ones({2}), 0); }).find("dst=0 is this rank"), std::string::npos);
  EXPECT_NE(msg([&] { c->all_reduce(at::Tensor()); }).find("undefined tensor"), std::string::npos);
  EXPECT_NE(msg([&] { c->all_reduce(at::ones({3, 3}).t()); }).find("must be contiguous"),
            std::string::npos);
  EXPECT_EQ(c->seq(), 0u) << "rejected calls do not consume sequence numbers";
}

TEST(Types, ReduceOpNamesRoundTrip) {
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    EXPECT_EQ(parse_reduce_op(to_string(op)), op);
  }
  try {
    parse_reduce_op("prod");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'prod' is not known; allowed: sum, avg, max, min"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace dtrain
