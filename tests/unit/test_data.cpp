// Token shards (write/read round trip, every header error), the dataset's samples, the
// distributed sampler (disjoint ranks, union = single-process batch, resumable), data
// blends (parsing, components, each batch's shares, each component's epochs) and the byte
// tokenizer.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <sys/stat.h>
#include <unistd.h>
#include <fstream>
#include <numeric>
#include <map>
#include <set>

#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/data/dataset.hpp"

namespace dtrain::data {
namespace {

std::int64_t file_size(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 ? st.st_size : -1;
}

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/dtrain_data_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::make_directories(dir_);
  }
  void TearDown() override { fs::remove_tree(dir_); }
  std::string path(const std::string& name) const { return fs::join(dir_, name); }

  std::string error_of(const std::string& p) {
    try {
      TokenShard s(p);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  }
  // Raw file with a given header and payload size.
  void write_raw(const std::string& p, std::int32_t magic, std::int32_t version,
                 std::int32_t count, std::size_t payload_tokens) {
    std::vector<std::int32_t> header(kShardHeaderInts, 0);
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    std::vector<std::uint16_t> payload(payload_tokens, 7);
    out.write(reinterpret_cast<const char*>(payload.data()), payload.size() * 2);
  }

  std::string dir_;
};

std::vector<std::uint16_t> iota_tokens(std::size_t n, std::uint16_t start = 0) {
  std::vector<std::uint16_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST_F(DataTest, ShardRoundTripAndLayoutMatchesLlmc) {
  const auto tokens = iota_tokens(1000, 3);
  write_token_shard(path("a.bin"), tokens);
  EXPECT_EQ(file_size(path("a.bin")), 256 * 4 + 1000 * 2);
  EXPECT_FALSE(fs::exists(path("a.bin.tmp")));
  TokenShard s(path("a.bin"));
  ASSERT_EQ(s.size(), 1000);
  EXPECT_TRUE(std::equal(tokens.begin(), tokens.end(), s.tokens()));
  EXPECT_EQ(s.max_token(), 1002);
  TokenShard moved(std::move(s));
  EXPECT_EQ(moved.tokens()[999], 1002);
}

TEST_F(DataTest, MalformedShardsAreNamedWithTheProblem) {
  EXPECT_NE(error_of(path("missing.bin")).find("cannot be opened"), std::string::npos);
  write_raw(path("magic.bin"), 12345, 1, 4, 4);
  EXPECT_NE(error_of(path("magic.bin")).find("has magic 12345; expected 20240520"), std::string::npos);
  write_raw(path("version.bin"), kShardMagic, 2, 4, 4);
  EXPECT_NE(error_of(path("version.bin")).find("has version 2; supported: 1"), std::string::npos);
  write_raw(path("short.bin"), kShardMagic, 1, 10, 4);
  EXPECT_NE(error_of(path("short.bin")).find("declares 10 tokens"), std::string::npos);
  std::ofstream(path("tiny.bin")) << "abc";
  EXPECT_NE(error_of(path("tiny.bin")).find("less than its 1024-byte header"), std::string::npos);
  try {
    glob_shards(path("nothing_*.bin"));
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no token shards match"), std::string::npos);
  }
}

TEST_F(DataTest, DatasetSamplesAreShiftedWindowsWithinShards) {
  write_token_shard(path("d_000.bin"), iota_tokens(25, 0));     // (25-1)/8 = 3 samples
  write_token_shard(path("d_001.bin"), iota_tokens(17, 100));   // (17-1)/8 = 2 samples
  write_token_shard(path("d_002.bin"), iota_tokens(5, 200));    // too short: 0 samples
  TokenDataset ds(path("d_*.bin"), 8);
  EXPECT_EQ(ds.num_shards(), 3u);
  EXPECT_EQ(ds.num_samples(), 5);
  EXPECT_EQ(ds.num_tokens(), 47);
  EXPECT_EQ(ds.max_token(), 204);
  auto b = ds.batch({0, 2, 3, 4});
  ASSERT_EQ(b.inputs.sizes(), (std::vector<std::int64_t>{4, 8}));
  EXPECT_EQ(b.inputs[0][0].item<std::int64_t>(), 0);
  EXPECT_EQ(b.inputs[1][0].item<std::int64_t>(), 16);
  EXPECT_EQ(b.targets[1][7].item<std::int64_t>(), 24);  // last token of shard 0
  EXPECT_EQ(b.inputs[2][0].item<std::int64_t>(), 100);  // sample 3 = first of shard 1
  EXPECT_EQ(b.inputs[3][0].item<std::int64_t>(), 108);
  EXPECT_TRUE(at::equal(b.targets.slice(1, 0, 7), b.inputs.slice(1, 1, 8)));
  EXPECT_THROW(ds.batch({5}), InvalidArgument);
  EXPECT_THROW(TokenDataset(path("d_002.bin"), 8), InvalidArgument);
}

// The ranks' samplers' indices for a step, in rank order (each holding `local`).
template <typename S>
std::vector<std::int64_t> joined_indices(const std::vector<S>& ranks, std::int64_t step, std::int64_t local) {
  std::vector<std::int64_t> joined;
  for (const auto& s : ranks) {
    const auto idx = s.indices(step);
    EXPECT_EQ(static_cast<std::int64_t>(idx.size()), local);
    joined.insert(joined.end(), idx.begin(), idx.end());
  }
  return joined;
}

TEST(DistributedSampler, RanksAreDisjointAndTogetherFormTheSingleProcessBatch) {
  const std::int64_t n = 103, global = 12;
  for (int dp : {1, 2, 3, 4}) {
    DistributedSampler single(n, global, 0, 1, 42);
    std::vector<DistributedSampler> ranks;
    for (int r = 0; r < dp; ++r) ranks.emplace_back(n, global, r, dp, 42);
    for (std::int64_t step = 0; step < 3 * single.steps_per_epoch() + 2; ++step) {
      const auto joined = joined_indices(ranks, step, global / dp);
      EXPECT_EQ(joined, single.indices(step)) << "dp " << dp << " step " << step;
      EXPECT_EQ(std::set<std::int64_t>(joined.begin(), joined.end()).size(), joined.size());
    }
  }
}

TEST(DistributedSampler, EpochsArePermutationsAndResumeExactly) {
  DistributedSampler s(50, 10, 0, 1, 7);
  ASSERT_EQ(s.steps_per_epoch(), 5);
  std::set<std::int64_t> epoch0, epoch1;
  std::vector<std::int64_t> first_epoch_order;
  for (int step = 0; step < 5; ++step) {
    for (auto i : s.indices(step)) {
      epoch0.insert(i);
      first_epoch_order.push_back(i);
    }
  }
  for (int step = 5; step < 10; ++step) {
    for (auto i : s.indices(step)) epoch1.insert(i);
  }
  EXPECT_EQ(epoch0.size(), 50u);
  EXPECT_EQ(epoch1.size(), 50u);
  EXPECT_NE(s.indices(0), s.indices(5)) << "each epoch has its own order";
  // A fresh sampler (a resumed run) jumping to step 7 sees what the first one saw.
  DistributedSampler resumed(50, 10, 0, 1, 7);
  EXPECT_EQ(resumed.indices(7), s.indices(7));
  EXPECT_EQ(resumed.indices(2), s.indices(2));
  EXPECT_NE(DistributedSampler(50, 10, 0, 1, 8).indices(0), s.indices(0)) << "seed matters";
  DistributedSampler ordered(50, 10, 0, 1, 7, /*shuffle=*/false);
  EXPECT_EQ(ordered.indices(1), (std::vector<std::int64_t>{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}));
}

TEST(DistributedSampler, BadBatchesAreNamed) {
  try {
    DistributedSampler(100, 10, 0, 4, 1);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("global batch 10 sequences is not divisible by the data-parallel size 4"),
              std::string::npos);
  }
  EXPECT_THROW(DistributedSampler(5, 8, 0, 1, 1), InvalidArgument);
  EXPECT_THROW(DistributedSampler(5, 1, 2, 2, 1), InvalidArgument);
}

TEST(Blend, ParsesOneGlobOrWeightedPairs) {
  auto one = parse_blend("data/web_*.bin", "--train-data");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].pattern, "data/web_*.bin");
  EXPECT_EQ(one[0].weight, 1.0);
  one = parse_blend("my data/web_*.bin", "--train-data");  // not a number first: one glob
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].pattern, "my data/web_*.bin");
  EXPECT_FALSE(is_blend("my data/web_*.bin"));
  EXPECT_FALSE(is_blend("0.5"));
  for (const char* b : {"0.5 a.bin", "1 a.bin 2 b.bin", "0.5 a.bin 0.5"}) EXPECT_TRUE(is_blend(b)) << b;
  const auto two = parse_blend("  3 web_*.bin\t1  code_*.bin ", "--train-data");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].pattern, "web_*.bin");
  EXPECT_DOUBLE_EQ(two[0].weight, 0.75);
  EXPECT_EQ(two[1].pattern, "code_*.bin");
  EXPECT_DOUBLE_EQ(two[1].weight, 0.25);
  auto error = [](const std::string& value) {
    try {
      parse_blend(value, "--train-data");
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error("0.7 a.bin 0.3").find("--train-data '0.7 a.bin 0.3' is not a blend: 3 words; allowed: one glob, "
                                        "or pairs of WEIGHT GLOB"),
            std::string::npos);
  for (const char* w : {"0", "-1", "inf", "nan", "x"}) {
    const std::string value = std::string("1 a.bin ") + w + " b.bin";
    EXPECT_NE(error(value).find("--train-data '" + value + "': weight '" + w +
                                "' of 'b.bin' is not allowed; allowed: a finite number > 0"),
              std::string::npos)
        << error(value);
  }
}

