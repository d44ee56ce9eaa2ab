// safetensors files: round trip of every supported dtype with metadata, the byte layout of
// the format (what Python's safetensors reads), ranged reads, the whole-file checksum, and
// the errors for truncated, corrupt, missing and unwritable files.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/errors.hpp"
#include "dtrain/checkpoint/directory.hpp"
#include "dtrain/checkpoint/safetensors.hpp"
#include "dtrain/checkpoint/sharded.hpp"
#include "dtrain/core/fs.hpp"

namespace dtrain::checkpoint {
namespace {

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/dtrain_ckpt_" + std::to_string(::getpid());
    fs::make_directories(dir_);
  }
  void TearDown() override { fs::remove_tree(dir_); }
  std::string path(const std::string& name) const { return fs::join(dir_, name); }
  static std::string bytes_of(const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  }
  static void write_bytes(const std::string& file, const std::string& bytes) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  }
  static std::string error_of(const std::function<void()>& f) {
    return testing::error_message<CheckpointError>(f);
  }
  std::string dir_;
};

TEST_F(SafetensorsTest, RoundTripsEveryDtypeWithMetadata) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"h.0.weight", torch::randn({3, 4}, gen)},
      {"bf16", torch::randn({5}, gen).to(torch::kBFloat16)},
      {"f16", torch::randn({2, 2}, gen).to(torch::kHalf)},
      {"f64", torch::randn({3}, gen, torch::kDouble)},
      {"i64", torch::arange(-3, 4, torch::kLong)},
      {"i32", torch::arange(7, torch::kInt)},
      {"u8", torch::arange(200, 210).to(torch::kByte)},
      {"bool", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(2.5)},
      {"empty", torch::zeros({0, 5})},
      {"strided", torch::randn({4, 6}, gen).t()},  // written contiguous
  };
  const auto hash = write_safetensors(path("a.safetensors"), tensors, {{"step", "12"}, {"format", "pt"}});
  SafetensorsReader r(path("a.safetensors"));
  std::vector<std::string> names;
  for (const auto& item : tensors) names.push_back(item.first);
  EXPECT_EQ(r.names(), names) << "file order is write order";
  for (const auto& [name, t] : tensors) {
    const auto got = r.read(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(got, t)) << name;
  }
  EXPECT_EQ(r.metadata().at("step"), "12");
  EXPECT_EQ(r.info("bf16").dtype, "BF16");
  EXPECT_EQ(r.checksum(), hash);
  EXPECT_EQ(checksum_text(hash).rfind("fnv1a64:", 0), 0u);
  EXPECT_EQ(checksum_text(hash).size(), 8u + 16u);
}

TEST_F(SafetensorsTest, BytesFollowTheFormat) {
  write_safetensors(path("b.safetensors"), {{"x", torch::tensor({1.0f, -2.0f})}}, {{"k", "v"}});
  const auto bytes = bytes_of(path("b.safetensors"));
  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "the data section is 8-byte aligned";
  ASSERT_EQ(bytes.size(), 8 + n + 8);
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["x"]["dtype"], "F32");
  EXPECT_EQ(header["x"]["shape"], nlohmann::json::array({2}));
  EXPECT_EQ(header["x"]["data_offsets"], nlohmann::json::array({0, 8}));
  EXPECT_EQ(header["__metadata__"]["k"], "v");
  float values[2];
  std::memcpy(values, bytes.data() + 8 + n, 8);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], -2.0f);
}

TEST_F(SafetensorsTest, RangeReadsReturnTheirElements) {
  const auto t = torch::arange(60, torch::kFloat).view({5, 12});
  write_safetensors(path("c.safetensors"), {{"pad", torch::ones({3})}, {"t", t}});
  SafetensorsReader r(path("c.safetensors"));
  EXPECT_TRUE(torch::equal(r.read_range("t", 17, 9), torch::arange(17, 26, torch::kFloat)));
  EXPECT_EQ(r.read_range("t", 60, 0).numel(), 0);
  try {
    r.read_range("t", 55, 6);
    ADD_FAILURE() << "a range past the end was read";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("elements [55, 61) are outside tensor 't' of 60 elements"), std::string::npos)
        << e.what();
  }
  EXPECT_NE(error_of([&] { r.read("missing"); }).find("holds no tensor 'missing'"), std::string::npos);
}

