// Gradient clipping across ranks that hold distinct gradient shards equals clipping the
// whole gradient in one process (world sizes 1-4).
#include <ATen/ATen.h>

#include "dist_test.hpp"
#include "dtrain/optim/optim.hpp"

namespace dtrain::testing {
namespace {

class OptimTest : public DistTest {};

TEST_F(OptimTest, ShardedClipEqualsWholeClip) {
  const int n = nranks(), r = rank();
  at::manual_seed(3);  // same full gradient on every rank
  at::Tensor full = at::randn({12 * n}) * 4;
  at::Tensor param = at::zeros({12}).requires_grad_();
  param.mutable_grad() = full.slice(0, 12 * r, 12 * (r + 1)).clone();
  const double norm = clip_grad_norm({param}, 1.0, world().get());
  EXPECT_NEAR(norm, full.norm().item<double>(), 1e-4 * norm);
  at::Tensor clipped = full * (1.0 / (full.norm().item<double>() + 1e-6));
  EXPECT_TRUE(at::allclose(param.grad(), clipped.slice(0, 12 * r, 12 * (r + 1)), 1e-5, 1e-7));
  // Replicated gradients (data parallel): no communication, same answer everywhere.
  param.mutable_grad() = full.clone().slice(0, 0, 12).clone();
  const double local = clip_grad_norm({param}, 100.0);
  EXPECT_NEAR(local, full.slice(0, 0, 12).norm().item<double>(), 1e-4 * local);
}

}  // namespace
}  // namespace dtrain::testing
