// The trainer in one process: the golden loss curve of the tiny config, every input
// check before training (each naming the option, the value and what is allowed), the
// metrics file, gradient accumulation, --eod-mask-loss, bfloat16 and float16 autocast, and
// the float16 loss scaler skipping an overflowed step; CPU memory tracking.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/corpus.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/train/device_stats.hpp"
#include "dtrain/train/trainer.hpp"

namespace dtrain::train {
namespace {

using testing::TestCorpus;

// The golden run: tiny preset, 20 steps on the LICENSE corpus (see tests/golden/README.md).
TrainOptions golden_options(const TestCorpus& corpus) {
  TrainOptions o;
  o.train_data = corpus.train();
  o.val_data = corpus.val();
  o.seq_len = 32;
  o.global_batch = 8;
  o.steps = 20;
  o.seed = 1337;
  o.adamw.lr = 3e-3;
  o.warmup_steps = 5;
  o.progress = "off";
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument)";
}

TEST(Trainer, TinyConfigMatchesTheGoldenLossFile) {
  TestCorpus corpus("golden");
  Trainer t(ParallelContext::single_process(), models::GptConfig::preset("tiny"), golden_options(corpus));
  const auto metrics = t.run();
  const std::string golden = std::string(DTRAIN_SOURCE_DIR) + "/tests/golden/tiny_loss.txt";
  if (std::getenv("DTRAIN_UPDATE_GOLDEN") != nullptr) {
    std::ofstream out(golden);
    for (const auto& m : metrics) {
      char line[64];
      std::snprintf(line, sizeof(line), "%lld %.6f\n", static_cast<long long>(m.step), m.loss);
      out << line;
    }
    GTEST_SKIP() << "wrote " << golden;
  }
  std::ifstream in(golden);
  ASSERT_TRUE(in.good()) << golden << " is missing (DTRAIN_UPDATE_GOLDEN=1 writes it)";
  std::int64_t step = 0;
  double loss = 0;
  std::size_t i = 0;
  while (in >> step >> loss) {
    ASSERT_LT(i, metrics.size());
    EXPECT_EQ(metrics[i].step, step);
    // Relative 2e-4: float32 kernels may sum in another order on another CPU.
    EXPECT_NEAR(metrics[i].loss, loss, 2e-4 * loss) << "step " << step;
    ++i;
  }
  EXPECT_EQ(i, metrics.size()) << "golden file has " << i << " steps";
  EXPECT_LT(metrics.back().loss, metrics.front().loss - 1.0);
  EXPECT_GT(metrics.back().val_loss, 0.0);
}

TEST(Trainer, BadInputIsRejectedBeforeTrainingWithTheOptionNamed) {
  TestCorpus corpus("bad");
  const auto ctx = ParallelContext::single_process();
  const auto tiny = models::GptConfig::preset("tiny");
  auto expect = [&](TrainOptions o, models::GptConfig c, const std::vector<std::string>& parts) {
    const std::string e = error_of([&] { Trainer t(ctx, c, o); });
    for (const auto& p : parts) EXPECT_NE(e.find(p), std::string::npos) << "want '" << p << "' in: " << e;
  };
  auto o = golden_options(corpus);
  o.train_data = corpus.dir() + "/nothing_*.bin";
  expect(o, tiny, {"--train-data", "nothing_*.bin", "no token shards match"});

  // Wrong magic, then wrong version.
  const std::string bad = corpus.dir() + "/bad_000000.bin";
  for (int field : {0, 1}) {
    fs::remove_tree(bad);
    std::ifstream src(corpus.dir() + "/license_train_000000.bin", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(src)), std::istreambuf_iterator<char>());
    bytes[static_cast<std::size_t>(field) * 4] ^= 0x5a;
    std::ofstream(bad, std::ios::binary) << bytes;
    o = golden_options(corpus);
    o.val_data = bad;
    expect(o, tiny, {"--val-data", field == 0 ? "magic" : "version"});
  }

  o = golden_options(corpus);
  auto small_vocab = tiny;
  small_vocab.vocab_size = 100;  // LICENSE holds letters above id 100
  expect(o, small_vocab, {"--train-data", "holds token id", "vocabulary is 100", "--vocab-size"});

  o = golden_options(corpus);
  o.seq_len = 65;
  expect(o, tiny, {"--seq-len=65", "context is 64", "allowed: 1..64"});

