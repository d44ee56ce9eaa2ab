// The kernel cases (kernel_cases.hpp) on the compiled kernels and a CUDA device, plus the
// ops (src/ops) on CUDA against their reference paths; every test skips without a GPU.
#include "kernel_cases.hpp"

#include "common/corpus.hpp"
#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/ops/adamw.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/ops/cross_entropy.hpp"
#include "dtrain/ops/norm.hpp"
#include "dtrain/parallel/context.hpp"
#include "dtrain/train/trainer.hpp"

namespace dtrain {
namespace {

#define SKIP_WITHOUT_GPU() KERNEL_DEVICE_OR_SKIP()

// The autograd op on CUDA against the same op's reference path in float64 on the host:
// within twice the error of the reference path run in the same 16-bit dtype on the GPU.
// The op with each kernel DTRAIN_ATTENTION_KERNEL can name here (see attention_kernels).
TEST(GpuOps, FlashAttentionAutogradMatchesTheReferencePath) {
  SKIP_WITHOUT_GPU();
  if (!dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_WGMMA)) {
    env::ScopedOverride wgmma(env::kAttentionKernel, "wgmma");
    auto q = torch::randn({1, 2, 8, 64}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
    EXPECT_THROW(ops::flash_attention(q, q, q, true), InvalidArgument) << "wgmma asked for where it cannot run";
  }
  for (auto kernel : attention_kernels()) {
  env::ScopedOverride only(env::kAttentionKernel, kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma" : "wgmma");
  SCOPED_TRACE(kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma.sync" : "wgmma");
  torch::manual_seed(11);
  for (bool causal : {true, false}) {
    for (std::int64_t d : {64, 128, 32, 80}) {
      auto q = torch::randn({2, 8, 300, d}), k = torch::randn({2, 2, 300, d}), v = torch::randn({2, 2, 300, d});
      auto dout = torch::randn({2, 8, 300, d});
      auto run = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& g,
                     bool sdpa) -> std::vector<at::Tensor> {
        auto qa = a.detach().requires_grad_(), kb = b.detach().requires_grad_(), vc = c.detach().requires_grad_();
        auto o = sdpa ? ops::attention(qa, kb, vc, causal) : ops::flash_attention(qa, kb, vc, causal);
        o.backward(g);
        return {o.cpu().to(at::kDouble), qa.grad().cpu().to(at::kDouble), kb.grad().cpu().to(at::kDouble),
                vc.grad().cpu().to(at::kDouble)};
      };
      const auto want = run(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), dout.to(at::kDouble), false);
      auto cu = [](const at::Tensor& t) { return t.to(torch::kCUDA, at::kBFloat16); };
      const auto got = run(cu(q), cu(k), cu(v), cu(dout), false);
      const auto sdpa = run(cu(q), cu(k), cu(v), cu(dout), true);  // LibTorch's own bf16 attention
      for (int i = 0; i < 4; ++i) {
        const double e = (got[i] - want[i]).abs().max().item<double>();
        const double base = (sdpa[i] - want[i]).abs().max().item<double>();
        EXPECT_LE(e, 2 * base + 1e-3) << "output " << i << " d " << d << (causal ? " causal" : "") << ": flash " << e
                                      << ", sdpa " << base;
      }
    }
  }
  }
  for (std::int64_t d : {100, 136}) {  // not a multiple of 8; over 128
    auto q = torch::randn({1, 2, 8, d}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
    EXPECT_THROW(ops::flash_attention(q, q, q, true), InvalidArgument) << "head dim " << d;
  }
  auto f = torch::randn({1, 2, 8, 64}, torch::kCUDA);
  EXPECT_THROW(ops::flash_attention(f, f, f, true), InvalidArgument);  // float32 on CUDA
}

TEST(GpuOps, NormsMatchTheReferencePath) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(12);
  for (bool layer : {false, true}) {
    auto x = torch::randn({4, 129, 768}).to(at::kBFloat16), w = torch::randn({768}), b = torch::randn({768});
    auto dy = torch::randn({4, 129, 768}).to(at::kBFloat16);
    auto run = [&](const at::Device& device) {
      auto xx = x.to(device).requires_grad_(), ww = w.to(device).requires_grad_(), bb = b.to(device).requires_grad_();
      auto y = layer ? ops::layer_norm(xx, ww, bb, 1e-5) : ops::rms_norm(xx, ww, 1e-5);
      y.backward(dy.to(device));
      return std::vector<at::Tensor>{y.cpu().to(at::kDouble), xx.grad().cpu().to(at::kDouble),
                                     ww.grad().cpu().to(at::kDouble),
                                     layer ? bb.grad().cpu().to(at::kDouble) : torch::zeros({1}, at::kDouble)};
    };
    const auto want = run(at::kCPU), got = run(at::kCUDA);
    for (int i = 0; i < 4; ++i) {
      const double scale = want[i].abs().max().item<double>() + 1;
      EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), 1e-2 * scale) << (layer ? "layer " : "rms ") << i;
    }
  }
}

