// NCCL backend on one GPU (world size 1, a real NCCL communicator): collectives, stream
// ordering of wait(), split and argument checks. Skipped without a GPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include "comm/nccl_communicator.hpp"
#include "dtrain/core/error.hpp"

namespace dtrain {
namespace {

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (detail::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    comm_ = detail::make_nccl_world(0, 1, 0, [](std::string&) {}, Timeout(60000),
                                    /*keep_size_one=*/true);
  }
  at::TensorOptions cuda(c10::ScalarType t) const {
    return at::TensorOptions().dtype(t).device(at::kCUDA, 0);
  }
  CommPtr comm_;
};

TEST_F(NcclTest, CollectivesAtWorldSizeOne) {
  ASSERT_EQ(comm_->backend(), Backend::kNccl);
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong,
                     at::kByte}) {
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
      at::Tensor t = at::arange(10, cuda(dtype));
      comm_->all_reduce(t, {op})->wait();
      EXPECT_TRUE(at::equal(t.cpu(), at::arange(10, dtype))) << dtype << " " << to_string(op);
    }
    at::Tensor in = at::arange(6, cuda(dtype));
    at::Tensor out = at::zeros({6}, cuda(dtype));
    comm_->all_gather(out, in)->wait();
    EXPECT_TRUE(at::equal(out, in));
    out.zero_();
    comm_->reduce_scatter(out, in)->wait();
    EXPECT_TRUE(at::equal(out, in));
    out.zero_();
    comm_->all_to_all(out, in)->wait();
    EXPECT_TRUE(at::equal(out, in));
    comm_->broadcast(in, {0})->wait();
    EXPECT_TRUE(at::equal(in.cpu(), at::arange(6, dtype)));
  }
  comm_->barrier()->synchronize();
}

TEST_F(NcclTest, WaitOrdersTheCallersStream) {
  // An out-of-place all_gather (a 256 MiB copy on the communicator's stream) and then a
  // kernel on the caller's stream that overwrites its output: with wait() ordering the two,
  // the output ends as 3s; without it the copy could land last and leave 1s.
  auto side = c10::cuda::getStreamFromPool(false, 0);
  at::Tensor in, out;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    in = at::ones({1 << 26}, cuda(at::kFloat));
    out = at::zeros({1 << 26}, cuda(at::kFloat));
    auto w = comm_->all_gather(out, in);
    w->wait();
    out.fill_(3);
  }
  side.synchronize();
  EXPECT_EQ(out.min().item<float>(), 3.0f);
}

TEST_F(NcclTest, RejectsCpuTensorsWithANamedError) {
  try {
    comm_->all_reduce(at::ones({4}));
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("takes tensors on cuda:0"), std::string::npos) << e.what();
  }
}

TEST_F(NcclTest, SplitGivesSelfForOneMember) {
  auto child = comm_->split(0, 0, "child");
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->size(), 1);
  EXPECT_EQ(comm_->split(-1, 0, "none"), nullptr);
}

}  // namespace
}  // namespace dtrain