  o = golden_options(corpus);
  o.global_batch = 10;
  o.micro_batch = 4;
  expect(o, tiny, {"--global-batch=10", "data-parallel size 1", "--micro-batch 4", "allowed: a multiple of 4"});

  o = golden_options(corpus);
  o.warmup_steps = 30;
  expect(o, tiny, {"--warmup-steps=30", "allowed: 0..--steps (20)"});

  o = golden_options(corpus);
  o.min_lr = 0.5;
  expect(o, tiny, {"--min-lr=0.5", "allowed: 0..--lr (0.003)"});

  o = golden_options(corpus);
  o.lr_decay = "wsd";
  expect(o, tiny, {"--lr-decay 'wsd'", "allowed: cosine, linear, sqrt, constant"});

  o = golden_options(corpus);
  o.lr_decay_steps = 16;
  expect(o, tiny, {"--lr-decay-steps=16", "allowed: 0..--steps - --warmup-steps (20 - 5 = 15)"});

  o = golden_options(corpus);
  o.lr_decay = "constant";
  o.lr_decay_steps = 3;
  expect(o, tiny, {"--lr-decay-steps=3", "--lr-decay constant", "allowed: 0"});

  o = golden_options(corpus);
  o.exit_duration_mins = -1;
  expect(o, tiny, {"--exit-duration-mins=-1", "allowed: minutes >= 0 (0: no limit)"});

  o = golden_options(corpus);
  o.exit_duration_mins = 30;
  expect(o, tiny, {"--exit-duration-mins 30", "needs --save-dir"});

  o = golden_options(corpus);
  o.precision = "fp8";
  expect(o, tiny, {"--precision 'fp8'", "allowed: fp32, bf16, fp16"});

  o = golden_options(corpus);
  o.precision = "fp16";
  o.loss_scale_init = 0;
  expect(o, tiny, {"--loss-scale-init=0", "allowed: a finite number >= 1"});

  o = golden_options(corpus);
  o.global_batch = 100000;
  expect(o, tiny, {"--global-batch=100000", "exceeds"});
}

TEST(Trainer, WritesOneJsonObjectPerStep) {
  TestCorpus corpus("metrics");
  auto o = golden_options(corpus);
  o.steps = 4;
  o.warmup_steps = 2;
  o.eval_every = 2;
  o.metrics_path = corpus.dir() + "/metrics.jsonl";
  Trainer t(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
  t.run();
  std::ifstream in(o.metrics_path);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    ++n;
    EXPECT_EQ(j["step"].get<int>(), n);
    for (const char* key : {"loss", "grad_norm", "lr", "tokens_per_s", "tflops", "step_ms",
                            "forward_ms", "backward_ms", "sync_ms", "optimizer_ms", "mem_mib"}) {
      EXPECT_TRUE(j.contains(key)) << key;
    }
    EXPECT_TRUE(j["mfu"].is_null()) << "no known peak for a CPU";
    EXPECT_EQ(j.contains("val_loss"), n % 2 == 0) << line;
    EXPECT_EQ(j["tokens"].get<std::int64_t>(), n * 8 * 32);
  }
  EXPECT_EQ(n, 4);
}

// The learning rate of each step (the metrics' lr, which the optimizer is given) follows
// the options: warm-up, the peak held, then the decay over the last steps to an explicit
// --min-lr 0; and without --min-lr, the decay ends at lr / 10.
TEST(Trainer, LearningRateFollowsTheChosenSchedule) {
  TestCorpus corpus("schedule");
  auto o = golden_options(corpus);
  o.steps = 6;
  o.warmup_steps = 2;
  o.val_data.clear();
  o.lr_decay = "linear";
  o.lr_decay_steps = 2;
  o.min_lr = 0.0;
  const double peak = o.adamw.lr;
  const auto wsd = Trainer(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o).run();
  const std::vector<double> want = {peak / 2, peak, peak, peak, peak, peak / 2};
  ASSERT_EQ(wsd.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(wsd[i].lr, want[i], 1e-15 * peak) << "step " << i + 1;

  o.lr_decay_steps = 0;
  o.min_lr.reset();
  o.warmup_steps = 0;
  o.steps = 2;
  const auto plain = Trainer(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o).run();
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_DOUBLE_EQ(plain[0].lr, peak);
  EXPECT_NEAR(plain[1].lr, peak / 10 + (peak - peak / 10) / 2, 1e-15 * peak);  // linear, halfway to lr / 10
}

TEST(Trainer, GradientAccumulationEqualsOneLargeBatch) {
  TestCorpus corpus("accum");
  auto o = golden_options(corpus);
  o.steps = 5;
  Trainer whole(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
  o.micro_batch = 2;  // 4 micro-batches per step
  Trainer parts(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
  EXPECT_EQ(parts.grad_accumulation(), 4);
  const auto a = whole.run(), b = parts.run();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i].loss, b[i].loss, 1e-5 * a[i].loss) << "step " << i + 1;
  }
  auto pa = whole.model()->parameter_list(), pb = parts.model()->parameter_list();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::allclose(pa[i].second, pb[i].second, 1e-4, 1e-5)) << pa[i].first;
  }
}

