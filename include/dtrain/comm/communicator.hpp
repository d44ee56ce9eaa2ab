// Communicator: the one interface every parallel strategy uses to talk across ranks.
// Backends: MPI (CPU tensors), NCCL (CUDA tensors) and Self (size 1, does nothing).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/types.hpp"
#include "dtrain/comm/work.hpp"

namespace dtrain {

// One operation of Communicator::batch_p2p.
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;
  int peer = 0;
  int tag = 0;
};

namespace detail {
struct CommProgress;  // per-communicator counters read by the peer probe (src/comm)
}

// Ordering contract: every member issues the same collectives in the same order (as in
// MPI and c10d); send/recv pair up per (peer, tag) in issue order. One tensor per call;
// all_gather writes and reduce_scatter reads one flat tensor holding the ranks' pieces in
// rank order. All tensors must be contiguous and on the backend's device.
//
// Stream semantics: see Work. Ownership: a Communicator is shared (shared_ptr); Work
// handles keep their tensors alive. Thread-safety: issue collectives from one thread at a
// time; Work handles may be waited on from that thread.
//
// Errors: invalid arguments raise InvalidArgument naming the argument, its value and what
// is allowed; ops that do not finish within the timeout raise TimeoutError naming the
// communicator, op, sequence number and the ranks that did not arrive. With
// DTRAIN_COMM_CHECK=1 every collective first cross-checks (op, dtype, numel, reduce op,
// root, seq) across ranks and raises CommError listing the diverging ranks.
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  Backend backend() const { return backend_; }
  // World rank of each member, indexed by rank in this communicator.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  Timeout default_timeout() const { return timeout_; }
  // Collectives issued so far (the seq of the last one).
  std::uint64_t seq() const;

  WorkPtr all_reduce(const at::Tensor& tensor, const ReduceOptions& opts = {});
  WorkPtr broadcast(const at::Tensor& tensor, const BroadcastOptions& opts = {});
  // output.numel() == input.numel() * size(); rank r's input lands at offset r * numel.
  // An input that is exactly rank()'s slice of output is gathered in place.
  WorkPtr all_gather(const at::Tensor& output, const at::Tensor& input,
                     const CollectiveOptions& opts = {});
  // input.numel() == output.numel() * size(); rank r receives the reduction of slice r.
  WorkPtr reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                         const ReduceOptions& opts = {});
  // Rows along dim 0: equal splits by default, uneven with opts.{input,output}_splits.
  WorkPtr all_to_all(const at::Tensor& output, const at::Tensor& input,
                     const AllToAllOptions& opts = {});
  WorkPtr send(const at::Tensor& tensor, int dst, const P2POptions& opts = {});
  WorkPtr recv(const at::Tensor& tensor, int src, const P2POptions& opts = {});
  // Issues several sends and receives at once, one Work per operation (in order). NCCL
  // runs them as one group, so a send and a receive crossing between two ranks (each
  // sending, then receiving) cannot wait on each other; MPI posts them all before any is
  // waited. Each operation is checked as send()/recv() check theirs.
  std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops, Timeout timeout = Timeout{0});
  WorkPtr barrier(const CollectiveOptions& opts = {});

  // Collective over this communicator: members with the same color form a new
  // communicator ordered by (key, rank). color < 0 returns nullptr for that member.
  // A resulting group of one member is a Self communicator.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name);

 protected:
  // uid identifies the communicator across processes (same on every member).
  // The size is world_ranks.size().
  Communicator(Backend backend, std::string name, int rank, std::vector<int> world_ranks,
               std::uint64_t uid, Timeout timeout);

  // Backend hooks: arguments are validated, seq assigned and (in check mode) verified.
  virtual void check_tensor_device(const at::Tensor& t, const char* arg) const = 0;
  // Device of the small tensors the communicator exchanges for its own checks.
  virtual at::Device check_device() const { return at::Device(at::kCPU); }
  virtual WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op, std::uint64_t seq,
                                Timeout timeout) = 0;
  virtual WorkPtr do_broadcast(const at::Tensor& t, int root, std::uint64_t seq,
                               Timeout timeout) = 0;
  virtual WorkPtr do_all_gather(const at::Tensor& out, const at::Tensor& in, std::uint64_t seq,
                                Timeout timeout) = 0;
  virtual WorkPtr do_reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op,
                                    std::uint64_t seq, Timeout timeout) = 0;
  // Splits are in elements (rows x row numel), one per rank.
  virtual WorkPtr do_all_to_all(const at::Tensor& out, const at::Tensor& in,
                                const std::vector<std::int64_t>& out_counts,
                                const std::vector<std::int64_t>& in_counts, std::uint64_t seq,
                                Timeout timeout) = 0;
  virtual WorkPtr do_send(const at::Tensor& t, int dst, int tag, Timeout timeout) = 0;
  virtual WorkPtr do_recv(const at::Tensor& t, int src, int tag, Timeout timeout) = 0;
  // Default: do_send / do_recv for each operation in order (both non-blocking).
  virtual std::vector<WorkPtr> do_batch_p2p(const std::vector<P2POp>& ops, Timeout timeout);
  virtual WorkPtr do_barrier(std::uint64_t seq, Timeout timeout) = 0;
  // Called after a barrier on this communicator succeeded, so every member is present.
  virtual std::shared_ptr<Communicator> do_split(int color, int key, const std::string& name,
                                                 std::uint64_t uid, Timeout timeout) = 0;

  Timeout resolve(Timeout t) const { return t.count() > 0 ? t : timeout_; }
  // Description used in errors: "'world' (mpi, rank 1 of 4)".
  std::string describe() const;
  // Message for a timed-out op; asks the peers (via the peer probe) where they are.
  std::string timeout_message(OpKind kind, std::uint64_t seq, Timeout timeout,
                              const std::string& what) const;
  const std::shared_ptr<detail::CommProgress>& progress() const { return progress_; }

 private:
  std::uint64_t begin_collective(OpKind kind, const at::Tensor* t, ReduceOp op, int root);
  void check_tensor(const at::Tensor& t, const char* arg) const;
  void check_peer(int peer, const char* arg) const;
  void cross_check(OpKind kind, const at::Tensor* t, ReduceOp op, int root,
                   std::uint64_t seq);

  Backend backend_;
  std::string name_;
  int rank_;
  int size_;
  std::vector<int> world_ranks_;
  Timeout timeout_;
  bool cross_check_;
  std::shared_ptr<detail::CommProgress> progress_;
  std::uint64_t splits_ = 0;
};

using CommPtr = std::shared_ptr<Communicator>;

// A communicator of one member: collectives are local copies or nothing.
// uid 0 derives one from the name.
CommPtr make_self_communicator(const std::string& name, int world_rank, std::uint64_t uid = 0,
                               Timeout timeout = Timeout{0});

}  // namespace dtrain
