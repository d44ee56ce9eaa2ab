// Mixture of experts in one process: capacity semantics on fixed routings (which
// assignments are dropped; dropped tokens add nothing, so they keep their residual), the
// load-balancing and z losses against their closed forms, the router's weights and bias,
// the MoE layer against a per-token reference (outputs and gradients), the auxiliary
// losses' gradients through attach_loss, activation checkpointing, the model's parameter
// bookkeeping with MoE blocks, and the errors for sizes that do not fit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "common/errors.hpp"
#include "dtrain/models/gpt.hpp"
#include "dtrain/models/moe.hpp"
#include "dtrain/parallel/context.hpp"
#include "dtrain/parallel/expert_parallel.hpp"

namespace dtrain {
namespace {

using testing::error_message;

ep::MoeOptions options(std::int64_t experts, std::int64_t topk) {
  ep::MoeOptions o;
  o.experts = experts;
  o.topk = topk;
  return o;
}

TEST(MoeCapacity, FirstChoicesBeforeSecondAndEarlierTokensFirst) {
  // Expert 0 is everyone's favourite; capacity 2 per expert.
  const auto experts = torch::tensor({0, 1, 0, 2, 0, 1, 1, 0}, torch::kLong).view({4, 2});
  const auto kept = ep::capacity_mask(experts, 3, 2);
  // Slot 0: tokens 0 and 1 take expert 0, token 2 finds it full; token 3 takes expert 1.
  // Slot 1: token 0 takes expert 1 (second place), token 1 expert 2, token 2 finds expert 1
  // full (tokens 3 and 0), token 3 finds expert 0 full.
  const auto expected = torch::tensor({1, 1, 1, 1, 0, 0, 1, 0}, torch::kBool).view({4, 2});
  EXPECT_TRUE(torch::equal(kept, expected)) << kept;
}

TEST(MoeCapacity, FactorGivesCeilOfTheShare) {
  auto o = options(4, 2);
  EXPECT_EQ(ep::capacity(10, o), -1) << "factor 0 is dropless";
  o.capacity_factor = 1.0;
  EXPECT_EQ(ep::capacity(10, o), 5);  // 10 x 2 / 4
  o.capacity_factor = 1.25;
  EXPECT_EQ(ep::capacity(10, o), 7);  // ceil(6.25)
  o.capacity_factor = 0.01;
  EXPECT_EQ(ep::capacity(10, o), 1) << "never below one slot";
}

TEST(MoeLosses, LoadBalancingLossMatchesItsClosedForm) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const std::int64_t N = 37, E = 6, k = 2;
  const auto logits = torch::randn({N, E}, gen, torch::kDouble);
  const auto probs = torch::softmax(logits, -1);
  const auto experts = std::get<1>(probs.topk(k, -1));
  // E * sum_e (assignments_e / (N k)) * (sum_t p_te / N), by loops in double.
  double expected = 0;
  const auto p = probs.accessor<double, 2>();
  const auto x = experts.accessor<std::int64_t, 2>();
  for (std::int64_t e = 0; e < E; ++e) {
    double f = 0, P = 0;
    for (std::int64_t t = 0; t < N; ++t) {
      for (std::int64_t j = 0; j < k; ++j) f += x[t][j] == e ? 1 : 0;
      P += p[t][e];
    }
    expected += (f / (N * k)) * (P / N);
  }
  expected *= E;
  EXPECT_NEAR(ep::load_balancing_loss(probs, experts, E).item<double>(), expected, 1e-12);
  // Perfect balance: uniform probabilities and every expert chosen equally often: 1.
  const auto uniform = torch::full({4, 4}, 0.25, torch::kDouble);
  const auto even = torch::tensor({0, 1, 2, 3, 1, 0, 3, 2}, torch::kLong).view({4, 2});
  EXPECT_NEAR(ep::load_balancing_loss(uniform, even, 4).item<double>(), 1.0, 1e-12);
}

TEST(MoeLosses, ZLossAndRouteApplyTheCoefficients) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  const auto logits = torch::randn({9, 4}, gen);
  double z = 0;
  for (std::int64_t t = 0; t < 9; ++t) {
    double s = 0;
    for (std::int64_t e = 0; e < 4; ++e) s += std::exp(logits[t][e].item<double>());
    z += std::log(s) * std::log(s);
  }
  EXPECT_NEAR(ep::z_loss(logits).item<double>(), z / 9, 1e-5);
  auto o = options(4, 2);
  o.aux_loss_coeff = 0.5, o.z_loss_coeff = 0.25;
  const auto r = ep::route(logits, {}, o);
  EXPECT_NEAR(r.z_loss.item<double>(), 0.25 * z / 9, 1e-5);
  EXPECT_NEAR(r.aux_loss.item<double>(), 0.5 * ep::load_balancing_loss(r.probs, r.experts, 4).item<double>(), 1e-6);
  EXPECT_EQ(r.counts.sum().item<std::int64_t>(), 18);
}

