// Checkpoints of the Trainer at 1-4 ranks: exact resume in the same layout (bitwise on the
// CPU), resharding into other layouts and world sizes (continuing equal to the run that
// never stopped), named errors for corrupt, truncated, missing and foreign checkpoints with
// fallback to the newest good one, a failed write that leaves the previous checkpoint and
// the training state intact, preemption by a signal, and skipped non-finite steps.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "train_harness.hpp"

namespace dtrain::testing {
namespace {

using checkpoint::CheckpointError;

struct Layout {
  int tp = 1, pp = 1, ep = 1;
  bool sp = false;
  std::string fsdp = "none";
  int cp = 1;
  std::string text() const {
    return format("tp={} pp={} ep={}{} fsdp={} cp={}", tp, pp, ep, sp ? " sp" : "", fsdp, cp);
  }
};

class CheckpointTest : public TrainTest {
 protected:
  ContextPtr context(const Layout& l, CommPtr comm = nullptr) {
    ParallelConfig c;
    c.tp = l.tp, c.pp = l.pp, c.ep = l.ep, c.cp = l.cp, c.sequence_parallel = l.sp;
    return std::make_shared<ParallelContext>(comm ? comm : world(), c);
  }
  // A fresh directory every rank names the same (rank 0's pid), removed at the end.
  std::string shared_dir(const std::string& tag) {
    auto pid = torch::full({1}, static_cast<std::int64_t>(::getpid()), torch::kLong);
    world()->broadcast(pid, {0})->wait();
    const auto dir = format("/tmp/dtrain_ckpt_{}_{}", pid.item<std::int64_t>(), tag);
    if (rank() == 0) fs::remove_tree(dir);
    world()->barrier()->wait();
    dirs_.push_back(dir);
    return dir;
  }
  void TearDown() override {
    world()->barrier()->wait();
    if (rank() == 0) {
      for (const auto& d : dirs_) fs::remove_tree(d);
    }
    TrainTest::TearDown();
  }
  static TrainOptions with(TrainOptions o, const Layout& l, std::int64_t dp) {
    o.fsdp = l.fsdp;
    o.micro_batch = l.pp > 1 ? 1 : o.global_batch / dp;
    return o;
  }
  static models::GptConfig llama() {
    auto c = models::GptConfig::preset("tiny");
    c.family = "llama", c.n_kv_head = 2, c.tie_embeddings = false;
    return c;
  }
  static models::GptConfig moe() {
    auto c = llama();
    c.n_layer = 2, c.moe.experts = 12, c.moe.topk = 2, c.moe.every = 1, c.moe.ffn_hidden = 32;
    c.moe.bias_update_rate = 1e-3;  // router biases are state
    return c;
  }
  std::vector<std::string> dirs_;
};

void expect_bitwise(Trainer& a, Trainer& b) {
  const auto pa = a.full_parameters(), pb = b.full_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second))
        << pa[i].first << " max diff " << (pa[i].second - pb[i].second).abs().max().item<float>();
  }
}

// N steps, save, a new trainer resumes, M more steps: the same losses and parameters as
// N + M steps without a stop, bit for bit (CPU float32), in every layout.
TEST_F(CheckpointTest, ResumeInTheSameLayoutIsExact) {
  const int n = nranks();
  TestCorpus corpus("resume" + std::to_string(rank()));
  const auto root = shared_dir("resume");
  std::vector<std::pair<Layout, models::GptConfig>> cases;
  auto dropout = models::GptConfig::preset("tiny");
  dropout.dropout = 0.1;  // the RNG states resume too
  cases.push_back({Layout{}, dropout});
  cases.push_back({Layout{1, 1, 1, false, "zero2"}, llama()});
  cases.push_back({Layout{1, 1, 1, false, "full"}, models::GptConfig::preset("tiny")});
  cases.push_back({Layout{1, 1, n, false, "none"}, moe()});
  if (n % 2 == 0) {
    cases.push_back({Layout{2, 1, 1, true, "none"}, dropout});
    cases.push_back({Layout{1, 2, 1, false, "zero1"}, models::GptConfig::preset("tiny")});
  }
  int k = 0;
  for (const auto& [layout, cfg] : cases) {
    SCOPED_TRACE(layout.text());
    auto ctx = context(layout);
    auto o = with(options(corpus), layout, ctx->dp_size());
    o.steps = 6;
    Trainer straight(ctx, cfg, o);
    const auto all = straight.run();
    const auto dir = fs::join(root, std::to_string(k++));
    {
      Trainer first(ctx, cfg, o);
      for (int s = 0; s < 3; ++s) first.train_step();
      first.save_checkpoint(dir);
    }
    o.resume = checkpoint::step_dir(dir, 3);
    Trainer resumed(ctx, cfg, o);
    EXPECT_EQ(resumed.step(), 3);
    const auto rest = resumed.run();
    ASSERT_EQ(rest.size(), 3u);
    for (std::size_t s = 0; s < 3; ++s) {
      EXPECT_EQ(rest[s].loss, all[s + 3].loss) << "step " << s + 4;
      EXPECT_EQ(rest[s].grad_norm, all[s + 3].grad_norm) << "step " << s + 4;
      EXPECT_EQ(rest[s].tokens, all[s + 3].tokens);
    }
    expect_bitwise(resumed, straight);
  }
}

