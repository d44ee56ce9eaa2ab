// ZeRO sharding against the single-process run: every rank trains with zero1 or zero2 over
// the world and compares with a single-process Trainer on the whole global batch (run on
// rank 0, broadcast: train_harness.hpp);
// after 10 steps losses agree within 1e-5 relative, gradient norms (computed from shards)
// within 1e-4 and parameters within 1e-5 (float32). Also: accumulation with sharded
// gradients, zero2's reduce-scatters during backward, even shards at odd world sizes, and
// the error for strategies not built yet; mixed precision (bfloat16, float16 with loss
// scaling) and overflows agreed by every rank; sharded and full state, and loading it
// into another layout.
#include <unistd.h>

#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>

#include "train_harness.hpp"

namespace dtrain::testing {
namespace {

class FsdpTest : public TrainTest {
 protected:
  // Half-precision parameters, in float32, against the reference's: the same names in
  // order, every element within atol.
  static void expect_within(const NamedParameters& pa, const NamedParameters& pb, double atol,
                            const std::string& what) {
    EXPECT_EQ(pa.size(), pb.size()) << what;
    for (std::size_t i = 0; i < std::min(pa.size(), pb.size()); ++i) {
      EXPECT_EQ(pa[i].first, pb[i].first);
      const double diff = (pa[i].second.to(torch::kFloat) - pb[i].second).abs().max().item<double>();
      EXPECT_LE(diff, atol) << what << " " << pa[i].first;
    }
  }
};

TEST_F(FsdpTest, Zero1MatchesSingleProcessForTenSteps) {
  TestCorpus corpus("z1" + std::to_string(rank()));
  const auto cfg = models::GptConfig::preset("tiny");
  auto o = options(corpus);
  o.fsdp = "zero1";
  Trainer sharded(dp_context(), cfg, o);
  ASSERT_NE(sharded.sharded(), nullptr);
  EXPECT_EQ(sharded.sharded()->stats().units, cfg.n_layer + 2);  // embed, blocks, head
  expect_equivalent_to_single_process(sharded, cfg, corpus);
}

// The llama family with one sample per micro-batch: 12 / n micro-batches accumulate
// locally before the sharded reduction.
TEST_F(FsdpTest, Zero2WithAccumulationMatchesSingleProcess) {
  TestCorpus corpus("z2" + std::to_string(rank()));
  const auto cfg = tiny_llama();
  auto o = options(corpus);
  o.fsdp = "zero2";
  o.micro_batch = 1;
  Trainer sharded(dp_context(), cfg, o);
  expect_equivalent_to_single_process(sharded, cfg, corpus);
}

TEST_F(FsdpTest, Zero2ReduceScattersDuringBackwardAndKeepsOnlyShards) {
  TestCorpus corpus("ov" + std::to_string(rank()));
  auto o = options(corpus);
  o.fsdp = "zero2";
  o.steps = 1;
  o.warmup_steps = 0;
  Trainer t(dp_context(), models::GptConfig::preset("tiny"), o);
  t.train_step();
  const auto& s = t.sharded()->stats();
  // Every unit but the last to finish backward is issued from the hooks.
  EXPECT_GE(s.launched_during_backward, s.units - 1);
  for (const auto& [name, p] : t.model()->parameter_list()) {
    EXPECT_FALSE(p.grad().defined()) << name << " kept its full gradient";
  }
}

TEST_F(FsdpTest, ShardsAreEvenAndParametersStayIdenticalAcrossRanks) {
  TestCorpus corpus("even" + std::to_string(rank()));
  const auto cfg = models::GptConfig::preset("tiny");
  auto o = options(corpus);
  o.fsdp = "zero1";
  o.steps = 3;
  Trainer t(dp_context(), cfg, o);
  t.run();
  const auto& s = t.sharded()->stats();
  const std::int64_t n = nranks(), total = cfg.num_parameters();
  EXPECT_GE(s.shard_numel * n, total);
  EXPECT_LT(s.shard_numel * n, total + s.units * n) << "padding beyond one element per rank per unit";
  // Checksums of every rank's full parameters agree (the all-gather after each step).
  double sum = 0;
  for (const auto& [name, p] : t.model()->parameter_list()) sum += p.to(torch::kDouble).sum().item<double>();
  auto mine = torch::full({1}, sum, torch::kDouble);
  auto all = torch::empty({n}, torch::kDouble);
  world()->all_gather(all, mine)->wait();
  for (int r = 1; r < n; ++r) EXPECT_EQ(all[r].item<double>(), all[0].item<double>()) << "rank " << r;
}

// Full sharding (ZeRO-3): blocks gathered around their forward and backward, freed
// between, with prefetch; the GPT-2 tiny model with evaluation in between (forward without
// backward) and with activation checkpointing (recompute inside the gathered window).
TEST_F(FsdpTest, FullShardingMatchesSingleProcessForTenSteps) {
  for (bool checkpointing : {false, true}) {
    TestCorpus corpus("full" + std::to_string(rank()) + (checkpointing ? "c" : ""));
    auto cfg = models::GptConfig::preset("tiny");
    cfg.n_layer = 3;
    cfg.recompute_blocks = checkpointing ? -1 : 0;
    auto o = options(corpus);
    o.fsdp = "full";
    o.val_data = corpus.val();
    o.eval_every = 4;
    Trainer sharded(dp_context(), cfg, o);
    auto ref_o = options(corpus);
    ref_o.val_data = corpus.val();
    ref_o.eval_every = 4;
    expect_equivalent(sharded, single_process_reference(cfg, ref_o));
  }
}

// Prefetching two blocks ahead and keeping blocks between forward and backward change
// when parameters exist, never the numbers.
TEST_F(FsdpTest, FullShardingOptionsLeaveResultsUnchanged) {
  TestCorpus corpus("opts" + std::to_string(rank()));
  auto cfg = models::GptConfig::preset("tiny");
  cfg.n_layer = 4;
  auto o = options(corpus);
  o.fsdp = "full";
  o.fsdp_prefetch = 2;
  o.fsdp_reshard_after_forward = false;
  Trainer sharded(dp_context(), cfg, o);
  expect_equivalent_to_single_process(sharded, cfg, corpus);
}

// Mixed precision: bfloat16 parameters, float32 masters and optimizer state, float32 or
// bfloat16 reduction, against the same policy in one process (a single-process bfloat16
// run). Stated tolerance: losses within 2e-3 relative, parameters (bfloat16) within 1e-2
// absolute: the float32 averages differ in the last bits, and casting the updated master
// to bfloat16 may round one ulp (2^-8 relative) the other way.
TEST_F(FsdpTest, Bfloat16ParametersMatchSingleProcessBfloat16) {
  for (const char* reduce : {"float32", "bfloat16"}) {
    for (const char* strategy : {"zero1", "zero2", "full"}) {
      TestCorpus corpus(std::string("bf") + strategy + reduce + std::to_string(rank()));
      auto cfg = models::GptConfig::preset("tiny");
      cfg.family = "llama";  // RoPE and RMSNorm in bfloat16 too
      cfg.n_kv_head = 2;
      auto o = options(corpus);
      o.fsdp = strategy;
      o.param_dtype = "bfloat16";
      o.reduce_dtype = reduce;
      Trainer sharded(dp_context(), cfg, o);
      EXPECT_EQ(sharded.model()->parameters()[0].scalar_type(), torch::kBFloat16);
      const auto ref = single_process_reference(cfg, o);
      const auto a = sharded.run();
      const auto& b = ref.steps;
      EXPECT_EQ(a.size(), b.size());  // EXPECT, not ASSERT: collectives follow
      for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        EXPECT_NEAR(a[i].loss, b[i].loss, 2e-3 * b[i].loss) << strategy << " " << reduce << " step " << i + 1;
      }
      if (!b.empty()) {
        EXPECT_LT(b.back().loss, b.front().loss - 0.5) << "bfloat16 training must still learn";
      }
      sharded.gather_parameters();
      expect_within(sharded.model()->parameter_list(), ref.params, 1e-2, std::string(strategy) + " " + reduce);
    }
  }
}

// The fused AdamW step over the shards (one pass per step: a segment per decay run, the
// bfloat16 shard written in the same pass) is, on the CPU, the unfused step op for op:
// losses and parameters bitwise equal, for float32 and bfloat16 parameters.
TEST_F(FsdpTest, FusedAdamWIsBitwiseTheUnfusedShardedStep) {
  for (const char* dtype : {"float32", "bfloat16"}) {
    for (const char* strategy : {"zero1", "full"}) {
      TestCorpus corpus(std::string("fa") + strategy + dtype + std::to_string(rank()));
      const auto cfg = models::GptConfig::preset("tiny");
      auto o = options(corpus);
      o.fsdp = strategy;
      o.param_dtype = dtype;
      o.steps = 5;
      auto fo = o;
      fo.adamw.fused = true;
      Trainer plain(dp_context(), cfg, o), fused(dp_context(), cfg, fo);
      const auto a = plain.run(), b = fused.run();
      for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].loss, b[i].loss) << strategy << " " << dtype << " step " << i + 1;
      plain.gather_parameters();
      fused.gather_parameters();
      const auto pa = plain.model()->parameter_list(), pb = fused.model()->parameter_list();
      for (std::size_t i = 0; i < pa.size(); ++i) {
        EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second)) << strategy << " " << dtype << " " << pa[i].first;
      }
    }
  }
}