TEST_F(DataTest, ComponentsAreLaidEndToEnd) {
  write_token_shard(path("a_000.bin"), iota_tokens(25, 0));    // 3 samples of 8
  write_token_shard(path("a_001.bin"), iota_tokens(17, 100));  // 2
  write_token_shard(path("b_000.bin"), iota_tokens(33, 300));  // 4
  TokenDataset ds(std::vector<std::string>{path("b_*.bin"), path("a_*.bin")}, 8);
  ASSERT_EQ(ds.num_components(), 2u);
  EXPECT_EQ(ds.num_samples(), 9);
  EXPECT_EQ(ds.component_begin(0), 0);
  EXPECT_EQ(ds.component_samples(0), 4);
  EXPECT_EQ(ds.component_begin(1), 4);
  EXPECT_EQ(ds.component_samples(1), 5);
  const TokenDataset a(path("a_*.bin"), 8);
  EXPECT_EQ(a.num_components(), 1u);
  for (std::int64_t i = 0; i < 5; ++i) {
    EXPECT_TRUE(at::equal(ds.batch({4 + i}).inputs, a.batch({i}).inputs)) << i;
  }
  EXPECT_EQ(ds.batch({3}).inputs[0][0].item<std::int64_t>(), 324);
  write_token_shard(path("c_000.bin"), iota_tokens(5, 0));  // no sample
  try {
    TokenDataset(std::vector<std::string>{path("a_*.bin"), path("c_*.bin")}, 8);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("c_*.bin' hold 5 tokens: not one sample of sequence length 8"),
              std::string::npos)
        << e.what();
  }
}

