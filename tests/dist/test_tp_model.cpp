// The tensor-parallel GPT against the single-process model: at tp = world size (1-4,
// odd sizes with a padded vocabulary), tp 2 x dp 2, with and without sequence
// parallelism, GPT-2 and Llama (key/value heads split, or replicated when tp does not
// divide them), replicated data parallelism and FSDP; 10 steps of the train harness with
// its tolerances (losses rtol 1e-5, gradient norms 1e-4, parameters rtol 1e-5 / atol 5e-5).
// Also: packed documents (reset positions, no loss at separators), attention sinks, every kernel option
// (the cross-entropy over the split vocabulary among them), QK-norm, the slices of the
// initial model, the dropout streams of the RNG tracker, and the errors for sizes that do
// not divide.
#include <torch/torch.h>

#include "train_harness.hpp"

namespace dtrain::testing {
namespace {

class TpModelTest : public TrainTest {
 protected:
  // sequence_parallel is dropped at tp = 1 (where it means nothing and is refused).
  ContextPtr context(int tp, bool sequence_parallel) {
    ParallelConfig c;
    c.tp = tp;
    c.sequence_parallel = sequence_parallel && tp > 1;
    return std::make_shared<ParallelContext>(world(), c);
  }
  // The tiny GPT-2 with sizes every tp in 1..4 divides (tp 3: 6 heads of 16, vocab 256
  // padded to 258).
  models::GptConfig gpt2(int tp) const {
    auto c = models::GptConfig::preset("tiny");
    if (tp == 3) c.n_head = c.n_kv_head = 6, c.d_model = 96;
    return c;
  }
  // Llama with 4 heads over 2 key/value heads: split at tp 2, replicated at tp 4 (and 3:
  // 6 heads over 2 kv heads).
  models::GptConfig llama(int tp) const {
    auto c = gpt2(tp);
    c.family = "llama";
    c.n_kv_head = 2;
    c.ffn_hidden = 96;  // divisible by 1..4
    return c;
  }
  // lr > 0: instead of the harness's.
  void expect_matches(const ContextPtr& ctx, const models::GptConfig& cfg,
                      const std::string& fsdp = "none", bool eod_mask_loss = false, double lr = 0,
                      double param_atol = 5e-5) {
    TestCorpus corpus("tp" + std::to_string(rank()));
    auto o = options(corpus);
    o.eod_mask_loss = eod_mask_loss;
    if (lr > 0) o.adamw.lr = lr;
    if (ctx->tp_size() == 3) o.seq_len = 30;  // sequence parallelism: divisible by tp
    auto ref_o = o;
    o.fsdp = fsdp;
    Trainer parallel(ctx, cfg, o);
    expect_equivalent(parallel, single_process_reference(cfg, ref_o), param_atol);
  }
};

TEST_F(TpModelTest, InitialModelIsTheSingleProcessModelSliced) {
  const int n = nranks();
  for (const auto& cfg : {gpt2(n), llama(n)}) {
    auto untied = cfg;
    untied.tie_embeddings = false;
    for (const auto& c : {cfg, untied}) {
      models::Gpt parallel(context(n, false), c, 7);
      models::Gpt ref(ParallelContext::single_process(), c, 7);
      const auto a = parallel->full_parameters(), b = ref->parameter_list();
      ASSERT_EQ(a.size(), b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(a[i].second.sizes() == b[i].second.sizes() && torch::equal(a[i].second, b[i].second))
            << c.family << " " << a[i].first;
      }
    }
  }
}

TEST_F(TpModelTest, Gpt2MatchesSingleProcessAtTpEqualWorld) {
  const int n = nranks();
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    expect_matches(context(n, sp), gpt2(n));
  }
}

TEST_F(TpModelTest, LlamaMatchesSingleProcessAtTpEqualWorld) {
  const int n = nranks();
  auto cfg = llama(n);
  cfg.tie_embeddings = false;  // the column-parallel head with a padded vocabulary
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    expect_matches(context(n, sp), cfg);
  }
}

TEST_F(TpModelTest, TpTimesDpMatchesSingleProcess) {
  if (nranks() != 4) GTEST_SKIP() << "tp 2 x dp 2 needs 4 ranks";
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    expect_matches(context(2, sp), gpt2(2));
    expect_matches(context(2, sp), llama(2));
  }
}

TEST_F(TpModelTest, TpWithFsdpMatchesSingleProcess) {
  const int n = nranks();
  const int tp = n == 4 ? 2 : n;  // 4 ranks: tp 2 x FSDP over 2
  auto cfg = llama(tp);
  for (const char* fsdp : {"zero2", "full"}) {
    SCOPED_TRACE(fsdp);
    expect_matches(context(tp, n == 4), cfg, fsdp);
  }
}

