// TokenDataset (samples over mmap'd shards), data blends, the samplers, ByteTokenizer.
#include "dtrain/data/dataset.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>

#include "dtrain/core/error.hpp"

namespace dtrain::data {

// ---------------------------------------------------------------------------------------
// TokenDataset

namespace {

std::vector<std::string> words_of(const std::string& value) {
  std::istringstream in(value);
  return {std::istream_iterator<std::string>(in), std::istream_iterator<std::string>()};
}

// True when w is a whole number (strtod's form); its value in out.
bool number(const std::string& w, double& out) {
  char* end = nullptr;
  out = std::strtod(w.c_str(), &end);
  return end != w.c_str() && *end == '\0';
}

}  // namespace

bool is_blend(const std::string& value) {
  const auto words = words_of(value);
  double first = 0;
  return words.size() >= 2 && number(words[0], first);
}

std::vector<BlendComponent> parse_blend(const std::string& value, const std::string& option) {
  if (!is_blend(value)) return {{1.0, value}};
  const auto words = words_of(value);
  DTRAIN_CHECK_ARG(words.size() % 2 == 0, option, " '", value, "' is not a blend: ", words.size(),
                   " words; allowed: one glob, or pairs of WEIGHT GLOB");
  std::vector<BlendComponent> out;
  double total = 0;
  for (std::size_t i = 0; i < words.size(); i += 2) {
    double w = 0;
    DTRAIN_CHECK_ARG(number(words[i], w) && w > 0 && std::isfinite(w), option, " '", value, "': weight '", words[i],
                     "' of '", words[i + 1], "' is not allowed; allowed: a finite number > 0");
    out.push_back({w, words[i + 1]});
    total += w;
  }
  for (auto& c : out) c.weight /= total;
  return out;
}

TokenDataset::TokenDataset(const std::string& pattern, std::int64_t seq_len)
    : TokenDataset(std::vector<std::string>{pattern}, seq_len) {}

TokenDataset::TokenDataset(const std::vector<std::string>& component_patterns, std::int64_t seq_len)
    : seq_len_(seq_len) {
  DTRAIN_CHECK_ARG(seq_len >= 1, "sequence length ", seq_len, " must be at least 1");
  DTRAIN_CHECK_ARG(!component_patterns.empty(), "a dataset needs at least one glob of token shards");
  offsets_.push_back(0);
  for (const auto& pattern : component_patterns) {
    component_begin_.push_back(offsets_.back());
    std::int64_t tokens = 0;
    for (const auto& path : glob_shards(pattern)) {
      shards_.emplace_back(path);
      const std::int64_t n = shards_.back().size();
      tokens += n;
      offsets_.push_back(offsets_.back() + (n > seq_len ? (n - 1) / seq_len : 0));
    }
    DTRAIN_CHECK_ARG(offsets_.back() > component_begin_.back(), "token shards '", pattern, "' hold ", tokens,
                     " tokens: not one sample of sequence length ", seq_len, " + 1 in any shard");
  }
  component_begin_.push_back(offsets_.back());
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

SeededPermutations::SeededPermutations(std::int64_t n, std::uint64_t seed, bool shuffle, int keep)
    : n_(n), seed_(seed), shuffle_(shuffle), epochs_(static_cast<std::size_t>(std::max(1, keep)), -1),
      perms_(epochs_.size()) {}

const std::vector<std::int64_t>& SeededPermutations::operator()(std::int64_t epoch) const {
  for (std::size_t i = 0; i < epochs_.size(); ++i) {
    if (epochs_[i] == epoch) return perms_[i];
  }
  auto& perm = perms_[next_];
  epochs_[next_] = epoch;
  next_ = (next_ + 1) % epochs_.size();
  perm.resize(static_cast<std::size_t>(n_));
  std::iota(perm.begin(), perm.end(), 0);
  if (shuffle_) {
    // Our own Fisher-Yates over mt19937_64 (std::shuffle's algorithm is unspecified and
    // differs between standard libraries; this order must not).
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(epoch));
    for (std::int64_t i = n_ - 1; i > 0; --i) {
      const auto j = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(i + 1));
      std::swap(perm[i], perm[j]);
    }
  }
  return perm;
}

namespace {

void check_batch(std::int64_t global_batch, int dp_rank, int dp_size) {
  DTRAIN_CHECK_ARG(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "data-parallel rank ",
                   dp_rank, " of ", dp_size, " is invalid");
  DTRAIN_CHECK_ARG(global_batch >= 1 && global_batch % dp_size == 0, "global batch ",
                   global_batch, " sequences is not divisible by the data-parallel size ",
                   dp_size);
}

}  // namespace

DistributedSampler::DistributedSampler(std::int64_t num_samples, std::int64_t global_batch,
                                       int dp_rank, int dp_size, std::uint64_t seed, bool shuffle)
    : num_samples_(num_samples),
      global_batch_(global_batch),
      dp_rank_(dp_rank),
      dp_size_(dp_size),
      perms_(num_samples, seed, shuffle) {
  check_batch(global_batch, dp_rank, dp_size);
  DTRAIN_CHECK_ARG(global_batch <= num_samples, "global batch ", global_batch,
                   " sequences exceeds the ", num_samples, " samples of the dataset");
}

