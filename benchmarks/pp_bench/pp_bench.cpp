// pp_bench: how much of a pipeline step is bubble. On N ranks (pp = N) it runs one step of
// every schedule (gpipe, 1f1b, interleaved, zb) for each micro-batch count through
// PipelineRuntime with equal-cost stages (each virtual stage: the same residual MLP blocks
// on [micro, seq, d]; the loss: mean square of the last output), records the actions as
// trace spans, and reports per schedule:
//   bubble_measured  1 - sum(compute spans over ranks) / (p x step time)
//   bubble_theory    the closed form (pp::theory_bubble; zb assumes F = Bi = W)
//   bubble_sim       pp::simulate with the measured mean F, B, Bi, W times: what the
//                    schedule's order alone costs with this machine's action times
//   peak_act_mib     per rank: tensor memory above the step's start at its peak (CPU:
//                    tracked allocator; CUDA: caching allocator), the activations held
//   step_ms          median step time
//
//   mpirun -np 2 build/benchmarks/pp_bench --microbatches 2,4,8
//   mpirun -np 4 build/benchmarks/pp_bench --d-model 512 --json pp.jsonl
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <map>
#include <nlohmann/json.hpp>

#include "common/bench_util.hpp"
#include "dtrain/dtrain.hpp"
#include "dtrain/parallel/pipeline.hpp"
#include "dtrain/train/device_stats.hpp"

namespace {

struct Options {
  std::string json, backend = "auto";
  std::int64_t d_model = 256, seq = 64, micro = 4, blocks = 2, steps = 3, warmup = 1;
  int virtual_stages = 2;
  std::vector<std::int64_t> microbatches = {0};  // 0: p, 2p, 4p
  std::vector<std::string> schedules = {"gpipe", "1f1b", "interleaved", "zb"};
};

// One virtual stage: `blocks` residual MLP blocks x + W2 gelu(W1 x) of width 4d.
struct StageModelImpl : torch::nn::Module {
  StageModelImpl(std::int64_t d, std::int64_t blocks) {
    for (std::int64_t i = 0; i < blocks; ++i) {
      up.push_back(register_module("up" + std::to_string(i), torch::nn::Linear(d, 4 * d)));
      down.push_back(register_module("down" + std::to_string(i), torch::nn::Linear(4 * d, d)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < up.size(); ++i) x = x + down[i]->forward(torch::gelu(up[i]->forward(x)));
    return x;
  }
  std::vector<torch::nn::Linear> up, down;
};
TORCH_MODULE(StageModel);

struct Row {
  std::string schedule;
  std::int64_t m = 0;
  int v = 1;
  double step_ms = 0, measured = 0, theory = 0, simulated = 0;
  double f_ms = 0, b_ms = 0, bi_ms = 0, w_ms = 0;
  std::vector<double> peak_act_mib;  // per rank
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"pp_bench: measured pipeline bubble per schedule against theory; activation memory"};
  app.add_option("--d-model", o.d_model, "width of the stage blocks")->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "tokens per sample")->check(CLI::PositiveNumber);
  app.add_option("--micro", o.micro, "samples per micro-batch")->check(CLI::PositiveNumber);
  app.add_option("--blocks", o.blocks, "MLP blocks per rank (split over the chunks when interleaved)")
      ->check(CLI::PositiveNumber);
  app.add_option("--microbatches", o.microbatches, "micro-batch counts (0: p, 2p and 4p)")->delimiter(',');
  app.add_option("--schedules", o.schedules, "schedules to run")->delimiter(',');
  app.add_option("--virtual-stages", o.virtual_stages, "chunks per rank for interleaved")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "timed steps per row")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps per row")->check(CLI::NonNegativeNumber);
  app.add_option("--backend", o.backend, "auto, mpi or nccl")->check(CLI::IsMember({"auto", "mpi", "nccl"}));
  app.add_option("-J,--json", o.json, "append one JSON object per row to this file");
  CLI11_PARSE(app, argc, argv);