// Every kernel option (the ops' reference paths on the CPU: flash attention, the fused
// norms and cross-entropy (Llama: the head with it, fused linear cross-entropy), SwiGLU and
// RoPE, fused AdamW over the shards) under zero2 and full sharding
// against the plain single-process run: GPT-2 and Llama, packed documents with
// eod-mask-loss, the harness's ten steps and tolerances.
TEST_F(FsdpTest, FusedOpsMatchSingleProcess) {
  for (const char* strategy : {"zero2", "full"}) {
    auto cfg = models::GptConfig::preset("tiny");
    cfg.n_layer = 3;
    cfg.document_separator = 10;
    for (const char* family : {"gpt2", "llama"}) {
      SCOPED_TRACE(std::string(strategy) + " " + family);
      cfg.family = family;
      cfg.n_kv_head = cfg.family == "llama" ? 2 : cfg.n_head;
      TestCorpus corpus(std::string("fo") + strategy + family + std::to_string(rank()));
      auto o = options(corpus);
      o.eod_mask_loss = true;
      o.adamw.lr = 1e-3;  // as dist_pp's: the fused ops' roundings, amplified by Adam, stay small
      const auto reference = single_process_reference(cfg, o);
      auto fused = cfg;
      fused.fused_ce = fused.fused_norm = fused.fused_swiglu = fused.fused_rope = true;
      fused.fused_linear_ce = cfg.family == "llama";  // the sharded head read in chunks
      fused.attention = ops::AttentionBackend::kFlash;
      o.adamw.fused = true;
      o.fsdp = strategy;
      Trainer sharded(dp_context(), fused, o);
      expect_equivalent(sharded, reference);
    }
  }
}

