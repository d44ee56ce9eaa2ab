// DataParallel against the single-process model: every rank trains a DataParallel copy on
// its slice of the global batch and, in the same process, a reference copy on the whole
// global batch; after 10 AdamW steps losses and parameters agree within 1e-5 (float32).
// Also: gradient accumulation equivalence, overlap with backward, unused parameters.
#include <torch/torch.h>

#include "dist_test.hpp"
#include "dtrain/parallel/data_parallel.hpp"

namespace dtrain::testing {
namespace {

constexpr std::int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4

torch::nn::Sequential make_model() {
  torch::manual_seed(1234);  // same initial weights everywhere
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 4));
}

NamedParameters named(torch::nn::Module& m) {
  NamedParameters out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

// Global batch of step `step`, the same on every rank.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = torch::randn({kGlobalBatch, 8}, gen);
  auto y = torch::randn({kGlobalBatch, 4}, gen);
  return {x, y};
}

class DdpTest : public DistTest {};

TEST_F(DdpTest, MatchesSingleProcessForTenSteps) {
  const int n = nranks(), r = rank();
  const std::int64_t local = kGlobalBatch / n;
  auto ref = make_model();
  auto model = make_model();
  AdamWOptions o;
  o.lr = 1e-2;
  auto ref_opt = make_adamw(named(*ref), o);
  auto opt = make_adamw(named(*model), o);
  DataParallelOptions dpo;
  dpo.bucket_bytes = 600;  // three buckets for this small model
  DataParallel ddp(named(*model), world(), dpo);
  EXPECT_EQ(ddp.stats().buckets, n > 1 ? 3 : 0);  // one rank: nothing to bucket
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = global_batch(step);
    ref_opt->zero_grad();
    auto ref_loss = torch::mse_loss(ref->forward(x), y);
    ref_loss.backward();
    ref_opt->step();

    opt->zero_grad();
    auto xs = x.slice(0, r * local, (r + 1) * local), ys = y.slice(0, r * local, (r + 1) * local);
    auto loss = torch::mse_loss(model->forward(xs), ys);
    ddp.set_sync(true);
    loss.backward();
    ddp.finish_gradient_sync();
    opt->step();
    at::Tensor mean_loss = loss.detach().clone();
    world()->all_reduce(mean_loss, {ReduceOp::kAvg})->wait();
    EXPECT_NEAR(mean_loss.item<float>(), ref_loss.item<float>(), 1e-5 * std::abs(ref_loss.item<float>()) + 1e-7)
        << "step " << step;
  }
  auto a = named(*model), b = named(*ref);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i].second, b[i].second, 1e-5, 1e-6))
        << a[i].first << " max diff " << (a[i].second - b[i].second).abs().max().item<float>();
  }
}

TEST_F(DdpTest, GradientAccumulationEqualsOneLargeBatch) {
  const int n = nranks(), r = rank();
  const std::int64_t local = kGlobalBatch / n;
  auto ref = make_model();
  auto model = make_model();
  DataParallel ddp(named(*model), world());
  auto [x, y] = global_batch(0);
  torch::mse_loss(ref->forward(x), y).backward();
  // Two micro-batches per rank, communication only on the second.
  const std::int64_t half = local / 2;
  auto xs = x.slice(0, r * local, (r + 1) * local), ys = y.slice(0, r * local, (r + 1) * local);
  const std::int64_t sizes[2] = {half, local - half};
  std::int64_t start = 0;
  for (int m = 0; m < 2; ++m) {
    if (sizes[m] == 0) continue;
    ddp.set_sync(m == 1);
    auto diff = model->forward(xs.slice(0, start, start + sizes[m])) -
                ys.slice(0, start, start + sizes[m]);
    auto loss = diff.pow(2).sum() / (local * 4);  // this rank's mean, split over micro-batches
    loss.backward();
    start += sizes[m];
  }
  ddp.finish_gradient_sync();
  auto a = named(*model), b = named(*ref);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i].second.grad(), b[i].second.grad(), 1e-5, 1e-6)) << a[i].first;
  }
}

TEST_F(DdpTest, BucketsAreIssuedDuringBackward) {
  auto model = make_model();
  DataParallelOptions dpo;
  dpo.bucket_bytes = 512;
  DataParallel ddp(named(*model), world(), dpo);
  auto [x, y] = global_batch(0);
  torch::mse_loss(model->forward(x), y).backward();
  const auto stats = ddp.stats();
  ddp.finish_gradient_sync();
  if (nranks() == 1) {
    EXPECT_EQ(stats.buckets, 0) << "one rank needs no all-reduce";
    return;
  }
  EXPECT_GE(stats.launched_during_backward, 1);
  EXPECT_LT(stats.grads_before_first_launch, static_cast<std::int64_t>(named(*model).size()))
      << "the first all-reduce must start before the last gradient is computed";
}

TEST_F(DdpTest, UnusedParameterIsNamed) {
  auto model = make_model();
  auto extra = torch::zeros({3}, torch::requires_grad());
  auto params = named(*model);
  params.emplace_back("head.unused", extra);
  {
    DataParallel ddp(params, world());
    auto [x, y] = global_batch(0);
    torch::mse_loss(model->forward(x), y).backward();
    try {
      ddp.finish_gradient_sync();
      ADD_FAILURE() << "no error for the unused parameter";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("head.unused"), std::string::npos) << e.what();
    }
  }
  world()->barrier()->wait();  // the failed sync's launched buckets finish on every rank
  for (auto& [name, p] : params) p.mutable_grad() = at::Tensor();
  DataParallelOptions allow;
  allow.allow_unused = true;
  DataParallel ddp(params, world(), allow);
  auto [x, y] = global_batch(1);
  torch::mse_loss(model->forward(x), y).backward();
  ddp.finish_gradient_sync();
  EXPECT_TRUE(extra.grad().defined());
  EXPECT_EQ(extra.grad().abs().sum().item<float>(), 0.0f);
}

TEST_F(DdpTest, CommCheckVerifiesIdenticalParametersAtStart) {
  const int n = nranks(), r = rank();
  ::setenv(env::kCommCheck, "1", 1);
  auto model = make_model();
  if (r == n - 1 && n > 1) {
    torch::NoGradGuard no_grad;
    model->parameters()[0].add_(1.0);  // the last rank diverges
  }
  DataParallelOptions no_broadcast;
  no_broadcast.broadcast_parameters = false;
  try {
    DataParallel ddp(named(*model), world(), no_broadcast);
    EXPECT_EQ(n, 1) << "diverged parameters were not reported";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("parameters differ across ranks at start"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(n - 1) + " (sum"), std::string::npos) << e.what();
  }
  DataParallel ddp(named(*model), world());  // broadcast first: identical, no error
  ::unsetenv(env::kCommCheck);
}

}  // namespace
}  // namespace dtrain::testing
