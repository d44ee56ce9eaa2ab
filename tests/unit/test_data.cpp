// Token shards (write/read round trip, every header error), the dataset's samples, the
// distributed sampler (disjoint ranks, union = single-process batch, resumable) and the
// byte tokenizer.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <sys/stat.h>
#include <unistd.h>
#include <fstream>
#include <numeric>
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

TEST(DistributedSampler, RanksAreDisjointAndTogetherFormTheSingleProcessBatch) {
  const std::int64_t n = 103, global = 12;
  for (int dp : {1, 2, 3, 4}) {
    DistributedSampler single(n, global, 0, 1, 42);
    std::vector<DistributedSampler> ranks;
    for (int r = 0; r < dp; ++r) ranks.emplace_back(n, global, r, dp, 42);
    for (std::int64_t step = 0; step < 3 * single.steps_per_epoch() + 2; ++step) {
      std::vector<std::int64_t> joined;
      for (const auto& s : ranks) {
        const auto idx = s.indices(step);
        EXPECT_EQ(static_cast<std::int64_t>(idx.size()), global / dp);
        joined.insert(joined.end(), idx.begin(), idx.end());
      }
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
