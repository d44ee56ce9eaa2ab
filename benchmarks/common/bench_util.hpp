// What the benchmark programs share: the median of timings, the largest of a figure over
// the ranks, and a synthetic token shard (random ids; contents do not change timing) for
// runs through the Trainer.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/data/token_shard.hpp"

namespace dtrain::bench {

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

}  // namespace dtrain::bench
