// Context parallelism against the whole sequence in one process, in its three forms (keys
// and values all-gathered; heads exchanged for positions by all-to-all; keys and values
// passed round a ring, flash attention on blocks merged by log-sum-exp): the attention of each
// rank's chunks (outputs and gradients, with grouped-query heads, a sliding window, packed
// documents and logit soft-capping) at cp = world size (1-4), and training: 10 steps of
// the train harness at cp = world size, and composed with data parallelism, FSDP, tensor
// and sequence parallelism and pipelines, each against the single-process run with the
// harness's tolerances (losses rtol 1e-5, gradient norms 1e-4, parameters rtol 1e-5 /
// atol 5e-5).
// Also the errors for what cannot be split.
#include <torch/torch.h>

#include "dtrain/parallel/context_parallel.hpp"
#include "train_harness.hpp"

namespace dtrain::testing {
namespace {

class CpTest : public TrainTest {
 protected:
  ContextPtr context(int cp, CpComm comm = CpComm::kAllGather, int tp = 1, int pp = 1,
                     bool sequence_parallel = false) {
    ParallelConfig c;
    c.cp = cp, c.cp_comm = comm, c.tp = tp, c.pp = pp, c.sequence_parallel = sequence_parallel;
    return std::make_shared<ParallelContext>(world(), c);
  }
  // 12 heads over 2 key/value heads (a2a splits both at cp 2 and repeats the kv heads per
  // query head at 3 and 4), packed documents (each line of the text one, positions
  // restarting, no loss at the separators) and a sliding window shorter than the sequence.
  static models::GptConfig llama() {
    auto c = tiny_llama();
    c.d_model = 96, c.n_head = 12;
    c.ffn_hidden = 96;  // divisible by the tp of the composed runs
    c.document_separator = 10, c.reset_position_ids = true;
    c.attention_window = 20;
    return c;
  }
  // The same on the flash backend (its reference path here), which ring attention needs.
  static models::GptConfig flash_llama() {
    auto c = llama();
    c.attention = ops::AttentionBackend::kFlash;
    return c;
  }
  // 48 tokens: 2 x cp chunks for every cp in 1..4 (and 6 at cp 3).
  static TrainOptions cp_options(const TestCorpus& corpus, bool eod_mask_loss) {
    auto o = options(corpus);
    o.seq_len = 48;
    o.eod_mask_loss = eod_mask_loss;
    return o;
  }
  void expect_matches(const ContextPtr& ctx, const models::GptConfig& cfg, TrainOptions o) {
    auto ref_o = o;
    ref_o.fsdp = "none";  // the plain single-process run (hybrid sharding needs ranks)
    if (ctx->pp_size() > 1) o.micro_batch = 1;
    Trainer parallel(ctx, cfg, o);
    expect_equivalent(parallel, single_process_reference(cfg, ref_o));
  }
};

TEST_F(CpTest, LayoutBalancesTheChunksAndGatherRestoresTheSequence) {
  // Rank r of cp holds chunks r and 2 cp - 1 - r of 2 cp.
  EXPECT_TRUE(torch::equal(cp::local_positions(12, 3, 0), torch::tensor({0, 1, 10, 11}, torch::kLong)));
  EXPECT_TRUE(torch::equal(cp::local_positions(12, 3, 1), torch::tensor({2, 3, 8, 9}, torch::kLong)));
  EXPECT_TRUE(torch::equal(cp::local_positions(12, 3, 2), torch::tensor({4, 5, 6, 7}, torch::kLong)));
  EXPECT_TRUE(torch::equal(cp::local_positions(8, 1, 0), torch::arange(8, torch::kLong)));
  expect_has(error_message([] { cp::check_sequence(30, 4); }), {"--seq-len=30", "--cp=4", "multiple of 8"});
  expect_has(error_message([] { cp::local_positions(12, 3, 3); }), {"rank 3", "[0, 3)"});

  const int n = nranks();
  auto ctx = context(n);
  const auto x = torch::randn({2, 3, 24, 5}, torch::TensorOptions().dtype(torch::kDouble));
  world()->broadcast(x)->wait();
  auto mine = cp::take_local(x, 2, n, ctx->cp_rank()).clone().requires_grad_();  // cp 1: x itself
  const auto whole = cp::gather_sequence(mine, 2, ctx->cp_comm());
  EXPECT_TRUE(torch::equal(whole, x));
  // The gradient of the gathered sequence comes back summed over the ranks: each rank
  // weighs it by its rank + 1.
  (whole * x * static_cast<double>(rank() + 1)).sum().backward();
  EXPECT_TRUE(torch::allclose(mine.grad(), cp::take_local(x, 2, n, ctx->cp_rank()) * (n * (n + 1) / 2.0)));
}

TEST_F(CpTest, AttentionMatchesTheWholeSequence) {
  const int n = nranks();
  auto ctx = context(n);
  const int r = ctx->cp_rank();
  const std::int64_t B = 2, H = 12, T = 24, D = 8;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  struct Case {
    CpComm comm;
    std::int64_t kv_heads, window;
    bool documents;
    ops::AttentionBackend backend = ops::AttentionBackend::kSdpa;
    double softcap = 0.0;  // logit soft-capping (flash only)
    bool sinks = false;    // attention sinks (flash only)
  };
  const auto a2a = CpComm::kAllToAll, gather = CpComm::kAllGather, ring = CpComm::kRing;
  const auto flash = ops::AttentionBackend::kFlash;  // its reference path on the CPU
  for (const auto& c : {Case{gather, 12, 0, false}, Case{gather, 2, 0, true}, Case{gather, 4, 7, false},
                        Case{gather, 12, 5, true}, Case{a2a, 12, 0, false}, Case{a2a, 2, 0, true},
                        Case{a2a, 4, 7, false}, Case{a2a, 12, 5, true}, Case{a2a, 2, 5, true, flash},
                        Case{gather, 4, 0, false, flash}, Case{gather, 2, 5, true, flash},
                        Case{ring, 12, 0, false, flash}, Case{ring, 2, 0, false, flash},
                        Case{ring, 4, 7, false, flash}, Case{ring, 2, 5, true, flash}, Case{ring, 12, 0, true, flash},
                        Case{ring, 12, 2, true, flash}, Case{gather, 2, 5, true, flash, 1.5},
                        Case{a2a, 4, 0, false, flash, 1.5}, Case{ring, 12, 0, false, flash, 1.5},
                        Case{ring, 2, 5, true, flash, 1.5}, Case{gather, 2, 5, true, flash, 0.0, true},
                        Case{a2a, 4, 0, false, flash, 0.0, true}, Case{ring, 2, 5, true, flash, 0.0, true},
                        Case{ring, 12, 0, false, flash, 1.5, true}}) {
    SCOPED_TRACE(format("{}, kv heads {}, window {}, documents {}, {}, softcap {}, sinks {}", to_string(c.comm),
                        c.kv_heads, c.window, c.documents, ops::to_string(c.backend), c.softcap, c.sinks));
    auto q = torch::randn({B, H, T, D}, f64), k = torch::randn({B, c.kv_heads, T, D}, f64);
    auto v = torch::randn({B, c.kv_heads, T, D}, f64), dy = torch::randn({B, H, T, D}, f64);
    auto sinks = torch::randn({H}, f64) * 2 + 1;
    // Documents of 1 to 9 tokens, numbered by their first token.
    auto ids = (torch::rand({B, T}, f64) < 0.2).to(torch::kLong).cumsum(1);
    for (auto* t : {&q, &k, &v, &dy, &ids, &sinks}) world()->broadcast(*t)->wait();
    const ops::Documents documents = c.documents ? ops::Documents(ids) : ops::Documents();

    auto qw = q.clone().requires_grad_(), kw = k.clone().requires_grad_(), vw = v.clone().requires_grad_();
    auto sw = sinks.clone().requires_grad_();
    const auto want =
        ops::attention(qw, kw, vw, true, 0.0, c.backend, c.window, documents, 0, c.softcap, c.sinks ? sw : at::Tensor());
    (want * dy).sum().backward();

    auto local = [&](const torch::Tensor& t) { return cp::take_local(t.detach(), 2, n, r).clone(); };
    auto ql = local(q).requires_grad_(), kl = local(k).requires_grad_(), vl = local(v).requires_grad_();
    auto sl = sinks.clone().requires_grad_();
    const auto got = cp::attention(ql, kl, vl, ctx->cp_comm(), c.comm, c.backend, 0.0, c.window, documents,
                                   c.softcap, c.sinks ? sl : at::Tensor());
    (got * local(dy)).sum().backward();
    if (c.sinks) {  // each rank's share of the sinks' gradient (its queries'), summed over cp
      auto ds = sl.grad().clone();
      ctx->cp_comm()->all_reduce(ds)->wait();
      EXPECT_TRUE(torch::allclose(ds, sw.grad(), 1e-10, 1e-12)) << (ds - sw.grad()).abs().max().item<double>();
    }
    EXPECT_TRUE(torch::allclose(got, local(want), 1e-10, 1e-12)) << (got - local(want)).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(ql.grad(), local(qw.grad()), 1e-10, 1e-12));
    EXPECT_TRUE(torch::allclose(kl.grad(), local(kw.grad()), 1e-10, 1e-12))
        << (kl.grad() - local(kw.grad())).abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(vl.grad(), local(vw.grad()), 1e-10, 1e-12));
  }
}