// Async saves (host snapshot, background write, commit on a later step) write the same
// bytes as synchronous ones and leave training unchanged.
TEST_F(CheckpointTest, AsyncSavesWriteWhatSyncSavesWrite) {
  TestCorpus corpus("async" + std::to_string(rank()));
  const auto root = shared_dir("async");
  const Layout layout{1, 1, 1, false, "zero2"};
  auto ctx = context(layout);
  std::vector<std::vector<train::StepMetrics>> runs;
  for (const bool async : {false, true}) {
    auto o = with(options(corpus), layout, ctx->dp_size());
    o.steps = 6;
    o.save_every = 2;
    o.async_save = async;
    o.save_dir = fs::join(root, async ? "async" : "sync");
    Trainer t(ctx, models::GptConfig::preset("tiny"), o);
    runs.push_back(t.run());
    EXPECT_EQ(checkpoint::list_steps(o.save_dir), (std::vector<std::int64_t>{2, 4, 6}));
    if (async) {
      EXPECT_GT(t.last_save().total_ms, 0);
    }
  }
  for (std::size_t s = 0; s < runs[0].size(); ++s) EXPECT_EQ(runs[0][s].loss, runs[1][s].loss);
  for (const int step : {2, 4, 6}) {
    const auto a = checkpoint::verify(checkpoint::step_dir(fs::join(root, "sync"), step));
    const auto b = checkpoint::verify(checkpoint::step_dir(fs::join(root, "async"), step));
    const auto files = [](const std::string& manifest) { return manifest.substr(manifest.find("\"files\"")); };
    EXPECT_EQ(files(a).substr(0, files(a).find("\"format\"")), files(b).substr(0, files(b).find("\"format\"")))
        << "step " << step;
  }
}

