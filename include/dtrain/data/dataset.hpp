// TokenDataset: many shards seen as fixed-length samples (seq_len inputs + the next token
// as targets), and DistributedSampler: which samples each data-parallel rank reads at
// each step, a pure function of (seed, step) so that a resumed run continues exactly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/data/token_shard.hpp"

namespace dtrain::data {

struct Batch {
  at::Tensor inputs;   // [rows, seq_len] int64
  at::Tensor targets;  // [rows, seq_len] int64, inputs shifted by one token
};

// Sample i covers tokens [i*seq_len, i*seq_len + seq_len + 1) of one shard (samples never
// cross shards); shards are taken in sorted path order.
class TokenDataset {
 public:
  // Raises InvalidArgument when no shard matches, a shard is malformed, or no shard holds
  // even one sample of seq_len + 1 tokens.
  TokenDataset(const std::string& pattern, std::int64_t seq_len);

  std::int64_t seq_len() const { return seq_len_; }
  std::int64_t num_samples() const { return offsets_.back(); }
  std::int64_t num_tokens() const;
  std::size_t num_shards() const { return shards_.size(); }
  // Largest token id over all shards (scans once).
  int max_token() const;
  // Rows of the batch, one per sample index, in order.
  Batch batch(const std::vector<std::int64_t>& samples) const;

 private:
  std::int64_t seq_len_;
  std::vector<TokenShard> shards_;
  std::vector<std::int64_t> offsets_;  // first global sample of each shard; back() = total
};

// Each step takes `global_batch` samples of an epoch's permutation (a seeded shuffle of
// all samples, new each epoch; the incomplete tail of an epoch is dropped). Rank r of
// dp_size gets the r-th contiguous slice of global_batch / dp_size samples, so ranks read
// disjoint samples and together read exactly the single-process batch.
class DistributedSampler {
 public:
  // Raises InvalidArgument if global_batch is not divisible by dp_size, is < 1, or
  // exceeds the number of samples.
  DistributedSampler(std::int64_t num_samples, std::int64_t global_batch, int dp_rank,
                     int dp_size, std::uint64_t seed, bool shuffle = true);

  std::int64_t steps_per_epoch() const { return num_samples_ / global_batch_; }
  std::int64_t local_batch() const { return global_batch_ / dp_size_; }
  // This rank's sample indices for global step `step` (epoch = step / steps_per_epoch).
  std::vector<std::int64_t> indices(std::int64_t step) const;

 private:
  const std::vector<std::int64_t>& permutation(std::int64_t epoch) const;

  std::int64_t num_samples_, global_batch_;
  int dp_rank_, dp_size_;
  std::uint64_t seed_;
  bool shuffle_;
  mutable std::int64_t cached_epoch_ = -1;
  mutable std::vector<std::int64_t> cached_perm_;
};

// Byte-level tokenizer: vocabulary 256, token = byte value.
struct ByteTokenizer {
  static constexpr int kVocabSize = 256;
  static std::vector<std::uint16_t> encode(const std::string& text);
  static std::string decode(const std::vector<std::uint16_t>& tokens);
};

}  // namespace dtrain::data
