// MPI backend: collectives run as blocking MPI calls on the communicator's MpiWorker
// thread, in issue order; send/recv are nonblocking requests polled by the MpiEngine
// thread. Work::wait() blocks the caller with the op's timeout.
#include "comm/mpi_communicator.hpp"

#include <ATen/ATen.h>

#include <climits>
#include <mutex>

#include "dtrain/core/error.hpp"

namespace dtrain::detail {

namespace {

// Op description for error messages, built lazily (formatting costs a microsecond).
using Describe = std::function<std::string()>;

class MpiWork final : public Work {
 public:
  MpiWork(OpKind kind, std::uint64_t seq, std::shared_ptr<MpiOpState> state, Timeout timeout,
          std::shared_ptr<const Communicator> comm, Describe what,
          std::function<void()> finish)
      : Work(kind, seq),
        state_(std::move(state)),
        timeout_(timeout),
        comm_(std::move(comm)),
        what_(std::move(what)),
        finish_(std::move(finish)) {}

  bool completed() override { return state_->done(); }

  void wait() override;

 private:
  std::shared_ptr<MpiOpState> state_;
  Timeout timeout_;
  std::shared_ptr<const Communicator> comm_;
  Describe what_;  // formatted only when a timeout needs it
  std::function<void()> finish_;  // runs once on the waiting thread (e.g. avg's division)
  std::once_flag finished_;
};

int checked_count(std::int64_t n, const char* what) {
  DTRAIN_CHECK_ARG(n <= INT_MAX, "MPI backend: ", what, " of ", n,
                   " elements exceeds MPI's int count limit (", INT_MAX, ")");
  return static_cast<int>(n);
}

std::string describe_tensor(const at::Tensor& t) {
  return str_cat(c10::toString(t.scalar_type()), " x ", t.numel());
}

}  // namespace

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::shared_ptr<MpiEngine> engine, MPI_Comm comm, const std::string& name,
                  std::vector<int> world_ranks, std::uint64_t uid, Timeout timeout, int rank)
      : Communicator(Backend::kMpi, name, rank, std::move(world_ranks), uid, timeout),
        engine_(std::move(engine)),
        comm_(comm),
        worker_(std::make_unique<MpiWorker>()) {}

  ~MpiCommunicator() override {
    // Queued ops finish first; then the communicator is freed on the worker.
    worker_->post([c = comm_]() mutable { MPI_Comm_free(&c); });
    worker_.reset();
  }

  std::string timeout_text(OpKind kind, std::uint64_t seq, Timeout timeout,
                           const std::string& what) const {
    return timeout_message(kind, seq, timeout, what);
  }

 protected:
  void check_tensor_device(const at::Tensor& t, const char* arg) const override {
    DTRAIN_CHECK_ARG(t.device().is_cpu(), "communicator ", describe(), ": argument '", arg,
                     "' is on ", t.device(),
                     "; the MPI backend takes CPU tensors (use the NCCL communicator for CUDA)");
  }

  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op, std::uint64_t seq,
                        Timeout timeout) override {
    const int n = checked_count(t.numel(), "all_reduce");
    const MPI_Datatype dt = MpiEngine::datatype(t.scalar_type());
    const MPI_Op mop = engine_->reduce_op(op, t.scalar_type());
    auto state = worker_->post([t, n, dt, mop, c = comm_] {
      DTRAIN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), n, dt, mop, c));
    });
    return make_work(OpKind::kAllReduce, seq, state, timeout,
                     [t, op] { return str_cat(describe_tensor(t), ", ", to_string(op)); },
                     average(t, op));
  }

  WorkPtr do_broadcast(const at::Tensor& t, int root, std::uint64_t seq,
                       Timeout timeout) override {
    const int n = checked_count(t.numel(), "broadcast");
    const MPI_Datatype dt = MpiEngine::datatype(t.scalar_type());
    auto state = worker_->post([t, n, dt, root, c = comm_] {
      DTRAIN_MPI_CHECK(MPI_Bcast(t.data_ptr(), n, dt, root, c));
    });
    return make_work(OpKind::kBroadcast, seq, state, timeout,
                     [t, root] { return str_cat(describe_tensor(t), ", root ", root); }, nullptr);
  }

  WorkPtr do_all_gather(const at::Tensor& out, const at::Tensor& in, std::uint64_t seq,
                        Timeout timeout) override {
    const int n = checked_count(in.numel(), "all_gather");
    checked_count(out.numel(), "all_gather output");
    const MPI_Datatype dt = MpiEngine::datatype(in.scalar_type());
    // In place when the input already sits at this rank's slot of the output.
    const bool in_place = in.numel() > 0 &&
                          static_cast<const char*>(in.data_ptr()) ==
                              static_cast<const char*>(out.data_ptr()) +
                                  static_cast<std::int64_t>(rank()) * in.nbytes();
    auto state = worker_->post([out, in, n, dt, in_place, c = comm_] {
      DTRAIN_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : in.data_ptr(), n, dt,
                                     out.data_ptr(), n, dt, c));
    });
    return make_work(OpKind::kAllGather, seq, state, timeout,
                     [in] { return describe_tensor(in); }, nullptr);
  }

  WorkPtr do_reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op,
                            std::uint64_t seq, Timeout timeout) override {
    const int n = checked_count(out.numel(), "reduce_scatter");
    checked_count(in.numel(), "reduce_scatter input");
    const MPI_Datatype dt = MpiEngine::datatype(in.scalar_type());
    const MPI_Op mop = engine_->reduce_op(op, in.scalar_type());
    auto state = worker_->post([out, in, n, dt, mop, c = comm_] {
      DTRAIN_MPI_CHECK(MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), n, dt, mop, c));
    });
    return make_work(OpKind::kReduceScatter, seq, state, timeout,
                     [in, op] { return str_cat(describe_tensor(in), ", ", to_string(op)); },
                     average(out, op));
  }

  WorkPtr do_all_to_all(const at::Tensor& out, const at::Tensor& in,
                        const std::vector<std::int64_t>& out_counts,
                        const std::vector<std::int64_t>& in_counts, std::uint64_t seq,
                        Timeout timeout) override {
    const MPI_Datatype dt = MpiEngine::datatype(in.scalar_type());
    checked_count(in.numel(), "all_to_all input");
    checked_count(out.numel(), "all_to_all output");
    bool equal = true;
    for (int r = 0; r < size(); ++r) {
      equal = equal && in_counts[r] == in_counts[0] && out_counts[r] == in_counts[0];
    }
    std::shared_ptr<MpiOpState> state;
    if (equal) {
      const int n = static_cast<int>(in_counts[0]);
      state = worker_->post([out, in, n, dt, c = comm_] {
        DTRAIN_MPI_CHECK(MPI_Alltoall(in.data_ptr(), n, dt, out.data_ptr(), n, dt, c));
      });
    } else {
      std::vector<int> sc(size()), sd(size()), rc(size()), rd(size());
      for (int r = 0, so = 0, ro = 0; r < size(); ++r) {
        sc[r] = static_cast<int>(in_counts[r]);
        rc[r] = static_cast<int>(out_counts[r]);
        sd[r] = so;
        rd[r] = ro;
        so += sc[r];
        ro += rc[r];
      }
      state = worker_->post([out, in, sc, sd, rc, rd, dt, c = comm_] {
        DTRAIN_MPI_CHECK(MPI_Alltoallv(in.data_ptr(), sc.data(), sd.data(), dt, out.data_ptr(),
                                       rc.data(), rd.data(), dt, c));
      });
    }
    return make_work(OpKind::kAllToAll, seq, state, timeout,
                     [in, equal] {
                       return str_cat(describe_tensor(in), equal ? ", equal splits" : ", uneven");
                     },
                     nullptr);
  }

  // Point-to-point stays nonblocking (a blocking send would hold the worker and deadlock
  // rings): the engine thread issues and polls it.
  WorkPtr do_send(const at::Tensor& t, int dst, int tag, Timeout timeout) override {
    const int n = checked_count(t.numel(), "send");
    const MPI_Datatype dt = MpiEngine::datatype(t.scalar_type());
    auto state = engine_->submit([t, n, dt, dst, tag, c = comm_](std::vector<MPI_Request>& reqs) {
      reqs.emplace_back();
      DTRAIN_MPI_CHECK(MPI_Isend(t.data_ptr(), n, dt, dst, tag, c, &reqs.back()));
    });
    return make_work(OpKind::kSend, 0, state, timeout,
                     [t, dst, tag] { return str_cat(describe_tensor(t), " to rank ", dst, " tag ", tag); },
                     nullptr);
  }

  WorkPtr do_recv(const at::Tensor& t, int src, int tag, Timeout timeout) override {
    const int n = checked_count(t.numel(), "recv");
    const MPI_Datatype dt = MpiEngine::datatype(t.scalar_type());
    auto state = engine_->submit([t, n, dt, src, tag, c = comm_](std::vector<MPI_Request>& reqs) {
      reqs.emplace_back();
      DTRAIN_MPI_CHECK(MPI_Irecv(t.data_ptr(), n, dt, src, tag, c, &reqs.back()));
    });
    return make_work(OpKind::kRecv, 0, state, timeout,
                     [t, src, tag] { return str_cat(describe_tensor(t), " from rank ", src, " tag ", tag); },
                     nullptr);
  }

  WorkPtr do_barrier(std::uint64_t seq, Timeout timeout) override {
    auto state = worker_->post([c = comm_] { DTRAIN_MPI_CHECK(MPI_Barrier(c)); });
    return make_work(OpKind::kBarrier, seq, state, timeout, nullptr, nullptr);
  }

  CommPtr do_split(int color, int key, const std::string& name, std::uint64_t uid,
                   Timeout timeout) override {
    MPI_Comm child = MPI_COMM_NULL;
    std::vector<int> members;
    int child_rank = 0;
    worker_->run([&] {
      DTRAIN_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child));
      if (child == MPI_COMM_NULL) return;
      int n = 0;
      DTRAIN_MPI_CHECK(MPI_Comm_size(child, &n));
      DTRAIN_MPI_CHECK(MPI_Comm_rank(child, &child_rank));
      DTRAIN_MPI_CHECK(MPI_Comm_set_errhandler(child, MPI_ERRORS_RETURN));
      // World ranks of the members, through the groups.
      MPI_Group world_group, child_group;
      DTRAIN_MPI_CHECK(MPI_Comm_group(engine_->world_comm(), &world_group));
      DTRAIN_MPI_CHECK(MPI_Comm_group(child, &child_group));
      std::vector<int> local(n);
      members.resize(n);
      for (int i = 0; i < n; ++i) local[i] = i;
      DTRAIN_MPI_CHECK(
          MPI_Group_translate_ranks(child_group, n, local.data(), world_group, members.data()));
      MPI_Group_free(&child_group);
      MPI_Group_free(&world_group);
      if (n == 1) DTRAIN_MPI_CHECK(MPI_Comm_free(&child));
    });
    if (members.empty()) return nullptr;
    if (members.size() == 1) return make_self_communicator(name, members[0], uid, timeout);
    return std::make_shared<MpiCommunicator>(engine_, child, name, std::move(members), uid,
                                             timeout, child_rank);
  }

 private:
  WorkPtr make_work(OpKind kind, std::uint64_t seq, std::shared_ptr<MpiOpState> state,
                    Timeout timeout, Describe what, std::function<void()> finish) const {
    return std::make_shared<MpiWork>(kind, seq, std::move(state), timeout, shared_from_this(),
                                     std::move(what), std::move(finish));
  }

  // The division that turns a sum into an average (truncating for integer dtypes).
  std::function<void()> average(const at::Tensor& t, ReduceOp op) const {
    if (op != ReduceOp::kAvg) return nullptr;
    const int n = size();
    return [t, n]() {
      if (at::isFloatingType(t.scalar_type())) {
        t.div_(n);
      } else {
        t.div_(n, "trunc");
      }
    };
  }

  std::shared_ptr<MpiEngine> engine_;
  MPI_Comm comm_;
  std::unique_ptr<MpiWorker> worker_;
};

void MpiWork::wait() {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  if (!state_->wait_until(deadline)) {
    const auto* mpi = static_cast<const MpiCommunicator*>(comm_.get());
    throw TimeoutError(
        located(mpi->timeout_text(kind(), seq(), timeout_, what_ ? what_() : std::string()), "Work::wait", __FILE__,
                __LINE__));
  }
  if (auto err = state_->error()) std::rethrow_exception(err);
  if (finish_) std::call_once(finished_, finish_);
}

CommPtr make_mpi_world(const std::shared_ptr<MpiEngine>& engine, Timeout timeout) {
  const int n = engine->world_size();
  if (n == 1) return make_self_communicator("world", 0, fnv1a("world"), timeout);
  std::vector<int> ranks(n);
  for (int i = 0; i < n; ++i) ranks[i] = i;
  MPI_Comm comm = MPI_COMM_NULL;
  DTRAIN_MPI_CHECK(MPI_Comm_dup(engine->world_comm(), &comm));
  DTRAIN_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  return std::make_shared<MpiCommunicator>(engine, comm, "world", std::move(ranks),
                                           fnv1a("world"), timeout, engine->world_rank());
}

}  // namespace dtrain::detail