// Saved in one layout after 5 steps, loaded into others (another world size, and context
// parallelism, too), 5 more steps: losses and parameters as the single process's 10
// uninterrupted steps, within the equivalence harness's tolerances (see train_harness.hpp).
TEST_F(CheckpointTest, LoadsIntoAnyLayoutAndContinuesAsTheUninterruptedRun) {
  const int n = nranks();
  TestCorpus corpus("reshard" + std::to_string(rank()));
  const auto root = shared_dir("reshard");
  struct Case {
    models::GptConfig cfg;
    Layout save;
    std::vector<Layout> loads;
    double param_atol;
  };
  std::vector<Case> cases;
  if (n == 1) cases.push_back({llama(), Layout{1, 1, 1, false, "full"}, {}, 5e-5});
  if (n == 2) {
    cases.push_back({llama(), Layout{1, 1, 1, false, "full"},
                     {Layout{2, 1, 1, true}, Layout{1, 2}, Layout{1, 1, 1, false, "zero2", 2}}, 5e-5});
    cases.push_back({llama(), Layout{1, 1, 1, false, "full", 2}, {Layout{2, 1, 1, true}}, 5e-5});
    cases.push_back({moe(), Layout{1, 1, 2, false, "none"}, {Layout{2, 1, 1, false, "zero1"}}, 2e-4});
  }
  if (n == 3) cases.push_back({models::GptConfig::preset("tiny"), Layout{1, 1, 1, false, "zero1"}, {Layout{1, 1, 1, false, "full"}}, 5e-5});
  if (n == 4) {
    cases.push_back({llama(), Layout{1, 1, 1, false, "full"},
                     {Layout{2, 1, 1, false, "none"}, Layout{1, 2, 1, false, "zero1"}, Layout{4, 1, 1, true, "none"},
                      Layout{2, 1, 1, true, "none", 2}}, 5e-5});
    cases.push_back({moe(), Layout{2, 1, 2, false, "zero2"}, {Layout{1, 1, 4}, Layout{1, 2, 2}}, 2e-4});
  }
  int k = 0;
  // MoE router statistics are per micro-batch: every MoE run uses micro-batches of one
  // sample, so the reference and every layout see the same ones (see test_moe.cpp).
  auto batched = [](TrainOptions o, const Case& c) {
    if (c.cfg.moe.enabled()) o.micro_batch = 1;
    return o;
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("saved at " + c.save.text());
    auto ref_options = batched(options(corpus), c);
    const auto ref = single_process_reference(c.cfg, ref_options);
    const auto& want = ref.steps;
    const auto dir = fs::join(root, std::to_string(k++));
    {
      auto ctx = context(c.save);
      Trainer saver(ctx, c.cfg, batched(with(options(corpus), c.save, ctx->dp_size()), c));
      for (int s = 0; s < 5; ++s) saver.train_step();
      saver.save_checkpoint(dir);
    }
    auto check = [&](Trainer& t, const std::string& what) {
      SCOPED_TRACE("loaded at " + what);
      EXPECT_EQ(t.step(), 5);
      const auto got = t.run();
      ASSERT_EQ(got.size(), 5u);
      EXPECT_EQ(want.size(), 10u);
      for (std::size_t s = 0; s < got.size() && s + 5 < want.size(); ++s) {
        EXPECT_NEAR(got[s].loss, want[s + 5].loss, 1e-5 * want[s + 5].loss) << "step " << s + 6;
      }
      expect_same_parameters(t.full_parameters(), ref.params, c.param_atol);
    };
    auto o = batched(options(corpus), c);
    o.resume = checkpoint::step_dir(dir, 5);
    {  // every rank alone, as one process
      Trainer single(ParallelContext::single_process(), c.cfg, o);
      check(single, "one process");
    }
    for (const auto& l : c.loads) {
      auto ctx = context(l);
      Trainer t(ctx, c.cfg, batched(with(o, l, ctx->dp_size()), c));
      check(t, l.text());
    }
    if (n == 4 && k == 1) {  // a smaller world: FSDP over 2 of the 4 ranks
      auto half = world()->split(rank() < 2 ? 0 : -1, rank(), "half");
      if (half) {
        const Layout l{1, 1, 1, false, "zero2"};
        auto ctx = context(l, half);
        Trainer t(ctx, c.cfg, with(o, l, ctx->dp_size()));
        check(t, "zero2 on 2 of 4 ranks");
      }
      world()->barrier()->wait();
    }
  }
}