std::vector<std::int64_t> DistributedSampler::indices(std::int64_t step) const {
  DTRAIN_CHECK_ARG(step >= 0, "step ", step, " must not be negative");
  const std::int64_t epoch = step / steps_per_epoch();
  const std::int64_t in_epoch = step % steps_per_epoch();
  const auto& perm = perms_(epoch);
  const std::int64_t begin = in_epoch * global_batch_ + dp_rank_ * local_batch();
  return {perm.begin() + begin, perm.begin() + begin + local_batch()};
}

BlendedSampler::BlendedSampler(const TokenDataset& data, const std::vector<double>& weights,
                               std::int64_t global_batch, int dp_rank, int dp_size, std::uint64_t seed)
    : global_batch_(global_batch), dp_rank_(dp_rank), dp_size_(dp_size) {
  check_batch(global_batch, dp_rank, dp_size);
  const std::size_t n = data.num_components();
  DTRAIN_CHECK_ARG(weights.size() == n, weights.size(), " blend weights for ", n, " components");
  DTRAIN_CHECK_ARG(n <= 65535, "a blend of ", n, " components; allowed: at most 65535");
  double total = 0;
  for (double w : weights) {
    DTRAIN_CHECK_ARG(w > 0 && std::isfinite(w), "blend weight ", w, " is not allowed; allowed: a finite number > 0");
    total += w;
  }
  // Each component's positions per period: the largest-remainder rounding of its share.
  std::vector<std::pair<double, std::size_t>> remainders;
  std::int64_t dealt = 0;
  for (std::size_t c = 0; c < n; ++c) {
    const double exact = weights[c] / total * static_cast<double>(kPeriod);
    share_.push_back(static_cast<std::int64_t>(std::floor(exact)));
    dealt += share_.back();
    remainders.emplace_back(share_.back() - exact, c);  // most negative first: largest remainder
  }
  std::sort(remainders.begin(), remainders.end());
  for (std::int64_t i = 0; dealt < kPeriod; ++i, ++dealt) ++share_[remainders[static_cast<std::size_t>(i)].second];
  for (std::size_t c = 0; c < n; ++c) {
    DTRAIN_CHECK_ARG(share_[c] > 0, "blend weight ", weights[c], " (component ", c, ") is under 1/", kPeriod,
                     " of the weights' sum ", total, "; allowed: at least ", total / kPeriod);
    begin_.push_back(data.component_begin(c));
    size_.push_back(data.component_samples(c));
    // Each component's own shuffles, seeded apart from the others'.
    perms_.emplace_back(size_.back(), seed + 0xD1B54A32D192ED03ull * (c + 1), true, /*keep=*/2);
  }
  // Each position to the component furthest behind its share (ties: the first), exactly
  // share_[c] of them in the period.
  std::vector<std::int64_t> placed(n, 0);
  pattern_.resize(kPeriod);
  rank_.resize(kPeriod);
  for (std::int64_t i = 0; i < kPeriod; ++i) {
    std::size_t best = n;
    std::int64_t best_lag = 0;
    for (std::size_t c = 0; c < n; ++c) {
      if (placed[c] == share_[c]) continue;
      const std::int64_t lag = share_[c] * (i + 1) - placed[c] * kPeriod;  // kPeriod x positions owed
      if (best == n || lag > best_lag) best = c, best_lag = lag;
    }
    pattern_[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(best);
    rank_[static_cast<std::size_t>(i)] = placed[best]++;
  }
}

std::pair<std::size_t, std::int64_t> BlendedSampler::sample_at(std::int64_t p) const {
  const auto i = static_cast<std::size_t>(p % kPeriod);
  const std::size_t c = pattern_[i];
  const std::int64_t k = p / kPeriod * share_[c] + rank_[i];  // the component's k-th sample
  return {c, begin_[c] + perms_[c](k / size_[c])[static_cast<std::size_t>(k % size_[c])]};
}

std::vector<std::int64_t> BlendedSampler::indices(std::int64_t step) const {
  DTRAIN_CHECK_ARG(step >= 0, "step ", step, " must not be negative");
  const std::int64_t local = global_batch_ / dp_size_, first = step * global_batch_ + dp_rank_ * local;
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(local));
  for (std::int64_t p = first; p < first + local; ++p) out.push_back(sample_at(p).second);
  return out;
}

std::int64_t BlendedSampler::steps_per_epoch() const {
  std::int64_t positions = std::numeric_limits<std::int64_t>::max();
  for (std::size_t c = 0; c < share_.size(); ++c) positions = std::min(positions, size_[c] * kPeriod / share_[c]);
  return std::max<std::int64_t>(1, positions / global_batch_);
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
