// The pipeline runtime over the world as the pp group (1-4 stages): every schedule (gpipe,
// 1f1b, interleaved with 2 chunks per rank, zb) runs one step of m micro-batches through
// model stages cut by balanced_partition, and the loss and every parameter gradient
// (assembled over the stages; tied embedding copies summed) equal the single-process
// model's on the whole batch (also with a document separator, whose mask every stage
// takes from the micro-batch's tokens). Tolerance: float32, loss rtol 1e-6, gradients rtol 1e-5 /
// atol 1e-7 (micro-batch means summed in another order).
// The Trainer with --pp: every schedule at pp = world (2-4) and pp 2 x dp 2, 10 steps
// against the single-process run with the train harness's tolerances (tied embeddings
// summed between the first and last stage, clipping over the stages); the pipeline with
// FSDP and with tp (pp 2 x tp 2, sequence parallelism); errors.
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>

#include "train_harness.hpp"
#include "dtrain/models/gpt.hpp"
#include "dtrain/parallel/pipeline.hpp"
#include "dtrain/parallel/pipeline_partition.hpp"

namespace dtrain::testing {
namespace {

class PpTest : public DistTest {};

TEST_F(PpTest, EveryScheduleMatchesTheWholeModel) {
  const int p = nranks(), rank = this->rank();
  auto gpt2 = models::GptConfig::preset("tiny");
  auto llama = gpt2;
  llama.family = "llama", llama.n_kv_head = 2, llama.tie_embeddings = false;
  auto documents = llama;  // every stage's document mask from the micro-batch's tokens
  documents.document_separator = 5, documents.reset_position_ids = true;
  for (auto cfg : {gpt2, llama, documents}) {
    cfg.n_layer = 8;
    for (auto kind : {pp::ScheduleKind::kGPipe, pp::ScheduleKind::k1F1B, pp::ScheduleKind::kInterleaved,
                      pp::ScheduleKind::kZeroBubble}) {
      const bool interleaved = kind == pp::ScheduleKind::kInterleaved;
      const int v = interleaved ? 2 : 1, m = interleaved ? 2 * p : 5;
      const std::int64_t micro = 2, seq = 16;
      SCOPED_TRACE(cfg.family + " " + pp::to_string(kind));
      auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
      auto inputs = torch::randint(0, cfg.vocab_size, {m * micro, seq}, gen);
      inputs.select(1, 6).fill_(5), inputs.slice(0, 0, m * micro, 3).select(1, 11).fill_(5);  // separators
      const auto targets = torch::randint(0, cfg.vocab_size, {m * micro, seq}, gen);

      models::Gpt whole(ParallelContext::single_process(), cfg, 3);
      auto ref_loss = whole->loss(inputs, targets);
      ref_loss.backward();

      const auto counts = pp::balanced_partition(std::vector<double>(8, 1.0), 0, 0, p * v);
      std::vector<models::Gpt> models;
      std::vector<pp::StageChunk> chunks;
      for (int c = 0; c < v; ++c) {
        const int g = pp::virtual_stage(rank, c, p);
        std::int64_t first = 0;
        for (int k = 0; k < g; ++k) first += counts[static_cast<std::size_t>(k)];
        models::GptStage stage{first, first + counts[static_cast<std::size_t>(g)], g == 0, g == p * v - 1};
        models.emplace_back(ParallelContext::single_process(), cfg, 3, stage);
        auto model = models.back();
        auto tokens = std::make_shared<at::Tensor>();
        chunks.push_back({[model, tokens](const at::Tensor& x) mutable { return model->forward_stage(x, *tokens); },
                          [model](const at::Tensor& h, const at::Tensor& t) mutable { return model->loss_from_hidden(h, t); },
                          model->parameters(), {}, [tokens](const at::Tensor& t) { *tokens = t; }, {}});
      }
      pp::PipelineOptions o;
      o.schedule = kind;
      o.shape = {p, m, v};
      o.activation_shape = {micro, seq, cfg.d_model};
      pp::PipelineRuntime runtime(chunks, world(), o);
      const double loss = runtime.run(inputs, targets);
      if (rank == (p * v - 1) % p) {
        EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-6 * ref_loss.item<double>());
      } else {
        EXPECT_TRUE(std::isnan(loss));
      }
      // Every gradient, summed over the stages that hold the parameter.
      for (const auto& item : whole->named_parameters()) {
        auto grad = torch::zeros_like(item.value());
        for (auto& model : models) {
          const auto mine = model->named_parameters();
          if (mine.contains(item.key()) && mine[item.key()].grad().defined()) grad += mine[item.key()].grad();
        }
        world()->all_reduce(grad)->wait();
        EXPECT_TRUE(torch::allclose(grad, item.value().grad(), 1e-5, 1e-7))
            << item.key() << " max diff " << (grad - item.value().grad()).abs().max().item<float>();
      }
    }
  }
}

TEST_F(PpTest, RuntimeChecksItsShape) {
  pp::PipelineOptions o;
  o.shape = {nranks() + 1, 4, 1};
  o.activation_shape = {1, 4, 8};
  EXPECT_NE(error_message([&] { pp::PipelineRuntime({}, world(), o); }).find("stages but the pp group has"),
            std::string::npos);
  o.shape = {nranks(), 4, 1};
  EXPECT_NE(error_message([&] { pp::PipelineRuntime({}, world(), o); }).find("0 model chunks on this rank"),
            std::string::npos);
}

// before_loss gets, before each micro-batch's loss on the last stage, the factor run()
// weighs it by (its weight, 1/m without weights), in every schedule and in forward_only.
TEST_F(PpTest, BeforeLossGetsEachMicroBatchsWeight) {
  const int p = nranks(), rank = this->rank();
  for (auto kind : {pp::ScheduleKind::kGPipe, pp::ScheduleKind::k1F1B, pp::ScheduleKind::kInterleaved,
                    pp::ScheduleKind::kZeroBubble}) {
    const int v = kind == pp::ScheduleKind::kInterleaved ? 2 : 1, m = 2 * p;
    const std::int64_t micro = 2, seq = 3;
    SCOPED_TRACE(pp::to_string(kind));
    // Micro-batch i's targets are all i, so that the loss knows whose it is.
    const auto targets = torch::arange(m).repeat_interleave(micro * seq).view({m * micro, seq});
    const auto inputs = torch::ones({m * micro, seq}, torch::kLong);
    std::vector<double> weights;
    for (int i = 0; i < m; ++i) weights.push_back(0.1 * (i + 1));
    std::vector<torch::Tensor> scales;
    std::vector<pp::StageChunk> chunks;
    auto announced = std::make_shared<double>(-1);
    auto seen = std::make_shared<std::vector<std::pair<std::int64_t, double>>>();  // (micro-batch, factor)
    for (int c = 0; c < v; ++c) {
      const bool first = pp::virtual_stage(rank, c, p) == 0;
      scales.push_back(torch::full({1}, 1.5, torch::requires_grad()));
      auto w = scales.back();
      chunks.push_back({[w, first](const at::Tensor& x) { return (first ? x.to(torch::kFloat).unsqueeze(-1) : x) * w; },
                        [announced, seen](const at::Tensor& h, const at::Tensor& t) {
                          seen->emplace_back(t[0][0].item<std::int64_t>(), *announced);
                          *announced = -1;  // one announcement per loss
                          return h.mean();
                        },
                        {w}, {}, {},
                        [announced](double weight) { *announced = weight; }});
    }
    pp::PipelineOptions o;
    o.schedule = kind;
    o.shape = {p, m, v};
    o.activation_shape = {micro, seq, 1};
    pp::PipelineRuntime runtime(chunks, world(), o);
    const bool last = rank == (p * v - 1) % p;
    for (bool weighed : {true, false}) {
      for (bool train : {true, false}) {
        SCOPED_TRACE(std::string(weighed ? "weights" : "no weights") + (train ? " run" : " forward_only"));
        seen->clear();
        const auto& w = weighed ? weights : std::vector<double>{};
        train ? runtime.run(inputs, targets, w) : runtime.forward_only(inputs, targets, w);
        ASSERT_EQ(seen->size(), last ? static_cast<std::size_t>(m) : 0U);
        std::vector<bool> done(static_cast<std::size_t>(m), false);
        for (const auto& [i, factor] : *seen) {
          ASSERT_TRUE(i >= 0 && i < m && !done[static_cast<std::size_t>(i)]) << i;
          done[static_cast<std::size_t>(i)] = true;
          EXPECT_DOUBLE_EQ(factor, weighed ? weights[static_cast<std::size_t>(i)] : 1.0 / m) << "micro-batch " << i;
        }
      }
    }
  }
}

class PpTrainTest : public TrainTest {
 protected:
  ContextPtr context(int pp, int tp = 1, bool sequence_parallel = false) {
    ParallelConfig c;
    c.pp = pp;
    c.tp = tp;
    c.sequence_parallel = sequence_parallel;
    return std::make_shared<ParallelContext>(world(), c);
  }
  // 10 steps of `schedule` (one sample per micro-batch; interleaved with 2 chunks) on the
  // context against the single-process run.
  void expect_pipeline_equivalent(const ContextPtr& ctx, const models::GptConfig& cfg,
                                  const std::string& schedule, const std::string& fsdp = "none") {
    TestCorpus corpus("pp" + std::to_string(rank()));
    auto o = options(corpus);
    o.micro_batch = 1;
    o.pp_schedule = schedule;
    o.virtual_stages = schedule == "interleaved" ? 2 : 1;
    o.fsdp = fsdp;
    Trainer pipelined(ctx, cfg, o);
    expect_equivalent_to_single_process(pipelined, cfg, corpus);
  }
  // GPT-2 (tied embeddings) and Llama (untied, 2 kv heads), 8 blocks.
  static std::pair<models::GptConfig, models::GptConfig> models8() {
    auto gpt2 = models::GptConfig::preset("tiny");
    gpt2.n_layer = 8;
    auto llama = gpt2;
    llama.family = "llama", llama.n_kv_head = 2, llama.tie_embeddings = false;
    return {gpt2, llama};
  }
};

// 8 blocks; 12 micro-batches of one sample at dp 1 (6 at dp 2): every schedule's m fits.
TEST_F(PpTrainTest, EveryScheduleMatchesSingleProcessForTenSteps) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "pipeline parallelism needs 2 or more ranks";
  const auto [gpt2, llama] = models8();
  std::vector<int> layouts = {n};
  if (n == 4) layouts.push_back(2);  // pp 2 x dp 2: two schedules, GPT-2
  for (int pp : layouts) {
    for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zb"}) {
      for (const auto& cfg : {gpt2, llama}) {
        if (pp != n && (cfg.family == "llama" || schedule[0] == 'g' || schedule[0] == 'z')) continue;
        SCOPED_TRACE(std::string(schedule) + " pp=" + std::to_string(pp) + " " + cfg.family);
        expect_pipeline_equivalent(context(pp), cfg, schedule);
      }
    }
  }
}