// The full export holds the single-process model under Hugging Face names and layouts
// (learned attention sinks under gpt-oss's); importing it into any layout reproduces the
// parameters exactly; a foreign file is a named error.
TEST_F(CheckpointTest, HuggingFaceExportImportsIntoAnyLayout) {
  const int n = nranks();
  TestCorpus corpus("hf" + std::to_string(rank()));
  const auto root = shared_dir("hf");
  struct Case {
    models::GptConfig cfg;
    Layout save, load;
  };
  auto gpt2 = models::GptConfig::preset("tiny");
  std::vector<Case> cases = {{gpt2, Layout{1, 1, 1, false, "full"}, Layout{1, 1, 1, false, "zero1"}},
                             {moe(), Layout{1, 1, n, false, "none"}, Layout{1, 1, 1, false, "zero2"}}};
  if (n % 2 == 0) cases.push_back({llama(), Layout{2, 1, 1, false, "none"}, Layout{1, 2, 1, false, "none"}});
  auto sinks = llama();  // learned attention sinks under gpt-oss's name, split by head at tp 2
  sinks.attention = ops::AttentionBackend::kFlash, sinks.softmax_type = "learnable";
  cases.push_back({sinks, Layout{n % 2 == 0 ? 2 : 1, 1, 1, false, "none"}, Layout{1, 1, 1, false, "full"}});
  int k = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.save.text() + " -> " + c.load.text() + " " + c.cfg.family);
    const auto path = fs::join(root, std::to_string(k++) + ".safetensors");
    auto ctx = context(c.save);
    Trainer saver(ctx, c.cfg, with(options(corpus), c.save, ctx->dp_size()));
    for (int s = 0; s < 3; ++s) saver.train_step();
    saver.export_hf(path);
    const auto want = saver.full_parameters();
    checkpoint::SafetensorsReader file(path);
    const auto d = c.cfg.d_model;
    if (c.cfg.family == "gpt2") {
      EXPECT_EQ(file.info("h.1.attn.c_attn.weight").shape, (std::vector<std::int64_t>{d, 3 * d}));
      EXPECT_EQ(file.info("wpe.weight").shape, (std::vector<std::int64_t>{c.cfg.context, d}));
    } else {
      const auto kv = c.cfg.n_kv_head * c.cfg.head_dim();
      EXPECT_EQ(file.info("model.layers.1.self_attn.k_proj.weight").shape, (std::vector<std::int64_t>{kv, d}));
      EXPECT_EQ(file.contains("lm_head.weight"), !c.cfg.tie_embeddings);
      EXPECT_EQ(file.contains("model.layers.1.self_attn.sinks"), c.cfg.attention_sinks());
      if (c.cfg.attention_sinks()) {
        EXPECT_EQ(file.info("model.layers.1.self_attn.sinks").shape, (std::vector<std::int64_t>{c.cfg.n_head}));
      }
      if (c.cfg.moe.enabled()) {
        EXPECT_EQ(file.info("model.layers.0.block_sparse_moe.experts.11.w2.weight").shape,
                  (std::vector<std::int64_t>{d, c.cfg.moe.ffn_hidden}));
      }
    }
    auto o = with(options(corpus), c.load, 1);
    o.init_from = path;
    auto load_ctx = context(c.load);
    Trainer loaded(load_ctx, c.cfg, with(o, c.load, load_ctx->dp_size()));
    const auto got = loaded.full_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i].second, want[i].second)) << got[i].first;
    }
    auto other = c.cfg;
    other.d_model *= 2, other.n_head *= 2, other.n_kv_head *= 2;
    auto bad = options(corpus);
    bad.init_from = path;
    const auto msg = error_message<CheckpointError>([&] { Trainer t(ParallelContext::single_process(), other, bad); });
    expect_has(msg, {"--init-from '" + path + "'", "; this model needs"});
  }
}

