// TokenDataset: many shards seen as fixed-length samples (seq_len inputs + the next token
// as targets), in one or several weighted components (a data blend); DistributedSampler
// and BlendedSampler: which samples each data-parallel rank reads at each step, a pure
// function of (seed, step) so that a resumed run continues exactly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/data/token_shard.hpp"

namespace dtrain::data {

struct Batch {
  at::Tensor inputs;   // [rows, seq_len] int64
  at::Tensor targets;  // [rows, seq_len] int64, inputs shifted by one token
};

// One weighted source of a data blend.
struct BlendComponent {
  double weight = 1;    // a share of the samples, relative to the other components'
  std::string pattern;  // glob of token shards
};

// A --train-data value: one glob, or Megatron's --data-path form "W1 GLOB1 W2 GLOB2 ..."
// (weights > 0, normalised to sum to 1; globs without spaces). A value whose first word
// is not a number is one glob, spaces and all. InvalidArgument names `option`.
std::vector<BlendComponent> parse_blend(const std::string& value, const std::string& option);
// True when value has the blend form parse_blend reads as WEIGHT GLOB pairs: two words or
// more, the first a number (well formed or not).
bool is_blend(const std::string& value);

// Sample i covers tokens [i*seq_len, i*seq_len + seq_len + 1) of one shard (samples never
// cross shards); shards are taken in sorted path order, each component's after the
// previous component's.
class TokenDataset {
 public:
  // Raises InvalidArgument when no shard matches, a shard is malformed, or no shard holds
  // even one sample of seq_len + 1 tokens (in any one component).
  TokenDataset(const std::string& pattern, std::int64_t seq_len);
  TokenDataset(const std::vector<std::string>& component_patterns, std::int64_t seq_len);

  std::int64_t seq_len() const { return seq_len_; }
  std::int64_t num_samples() const { return offsets_.back(); }
  std::int64_t num_tokens() const;
  std::size_t num_shards() const { return shards_.size(); }
  // Component c's samples are [component_begin(c), component_begin(c + 1)).
  std::size_t num_components() const { return component_begin_.size() - 1; }
  std::int64_t component_begin(std::size_t c) const { return component_begin_[c]; }
  std::int64_t component_samples(std::size_t c) const { return component_begin_[c + 1] - component_begin_[c]; }
  // Largest token id over all shards (scans once).
  int max_token() const;
  // Rows of the batch, one per sample index, in order.
  Batch batch(const std::vector<std::int64_t>& samples) const;

 private:
  std::int64_t seq_len_;
  std::vector<TokenShard> shards_;
  std::vector<std::int64_t> offsets_;  // first global sample of each shard; back() = total
  std::vector<std::int64_t> component_begin_;  // first global sample of each; back() = total
};

// Which samples each data-parallel rank reads at each step.
class Sampler {
 public:
  virtual ~Sampler() = default;
  // This rank's sample indices for global step `step`: its contiguous share of the
  // step's global batch, so that the ranks together read the single-process batch.
  virtual std::vector<std::int64_t> indices(std::int64_t step) const = 0;
  // Steps until some sample is read again.
  virtual std::int64_t steps_per_epoch() const = 0;
};

// The seeded shuffle of [0, n) for each epoch (Fisher-Yates over mt19937_64 seeded with
// seed and epoch: the same order with every standard library), the last `keep` kept
// (2 where one batch may span two epochs).
class SeededPermutations {
 public:
  SeededPermutations(std::int64_t n, std::uint64_t seed, bool shuffle = true, int keep = 1);
  const std::vector<std::int64_t>& operator()(std::int64_t epoch) const;

 private:
  std::int64_t n_;
  std::uint64_t seed_;
  bool shuffle_;
  mutable std::vector<std::int64_t> epochs_;
  mutable std::vector<std::vector<std::int64_t>> perms_;
  mutable std::size_t next_ = 0;
};

// Each step takes `global_batch` samples of an epoch's permutation (a seeded shuffle of
// all samples, new each epoch; the incomplete tail of an epoch is dropped). Rank r of
// dp_size gets the r-th contiguous slice of global_batch / dp_size samples, so ranks read
// disjoint samples and together read exactly the single-process batch.
class DistributedSampler final : public Sampler {
 public:
  // Raises InvalidArgument if global_batch is not divisible by dp_size, is < 1, or
  // exceeds the number of samples.
  DistributedSampler(std::int64_t num_samples, std::int64_t global_batch, int dp_rank,
                     int dp_size, std::uint64_t seed, bool shuffle = true);

  std::int64_t steps_per_epoch() const override { return num_samples_ / global_batch_; }
  std::int64_t local_batch() const { return global_batch_ / dp_size_; }
  // This rank's sample indices for global step `step` (epoch = step / steps_per_epoch).
  std::vector<std::int64_t> indices(std::int64_t step) const override;

 private:
  std::int64_t num_samples_, global_batch_;
  int dp_rank_, dp_size_;
  SeededPermutations perms_;
};

// A data blend: the global batch of every step takes its samples from the dataset's
// components in proportion to their weights, each component read in its own shuffled
// order (a new shuffle each time it is exhausted: a small component with a large weight
// repeats, a large one with a small weight is read in part). Positions p = 0, 1, 2, ... of
// an endless stream are dealt to the components by a fixed pattern of kPeriod positions
// (each weight rounded to a multiple of 1 / kPeriod, each position going to the component
// furthest behind its share, as Megatron's blended index does); step s reads positions
// [s * global_batch, (s + 1) * global_batch), so every prefix of the stream holds each
// component's share within one sample (any window: within two), and the order does not
// depend on --steps.
class BlendedSampler final : public Sampler {
 public:
  static constexpr std::int64_t kPeriod = 10000;
  // weights[c] for data's component c (normalised here). Raises InvalidArgument when the
  // counts do not match, a weight is not positive or rounds to 0 in kPeriod, or
  // global_batch is not divisible by dp_size.
  BlendedSampler(const TokenDataset& data, const std::vector<double>& weights, std::int64_t global_batch,
                 int dp_rank, int dp_size, std::uint64_t seed);

  std::vector<std::int64_t> indices(std::int64_t step) const override;
  // Steps until the component read fastest relative to its size is exhausted.
  std::int64_t steps_per_epoch() const override;
  // Positions of each period that go to component c (sums to kPeriod).
  std::int64_t period_share(std::size_t c) const { return share_[c]; }
  // The component and its (global) sample at stream position p.
  std::pair<std::size_t, std::int64_t> sample_at(std::int64_t p) const;

 private:
  std::int64_t global_batch_;
  int dp_rank_, dp_size_;
  std::vector<std::int64_t> begin_, size_, share_;
  std::vector<std::uint16_t> pattern_;   // component of each position of a period
  std::vector<std::int64_t> rank_;       // earlier positions of the same component in it
  std::vector<SeededPermutations> perms_;  // per component
};

// Byte-level tokenizer: vocabulary 256, token = byte value.
struct ByteTokenizer {
  static constexpr int kVocabSize = 256;
  static std::vector<std::uint16_t> encode(const std::string& text);
  static std::string decode(const std::vector<std::uint16_t>& tokens);
};

}  // namespace dtrain::data