TEST_F(SafetensorsTest, ChecksumSeesAFlippedByte) {
  const auto file = path("d.safetensors");
  const auto hash = write_safetensors(file, {{"w", torch::randn({64})}});
  auto bytes = bytes_of(file);
  bytes[bytes.size() - 5] ^= 0x10;  // in the data section: the header still parses
  write_bytes(file, bytes);
  SafetensorsReader r(file);
  EXPECT_NE(r.checksum(), hash);
}

TEST_F(SafetensorsTest, BadFilesNameTheFileAndTheProblem) {
  const auto file = path("e.safetensors");
  write_safetensors(file, {{"a", torch::randn({100})}, {"b", torch::randn({100})}});
  const auto good = bytes_of(file);
  write_bytes(file, good.substr(0, good.size() - 100));
  auto msg = error_of([&] { SafetensorsReader r(file); });
  EXPECT_NE(msg.find("checkpoint file '" + file + "': truncated: tensor 'b' ends at byte"), std::string::npos) << msg;
  write_bytes(file, good.substr(0, 3));
  msg = error_of([&] { SafetensorsReader r(file); });
  EXPECT_NE(msg.find("truncated: 3 bytes"), std::string::npos) << msg;
  write_bytes(file, good.substr(0, 20));
  msg = error_of([&] { SafetensorsReader r(file); });
  EXPECT_NE(msg.find("truncated or not a safetensors file"), std::string::npos) << msg;
  auto broken = good;
  broken[8] = '[';  // the header's opening brace
  broken[9] = '[';
  write_bytes(file, broken);
  msg = error_of([&] { SafetensorsReader r(file); });
  EXPECT_NE(msg.find("malformed header"), std::string::npos) << msg;
  msg = error_of([&] { SafetensorsReader r(path("nowhere.safetensors")); });
  EXPECT_NE(msg.find("nowhere.safetensors': cannot be opened: No such file"), std::string::npos) << msg;
  msg = error_of([&] { write_safetensors(path("no/such/dir/x.safetensors"), {{"a", torch::ones({1})}}); });
  EXPECT_NE(msg.find("x.safetensors': cannot be created: No such file"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path("no/such/dir/x.safetensors")));
}

