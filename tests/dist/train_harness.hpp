// Equivalence harness for training strategies: the options of a short run on the test
// corpus, and a fixture that runs a strategy's Trainer, gets the single-process run of the
// same config from rank 0, and compares per-step losses, gradient norms and final parameters.
#pragma once

#include <torch/torch.h>

#include <iomanip>
#include <map>
#include <sstream>

#include "common/corpus.hpp"
#include "dist_test.hpp"
#include "dtrain/train/trainer.hpp"

namespace dtrain::testing {

using train::Trainer;
using train::TrainOptions;

// 10 steps of 12 samples x 32 tokens, warm-up 2, clipping at 1.0 (active early on).
inline TrainOptions options(const TestCorpus& corpus) {
  TrainOptions o;
  o.train_data = corpus.train();
  o.seq_len = 32;
  o.global_batch = 12;  // divisible by 1, 2, 3 and 4
  o.steps = 10;
  o.adamw.lr = 3e-3;
  o.warmup_steps = 2;
  o.grad_clip = 1.0;   // clipping active in the first steps
  o.progress = "off";
  return o;
}

// The tiny preset as Llama: RMSNorm, RoPE, SwiGLU, 4 query heads over 2 key/value heads,
// an untied head.
inline models::GptConfig tiny_llama() {
  auto c = models::GptConfig::preset("tiny");
  c.family = "llama";
  c.n_kv_head = 2;
  c.tie_embeddings = false;
  return c;
}

// Every field of cfg, as text: the key under which a process keeps a config's
// single-process run (a field added to GptConfig must be added here).
inline std::string describe(const models::GptConfig& c) {
  std::ostringstream s;
  s << std::setprecision(17) << c.family << ' ' << c.vocab_size << ' ' << c.context << ' ' << c.n_layer << ' '
    << c.n_head << ' ' << c.n_kv_head << ' ' << c.d_model << ' ' << c.ffn_hidden << ' ' << c.rope_theta << ' '
    << c.norm_eps << ' ' << c.init_std << ' ' << c.tie_embeddings << ' ' << c.recompute_blocks << ' '
    << c.attention_window << ' ' << c.document_separator << ' ' << c.reset_position_ids << ' '
    << c.dropout << " moe " << c.moe.experts << ' ' << c.moe.topk << ' ' << c.moe.every << ' ' << c.moe.ffn_hidden
    << ' ' << c.moe.capacity_factor << ' ' << c.moe.score << ' ' << c.moe.aux_loss_coeff << ' '
    << c.moe.z_loss_coeff << ' ' << c.moe.bias_update_rate << " ops " << static_cast<int>(c.attention) << ' '
    << c.fused_norm << ' ' << c.fused_ce << ' ' << c.fused_swiglu << ' ' << c.fused_rope << ' ' << c.fused_linear_ce;
  return s.str();
}

class TrainTest : public DistTest {
 protected:
  ContextPtr dp_context() { return std::make_shared<ParallelContext>(world(), ParallelConfig{}); }

