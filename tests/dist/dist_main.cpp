// MPI-aware GoogleTest main: one Runtime per process; only rank 0 prints the gtest report;
// failures are reduced across ranks by DistTest::TearDown.
#include <ATen/ATen.h>

#include "dist_test.hpp"

namespace dtrain::testing {

namespace {
Runtime* g_runtime = nullptr;
}

Runtime& runtime() { return *g_runtime; }

void DistTest::TearDown() {
  // Max over ranks of "this rank failed"; then the rank list for the message.
  at::Tensor failed = at::full({nranks()}, 0, at::kInt);
  failed[rank()] = HasFailure() ? 1 : 0;
  world()->all_reduce(failed, {ReduceOp::kSum})->wait();
  std::string who;
  for (int r = 0; r < nranks(); ++r) {
    if (failed[r].item<int>() != 0 && r != rank()) who += std::to_string(r) + " ";
  }
  if (!who.empty()) ADD_FAILURE() << "the test failed on rank(s) " << who;
}

}  // namespace dtrain::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    dtrain::Runtime rt(&argc, &argv, dtrain::RuntimeOptions{"mpi"});
    dtrain::testing::g_runtime = &rt;
    if (rt.rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    const int rc = RUN_ALL_TESTS();
    dtrain::testing::g_runtime = nullptr;
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist test main: %s\n", e.what());
    return 1;
  }
}
