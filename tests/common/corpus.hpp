// A small real-text corpus for training tests: the project's LICENSE (the Apache-2.0
// text, about 11 KB), or a text of the test's own, written as byte-level token shards
// (95 % train, 5 % val) into a fresh directory that is removed again at the end of the
// test.
#pragma once

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "dtrain/core/fs.hpp"
#include "dtrain/data/dataset.hpp"

#ifndef DTRAIN_SOURCE_DIR
#error "tests need DTRAIN_SOURCE_DIR (set in tests/CMakeLists.txt)"
#endif

namespace dtrain::testing {

class TestCorpus {
 public:
  explicit TestCorpus(const std::string& tag) : TestCorpus(tag, license()) {}
  TestCorpus(const std::string& tag, const std::string& text) {
    dir_ = "/tmp/dtrain_corpus_" + std::to_string(::getpid()) + "_" + tag;
    fs::make_directories(dir_);
    const auto tokens = data::ByteTokenizer::encode(text);
    const auto n_val = tokens.size() / 20;
    data::write_token_shard(fs::join(dir_, "license_val_000000.bin"),
                            {tokens.begin(), tokens.begin() + n_val});
    data::write_token_shard(fs::join(dir_, "license_train_000000.bin"),
                            {tokens.begin() + n_val, tokens.end()});
  }
  ~TestCorpus() { fs::remove_tree(dir_); }
  TestCorpus(const TestCorpus&) = delete;
  TestCorpus& operator=(const TestCorpus&) = delete;

  const std::string& dir() const { return dir_; }
  std::string train() const { return fs::join(dir_, "license_train_*.bin"); }
  std::string val() const { return fs::join(dir_, "license_val_*.bin"); }

 private:
  static std::string license() {
    std::ifstream in(std::string(DTRAIN_SOURCE_DIR) + "/LICENSE", std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }
  std::string dir_;
};

}  // namespace dtrain::testing
