// cp_bench: what context parallelism costs and saves. On N ranks it trains one model on the
// same global batch of N samples of --seq tokens in each layout: pure data parallelism (each
// rank one whole sample a step: the baseline), and for each c in --cp, c context-parallel
// ranks per sample (dp = N / c) in each --cp-comm form the attention backend allows
// (--attention sdpa: all_gather and a2a; flash: all three), with micro-batches of one sample,
// so that a rank holds seq / c of the positions at a time. Per layout: the median step
// time and its ratio to the baseline, the peak memory a rank allocates during a step above
// what it held before it (CPU: live tensors, tracked; CUDA: the caching allocator) and its
// ratio to the baseline, and the bytes a rank sends per step in context-parallel
// collectives against the analytical count of docs/parallelism.md (measured for
// all_gather, which runs tp's sequence functions; a2a's all-to-alls and p2p's sends are
// not counted).
//
//   mpirun -np 2 build/benchmarks/cp_bench --seq 1024
//   mpirun -np 4 build/benchmarks/cp_bench --cp 2,4 --family llama --n-kv-head 2 --seq 2048
//   mpirun -np 2 build/benchmarks/cp_bench --attention flash --seq 1024
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/bench_util.hpp"
#include "common/model_options.hpp"
#include "dtrain/dtrain.hpp"
#include "dtrain/parallel/tensor_parallel.hpp"
#include "dtrain/train/device_stats.hpp"
#include "dtrain/train/trainer.hpp"