TEST(MoeRouter, WeightsRenormaliseOverTopkAndBiasMovesOnlyTheChoice) {
  const auto logits = torch::tensor({2.0f, 1.0f, 0.0f, -1.0f}).view({1, 4});
  const auto probs = torch::softmax(logits, -1);
  auto r = ep::route(logits, {}, options(4, 2));
  EXPECT_TRUE(torch::equal(r.experts, torch::tensor({0, 1}, torch::kLong).view({1, 2})));
  EXPECT_NEAR(r.weights.sum().item<double>(), 1.0, 1e-6);
  EXPECT_NEAR(r.weights[0][0].item<double>(), (probs[0][0] / (probs[0][0] + probs[0][1])).item<double>(), 1e-6);
  // top-1 keeps the probability itself (a renormalised 1 would give the router no gradient).
  r = ep::route(logits, {}, options(4, 1));
  EXPECT_NEAR(r.weights[0][0].item<double>(), probs[0][0].item<double>(), 1e-6);
  // A bias lifts expert 3 into the choice; its weight is still its score.
  const auto bias = torch::tensor({0.0f, 0.0f, 0.0f, 1.0f});
  r = ep::route(logits, bias, options(4, 1));
  EXPECT_EQ(r.experts[0][0].item<std::int64_t>(), 3);
  EXPECT_NEAR(r.weights[0][0].item<double>(), probs[0][3].item<double>(), 1e-6);
  // Sigmoid scores: chosen by sigmoid, the aux probabilities normalised over the experts.
  auto o = options(4, 2);
  o.score = "sigmoid";
  r = ep::route(logits, {}, o);
  EXPECT_NEAR(r.probs.sum().item<double>(), 1.0, 1e-6);
  EXPECT_NEAR(r.weights[0][0].item<double>(),
              (torch::sigmoid(logits[0][0]) / (torch::sigmoid(logits[0][0]) + torch::sigmoid(logits[0][1]))).item<double>(),
              1e-6);
}

// A MoE layer in one process with its weights drawn from a seed.
models::Moe make_moe(const ep::MoeOptions& o, std::int64_t d, std::int64_t hidden) {
  models::Moe moe(o, d, hidden, make_self_communicator("tp", 0), false, make_self_communicator("ep", 0));
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (auto& p : moe->parameters()) p.normal_(0, 0.3, gen);
  return moe;
}

// One token through expert e: proj(silu(gate x) * fc x).
torch::Tensor expert_out(models::MoeImpl& m, std::int64_t e, const torch::Tensor& x) {
  return torch::mv(m.proj[e], torch::silu(torch::mv(m.gate[e], x)) * torch::mv(m.fc[e], x));
}

TEST(MoeLayer, DroppedTokensAddNothingSoTheyKeepTheirResidual) {
  auto o = options(2, 1);
  o.capacity_factor = 0.5;  // 8 tokens x 1 / 2 experts x 0.5: 2 slots each
  auto moe = make_moe(o, 4, 6);
  {
    torch::NoGradGuard no_grad;
    moe->router.zero_();
    moe->router[0].fill_(1.0);  // positive inputs: every token prefers expert 0
  }
  const auto x = torch::rand({1, 8, 4}) + 0.1;
  const auto y = moe->forward(x);
  const auto probs = torch::softmax(torch::mm(x[0], moe->router.t()), -1);
  for (std::int64_t t = 0; t < 8; ++t) {
    if (t < 2) {
      const auto ref = probs[t][0] * expert_out(*moe, 0, x[0][t]);
      EXPECT_TRUE(torch::allclose(y[0][t], ref, 1e-5, 1e-6)) << "token " << t;
    } else {
      EXPECT_TRUE(torch::equal(y[0][t], torch::zeros({4}))) << "token " << t << " was dropped: " << y[0][t];
    }
  }
  // Telemetry: 8 assignments to expert 0, 6 of them dropped.
  EXPECT_EQ(moe->stats().counts[0].item<double>(), 8);
  EXPECT_EQ(moe->stats().dropped.item<double>(), 6);
  EXPECT_EQ(moe->stats().forwards, 1);
}

