// TokenDataset (samples over mmap'd shards), DistributedSampler, ByteTokenizer.
#include "dtrain/data/dataset.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "dtrain/core/error.hpp"

namespace dtrain::data {

// ---------------------------------------------------------------------------------------
// TokenDataset

TokenDataset::TokenDataset(const std::string& pattern, std::int64_t seq_len) : seq_len_(seq_len) {
  DTRAIN_CHECK_ARG(seq_len >= 1, "sequence length ", seq_len, " must be at least 1");
  offsets_.push_back(0);
  for (const auto& path : glob_shards(pattern)) {
    shards_.emplace_back(path);
    const std::int64_t n = shards_.back().size();
    offsets_.push_back(offsets_.back() + (n > seq_len ? (n - 1) / seq_len : 0));
  }
  DTRAIN_CHECK_ARG(num_samples() > 0, "token shards '", pattern, "' hold ", num_tokens(),
                   " tokens: not one sample of sequence length ", seq_len, " + 1 in any shard");
}

std::int64_t TokenDataset::num_tokens() const {
  std::int64_t n = 0;
  for (const auto& s : shards_) n += s.size();
  return n;
}

int TokenDataset::max_token() const {
  int m = 0;
  for (const auto& s : shards_) m = std::max<int>(m, s.max_token());
  return m;
}

Batch TokenDataset::batch(const std::vector<std::int64_t>& samples) const {
  const auto rows = static_cast<std::int64_t>(samples.size());
  at::Tensor window = at::empty({rows, seq_len_ + 1}, at::kLong);
  std::int64_t* out = window.data_ptr<std::int64_t>();
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t s = samples[r];
    DTRAIN_CHECK_ARG(s >= 0 && s < num_samples(), "sample ", s, " is out of range; allowed: 0..",
                     num_samples() - 1);
    const auto shard = std::upper_bound(offsets_.begin(), offsets_.end(), s) - offsets_.begin() - 1;
    const std::uint16_t* src = shards_[shard].tokens() + (s - offsets_[shard]) * seq_len_;
    std::copy(src, src + seq_len_ + 1, out + r * (seq_len_ + 1));
  }
  return {window.slice(1, 0, seq_len_).contiguous(), window.slice(1, 1, seq_len_ + 1).contiguous()};
}

// ---------------------------------------------------------------------------------------
// DistributedSampler

DistributedSampler::DistributedSampler(std::int64_t num_samples, std::int64_t global_batch,
                                       int dp_rank, int dp_size, std::uint64_t seed, bool shuffle)
    : num_samples_(num_samples),
      global_batch_(global_batch),
      dp_rank_(dp_rank),
      dp_size_(dp_size),
      seed_(seed),
      shuffle_(shuffle) {
  DTRAIN_CHECK_ARG(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "data-parallel rank ",
                   dp_rank, " of ", dp_size, " is invalid");
  DTRAIN_CHECK_ARG(global_batch >= 1 && global_batch % dp_size == 0, "global batch ",
                   global_batch, " sequences is not divisible by the data-parallel size ",
                   dp_size);
  DTRAIN_CHECK_ARG(global_batch <= num_samples, "global batch ", global_batch,
                   " sequences exceeds the ", num_samples, " samples of the dataset");
}

const std::vector<std::int64_t>& DistributedSampler::permutation(std::int64_t epoch) const {
  if (epoch != cached_epoch_) {
    cached_perm_.resize(num_samples_);
    std::iota(cached_perm_.begin(), cached_perm_.end(), 0);
    if (shuffle_) {
      // Our own Fisher-Yates over mt19937_64 (std::shuffle's algorithm is unspecified and
      // differs between standard libraries; this order must not).
      std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(epoch));
      for (std::int64_t i = num_samples_ - 1; i > 0; --i) {
        const auto j = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(i + 1));
        std::swap(cached_perm_[i], cached_perm_[j]);
      }
    }
    cached_epoch_ = epoch;
  }
  return cached_perm_;
}

std::vector<std::int64_t> DistributedSampler::indices(std::int64_t step) const {
  DTRAIN_CHECK_ARG(step >= 0, "step ", step, " must not be negative");
  const std::int64_t epoch = step / steps_per_epoch();
  const std::int64_t in_epoch = step % steps_per_epoch();
  const auto& perm = permutation(epoch);
  const std::int64_t begin = in_epoch * global_batch_ + dp_rank_ * local_batch();
  return {perm.begin() + begin, perm.begin() + begin + local_batch()};
}

// ---------------------------------------------------------------------------------------
// ByteTokenizer

std::vector<std::uint16_t> ByteTokenizer::encode(const std::string& text) {
  std::vector<std::uint16_t> out(text.size());
  std::transform(text.begin(), text.end(), out.begin(),
                 [](char c) { return static_cast<std::uint16_t>(static_cast<unsigned char>(c)); });
  return out;
}

std::string ByteTokenizer::decode(const std::vector<std::uint16_t>& tokens) {
  std::string out(tokens.size(), '\0');
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    DTRAIN_CHECK_ARG(tokens[i] < kVocabSize, "token ", tokens[i], " at position ", i,
                     " is outside the byte vocabulary (0..255)");
    out[i] = static_cast<char>(tokens[i]);
  }
  return out;
}

}  // namespace dtrain::data
