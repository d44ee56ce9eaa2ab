// Token shard reading (mmap) and writing (temporary file + rename).
#include "dtrain/data/token_shard.hpp"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "dtrain/core/error.hpp"

namespace dtrain::data {

using detail::str_cat;

TokenShard::TokenShard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  DTRAIN_CHECK_ARG(fd >= 0, "token shard '", path, "' cannot be opened: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw InvalidArgument(str_cat("token shard '", path, "' cannot be read: ", std::strerror(err)));
  }
  map_bytes_ = static_cast<std::size_t>(st.st_size);
  const std::size_t header_bytes = kShardHeaderInts * sizeof(std::int32_t);
  if (map_bytes_ < header_bytes) {
    ::close(fd);
    throw InvalidArgument(str_cat("token shard '", path, "' has ", map_bytes_,
                                  " bytes, less than its ", header_bytes, "-byte header"));
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  DTRAIN_CHECK_ARG(map_ != MAP_FAILED, "token shard '", path, "' cannot be mapped: ",
                   std::strerror(errno));
  const auto* header = static_cast<const std::int32_t*>(map_);
  try {
    DTRAIN_CHECK_ARG(header[0] == kShardMagic, "token shard '", path, "' has magic ",
                     header[0], "; expected ", kShardMagic,
                     " (llm.c/nanoGPT uint16 token shard)");
    DTRAIN_CHECK_ARG(header[1] == kShardVersion, "token shard '", path, "' has version ",
                     header[1], "; supported: ", kShardVersion);
    num_tokens_ = header[2];
    const std::size_t want = header_bytes + static_cast<std::size_t>(num_tokens_) * 2;
    DTRAIN_CHECK_ARG(num_tokens_ >= 0 && want == map_bytes_, "token shard '", path,
                     "' declares ", num_tokens_, " tokens (", want, " bytes with header) but has ",
                     map_bytes_, " bytes");
  } catch (...) {
    release();
    throw;
  }
  tokens_ = reinterpret_cast<const std::uint16_t*>(static_cast<const char*>(map_) + header_bytes);
  ::madvise(map_, map_bytes_, MADV_RANDOM);  // samples are read out of order
}

TokenShard::~TokenShard() { release(); }

TokenShard::TokenShard(TokenShard&& other) noexcept { *this = std::move(other); }

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    max_token_ = other.max_token_;
  }
  return *this;
}

void TokenShard::release() {
  if (map_ != nullptr && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
  map_ = nullptr;
}

std::uint16_t TokenShard::max_token() const {
  if (max_token_ < 0) {
    max_token_ = num_tokens_ == 0 ? 0 : *std::max_element(tokens_, tokens_ + num_tokens_);
  }
  return static_cast<std::uint16_t>(max_token_);
}

void write_token_shard(const std::string& path, const std::vector<std::uint16_t>& tokens) {
  DTRAIN_CHECK_ARG(tokens.size() <= 0x7fffffffu, "token shard '", path, "': ", tokens.size(),
                   " tokens exceed the format's int32 count; split into more shards");
  std::int32_t header[kShardHeaderInts] = {0};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<std::int32_t>(tokens.size());
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  DTRAIN_CHECK_ARG(f != nullptr, "token shard '", path, "' cannot be written: ",
                   std::strerror(errno));
  bool ok = std::fwrite(header, sizeof(header), 1, f) == 1;
  if (!tokens.empty()) ok = ok && std::fwrite(tokens.data(), 2, tokens.size(), f) == tokens.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw InvalidArgument(str_cat("token shard '", path, "' could not be written completely: ",
                                  std::strerror(errno)));
  }
}

std::vector<std::string> glob_shards(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0) {
    for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  DTRAIN_CHECK_ARG(!out.empty(), "no token shards match '", pattern, "'");
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace dtrain::data