// --eod-mask-loss through the pipeline: the last stage weighs each micro-batch by its share
// of the global batch's loss targets (PipelineRuntime::run's weights); at 4 ranks also
// pp 2 x dp 2.
TEST_F(PpTrainTest, EodMaskLossMatchesSingleProcess) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "pipeline parallelism needs 2 or more ranks";
  auto cfg = models8().first;
  cfg.document_separator = 10;  // each line of the text a document
  TestCorpus corpus("ppeod" + std::to_string(rank()));
  auto o = options(corpus);
  o.eod_mask_loss = true;
  const auto reference = single_process_reference(cfg, o);
  o.micro_batch = 1;
  for (int pp : n == 4 ? std::vector<int>{4, 2} : std::vector<int>{n}) {
    SCOPED_TRACE("pp=" + std::to_string(pp));
    Trainer pipelined(context(pp), cfg, o);
    expect_equivalent(pipelined, reference);
  }
}

// The pipeline inside the mesh: stages sharded over dp (zero1/zero2/full, the tied copy
// included) and split over tp (with and without sequence parallelism), 10 steps against
// the single-process run with the harness's tolerances.
TEST_F(PpTrainTest, ComposesWithShardingAndTensorParallelism) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "pipeline parallelism needs 2 or more ranks";
  const auto [gpt2, llama] = models8();
  struct Case {
    int pp, tp;
    bool sp;
    const char* fsdp;
    const char* schedule;
    models::GptConfig cfg;
  };
  std::vector<Case> cases;
  if (n == 2) cases = {{2, 1, false, "full", "1f1b", gpt2}, {2, 1, false, "zero2", "zb", llama}};
  if (n == 3) cases = {{3, 1, false, "zero1", "gpipe", gpt2}};
  if (n == 4) {
    cases = {{2, 2, false, "none", "1f1b", gpt2},        {2, 2, true, "none", "zb", llama},
             {2, 2, true, "none", "interleaved", gpt2},  {2, 1, false, "zero2", "interleaved", llama},
             {2, 1, false, "full", "1f1b", gpt2},        {2, 1, false, "full", "zb", gpt2},
             {2, 2, true, "zero1", "1f1b", gpt2}};
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(format("{} pp={} tp={}{} fsdp={} {}", c.schedule, c.pp, c.tp, c.sp ? " sp" : "",
                        c.fsdp, c.cfg.family));
    expect_pipeline_equivalent(context(c.pp, c.tp, c.sp), c.cfg, c.schedule, c.fsdp);
  }
}

