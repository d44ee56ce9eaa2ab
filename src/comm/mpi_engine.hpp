// The MPI progress engine: one thread per process that issues and polls nonblocking
// point-to-point requests (send/recv, timeout probes) and answers the peers' "where are
// you?" probes on a control communicator; and MpiWorker, the per-communicator thread
// that runs collectives. Needs MPI_THREAD_MULTIPLE.
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <c10/core/ScalarType.h>

#include "comm/peer_probe.hpp"
#include "dtrain/comm/types.hpp"

namespace dtrain::detail {

// Completion state of one submitted operation, shared by the engine and the Work.
class MpiOpState {
 public:
  // True when finished before the deadline (check error() then).
  bool wait_until(std::chrono::steady_clock::time_point deadline);
  bool done() const { return done_.load(std::memory_order_acquire); }
  std::exception_ptr error() const;
  void finish(std::exception_ptr error);

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

// Runs one communicator's collectives as blocking MPI calls, in issue order, on its own
// thread (c10d ProcessGroupMPI style): the caller goes on computing while the worker sits
// in MPI making progress, and the MPI library's tuned blocking algorithms are used (its
// nonblocking ones measured 0.6-0.75x as fast here; docs/architecture.md).
class MpiWorker {
 public:
  MpiWorker();
  // Finishes the queued work, then joins. A collective that never completes (a peer that
  // never joins) blocks here: after a TimeoutError the job should abort (MPI_Abort).
  ~MpiWorker();
  MpiWorker(const MpiWorker&) = delete;
  MpiWorker& operator=(const MpiWorker&) = delete;

  std::shared_ptr<MpiOpState> post(std::function<void()> fn);
  // post() and wait without a timeout; rethrows fn's exception.
  void run(std::function<void()> fn);

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<MpiOpState>>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class MpiEngine final : public PeerProbe, public std::enable_shared_from_this<MpiEngine> {
 public:
  // Initialises MPI with MPI_THREAD_MULTIPLE unless already initialised (then checks the
  // level), sets MPI_ERRORS_RETURN and starts the progress thread.
  static std::shared_ptr<MpiEngine> start(int* argc, char*** argv);
  ~MpiEngine() override;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // A private duplicate of MPI_COMM_WORLD for the world communicator.
  MPI_Comm world_comm() const { return world_comm_; }

  // `issue` runs on the engine thread and starts nonblocking MPI calls (send/recv),
  // appending their requests; the op is done when all of them complete. It keeps whatever
  // it captures (tensors) alive until then.
  using IssueFn = std::function<void(std::vector<MPI_Request>&)>;
  std::shared_ptr<MpiOpState> submit(IssueFn issue);
  // Cancels what can be cancelled of an unfinished op and forgets it (used for probes
  // whose peers never answered). Collectives cannot be abandoned.
  void abandon(const std::shared_ptr<MpiOpState>& op);

  // MPI datatype for a tensor dtype; bfloat16/float16 travel as 16-bit words.
  static MPI_Datatype datatype(c10::ScalarType dtype);
  // Reduction op; bfloat16/float16 use user-defined ops that compute in float32.
  MPI_Op reduce_op(ReduceOp op, c10::ScalarType dtype) const;

  std::vector<PeerState> query(std::uint64_t uid, const std::vector<int>& world_ranks,
                               Timeout grace) override;

 private:
  MpiEngine() = default;
  void loop();
  void start_control_recv();
  void service_control();
  void stop();

  struct Task {
    IssueFn issue;
    std::shared_ptr<MpiOpState> state;
    std::vector<MPI_Request> requests;
  };

  int world_rank_ = 0;
  int world_size_ = 1;
  bool owns_mpi_ = false;
  MPI_Comm world_comm_ = MPI_COMM_NULL;
  MPI_Comm control_comm_ = MPI_COMM_NULL;
  MPI_Op half_ops_[2][3] = {};  // [bf16, f16][sum, max, min]

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> pending_;                              // guarded by mutex_
  std::vector<std::shared_ptr<MpiOpState>> to_abandon_;  // guarded by mutex_
  bool stopping_ = false;                                 // guarded by mutex_
  std::deque<Task> active_;                               // engine thread only
  std::vector<Task> graveyard_;                           // abandoned ops, engine thread
  std::thread thread_;

  // Control channel (engine thread only): one posted receive for incoming queries and
  // the replies in flight.
  std::int64_t query_in_[2] = {0, 0};
  MPI_Request query_req_ = MPI_REQUEST_NULL;
  std::deque<std::pair<std::array<std::int64_t, 4>, MPI_Request>> replies_;
  std::atomic<std::int64_t> next_query_id_{1};
};

}  // namespace dtrain::detail