// float16 with dynamic loss scaling: autocast (replicated) or float16 parameters (sharded)
// against the same precision in one process. The default scale (65536) never overflows
// here, so every step applies on both sides. (Where the threshold lies depends on the
// per-rank micro-batch, so a run at the edge of overflow could skip different steps than
// the single process; unit_train covers skipping and growth.) Stated tolerance: losses
// within 2e-3 relative, parameters within 1e-2 absolute, as for bfloat16: float16 rounds
// the gradients of the two runs differently, and Adam moves an element by about lr (3e-3)
// per step whatever its gradient's size, so near-zero gradients of opposite sign can part
// elements by a few lr over 10 steps (measured: 5.1e-3 at 3 ranks).
TEST_F(FsdpTest, Float16WithLossScalingMatchesSingleProcessFloat16) {
  for (const char* strategy : {"none", "zero2", "full"}) {
    TestCorpus corpus(std::string("fp16") + strategy + std::to_string(rank()));
    const auto cfg = models::GptConfig::preset("tiny");
    auto o = options(corpus);
    o.fsdp = strategy;
    if (o.fsdp == "none") {
      o.precision = "fp16";
    } else {
      o.param_dtype = "float16";
    }
    Trainer dp(dp_context(), cfg, o);
    EXPECT_NE(dp.loss_scaler(), nullptr);
    const auto ref = single_process_reference(cfg, o);
    const auto a = dp.run();
    const auto& b = ref.steps;
    EXPECT_EQ(a.size(), b.size());  // EXPECT, not ASSERT: collectives follow
    for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      EXPECT_NEAR(a[i].loss, b[i].loss, 2e-3 * b[i].loss) << strategy << " step " << i + 1;
      EXPECT_EQ(a[i].loss_scale, b[i].loss_scale) << strategy << " step " << i + 1;
      EXPECT_FALSE(a[i].skipped || b[i].skipped) << strategy << " step " << i + 1;
    }
    if (!a.empty()) {
      EXPECT_EQ(a.back().loss_scale, 65536.0);
    }
    dp.gather_parameters();
    expect_within(dp.model()->parameter_list(), ref.params, 1e-2, strategy);
  }
}