// cp = world size: Llama with packed documents and a window in all_gather and a2a on sdpa,
// in all three forms on flash, with soft-capping on the ring, and with learned attention
// sinks and a global block among windowed ones on the ring and a2a (flash's reference path,
// the kernel's function: query offsets for all_gather and the ring's blocks), GPT-2 with
// learned positions and tied embeddings.
TEST_F(CpTest, TrainingMatchesSingleProcess) {
  const int n = nranks();
  TestCorpus corpus("cp" + std::to_string(rank()));
  for (const auto comm : {CpComm::kAllGather, CpComm::kAllToAll}) {
    SCOPED_TRACE(format("llama, documents, window, {}", to_string(comm)));
    expect_matches(context(n, comm), llama(), cp_options(corpus, /*eod_mask_loss=*/true));
  }
  for (const auto comm : {CpComm::kAllGather, CpComm::kAllToAll, CpComm::kRing}) {
    SCOPED_TRACE(format("llama, documents, window, {}, flash attention", to_string(comm)));
    expect_matches(context(n, comm), flash_llama(), cp_options(corpus, true));
  }
  {  // logit soft-capping on the ring's blocks (elementwise on the scores, merged as usual)
    SCOPED_TRACE("llama, documents, window, soft-capping, p2p, flash attention");
    auto cfg = flash_llama();
    cfg.attention_softcap = 2.0;
    expect_matches(context(n, CpComm::kRing), cfg, cp_options(corpus, true));
  }
  for (const auto comm : {CpComm::kRing, CpComm::kAllToAll}) {
    // learned sinks: folded in once after the ring's merge; each rank's heads' after a2a;
    // block 1 global (--window-attn-skip-freq 2: the ring visits every earlier block there)
    SCOPED_TRACE(format("llama, documents, window, global every 2 blocks, learnable softmax, {}, flash attention",
                        to_string(comm)));
    auto cfg = flash_llama();
    cfg.softmax_type = "learnable";
    cfg.window_skip_every = 2;
    expect_matches(context(n, comm), cfg, cp_options(corpus, true));
  }
  {
    SCOPED_TRACE("gpt2");
    expect_matches(context(n), models::GptConfig::preset("tiny"), cp_options(corpus, false));
  }
}

