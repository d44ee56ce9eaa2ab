// The trainer in one process: the golden loss curve of the tiny config, every input
// check before training (each naming the option, the value and what is allowed), the
// metrics file, gradient accumulation, and bfloat16 autocast.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/corpus.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"
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
  o.precision = "fp8";
  expect(o, tiny, {"--precision 'fp8'", "allowed: fp32, bf16"});

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

TEST(Trainer, Bf16AutocastTracksFloat32) {
  TestCorpus corpus("bf16");
  auto o = golden_options(corpus);
  o.steps = 3;
  o.warmup_steps = 1;
  Trainer fp32(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
  o.precision = "bf16";
  Trainer bf16(ParallelContext::single_process(), models::GptConfig::preset("tiny"), o);
  const auto a = fp32.run(), b = bf16.run();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_NE(a[i].loss, b[i].loss) << "autocast had no effect";
    EXPECT_NEAR(a[i].loss, b[i].loss, 0.02 * a[i].loss) << "step " << i + 1;
  }
  // Parameters stay float32 (autocast changes compute, not storage).
  EXPECT_EQ(bf16.model()->parameters()[0].scalar_type(), torch::kFloat);
}

}  // namespace
}  // namespace dtrain::train