// An overflow in one rank's gradients (its loss times inf) reaches every rank's gradient
// norm, so with loss scaling every rank skips the same step: through DDP's all-reduce, and
// through the reduce-scatter and the all-reduce of partial norms for the sharded strategies.
TEST_F(FsdpTest, OverflowOnOneRankIsSeenByEveryRank) {
  const auto cfg = models::GptConfig::preset("tiny");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5 + rank());
  const auto tokens = torch::randint(0, cfg.vocab_size, {2, 17}, gen, torch::kLong);
  const auto x = tokens.slice(1, 0, 16), y = tokens.slice(1, 1, 17);
  for (const char* strategy : {"none", "zero1", "zero2", "full"}) {
    for (int bad = 0; bad < nranks(); ++bad) {
      models::Gpt model(dp_context(), cfg, 1);
      std::unique_ptr<DataParallel> ddp;
      std::unique_ptr<ShardedDataParallel> sdp;
      if (std::string(strategy) == "none") {
        ddp = std::make_unique<DataParallel>(model->parameter_list(), world());
      } else {
        FsdpOptions fo;
        fo.strategy = parse_sharding(strategy);
        sdp = std::make_unique<ShardedDataParallel>(model->parameter_list(), world(), fo);
        model->set_block_hooks(sdp->block_hooks());
      }
      auto loss = model->loss(x, y) * 1024.0;  // a loss scale
      if (rank() == bad) loss = loss * std::numeric_limits<float>::infinity();
      loss.backward();
      double norm = 0;
      if (ddp) {
        ddp->finish_gradient_sync();
        norm = clip_grad_norm(model->parameters(), 1.0, nullptr, 1024.0);
      } else {
        sdp->finish_gradient_sync();
        norm = sdp->clip_grad_norm(1.0, 1024.0);
      }
      EXPECT_FALSE(std::isfinite(norm)) << strategy << ": rank " << bad << " overflowed";
    }
  }
}

// A run driven by hand through ShardedDataParallel (no Trainer): step s trains on a fixed
// global batch of 12 x 16 tokens drawn from seed s; each rank of `comm` takes its rows.
class ManualRun {
 public:
  ManualRun(ContextPtr ctx, CommPtr comm, ShardingStrategy strategy, std::uint64_t seed)
      : model_(ctx, models::GptConfig::preset("tiny"), seed), comm_(comm) {
    FsdpOptions fo;
    fo.strategy = strategy;
    fo.adamw.lr = 3e-3;
    sdp_ = std::make_unique<ShardedDataParallel>(model_->parameter_list(), comm_, fo);
    model_->set_block_hooks(sdp_->block_hooks());
  }
  double step(std::uint64_t s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
    const auto tokens = torch::randint(0, 256, {12, 17}, gen, torch::kLong);
    const std::int64_t rows = 12 / comm_->size(), first = rows * comm_->rank();
    const auto mine = tokens.slice(0, first, first + rows);
    sdp_->zero_grad();
    auto loss = model_->loss(mine.slice(1, 0, 16), mine.slice(1, 1, 17));
    loss.backward();
    sdp_->finish_gradient_sync();
    sdp_->clip_grad_norm(1.0);
    sdp_->step(3e-3);
    auto mean = loss.detach().clone();
    comm_->all_reduce(mean, {ReduceOp::kAvg})->wait();
    return mean.item<double>();
  }
  ShardedDataParallel& sdp() { return *sdp_; }
  // Whole float32 parameters by name (a collective).
  std::map<std::string, at::Tensor> parameters() {
    std::map<std::string, at::Tensor> out;
    auto full = sdp_->full_state(0);
    for (auto& piece : full.params) out[piece.name] = piece.values.view(piece.shape);
    return out;
  }

 private:
  models::Gpt model_;
  CommPtr comm_;
  std::unique_ptr<ShardedDataParallel> sdp_;
};

// A ShardedState in files (the pieces' tensors through torch::save, their places in text):
// what a checkpoint would hold, enough to move state between ranks in a test.
void write_state(const std::string& path, const ShardedState& st) {
  std::vector<at::Tensor> tensors;
  std::ofstream meta(path + ".txt");
  meta << st.optimizer_step << '\n';
  int kind = 0;
  for (const auto* pieces : {&st.params, &st.exp_avg, &st.exp_avg_sq}) {
    for (const auto& p : *pieces) {
      meta << kind << ' ' << p.name << ' ' << p.offset << ' ' << p.shape.size();
      for (auto d : p.shape) meta << ' ' << d;
      meta << '\n';
      tensors.push_back(p.values.contiguous());
    }
    ++kind;
  }
  torch::save(tensors, path + ".pt");
}

void read_state(const std::string& path, ShardedState& st) {
  std::vector<at::Tensor> tensors;
  torch::load(tensors, path + ".pt");
  std::ifstream meta(path + ".txt");
  meta >> st.optimizer_step;
  int kind = 0;
  std::size_t i = 0, dims = 0;
  TensorPiece p;
  while (meta >> kind >> p.name >> p.offset >> dims) {
    p.shape.assign(dims, 0);
    for (auto& d : p.shape) meta >> d;
    p.values = tensors.at(i++);
    (kind == 0 ? st.params : kind == 1 ? st.exp_avg : st.exp_avg_sq).push_back(p);
  }
}