// A rank whose positions hold no loss token (--eod-mask-loss over chunks of separators)
// weighs that micro-batch 0: the step's loss and the validation loss are the other
// micro-batches' and ranks' share, as the single process's, never a 0/0 that spoils the
// rank's sum. Every other 16-token sample is "abcd" and 12 separators (at cp 2 rank 1
// holds positions 4-11: all separators), the others 16 letters; micro-batches of one
// sample. At 4 ranks through two pipeline stages (the last stage's loss).
TEST_F(CpTest, RankWithoutLossTokensAddsNothing) {
  const int n = nranks();
  if (n != 2 && n != 4) GTEST_SKIP() << "cp 2, or cp 2 x pp 2";
  std::string text;
  for (int i = 0; i < 160; ++i) text += "abcd" + std::string(12, '#') + "efghijklmnopqrst";  // samples aligned in both shards
  TestCorpus corpus("cpnoloss" + std::to_string(rank()), text);
  auto o = cp_options(corpus, /*eod_mask_loss=*/true);
  o.seq_len = 16;
  o.val_data = corpus.val();
  auto cfg = llama();
  cfg.document_separator = '#';
  o.micro_batch = 1;
  Trainer parallel(context(2, CpComm::kAllGather, 1, n / 2), cfg, o);
  EXPECT_TRUE(std::isfinite(parallel.evaluate()));
  expect_equivalent(parallel, single_process_reference(cfg, o));
}

// The whole model's logits (gathered from every rank's positions) and the validation loss
// (averaged over dp x cp) of the initial model equal the single process's, in both forms.
TEST_F(CpTest, LogitsAndValidationLossMatchSingleProcess) {
  const int n = nranks();
  TestCorpus corpus("cpval" + std::to_string(rank()));
  auto o = cp_options(corpus, /*eod_mask_loss=*/true);
  o.val_data = corpus.val();
  o.eval_batches = 2;
  o.global_batch = 4;  // the validation split holds 11 samples of 48 tokens
  const auto cfg = llama();
  auto idx = torch::randint(0, cfg.vocab_size, {2, 48}, torch::kLong);
  using torch::indexing::None, torch::indexing::Slice;
  idx.index_put_({Slice(), Slice(None, None, 7)}, cfg.document_separator);  // documents of 7 tokens
  world()->broadcast(idx)->wait();
  Trainer single(ParallelContext::single_process(), cfg, o);
  const auto want_logits = single.model()->forward(idx);
  const double want_val = single.evaluate();
  for (const auto comm : {CpComm::kAllGather, CpComm::kAllToAll}) {
    SCOPED_TRACE(to_string(comm));
    Trainer t(context(n, comm), cfg, o);
    const auto logits = t.model()->forward(idx);
    EXPECT_TRUE(torch::allclose(logits, want_logits, 1e-5, 1e-5)) << (logits - want_logits).abs().max().item<float>();
    EXPECT_NEAR(t.evaluate(), want_val, 1e-5 * want_val);
  }
}