// --eod-mask-loss: the first step's loss is the initial model's mean cross-entropy over
// the step's targets except those predicted at a separator (computed here from the same
// samples), with the step as one micro-batch or eight (whose loss targets differ in
// number); without --document-separator it is refused.
TEST(Trainer, EodMaskLossIsTheMeanOverTheOtherTargets) {
  TestCorpus corpus("eod");
  auto cfg = models::GptConfig::preset("tiny");
  cfg.document_separator = 10;  // the byte tokenizer's newline: each line is a document
  auto o = golden_options(corpus);
  o.steps = 1, o.warmup_steps = 0, o.val_data.clear(), o.eod_mask_loss = true;
  data::TokenDataset data(o.train_data, o.seq_len);
  const auto batch = data.batch(data::DistributedSampler(data.num_samples(), o.global_batch, 0, 1, o.seed).indices(0));
  models::Gpt model(ParallelContext::single_process(), cfg, o.seed);
  const auto logits = model->forward(batch.inputs).detach();
  namespace F = torch::nn::functional;
  const auto per_target = F::cross_entropy(logits.reshape({-1, logits.size(-1)}), batch.targets.reshape({-1}),
                                           F::CrossEntropyFuncOptions().reduction(torch::kNone));
  const auto keep = batch.inputs.reshape({-1}).ne(cfg.document_separator);
  const auto per_sample = keep.view({o.global_batch, -1}).sum(1);
  ASSERT_GT(per_sample.max().item<std::int64_t>(), per_sample.min().item<std::int64_t>())
      << "the samples should hold different numbers of separators";
  const double want = per_target.masked_select(keep).mean().item<double>();
  ASSERT_GT(std::abs(want - per_target.mean().item<double>()), 2e-4 * want)
      << "the mask should matter (20x the tolerance)";
  for (std::int64_t micro : {0, 1}) {
    o.micro_batch = micro;
    Trainer t(ParallelContext::single_process(), cfg, o);
    EXPECT_NEAR(t.run().front().loss, want, 1e-5 * want) << "micro-batch " << micro;
  }
  cfg.document_separator = -1;
  EXPECT_NE(error_of([&] { Trainer(ParallelContext::single_process(), cfg, o); })
                .find("--eod-mask-loss drops the loss at each document separator; allowed only with "
                      "--document-separator ID (got -1)"),
            std::string::npos);
}

