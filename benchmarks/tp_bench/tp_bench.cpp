// tp_bench: what tensor parallelism costs. On N ranks it trains one model on the same global
// batch in each layout tp x dp of the world (tp from --tp; tp = 1 is pure data parallelism,
// the baseline of the throughput ratio), tensor parallel layouts with and without sequence
// parallelism. Per layout: the median step time, tokens/s and its ratio to tp = 1, and the
// bytes each rank sent per step in tensor-parallel collectives (tp::comm_stats, ring
// wire bytes) against the analytical count of docs/parallelism.md, plus the data-parallel
// bytes. The analytical count assumes float32 activations (run with --precision fp32).
//
//   mpirun -np 4 build/benchmarks/tp_bench --tp 1,2,4
//   mpirun -np 4 build/benchmarks/tp_bench --preset gpt2-124m --n-layer 4 --seq 128 --batch 2
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/bench_util.hpp"
#include "common/model_options.hpp"
#include "dtrain/dtrain.hpp"
#include "dtrain/parallel/tensor_parallel.hpp"
#include "dtrain/train/trainer.hpp"

namespace {

struct Options {
  dtrain::bench::ModelOptions model;
  std::string json, backend = "auto";
  std::int64_t batch = 2, seq = 64, steps = 4, warmup = 1;
  std::vector<int> tp = {1, 2, 4};
  bool fused_ce = false;
};

// Bytes one rank sends per optimizer step in the tensor-parallel layers (docs/parallelism.md):
// per micro-batch of b x s tokens, A = b s d e bytes of activations (e = 4, float32) and
// ring factors r = 2 (t - 1) / t for an all-reduce, (t - 1) / t for an all-gather or a
// reduce-scatter:
//   activations  (4 L + 2) r A   (2 per block in forward, 2 in backward; embedding, head).
//                Sequence parallelism trades each all-reduce for a reduce-scatter plus an
//                all-gather of the same bytes: the same count.
//   loss         3 r b s 4       (row max, sum of exponentials, target logit; float32), or
//                with --fused-ce 8 (t - 1) b s (an all-gather of two float32 statistics
//                per row from each rank)
//   kv heads     L r (2 Hkv hd d [+ 2 Hkv hd bias]) e, only when tp does not divide Hkv
//                (replicated key/value projections: their gradients are summed)
//   sequence     r e (per block: 2 norms and 2 row biases (gpt2: 6d; llama: 2d); the final
//   parallel     norm (gpt2 2d, llama d); gpt2's position table context x d): parameters whose
//                gradients are partial on each rank's sequence shard
double theory_bytes(const dtrain::models::GptConfig& c, std::int64_t micro, std::int64_t seq,
                    std::int64_t accum, int t, bool sp) {
  if (t == 1) return 0;
  const double e = 4, r = 2.0 * (t - 1) / t;
  const bool gpt2 = c.family == "gpt2";
  const double L = static_cast<double>(c.n_layer), d = static_cast<double>(c.d_model);
  const double A = static_cast<double>(micro * seq) * d * e;
  const double tokens = static_cast<double>(micro * seq);
  double bytes = (4 * L + 2) * r * A + (c.fused_ce ? 8.0 * (t - 1) * tokens : 3 * r * tokens * 4);
  if (c.n_kv_head % t != 0) {
    const double kv = 2.0 * static_cast<double>(c.n_kv_head * c.head_dim());
    bytes += L * r * (kv * d + (gpt2 ? kv : 0)) * e;
  }
  if (sp) {
    const double params = L * (gpt2 ? 6 * d : 2 * d) + (gpt2 ? 2 * d : d) +
                          (gpt2 ? static_cast<double>(c.context) * d : 0);
    bytes += r * e * params;
  }
  return static_cast<double>(accum) * bytes;
}

struct Row {
  int tp = 1, dp = 1;
  bool sp = false;
  double step_ms = 0, tokens_per_s = 0, comm_bytes = 0, theory = 0, dp_bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"tp_bench: tensor-parallel traffic against its analytical count, throughput against tp = 1"};
  o.model.add_to(app);  // llama's kv heads: tp not dividing them replicates them
  app.add_option("--batch", o.batch, "samples per rank per step (global batch: batch x ranks)")->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "tokens per sample")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "timed steps per layout")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps per layout")->check(CLI::NonNegativeNumber);
  app.add_option("--tp", o.tp, "tensor-parallel degrees to run (each dividing the world)")->delimiter(',');
  app.add_flag("--fused-ce", o.fused_ce,
               "the loss by dtrain's fused cross-entropy over the split vocabulary (its reference path on the CPU)");
  app.add_option("--backend", o.backend, "auto, mpi or nccl")->check(CLI::IsMember({"auto", "mpi", "nccl"}));
  app.add_option("-J,--json", o.json, "append one JSON object per layout to this file");
  CLI11_PARSE(app, argc, argv);

  // Outside the try: an error reaches the catch (and is printed) before the runtime's
  // shut-down waits for the other ranks.
  std::unique_ptr<dtrain::Runtime> runtime_holder;
  try {
    runtime_holder = std::make_unique<dtrain::Runtime>(&argc, &argv, dtrain::RuntimeOptions{o.backend});
    auto& rt = *runtime_holder;
    auto cfg = o.model.config();
    cfg.fused_ce = o.fused_ce;
    cfg.validate();
    DTRAIN_CHECK_ARG(o.seq <= cfg.context, "--seq=", o.seq, " exceeds the context ", cfg.context);
    const int n = rt.size();
    for (int t : o.tp) {
      DTRAIN_CHECK_ARG(t >= 1 && n % t == 0, "--tp ", t, " does not divide the world size ", n,
                       "; allowed: divisors of ", n);
      cfg.validate_tp(t);
    }

    const std::string dir = "/tmp/dtrain_tp_bench_" + std::to_string(::getpid());
    const std::string train_glob = dtrain::bench::write_synthetic_shard(dir, (o.batch * n * 2) * (o.seq + 1) + 1, cfg.vocab_size);
    dtrain::train::TrainOptions to;
    to.train_data = train_glob;
    to.seq_len = o.seq;
    to.global_batch = o.batch * n;
    to.steps = o.warmup + o.steps;
    to.warmup_steps = 0;
    to.adamw.lr = 1e-4;
    to.progress = "off";

    auto max_over_ranks = [&](double v) { return dtrain::bench::max_over_ranks(rt.world(), rt.device(), v); };

    std::vector<Row> rows;
    for (int t : o.tp) {
      for (bool sp : {false, true}) {
        if (sp && t == 1) continue;
        dtrain::ParallelConfig pc;
        pc.tp = t;
        pc.sequence_parallel = sp;
        auto ctx = std::make_shared<dtrain::ParallelContext>(rt.world(), pc, rt.device());
        dtrain::train::Trainer trainer(ctx, cfg, to);
        for (std::int64_t i = 0; i < o.warmup; ++i) trainer.train_step();
        Row row;
        row.tp = t, row.dp = n / t, row.sp = sp;
        std::vector<double> steps;
        double tp_bytes = 0;
        for (std::int64_t i = 0; i < o.steps; ++i) {
          rt.world()->barrier()->wait();
          dtrain::tp::reset_comm_stats();
          steps.push_back(trainer.train_step().step_ms);
          tp_bytes += dtrain::tp::comm_stats().bytes;
        }
        row.step_ms = max_over_ranks(dtrain::bench::median(steps));
        row.tokens_per_s = static_cast<double>(to.global_batch * o.seq) / (row.step_ms / 1e3);
        row.comm_bytes = max_over_ranks(tp_bytes / static_cast<double>(o.steps));
        row.dp_bytes = max_over_ranks(trainer.comm_bytes());
        const std::int64_t micro = to.global_batch / row.dp;
        row.theory = theory_bytes(cfg, micro, o.seq, trainer.grad_accumulation(), t, sp);
        rows.push_back(row);
      }
    }
    dtrain::fs::remove_tree(dir);

    if (rt.rank() == 0) {
      std::printf("# tp_bench: preset %s %s (%d layers, d %lld, %lld heads / %lld kv), %d rank(s), "
                  "global batch %lld x %lld tokens, fp32, %s loss, median of %lld steps\n",
                  o.model.preset.c_str(), cfg.family.c_str(), static_cast<int>(cfg.n_layer), static_cast<long long>(cfg.d_model),
                  static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.n_kv_head), n,
                  static_cast<long long>(to.global_batch), static_cast<long long>(o.seq),
                  o.fused_ce ? "fused" : "Megatron's", static_cast<long long>(o.steps));
      std::printf("%-6s %3s %3s %9s %10s %8s %14s %14s %8s %14s\n", "layout", "tp", "dp", "step_ms",
                  "tokens/s", "vs_tp1", "tp_MB/step", "theory_MB", "ratio", "dp_MB/step");
      const double base = rows.front().tp == 1 ? rows.front().tokens_per_s : 0;
      dtrain::bench::JsonLines json(o.json);
      for (const auto& r : rows) {
        const char* layout = r.tp == 1 ? "dp" : r.sp ? "tp+sp" : "tp";
        const double vs = base > 0 ? r.tokens_per_s / base : 0;
        const double ratio = r.theory > 0 ? r.comm_bytes / r.theory : 0;
        std::printf("%-6s %3d %3d %9.1f %10.0f %8.3f %14.3f %14.3f %8.4f %14.3f\n", layout, r.tp, r.dp,
                    r.step_ms, r.tokens_per_s, vs, r.comm_bytes / 1e6, r.theory / 1e6, ratio,
                    r.dp_bytes / 1e6);
        nlohmann::json j = {{"bench", "tp_bench"}, {"strategy", layout}, {"preset", o.model.preset}, {"family", cfg.family},
                            {"n_layer", cfg.n_layer}, {"tp", r.tp}, {"dp", r.dp}, {"nranks", n},
                            {"sequence_parallel", r.sp}, {"fused_ce", o.fused_ce}, {"seq", o.seq}, {"global_batch", to.global_batch},
                            {"step_ms", r.step_ms}, {"tokens_per_s", r.tokens_per_s},
                            {"tokens_per_s_vs_tp1", base > 0 ? nlohmann::json(vs) : nlohmann::json()},
                            {"comm_bytes", r.comm_bytes}, {"comm_bytes_theory", r.theory},
                            {"dp_comm_bytes", r.dp_bytes}};
        json.line(j);
      }
    }
  } catch (const std::exception& e) {
    return dtrain::bench::fail("tp_bench", e, runtime_holder.get());
  }
  return 0;
}
