// The trainer with data parallelism against the single-process run: every rank trains the
// tiny GPT with DP over the world and compares with a single-process reference on the
// whole global batch (run on rank 0, broadcast: train_harness.hpp); after 10 steps losses
// agree within 1e-5 relative and parameters within 1e-5 (float32). Also: accumulation
// under DP, --eod-mask-loss, the kernel options, overlap of the bucket all-reduces with
// backward, a data blend, and bad input on one rank stops every rank with no hang.
#include <torch/torch.h>

#include "train_harness.hpp"

namespace dtrain::testing {
namespace {

TEST_F(TrainTest, DataParallelMatchesSingleProcessForTenSteps) {
  TestCorpus corpus("dp" + std::to_string(rank()));
  const auto cfg = models::GptConfig::preset("tiny");
  auto o = options(corpus);
  o.ddp.bucket_bytes = 64 * 1024;  // several buckets
  Trainer dp(dp_context(), cfg, o);
  EXPECT_EQ(dp.data_parallel()->stats().buckets > 1, nranks() > 1);
  expect_equivalent_to_single_process(dp, cfg, corpus);
}

// A data blend (the corpus' train split and its much smaller validation split, 7:3, so
// that the small one repeats within the run) read by the ranks' shares of each step.
TEST_F(TrainTest, BlendedDataUnderDataParallelMatchesSingleProcess) {
  TestCorpus corpus("blend" + std::to_string(rank()));
  const auto cfg = models::GptConfig::preset("tiny");
  auto o = options(corpus);
  o.train_data = format("0.7 {} 0.3 {}", corpus.train(), corpus.val());
  o.val_data.clear();
  const auto reference = single_process_reference(cfg, o);
  Trainer dp(dp_context(), cfg, o);
  expect_equivalent(dp, reference);
}

// The llama family (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head) with
// one sample per micro-batch.
TEST_F(TrainTest, AccumulationUnderDataParallelMatchesSingleProcess) {
  TestCorpus corpus("acc" + std::to_string(rank()));
  const auto tiny = tiny_llama();
  auto o = options(corpus);
  o.micro_batch = 1;  // 12 / n micro-batches per rank
  Trainer dp(dp_context(), tiny, o);
  EXPECT_EQ(dp.grad_accumulation(), 12 / nranks());
  expect_equivalent_to_single_process(dp, tiny, corpus);
}

// --eod-mask-loss (each line of the text a document): with one sample per micro-batch the
// micro-batches and the ranks hold different numbers of loss targets, and each weighs its
// share of the global batch's: the single-process run of the whole batch at once.
TEST_F(TrainTest, EodMaskLossUnderDataParallelMatchesSingleProcess) {
  TestCorpus corpus("eod" + std::to_string(rank()));
  auto cfg = models::GptConfig::preset("tiny");
  cfg.document_separator = 10;
  auto o = options(corpus);
  o.eod_mask_loss = true;
  const auto reference = single_process_reference(cfg, o);
  o.micro_batch = 1;
  Trainer dp(dp_context(), cfg, o);
  expect_equivalent(dp, reference);
}

// Every kernel option (the ops' reference paths on the CPU) under replicated data
// parallelism with accumulation and eod-mask-loss, Llama (grouped-query attention, untied
// head, the head and loss as fused linear cross-entropy), against the plain single-process run.
TEST_F(TrainTest, FusedOpsUnderDataParallelMatchSingleProcess) {
  TestCorpus corpus("dpfused" + std::to_string(rank()));
  auto cfg = tiny_llama();
  cfg.document_separator = 10;
  auto o = options(corpus);
  o.eod_mask_loss = true;
  o.adamw.lr = 1e-3;  // as dist_pp's: the fused ops' roundings, amplified by Adam, stay small
  const auto reference = single_process_reference(cfg, o);
  cfg.fused_ce = cfg.fused_norm = cfg.fused_swiglu = cfg.fused_rope = true;
  cfg.fused_linear_ce = true;  // the head and the loss in chunks (the loss kernel per chunk)
  cfg.attention = ops::AttentionBackend::kFlash;
  o.adamw.fused = true;
  o.micro_batch = 1;
  Trainer dp(dp_context(), cfg, o);
  expect_equivalent(dp, reference);
}

TEST_F(TrainTest, BucketAllReducesStartDuringBackward) {
  TestCorpus corpus("ov" + std::to_string(rank()));
  auto o = options(corpus);
  o.steps = 1;
  o.warmup_steps = 0;
  o.ddp.bucket_bytes = 16 * 1024;
  Trainer t(dp_context(), models::GptConfig::preset("tiny"), o);
  t.train_step();
  const auto& s = t.data_parallel()->stats();
  if (nranks() == 1) {
    EXPECT_EQ(s.buckets, 0) << "one rank needs no all-reduce";
    return;
  }
  EXPECT_GE(s.launched_during_backward, 1);
  EXPECT_LT(s.grads_before_first_launch,
            static_cast<std::int64_t>(t.model()->parameter_list().size()))
      << "the first all-reduce must start before the last gradient is computed";
}

TEST_F(TrainTest, BadDataOnOneRankStopsEveryRank) {
  TestCorpus corpus("bad" + std::to_string(rank()));
  auto o = options(corpus);
  const int bad = nranks() - 1;
  if (rank() == bad) o.train_data = corpus.dir() + "/missing_*.bin";
  try {
    Trainer t(dp_context(), models::GptConfig::preset("tiny"), o);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    if (rank() == bad) {
      EXPECT_NE(what.find("missing_*.bin"), std::string::npos) << what;
      if (bad != 0) {
        EXPECT_EQ(what.rfind("rank " + std::to_string(bad) + ":", 0), 0u) << what;
      }
    } else {
      EXPECT_NE(what.find("rank(s) " + std::to_string(bad) + " rejected"), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace dtrain::testing