// Every kernel option (the ops' reference paths on the CPU: flash attention, the fused
// norms, the cross-entropy on the last stage, fused AdamW per stage) through 1f1b and
// zero bubble (the loss's backward inside Bi) against the plain single-process run;
// packed documents with eod-mask-loss (each micro-batch weighed by its targets); at 4
// ranks pp 2 x tp 2 with sequence parallelism (the cross-entropy over the split
// vocabulary; below that Llama's loss is the fused linear cross-entropy, whose gradients
// zero bubble asks for one at a time). lr 1e-3: at the harness's 3e-3 Llama's step 5 is a spike (gradient norm
// 24.6) where the fused ops' own roundings, amplified, came to 0.8-1.0e-4 of it, at the
// tolerance (every other step within 2e-6); at 1e-3 the worst step is within 5e-7.
TEST_F(PpTrainTest, FusedOpsMatchSingleProcess) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "pipeline parallelism needs 2 or more ranks";
  const auto [gpt2, llama] = models8();
  for (auto cfg : {gpt2, llama}) {
    cfg.document_separator = 10;
    TestCorpus corpus("ppfused" + std::to_string(rank()));
    auto o = options(corpus);
    o.eod_mask_loss = true;
    o.adamw.lr = 1e-3;
    const auto reference = single_process_reference(cfg, o);
    cfg.fused_ce = cfg.fused_norm = cfg.fused_swiglu = cfg.fused_rope = true;
    cfg.attention = ops::AttentionBackend::kFlash;
    o.adamw.fused = true;
    o.micro_batch = 1;
    for (const char* schedule : {"1f1b", "zb"}) {
      const int tp = n == 4 ? 2 : 1;
      SCOPED_TRACE(format("{} pp={} tp={} {}", schedule, n / tp, tp, cfg.family));
      o.pp_schedule = schedule;
      auto run_cfg = cfg;  // the head and loss in chunks: Llama's, and at tp 2 GPT-2's tied head's rows
      run_cfg.fused_linear_ce = cfg.family == "llama" || tp > 1;
      Trainer pipelined(context(n / tp, tp, tp > 1), run_cfg, o);
      expect_equivalent(pipelined, reference);
    }
  }
}

