// train_bench: training throughput of dtrain against a plain LibTorch loop in the same run.
// Every rank first runs the plain loop (the same Gpt module, torch::optim::AdamW, no dtrain
// trainer, no communication) and then dtrain's Trainer with data parallelism over all
// ranks, in alternating rounds; medians of the per-step times are reported. Weak scaling:
// --batch samples of --seq tokens per rank per step. Also reported: the step-time
// breakdown, the time of the gradient all-reduces alone (comm_total) and the part of it
// the step waited for after backward (comm_exposed). With --fsdp a list of strategies runs
// one after another (each alternating with the plain loop), adding the model-state bytes
// per rank and the bytes sent per step against DDP's theoretical all-reduce volume.
// peak_MiB is the allocator's peak over each loop's own steps minus what was allocated
// before that loop existed (its parameters, gradients, optimizer state and activations):
// the CUDA caching allocator's on a GPU, LibTorch's CPU allocator counted by
// enable_cpu_memory_tracking() on the CPU. --precision bf16 runs both loops under the same autocast.
//
//   mpirun -np 2 build/benchmarks/train_bench --preset gpt2-124m --batch 4 --seq 64 --steps 6
//   mpirun -np 4 build/benchmarks/train_bench --fsdp none,zero1,zero2,full
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <limits>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <nlohmann/json.hpp>

#include "common/bench_util.hpp"
#include "dtrain/dtrain.hpp"
#include "dtrain/train/autocast.hpp"
#include "dtrain/train/trainer.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using dtrain::train::StepMetrics;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

struct Options {
  std::string preset = "tiny", json, backend = "auto", precision = "fp32";
  std::vector<std::string> kernels = {"plain"};
  std::int64_t batch = 4, seq = 64, steps = 6, warmup = 2, rounds = 2, comm_reps = 5;
  std::int64_t attention_window = 0;  // the model's sliding window (0: the preset's, none)
  std::int64_t recompute_blocks = 0;  // the trainer's activation checkpointing (-1: every block)
  double bucket_mb = 25;
  std::vector<std::string> strategies = {"none"};
};

struct Row {
  std::string strategy;
  double step_ms = 0, forward_ms = 0, backward_ms = 0, optimizer_ms = 0, sync_ms = 0;
  double comm_total_ms = 0;
  double state_bytes = 0, comm_bytes = 0;
  double peak_bytes = -1;  // CUDA only: allocator peak attributable to this loop
};

// The plain LibTorch loop: forward, backward, clip, AdamW step.
class PlainLoop {
 public:
  PlainLoop(const dtrain::models::GptConfig& cfg, const Options& o, c10::Device device)
      : model_(dtrain::ParallelContext::single_process(device), cfg, 1337) {
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95}).weight_decay(0.1));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    auto tokens = torch::randint(0, cfg.vocab_size, {o.batch, o.seq + 1}, gen, torch::kLong).to(device);
    x_ = tokens.slice(1, 0, o.seq);
    y_ = tokens.slice(1, 1, o.seq + 1);
    device_ = device;
    dtype_ = dtrain::train::precision_dtype(o.precision);
  }
  // One step; adds its phase times to row, returns the step time.
  double step(Row& row) {
    const auto t0 = Clock::now();
    optimizer_->zero_grad();
    torch::Tensor loss;
    {
      dtrain::train::AutocastScope autocast(dtype_, device_.type());
      loss = model_->loss(x_, y_);
    }
    dtrain::train::synchronize(device_);
    row.forward_ms += ms_since(t0);
    auto t = Clock::now();
    loss.backward();
    dtrain::train::synchronize(device_);
    row.backward_ms += ms_since(t);
    t = Clock::now();
    torch::nn::utils::clip_grad_norm_(model_->parameters(), 1.0);
    optimizer_->step();
    (void)loss.item<float>();
    row.optimizer_ms += ms_since(t);
    return ms_since(t0);
  }

 private:
  dtrain::models::Gpt model_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  torch::Tensor x_, y_;
  c10::Device device_{c10::kCPU};
  c10::ScalarType dtype_ = at::kFloat;
};

// Allocated bytes now; and the peak since `reset_peak_memory` (CUDA), in bytes.
double allocated_bytes(c10::Device device) {
  dtrain::train::synchronize(device);
  return dtrain::train::memory_stats(device).current_mib * (1 << 20);
}
double peak_bytes(c10::Device device) {
  dtrain::train::synchronize(device);
  return dtrain::train::memory_stats(device).peak_mib * (1 << 20);
}