// Sharded state: every element of every parameter and AdamW moment lies in exactly one
// rank's pieces, each piece equals the same range of the full state gathered on rank 0,
// and the full parameters are the trained ones.
TEST_F(FsdpTest, ShardedStatePiecesTileTheFullState) {
  for (const char* strategy : {"zero1", "full"}) {
    TestCorpus corpus(std::string("st") + strategy + std::to_string(rank()));
    auto o = options(corpus);
    o.fsdp = strategy;
    o.steps = 2;
    o.warmup_steps = 0;
    Trainer t(dp_context(), models::GptConfig::preset("tiny"), o);
    t.run();
    auto& sdp = *t.sharded();
    const ShardedState mine = sdp.sharded_state();
    ShardedState full = sdp.full_state(0);
    EXPECT_EQ(mine.optimizer_step, 2);
    EXPECT_EQ(full.optimizer_step, 2);
    EXPECT_EQ(full.params.empty(), rank() != 0);
    t.gather_parameters();
    const auto params = t.model()->parameter_list();
    // Rank 0's whole tensors, broadcast so that every rank checks its own pieces.
    std::map<std::string, std::array<at::Tensor, 3>> whole;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      for (int kind = 0; kind < 3; ++kind) {
        const auto& list = kind == 0 ? full.params : kind == 1 ? full.exp_avg : full.exp_avg_sq;
        at::Tensor v = at::zeros({p.numel()});
        for (const auto& piece : list) {
          if (piece.name == name) {
            EXPECT_EQ(piece.offset, 0);
            EXPECT_EQ(piece.shape, p.sizes().vec());
            v = piece.values.clone();
          }
        }
        world()->broadcast(v, {0})->wait();
        whole[name][kind] = v;
      }
      EXPECT_TRUE(torch::equal(whole[name][0], p.detach().reshape({-1}))) << strategy << " " << name;
    }
    // Counts of elements per parameter over all ranks: each exactly once.
    at::Tensor counts = at::zeros({static_cast<std::int64_t>(params.size())}, at::kLong);
    for (int kind = 0; kind < 3; ++kind) {
      const auto& list = kind == 0 ? mine.params : kind == 1 ? mine.exp_avg : mine.exp_avg_sq;
      for (const auto& piece : list) {
        const auto& w = whole.at(piece.name)[kind];
        EXPECT_TRUE(torch::equal(piece.values, w.narrow(0, piece.offset, piece.values.numel())))
            << strategy << " " << piece.name << " kind " << kind;
        if (kind == 0) {
          for (std::size_t i = 0; i < params.size(); ++i) {
            if (params[i].first == piece.name) counts[static_cast<std::int64_t>(i)] += piece.values.numel();
          }
        }
      }
    }
    world()->all_reduce(counts)->wait();
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(counts[static_cast<std::int64_t>(i)].item<std::int64_t>(), params[i].second.numel())
          << strategy << " " << params[i].first;
    }
  }
}

