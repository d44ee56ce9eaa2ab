// Equivalence harness for training strategies: the options of a short run on the test
// corpus, and a fixture that runs a strategy's Trainer and the single-process Trainer in
// the same process and compares per-step losses, gradient norms and final parameters.
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

// Every field of cfg, as text: the key under which a process keeps a config's
// single-process run (a field added to GptConfig must be added here).
inline std::string describe(const models::GptConfig& c) {
  std::ostringstream s;
  s << std::setprecision(17) << c.family << ' ' << c.vocab_size << ' ' << c.context << ' ' << c.n_layer << ' '
    << c.n_head << ' ' << c.n_kv_head << ' ' << c.d_model << ' ' << c.ffn_hidden << ' ' << c.rope_theta << ' '
    << c.norm_eps << ' ' << c.init_std << ' ' << c.tie_embeddings << ' ' << c.activation_checkpointing << ' '
    << c.dropout << " moe " << c.moe.experts << ' ' << c.moe.topk << ' ' << c.moe.every << ' ' << c.moe.ffn_hidden
    << ' ' << c.moe.capacity_factor << ' ' << c.moe.score << ' ' << c.moe.aux_loss_coeff << ' '
    << c.moe.z_loss_coeff << ' ' << c.moe.bias_update_rate << " ops " << static_cast<int>(c.attention) << ' '
    << c.fused_norm << ' ' << c.fused_ce;
  return s.str();
}

class TrainTest : public DistTest {
 protected:
  ContextPtr dp_context() { return std::make_shared<ParallelContext>(world(), ParallelConfig{}); }

  // param_atol: see below; MoE runs pass a larger one (tests/dist/test_moe.cpp says why).
  void expect_equivalent(Trainer& dp, Trainer& ref, double param_atol = 5e-5) {
    const auto a = dp.run(), b = ref.run();
    expect_same_steps(a, b);
    expect_same_parameters(dp.full_parameters(), ref.model()->parameter_list(), param_atol);
  }

  // dp against the single-process run of cfg under options(corpus). That run is the same
  // for every strategy and corpus tag (each corpus holds the same text), so a process
  // computes it once per config and keeps its steps and final parameters: the tests that
  // compare many strategies with one config no longer repeat it on every rank.
  void expect_equivalent_to_single_process(Trainer& dp, const models::GptConfig& cfg, const TestCorpus& corpus,
                                           double param_atol = 5e-5) {
    struct Run {
      std::vector<train::StepMetrics> steps;
      NamedParameters params;
    };
    static std::map<std::string, Run> runs;
    const auto key = describe(cfg);
    auto it = runs.find(key);
    if (it == runs.end()) {
      Trainer ref(ParallelContext::single_process(), cfg, options(corpus));
      Run run{ref.run(), {}};
      for (const auto& [name, p] : ref.model()->parameter_list()) run.params.emplace_back(name, p.detach().clone());
      it = runs.emplace(key, std::move(run)).first;
    }
    expect_same_steps(dp.run(), it->second.steps);
    expect_same_parameters(dp.full_parameters(), it->second.params, param_atol);
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
