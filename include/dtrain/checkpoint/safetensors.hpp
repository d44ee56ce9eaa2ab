// safetensors files (the Hugging Face format: an 8-byte little-endian header length, a JSON
// header of name -> {dtype, shape, data_offsets} plus "__metadata__", then the raw
// little-endian bytes): written durably (fsync) with a checksum of the whole file, and read
// whole or by element ranges (each read touches only the bytes it needs).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/core/error.hpp"

namespace dtrain::checkpoint {

// A checkpoint file or directory that cannot be used: the message names the file and
// the problem (truncated, checksum mismatch, malformed header, missing tensor, ...).
class CheckpointError : public Error {
  using Error::Error;
};

// 64-bit FNV-1a over bytes, continued from `seed` (the checksum written in manifests:
// "fnv1a64:<16 hex digits>").
std::uint64_t fnv1a64(const void* data, std::size_t size,
                      std::uint64_t seed = 0xcbf29ce484222325ULL);
std::string checksum_text(std::uint64_t hash);
// fnv1a64 of a whole file (any file), read in large blocks; CheckpointError naming the
// path when it cannot be read.
std::uint64_t file_checksum(const std::string& path);

// One tensor of a file: its safetensors dtype ("F32", "BF16", ...), shape and byte range
// in the data section.
struct TensorInfo {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, end = 0;  // data_offsets
  at::ScalarType scalar_type() const;
  std::int64_t numel() const;
};

// Writes `tensors` (any device; copied to the CPU, contiguous) in the given order with
// string metadata, then fsyncs the file. Returns the checksum of the whole file. Raises
// CheckpointError naming the path and the system error (a full disk included); a failed
// write removes the partial file.
std::uint64_t write_safetensors(const std::string& path,
                                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const std::map<std::string, std::string>& metadata = {});

// An open safetensors file. The header is parsed and checked against the file's size on
// open (CheckpointError: truncated, malformed header, a tensor's bytes out of range or not
// matching its dtype and shape). Not thread-safe.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  // Names in file order (by data offset).
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // CheckpointError when missing
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The whole tensor (CPU).
  at::Tensor read(const std::string& name) const;
  // Elements [offset, offset + numel) of the row-major flattened tensor (CPU, 1-D); reads
  // only their bytes.
  at::Tensor read_range(const std::string& name, std::int64_t offset, std::int64_t numel) const;
  // Checksum of the whole file (reads it all).
  std::uint64_t checksum() const;
  std::int64_t file_size() const { return size_; }

 private:
  void read_bytes(void* into, std::int64_t at, std::int64_t bytes) const;
  std::string path_;
  int fd_ = -1;
  std::int64_t size_ = 0, data_start_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// safetensors dtype name of a scalar type ("F32", "F16", "BF16", "F64", "I64", "I32",
// "I16", "I8", "U8", "BOOL"); InvalidArgument for others.
std::string dtype_name(at::ScalarType t);

}  // namespace dtrain::checkpoint