// Corrupt, truncated, missing and foreign checkpoints are named errors; --resume auto
// falls back to the newest good checkpoint.
TEST_F(CheckpointTest, DamagedCheckpointsAreNamedAndAutoResumeFallsBack) {
  const int n = nranks();
  TestCorpus corpus("damaged" + std::to_string(rank()));
  const auto root = shared_dir("damaged");
  const auto cfg = models::GptConfig::preset("tiny");
  const Layout layout{1, 1, 1, false, "zero1"};
  auto ctx = context(layout);
  auto o = with(options(corpus), layout, ctx->dp_size());
  o.save_dir = root;
  {
    Trainer t(ctx, cfg, o);
    for (int s = 0; s < 4; ++s) {
      t.train_step();
      if (t.step() % 2 == 0) t.save_checkpoint();
    }
  }
  const auto last_file = fs::join(checkpoint::step_dir(root, 4), format("rank_0000{}.safetensors", n - 1));
  auto resume_error = [&](const std::string& resume, const models::GptConfig& c = models::GptConfig::preset("tiny")) {
    auto oo = o;
    oo.resume = resume;
    return error_message<CheckpointError>([&] { Trainer t(ctx, c, oo); });
  };
  // A flipped byte in the last rank's file.
  if (rank() == 0) {
    std::fstream f(last_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char b = 0;
    f.read(&b, 1);
    f.seekp(-5, std::ios::end);
    b = static_cast<char>(b ^ 0x5a);
    f.write(&b, 1);
  }
  world()->barrier()->wait();
  expect_has(resume_error(checkpoint::step_dir(root, 4)), {last_file, "checksum mismatch"});
  {
    auto oo = o;
    oo.resume = "auto";
    Trainer t(ctx, cfg, oo);
    EXPECT_EQ(t.step(), 2) << "auto falls back past the corrupt step 4";
  }
  // Truncated.
  if (rank() == 0) ::truncate(last_file.c_str(), 100);
  world()->barrier()->wait();
  expect_has(resume_error(checkpoint::step_dir(root, 4)), {last_file, "has 100 bytes"});
  // Missing.
  if (rank() == 0) ::unlink(last_file.c_str());
  world()->barrier()->wait();
  expect_has(resume_error(checkpoint::step_dir(root, 4)), {last_file, "is missing"});
  // Another model.
  auto deeper = cfg;
  deeper.n_layer = 3;
  expect_has(resume_error(checkpoint::step_dir(root, 2), deeper), {"is from a different model: n_layer is 2 there, 3 here"});
  auto sinks = cfg;  // the same weights but for none, or the same weights with another softmax
  sinks.attention = ops::AttentionBackend::kFlash, sinks.softmax_type = "off-by-one";
  expect_has(resume_error(checkpoint::step_dir(root, 2), sinks),
             {"is from a different model: softmax_type is \"vanilla\" there, \"off-by-one\" here"});
  // Not a checkpoint.
  expect_has(resume_error(corpus.dir()), {"is neither a checkpoint"});
}

// A write that fails on one rank (its file-size limit, as a full disk would) fails the
// save on every rank with that rank's error; the previous checkpoint stays the latest and
// loadable, and training and the next save go on.
TEST_F(CheckpointTest, FailedWriteLeavesThePreviousCheckpointAndTheRunIntact) {
  const int n = nranks();
  TestCorpus corpus("failwrite" + std::to_string(rank()));
  const auto root = shared_dir("failwrite");
  const Layout layout{1, 1, 1, false, "zero2"};
  auto ctx = context(layout);
  auto o = with(options(corpus), layout, ctx->dp_size());
  o.save_dir = root;
  Trainer t(ctx, models::GptConfig::preset("tiny"), o);
  t.train_step();
  t.save_checkpoint();
  t.train_step();
  const auto before = t.full_parameters();
  std::string error;
  {
    rlimit old{};
    ::getrlimit(RLIMIT_FSIZE, &old);
    auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
    if (rank() == n - 1) {
      rlimit small = old;
      small.rlim_cur = 4096;
      ::setrlimit(RLIMIT_FSIZE, &small);
    }
    error = error_message<CheckpointError>([&] { t.save_checkpoint(); });
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::signal(SIGXFSZ, old_handler);
  }
  expect_has(error, {"step 2 was not saved", format("rank_0000{}.safetensors", n - 1), "File too large"});
  EXPECT_EQ(checkpoint::list_steps(root), std::vector<std::int64_t>{1});
  EXPECT_EQ(checkpoint::latest_good(root), checkpoint::step_dir(root, 1));
  const auto after = t.full_parameters();
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i].second, after[i].second));
  t.train_step();
  t.save_checkpoint();
  EXPECT_EQ(checkpoint::list_steps(root), (std::vector<std::int64_t>{1, 3}));
  auto oo = o;
  oo.resume = "auto";
  Trainer resumed(ctx, models::GptConfig::preset("tiny"), oo);
  EXPECT_EQ(resumed.step(), 3);
}