// load_state reshards: the state of an n-rank full-sharding run after 3 steps, saved as
// every rank's pieces and as rank 0's full state, loads into a single-process zero1 run
// and an n-rank zero2 run that were initialised from another seed; both then continue
// exactly as the original run does (the equivalence tolerances of train_harness.hpp).
TEST_F(FsdpTest, LoadStateResumesInAnotherLayout) {
  auto id = at::tensor({static_cast<std::int64_t>(::getpid())});
  world()->broadcast(id, {0})->wait();
  const std::string dir = "/tmp/dtrain_fsdp_state_" + std::to_string(id.item<std::int64_t>());
  fs::make_directories(dir);
  world()->barrier()->wait();

  ManualRun a(dp_context(), world(), ShardingStrategy::kFull, 1);
  for (int s = 0; s < 3; ++s) a.step(s);
  write_state(dir + "/rank" + std::to_string(rank()), a.sdp().sharded_state());
  const ShardedState full = a.sdp().full_state(0);
  if (rank() == 0) write_state(dir + "/full", full);
  world()->barrier()->wait();
  std::vector<double> la;
  for (int s = 3; s < 6; ++s) la.push_back(a.step(s));
  const auto pa = a.parameters();

  ShardedState pieces, whole;
  for (int r = 0; r < nranks(); ++r) read_state(dir + "/rank" + std::to_string(r), pieces);
  read_state(dir + "/full", whole);
  EXPECT_EQ(pieces.optimizer_step, 3);

  const auto single = ParallelContext::single_process();
  ManualRun b(single, single->dp_comm(), ShardingStrategy::kZero1, 2);
  b.sdp().load_state(whole);
  ManualRun c(dp_context(), world(), ShardingStrategy::kZero2, 2);
  c.sdp().load_state(pieces);
  for (int s = 3; s < 6; ++s) {
    const double lb = b.step(s), lc = c.step(s);
    EXPECT_NEAR(lb, la[s - 3], 1e-5 * la[s - 3]) << "single-process zero1, step " << s;
    EXPECT_NEAR(lc, la[s - 3], 1e-5 * la[s - 3]) << "zero2, step " << s;
  }
  const auto pb = b.parameters(), pc = c.parameters();
  if (rank() == 0) {
    for (const auto& [name, value] : pa) {
      EXPECT_TRUE(torch::allclose(pb.at(name), value, 1e-5, 5e-5)) << "zero1 " << name;
      EXPECT_TRUE(torch::allclose(pc.at(name), value, 1e-5, 5e-5)) << "zero2 " << name;
    }
  }

  // Wrong input is named: a missing tensor, a shape from another model, a gap.
  auto error_of = [&](ShardedState st) {
    try {
      b.sdp().load_state(st);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  ShardedState bad = whole;
  bad.params.erase(bad.params.begin());
  EXPECT_NE(error_of(bad).find("parameter of '" + whole.params[0].name + "' is missing"),
            std::string::npos) << error_of(bad);
  bad = whole;
  bad.params[0].shape.push_back(2);
  EXPECT_NE(error_of(bad).find("has shape"), std::string::npos) << error_of(bad);
  bad = whole;
  bad.params[0].values = bad.params[0].values.narrow(0, 1, bad.params[0].values.numel() - 1);
  bad.params[0].offset = 1;
  EXPECT_NE(error_of(bad).find("does not cover element 0"), std::string::npos) << error_of(bad);
  world()->barrier()->wait();
  if (rank() == 0) fs::remove_tree(dir);
}

TEST_F(FsdpTest, FullShardingWithAccumulationLlama) {
  TestCorpus corpus("fullacc" + std::to_string(rank()));
  const auto cfg = tiny_llama();
  auto o = options(corpus);
  o.fsdp = "full";
  o.micro_batch = 1;
  Trainer sharded(dp_context(), cfg, o);
  expect_equivalent_to_single_process(sharded, cfg, corpus);
}

// Between uses each rank holds only shards: after a step nothing is gathered, and during
// the step at most four units of eight (embed, six blocks, head): tied embeddings stay
// gathered from the embedding's forward to its backward (the head uses them too), plus
// the current block, the prefetched one and the head or the block whose gradients are
// being reduced. Untied, the embeddings are freed after their forward.
TEST_F(FsdpTest, FullShardingKeepsFewUnitsGathered) {
  for (bool tied : {true, false}) {
    TestCorpus corpus("mem" + std::to_string(tied) + std::to_string(rank()));
    auto cfg = models::GptConfig::preset("tiny");
    cfg.n_layer = 6;
    cfg.tie_embeddings = tied;
    auto o = options(corpus);
    o.fsdp = "full";
    o.steps = 2;
    o.warmup_steps = 0;
    Trainer t(dp_context(), cfg, o);
    EXPECT_EQ(t.sharded()->stats().units, 8);
    EXPECT_EQ(t.sharded()->stats().gathered_units, 0);
    for (int step = 0; step < 2; ++step) {
      t.train_step();
      const auto& s = t.sharded()->stats();
      EXPECT_EQ(s.gathered_units, 0) << "step " << step;
      EXPECT_EQ(s.gathered_bytes, 0) << "step " << step;
      EXPECT_LE(s.peak_gathered_units, 4) << "tied " << tied << " step " << step;
      EXPECT_GE(s.peak_gathered_units, 2) << "tied " << tied << " step " << step;
    }
  }
}

// Forwards every collective to an inner communicator and records it (what, the numel of
// the full buffer, the Work handle) in issue order, with marks that a test adds between.
class RecordingComm : public Communicator {
 public:
  struct Event {
    std::string what;  // "all_gather", "reduce_scatter", ... or a mark ("exit 2")
    std::int64_t numel = 0;
    WorkPtr work;
  };
  explicit RecordingComm(CommPtr inner)
      : Communicator(inner->backend(), "recording", inner->rank(), inner->world_ranks(),
                     0x5eed, inner->default_timeout()),
        inner_(std::move(inner)) {}
  void mark(const std::string& what) { events.push_back({what, 0, nullptr}); }
  std::vector<Event> events;

 protected:
  void check_tensor_device(const at::Tensor&, const char*) const override {}
  WorkPtr log(const char* what, std::int64_t numel, WorkPtr w) {
    events.push_back({what, numel, w});
    return w;
  }
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op, std::uint64_t, Timeout) override {
    return log("all_reduce", t.numel(), inner_->all_reduce(t, {op}));
  }
  WorkPtr do_broadcast(const at::Tensor& t, int root, std::uint64_t, Timeout) override {
    return log("broadcast", t.numel(), inner_->broadcast(t, {root}));
  }
  WorkPtr do_all_gather(const at::Tensor& out, const at::Tensor& in, std::uint64_t, Timeout) override {
    return log("all_gather", out.numel(), inner_->all_gather(out, in));
  }
  WorkPtr do_reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op,
                            std::uint64_t, Timeout) override {
    return log("reduce_scatter", in.numel(), inner_->reduce_scatter(out, in, {op}));
  }
  WorkPtr do_all_to_all(const at::Tensor&, const at::Tensor&, const std::vector<std::int64_t>&,
                        const std::vector<std::int64_t>&, std::uint64_t, Timeout) override {
    throw Error("RecordingComm: all_to_all is not recorded");
  }
  WorkPtr do_send(const at::Tensor&, int, int, Timeout) override {
    throw Error("RecordingComm: send is not recorded");
  }
  WorkPtr do_recv(const at::Tensor&, int, int, Timeout) override {
    throw Error("RecordingComm: recv is not recorded");
  }
  WorkPtr do_barrier(std::uint64_t, Timeout) override { return log("barrier", 0, inner_->barrier()); }
  std::shared_ptr<Communicator> do_split(int color, int key, const std::string& name,
                                         std::uint64_t, Timeout) override {
    return inner_->split(color, key, name);
  }

 private:
  CommPtr inner_;
};