  // Outside the try: an error reaches the catch (and is printed) before the runtime's
  // shut-down waits for the other ranks.
  std::unique_ptr<dtrain::Runtime> runtime_holder;
  try {
    runtime_holder = std::make_unique<dtrain::Runtime>(&argc, &argv, dtrain::RuntimeOptions{o.backend});
    auto& rt = *runtime_holder;
    const int p = rt.size(), rank = rt.rank();
    const auto device = rt.device();
    if (device.is_cpu()) dtrain::train::enable_cpu_memory_tracking();
    if (o.microbatches == std::vector<std::int64_t>{0}) o.microbatches = {p, 2 * p, 4 * p};
    auto world = rt.world();
    auto all_reduce = [&](double v, dtrain::ReduceOp op) {
      auto t = torch::full({1}, v, torch::kDouble).to(device);
      world->all_reduce(t, {op})->synchronize();
      return t.cpu().item<double>();
    };

    std::vector<Row> rows;
    for (const auto& name : o.schedules) {
      const auto kind = dtrain::pp::parse_schedule(name);
      const int v = kind == dtrain::pp::ScheduleKind::kInterleaved ? o.virtual_stages : 1;
      DTRAIN_CHECK_ARG(o.blocks % v == 0, "--blocks=", o.blocks, " is not divisible by --virtual-stages=", v);
      for (const std::int64_t m : o.microbatches) {
        if (kind == dtrain::pp::ScheduleKind::kInterleaved && m % p != 0) continue;
        torch::manual_seed(7);
        std::vector<StageModel> models;
        std::vector<dtrain::pp::StageChunk> chunks;
        for (int c = 0; c < v; ++c) {
          models.emplace_back(o.d_model, o.blocks / v);
          models.back()->to(device);
          auto model = models.back();
          chunks.push_back({[model](const at::Tensor& x) mutable { return model->forward(x); },
                            [](const at::Tensor& y, const at::Tensor&) { return y.square().mean(); },
                            model->parameters(), {}, {}, {}});
        }
        dtrain::trace::Recorder recorder(rank, "rank " + std::to_string(rank));
        if (device.is_cuda()) recorder.set_end_hook([device] { dtrain::train::synchronize(device); });
        dtrain::pp::PipelineOptions po;
        po.schedule = kind;
        po.shape = {p, static_cast<int>(m), v};
        po.activation_shape = {o.micro, o.seq, o.d_model};
        po.trace = &recorder;
        dtrain::pp::PipelineRuntime runtime(std::move(chunks), world, po);
        // Stage 0 feeds [m micro, seq, d] activations (the runtime narrows micro-batches).
        const auto inputs = torch::randn({m * o.micro, o.seq, o.d_model}, torch::TensorOptions().device(device));
        const auto targets = torch::zeros({m * o.micro}, torch::TensorOptions().device(device));

        Row row;
        row.schedule = name, row.m = m, row.v = v;
        std::vector<double> steps, measured;
        std::map<std::string, std::vector<double>> action_us;
        for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
          for (auto& model : models) {
            for (auto& prm : model->parameters()) {
              if (prm.grad().defined()) prm.mutable_grad().zero_();  // kept: not counted as activations
            }
          }
          world->barrier()->wait();
          dtrain::train::synchronize(device);
          const double base_mib = dtrain::train::memory_stats(device).current_mib;
          dtrain::train::reset_peak_memory(device);
          recorder.clear();
          recorder.set_epoch();
          runtime.run(inputs, targets);
          dtrain::train::synchronize(device);
          const double end_us = recorder.now_us();
          const double peak = dtrain::train::memory_stats(device).peak_mib - base_mib;
          double busy = 0;
          for (const auto& e : recorder.events()) {
            if (e.track != dtrain::trace::Track::kCompute) continue;
            busy += e.duration_us;
            if (s >= o.warmup) action_us[e.name].push_back(e.duration_us);
          }
          const double step_us = all_reduce(end_us, dtrain::ReduceOp::kMax);
          const double busy_all = all_reduce(busy, dtrain::ReduceOp::kSum);
          if (s < o.warmup) continue;
          steps.push_back(step_us / 1e3);
          measured.push_back(1.0 - busy_all / (p * step_us));
          row.peak_act_mib.assign(static_cast<std::size_t>(p), 0.0);
          auto all = torch::zeros({p}, torch::kDouble);
          all[rank] = peak;
          all = all.to(device);
          world->all_reduce(all)->synchronize();
          all = all.cpu();
          for (int r = 0; r < p; ++r) row.peak_act_mib[static_cast<std::size_t>(r)] = all[r].item<double>();
        }
        row.step_ms = dtrain::bench::median(steps);
        row.measured = dtrain::bench::median(measured);
        row.theory = dtrain::pp::theory_bubble(kind, po.shape);
        // Mean action times over every rank (per virtual stage), then the simulated bubble.
        auto mean_ms = [&](const std::string& op) {
          const auto& v_us = action_us[op];
          double sum = 0;
          for (double x : v_us) sum += x;
          const double total = all_reduce(sum, dtrain::ReduceOp::kSum);
          const double count = all_reduce(static_cast<double>(v_us.size()), dtrain::ReduceOp::kSum);
          return count > 0 ? total / count / 1e3 : 0.0;
        };
        row.f_ms = mean_ms("F"), row.b_ms = mean_ms("B"), row.bi_ms = mean_ms("Bi"), row.w_ms = mean_ms("W");
        dtrain::pp::ActionCosts costs;
        costs.forward = row.f_ms;
        costs.backward = row.b_ms > 0 ? row.b_ms : row.bi_ms + row.w_ms;
        costs.backward_input = row.bi_ms > 0 ? row.bi_ms : row.b_ms / 2;
        costs.backward_weight = row.w_ms > 0 ? row.w_ms : row.b_ms / 2;
        row.simulated = dtrain::pp::simulate(runtime.schedule(), po.shape, costs).bubble;
        rows.push_back(row);
      }
    }