class BlendTest : public DataTest {
 protected:
  // Components of 40, 9 and 25 samples of 8 tokens; sample s's first token tells its
  // component (thousands) and its index in it.
  void SetUp() override {
    DataTest::SetUp();
    sizes_ = {40, 9, 25};
    std::vector<std::string> patterns;
    for (std::size_t c = 0; c < sizes_.size(); ++c) {
      std::vector<std::uint16_t> t(static_cast<std::size_t>(sizes_[c] * 8 + 1));
      for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::uint16_t>(1000 * c + i / 8);
      const auto p = path("c" + std::to_string(c) + "_000.bin");
      write_token_shard(p, t);
      patterns.push_back(p);
    }
    data_ = std::make_unique<TokenDataset>(patterns, 8);
  }
  std::vector<std::int64_t> sizes_;
  std::unique_ptr<TokenDataset> data_;
};

// Every window of positions holds each component's share within 2 samples (within 1 from
// position 0), whatever the weights; shares are the weights rounded in kPeriod.
TEST_F(BlendTest, EveryWindowHoldsEachComponentsShare) {
  const std::int64_t P = BlendedSampler::kPeriod;
  for (const std::vector<double>& weights :
       {std::vector<double>{0.5, 0.2, 0.3}, {1, 1, 1}, {1, 3, 3}, {0.98, 0.0101, 0.0099}}) {
    const BlendedSampler s(*data_, weights, 10, 0, 1, 3);
    std::int64_t total = 0;
    for (std::size_t c = 0; c < 3; ++c) {
      total += s.period_share(c);
      EXPECT_NEAR(static_cast<double>(s.period_share(c)), weights[c] / (weights[0] + weights[1] + weights[2]) * P, 1.0);
    }
    EXPECT_EQ(total, P);
    std::vector<std::int64_t> count(3, 0);
    std::vector<std::vector<std::int64_t>> prefix(3);  // prefix[c][p]: c's positions in [0, p)
    for (auto& v : prefix) v.push_back(0);
    for (std::int64_t p = 0; p < 2 * P + 37; ++p) {
      const auto [c, sample] = s.sample_at(p);
      ASSERT_LT(c, 3u);
      EXPECT_GE(sample, data_->component_begin(c));
      EXPECT_LT(sample, data_->component_begin(c) + data_->component_samples(c));
      ++count[c];
      for (std::size_t d = 0; d < 3; ++d) {
        prefix[d].push_back(count[d]);
        const double owed = static_cast<double>(s.period_share(d)) * static_cast<double>(p + 1) / P;
        ASSERT_LT(std::abs(static_cast<double>(count[d]) - owed), 1.0) << "component " << d << " position " << p;
      }
    }
    for (std::int64_t begin : {0, 5, 1234, 9995}) {
      for (std::int64_t len : {10, 64, 1000}) {
        for (std::size_t d = 0; d < 3; ++d) {
          const double got = static_cast<double>(prefix[d][begin + len] - prefix[d][begin]);
          EXPECT_LT(std::abs(got - static_cast<double>(s.period_share(d)) * len / P), 2.0);
        }
      }
    }
  }
  // Largest remainders: thirds of 10000 are 3334, 3333, 3333; 1:3:3 is 1428.6, 4285.7, 4285.7.
  const BlendedSampler thirds(*data_, {1, 1, 1}, 10, 0, 1, 3);
  EXPECT_EQ(thirds.period_share(0), 3334);
  EXPECT_EQ(thirds.period_share(1), 3333);
  const BlendedSampler sevenths(*data_, {1, 3, 3}, 10, 0, 1, 3);
  EXPECT_EQ(sevenths.period_share(0), 1428);
  EXPECT_EQ(sevenths.period_share(1), 4286);
  EXPECT_EQ(sevenths.period_share(2), 4286);
}

