// AdamW parameter groups, the cosine schedule and gradient clipping against LibTorch's;
// the dynamic loss scaler's schedule and clipping of loss-scaled gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "dtrain/core/error.hpp"
#include "dtrain/optim/loss_scaler.hpp"
#include "dtrain/optim/optim.hpp"

namespace dtrain {
namespace {

TEST(CosineSchedule, WarmupThenCosineThenFloor) {
  CosineSchedule s(1.0, 0.1, 10, 100);
  EXPECT_DOUBLE_EQ(s.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(4), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(9), 1.0);
  EXPECT_DOUBLE_EQ(s.lr(10), 1.0);
  EXPECT_NEAR(s.lr(55), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(s.lr(100), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(5000), 0.1);
  for (int i = 10; i < 100; ++i) EXPECT_LE(s.lr(i + 1), s.lr(i)) << "monotone after warm-up";
  EXPECT_DOUBLE_EQ(CosineSchedule(2.0, 0.0, 0, 10).lr(0), 2.0);
  EXPECT_THROW(CosineSchedule(1.0, 2.0, 0, 10), InvalidArgument);
  EXPECT_THROW(CosineSchedule(1.0, 0.1, 20, 10), InvalidArgument);
  EXPECT_THROW(CosineSchedule(0.0, 0.0, 0, 10), InvalidArgument);
}

TEST(ClipGradNorm, MatchesLibTorch) {
  torch::manual_seed(0);
  for (double max_norm : {0.5, 1e6}) {
    std::vector<at::Tensor> a, b;
    for (auto shape : {std::vector<std::int64_t>{7, 3}, {5}, {2, 2, 2}}) {
      auto p = torch::randn(shape, torch::requires_grad());
      p.mutable_grad() = torch::randn(shape);
      auto q = p.detach().clone().requires_grad_();
      q.mutable_grad() = p.grad().clone();
      a.push_back(p);
      b.push_back(q);
    }
    auto no_grad = torch::randn({3}, torch::requires_grad());  // skipped: no gradient
    a.push_back(no_grad);
    const double ours = clip_grad_norm(a, max_norm);
    const double ref = torch::nn::utils::clip_grad_norm_(b, max_norm);
    EXPECT_NEAR(ours, ref, 1e-5 * ref);
    for (std::size_t i = 0; i < b.size(); ++i) {
      EXPECT_TRUE(torch::allclose(a[i].grad(), b[i].grad(), 1e-5, 1e-7)) << i;
    }
  }
  EXPECT_THROW(clip_grad_norm(std::vector<at::Tensor>{}, 0.0), InvalidArgument);
}

// Groups (tensor parallelism): one global norm over every group's gradients, views
// included (a parameter split into tp-distinct and replicated elements), clipped in place.
TEST(ClipGradNorm, GroupsShareOneNormAndClipViewsInPlace) {
  auto g = torch::tensor({3.0f, 0.0f, 4.0f, 12.0f});
  GradGroup a{{g.narrow(0, 0, 2)}, {nullptr}}, b{{g.narrow(0, 2, 2)}, {}};
  const double norm = clip_grad_norm(std::vector<GradGroup>{a, b}, 6.5);
  EXPECT_NEAR(norm, 13.0, 1e-6);
  EXPECT_TRUE(torch::allclose(g, torch::tensor({1.5f, 0.0f, 2.0f, 6.0f}), 1e-5, 1e-6)) << g;
  // An uncounted group is clipped by the others' norm.
  auto copy = torch::tensor({12.0f});
  GradGroup c{{copy}, {}, /*counted=*/false};
  auto h = torch::tensor({3.0f, 4.0f});
  EXPECT_NEAR(clip_grad_norm(std::vector<GradGroup>{GradGroup{{h}, {}}, c}, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(copy.item<float>(), 12.0f / 5.0f, 1e-5);
}

// Gradients that carry a loss scale: one call unscales and clips, the same as unscaling
// first and then clipping; a non-finite norm (overflow) changes nothing.
TEST(ClipGradNorm, UnscalesAndClipsInOnePass) {
  torch::manual_seed(1);
  const double scale = 1024;
  for (double max_norm : {0.5, 1e6}) {
    auto p = torch::randn({6, 5}, torch::requires_grad());
    auto q = p.detach().clone().requires_grad_();
    const auto g = torch::randn({6, 5});
    p.mutable_grad() = g * scale;
    q.mutable_grad() = g.clone();
    const double scaled = clip_grad_norm({p}, max_norm, nullptr, scale);
    const double plain = clip_grad_norm({q}, max_norm);
    EXPECT_NEAR(scaled, plain, 1e-6 * plain);
    EXPECT_TRUE(torch::allclose(p.grad(), q.grad(), 1e-5, 1e-7)) << max_norm;
  }
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    auto p = torch::randn({4}, torch::requires_grad());
    p.mutable_grad() = torch::ones({4}) * 8;
    p.mutable_grad()[2] = bad;
    auto before = p.grad().clone();
    EXPECT_FALSE(std::isfinite(clip_grad_norm({p}, 1.0, nullptr, 8)));
    EXPECT_TRUE(torch::equal(p.grad().slice(0, 0, 2), before.slice(0, 0, 2))) << "untouched";
  }
  EXPECT_THROW(clip_grad_norm({}, 1.0, nullptr, 0.0), InvalidArgument);
}

TEST(DynamicLossScaler, BacksOffOnOverflowAndGrowsAfterTheWindow) {
  LossScalerOptions o;
  o.init_scale = 1024;
  o.growth_interval = 3;
  o.min_scale = 256;
  DynamicLossScaler s(o);
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_FALSE(s.update(false));  // overflow: skip, halve
  EXPECT_EQ(s.scale(), 512);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 512) << "two good steps are not yet the window of three";
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 1024) << "grows after three good steps in a row";
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_FALSE(s.update(false));  // an overflow restarts the count
  EXPECT_EQ(s.scale(), 512);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 512);
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale(), 256) << "never below min_scale";
  EXPECT_EQ(s.skipped_steps(), 5);
  EXPECT_EQ(s.state().good_steps, 0);