TEST(MoeLayer, DroplessMatchesAPerTokenReferenceWithGradients) {
  auto o = options(5, 2);
  auto moe = make_moe(o, 8, 12);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto x = torch::randn({2, 7, 8}, gen).requires_grad_(true);
  const auto y = moe->forward(x);
  // Reference: each token by itself, its top-2 experts weighted by renormalised softmax.
  const auto flat = x.detach().reshape({-1, 8});
  const auto probs = torch::softmax(torch::mm(flat, moe->router.detach().t()), -1);
  const auto top = probs.topk(2, -1);
  for (std::int64_t t = 0; t < 14; ++t) {
    auto ref = torch::zeros({8});
    const auto w = std::get<0>(top)[t] / std::get<0>(top)[t].sum();
    for (int j = 0; j < 2; ++j) {
      torch::NoGradGuard no_grad;
      ref += w[j] * expert_out(*moe, std::get<1>(top)[t][j].item<std::int64_t>(), flat[t]);
    }
    EXPECT_TRUE(torch::allclose(y.reshape({-1, 8})[t], ref, 1e-5, 1e-6)) << "token " << t;
  }
  // Gradients reach the router, the input and every expert that got a token.
  y.pow(2).sum().backward();
  EXPECT_GT(moe->router.grad().abs().sum().item<double>(), 0);
  EXPECT_GT(x.grad().abs().sum().item<double>(), 0);
  const auto used = moe->stats().counts;
  for (std::int64_t e = 0; e < 5; ++e) {
    ASSERT_TRUE(moe->fc.grad().defined());
    const double g = moe->fc.grad()[e].abs().sum().item<double>();
    if (used[e].item<double>() > 0) {
      EXPECT_GT(g, 0) << "expert " << e;
    } else {
      EXPECT_EQ(g, 0) << "expert " << e;
    }
  }
}

TEST(MoeLayer, AuxiliaryLossGradientsEnterBackwardWithTheLossScale) {
  auto o = options(4, 2);
  o.aux_loss_coeff = 0.3, o.z_loss_coeff = 0.2;
  auto moe = make_moe(o, 6, 8);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const auto x = torch::randn({3, 5, 6}, gen);
  moe->set_aux_loss_scale(0.25);
  (moe->forward(x) * 0).sum().backward();  // only the auxiliary losses reach the router
  const auto got = moe->router.grad().clone();
  // The same losses computed directly.
  auto w = moe->router.detach().clone().requires_grad_(true);
  const auto r = ep::route(torch::mm(x.reshape({-1, 6}), w.t()), {}, o);
  ((r.aux_loss + r.z_loss) * 0.25).backward();
  EXPECT_GT(got.abs().sum().item<double>(), 0);
  EXPECT_TRUE(torch::allclose(got, w.grad(), 1e-5, 1e-7)) << got << w.grad();
  // Not in eval mode.
  moe->eval();
  moe->router.mutable_grad().zero_();
  (moe->forward(x) * 0).sum().backward();
  EXPECT_EQ(moe->router.grad().abs().sum().item<double>(), 0);
}

TEST(MoeLayer, BiasUpdateMovesTowardsTheMeanLoad) {
  auto o = options(4, 1);
  o.bias_update_rate = 0.1;
  auto moe = make_moe(o, 4, 4);
  moe->update_bias(torch::tensor({10.0, 2.0, 4.0, 4.0}));  // mean 5
  EXPECT_TRUE(torch::allclose(moe->bias(), torch::tensor({-0.1f, 0.1f, 0.1f, 0.1f})));
}

models::GptConfig moe_config() {
  auto c = models::GptConfig::preset("tiny");
  c.family = "llama", c.n_kv_head = 2, c.n_layer = 3;
  c.moe = options(4, 2);
  c.moe.every = 2;  // blocks 0 and 2
  c.moe.ffn_hidden = 96;
  return c;
}

