// Sharded state: runs of a slice, rank files of compacted runs with their run tables, and
// the reader that fills any other layout's tensors from them by byte ranges.
#include "dtrain/checkpoint/sharded.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <climits>
#include <iterator>

#include "dtrain/checkpoint/safetensors.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"

namespace dtrain::checkpoint {

namespace {

void append(Runs& out, const Run& r) {
  if (r.numel <= 0) return;
  if (!out.empty()) {
    auto& b = out.back();
    if (b.local + b.numel == r.local && b.global + b.numel == r.global) {
      b.numel += r.numel;
      return;
    }
  }
  out.push_back(r);
}

std::string runs_name(const std::string& key) { return key + "::runs"; }

}  // namespace

Runs slice_runs(const std::vector<std::int64_t>& global_shape, std::int64_t dim,
                const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, std::int64_t row0,
                std::int64_t rows) {
  const auto& G = global_shape;
  const auto k = static_cast<std::int64_t>(G.size());
  if (k == 0) return {Run{0, 0, 1}};
  std::vector<std::pair<std::int64_t, std::int64_t>> along = ranges;
  if (dim < 0) {  // whole extent, or the rows along dim 0
    dim = 0;
    along = {{row0, rows < 0 ? G[0] : rows}};
    row0 = 0, rows = -1;
  }
  DTRAIN_CHECK(dim < k, "slice_runs: dim ", dim, " of a ", k, "-d tensor");
  DTRAIN_CHECK(dim > 0 || (row0 == 0 && rows < 0), "slice_runs: rows and ranges both on dim 0");
  auto L = G;
  if (rows >= 0) L[0] = rows;
  std::int64_t width = 0;
  for (const auto& r : along) width += r.second;
  L[static_cast<std::size_t>(dim)] = width;
  std::int64_t inner = 1, outer = 1;
  for (std::int64_t i = dim + 1; i < k; ++i) inner *= G[static_cast<std::size_t>(i)];
  for (std::int64_t i = 0; i < dim; ++i) outer *= L[static_cast<std::size_t>(i)];
  // Strides of G for dims [0, dim].
  std::vector<std::int64_t> stride(static_cast<std::size_t>(dim + 1));
  stride[static_cast<std::size_t>(dim)] = inner;
  for (std::int64_t i = dim - 1; i >= 0; --i) {
    stride[static_cast<std::size_t>(i)] = stride[static_cast<std::size_t>(i + 1)] * G[static_cast<std::size_t>(i + 1)];
  }
  const std::int64_t extent = G[static_cast<std::size_t>(dim)];
  Runs out;
  std::vector<std::int64_t> idx(static_cast<std::size_t>(dim), 0);
  for (std::int64_t o = 0; o < outer; ++o) {
    // idx: the multi-index of o over L's dims [0, dim).
    std::int64_t rest = o, base = 0;
    for (std::int64_t i = dim - 1; i >= 0; --i) {
      const auto n = L[static_cast<std::size_t>(i)];
      idx[static_cast<std::size_t>(i)] = rest % n;
      rest /= n;
    }
    for (std::int64_t i = 0; i < dim; ++i) {
      base += (idx[static_cast<std::size_t>(i)] + (i == 0 ? row0 : 0)) * stride[static_cast<std::size_t>(i)];
    }
    std::int64_t pos = 0;
    for (const auto& [start, len] : along) {
      const std::int64_t have = std::clamp<std::int64_t>(extent - start, 0, len);
      append(out, Run{(o * width + pos) * inner, base + start * inner, have * inner});
      pos += len;
    }
  }
  return out;
}

Runs restrict_runs(const Runs& runs, std::int64_t lo, std::int64_t hi) {
  Runs out;
  for (const auto& r : runs) {
    const std::int64_t a = std::max(lo, r.local), b = std::min(hi, r.local + r.numel);
    if (b > a) append(out, Run{a - lo, r.global + (a - r.local), b - a});
  }
  return out;
}

std::uint64_t write_shard_file(const std::string& path, const std::vector<ShardEntry>& entries,
                               const std::vector<std::pair<std::string, at::Tensor>>& extra,
                               const std::map<std::string, std::string>& metadata,
                               std::vector<ShardSummary>* summaries) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<ShardSummary> out;
  for (const auto& e : entries) {
    if (e.runs.empty()) continue;
    const auto flat = e.values.reshape({-1});
    std::vector<at::Tensor> parts;
    auto table = at::empty({static_cast<std::int64_t>(e.runs.size()), 2}, at::kLong);
    auto* t = table.data_ptr<std::int64_t>();
    ShardSummary s{e.key, e.shape, dtype_name(e.values.scalar_type()), e.runs.front().global, 0, 0};
    for (std::size_t i = 0; i < e.runs.size(); ++i) {
      const auto& r = e.runs[i];
      DTRAIN_CHECK(r.local >= 0 && r.local + r.numel <= flat.numel(), "write_shard_file: ", e.key,
                   " has a run past its ", flat.numel(), " local elements");
      parts.push_back(flat.narrow(0, r.local, r.numel));
      t[2 * i] = r.global;
      t[2 * i + 1] = r.numel;
      s.lo = std::min(s.lo, r.global);
      s.hi = std::max(s.hi, r.global + r.numel);
      s.numel += r.numel;
    }
    tensors.emplace_back(e.key, parts.size() == 1 ? parts.front() : at::cat(parts));
    tensors.emplace_back(runs_name(e.key), table);
    out.push_back(std::move(s));
  }
  for (const auto& item : extra) tensors.push_back(item);
  const auto checksum = write_safetensors(path, tensors, metadata);
  if (summaries != nullptr) *summaries = std::move(out);
  return checksum;
}