// --trace: every action of every step is a span on this rank (F and B, or F, Bi and W per
// micro-batch), with the step, gradient sync and optimizer spans; the rank's file holds
// them all.
TEST_F(PpTrainTest, TraceRecordsEveryAction) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "pipeline parallelism needs 2 or more ranks";
  auto cfg = models::GptConfig::preset("tiny");
  cfg.n_layer = 4;
  for (const char* schedule : {"1f1b", "zb"}) {
    SCOPED_TRACE(schedule);
    TestCorpus corpus("pptrace" + std::to_string(rank()));
    auto o = options(corpus);
    o.steps = 2;
    o.micro_batch = 2;  // 6 micro-batches
    o.pp_schedule = schedule;
    o.trace_path = corpus.dir() + "/trace.json";
    Trainer trainer(context(n), cfg, o);
    trainer.run();
    std::map<std::string, int> count;
    for (const auto& e : trainer.trace()->events()) {
      ++count[e.name];
      if (e.category == "pp" && e.track == trace::Track::kCompute) {
        EXPECT_EQ(e.args.back(), (std::pair<std::string, std::int64_t>{"stage", rank()}));
      }
    }
    const int actions = 2 * 6;  // steps x micro-batches
    EXPECT_EQ(count["F"], actions);
    if (std::string(schedule) == "zb") {
      EXPECT_EQ(count["Bi"], actions);
      EXPECT_EQ(count["W"], actions);
      EXPECT_EQ(count["B"], 0);
    } else {
      EXPECT_EQ(count["B"], actions);
    }
    EXPECT_EQ(count["recv"], rank() == 0 || rank() == n - 1 ? actions : 2 * actions);
    EXPECT_EQ(count["step"], 2);
    EXPECT_EQ(count["grad-sync"], 2);
    EXPECT_EQ(count["optimizer"], 2);
    std::ifstream in(trace::rank_path(o.trace_path, rank()));
    ASSERT_TRUE(in.good());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::size_t spans = 0;
    for (auto at = text.find("\"ph\":\"X\""); at != std::string::npos; at = text.find("\"ph\":\"X\"", at + 1)) ++spans;
    EXPECT_EQ(spans, trainer.trace()->events().size());
  }
}