// Python's safetensors (scripts/setup.sh installs it) reads dtrain's file, and dtrain reads
// the file Python writes; skipped when python3 cannot import safetensors.
TEST_F(SafetensorsTest, PythonSafetensorsReadsAndWritesTheSameFormat) {
  if (std::system("python3 -c 'import safetensors.torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 cannot import safetensors.torch (scripts/setup.sh installs it)";
  }
  const auto ours = path("ours.safetensors"), theirs = path("theirs.safetensors");
  write_safetensors(ours, {{"a", torch::arange(12, torch::kFloat).view({3, 4})},
                           {"b", torch::tensor({1.5f, -2.0f}).to(torch::kBFloat16)}},
                    {{"from", "dtrain"}});
  const std::string script =
      "import sys, torch\n"
      "from safetensors import safe_open\n"
      "from safetensors.torch import load_file, save_file\n"
      "t = load_file(sys.argv[1])\n"
      "assert torch.equal(t['a'], torch.arange(12, dtype=torch.float32).view(3, 4)), t['a']\n"
      "assert t['b'].dtype == torch.bfloat16 and torch.equal(t['b'].float(), torch.tensor([1.5, -2.0])), t['b']\n"
      "assert safe_open(sys.argv[1], 'pt').metadata() == {'from': 'dtrain'}\n"
      "save_file({'c': torch.arange(6).view(2, 3), 'd': torch.tensor([0.25], dtype=torch.float16)},\n"
      "          sys.argv[2], metadata={'from': 'python'})\n";
  std::ofstream(path("check.py")) << script;
  const auto cmd = "python3 " + path("check.py") + " " + ours + " " + theirs;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  SafetensorsReader r(theirs);
  EXPECT_TRUE(torch::equal(r.read("c"), torch::arange(6, torch::kLong).view({2, 3})));
  EXPECT_EQ(r.read("d").scalar_type(), torch::kHalf);
  EXPECT_EQ(r.read("d").item<float>(), 0.25f);
  EXPECT_EQ(r.metadata().at("from"), "python");
}

// A checkpoint directory with one safetensors file per "rank" for `step`, committed.
void save_step(const std::string& root, std::int64_t step, int ranks = 2, int keep_last = 0) {
  const auto staging = begin_save(root, step);
  std::vector<FileRecord> files;
  for (int r = 0; r < ranks; ++r) {
    const auto name = "rank" + std::to_string(r) + ".safetensors";
    const auto hash = write_safetensors(fs::join(staging, name), {{"w", torch::full({8}, static_cast<float>(step))}});
    files.push_back({name, SafetensorsReader(fs::join(staging, name)).file_size(), hash});
  }
  commit_save(root, step, R"({"model": "tiny"})", files, keep_last);
}

class CheckpointDirTest : public SafetensorsTest {};

TEST_F(CheckpointDirTest, CommitRenamesTheStagingDirectoryAndPointsLatestAtIt) {
  const auto root = path("run");
  save_step(root, 5);
  EXPECT_TRUE(fs::exists(step_dir(root, 5)));
  EXPECT_FALSE(fs::exists(staging_dir(root, 5)));
  EXPECT_EQ(bytes_of(fs::join(root, "latest")), "step_5\n");
  const auto m = nlohmann::json::parse(verify(step_dir(root, 5)));
  EXPECT_EQ(m["step"], 5);
  EXPECT_EQ(m["model"], "tiny");
  EXPECT_EQ(m["format"], "dtrain-checkpoint");
  EXPECT_EQ(m["files"].size(), 2u);
  EXPECT_EQ(latest_good(root), step_dir(root, 5));
  save_step(root, 5, 1);  // a re-save of the same step replaces it
  EXPECT_EQ(nlohmann::json::parse(verify(step_dir(root, 5)))["files"].size(), 1u);
}

TEST_F(CheckpointDirTest, AnInterruptedSaveLeavesThePreviousCheckpoint) {
  const auto root = path("run");
  save_step(root, 1);
  // Step 2 stops after its files, before the commit: only a staging directory.
  const auto staging = begin_save(root, 2);
  write_safetensors(fs::join(staging, "rank0.safetensors"), {{"w", torch::ones({8})}});
  EXPECT_EQ(list_steps(root), (std::vector<std::int64_t>{1}));
  EXPECT_EQ(latest_good(root), step_dir(root, 1));
  // The next attempt starts from an empty staging directory.
  EXPECT_FALSE(fs::exists(fs::join(begin_save(root, 2), "rank0.safetensors")));
  // A commit whose files changed since they were written fails and keeps step 1 current.
  auto msg = error_of([&] { commit_save(root, 2, "{}", {{"rank0.safetensors", 100, 0}}); });
  EXPECT_NE(msg.find("file 'rank0.safetensors' has -1 bytes, not the 100 written"), std::string::npos) << msg;
  EXPECT_EQ(latest_good(root), step_dir(root, 1));
}

TEST_F(CheckpointDirTest, KeepsTheNewestSteps) {
  const auto root = path("run");
  for (int step : {10, 20, 30, 40}) save_step(root, step, 1, /*keep_last=*/2);
  EXPECT_EQ(list_steps(root), (std::vector<std::int64_t>{30, 40}));
}

TEST_F(CheckpointDirTest, BadFilesAreNamedAndTheNewestGoodCheckpointIsUsed) {
  const auto root = path("run");
  EXPECT_NE(error_of([&] { latest_good(root); }).find("no usable checkpoint under '" + root + "' (none saved)"),
            std::string::npos);
  save_step(root, 1);
  save_step(root, 2);
  const auto file = fs::join(step_dir(root, 2), "rank1.safetensors");
  const auto good = bytes_of(file);
  auto flipped = good;
  flipped[flipped.size() - 3] ^= 0x01;
  write_bytes(file, flipped);
  auto msg = error_of([&] { verify(step_dir(root, 2)); });
  EXPECT_NE(msg.find("checkpoint '" + file + "': checksum mismatch"), std::string::npos) << msg;
  std::vector<std::string> skipped;
  EXPECT_EQ(latest_good(root, &skipped), step_dir(root, 1)) << "falls back past the corrupt step";
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("rank1.safetensors': checksum mismatch"), std::string::npos) << skipped[0];
  write_bytes(file, good.substr(0, good.size() - 4));
  msg = error_of([&] { verify(step_dir(root, 2)); });
  EXPECT_NE(msg.find("bytes but the manifest says " + std::to_string(good.size()) + " (truncated)"), std::string::npos)
      << msg;
  fs::remove_tree(file);
  msg = error_of([&] { verify(step_dir(root, 2)); });
  EXPECT_NE(msg.find("rank1.safetensors': is missing (listed in the manifest)"), std::string::npos) << msg;
  write_bytes(fs::join(step_dir(root, 2), "manifest.json"), "{ not json");
  msg = error_of([&] { verify(step_dir(root, 2)); });
  EXPECT_NE(msg.find("malformed manifest"), std::string::npos) << msg;
  write_bytes(fs::join(step_dir(root, 1), "manifest.json"), R"({"format": "other"})");
  msg = error_of([&] { latest_good(root); });
  EXPECT_NE(msg.find("no usable checkpoint"), std::string::npos) << msg;
  EXPECT_NE(msg.find("is not a dtrain-checkpoint manifest"), std::string::npos) << msg;
}

