// Durable whole-file writes shared by the checkpoint files (safetensors, manifests,
// the latest pointer). Internal to src/checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::checkpoint::io {

struct Buffer {
  const void* data;
  std::size_t size;
};

// Writes the buffers in order to path (created or truncated), fsyncs and closes it, every
// call checked; on failure removes the file and raises CheckpointError naming the path and
// the system error (a full disk included). Returns fnv1a64 of the bytes written.
std::uint64_t write_file(const std::string& path, const std::vector<Buffer>& buffers);

}  // namespace dtrain::checkpoint::io
