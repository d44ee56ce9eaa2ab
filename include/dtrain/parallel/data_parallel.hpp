// DataParallel: gradient averaging across the data-parallel ranks, overlapped with the
// backward pass. Gradients are packed into buckets (reverse registration order, default
// 25 MiB); a bucket's asynchronous all-reduce starts as soon as all its gradients exist.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/optim/optim.hpp"

namespace dtrain {

struct DataParallelOptions {
  std::int64_t bucket_bytes = 25 * 1024 * 1024;
  bool bf16_reduce = false;    // reduce gradients in bfloat16 (half the traffic)
  bool allow_unused = false;   // a parameter without a gradient is an error by default
  bool broadcast_parameters = true;  // copy rank 0's parameters to every rank at start
  // With DTRAIN_COMM_CHECK=1 the constructor also verifies, by checksums, that every rank
  // then holds the same parameters (CommError naming the ranks that differ).
};

struct DataParallelStats {
  std::int64_t buckets = 0;
  std::int64_t launched_during_backward = 0;  // last sync: buckets issued from the hooks
  std::int64_t grads_before_first_launch = 0;  // last sync: gradients seen at 1st issue
  double sync_wait_ms = 0;  // last sync: time finish_gradient_sync blocked (exposed comm)
  std::vector<std::int64_t> bucket_numel;  // elements per bucket, in launch order
  double comm_bytes = 0;  // last sync: bytes each rank sent (comm/types.hpp wire_bytes)
};

// Usage per optimizer step: for each micro-batch, set_sync(is_last) then backward; then
// finish_gradient_sync() before clipping and the optimizer step. Over a communicator of
// one rank nothing is bucketed or copied (stats().buckets is 0); only the unused-parameter
// check remains. With sync off, gradients
// accumulate locally and nothing is communicated. Not copyable; holds hooks on the
// parameters (removed on destruction). Gradients are averaged over the communicator.
class DataParallel {
 public:
  DataParallel(NamedParameters params, CommPtr dp_comm, DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  void set_sync(bool sync);
  // Waits for every bucket and writes the averaged gradients into param.grad(). Raises
  // InvalidArgument naming the parameters that received no gradient (unless allowed).
  void finish_gradient_sync();
  const DataParallelStats& stats() const { return stats_; }
  const CommPtr& comm() const { return comm_; }

 private:
  struct Bucket;
  void verify_identical_parameters();
  void on_grad(std::size_t index, const at::Tensor& grad);
  void launch_ready_buckets();

  NamedParameters params_;
  CommPtr comm_;
  DataParallelOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::size_t> bucket_of_;   // parameter -> bucket
  std::vector<std::int64_t> offset_of_;  // parameter -> element offset in its bucket
  std::vector<bool> seen_;               // parameter received its gradient this sync
  std::vector<unsigned> hooks_;
  std::size_t next_launch_ = 0;
  std::int64_t grads_seen_ = 0;
  bool sync_ = true;
  bool in_backward_ = false;
  DataParallelStats stats_;
};

}  // namespace dtrain