// The cross-entropy op writes the gradient in its forward for the upstream gradient it is
// told: told right (2), told wrong (the default 1: the backward rescales), in place, and
// a graph that backpropagates twice (2, then 3: the gradients add up to 5 times the unit
// one), each against the reference path on the host.
TEST(GpuOps, CrossEntropyMatchesTheReferencePath) {
  SKIP_WITHOUT_GPU();
  auto logits = (torch::randn({257, 50304}) * 2).to(at::kBFloat16);
  auto target = torch::randint(0, 50304, {257}, torch::kLong);
  target[0] = -100;
  struct Case {
    const char* name;
    double told;
    bool in_place;
    std::vector<double> upstream;  // one backward each, the graph retained between
  };
  for (const Case& c : {Case{"told", 2, false, {2}}, Case{"untold", 1, false, {2}}, Case{"in place", 2, true, {2}},
                        Case{"twice", 2, true, {2, 3}}, Case{"thrice", 1, false, {3, 0.5, 2}}}) {
    SCOPED_TRACE(c.name);
    auto run = [&](const at::Device& device) {
      auto l = logits.to(device).requires_grad_();
      ops::CrossEntropyOptions o;
      o.grad_scale = c.told;
      o.in_place = c.in_place;
      auto loss = ops::cross_entropy(l, target.to(device), o);
      for (std::size_t i = 0; i < c.upstream.size(); ++i) {
        (loss * c.upstream[i]).backward({}, /*retain_graph=*/i + 1 < c.upstream.size());
      }
      return std::make_pair(loss.item<double>(), l.grad().cpu().to(at::kDouble));
    };
    const auto want = run(at::kCPU), got = run(at::kCUDA);
    EXPECT_NEAR(got.first, want.first, 1e-4 * want.first);
    // A bfloat16 rounding of gradients up to (sum of upstream) / 256 is 8e-6 of that sum;
    // allow a few (the rescale and the accumulation add some).
    double total = 0;
    for (double u : c.upstream) total += u;
    EXPECT_LT((got.second - want.second).abs().max().item<double>(), 6e-5 * total);
    EXPECT_EQ(got.second[0].abs().sum().item<double>(), 0.0);
  }
  // In place, the logits are gone: a graph that saved them fails in its backward instead
  // of reading the gradient.
  auto l = logits.cuda().requires_grad_();
  auto a = l * 1;
  auto side = a.sin().sum();  // saves a
  ops::CrossEntropyOptions o;
  o.in_place = true;
  auto loss = ops::cross_entropy(a, target.cuda(), o);
  EXPECT_THROW((loss + side).backward(), c10::Error);
  // Without grad mode nothing is written, in place or not.
  {
    torch::NoGradGuard no_grad;
    auto kept = logits.cuda().requires_grad_();
    ops::cross_entropy(kept, target.cuda(), o);
    EXPECT_TRUE(torch::equal(kept.detach().cpu(), logits));
  }
}

TEST(GpuOps, FusedAdamWMatchesTheReferencePath) {
  SKIP_WITHOUT_GPU();
  torch::manual_seed(13);
  std::vector<ops::AdamWSegment> host, gpu;
  for (std::int64_t n : {1, 1000, 123457}) {
    ops::AdamWSegment s{torch::randn({n}), torch::randn({n}).to(at::kBFloat16), torch::randn({n}) * 0.1,
                        torch::rand({n}) * 0.01, torch::zeros({n}, at::kBFloat16), n == 1000 ? 0.1 : 0.0};
    host.push_back(s);
    gpu.push_back({s.param.cuda(), s.grad.cuda(), s.exp_avg.cuda(), s.exp_avg_sq.cuda(), s.model_param.cuda(),
                   s.weight_decay});
  }
  ops::AdamWHyper h;
  h.lr = 1e-3;
  h.beta2 = 0.95;
  h.bias_correction1 = 0.1;
  h.bias_correction2 = 0.05;
  h.grad_scale = 1.0 / 1024;
  for (int step = 0; step < 3; ++step) {
    ops::fused_adamw(host, h);
    ops::fused_adamw(gpu, h);
  }
  for (std::size_t i = 0; i < host.size(); ++i) {
    EXPECT_LT((gpu[i].param.cpu() - host[i].param).abs().max().item<double>(), 1e-6) << i;
    EXPECT_TRUE(torch::equal(gpu[i].model_param.cpu(), gpu[i].param.cpu().to(at::kBFloat16))) << i;
  }
}

// The tiny model in bf16 on the GPU with every fused option against the unfused run.
TEST(GpuOps, TrainerWithFusedOpsTracksTheUnfusedRun) {
  SKIP_WITHOUT_GPU();
  testing::TestCorpus corpus("gpufused");
  auto cfg = models::GptConfig::preset("tiny");
  cfg.family = "llama";
  cfg.d_model = 128;  // head dim 64
  cfg.n_head = 2;
  cfg.n_kv_head = 1;
  train::TrainOptions o;
  o.train_data = corpus.train();
  o.steps = 30;
  o.warmup_steps = 2;
  o.seq_len = 64;
  o.global_batch = 8;
  o.precision = "bf16";
  o.progress = "off";
  auto ctx = ParallelContext::single_process(c10::Device(c10::kCUDA, 0));
  train::Trainer plain(ctx, cfg, o);
  auto fcfg = cfg;
  fcfg.attention = ops::AttentionBackend::kFlash;
  fcfg.fused_norm = fcfg.fused_ce = true;
  auto fo = o;
  fo.adamw.fused = true;
  train::Trainer fused(ctx, fcfg, fo);
  const auto a = plain.run(), b = fused.run();
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i].loss, b[i].loss, 2e-2 * a[i].loss) << "step " << i + 1;
  EXPECT_LT(b.back().loss, b.front().loss - 0.5) << "the fused run must learn";
}

}  // namespace
}  // namespace dtrain