  DynamicLossScaler t(o);
  t.load_state(s.state());
  EXPECT_EQ(t.scale(), 256);
  EXPECT_EQ(t.skipped_steps(), 5);
  EXPECT_THROW(t.load_state(LossScalerState{-1, 0, 0}), InvalidArgument);
}

TEST(DynamicLossScaler, RejectsBadOptionsNamingThem) {
  auto message = [](LossScalerOptions o) {
    try {
      DynamicLossScaler s(o);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  LossScalerOptions o;
  o.init_scale = 0.5;
  EXPECT_NE(message(o).find("--loss-scale-init=0.5 is not allowed; allowed: a finite number >= 1"),
            std::string::npos) << message(o);
  o = LossScalerOptions{};
  o.growth_interval = 0;
  EXPECT_NE(message(o).find("--loss-scale-window=0 is not allowed; allowed: >= 1"), std::string::npos)
      << message(o);
  o = LossScalerOptions{};
  o.backoff_factor = 1.5;
  EXPECT_NE(message(o).find("backoff_factor=1.5"), std::string::npos) << message(o);
}

TEST(AdamW, WeightDecaySkipsBiasesNormsAndEmbeddings) {
  torch::NoGradGuard no_grad;
  AdamWOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.5;
  NamedParameters params = {
      {"h.0.mlp.weight", torch::ones({4, 4}).requires_grad_()},
      {"h.0.mlp.bias", torch::ones({4}).requires_grad_()},
      {"h.0.ln.weight", torch::ones({4}).requires_grad_()},
      {"wte.emb.weight", torch::ones({8, 4}).requires_grad_()},
  };
  EXPECT_TRUE(decays(params[0].first, params[0].second, o));
  EXPECT_FALSE(decays(params[1].first, params[1].second, o));
  EXPECT_FALSE(decays(params[3].first, params[3].second, o));
  auto opt = make_adamw(params, o);
  for (auto& [name, p] : params) p.mutable_grad() = torch::zeros_like(p);  // pure decay step
  opt->step();
  EXPECT_TRUE(torch::allclose(params[0].second, torch::full({4, 4}, 1.0 - 0.1 * 0.5)));
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(torch::equal(params[i].second, torch::ones_like(params[i].second))) << params[i].first;
  set_learning_rate(*opt, 0.25);
  for (auto& g : opt->param_groups()) EXPECT_DOUBLE_EQ(g.options().get_lr(), 0.25);
  o.beta2 = 1.0;
  try {
    make_adamw(params, o);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("AdamW beta2=1 must be in [0, 1)"), std::string::npos);
  }
}

}  // namespace
}  // namespace dtrain