  // The single-process run of cfg under o: each step's loss, grad_norm, loss_scale and
  // skipped (what the comparisons read) and the final parameters as float32 copies. Rank 0
  // runs it and broadcasts it: every rank still compares its own run with it, and an
  // N-rank test pays for the reference once, not N times (on 2 cores dist_fsdp_np4 took
  // 60 s with a reference on every rank, 36 s so). A reference that throws fails the test
  // on every rank, with an empty Reference.
  struct Reference {
    std::vector<train::StepMetrics> steps;
    NamedParameters params;
  };
  Reference single_process_reference(const models::GptConfig& cfg, const TrainOptions& o) {
    constexpr std::int64_t kFields = 4;
    const auto shapes = cfg.parameter_shapes();  // the model's parameters, in order
    auto steps = torch::full({1}, -1.0, torch::kDouble);  // [-1]: the reference failed
    auto values = torch::empty({parameter_count(shapes)}, torch::kFloat);
    if (rank() == 0) {
      try {
        Trainer t(ParallelContext::single_process(), cfg, o);
        const auto run = t.run();
        values = flatten_parameters(t.full_parameters(), shapes);
        steps = torch::empty({static_cast<std::int64_t>(run.size()), kFields}, torch::kDouble);
        auto s = steps.accessor<double, 2>();
        for (std::size_t i = 0; i < run.size(); ++i) {
          s[i][0] = run[i].loss, s[i][1] = run[i].grad_norm, s[i][2] = run[i].loss_scale;
          s[i][3] = run[i].skipped ? 1 : 0;
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "the single-process reference failed: " << e.what();
      }
    }
    auto count = torch::full({1}, steps.dim() == 2 ? steps.size(0) : -1, torch::kLong);
    world()->broadcast(count)->wait();
    const std::int64_t n = count.item<std::int64_t>();
    if (n < 0) {
      if (rank() != 0) ADD_FAILURE() << "rank 0's single-process reference failed";
      return {};
    }
    if (rank() != 0) steps = torch::empty({n, kFields}, torch::kDouble);
    world()->broadcast(steps)->wait();
    world()->broadcast(values)->wait();

    Reference ref;
    const auto s = steps.accessor<double, 2>();
    for (std::int64_t i = 0; i < n; ++i) {
      train::StepMetrics m;
      m.step = i + 1;
      m.loss = s[i][0], m.grad_norm = s[i][1], m.loss_scale = s[i][2], m.skipped = s[i][3] != 0;
      ref.steps.push_back(m);
    }
    ref.params = unflatten_parameters(values, shapes);
    return ref;
  }

  // The single-process model's parameters (GptConfig::parameter_shapes()) as one float32
  // tensor, what rank 0 broadcasts: flatten_parameters checks the names and shapes against
  // the list (a mismatch raises), unflatten_parameters splits by it on every rank.
  using ParameterShapes = std::vector<std::pair<std::string, std::vector<std::int64_t>>>;
  static std::int64_t parameter_count(const ParameterShapes& shapes) {
    std::int64_t numel = 0;
    for (const auto& [name, shape] : shapes) numel += c10::multiply_integers(shape);
    return numel;
  }
  static torch::Tensor flatten_parameters(const NamedParameters& params, const ParameterShapes& shapes) {
    DTRAIN_CHECK(params.size() == shapes.size(), "the reference has ", params.size(), " parameters, ",
                 "GptConfig::parameter_shapes() ", shapes.size());
    auto values = torch::empty({parameter_count(shapes)}, torch::kFloat);
    std::int64_t at = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      DTRAIN_CHECK(params[i].first == shapes[i].first && params[i].second.sizes() == shapes[i].second,
                   "reference parameter ", i, " is ", params[i].first, ", not ", shapes[i].first);
      values.narrow(0, at, params[i].second.numel()).copy_(params[i].second.detach().reshape(-1));
      at += params[i].second.numel();
    }
    return values;
  }
  static NamedParameters unflatten_parameters(const torch::Tensor& values, const ParameterShapes& shapes) {
    NamedParameters out;
    std::int64_t at = 0;
    for (const auto& [name, shape] : shapes) {
      const auto k = c10::multiply_integers(shape);
      out.emplace_back(name, values.narrow(0, at, k).view(shape));
      at += k;
    }
    return out;
  }

  // param_atol: see below; MoE runs pass a larger one (tests/dist/test_moe.cpp says why).
  void expect_equivalent(Trainer& dp, const Reference& ref, double param_atol = 5e-5) {
    expect_same_steps(dp.run(), ref.steps);
    expect_same_parameters(dp.full_parameters(), ref.params, param_atol);
  }

  // dp against the single-process run of cfg under options(corpus). That run is the same
  // for every strategy and corpus tag (each corpus holds the same text), so a process
  // computes it once per config and keeps it: the tests that compare many strategies with
  // one config do not repeat it.
  void expect_equivalent_to_single_process(Trainer& dp, const models::GptConfig& cfg, const TestCorpus& corpus,
                                           double param_atol = 5e-5) {
    static std::map<std::string, Reference> runs;
    const auto key = describe(cfg);
    auto it = runs.find(key);
    if (it == runs.end()) it = runs.emplace(key, single_process_reference(cfg, options(corpus))).first;
    expect_equivalent(dp, it->second, param_atol);
  }

  // Per-step losses (rtol 1e-5) and gradient norms (rtol 1e-4); some step must clip.
  static void expect_same_steps(const std::vector<train::StepMetrics>& a, const std::vector<train::StepMetrics>& b) {
    ASSERT_EQ(a.size(), b.size());
    bool clipped = false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i].loss, b[i].loss, 1e-5 * b[i].loss) << "step " << i + 1;
      EXPECT_NEAR(a[i].grad_norm, b[i].grad_norm, 1e-4 * b[i].grad_norm) << "step " << i + 1;
      clipped = clipped || b[i].grad_norm > 1.0;
    }
    EXPECT_TRUE(clipped) << "the comparison should cover clipped steps";
  }

  // Parameters: rtol 1e-5, atol 5e-5 by default. Averages over ranks sum in another order
  // than the single-process mean; Adam's normalisation turns those float32 roundings into
  // update differences up to about 1e-5 (measured) after 10 steps of lr 3e-3. A wrong
  // average or a lost micro-batch moves parameters by O(lr). Tensor and pipeline
  // parallelism: pa holds every rank's pieces assembled into the single-process tensors.
  static void expect_same_parameters(const NamedParameters& pa, const NamedParameters& pb, double param_atol) {
    ASSERT_EQ(pa.size(), pb.size());
    for (std::size_t i = 0; i < pa.size(); ++i) {
      EXPECT_EQ(pa[i].first, pb[i].first);
      EXPECT_TRUE(pa[i].second.sizes() == pb[i].second.sizes() &&
                  torch::allclose(pa[i].second, pb[i].second, 1e-5, param_atol))
          << pa[i].first << " " << pa[i].second.sizes() << " vs " << pb[i].second.sizes() << ", max diff "
          << (pa[i].second.sizes() == pb[i].second.sizes()
                  ? (pa[i].second - pb[i].second).abs().max().item<float>()
                  : -1.0f);
    }
  }
};

}  // namespace dtrain::testing