// With the other strategies: cp 2 with ZeRO-2 over dp x cp (2 ranks), cp 3 (a2a) with full
// sharding and recomputed blocks (3), and at 4 ranks cp 2 with dp 2 under full sharding,
// with tp 2 and sequence parallelism (all three forms), under hybrid sharding (the shards over
// cp, replicas over dp), and with two pipeline stages.
TEST_F(CpTest, ComposesWithTheOtherStrategies) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "nothing to compose on one rank";
  TestCorpus corpus("cpx" + std::to_string(rank()));
  const auto o = cp_options(corpus, /*eod_mask_loss=*/true);
  auto sharded = [&](const std::string& fsdp) {
    auto s = o;
    s.fsdp = fsdp;
    return s;
  };
  if (n == 2) {
    SCOPED_TRACE("cp 2, zero2");
    expect_matches(context(2), llama(), sharded("zero2"));
  }
  if (n == 3) {
    SCOPED_TRACE("cp 3 a2a, full sharding, recompute");
    auto cfg = llama();
    cfg.recompute_blocks = -1;
    expect_matches(context(3, CpComm::kAllToAll), cfg, sharded("full"));
    SCOPED_TRACE("cp 3 p2p, recompute (the blocks' documents rebuilt from the saved numbers)");
    cfg = flash_llama();
    cfg.recompute_blocks = -1;
    expect_matches(context(3, CpComm::kRing), cfg, o);
  }
  if (n == 4) {
    {
      SCOPED_TRACE("dp 2 x cp 2, full sharding");
      expect_matches(context(2), llama(), sharded("full"));
    }
    for (const auto comm : {CpComm::kAllGather, CpComm::kAllToAll, CpComm::kRing}) {
      SCOPED_TRACE(format("cp 2 x tp 2, sequence parallel, {}", to_string(comm)));
      expect_matches(context(2, comm, 2, 1, true), comm == CpComm::kRing ? flash_llama() : llama(), o);
    }
    {
      SCOPED_TRACE("hybrid sharding: 2 replicas x (1 dp shard x cp 2)");
      ParallelConfig c;
      c.cp = 2, c.dp_shard = 1;
      expect_matches(std::make_shared<ParallelContext>(world(), c), llama(), sharded("hybrid"));
    }
    {
      SCOPED_TRACE("pp 2 x cp 2");
      expect_matches(context(2, CpComm::kAllGather, 1, 2), llama(), o);
    }
  }
}

TEST_F(CpTest, RefusesWhatItCannotSplit) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "cp 1 splits nothing";
  TestCorpus corpus("cperr" + std::to_string(rank()));
  auto o = cp_options(corpus, false);
  o.seq_len = 2 * n + 1;
  expect_has(error_message([&] { Trainer(context(n), llama(), o); }),
             {format("--seq-len={}", 2 * n + 1), format("--cp={}", n), format("multiple of {}", 2 * n)});
  o = cp_options(corpus, false);
  // a2a splits the heads: 5 heads over 2, 3 or 4 ranks cannot be.
  auto five = models::GptConfig::preset("tiny");
  five.n_head = five.n_kv_head = 5, five.d_model = 80;
  expect_has(error_message([&] { Trainer(context(n, CpComm::kAllToAll), five, o); }),
             {"n_head=5", format("--cp={} --cp-comm a2a cannot split", n), "or --cp-comm all_gather"});
  expect_has(error_message([&] { parse_cp_comm("ring"); }), {"--cp-comm=ring", "all_gather, a2a, p2p"});
  // The ring runs flash attention's passes on blocks.
  expect_has(error_message([&] { Trainer(context(n, CpComm::kRing), llama(), o); }),
             {"--cp-comm p2p", "--attention sdpa", "allowed: --attention flash"});
  auto cfg = llama();
  cfg.dropout = 0.1;
  expect_has(error_message([&] { Trainer(context(n), cfg, o); }), {"--dropout=0.1", "allowed: --dropout 0"});
}

}  // namespace
}  // namespace dtrain::testing
