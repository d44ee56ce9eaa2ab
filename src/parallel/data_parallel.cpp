// DataParallel: bucketed, backward-overlapped gradient averaging.
#include "dtrain/parallel/data_parallel.hpp"

#include <ATen/ATen.h>

#include <chrono>

#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"

namespace dtrain {

namespace {
// Every rank raises together (the check is local, so all must see the same unused set);
// a rank that raised alone would leave its peers waiting.
void check_unused(const std::string& missing, bool allowed) {
  DTRAIN_CHECK_ARG(missing.empty() || allowed,
                   "DataParallel: parameters received no gradient in this backward: ", missing,
                   " (set allow_unused to reduce them as zeros)");
}
}  // namespace

struct DataParallel::Bucket {
  at::Tensor buffer;                 // flat, reduce dtype
  std::vector<std::size_t> params;  // indices into params_
  std::size_t ready = 0;
  WorkPtr work;
};

DataParallel::DataParallel(NamedParameters params, CommPtr dp_comm, DataParallelOptions options)
    : params_(std::move(params)), comm_(std::move(dp_comm)), options_(options) {
  DTRAIN_CHECK_ARG(comm_ != nullptr, "DataParallel needs a data-parallel communicator");
  DTRAIN_CHECK_ARG(options_.bucket_bytes > 0, "DataParallel bucket_bytes=",
                   options_.bucket_bytes, " must be positive");
  if (options_.broadcast_parameters) {
    for (auto& [name, p] : params_) {
      at::NoGradGuard no_grad;
      comm_->broadcast(p.detach(), {0})->wait();
    }
  }
  if (env::comm_check()) verify_identical_parameters();
  for (const auto& [name, p] : params_) {
    DTRAIN_CHECK_ARG(p.requires_grad(), "DataParallel: parameter '", name,
                     "' does not require grad; pass only trainable parameters");
  }
  seen_.assign(params_.size(), false);
  // One rank: the average is the gradient itself; no buckets, hooks or copies.
  if (comm_->size() == 1) return;
  // Buckets in reverse registration order (gradients arrive roughly in that order),
  // split when full or when dtype/device change.
  bucket_of_.assign(params_.size(), 0);
  offset_of_.assign(params_.size(), 0);
  std::vector<std::size_t> current;
  std::int64_t bytes = 0, elems = 0;
  auto close = [&]() {
    if (current.empty()) return;
    auto b = std::make_unique<Bucket>();
    const auto& first = params_[current[0]].second;
    const auto dtype = options_.bf16_reduce ? at::kBFloat16 : first.scalar_type();
    b->buffer = at::zeros({elems}, first.options().dtype(dtype));
    b->params = current;
    buckets_.push_back(std::move(b));
    current.clear();
    bytes = elems = 0;
  };
  for (std::size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k].second;
    if (!current.empty()) {
      const auto& prev = params_[current[0]].second;
      if (prev.scalar_type() != p.scalar_type() || prev.device() != p.device()) close();
    }
    bucket_of_[k] = buckets_.size();
    offset_of_[k] = elems;
    current.push_back(k);
    elems += p.numel();
    bytes += p.numel() * p.element_size();
    if (bytes >= options_.bucket_bytes) close();
  }
  close();
  stats_.buckets = static_cast<std::int64_t>(buckets_.size());
  for (const auto& b : buckets_) stats_.bucket_numel.push_back(b->buffer.numel());
  for (std::size_t k = 0; k < params_.size(); ++k) {
    hooks_.push_back(params_[k].second.register_hook(
        [this, k](const at::Tensor& grad) { on_grad(k, grad); }));
  }
}

DataParallel::~DataParallel() {
  for (std::size_t k = 0; k < hooks_.size(); ++k) params_[k].second.remove_hook(hooks_[k]);
}

