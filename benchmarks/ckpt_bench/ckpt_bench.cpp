// ckpt_bench: what a checkpoint costs. A Trainer (one step taken, so AdamW's moments exist)
// saves synchronously and asynchronously and loads back; as the baseline of the same run,
// each rank writes (write + fsync) and reads back the same number of bytes as one plain
// sequential file in the same directory. Per mode: bytes per rank, save and load GB/s per
// rank (the slowest rank's time), the baseline's GB/s, and for async saves the time
// training paused (the host snapshot) and the time of a training step while the writer
// runs against a step without a save.
//
//   mpirun -np 2 build/benchmarks/ckpt_bench --dir /tmp/ckpt_bench --fsdp zero1
//   mpirun -np 4 build/benchmarks/ckpt_bench --d-model 768 --n-layer 12 --json ckpt.jsonl
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "common/bench_util.hpp"
#include "dtrain/dtrain.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double since_ms(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct Options {
  std::string backend = "auto", dir = "/tmp/dtrain_ckpt_bench", fsdp = "zero1", json;
  std::int64_t d_model = 512, n_layer = 8;
  int iters = 3;
};

// The slowest rank's value (what the job waits for).
double slowest(dtrain::Communicator& world, double v, c10::Device device) {
  auto t = torch::full({1}, v, torch::TensorOptions().dtype(torch::kDouble).device(device));
  world.all_reduce(t, {dtrain::ReduceOp::kMax})->wait();
  return t.cpu().item<double>();
}

