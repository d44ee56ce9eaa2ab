// Sharded state in checkpoint files: each rank writes the elements it owns of the global
// (single-process) tensors as runs of consecutive elements, and any rank of any later
// layout reads back exactly the global elements its own tensors hold, by byte ranges.
// Runs describe every layout: tensor-parallel slices, expert rows, FSDP flat shards.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::checkpoint {

// Local flat elements [local, local + numel) of a rank's tensor are the global tensor's
// flat (row-major) elements [global, global + numel).
struct Run {
  std::int64_t local = 0, global = 0, numel = 0;
  bool operator==(const Run& o) const { return local == o.local && global == o.global && numel == o.numel; }
};
using Runs = std::vector<Run>;

// The runs of a slice of a global tensor of shape global_shape: rows [row0, row0 + rows)
// along dim 0 (rows < 0: all), and along `dim` the concatenation of `ranges` (start,
// length) (dim < 0: the whole extent). Parts of a range past the global size are padding
// and map nowhere. Adjacent runs are merged.
Runs slice_runs(const std::vector<std::int64_t>& global_shape, std::int64_t dim,
                const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges,
                std::int64_t row0 = 0, std::int64_t rows = -1);
// The part of `runs` with local elements in [lo, hi), its local indices relative to lo
// (an FSDP shard of a tensor holds local elements [lo, hi)).
Runs restrict_runs(const Runs& runs, std::int64_t lo, std::int64_t hi);

// One tensor of a rank's state: `values` (1-D, any device) are its local elements, and
// `runs` place them in the global tensor `key` (e.g. "param/h.0.attn_qkv.weight") of shape
// `shape`.
struct ShardEntry {
  std::string key;
  std::vector<std::int64_t> shape;
  at::Tensor values;
  Runs runs;
};

// What a rank file holds of one global tensor (the manifest's index of the shards).
struct ShardSummary {
  std::string key;
  std::vector<std::int64_t> shape;
  std::string dtype;                        // safetensors name of the stored values ("F32")
  std::int64_t lo = 0, hi = 0, numel = 0;  // global elements covered: within [lo, hi)
};

// Writes the elements of `entries` that their runs map (copied to the CPU, in run order)
// as safetensors tensors "<key>" with their run tables "<key>::runs" (int64 [R, 2]:
// global offset, count), plus the `extra` tensors as they are, then fsyncs. Returns the
// file's checksum and fills `summaries`. CheckpointError naming the path on failure.
std::uint64_t write_shard_file(const std::string& path, const std::vector<ShardEntry>& entries,
                               const std::vector<std::pair<std::string, at::Tensor>>& extra,
                               const std::map<std::string, std::string>& metadata,
                               std::vector<ShardSummary>* summaries);

// Reads global elements from a checkpoint directory's rank files, opening a file (and
// its run tables) only when a requested range overlaps what it holds.
class ShardReader {
 public:
  // index: key -> (file name, summary) for every shard of the checkpoint.
  struct Shard {
    std::string file;
    ShardSummary summary;
  };
  ShardReader(std::string dir, std::map<std::string, std::vector<Shard>> index);
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  bool contains(const std::string& key) const { return index_.count(key) != 0; }
  // The global shape of key (CheckpointError when the checkpoint has no such tensor).
  const std::vector<std::int64_t>& shape(const std::string& key) const;
  // Fills dest (1-D CPU, dtype of the checkpoint's values or any floating dtype) at the
  // local indices of `runs` with the global elements they map; CheckpointError naming the
  // key and the first element no file holds.
  void fill(const std::string& key, const Runs& runs, const at::Tensor& dest);
  // A tensor stored as it is in file `file` ("extra" tensors), or undefined when absent.
  at::Tensor read_extra(const std::string& file, const std::string& name);

 private:
  struct File;
  File& open(const std::string& name);
  std::string dir_;
  std::map<std::string, std::vector<Shard>> index_;
  std::map<std::string, std::unique_ptr<File>> files_;
};

}  // namespace dtrain::checkpoint