TEST_F(TpModelTest, TpWithActivationCheckpointingMatchesSingleProcess) {
  const int n = nranks();
  auto cfg = gpt2(n);
  cfg.recompute_blocks = -1;
  expect_matches(context(n, true), cfg);
}

// QK-norm: each rank norms its own heads' queries and keys with the replicated weights,
// whose gradients are summed across tp (key/value heads split at tp 2, replicated at 3
// and 4: each rank norms the key heads its query heads use). At lr 1e-3: at the harness's
// 3e-3 the parameters came up to 8.1e-5 off at tp 4 with sequence parallelism (atol 5e-5;
// without QK-norm 1.6e-6), spread over the weight matrices (attn_proj, mlp_fc) while the
// norm weights themselves stayed within 2.3e-6 and every loss and gradient norm within
// tolerance: Adam amplifying roundings in near-zero gradients, not a wrong gradient (that
// would move the norm weights by O(lr) a step). At 1e-3 the worst was 2.9e-5, and is
// 5.5e-5 (Llama at tp 4, attn_proj) on a machine whose LibTorch runs AVX-512 kernels
// (2026-12-06; 06b05f0 gives the same): parameters are held to 1e-4 here. The norm
// weights' gradient left unsummed across tp fails it by far (checked).
TEST_F(TpModelTest, QkNormMatchesSingleProcess) {
  const int n = nranks();
  for (auto cfg : {gpt2(n), llama(n)}) {
    cfg.qk_norm = true;
    for (bool sp : {false, true}) {
      SCOPED_TRACE(cfg.family + (sp ? " sequence parallel" : " tensor parallel"));
      expect_matches(context(n, sp), cfg, "none", false, 1e-3, /*param_atol=*/1e-4);
    }
  }
}

// Attention sinks (--softmax-type, flash attention's reference path on the CPU): the
// learned sinks split by query head like the heads (tp 3: 2 of 6 per rank), with sequence
// parallelism, and with FSDP (a 1-D parameter sharded with the rest); the off-by-one
// softmax (zeros, no parameter) on Llama's replicated key/value heads.
TEST_F(TpModelTest, AttentionSinksMatchSingleProcess) {
  const int n = nranks();
  for (auto cfg : {gpt2(n), llama(n)}) {
    cfg.attention = ops::AttentionBackend::kFlash;
    cfg.softmax_type = "learnable";
    SCOPED_TRACE(cfg.family + " learnable");
    expect_matches(context(n, cfg.family == "llama"), cfg, cfg.family == "gpt2" ? "full" : "none");
  }
  auto cfg = llama(n);
  cfg.attention = ops::AttentionBackend::kFlash;
  cfg.softmax_type = "off-by-one";
  SCOPED_TRACE("llama off-by-one");
  expect_matches(context(n, false), cfg);
}

// Packed documents with reset positions and no loss at separators (the byte corpus's
// newlines end them) under sequence parallelism: each rank's slice of the per-document
// learned positions (GPT-2), the rotary angles per token (Llama), and the
// vocabulary-parallel loss leaving out the ignored targets.
TEST_F(TpModelTest, PackedDocumentsMatchSingleProcess) {
  const int n = nranks();
  for (auto cfg : {gpt2(n), llama(n)}) {
    cfg.document_separator = 10, cfg.reset_position_ids = true;
    SCOPED_TRACE(cfg.family);
    expect_matches(context(n, true), cfg, "none", /*eod_mask_loss=*/true);
  }
}

// Every kernel option (the ops' reference paths on the CPU: flash attention over each
// rank's heads, the fused norms, the cross-entropy over the split vocabulary with its row
// statistics all-gathered across tp, fused AdamW over each rank's slices) against the
// plain single-process model: GPT-2's tied head and Llama's untied one (a padded
// vocabulary at tp 3), packed documents whose separators' targets are ignored. Llama's
// head and loss run in chunks (fused_linear_ce: each rank's rows of the head, the chunks'
// statistics all-gathered), GPT-2's as whole logits.
TEST_F(TpModelTest, FusedOpsMatchSingleProcess) {
  const int n = nranks();
  auto untied = llama(n);
  untied.tie_embeddings = false;
  for (auto cfg : {gpt2(n), untied}) {
    SCOPED_TRACE(cfg.family);
    cfg.document_separator = 10;
    TestCorpus corpus("tpce" + std::to_string(rank()));
    auto o = options(corpus);
    o.eod_mask_loss = true;
    o.adamw.lr = 1e-3;  // as dist_pp's: the fused ops' roundings, amplified by Adam, stay small
    if (n == 3) o.seq_len = 30;  // sequence parallelism: divisible by tp
    auto fused = cfg;
    fused.fused_ce = fused.fused_norm = fused.fused_swiglu = fused.fused_rope = true;
    fused.fused_linear_ce = cfg.family == "llama";
    fused.attention = ops::AttentionBackend::kFlash;
    auto fused_o = o;
    fused_o.adamw.fused = true;
    Trainer parallel(context(n, true), fused, fused_o);
    expect_equivalent(parallel, single_process_reference(cfg, o));
  }
}