// The global flat index of every local element, computed the slow way: the local tensor is
// the concatenation along dim of the ranges (padding: -1) of rows [row0, row0 + rows).
torch::Tensor brute_force(const std::vector<std::int64_t>& shape, std::int64_t dim,
                          const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, std::int64_t row0,
                          std::int64_t rows) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  auto idx = torch::arange(n, torch::kLong).view(shape).narrow(0, row0, rows);
  std::vector<torch::Tensor> parts;
  for (const auto& [start, len] : ranges) {
    const std::int64_t have = std::clamp<std::int64_t>(shape[static_cast<std::size_t>(dim)] - start, 0, len);
    if (have > 0) parts.push_back(idx.narrow(dim, start, have));
    if (have < len) {
      auto pad = idx.sizes().vec();
      pad[static_cast<std::size_t>(dim)] = len - have;
      parts.push_back(torch::full(pad, -1, torch::kLong));
    }
  }
  return torch::cat(parts, dim).reshape({-1});
}

torch::Tensor from_runs(const Runs& runs, std::int64_t numel) {
  auto out = torch::full({numel}, -1, torch::kLong);
  for (const auto& r : runs) out.narrow(0, r.local, r.numel).copy_(torch::arange(r.global, r.global + r.numel));
  return out;
}

// Slices of every kind dtrain makes: dim-0 ranges (q, k, v rows of a tp rank), a dim-1
// slice (row-parallel), expert rows with a dim-2 slice, vocabulary padding past the end.
TEST(ShardedRunsTest, SliceRunsMapEveryLocalElementLikeTheSlowIndex) {
  struct Case {
    std::vector<std::int64_t> shape;
    std::int64_t dim;
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    std::int64_t row0, rows;
  };
  const std::vector<Case> cases = {
      {{12, 5}, 0, {{2, 2}, {6, 1}, {9, 2}}, 0, 12},
      {{6, 8}, 1, {{4, 4}}, 0, 6},
      {{6, 4, 8}, 2, {{2, 3}}, 2, 3},
      {{6, 8, 4}, 1, {{0, 4}}, 4, 2},
      {{10, 3}, 0, {{8, 4}}, 0, 10},  // rows 8, 9 and two rows of padding
  };
  for (const auto& c : cases) {
    const auto want = brute_force(c.shape, c.dim, c.ranges, c.row0, c.rows);
    const auto runs = c.dim == 0 ? slice_runs(c.shape, 0, c.ranges) : slice_runs(c.shape, c.dim, c.ranges, c.row0, c.rows);
    EXPECT_TRUE(torch::equal(from_runs(runs, want.numel()), want)) << c.dim;
    // Any flat window of the local tensor (an FSDP shard) keeps its part of the map.
    const std::int64_t lo = want.numel() / 3, hi = want.numel() - 2;
    EXPECT_TRUE(torch::equal(from_runs(restrict_runs(runs, lo, hi), hi - lo), want.narrow(0, lo, hi - lo)));
  }
  EXPECT_EQ(slice_runs({4, 6}, -1, {}), (Runs{{0, 0, 24}}));  // whole: one run
  EXPECT_EQ(slice_runs({8, 6}, -1, {}, 2, 4), (Runs{{0, 12, 24}}));  // rows 2..5
}

