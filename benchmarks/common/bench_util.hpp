// What the benchmark programs share: the median of timings, the largest of a figure over
// the ranks, a synthetic token shard (random ids; contents do not change timing) for runs
// through the Trainer, their JSON lines, and the exit of a benchmark that caught an error.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/comm/runtime.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/data/token_shard.hpp"

namespace dtrain::bench {

// A benchmark's JSON lines: each printed to stdout after the table and, with a --json path,
// appended to that file.
class JsonLines {
 public:
  explicit JsonLines(const std::string& path) {
    if (!path.empty()) file_.open(path, std::ios::app);
  }
  void line(const nlohmann::json& j) {
    const auto text = j.dump();
    std::printf("%s\n", text.c_str());
    if (file_.is_open()) file_ << text << '\n';
  }

 private:
  std::ofstream file_;
};

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The largest v over the ranks of world (a collective), through a tensor on `device`.
inline double max_over_ranks(const CommPtr& world, c10::Device device, double v) {
  auto t = torch::full({1}, v, torch::kDouble).to(device);
  world->all_reduce(t, {ReduceOp::kMax})->synchronize();
  return t.cpu().item<double>();
}

// Writes `count` random token ids below vocab_size (a fixed seed) as one shard in dir
// (created); returns the glob that matches it, for TrainOptions::train_data.
inline std::string write_synthetic_shard(const std::string& dir, std::int64_t count,
                                         std::int64_t vocab_size) {
  fs::make_directories(dir);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto t = torch::randint(0, vocab_size, {count}, gen, torch::kInt);
  std::vector<std::uint16_t> tokens(static_cast<std::size_t>(count));
  auto acc = t.accessor<int, 1>();
  for (std::int64_t i = 0; i < count; ++i) tokens[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(acc[i]);
  data::write_token_shard(dir + "/bench_train_000000.bin", tokens);
  return dir + "/bench_train_*.bin";
}

// The exit code of an error a benchmark caught, printed under its name: 2 for bad input
// (InvalidArgument, which every rank raises alike), else 1, ending the whole job (peers
// may be inside a collective with this rank). runtime: null before it exists.
inline int fail(const char* bench, const std::exception& e, Runtime* runtime) {
  std::fprintf(stderr, "%s: error: %s\n", bench, e.what());
  if (dynamic_cast<const InvalidArgument*>(&e) != nullptr) return 2;
  if (runtime != nullptr && runtime->size() > 1) runtime->abort(1);
  return 1;
}

}  // namespace dtrain::bench