// Replicated activations get the same dropout mask on every tp rank, split ones different
// masks; the forks leave the default generator where it was.
TEST_F(TpModelTest, RngTrackerStreams) {
  const int n = nranks();
  tp::RngTracker rng(11, rank(), c10::kCPU);
  const auto before = at::detail::getDefaultCPUGenerator().get_state();
  const auto ones = torch::ones({4096});
  auto gather = [&](const at::Tensor& t) {
    auto all = torch::empty({n, t.numel()});
    world()->all_gather(all, t.contiguous())->wait();
    return all;
  };
  const auto replicated = gather(tp::dropout(ones, 0.5, true, rng, tp::RngTracker::Stream::kReplicated));
  const auto split = gather(tp::dropout(ones, 0.5, true, rng, tp::RngTracker::Stream::kSplit));
  EXPECT_TRUE(torch::equal(before, at::detail::getDefaultCPUGenerator().get_state()));
  for (int k = 1; k < n; ++k) {
    EXPECT_TRUE(torch::equal(replicated[k], replicated[0])) << "rank " << k;
    EXPECT_FALSE(torch::equal(split[k], split[0])) << "rank " << k;
  }
  // Inverted dropout: kept elements scaled by 1 / (1 - p), about half of them kept.
  const double kept = (replicated[0] > 0).to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(kept, 0.5, 0.05);
  EXPECT_TRUE(torch::allclose(replicated[0].masked_select(replicated[0] > 0), torch::full({1}, 2.0f)));
  // The stream continues: a second draw differs from the first.
  EXPECT_FALSE(torch::equal(tp::dropout(ones, 0.5, true, rng, tp::RngTracker::Stream::kReplicated),
                            replicated[rank()]));
}

// With dropout and tensor parallelism the residual stream stays the same on every tp rank
// (or, sequence parallel, consistent shards): replicated parameters get the same gradient.
TEST_F(TpModelTest, DropoutKeepsReplicatedGradientsIdenticalAcrossTp) {
  const int n = nranks();
  for (bool sp : {false, true}) {
    auto cfg = gpt2(n);
    cfg.dropout = 0.2;
    models::Gpt model(context(n, sp), cfg, 5);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const auto idx = torch::randint(0, cfg.vocab_size, {2, 12}, gen);
    const auto targets = torch::randint(0, cfg.vocab_size, {2, 12}, gen);
    auto loss = model->loss(idx, targets);
    loss.backward();
    model->eval();
    const double no_dropout = model->loss(idx, targets).item<double>();
    EXPECT_GT(std::abs(loss.item<double>() - no_dropout), 1e-4) << "dropout had no effect";
    const auto params = model->parameter_list();
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (model->tp_shards()[i].second.dim >= 0) continue;
      const auto g = params[i].second.grad().contiguous();
      auto all = torch::empty({n, g.numel()});
      world()->all_gather(all, g.reshape({-1}))->wait();
      for (int k = 1; k < n; ++k) {
        EXPECT_TRUE(torch::equal(all[k], all[0])) << params[i].first << " rank " << k << (sp ? " sp" : "");
      }
    }
  }
}

TEST_F(TpModelTest, SizesThatDoNotDivideAreNamed) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "every size divides tp=1";
  auto heads = gpt2(n);
  heads.n_head = heads.n_kv_head = n + 1, heads.d_model = 8 * (n + 1);
  auto e = error_message([&] { models::Gpt(context(n, false), heads, 1); });
  EXPECT_NE(e.find("n_head=" + std::to_string(n + 1) + " (--n-head) is not divisible by --tp=" +
                   std::to_string(n)), std::string::npos) << e;
  auto ffn = llama(n);
  ffn.ffn_hidden = 4 * n + 1;
  e = error_message([&] { models::Gpt(context(n, false), ffn, 1); });
  EXPECT_NE(e.find("MLP width " + std::to_string(4 * n + 1)), std::string::npos) << e;
  // Sequence parallelism needs --seq-len divisible by tp.
  TestCorpus corpus("tperr" + std::to_string(rank()));
  auto o = options(corpus);
  o.seq_len = 4 * n + 1;
  e = error_message([&] { Trainer(context(n, true), gpt2(n), o); });
  EXPECT_NE(e.find("--seq-len=" + std::to_string(4 * n + 1) + " is not divisible by --tp=" +
                   std::to_string(n)), std::string::npos) << e;
}

}  // namespace
}  // namespace dtrain::testing