// bf16 and fp16 autocast track float32 within 2% of the loss; fp16 runs with the loss
// scaler (gradients unscaled before clipping and reporting, no overflow at the default
// scale), bf16 without.
TEST(Trainer, AutocastTracksFloat32) {
  for (const char* precision : {"bf16", "fp16"}) {
    TestCorpus corpus(precision);
    auto o = golden_options(corpus);
    o.steps = 3;
    o.warmup_steps = 1;
    Trainer fp32(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
    o.precision = precision;
    Trainer low(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
    const bool fp16 = o.precision == "fp16";
    EXPECT_EQ(low.loss_scaler() != nullptr, fp16) << precision;
    EXPECT_EQ(fp32.loss_scaler(), nullptr);
    const auto a = fp32.run(), b = low.run();
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_NE(a[i].loss, b[i].loss) << precision << ": autocast had no effect";
      EXPECT_NEAR(a[i].loss, b[i].loss, 0.02 * a[i].loss) << precision << " step " << i + 1;
      EXPECT_NEAR(a[i].grad_norm, b[i].grad_norm, 0.05 * a[i].grad_norm) << precision << ": unscaled";
      EXPECT_FALSE(b[i].skipped) << precision;
      EXPECT_EQ(b[i].loss_scale, fp16 ? 65536 : 0) << precision;
    }
    // Parameters stay float32 (autocast changes compute, not storage).
    EXPECT_EQ(low.model()->parameters()[0].scalar_type(), torch::kFloat);
  }
}

// A forced overflow: the initial scale 2^40 makes the float16 activation gradients inf. The
// step is skipped (parameters and optimizer untouched), the scale halves each time until the
// gradients fit, and after loss_scale_window good steps it doubles again.
TEST(Trainer, Fp16OverflowSkipsTheStepAndLowersTheScale) {
  TestCorpus corpus("overflow");
  auto o = golden_options(corpus);
  o.steps = 60;
  o.precision = "fp16";
  o.loss_scale_init = std::ldexp(1.0, 40);
  o.loss_scale_window = 2;
  // Overflows that lower the scale are not divergence: far more than 3 in a row must not
  // end the run.
  o.max_skipped_steps = 3;
  Trainer t(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
  auto snapshot = [&] {
    std::vector<torch::Tensor> v;
    for (const auto& p : t.model()->parameters()) v.push_back(p.detach().clone());
    return v;
  };
  auto changed = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (!torch::equal(a[i], b[i])) return true;
    }
    return false;
  };
  double expected_scale = o.loss_scale_init;
  std::int64_t skipped = 0, good_in_a_row = 0, good = 0;
  while (good < 5) {
    ASSERT_LT(t.step(), o.steps) << "the scale never came down far enough";
    const auto before = snapshot();
    const StepMetrics m = t.train_step();
    EXPECT_EQ(m.loss_scale, expected_scale) << "step " << m.step;
    EXPECT_TRUE(std::isfinite(m.loss)) << "the reported loss is unscaled";
    if (m.skipped) {
      EXPECT_FALSE(std::isfinite(m.grad_norm));
      EXPECT_FALSE(changed(before, snapshot())) << "skipped step " << m.step << " changed parameters";
      ++skipped;
      good_in_a_row = 0;
      expected_scale /= 2;
    } else {
      EXPECT_TRUE(std::isfinite(m.grad_norm));
      EXPECT_TRUE(changed(before, snapshot())) << "step " << m.step << " applied no update";
      ++good;
      if (++good_in_a_row == 2) {
        expected_scale *= 2;
        good_in_a_row = 0;
      }
    }
    EXPECT_EQ(m.skipped_steps, skipped);
    EXPECT_EQ(t.loss_scaler()->scale(), expected_scale);
  }
  EXPECT_GT(skipped, 10) << "2^40 must overflow float16 for many halvings";

  // The metrics carry the scale and the skips.
  o.steps = 2;
  o.warmup_steps = 0;
  o.metrics_path = corpus.dir() + "/metrics.jsonl";
  Trainer r(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
  r.run();
  std::ifstream in(o.metrics_path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["loss_scale"].get<double>(), std::ldexp(1.0, 40)) << line;
  EXPECT_TRUE(j["skipped"].get<bool>()) << line;
  EXPECT_EQ(j["skipped_steps"].get<int>(), 1) << line;
}

// The CPU tracking allocator counts live tensor bytes and their peak, as the CUDA caching
// allocator's statistics do on a GPU.
TEST(DeviceStats, CpuTrackingCountsLiveTensorsAndThePeak) {
  enable_cpu_memory_tracking();
  enable_cpu_memory_tracking();  // idempotent
  const c10::Device cpu(c10::kCPU);
  ASSERT_TRUE(reset_peak_memory(cpu));
  const double before = memory_stats(cpu).current_mib;
  {
    auto a = torch::ones({4 << 20}, torch::kFloat);  // 16 MiB
    EXPECT_NEAR(memory_stats(cpu).current_mib - before, 16.0, 0.01);
    auto b = a * 2;  // another 16 MiB
    EXPECT_NEAR(memory_stats(cpu).current_mib - before, 32.0, 0.01);
    EXPECT_EQ(b[7].item<float>(), 2.0f);
  }
  const auto after = memory_stats(cpu);
  EXPECT_NEAR(after.current_mib, before, 0.01) << "freed tensors are no longer counted";
  EXPECT_GE(after.peak_mib - before, 32.0 - 0.01);
  ASSERT_TRUE(reset_peak_memory(cpu));
  EXPECT_NEAR(memory_stats(cpu).peak_mib, memory_stats(cpu).current_mib, 0.01);
}

}  // namespace
}  // namespace dtrain::train