// Marks "exit <i>" when block i's forward compute is done, then runs the strategy's hook.
class MarkingHooks final : public BlockHooks {
 public:
  MarkingHooks(BlockHooks* inner, RecordingComm* log) : inner_(inner), log_(log) {}
  at::Tensor enter(std::size_t i, const at::Tensor& x) override { return inner_->enter(i, x); }
  at::Tensor exit(std::size_t i, const at::Tensor& y) override {
    log_->mark("exit " + std::to_string(i));
    return inner_->exit(i, y);
  }
  void enter_embedding() override { inner_->enter_embedding(); }
  at::Tensor exit_embedding(const at::Tensor& x, bool reused) override {
    return inner_->exit_embedding(x, reused);
  }
  at::Tensor enter_head(const at::Tensor& x) override { return inner_->enter_head(x); }

 private:
  BlockHooks* inner_;
  RecordingComm* log_;
};

// Prefetch ordering, observed in the order the communicator's Work handles are issued:
// in forward, block i+1's all-gather is issued before block i's compute is done (before
// "exit i"); in backward, block i-1's all-gather is issued before block i's gradients are
// reduce-scattered (which happens once its backward compute is done). Without prefetch
// both come after, so the test can tell.
TEST_F(FsdpTest, PrefetchIssuesTheNextGatherBeforeTheCurrentBlockFinishes) {
  auto cfg = models::GptConfig::preset("tiny");
  cfg.n_layer = 4;
  const std::int64_t L = cfg.n_layer;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const auto tokens = torch::randint(0, cfg.vocab_size, {2, 17}, gen, torch::kLong);
  for (int prefetch : {1, 0}) {
    auto rec = std::make_shared<RecordingComm>(world());
    models::Gpt model(dp_context(), cfg, 1);
    std::int64_t block_numel = 0;
    for (const auto& [name, p] : model->parameter_list()) {
      if (name.rfind("h.0.", 0) == 0) block_numel += p.numel();
    }
    const std::int64_t n = nranks();
    block_numel = (block_numel + n - 1) / n * n;  // padded flat buffer
    FsdpOptions fo;
    fo.strategy = ShardingStrategy::kFull;
    fo.prefetch = prefetch;
    ShardedDataParallel sdp(model->parameter_list(), rec, fo);
    MarkingHooks hooks(sdp.block_hooks(), rec.get());
    model->set_block_hooks(&hooks);
    rec->events.clear();
    rec->mark("forward");
    auto loss = model->loss(tokens.slice(1, 0, 16), tokens.slice(1, 1, 17));
    rec->mark("backward");
    loss.backward();
    sdp.finish_gradient_sync();
    // Positions in the log: the k-th block-sized all-gather of forward is block k's; of
    // backward, block L-2-k's; the k-th block-sized reduce-scatter is block L-1-k's.
    std::vector<std::size_t> fwd_gather, bwd_gather, scatter;
    std::map<std::string, std::size_t> mark;
    bool backward = false;
    for (std::size_t e = 0; e < rec->events.size(); ++e) {
      const auto& ev = rec->events[e];
      if (!ev.work) mark[ev.what] = e;
      if (ev.what == "backward") backward = true;
      if (ev.numel != block_numel) continue;
      if (ev.what == "all_gather") (backward ? bwd_gather : fwd_gather).push_back(e);
      if (ev.what == "reduce_scatter") scatter.push_back(e);
    }
    ASSERT_EQ(fwd_gather.size(), static_cast<std::size_t>(L)) << "prefetch " << prefetch;
    ASSERT_EQ(bwd_gather.size(), static_cast<std::size_t>(L - 1)) << "the last block is kept";
    ASSERT_EQ(scatter.size(), static_cast<std::size_t>(L));
    for (std::int64_t i = 0; i + 1 < L; ++i) {
      const bool before = fwd_gather[i + 1] < mark.at("exit " + std::to_string(i));
      EXPECT_EQ(before, prefetch > 0) << "forward: block " << i + 1 << "'s gather vs block " << i
                                      << "'s compute, prefetch " << prefetch;
    }
    for (std::int64_t i = L - 1; i >= 1; --i) {
      const std::size_t gather_prev = bwd_gather[static_cast<std::size_t>(L - 1 - i)];
      const std::size_t scatter_this = scatter[static_cast<std::size_t>(L - 1 - i)];
      EXPECT_EQ(gather_prev < scatter_this, prefetch > 0)
          << "backward: block " << i - 1 << "'s gather vs block " << i
          << "'s reduce-scatter, prefetch " << prefetch;
    }
    for (const auto& ev : rec->events) {
      if (ev.work) ev.work->wait();
    }
    model->set_block_hooks(nullptr);
  }
}

