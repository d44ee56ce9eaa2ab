// AdamW parameter groups, the learning-rate schedules and gradient clipping against LibTorch's;
// the dynamic loss scaler's schedule and clipping of loss-scaled gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "dtrain/core/error.hpp"
#include "dtrain/optim/loss_scaler.hpp"
#include "dtrain/optim/optim.hpp"

namespace dtrain {
namespace {

LrSchedule schedule(double lr, double min_lr, std::int64_t warmup, std::int64_t total,
                    LrDecay decay = LrDecay::kCosine, std::int64_t decay_steps = 0) {
  return LrSchedule({lr, min_lr, warmup, total, decay, decay_steps});
}

TEST(LrSchedule, WarmupThenCosineThenFloor) {
  const auto s = schedule(1.0, 0.1, 10, 100);
  EXPECT_DOUBLE_EQ(s.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(4), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(9), 1.0);
  EXPECT_DOUBLE_EQ(s.lr(10), 1.0);
  EXPECT_NEAR(s.lr(55), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(s.lr(100), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(5000), 0.1);
  EXPECT_EQ(s.decay_start(), 10);
  for (int i = 10; i < 100; ++i) EXPECT_LE(s.lr(i + 1), s.lr(i)) << "monotone after warm-up";
  EXPECT_DOUBLE_EQ(schedule(2.0, 0.0, 0, 10).lr(0), 2.0);
  EXPECT_THROW(schedule(1.0, 2.0, 0, 10), InvalidArgument);
  EXPECT_THROW(schedule(1.0, 0.1, 20, 10), InvalidArgument);
  EXPECT_THROW(schedule(0.0, 0.0, 0, 10), InvalidArgument);
}

// Each decay's shape at known points of its progress p = (step - start) / (total - start).
TEST(LrSchedule, DecayShapes) {
  // No warm-up, 100 steps, 2 -> 0.5: lr = 0.5 + 1.5 f(p), p = step / 100.
  const double lr = 2.0, min_lr = 0.5;
  for (auto [decay, f_quarter, f_half] : {std::tuple{LrDecay::kCosine, 0.5 * (1 + std::cos(M_PI / 4)), 0.5},
                                          std::tuple{LrDecay::kLinear, 0.75, 0.5},
                                          std::tuple{LrDecay::kSqrt, 0.5, 1 - std::sqrt(0.5)}}) {
    SCOPED_TRACE(to_string(decay));
    const auto s = schedule(lr, min_lr, 0, 100, decay);
    EXPECT_DOUBLE_EQ(s.lr(0), lr);
    EXPECT_NEAR(s.lr(25), min_lr + (lr - min_lr) * f_quarter, 1e-12);
    EXPECT_NEAR(s.lr(50), min_lr + (lr - min_lr) * f_half, 1e-12);
    EXPECT_GT(s.lr(99), min_lr);
    EXPECT_DOUBLE_EQ(s.lr(100), min_lr);
    for (int i = 0; i < 100; ++i) EXPECT_LT(s.lr(i + 1), s.lr(i)) << "strictly decreasing at " << i;
  }
  const auto c = schedule(lr, min_lr, 4, 100, LrDecay::kConstant);
  EXPECT_DOUBLE_EQ(c.lr(0), 0.5);
  for (int i : {4, 50, 99, 100, 1000}) EXPECT_DOUBLE_EQ(c.lr(i), lr) << i;
}

// Warmup-stable-decay: the peak held from the warm-up's end to the last decay_steps.
TEST(LrSchedule, DecayOverTheLastStepsOnly) {
  for (auto decay : {LrDecay::kCosine, LrDecay::kLinear, LrDecay::kSqrt}) {
    SCOPED_TRACE(to_string(decay));
    const auto s = schedule(1.0, 0.0, 10, 100, decay, 20);
    EXPECT_EQ(s.decay_start(), 80);
    EXPECT_DOUBLE_EQ(s.lr(0), 0.1);
    for (int i = 9; i <= 80; ++i) EXPECT_DOUBLE_EQ(s.lr(i), 1.0) << i;
    for (int i = 80; i < 100; ++i) EXPECT_LT(s.lr(i + 1), s.lr(i)) << i;
    EXPECT_DOUBLE_EQ(s.lr(100), 0.0);
    // Against the same decay over 20 steps without warm-up or plateau, shifted by 80.
    const auto whole = schedule(1.0, 0.0, 0, 20, decay);
    for (int i = 80; i <= 100; ++i) EXPECT_DOUBLE_EQ(s.lr(i), whole.lr(i - 80)) << i;
  }
  EXPECT_NEAR(schedule(1.0, 0.0, 10, 100, LrDecay::kLinear, 20).lr(90), 0.5, 1e-15);
  // The whole span after the warm-up is the plain schedule.
  const auto full = schedule(1.0, 0.1, 10, 100, LrDecay::kCosine, 90), plain = schedule(1.0, 0.1, 10, 100);
  for (int i = 0; i <= 100; ++i) EXPECT_DOUBLE_EQ(full.lr(i), plain.lr(i)) << i;
  EXPECT_THROW(schedule(1.0, 0.1, 10, 100, LrDecay::kLinear, 91), InvalidArgument);
  EXPECT_THROW(schedule(1.0, 0.1, 0, 100, LrDecay::kLinear, -1), InvalidArgument);
  EXPECT_THROW(schedule(1.0, 0.1, 0, 100, LrDecay::kConstant, 10), InvalidArgument);
}

TEST(LrSchedule, ParsesDecayNames) {
  for (auto decay : {LrDecay::kCosine, LrDecay::kLinear, LrDecay::kSqrt, LrDecay::kConstant}) {
    EXPECT_EQ(parse_lr_decay(to_string(decay)), decay);
  }
  try {
    parse_lr_decay("wsd");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--lr-decay 'wsd' is not known; allowed: cosine, linear, sqrt, constant"),
              std::string::npos)
        << e.what();
  }
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