// A component is read in shuffles of all its samples, a new one each time it is exhausted
// (the small component of a large weight repeats; each of its epochs is a permutation).
TEST_F(BlendTest, EachComponentIsReadInShuffledEpochs) {
  const BlendedSampler s(*data_, {0.2, 0.5, 0.3}, 10, 0, 1, 3);
  std::vector<std::vector<std::int64_t>> reads(3);
  for (std::int64_t step = 0; step < 40; ++step) {
    for (auto i : s.indices(step)) {
      const auto first = data_->batch({i}).inputs[0][0].item<std::int64_t>();
      reads[static_cast<std::size_t>(first / 1000)].push_back(first % 1000);
    }
  }
  for (std::size_t c = 0; c < 3; ++c) {
    const auto n = static_cast<std::size_t>(sizes_[c]);
    ASSERT_GE(reads[c].size(), 2 * n) << c;
    std::vector<std::int64_t> e0(reads[c].begin(), reads[c].begin() + n), e1(reads[c].begin() + n, reads[c].begin() + 2 * n);
    EXPECT_NE(e0, e1) << "each epoch has its own order (component " << c << ")";
    std::sort(e0.begin(), e0.end());
    std::sort(e1.begin(), e1.end());
    std::vector<std::int64_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(e0, all) << c;
    EXPECT_EQ(e1, all) << c;
  }
  // Over three periods of positions, every component's reads are whole epochs, each a
  // permutation of its samples (the stream goes on across the period's end).
  std::vector<std::vector<std::int64_t>> stream(3);
  for (std::int64_t p = 0; p < 3 * BlendedSampler::kPeriod; ++p) {
    const auto [c, sample] = s.sample_at(p);
    stream[c].push_back(sample - data_->component_begin(c));
  }
  for (std::size_t c = 0; c < 3; ++c) {
    const auto n = static_cast<std::size_t>(sizes_[c]);
    std::vector<std::int64_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    for (std::size_t e = 0; (e + 1) * n <= stream[c].size(); ++e) {
      std::vector<std::int64_t> epoch(stream[c].begin() + e * n, stream[c].begin() + (e + 1) * n);
      std::sort(epoch.begin(), epoch.end());
      ASSERT_EQ(epoch, all) << "component " << c << " epoch " << e;
    }
  }
  // Component 1 (9 samples, half of every batch) is exhausted first: 18 positions.
  EXPECT_EQ(s.steps_per_epoch(), 1);
  EXPECT_EQ(BlendedSampler(*data_, {0.8, 0.1, 0.1}, 10, 0, 1, 3).steps_per_epoch(), 5);  // 40 / 0.8 = 50 positions
}