// SIGTERM on one rank mid-run: every rank finishes the step, saves and stops; the run
// resumes from there.
TEST_F(CheckpointTest, SigtermSavesAndStops) {
  TestCorpus corpus("sigterm" + std::to_string(rank()));
  const auto root = shared_dir("sigterm");
  const Layout layout{1, 1, 1, false, "zero1"};
  auto ctx = context(layout);
  auto o = with(options(corpus), layout, ctx->dp_size());
  o.save_dir = root;
  o.steps = 2000;
  o.metrics_path = fs::join(corpus.dir(), "metrics.jsonl");
  std::thread signaller;
  if (rank() == 0) {  // once two steps are logged
    signaller = std::thread([path = o.metrics_path] {
      for (int i = 0; i < 6000; ++i) {
        std::ifstream in(path);
        int lines = 0;
        for (std::string line; std::getline(in, line);) ++lines;
        if (lines >= 2) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ::kill(::getpid(), SIGTERM);
    });
  }
  Trainer t(ctx, models::GptConfig::preset("tiny"), o);
  const auto metrics = t.run();
  if (signaller.joinable()) signaller.join();
  EXPECT_TRUE(t.preempted());
  EXPECT_LT(t.step(), o.steps);
  EXPECT_EQ(static_cast<std::int64_t>(metrics.size()), t.step());
  EXPECT_EQ(checkpoint::latest_good(root), checkpoint::step_dir(root, t.step()));
  auto oo = o;
  oo.resume = "auto";
  oo.metrics_path.clear();
  Trainer resumed(ctx, models::GptConfig::preset("tiny"), oo);
  EXPECT_EQ(resumed.step(), t.step());
}

// --exit-duration-mins: the first step that ends past the budget on any rank (here rank
// 0's budget is spent at once, the others' never) saves and stops every rank together;
// --resume auto continues from there.
TEST_F(CheckpointTest, ExitDurationSavesAndStopsEveryRank) {
  TestCorpus corpus("duration" + std::to_string(rank()));
  const auto root = shared_dir("duration");
  const Layout layout{1, 1, 1, false, "zero1"};
  auto ctx = context(layout);
  auto o = with(options(corpus), layout, ctx->dp_size());
  o.save_dir = root;
  o.steps = 5;
  o.exit_duration_mins = rank() == 0 ? 1e-9 : 1e9;
  Trainer t(ctx, models::GptConfig::preset("tiny"), o);
  const auto metrics = t.run();
  EXPECT_TRUE(t.preempted());
  EXPECT_EQ(t.step(), 1);
  EXPECT_EQ(metrics.size(), 1u);
  EXPECT_EQ(checkpoint::latest_good(root), checkpoint::step_dir(root, 1));
  o.resume = "auto";
  o.exit_duration_mins = 0;
  Trainer resumed(ctx, models::GptConfig::preset("tiny"), o);
  EXPECT_EQ(resumed.step(), 1);
  EXPECT_EQ(resumed.run().size(), 4u);
  EXPECT_FALSE(resumed.preempted());
}

// A step with non-finite gradients applies no update and is counted; the next one trains;
// max_skipped_steps in a row end the run with an error.
TEST_F(CheckpointTest, NonFiniteStepsAreSkippedThenAbort) {
  TestCorpus corpus("nan" + std::to_string(rank()));
  auto ctx = dp_context();
  auto o = options(corpus);
  o.micro_batch = o.global_batch / ctx->dp_size();
  o.max_skipped_steps = 3;
  Trainer t(ctx, models::GptConfig::preset("tiny"), o);
  // A NaN in a parameter (every rank's copy) makes the loss and every gradient NaN.
  auto param = t.model()->parameter_list().front().second;
  at::Tensor saved;
  auto poison = [&](bool on) {
    torch::NoGradGuard no_grad;
    param.copy_(saved);
    if (on) param.view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
  };
  t.train_step();
  saved = param.detach().clone();
  const auto before = t.full_parameters();
  poison(true);
  const auto m = t.train_step();
  poison(false);
  EXPECT_TRUE(m.skipped);
  EXPECT_EQ(m.skipped_steps, 1);
  const auto after = t.full_parameters();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
  }
  const auto next = t.train_step();
  EXPECT_FALSE(next.skipped);
  EXPECT_TRUE(std::isfinite(next.grad_norm));
  poison(true);
  const auto message = error_message<Error>([&] {
    for (int s = 0; s < 5; ++s) t.train_step();
  });
  expect_has(message, {"3 steps in a row", "--max-skipped-steps 3"});
}

}  // namespace
}  // namespace dtrain::testing