// Plain sequential write (one buffer, fsync) and read of `bytes` in `path`: ms each.
std::pair<double, double> baseline(const std::string& path, std::int64_t bytes) {
  std::vector<char> buf(static_cast<std::size_t>(bytes), 7);
  auto t = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DTRAIN_CHECK(fd >= 0, "cannot create ", path);
  std::int64_t done = 0;
  while (done < bytes) {
    const auto n = ::write(fd, buf.data() + done, static_cast<std::size_t>(bytes - done));
    DTRAIN_CHECK(n > 0, "write to ", path, " failed");
    done += n;
  }
  DTRAIN_CHECK(::fsync(fd) == 0 && ::close(fd) == 0, "fsync/close of ", path, " failed");
  const double write_ms = since_ms(t);
  t = Clock::now();
  const int in = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  done = 0;
  while (done < bytes) {
    const auto n = ::pread(in, buf.data() + done, static_cast<std::size_t>(bytes - done), done);
    DTRAIN_CHECK(n > 0, "read of ", path, " failed");
    done += n;
  }
  ::close(in);
  const double read_ms = since_ms(t);
  ::unlink(path.c_str());
  return {write_ms, read_ms};
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dtrain;
  Options o;
  CLI::App app{"ckpt_bench: checkpoint save/load throughput against plain file I/O, and the async-save stall"};
  app.add_option("--backend", o.backend, "communication backend")->check(CLI::IsMember({"auto", "mpi", "nccl"}));
  app.add_option("--dir", o.dir, "checkpoint directory (the disk being measured)");
  app.add_option("--fsdp", o.fsdp, "sharding of the trainer: none, zero1, zero2, full");
  app.add_option("--d-model", o.d_model, "model width (GPT-2 family)");
  app.add_option("--n-layer", o.n_layer, "blocks");
  app.add_option("--iters", o.iters, "saves and loads timed per mode (median)");
  app.add_option("--json", o.json, "append JSON lines here (rank 0)");
  CLI11_PARSE(app, argc, argv);

  Runtime runtime(&argc, &argv, RuntimeOptions{o.backend});
  const auto device = runtime.device();
  auto world = runtime.world();
  const int rank = world->rank(), n = world->size();
  const auto data = bench::write_synthetic_shard(o.dir + "/data_" + std::to_string(rank), 1 << 16, 50257);

  auto cfg = models::GptConfig::preset("gpt2-124m");
  cfg.d_model = o.d_model, cfg.n_layer = o.n_layer, cfg.n_head = std::max<std::int64_t>(1, o.d_model / 64);
  cfg.n_kv_head = cfg.n_head, cfg.context = 128;
  train::TrainOptions t;
  t.train_data = data;
  t.seq_len = 64;
  t.global_batch = 2 * n;
  t.steps = 1000;
  t.progress = "off";
  t.fsdp = o.fsdp;
  auto ctx = std::make_shared<ParallelContext>(world, ParallelConfig{}, device);
  train::Trainer trainer(ctx, cfg, t);
  trainer.train_step();  // AdamW moments exist
  const std::string root = o.dir + "/ckpt";
  if (rank == 0) fs::remove_tree(root);
  world->barrier()->wait();

  struct Row {
    std::string mode;
    double bytes = 0, save_ms = 0, load_ms = 0, write_ms = 0, read_ms = 0, stall_ms = 0, step_ms = 0,
           step_async_ms = 0;
  };
  std::vector<Row> rows;
  for (const std::string mode : {"sync", "async"}) {
    Row row;
    row.mode = mode;
    std::vector<double> save, load, stall, step_plain, step_async;
    std::string dir;
    for (int i = 0; i < o.iters; ++i) {
      world->barrier()->wait();
      auto t0 = Clock::now();
      if (mode == "sync") {
        dir = trainer.save_checkpoint(root);
        save.push_back(slowest(*world, since_ms(t0), device));
      } else {
        // The save alone (snapshot, background write, commit), then a save with a training
        // step while the writer runs, and a step without one.
        trainer.save_checkpoint(root, /*async=*/true);
        stall.push_back(slowest(*world, since_ms(t0), device));
        dir = trainer.finish_save();
        save.push_back(slowest(*world, since_ms(t0), device));
        trainer.save_checkpoint(root, /*async=*/true);
        auto ts = Clock::now();
        trainer.train_step();
        step_async.push_back(slowest(*world, since_ms(ts), device));
        dir = trainer.finish_save();
        ts = Clock::now();
        trainer.train_step();
        step_plain.push_back(slowest(*world, since_ms(ts), device));
      }
      world->barrier()->wait();
      t0 = Clock::now();
      trainer.load_checkpoint(dir);
      load.push_back(slowest(*world, since_ms(t0), device));
    }
    const auto manifest = nlohmann::json::parse(checkpoint::verify(dir));
    char file[48];
    std::snprintf(file, sizeof(file), "rank_%05d.safetensors", rank);
    row.bytes = manifest["files"][file]["bytes"].get<double>();
    const auto [w, r] = baseline(o.dir + "/plain_" + std::to_string(rank) + ".bin", static_cast<std::int64_t>(row.bytes));
    row.write_ms = slowest(*world, w, device);
    row.read_ms = slowest(*world, r, device);
    row.save_ms = bench::median(save), row.load_ms = bench::median(load);
    row.stall_ms = bench::median(stall), row.step_ms = bench::median(step_plain), row.step_async_ms = bench::median(step_async);
    rows.push_back(row);
  }
  if (rank == 0) {
    auto gbps = [](double bytes, double ms) { return ms > 0 ? bytes / 1e9 / (ms / 1e3) : 0.0; };
    std::printf("# ckpt_bench: %d rank(s), gpt2 d_model %lld x %lld layers, --fsdp %s, device %s, dir %s\n", n,
                static_cast<long long>(o.d_model), static_cast<long long>(o.n_layer), o.fsdp.c_str(),
                device.str().c_str(), o.dir.c_str());
    std::printf("%-6s %10s %9s %9s %10s %10s %9s %9s %9s %9s %10s\n", "mode", "MiB/rank", "save ms", "load ms",
                "save GB/s", "load GB/s", "write GB/s", "read GB/s", "save/wr", "stall ms", "step+w ms");
    dtrain::bench::JsonLines json(o.json);
    for (const auto& r : rows) {
      const double save = gbps(r.bytes, r.save_ms), load = gbps(r.bytes, r.load_ms);
      const double write = gbps(r.bytes, r.write_ms), read = gbps(r.bytes, r.read_ms);
      std::printf("%-6s %10.1f %9.1f %9.1f %10.3f %10.3f %9.3f %9.3f %9.2f %9.1f %10s\n", r.mode.c_str(),
                  r.bytes / (1 << 20), r.save_ms, r.load_ms, save, load, write, read, write > 0 ? save / write : 0,
                  r.stall_ms, r.mode == "async" ? format("{} (vs {})", std::round(r.step_async_ms), std::round(r.step_ms)).c_str() : "-");
      nlohmann::json j = {{"bench", "ckpt_bench"}, {"mode", r.mode}, {"nranks", n}, {"bytes", r.bytes},
                          {"save_ms", r.save_ms}, {"load_ms", r.load_ms}, {"save_gbps", save}, {"load_gbps", load},
                          {"baseline_write_gbps", write}, {"baseline_read_gbps", read}, {"fsdp", o.fsdp},
                          {"device", device.str()}};
      if (r.mode == "async") {
        j["stall_ms"] = r.stall_ms;
        j["step_ms_during_write"] = r.step_async_ms;
        j["step_ms"] = r.step_ms;
      }
      json.line(j);
    }
    fs::remove_tree(root);
  }
  world->barrier()->wait();
  fs::remove_tree(o.dir + "/data_" + std::to_string(rank));
  return 0;
}
