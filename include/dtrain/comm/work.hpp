// Work: the handle an asynchronous collective returns. The caller keeps computing and calls
// wait() before it touches the tensors; the Work keeps those tensors alive until then.
#pragma once

#include <cstdint>
#include <memory>

#include "dtrain/comm/types.hpp"

namespace dtrain {

// Contract: results are valid only after wait() returned. MPI backend: wait() blocks the
// host until the op is done. NCCL backend: wait() makes the caller's current CUDA stream
// wait for the op (no host block); synchronize() blocks the host. Both raise TimeoutError
// after the op's timeout, naming the ranks that did not arrive, and rethrow backend errors.
// wait() may be called again after it threw (an op that completes late then succeeds).
// Thread-safety: wait()/completed() may be called from any one thread at a time.
class Work {
 public:
  Work(OpKind kind, std::uint64_t seq) : kind_(kind), seq_(seq) {}
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  virtual void wait() = 0;
  // True once the communication has finished (never blocks). Call wait() anyway before
  // reading results: finishing steps such as the division of an average run there.
  virtual bool completed() = 0;
  // Blocks the host until the op is done (same as wait() for host backends).
  virtual void synchronize() { wait(); }

  OpKind kind() const { return kind_; }
  // Position of this collective in its communicator's order (1-based; 0 for send/recv).
  std::uint64_t seq() const { return seq_; }

 private:
  OpKind kind_;
  std::uint64_t seq_;
};

using WorkPtr = std::shared_ptr<Work>;

// A Work that was done when created (size-1 communicators, empty tensors).
class CompletedWork final : public Work {
 public:
  using Work::Work;
  void wait() override {}
  bool completed() override { return true; }
};

WorkPtr make_completed_work(OpKind kind, std::uint64_t seq = 0);

}  // namespace dtrain