// Two "ranks" write interleaved halves of a [6, 4] tensor (by columns); a reader fills a
// third layout (rows 1..4) from both files and names a hole when one file is missing.
TEST_F(SafetensorsTest, ShardReaderFillsAnyLayoutFromTheRankFiles) {
  const auto full = torch::arange(24, torch::kFloat).view({6, 4});
  std::map<std::string, std::vector<ShardReader::Shard>> index;
  for (int r = 0; r < 2; ++r) {
    const auto runs = slice_runs({6, 4}, 1, {{2 * r, 2}});
    ShardEntry e{"param/w", {6, 4}, full.narrow(1, 2 * r, 2).contiguous().view(-1), runs};
    std::vector<ShardSummary> sums;
    const auto name = "rank" + std::to_string(r) + ".safetensors";
    write_shard_file(path(name), {e}, {{"extra", torch::ones({2})}}, {}, &sums);
    ASSERT_EQ(sums.size(), 1u);
    EXPECT_EQ(sums[0].numel, 12);
    EXPECT_EQ(sums[0].dtype, "F32");
    index["param/w"].push_back({name, sums[0]});
  }
  {
    ShardReader reader(dir_, index);
    auto dest = torch::zeros({16});
    reader.fill("param/w", slice_runs({6, 4}, -1, {}, 1, 4), dest);
    EXPECT_TRUE(torch::equal(dest, full.narrow(0, 1, 4).reshape({-1})));
    EXPECT_TRUE(torch::equal(reader.read_extra("rank1.safetensors", "extra"), torch::ones({2})));
    EXPECT_FALSE(reader.read_extra("rank1.safetensors", "none").defined());
    EXPECT_EQ(reader.shape("param/w"), (std::vector<std::int64_t>{6, 4}));
    EXPECT_NE(error_of([&] { reader.shape("param/x"); }).find("holds no tensor 'param/x'"), std::string::npos);
  }
  index["param/w"].pop_back();
  ShardReader half(dir_, index);
  auto dest = torch::zeros({24});
  const auto msg = error_of([&] { half.fill("param/w", slice_runs({6, 4}, -1, {}), dest); });
  EXPECT_NE(msg.find("no file holds element 2 of 'param/w' [6, 4]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dtrain::checkpoint
