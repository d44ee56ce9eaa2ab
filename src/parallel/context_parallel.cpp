// Context parallelism: the load-balanced chunk layout and attention over gathered keys.
#include "dtrain/parallel/context_parallel.hpp"

#include <ATen/ATen.h>

#include <vector>

#include "dtrain/core/error.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/parallel/tensor_parallel.hpp"

namespace dtrain::cp {

namespace {
// The chunk (of 2 cp) that rank r holds in its slot s (0, 1).
std::int64_t chunk_of(int cp, int r, int s) { return s == 0 ? r : 2 * cp - 1 - r; }
}  // namespace

void check_sequence(std::int64_t seq_len, int cp, const std::string& option) {
  DTRAIN_CHECK_ARG(cp >= 1, "--cp=", cp, " must be at least 1");
  DTRAIN_CHECK_ARG(seq_len > 0 && seq_len % (2 * cp) == 0, option, "=", seq_len,
                   " cannot be split across --cp=", cp, " (each rank holds 2 of 2 x cp equal chunks); allowed: a ",
                   "multiple of ", 2 * cp);
}

at::Tensor local_positions(std::int64_t seq_len, int cp, int rank, c10::Device device) {
  check_sequence(seq_len, cp);
  DTRAIN_CHECK_ARG(rank >= 0 && rank < cp, "context parallel rank ", rank, " is not in [0, ", cp, ")");
  const auto L = seq_len / (2 * cp);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  if (cp == 1) return at::arange(seq_len, opts);
  return at::cat({at::arange(chunk_of(cp, rank, 0) * L, (chunk_of(cp, rank, 0) + 1) * L, opts),
                  at::arange(chunk_of(cp, rank, 1) * L, (chunk_of(cp, rank, 1) + 1) * L, opts)});
}

at::Tensor take_local(const at::Tensor& x, std::int64_t dim, int cp, int rank) {
  if (cp == 1) return x;
  return x.index_select(dim, local_positions(x.size(dim), cp, rank, x.device()));
}

at::Tensor gather_sequence(const at::Tensor& x, std::int64_t dim, const CommPtr& cp) {
  DTRAIN_CHECK_ARG(cp != nullptr, "context parallel: no cp communicator");
  const int n = cp->size();
  if (n == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  DTRAIN_CHECK_ARG(dim >= 0 && dim < x.dim() && x.size(dim) % 2 == 0, "context parallel: dimension ", dim,
                   " of ", x.sizes(), " is not a rank's two chunks of the sequence");
  // Gathered in rank order: rank r's chunks (r, 2n - 1 - r) at slots 2r, 2r + 1.
  const auto gathered = tp::gather_from_sequence(x, cp, dim);
  const auto L = x.size(dim) / 2;
  std::vector<std::int64_t> slot_of(static_cast<std::size_t>(2 * n));
  for (int r = 0; r < n; ++r) {
    for (int s = 0; s < 2; ++s) slot_of[static_cast<std::size_t>(chunk_of(n, r, s))] = 2 * r + s;
  }
  std::vector<at::Tensor> index;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(x.device());
  for (auto slot : slot_of) index.push_back(at::arange(slot * L, (slot + 1) * L, opts));
  return gathered.index_select(dim, at::cat(index));
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp,
                     double dropout_p, std::int64_t window, const ops::Documents& documents) {
  DTRAIN_CHECK_ARG(cp != nullptr, "context parallel: no cp communicator");
  const int n = cp->size();
  if (n == 1) return ops::attention(q, k, v, /*causal=*/true, dropout_p, ops::AttentionBackend::kSdpa, window, documents);
  DTRAIN_CHECK_ARG(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                       q.size(2) == k.size(2) && q.size(2) % 2 == 0,
                   "context parallel attention: q, k, v must be [batch, heads, 2 chunks of time, head_dim] with k "
                   "and v alike; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const auto hkv = k.size(1), L = q.size(2) / 2;
  // One all-gather for keys and values together.
  const auto kv = gather_sequence(at::cat({k, v}, 1), 2, cp);
  const auto keys = kv.narrow(1, 0, hkv), values = kv.narrow(1, hkv, hkv);
  std::vector<at::Tensor> out;
  for (int s = 0; s < 2; ++s) {
    const auto g = chunk_of(n, cp->rank(), s);
    const auto seen = (g + 1) * L;  // the keys up to the chunk's end
    out.push_back(ops::attention(q.narrow(2, s * L, L), keys.narrow(2, 0, seen), values.narrow(2, 0, seen),
                                 /*causal=*/true, dropout_p, ops::AttentionBackend::kSdpa, window, documents, g * L));
  }
  return at::cat(out, 2);
}

}  // namespace dtrain::cp