namespace {

struct Options {
  dtrain::bench::ModelOptions model;
  std::string json, backend = "auto", attention = "sdpa";
  std::int64_t context = 0, seq = 1024, steps = 3, warmup = 1;
  std::vector<int> cp = {2};
};

// Bytes one rank sends per step in context-parallel collectives (docs/parallelism.md), per
// layer and micro-batch of b samples, each rank T / c positions, e = 4 (float32), forward
// and backward alike:
//   all_gather  (c - 1) 2 b (T/c) Hkv hd e             (an all-gather, then a reduce-scatter)
//   a2a         (c - 1)/c (2 H + 2 Hkv') b (T/c) hd e   (two all-to-alls; Hkv' = Hkv, or H
//                                                        when c does not divide Hkv)
//   p2p         (c - 1) 2 b (T/c) Hkv hd e forward; backward that again and c hops of the
//               keys' float32 gradients, c 2 b (T/c) Hkv hd 4
double theory_bytes(const dtrain::models::GptConfig& m, dtrain::CpComm comm, int c, std::int64_t seq,
                    std::int64_t micro_batches) {
  if (c == 1) return 0;
  const double e = 4, local = static_cast<double>(seq / c), hd = static_cast<double>(m.head_dim());
  const double H = static_cast<double>(m.n_head);
  const double hkv = static_cast<double>(m.n_kv_head % c == 0 ? m.n_kv_head : m.n_head);
  const double kv = 2.0 * local * static_cast<double>(m.n_kv_head) * hd;  // one rank's keys and values
  double per_layer = 0;
  switch (comm) {
    case dtrain::CpComm::kAllGather: per_layer = 2 * (c - 1) * kv * e; break;
    case dtrain::CpComm::kAllToAll: per_layer = 2 * (c - 1.0) / c * (2 * H + 2 * hkv) * local * hd * e; break;
    case dtrain::CpComm::kRing: per_layer = 2 * (c - 1) * kv * e + c * kv * 4; break;
  }
  return per_layer * static_cast<double>(m.n_layer * micro_batches);
}

struct Row {
  int cp = 1, dp = 1;
  dtrain::CpComm comm = dtrain::CpComm::kAllGather;
  double step_ms = 0, peak_bytes = 0, comm_bytes = 0, theory = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"cp_bench: context parallelism's step time and peak memory against data parallelism"};
  o.model.add_to(app);
  app.add_option("--context", o.context, "the model's context (0: max(the preset's, --seq))")->check(CLI::NonNegativeNumber);
  app.add_option("--seq", o.seq, "tokens per sample (a multiple of 2 x every --cp)")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "timed steps per layout")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps per layout (at least 1: the optimizer state)")->check(CLI::PositiveNumber);
  app.add_option("--cp", o.cp, "context-parallel degrees to run (each dividing the world)")->delimiter(',');
  app.add_option("--attention", o.attention, "sdpa (rows: dp, all_gather, a2a) or flash (dp, all_gather, a2a, p2p; on the CPU its reference path)")
      ->check(CLI::IsMember({"sdpa", "flash"}));
  app.add_option("--backend", o.backend, "auto, mpi or nccl")->check(CLI::IsMember({"auto", "mpi", "nccl"}));
  app.add_option("-J,--json", o.json, "append one JSON object per layout to this file");
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<dtrain::Runtime> runtime_holder;
  try {
    runtime_holder = std::make_unique<dtrain::Runtime>(&argc, &argv, dtrain::RuntimeOptions{o.backend});
    auto& rt = *runtime_holder;
    const auto device = rt.device();
    if (device.is_cpu()) dtrain::train::enable_cpu_memory_tracking();
    auto cfg = o.model.config();
    cfg.context = o.context > 0 ? o.context : std::max(cfg.context, o.seq);
    cfg.attention = dtrain::ops::parse_attention_backend(o.attention);
    cfg.validate();
    const int n = rt.size();
    for (int c : o.cp) {
      DTRAIN_CHECK_ARG(c >= 2 && n % c == 0, "--cp ", c, " does not divide the world size ", n,
                       "; allowed: divisors of ", n, " from 2");
      dtrain::cp::check_sequence(o.seq, c, "--seq");
    }

    const std::string dir = "/tmp/dtrain_cp_bench_" + std::to_string(::getpid());
    const auto glob = dtrain::bench::write_synthetic_shard(dir, n * 2 * (o.seq + 1) + 1, cfg.vocab_size);
    dtrain::train::TrainOptions to;
    to.train_data = glob;
    to.seq_len = o.seq;
    to.global_batch = n;
    to.micro_batch = 1;
    to.steps = o.warmup + o.steps;
    to.warmup_steps = 0;
    to.adamw.lr = 1e-4;
    to.progress = "off";

    auto max_over_ranks = [&](double v) { return dtrain::bench::max_over_ranks(rt.world(), device, v); };

    std::vector<Row> rows;
    std::vector<std::pair<int, dtrain::CpComm>> layouts = {{1, dtrain::CpComm::kAllGather}};
    const bool flash = cfg.attention == dtrain::ops::AttentionBackend::kFlash;
    for (int c : o.cp) {
      for (auto comm : {dtrain::CpComm::kAllGather, dtrain::CpComm::kAllToAll, dtrain::CpComm::kRing}) {
        if (flash || comm != dtrain::CpComm::kRing) layouts.emplace_back(c, comm);  // the ring runs flash only
      }
    }
    for (const auto& [c, comm] : layouts) {
      if (comm == dtrain::CpComm::kAllToAll && cfg.n_head % c != 0) continue;  // a2a splits the heads
      dtrain::ParallelConfig pc;
      pc.cp = c, pc.cp_comm = comm;
      auto ctx = std::make_shared<dtrain::ParallelContext>(rt.world(), pc, device);
      Row row;
      row.cp = c, row.dp = n / c, row.comm = comm;
      {
        dtrain::train::Trainer trainer(ctx, cfg, to);
        for (std::int64_t i = 0; i < o.warmup; ++i) trainer.train_step();
        std::vector<double> steps, peaks;
        double bytes = 0;
        for (std::int64_t i = 0; i < o.steps; ++i) {
          rt.world()->barrier()->wait();
          dtrain::tp::reset_comm_stats();
          dtrain::train::synchronize(device);
          const double before = dtrain::train::memory_stats(device).current_mib;
          dtrain::train::reset_peak_memory(device);
          steps.push_back(trainer.train_step().step_ms);
          peaks.push_back((dtrain::train::memory_stats(device).peak_mib - before) * (1 << 20));
          bytes += dtrain::tp::comm_stats().bytes;
        }
        row.step_ms = max_over_ranks(dtrain::bench::median(steps));
        row.peak_bytes = max_over_ranks(dtrain::bench::median(peaks));
        row.comm_bytes = max_over_ranks(bytes / static_cast<double>(o.steps));
        row.theory = theory_bytes(cfg, comm, c, o.seq, trainer.grad_accumulation());
      }
      rows.push_back(row);
    }
    dtrain::fs::remove_tree(dir);

    if (rt.rank() == 0) {
      std::printf("# cp_bench: preset %s %s (%d layers, d %lld, %lld heads / %lld kv), %d rank(s) on %s, "
                  "global batch %d x %lld tokens, micro-batches of 1 sample, fp32, attention %s, median of %lld "
                  "steps\n",
                  o.model.preset.c_str(), cfg.family.c_str(), static_cast<int>(cfg.n_layer),
                  static_cast<long long>(cfg.d_model), static_cast<long long>(cfg.n_head),
                  static_cast<long long>(cfg.n_kv_head), n, dtrain::train::device_name(device).c_str(), n,
                  static_cast<long long>(o.seq), o.attention.c_str(), static_cast<long long>(o.steps));
      std::printf("%-14s %3s %3s %9s %8s %10s %8s %12s %12s\n", "layout", "cp", "dp", "step_ms", "vs_dp",
                  "peak_MiB", "vs_dp", "cp_MB/step", "theory_MB");
      const auto& base = rows.front();
      dtrain::bench::JsonLines json(o.json);
      for (const auto& r : rows) {
        const std::string layout = r.cp == 1 ? "dp" : std::string("cp ") + dtrain::to_string(r.comm);
        const bool measured = r.cp == 1 || r.comm == dtrain::CpComm::kAllGather;
        char sent[32] = "n/a";
        if (measured) std::snprintf(sent, sizeof sent, "%.3f", r.comm_bytes / 1e6);
        std::printf("%-14s %3d %3d %9.1f %8.3f %10.2f %8.3f %12s %12.3f\n", layout.c_str(), r.cp, r.dp, r.step_ms,
                    r.step_ms / base.step_ms, r.peak_bytes / (1 << 20), r.peak_bytes / base.peak_bytes, sent,
                    r.theory / 1e6);
        nlohmann::json j = {{"bench", "cp_bench"}, {"layout", layout}, {"attention", o.attention}, {"preset", o.model.preset},
                            {"family", cfg.family}, {"n_layer", cfg.n_layer}, {"n_head", cfg.n_head},
                            {"n_kv_head", cfg.n_kv_head}, {"nranks", n}, {"cp", r.cp}, {"dp", r.dp},
                            {"seq", o.seq}, {"global_batch", n}, {"step_ms", r.step_ms},
                            {"step_vs_dp", r.step_ms / base.step_ms}, {"peak_bytes", r.peak_bytes},
                            {"peak_vs_dp", r.peak_bytes / base.peak_bytes},
                            {"cp_comm_bytes", measured ? nlohmann::json(r.comm_bytes) : nlohmann::json()},
                            {"cp_comm_bytes_theory", r.theory}};
        json.line(j);
      }
    }
  } catch (const std::exception& e) {
    return dtrain::bench::fail("cp_bench", e, runtime_holder.get());
  }
  return 0;
}