TEST_F(BlendTest, RanksFormTheSingleProcessBatchAndAFreshSamplerResumes) {
  const std::int64_t global = 12;
  const BlendedSampler single(*data_, {0.5, 0.2, 0.3}, global, 0, 1, 11);
  for (int dp : {1, 2, 3, 4}) {
    std::vector<BlendedSampler> ranks;
    for (int r = 0; r < dp; ++r) ranks.emplace_back(*data_, std::vector<double>{0.5, 0.2, 0.3}, global, r, dp, 11);
    for (std::int64_t step = 0; step < 30; ++step) {
      EXPECT_EQ(joined_indices(ranks, step, global / dp), single.indices(step)) << "dp " << dp << " step " << step;
    }
  }
  // Out of order and fresh: the same steps.
  const BlendedSampler resumed(*data_, {0.5, 0.2, 0.3}, global, 0, 1, 11);
  for (std::int64_t step : {29, 3, 17, 0, 1000}) EXPECT_EQ(resumed.indices(step), single.indices(step)) << step;
  EXPECT_NE(BlendedSampler(*data_, {0.5, 0.2, 0.3}, global, 0, 1, 12).indices(0), single.indices(0)) << "seed";
  // Each step's 12 samples: 6, 2.4 and 3.6 of the components, within one.
  for (std::int64_t step = 0; step < 30; ++step) {
    std::map<std::int64_t, int> per;
    for (auto i : single.indices(step)) ++per[data_->batch({i}).inputs[0][0].item<std::int64_t>() / 1000];
    EXPECT_NEAR(per[0], 6, 1);
    EXPECT_NEAR(per[1], 2.4, 1);
    EXPECT_NEAR(per[2], 3.6, 1);
  }
}

TEST_F(BlendTest, BadInputIsNamed) {
  auto error = [&](const std::vector<double>& w, std::int64_t global, int dp) {
    try {
      BlendedSampler(*data_, w, global, 0, dp, 1);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error({1, 1}, 8, 1).find("2 blend weights for 3 components"), std::string::npos);
  EXPECT_NE(error({1, 0, 1}, 8, 1).find("blend weight 0 is not allowed; allowed: a finite number > 0"),
            std::string::npos);
  EXPECT_NE(error({1, 1e-5, 1}, 8, 1).find("blend weight 1e-05 (component 1) is under 1/10000 of the weights' sum"),
            std::string::npos)
      << error({1, 1e-5, 1}, 8, 1);
  EXPECT_NE(error({1, 1, 1}, 10, 4).find("global batch 10 sequences is not divisible by the data-parallel size 4"),
            std::string::npos);
}

TEST(ByteTokenizer, RoundTripsBytes) {
  const std::string text = "Hello, w\xC3\xB6rld\n\x01";
  const auto t = ByteTokenizer::encode(text);
  EXPECT_EQ(t.size(), text.size());
  EXPECT_EQ(t[8], 0xC3);
  EXPECT_EQ(ByteTokenizer::decode(t), text);
  EXPECT_THROW(ByteTokenizer::decode({65, 300}), InvalidArgument);
}

}  // namespace
}  // namespace dtrain::data