struct ShardReader::File {
  std::unique_ptr<SafetensorsReader> reader;
  // key -> saved runs (global, numel, offset in the compacted values), by global offset.
  std::map<std::string, std::vector<std::array<std::int64_t, 3>>> runs;
};

ShardReader::ShardReader(std::string dir, std::map<std::string, std::vector<Shard>> index)
    : dir_(std::move(dir)), index_(std::move(index)) {}

ShardReader::~ShardReader() = default;

ShardReader::File& ShardReader::open(const std::string& name) {
  auto& f = files_[name];
  if (!f) {
    f = std::make_unique<File>();
    f->reader = std::make_unique<SafetensorsReader>(fs::join(dir_, name));
  }
  return *f;
}

const std::vector<std::int64_t>& ShardReader::shape(const std::string& key) const {
  const auto it = index_.find(key);
  if (it == index_.end() || it->second.empty()) {
    throw CheckpointError("checkpoint '" + dir_ + "' holds no tensor '" + key + "'");
  }
  return it->second.front().summary.shape;
}

void ShardReader::fill(const std::string& key, const Runs& runs, const at::Tensor& dest) {
  const auto& shards = index_.at(key);  // shape() above checked presence for callers
  std::vector<std::pair<std::int64_t, std::int64_t>> covered;  // global ranges filled
  for (const auto& shard : shards) {
    const auto& s = shard.summary;
    bool overlaps = false;
    for (const auto& r : runs) overlaps = overlaps || (r.global < s.hi && r.global + r.numel > s.lo);
    if (!overlaps) continue;
    auto& file = open(shard.file);
    auto it = file.runs.find(key);
    if (it == file.runs.end()) {
      const auto table = file.reader->read(runs_name(key));
      if (table.dim() != 2 || table.size(1) != 2 || table.scalar_type() != at::kLong) {
        throw CheckpointError("checkpoint file '" + file.reader->path() + "': the run table of '" +
                              key + "' is malformed");
      }
      std::vector<std::array<std::int64_t, 3>> saved;
      const auto* t = table.data_ptr<std::int64_t>();
      std::int64_t offset = 0;
      for (std::int64_t i = 0; i < table.size(0); ++i) {
        saved.push_back({t[2 * i], t[2 * i + 1], offset});
        offset += t[2 * i + 1];
      }
      if (offset != file.reader->info(key).numel()) {
        throw CheckpointError("checkpoint file '" + file.reader->path() + "': the runs of '" + key +
                              "' count " + std::to_string(offset) + " elements, the tensor has " +
                              std::to_string(file.reader->info(key).numel()));
      }
      std::sort(saved.begin(), saved.end());
      it = file.runs.emplace(key, std::move(saved)).first;
    }
    const auto& saved = it->second;
    // One read per stretch that is consecutive both in the file and in dest.
    std::int64_t pending_src = -1, pending_dst = 0, pending_n = 0;
    auto flush = [&]() {
      if (pending_n == 0) return;
      dest.narrow(0, pending_dst, pending_n).copy_(file.reader->read_range(key, pending_src, pending_n));
      pending_n = 0;
    };
    for (const auto& r : runs) {
      auto first = std::upper_bound(saved.begin(), saved.end(), std::array<std::int64_t, 3>{r.global, INT64_MAX, 0});
      if (first != saved.begin()) --first;
      for (auto sv = first; sv != saved.end() && (*sv)[0] < r.global + r.numel; ++sv) {
        const std::int64_t a = std::max(r.global, (*sv)[0]);
        const std::int64_t b = std::min(r.global + r.numel, (*sv)[0] + (*sv)[1]);
        if (b <= a) continue;
        const std::int64_t src = (*sv)[2] + (a - (*sv)[0]), dst = r.local + (a - r.global);
        if (pending_n > 0 && pending_src + pending_n == src && pending_dst + pending_n == dst) {
          pending_n += b - a;
        } else {
          flush();
          pending_src = src, pending_dst = dst, pending_n = b - a;
        }
        covered.emplace_back(a, b);
      }
    }
    flush();
  }
  std::sort(covered.begin(), covered.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> merged;
  for (const auto& [a, b] : covered) {
    if (!merged.empty() && a <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, b);
    } else {
      merged.emplace_back(a, b);
    }
  }
  for (const auto& r : runs) {
    auto it = std::upper_bound(merged.begin(), merged.end(), std::make_pair(r.global, INT64_MAX));
    const std::int64_t reach = it == merged.begin() ? r.global : std::max(r.global, std::prev(it)->second);
    if (reach < r.global + r.numel) {
      throw CheckpointError(detail::str_cat("checkpoint '", dir_, "': no file holds element ", reach, " of '", key,
                                            "' ", at::IntArrayRef(shape(key)), " (a rank file or its tensor is missing)"));
    }
  }
}

at::Tensor ShardReader::read_extra(const std::string& file, const std::string& name) {
  auto& f = open(file);
  return f.reader->contains(name) ? f.reader->read(name) : at::Tensor();
}

}  // namespace dtrain::checkpoint