// Memory accounting: with full sharding at N ranks each rank holds, outside the units
// gathered at the moment, its float32 master shard (also the all-gather input), the
// gradient shard and the two AdamW moments: at most 1/N + 5% of the unsharded model state
// (16 bytes per parameter: parameter, gradient, two moments), padding included.
TEST_F(FsdpTest, FullShardingHoldsOneNthOfTheModelState) {
  for (const char* strategy : {"full", "zero2"}) {
    TestCorpus corpus(std::string("acct") + strategy + std::to_string(rank()));
    auto cfg = models::GptConfig::preset("tiny");
    cfg.tie_embeddings = false;
    auto o = options(corpus);
    o.fsdp = strategy;
    o.steps = 2;
    o.warmup_steps = 0;
    Trainer t(dp_context(), cfg, o);
    t.train_step();
    t.train_step();
    const double total = 16.0 * static_cast<double>(cfg.num_parameters());
    const double held =
        static_cast<double>(t.model_state_bytes() - t.sharded()->stats().gathered_bytes);
    if (std::string(strategy) == "full") {
      EXPECT_LE(held / total, 1.0 / nranks() + 0.05) << held << " of " << total;
      EXPECT_GE(held / total, 1.0 / nranks() - 1e-9);
    } else {
      // zero2 keeps the parameters whole: 4 of the 16 bytes, plus 12 / N.
      EXPECT_LE(held / total, 0.25 + 0.75 / nranks() + 0.05) << held << " of " << total;
    }
  }
}

// Hybrid sharding: full sharding inside replicas of dp_shard ranks, gradients averaged
// across replicas. 2 x 2 at four ranks (and 1 x 2 at two; one replica of n at odd n).
TEST_F(FsdpTest, HybridMatchesSingleProcessForTenSteps) {
  TestCorpus corpus("hy" + std::to_string(rank()));
  const auto cfg = models::GptConfig::preset("tiny");
  ParallelConfig pc;
  pc.dp_shard = nranks() % 2 == 0 ? 2 : nranks();
  auto ctx = std::make_shared<ParallelContext>(world(), pc);
  EXPECT_EQ(ctx->dp_size(), nranks());
  EXPECT_EQ(ctx->shard_comm()->size(), pc.dp_shard);
  EXPECT_EQ(ctx->replicate_comm()->size(), nranks() / pc.dp_shard);
  auto o = options(corpus);
  o.fsdp = "hybrid";
  Trainer sharded(ctx, cfg, o);
  expect_equivalent_to_single_process(sharded, cfg, corpus);
}

TEST_F(FsdpTest, HybridNeedsDpShardAndUnknownStrategiesAreNamed) {
  TestCorpus corpus("hyerr" + std::to_string(rank()));
  auto o = options(corpus);
  o.fsdp = "hybrid";
  try {
    Trainer t(dp_context(), models::GptConfig::preset("tiny"), o);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--fsdp hybrid needs --dp-shard"), std::string::npos) << e.what();
  }
  try {
    parse_sharding("zero4");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("allowed: none, zero1, zero2, full, hybrid"), std::string::npos);
  }
}

}  // namespace
}  // namespace dtrain::testing
