// Shared fixture for multi-rank tests: the process's Runtime, and a TearDown that reduces
// failures across ranks so that a failure on any rank fails the test on every rank.
// Rule for test bodies: EXPECT_* (not ASSERT_*) before collectives, so that no rank
// returns early while its peers wait in a collective.
#pragma once

#include <gtest/gtest.h>


#include "common/errors.hpp"
#include "dtrain/dtrain.hpp"

namespace dtrain::testing {

// The runtime created by dist_main before RUN_ALL_TESTS.
Runtime& runtime();

class DistTest : public ::testing::Test {
 protected:
  CommPtr world() { return runtime().cpu_world(); }
  int rank() { return runtime().rank(); }
  int nranks() { return runtime().size(); }
  void TearDown() override;
};

}  // namespace dtrain::testing