// The gradient all-reduces of one step without compute: every bucket issued, then waited.
double time_bucket_all_reduces(const dtrain::CommPtr& comm, const std::vector<std::int64_t>& numel,
                               c10::Device device, int reps) {
  std::vector<at::Tensor> buffers;
  for (auto n : numel) buffers.push_back(torch::ones({n}, torch::TensorOptions().device(device)));
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    comm->barrier()->wait();
    const auto t = Clock::now();
    std::vector<dtrain::WorkPtr> works;
    for (auto& b : buffers) works.push_back(comm->all_reduce(b, {dtrain::ReduceOp::kAvg}));
    for (auto& w : works) w->synchronize();
    if (r > 0) times.push_back(ms_since(t));  // the first round warms up
  }
  return dtrain::bench::median(times);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"train_bench: dtrain's data-parallel trainer against a plain LibTorch loop"};
  app.add_option("--preset", o.preset, "model preset: tiny, gpt2-124m, gpt2-350m, llama-1b");
  app.add_option("--batch", o.batch, "samples per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "tokens per sample")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "timed steps per round and strategy")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps per strategy before the rounds (the plain loop: at least 2, for its peak memory)")->check(CLI::NonNegativeNumber);
  app.add_option("--rounds", o.rounds, "alternating rounds (plain, then dtrain)")->check(CLI::PositiveNumber);
  app.add_option("--attention-window", o.attention_window,
                 "the model's sliding window, in both loops (0: none, the presets' own)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--recompute-blocks", o.recompute_blocks, "the trainer side's activation checkpointing (the plain loop keeps every activation): the first N blocks recompute in backward; -1: every block, 0: none")
      ->check(CLI::Range(std::int64_t{-1}, std::numeric_limits<std::int64_t>::max()));
  app.add_option("--bucket-mb", o.bucket_mb, "DataParallel bucket size in MiB")->check(CLI::PositiveNumber);
  app.add_option("--backend", o.backend, "auto, mpi or nccl")->check(CLI::IsMember({"auto", "mpi", "nccl"}));
  app.add_option("--fsdp", o.strategies, "strategies to run, each against the plain loop: none (ddp), zero1, zero2, full")
      ->delimiter(',')->check(CLI::IsMember({"none", "zero1", "zero2", "full"}));
  app.add_option("--precision", o.precision, "fp32, or bf16 autocast for both loops")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--kernels", o.kernels, "dtrain's kernels on the trainer side (the plain loop is unchanged): plain (LibTorch ops), fused (all six), or a comma list of flash (--attention flash), norm (--fused-norm), ce (--fused-ce), adamw (--fused-adamw), swiglu (--fused-swiglu), rope (--fused-rope), linear_ce (--fused-linear-ce; not part of fused)")
      ->delimiter(',')->check(CLI::IsMember({"plain", "fused", "flash", "norm", "ce", "adamw", "swiglu", "rope", "linear_ce"}));
  app.add_option("-J,--json", o.json, "append one JSON object per strategy to this file");
  CLI11_PARSE(app, argc, argv);
  std::string kernels_named;  // as given, for the header and the JSON lines
  for (const auto& k : o.kernels) kernels_named += (kernels_named.empty() ? "" : ",") + k;

  // Outside the try: an error reaches the catch (and is printed) before the runtime's
  // shut-down waits for the other ranks.
  std::unique_ptr<dtrain::Runtime> runtime_holder;
  try {
    runtime_holder = std::make_unique<dtrain::Runtime>(&argc, &argv, dtrain::RuntimeOptions{o.backend});
    auto& rt = *runtime_holder;
    auto cfg = dtrain::models::GptConfig::preset(o.preset);
    DTRAIN_CHECK_ARG(cfg.vocab_size <= 65536, "--preset ", o.preset, " has vocabulary ", cfg.vocab_size,
                     "; token shards hold uint16 ids: allowed presets have vocabularies <= 65536");
    DTRAIN_CHECK_ARG(o.seq <= cfg.context, "--seq=", o.seq, " exceeds the context ", cfg.context);
    cfg.attention_window = o.attention_window;
    const int n = rt.size();
    const auto device = rt.device();
    if (device.is_cpu()) dtrain::train::enable_cpu_memory_tracking();  // peak_MiB on the CPU

    // Synthetic token shard for the trainer (one per rank; contents do not change timing).
    const std::string dir = "/tmp/dtrain_train_bench_" + std::to_string(::getpid());
    const std::string train_glob = dtrain::bench::write_synthetic_shard(dir, (o.batch * n * 4) * (o.seq + 1) + 1, cfg.vocab_size);
    dtrain::train::TrainOptions to;
    to.train_data = train_glob;
    to.seq_len = o.seq;
    to.global_batch = o.batch * n;
    to.steps = o.warmup + o.rounds * o.steps;
    to.warmup_steps = 0;
    to.adamw.lr = 1e-4;
    to.progress = "off";
    to.sync_timing = true;
    to.precision = o.precision;
    to.ddp.bucket_bytes = static_cast<std::int64_t>(o.bucket_mb * (1 << 20));

    auto ctx = std::make_shared<dtrain::ParallelContext>(rt.world(), dtrain::ParallelConfig{}, device);
    const double before_plain = allocated_bytes(device);
    const bool track_peak = dtrain::train::reset_peak_memory(device);
    PlainLoop plain(cfg, o, device);
    Row scratch;
    // At least two steps: the second is the first whose activations live beside the AdamW
    // state (the first step creates it after its backward), the steady state's peak.
    for (std::int64_t i = 0; i < std::max<std::int64_t>(o.warmup, 2); ++i) plain.step(scratch);
    const double plain_peak = track_peak ? peak_bytes(device) - before_plain : -1;

    // The slowest rank sets the pace: the maximum over ranks of each value.
    auto max_over_ranks = [&](std::vector<double> v) {
      auto t = torch::tensor(v, torch::kDouble).to(device);
      rt.world()->all_reduce(t, {dtrain::ReduceOp::kMax})->synchronize();
      t = t.cpu();
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = t[static_cast<std::int64_t>(i)].item<double>();
      return v;
    };

    Row prow{"plain"};
    std::vector<double> p_steps;
    std::vector<Row> rows;
    for (const auto& strategy : o.strategies) {
      to.fsdp = strategy;
      const double before = allocated_bytes(device);
      auto tcfg = cfg;
      auto uses = [&](const char* k) {
        return std::count(o.kernels.begin(), o.kernels.end(), "fused") + std::count(o.kernels.begin(), o.kernels.end(), k) > 0;
      };
      if (uses("flash")) tcfg.attention = dtrain::ops::AttentionBackend::kFlash;
      tcfg.fused_norm = uses("norm");
      tcfg.fused_ce = uses("ce");
      tcfg.fused_swiglu = uses("swiglu");
      tcfg.fused_rope = uses("rope");
      tcfg.fused_linear_ce = std::count(o.kernels.begin(), o.kernels.end(), "linear_ce") > 0;
      tcfg.recompute_blocks = o.recompute_blocks;
      to.adamw.fused = uses("adamw");
      dtrain::train::Trainer trainer(ctx, tcfg, to);
      for (std::int64_t i = 0; i < o.warmup; ++i) trainer.train_step();
      Row row{strategy == "none" ? "ddp" : strategy};
      std::vector<double> steps;
      for (std::int64_t r = 0; r < o.rounds; ++r) {
        rt.world()->barrier()->wait();
        for (std::int64_t i = 0; i < o.steps; ++i) p_steps.push_back(plain.step(prow));
        rt.world()->barrier()->wait();
        if (track_peak) dtrain::train::reset_peak_memory(device);
        for (std::int64_t i = 0; i < o.steps; ++i) {
          const StepMetrics m = trainer.train_step();
          steps.push_back(m.step_ms);
          row.forward_ms += m.forward_ms;
          row.backward_ms += m.backward_ms;
          row.sync_ms += m.sync_ms;
          row.optimizer_ms += m.optimizer_ms;
        }
        if (track_peak) row.peak_bytes = std::max(row.peak_bytes, peak_bytes(device) - before);
      }
      const double timed = static_cast<double>(o.rounds * o.steps);
      row.forward_ms /= timed;
      row.backward_ms /= timed;
      row.sync_ms /= timed;
      row.optimizer_ms /= timed;
      row.step_ms = dtrain::bench::median(steps);
      row.state_bytes = static_cast<double>(trainer.model_state_bytes());
      row.comm_bytes = trainer.comm_bytes();
      if (const auto* ddp = trainer.data_parallel()) {
        row.comm_total_ms = time_bucket_all_reduces(rt.world(), ddp->stats().bucket_numel, device,
                                                    static_cast<int>(o.comm_reps));
      }
      const auto v = max_over_ranks({row.step_ms, row.sync_ms, row.comm_total_ms, row.state_bytes,
                                     row.peak_bytes});
      row.step_ms = v[0];
      row.sync_ms = v[1];
      row.comm_total_ms = v[2];
      row.state_bytes = v[3];
      row.peak_bytes = v[4];
      rows.push_back(row);
    }
    const double timed_plain = static_cast<double>(p_steps.size());
    prow.forward_ms /= timed_plain;
    prow.backward_ms /= timed_plain;
    prow.optimizer_ms /= timed_plain;
    const auto pv = max_over_ranks({dtrain::bench::median(p_steps), plain_peak});
    prow.step_ms = pv[0];
    prow.peak_bytes = pv[1];
    prow.state_bytes = static_cast<double>(cfg.num_parameters()) * 4 * 4;  // params, grads, 2 Adam
    dtrain::fs::remove_tree(dir);

    if (rt.rank() == 0) {
      const double tokens = static_cast<double>(o.batch * o.seq * n);
      const double param_bytes = static_cast<double>(cfg.num_parameters()) * 4;
      std::printf("# train_bench: preset %s (%.1fM params), %d rank(s), batch %lld x %lld tokens per rank, "
                  "window %lld, recompute %lld blocks, %lld rounds x %lld steps, %s, %s kernels, device %s\n",
                  o.preset.c_str(), static_cast<double>(cfg.num_parameters()) / 1e6, n,
                  static_cast<long long>(o.batch), static_cast<long long>(o.seq),
                  static_cast<long long>(o.attention_window), static_cast<long long>(o.recompute_blocks),
                  static_cast<long long>(o.rounds), static_cast<long long>(o.steps),
                  o.precision.c_str(), kernels_named.c_str(), dtrain::train::device_name(device).c_str());
      std::printf("# plain: every rank runs the LibTorch loop alone (no communication); ddp: dtrain Trainer"
                  "; zero1/zero2/full: dtrain Trainer with --fsdp\n");
      const double peak = dtrain::train::known_peak_tflops(dtrain::train::device_name(device));
      std::printf("%-8s %6s %10s %9s %8s %8s %8s %10s %12s %7s %8s %9s %8s %9s %8s %7s %6s\n", "strategy",
                  "nranks", "tokens/s", "step_ms", "fwd_ms", "bwd_ms", "opt_ms", "comm_total",
                  "comm_exposed", "hidden", "vs_plain", "state_MiB", "peak_MiB", "comm_MB", "comm/ddp",
                  "TFLOP/s", "mfu");
      dtrain::bench::JsonLines json(o.json);
      // DDP's traffic per step in theory: one all-reduce of every gradient.
      const double ddp_theory = dtrain::wire_bytes(dtrain::OpKind::kAllReduce, param_bytes, n);
      std::vector<const Row*> all = {&prow};
      for (const auto& r : rows) all.push_back(&r);
      for (const Row* row : all) {
        const bool is_plain = row == &prow;
        const double tps = tokens / (row->step_ms / 1e3);
        const double hidden = row->comm_total_ms > 0
                                  ? std::clamp(1.0 - row->sync_ms / row->comm_total_ms, 0.0, 1.0)
                                  : 0.0;
        const double ratio = row->step_ms / prow.step_ms;
        const double tflops = cfg.flops_per_token(o.seq) * tps / n / 1e12;  // per device
        const double comm_ratio = ddp_theory > 0 ? row->comm_bytes / ddp_theory : 0.0;
        char mfu[16] = "n/a";
        if (peak > 0) std::snprintf(mfu, sizeof(mfu), "%.1f%%", 100 * tflops / peak);
        char peak_mib[16] = "n/a";
        if (row->peak_bytes >= 0) std::snprintf(peak_mib, sizeof(peak_mib), "%.0f", row->peak_bytes / (1 << 20));
        std::printf("%-8s %6d %10.0f %9.1f %8.1f %8.1f %8.1f %10.2f %12.2f %6.0f%% %8.3f %9.1f %8s %9.1f %8.3f %7.3f %6s\n",
                    row->strategy.c_str(), n, tps, row->step_ms, row->forward_ms, row->backward_ms,
                    row->optimizer_ms, row->comm_total_ms, row->sync_ms, 100 * hidden, ratio,
                    row->state_bytes / (1 << 20), peak_mib, row->comm_bytes / 1e6, comm_ratio, tflops, mfu);
        nlohmann::json j = {{"strategy", row->strategy}, {"nranks", n},
                            {"preset", o.preset},         {"batch", o.batch},
                            {"seq", o.seq},               {"precision", o.precision}, {"kernels", kernels_named},
                            {"attention_window", o.attention_window}, {"recompute_blocks", o.recompute_blocks},
                            {"tokens_per_s", tps},
                            {"step_ms", row->step_ms},    {"forward_ms", row->forward_ms},
                            {"backward_ms", row->backward_ms}, {"optimizer_ms", row->optimizer_ms},
                            {"comm_total_ms", row->comm_total_ms}, {"comm_exposed_ms", row->sync_ms},
                            {"hidden_fraction", hidden},  {"step_ratio_vs_plain", ratio},
                            {"state_bytes_per_rank", row->state_bytes},
                            {"peak_bytes_per_rank", row->peak_bytes >= 0 ? nlohmann::json(row->peak_bytes) : nlohmann::json()},
                            {"comm_bytes", row->comm_bytes},
                            {"comm_bytes_vs_ddp_theory", is_plain ? nlohmann::json() : nlohmann::json(comm_ratio)},
                            {"tflops", tflops},
                            {"mfu", peak > 0 ? nlohmann::json(tflops / peak) : nlohmann::json()}};
        json.line(j);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    return dtrain::bench::fail("train_bench", e, runtime_holder.get());
  }
}
