// The kernel cases (kernel_cases.hpp) and the op cases (op_cases.hpp) on the compiled
// kernels and a CUDA device, plus more of the ops (src/ops) on CUDA against their
// reference paths; every test skips without a GPU.
#include "kernel_cases.hpp"
#include "op_cases.hpp"

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

}  // namespace
}  // namespace dtrain
