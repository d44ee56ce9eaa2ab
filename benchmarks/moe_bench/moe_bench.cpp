// moe_bench: what expert parallelism costs. On N ranks, one MoE layer (router, top-k
// SwiGLU experts) runs forward + backward on each rank's own tokens for every ep in --ep
// that divides N (N / ep groups of ep ranks). Per ep: the median layer time, tokens/s over
// all ranks, the time and bytes of the dispatch/combine all-to-alls (their share of the
// layer), the load imbalance (max / mean assignments over the experts), and, as the
// baseline of the same run, a dense SwiGLU MLP of the same active width (topk x the
// expert width) on the same tokens: the ratio says what routing and exchange add.
//
//   mpirun -np 4 build/benchmarks/moe_bench --ep 1,2,4
//   mpirun -np 4 build/benchmarks/moe_bench --tokens 8192 --d-model 512 --experts 16 --topk 2
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/bench_util.hpp"
#include "dtrain/dtrain.hpp"

namespace {

struct Options {
  std::string backend = "auto", json;
  std::int64_t tokens = 4096, d_model = 256, hidden = 512, experts = 8, topk = 2;
  double capacity = 0;
  int iters = 6, warmup = 2;
  std::vector<int> ep = {1, 2, 4};
};

struct Row {
  int ep = 1;
  double layer_ms = 0, a2a_ms = 0, a2a_mib = 0, dense_ms = 0, imbalance = 0, tokens_per_s = 0;
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Row run(const Options& o, const dtrain::CommPtr& world, c10::Device device, int ep) {
  using namespace dtrain;
  ParallelConfig pc;
  pc.ep = ep;
  auto ctx = std::make_shared<ParallelContext>(world, pc, device);
  ep::MoeOptions mo;
  mo.experts = o.experts, mo.topk = o.topk, mo.capacity_factor = o.capacity;
  models::Moe moe(mo, o.d_model, o.hidden, ctx->tp_comm(), false, ctx->ep_comm());
  // Dense baseline: the same active width per token.
  const auto w = o.topk * o.hidden;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + ctx->dp_rank());
  auto w1 = (torch::randn({w, o.d_model}, gen) * 0.02).to(device).requires_grad_(true);
  auto w3 = (torch::randn({w, o.d_model}, gen) * 0.02).to(device).requires_grad_(true);
  auto w2 = (torch::randn({o.d_model, w}, gen) * 0.02).to(device).requires_grad_(true);
  {
    torch::NoGradGuard no_grad;
    // The router is replicated (the same on every rank); each ep rank has its own experts.
    auto same = at::make_generator<at::CPUGeneratorImpl>(7);
    auto own = at::make_generator<at::CPUGeneratorImpl>(1000 + ctx->ep_rank());
    moe->router.copy_(torch::randn(moe->router.sizes(), same) * 0.02);
    for (auto* p : {&moe->fc, &moe->gate, &moe->proj}) p->copy_(torch::randn(p->sizes(), own) * 0.02);
    moe->to(device);
  }
  // The input needs its gradient, as inside a model (the dispatch then runs backward too).
  const auto x = torch::randn({1, o.tokens, o.d_model}, gen).to(device).requires_grad_(true);
  std::vector<double> layer, a2a, dense;
  double bytes = 0;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    moe->zero_grad();
    moe->reset_stats();
    ep::reset_comm_stats();
    world->barrier()->wait();
    dtrain::train::synchronize(device);
    double t = now_ms();
    moe->forward(x).pow(2).mean().backward();
    dtrain::train::synchronize(device);
    const double moe_ms = now_ms() - t;
    const double a2a_ms = ep::comm_stats().ms;
    bytes = ep::comm_stats().bytes;
    world->barrier()->wait();
    t = now_ms();
    auto y = torch::mm(torch::silu(torch::mm(x[0], w3.t())) * torch::mm(x[0], w1.t()), w2.t());
    y.pow(2).mean().backward();
    dtrain::train::synchronize(device);
    const double dense_ms = now_ms() - t;
    if (i >= o.warmup) {
      layer.push_back(moe_ms), a2a.push_back(a2a_ms), dense.push_back(dense_ms);
    }
  }
  // Load over the experts from every rank's last forward.
  auto counts = moe->stats().counts.clone();
  world->all_reduce(counts)->wait();
  // The slowest rank sets the pace: max over ranks of the medians.
  auto t = torch::tensor({bench::median(layer), bench::median(a2a), bench::median(dense)}, torch::kDouble).to(device);
  world->all_reduce(t, {ReduceOp::kMax})->wait();
  t = t.cpu();
  Row r;
  r.ep = ep;
  r.layer_ms = t[0].item<double>(), r.a2a_ms = t[1].item<double>(), r.dense_ms = t[2].item<double>();
  r.a2a_mib = bytes / (1 << 20);
  r.imbalance = (counts.max() / counts.mean()).item<double>();
  r.tokens_per_s = static_cast<double>(o.tokens * world->size()) / (r.layer_ms / 1e3);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"moe_bench: one MoE layer at several expert-parallel degrees against a dense MLP of the same active width"};
  app.add_option("--backend", o.backend, "auto, mpi or nccl");
  app.add_option("--tokens", o.tokens, "tokens per rank");
  app.add_option("--d-model", o.d_model, "model width");
  app.add_option("--hidden", o.hidden, "each expert's SwiGLU width");
  app.add_option("--experts", o.experts, "experts");
  app.add_option("--topk", o.topk, "experts per token");
  app.add_option("--capacity", o.capacity, "capacity factor (0: dropless)");
  app.add_option("--ep", o.ep, "expert-parallel degrees to run (those dividing the world size)")->delimiter(',');
  app.add_option("--iters", o.iters, "timed iterations");
  app.add_option("--warmup", o.warmup, "untimed iterations first");
  app.add_option("--json", o.json, "also append the JSON lines to this file");
  CLI11_PARSE(app, argc, argv);

  // Held outside the try: a failure aborts the job instead of hanging in MPI_Finalize.
  dtrain::Runtime runtime(&argc, &argv, dtrain::RuntimeOptions{o.backend});
  try {
    const auto world = runtime.world();
    const int n = world->size();
    std::vector<Row> rows;
    for (int ep : o.ep) {
      if (ep < 1 || n % ep != 0 || o.experts % ep != 0) continue;
      rows.push_back(run(o, world, runtime.device(), ep));
    }
    if (runtime.rank() == 0) {
      std::printf("# moe_bench: %d ranks, %lld tokens/rank, d %lld, %lld experts x %lld wide, top-%lld, %s; device %s\n",
                  n, static_cast<long long>(o.tokens), static_cast<long long>(o.d_model),
                  static_cast<long long>(o.experts), static_cast<long long>(o.hidden),
                  static_cast<long long>(o.topk), o.capacity > 0 ? "capacity" : "dropless",
                  runtime.device().str().c_str());
      std::printf("%4s %10s %12s %9s %10s %9s %10s %12s %10s\n", "ep", "layer_ms", "tokens/s", "a2a_ms",
                  "a2a_share", "a2a_MiB", "dense_ms", "moe/dense", "imbalance");
      dtrain::bench::JsonLines json(o.json);
      for (const auto& r : rows) {
        std::printf("%4d %10.2f %12.0f %9.2f %10.3f %9.2f %10.2f %12.2f %10.3f\n", r.ep, r.layer_ms,
                    r.tokens_per_s, r.a2a_ms, r.a2a_ms / r.layer_ms, r.a2a_mib, r.dense_ms,
                    r.layer_ms / r.dense_ms, r.imbalance);
        nlohmann::json j = {{"bench", "moe"},          {"nranks", n},
                            {"ep", r.ep},              {"experts", o.experts},
                            {"topk", o.topk},          {"tokens_per_rank", o.tokens},
                            {"d_model", o.d_model},    {"hidden", o.hidden},
                            {"capacity", o.capacity},  {"layer_ms", r.layer_ms},
                            {"tokens_per_s", r.tokens_per_s}, {"a2a_ms", r.a2a_ms},
                            {"a2a_share", r.a2a_ms / r.layer_ms}, {"a2a_mib_per_rank", r.a2a_mib},
                            {"dense_ms", r.dense_ms},  {"moe_over_dense", r.layer_ms / r.dense_ms},
                            {"load_imbalance", r.imbalance}};
        json.line(j);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_bench: error: %s\n", e.what());
    runtime.abort(1);
  }
  return 0;
}