    if (rank == 0) {
      std::printf("# pp_bench: %d stage(s), %lld MLP blocks of d %lld per rank, micro-batch %lld x %lld "
                  "tokens, %s, median of %lld steps\n",
                  p, static_cast<long long>(o.blocks), static_cast<long long>(o.d_model),
                  static_cast<long long>(o.micro), static_cast<long long>(o.seq),
                  dtrain::train::device_name(device).c_str(), static_cast<long long>(o.steps));
      std::printf("%-12s %3s %3s %9s %9s %9s %9s %8s %7s %7s %7s %7s %14s\n", "schedule", "m", "v", "step_ms",
                  "measured", "theory", "sim", "vs_thry", "F_ms", "B_ms", "Bi_ms", "W_ms", "act_MiB r0/last");
      dtrain::bench::JsonLines json(o.json);
      for (const auto& r : rows) {
        std::printf("%-12s %3lld %3d %9.1f %9.4f %9.4f %9.4f %8.3f %7.2f %7.2f %7.2f %7.2f %6.1f/%-6.1f\n",
                    r.schedule.c_str(), static_cast<long long>(r.m), r.v, r.step_ms, r.measured, r.theory,
                    r.simulated, r.theory > 0 ? r.measured / r.theory : 0.0, r.f_ms, r.b_ms, r.bi_ms, r.w_ms,
                    r.peak_act_mib.front(), r.peak_act_mib.back());
        nlohmann::json j = {{"bench", "pp_bench"}, {"schedule", r.schedule}, {"pp", p}, {"microbatches", r.m},
                            {"virtual_stages", r.v}, {"bubble_measured", r.measured},
                            {"bubble_theory", r.theory}, {"bubble_sim", r.simulated}, {"step_ms", r.step_ms},
                            {"forward_ms", r.f_ms}, {"backward_ms", r.b_ms}, {"backward_input_ms", r.bi_ms},
                            {"backward_weight_ms", r.w_ms}, {"peak_act_mib", r.peak_act_mib},
                            {"d_model", o.d_model}, {"seq", o.seq}, {"micro", o.micro}, {"blocks", o.blocks},
                            {"device", dtrain::train::device_name(device)}};
        json.line(j);
      }
    }
  } catch (const std::exception& e) {
    return dtrain::bench::fail("pp_bench", e, runtime_holder.get());
  }
  return 0;
}
