// prepare_data: text files -> llm.c/nanoGPT token shards with the byte-level tokenizer.
// The first --val-fraction of the tokens become NAME_val_000000.bin, the rest
// NAME_train_NNNNNN.bin shards of at most --shard-tokens tokens.
//
//   build/examples/prepare_data --input a.txt b.txt --output-dir data/tiny --name tiny
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/data/dataset.hpp"

namespace {

std::string shard_path(const std::string& dir, const std::string& name, const char* split, int i) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "_%s_%06d.bin", split, i);
  return dtrain::fs::join(dir, name + buf);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> inputs;
  std::string out_dir, name = "corpus";
  double val_fraction = 0.05;
  std::int64_t shard_tokens = 100'000'000;
  CLI::App app{"prepare_data: text files to byte-level token shards (llm.c format)"};
  app.add_option("-i,--input", inputs, "text files, concatenated in order")->required()->check(CLI::ExistingFile);
  app.add_option("-o,--output-dir", out_dir, "directory for the shards (created)")->required();
  app.add_option("-n,--name", name, "shard file prefix");
  app.add_option("--val-fraction", val_fraction, "share of tokens for the validation shard")->check(CLI::Range(0.0, 0.5));
  app.add_option("--shard-tokens", shard_tokens, "tokens per training shard")->check(CLI::Range(std::int64_t{1024}, std::int64_t{2'000'000'000}));
  CLI11_PARSE(app, argc, argv);
  try {
    std::string text;
    for (const auto& path : inputs) {
      std::ifstream in(path, std::ios::binary);
      DTRAIN_CHECK_ARG(in.good(), "--input '", path, "' cannot be read");
      std::ostringstream ss;
      ss << in.rdbuf();
      if (!text.empty() && text.back() != '\n') text += '\n';
      text += ss.str();
    }
    const auto tokens = dtrain::data::ByteTokenizer::encode(text);
    DTRAIN_CHECK_ARG(tokens.size() >= 2048, "--input holds ", tokens.size(),
                     " bytes; at least 2048 are needed for a train and a val shard");
    dtrain::fs::make_directories(out_dir);
    const auto n_val = static_cast<std::size_t>(static_cast<double>(tokens.size()) * val_fraction);
    if (n_val > 0) {
      dtrain::data::write_token_shard(shard_path(out_dir, name, "val", 0),
                                      {tokens.begin(), tokens.begin() + n_val});
    }
    int shards = 0;
    for (std::size_t at = n_val; at < tokens.size(); at += shard_tokens, ++shards) {
      const std::size_t end = std::min(tokens.size(), at + static_cast<std::size_t>(shard_tokens));
      dtrain::data::write_token_shard(shard_path(out_dir, name, "train", shards),
                                      {tokens.begin() + at, tokens.begin() + end});
    }
    std::printf("prepare_data: %zu tokens -> %s: val %zu tokens, train %zu tokens in %d shard(s)\n",
                tokens.size(), out_dir.c_str(), n_val, tokens.size() - n_val, shards);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prepare_data: %s\n", e.what());
    return 2;
  }
}