void DataParallel::verify_identical_parameters() {
  at::NoGradGuard no_grad;
  // Two float64 checksums per rank: the sum and the sum of absolute values.
  at::Tensor mine = at::zeros({2}, at::kDouble);
  for (const auto& [name, p] : params_) {
    mine[0] += p.detach().to(at::kDouble).sum().cpu();
    mine[1] += p.detach().to(at::kDouble).abs().sum().cpu();
  }
  const auto device = params_.empty() ? at::Device(at::kCPU) : params_[0].second.device();
  at::Tensor in = mine.to(device), all = at::empty({2 * comm_->size()}, in.options());
  comm_->all_gather(all, in)->synchronize();
  at::Tensor sums = all.cpu().view({comm_->size(), 2});
  std::string differ;
  for (int r = 1; r < comm_->size(); ++r) {
    if (!at::equal(sums[r], sums[0])) {
      differ += detail::str_cat(differ.empty() ? "" : "; ", "rank ", r, " (sum ",
                                sums[r][0].item<double>(), ", abs sum ", sums[r][1].item<double>(), ")");
    }
  }
  DTRAIN_CHECK_T(CommError, differ.empty(),
                 "DataParallel (DTRAIN_COMM_CHECK): parameters differ across ranks at start: rank 0 "
                 "(sum ", sums[0][0].item<double>(), ", abs sum ", sums[0][1].item<double>(),
                 ") vs ", differ);
}

void DataParallel::set_sync(bool sync) { sync_ = sync; }

void DataParallel::on_grad(std::size_t k, const at::Tensor& grad) {
  if (!sync_) return;
  at::NoGradGuard no_grad;
  if (!in_backward_) {
    in_backward_ = true;
    grads_seen_ = 0;
    stats_.launched_during_backward = 0;
    stats_.grads_before_first_launch = 0;
  }
  DTRAIN_CHECK(!seen_[k], "DataParallel: parameter '", params_[k].first,
               "' received two gradients in one backward (shared parameters need one entry)");
  seen_[k] = true;
  ++grads_seen_;
  auto& b = *buckets_[bucket_of_[k]];
  const auto& p = params_[k].second;
  at::Tensor slot = b.buffer.narrow(0, offset_of_[k], p.numel());
  // Earlier micro-batches (sync off) accumulated into .grad: include them.
  if (p.grad().defined()) {
    slot.copy_((p.grad() + grad).reshape({-1}));
  } else {
    slot.copy_(grad.reshape({-1}));
  }
  if (++b.ready == b.params.size()) launch_ready_buckets();
}

void DataParallel::launch_ready_buckets() {
  // Strictly in bucket order, so every rank issues the same collectives in the same order.
  while (next_launch_ < buckets_.size() &&
         buckets_[next_launch_]->ready == buckets_[next_launch_]->params.size()) {
    if (in_backward_ && stats_.launched_during_backward == 0) {
      stats_.grads_before_first_launch = grads_seen_;
    }
    if (in_backward_) ++stats_.launched_during_backward;
    auto& b = *buckets_[next_launch_++];
    b.work = comm_->all_reduce(b.buffer, {ReduceOp::kAvg});
  }
}

void DataParallel::finish_gradient_sync() {
  at::NoGradGuard no_grad;
  const auto start = std::chrono::steady_clock::now();
  if (buckets_.empty()) {  // one rank
    std::string missing;
    for (auto& [name, p] : params_) {
      if (p.grad().defined()) continue;
      missing += (missing.empty() ? "" : ", ") + name;
      if (options_.allow_unused) p.mutable_grad() = at::zeros_like(p);
    }
    check_unused(missing, options_.allow_unused);
    stats_.sync_wait_ms = 0;
    return;
  }
  in_backward_ = false;  // launches from here on are not overlapped with backward
  std::string missing;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    if (seen_[k]) continue;
    missing += (missing.empty() ? "" : ", ") + params_[k].first;
    auto& b = *buckets_[bucket_of_[k]];
    const auto& p = params_[k].second;
    at::Tensor slot = b.buffer.narrow(0, offset_of_[k], p.numel());
    if (p.grad().defined()) {
      slot.copy_(p.grad().reshape({-1}));
    } else {
      slot.zero_();
    }
    ++b.ready;
  }
  check_unused(missing, options_.allow_unused);
  launch_ready_buckets();
  stats_.comm_bytes = 0;
  for (auto& b : buckets_) {
    stats_.comm_bytes += wire_bytes(OpKind::kAllReduce,
                                    static_cast<double>(b->buffer.nbytes()), comm_->size());
    b->work->wait();
    for (std::size_t k : b->params) {
      auto& p = params_[k].second;
      at::Tensor reduced = b->buffer.narrow(0, offset_of_[k], p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(reduced);
      } else {
        p.mutable_grad() = reduced.to(p.scalar_type()).clone();
      }
      seen_[k] = false;
    }
    b->ready = 0;
    b->work.reset();
  }
  next_launch_ = 0;
  stats_.sync_wait_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace dtrain