TEST_F(PpTrainTest, BadConfigurationsAreNamed) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "pipeline parallelism needs 2 or more ranks";
  TestCorpus corpus("pperr" + std::to_string(rank()));
  auto cfg = models::GptConfig::preset("tiny");  // 2 blocks
  auto o = options(corpus);
  auto e = error_message([&] { Trainer(context(n), cfg, o); });
  if (n > 2) {
    EXPECT_NE(e.find(std::to_string(n) + " virtual stages (--pp x --virtual-stages) but the model has 2 blocks"),
              std::string::npos) << e;
  }
  o.pp_schedule = "interleaved";
  o.virtual_stages = 2;
  const int m = n == 2 ? 3 : 2;  // micro-batches: not a multiple of pp
  o.micro_batch = 12 / m;
  cfg.n_layer = 8;
  e = error_message([&] { Trainer(context(n), cfg, o); });
  EXPECT_NE(e.find("--microbatches=" + std::to_string(m) + " is not a multiple of --pp=" + std::to_string(n)),
            std::string::npos) << e;
  o = options(corpus);
  o.fsdp = "full";
  o.pp_schedule = "interleaved";
  o.virtual_stages = 2;
  o.micro_batch = 12 / (2 * n);
  e = error_message([&] { Trainer(context(n), cfg, o); });
  EXPECT_NE(e.find("--fsdp full with --virtual-stages 2 is not available"), std::string::npos) << e;
  o = options(corpus);
  o.pp_schedule = "pipedream";
  e = error_message([&] { Trainer(context(n), cfg, o); });
  EXPECT_NE(e.find("--pp-schedule 'pipedream' is not known"), std::string::npos) << e;
}

}  // namespace
}  // namespace dtrain::testing