TEST(MoeModel, ParametersShapesAndCountsAgree) {
  const auto c = moe_config();
  models::Gpt model(ParallelContext::single_process(), c, 1);
  const auto shapes = c.parameter_shapes();
  const auto params = model->parameter_list();
  ASSERT_EQ(shapes.size(), params.size());
  std::int64_t total = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(shapes[i].first, params[i].first);
    EXPECT_EQ(at::IntArrayRef(shapes[i].second), params[i].second.sizes()) << params[i].first;
    total += params[i].second.numel();
  }
  EXPECT_EQ(total, c.num_parameters());
  EXPECT_EQ(model->moe_layers().size(), 2u);
  EXPECT_TRUE(models::is_expert_parameter("h.0.moe.fc.weight"));
  EXPECT_FALSE(models::is_expert_parameter("h.0.moe.router.weight"));
  EXPECT_FALSE(models::is_expert_parameter("h.1.mlp_fc.weight"));
  // FLOPs count topk experts: one more expert per token adds 6 x 3 d F per MoE layer.
  auto more = c;
  more.moe.topk = 3;
  EXPECT_DOUBLE_EQ(more.flops_per_token(32) - c.flops_per_token(32), 6.0 * 2 * 3 * c.d_model * 96);
}

TEST(MoeModel, ActivationCheckpointingGivesTheSameGradientsAndCountsOnce) {
  auto c = moe_config();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const auto idx = torch::randint(0, c.vocab_size, {2, 16}, gen);
  const auto tgt = torch::randint(0, c.vocab_size, {2, 16}, gen);
  models::Gpt plain(ParallelContext::single_process(), c, 1);
  c.recompute_blocks = -1;
  models::Gpt ckpt(ParallelContext::single_process(), c, 1);
  plain->loss(idx, tgt).backward();
  ckpt->loss(idx, tgt).backward();
  const auto a = plain->parameter_list(), b = ckpt->parameter_list();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i].second.grad(), b[i].second.grad(), 1e-5, 1e-7)) << a[i].first;
  }
  for (auto& [block, layer] : ckpt->moe_layers()) {
    EXPECT_EQ(layer->stats().forwards, 1) << "block " << block;
    EXPECT_EQ(layer->stats().counts.sum().item<double>(), 2 * 16 * 2);
  }
}

TEST(MoeErrors, SizesThatDoNotFitNameTheOption) {
  auto c = moe_config();
  c.moe.topk = 5;
  EXPECT_NE(error_message([&] { c.validate(); }).find("--moe-topk=5 is not allowed with --moe-experts 4; allowed: 1..4"),
            std::string::npos);
  c = moe_config();
  EXPECT_NE(error_message([&] { c.moe.validate_ep(3); }).find("--moe-experts=4 is not divisible by --ep=3"),
            std::string::npos);
  c.moe.score = "relu";
  EXPECT_NE(error_message([&] { c.validate(); }).find("--moe-score 'relu' is not known; allowed: softmax, sigmoid"),
            std::string::npos);
  c = moe_config();
  c.moe.capacity_factor = -1;
  EXPECT_NE(error_message([&] { c.validate(); }).find("--moe-capacity=-1"), std::string::npos);
  ep::MoeOptions dense;
  EXPECT_NE(error_message([&] { dense.validate_ep(2); }).find("--ep=2 needs a MoE model"), std::string::npos);
  ParallelConfig p;
  p.ep = 3;
  EXPECT_NE(error_message([&] { p.mesh_axes(4); }).find("--ep=3 does not divide the data-parallel size 4"),
            std::string::npos);
  p.ep = 4, p.tp = 2;
  EXPECT_NE(error_message([&] { p.mesh_axes(4); }).find("--ep=4 does not divide the data-parallel size 2"),
            std::string::npos)
      << "ep splits dp = world / tp, not the world";
  p.ep = 2, p.tp = 1;
  const auto axes = p.mesh_axes(4);
  ASSERT_EQ(axes.size(), 5u);
  EXPECT_EQ(axes[1], (std::pair<std::string, int>{"dp", 2}));
  EXPECT_EQ(axes[3], (std::pair<std::string, int>{"ep", 2}));
}

}  // namespace
}  // namespace dtrain
