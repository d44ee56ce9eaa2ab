// Token shards in the llm.c / nanoGPT format: a 256 x int32 header (magic 20240520,
// version 1, token count) followed by uint16 tokens. Read by memory mapping; written
// atomically (temporary file + rename), so a crash never leaves a half-written shard.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::data {

inline constexpr std::int32_t kShardMagic = 20240520;
inline constexpr std::int32_t kShardVersion = 1;
inline constexpr int kShardHeaderInts = 256;

// A read-only, memory-mapped shard. Move-only; the mapping lives as long as the object.
class TokenShard {
 public:
  // Raises InvalidArgument naming the path and the problem: unreadable, too short for the
  // header, wrong magic or version, or a token count that disagrees with the file size.
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  std::int64_t size() const { return num_tokens_; }
  const std::uint16_t* tokens() const { return tokens_; }
  // Largest token id in the shard (scanned once, on first call).
  std::uint16_t max_token() const;

 private:
  void release();
  std::string path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  const std::uint16_t* tokens_ = nullptr;
  std::int64_t num_tokens_ = 0;
  mutable int max_token_ = -1;
};

// Writes tokens as one shard at path (parent directory must exist).
void write_token_shard(const std::string& path, const std::vector<std::uint16_t>& tokens);

// Files matching a glob pattern (e.g. "data/tiny_train_*.bin"), sorted; raises
// InvalidArgument naming the pattern when nothing matches.
std::vector<std::string> glob_shards(const std::string& pattern);

}  // namespace dtrain::data
