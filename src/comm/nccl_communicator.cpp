// NCCL backend: ops on a per-communicator stream from the c10 pool, ordered after the
// caller's stream with events; Work::wait() makes the caller's stream wait on the op's end
// event; a watchdog thread aborts the communicator when an op outlives its timeout or NCCL
// reports an asynchronous error, and later calls raise that error.
#include "comm/nccl_communicator.hpp"

#include "comm/peer_probe.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <condition_variable>
#include <list>
#include <mutex>
#include <thread>

#include "dtrain/core/error.hpp"
#include "dtrain/core/logging.hpp"

namespace dtrain::detail {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

namespace {

ncclDataType_t nccl_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return ncclFloat32;
    case c10::kDouble: return ncclFloat64;
    case c10::kBFloat16: return ncclBfloat16;
    case c10::kHalf: return ncclFloat16;
    case c10::kInt: return ncclInt32;
    case c10::kLong: return ncclInt64;
    case c10::kByte: return ncclUint8;
    default:
      throw InvalidArgument(str_cat("NCCL backend: dtype ", t, " is not supported"));
  }
}

ncclRedOp_t nccl_op(ReduceOp op, c10::ScalarType t) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return at::isFloatingType(t) ? ncclAvg : ncclSum;  // ints: sum, /n
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// Owned CUDA event (timing disabled: only ordering and completion).
struct Event {
  cudaEvent_t ev = nullptr;
  Event() { DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)); }
  ~Event() {
    if (ev) cudaEventDestroy(ev);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

}  // namespace

class NcclCommunicator;

// State the watchdog shares with a Work: the op's end event and deadline.
struct NcclInflight {
  std::shared_ptr<Event> end;
  std::chrono::steady_clock::time_point deadline;
  Timeout timeout;
  OpKind kind;
  std::uint64_t seq;
  std::string what;
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclCommunicator> comm, std::shared_ptr<NcclInflight> op,
           std::vector<at::Tensor> keep, std::function<void()> finish, Timeout timeout)
      : Work(op->kind, op->seq),
        comm_(std::move(comm)),
        op_(std::move(op)),
        keep_(std::move(keep)),
        finish_(std::move(finish)),
        timeout_(timeout) {}

  bool completed() override;
  void wait() override;
  void synchronize() override;

 private:
  std::shared_ptr<NcclCommunicator> comm_;
  std::shared_ptr<NcclInflight> op_;
  std::vector<at::Tensor> keep_;
  std::function<void()> finish_;
  Timeout timeout_;
  std::once_flag finished_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, const std::string& name, int rank,
                   std::vector<int> world_ranks, std::uint64_t uid, Timeout timeout)
      : Communicator(Backend::kNccl, name, rank, std::move(world_ranks), uid, timeout),
        comm_(comm),
        device_(static_cast<c10::DeviceIndex>(device)),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)) {
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (!aborted_) ncclCommDestroy(comm_);
  }

  c10::DeviceIndex device() const { return device_; }

  // Raises the error recorded by the watchdog (timeout or async NCCL error), if any.
  void raise_if_failed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) return;
    if (failure_is_timeout_) throw TimeoutError(failure_);
    throw CommError(failure_);
  }

  // Blocks until op finished; aborts the communicator and raises on timeout.
  void synchronize(const NcclInflight& op, Timeout timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      raise_if_failed();
      const cudaError_t q = cudaEventQuery(op.end->ev);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) DTRAIN_CUDA_CHECK(q);
      if (std::chrono::steady_clock::now() > deadline) {
        fail(timeout_message(op.kind, op.seq, timeout, op.what), true);
        raise_if_failed();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 protected:
  void check_tensor_device(const at::Tensor& t, const char* arg) const override {
    DTRAIN_CHECK_ARG(t.is_cuda() && t.device().index() == device_, "communicator ",
                     describe(), ": argument '", arg, "' is on ", t.device(),
                     "; this NCCL communicator takes tensors on cuda:", int(device_));
  }
  at::Device check_device() const override { return at::Device(at::kCUDA, device_); }

  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op, std::uint64_t seq,
                        Timeout timeout) override {
    return launch(OpKind::kAllReduce, seq, timeout, str_cat(c10::toString(t.scalar_type()), " x ", t.numel(), ", ", to_string(op)), {t},
                  [&](cudaStream_t s) {
                    DTRAIN_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(),
                                                    nccl_dtype(t.scalar_type()),
                                                    nccl_op(op, t.scalar_type()), comm_, s));
                  },
                  integer_average(t, op));
  }

  WorkPtr do_broadcast(const at::Tensor& t, int root, std::uint64_t seq,
                       Timeout timeout) override {
    return launch(OpKind::kBroadcast, seq, timeout, str_cat("root ", root), {t},
                  [&](cudaStream_t s) {
                    DTRAIN_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(),
                                                    nccl_dtype(t.scalar_type()), root, comm_,
                                                    s));
                  });
  }

  WorkPtr do_all_gather(const at::Tensor& out, const at::Tensor& in, std::uint64_t seq,
                        Timeout timeout) override {
    return launch(OpKind::kAllGather, seq, timeout, str_cat(in.numel(), " elements"), {out, in},
                  [&](cudaStream_t s) {
                    DTRAIN_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(),
                                                    nccl_dtype(in.scalar_type()), comm_, s));
                  });
  }

  WorkPtr do_reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op,
                            std::uint64_t seq, Timeout timeout) override {
    return launch(OpKind::kReduceScatter, seq, timeout, str_cat(in.numel(), " elements, ", to_string(op)), {out, in},
                  [&](cudaStream_t s) {
                    DTRAIN_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(),
                                                        out.numel(),
                                                        nccl_dtype(in.scalar_type()),
                                                        nccl_op(op, in.scalar_type()), comm_,
                                                        s));
                  },
                  integer_average(out, op));
  }

  WorkPtr do_all_to_all(const at::Tensor& out, const at::Tensor& in,
                        const std::vector<std::int64_t>& out_counts,
                        const std::vector<std::int64_t>& in_counts, std::uint64_t seq,
                        Timeout timeout) override {
    return launch(OpKind::kAllToAll, seq, timeout, str_cat(in.numel(), " elements"), {out, in},
                  [&](cudaStream_t s) {
                    const auto dt = nccl_dtype(in.scalar_type());
                    const auto esize = in.element_size();
                    auto* src = static_cast<char*>(in.data_ptr());
                    auto* dst = static_cast<char*>(out.data_ptr());
                    DTRAIN_NCCL_CHECK(ncclGroupStart());
                    std::int64_t so = 0, ro = 0;
                    for (int r = 0; r < size(); ++r) {
                      DTRAIN_NCCL_CHECK(ncclSend(src + so * esize, in_counts[r], dt, r, comm_, s));
                      DTRAIN_NCCL_CHECK(ncclRecv(dst + ro * esize, out_counts[r], dt, r, comm_, s));
                      so += in_counts[r];
                      ro += out_counts[r];
                    }
                    DTRAIN_NCCL_CHECK(ncclGroupEnd());
                  });
  }

  WorkPtr do_send(const at::Tensor& t, int dst, int tag, Timeout timeout) override {
    if (tag != 0) warn_once("nccl-tag", "NCCL matches send/recv by order per peer; tags are ignored");
    return launch(OpKind::kSend, 0, timeout, str_cat("to rank ", dst), {t}, [&](cudaStream_t s) {
      DTRAIN_NCCL_CHECK(ncclSend(t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), dst, comm_, s));
    });
  }

  WorkPtr do_recv(const at::Tensor& t, int src, int tag, Timeout timeout) override {
    if (tag != 0) warn_once("nccl-tag", "NCCL matches send/recv by order per peer; tags are ignored");
    return launch(OpKind::kRecv, 0, timeout, str_cat("from rank ", src), {t}, [&](cudaStream_t s) {
      DTRAIN_NCCL_CHECK(ncclRecv(t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), src, comm_, s));
    });
  }

  // One NCCL group on the communicator's stream; every operation's Work is the group's.
  std::vector<WorkPtr> do_batch_p2p(const std::vector<P2POp>& ops, Timeout timeout) override {
    std::vector<at::Tensor> tensors;
    for (const auto& op : ops) {
      if (op.tag != 0) warn_once("nccl-tag", "NCCL matches send/recv by order per peer; tags are ignored");
      tensors.push_back(op.tensor);
    }
    auto work = launch(OpKind::kSend, 0, timeout, str_cat(ops.size(), " batched send/recv"), tensors,
                       [&](cudaStream_t s) {
                         DTRAIN_NCCL_CHECK(ncclGroupStart());
                         for (const auto& op : ops) {
                           const auto& t = op.tensor;
                           if (op.kind == P2POp::Kind::kSend) {
                             DTRAIN_NCCL_CHECK(ncclSend(t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), op.peer, comm_, s));
                           } else {
                             DTRAIN_NCCL_CHECK(ncclRecv(t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), op.peer, comm_, s));
                           }
                         }
                         DTRAIN_NCCL_CHECK(ncclGroupEnd());
                       });
    return std::vector<WorkPtr>(ops.size(), work);
  }

  WorkPtr do_barrier(std::uint64_t seq, Timeout timeout) override {
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
    return launch(OpKind::kBarrier, seq, timeout, "", {one}, [&](cudaStream_t s) {
      DTRAIN_NCCL_CHECK(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclInt32, ncclSum, comm_, s));
    });
  }

  CommPtr do_split(int color, int key, const std::string& name, std::uint64_t uid,
                   Timeout timeout) override {
    raise_if_failed();
    c10::cuda::CUDAGuard guard(device_);
    ncclComm_t child = nullptr;
    DTRAIN_NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr));
    if (child == nullptr) return nullptr;
    int n = 0, r = 0;
    DTRAIN_NCCL_CHECK(ncclCommCount(child, &n));
    DTRAIN_NCCL_CHECK(ncclCommUserRank(child, &r));
    // Learn the members' world ranks through the child itself.
    auto opts = at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_);
    at::Tensor mine = at::full({1}, world_ranks()[rank()], opts);
    at::Tensor all = at::empty({n}, opts);
    cudaStream_t s = c10::cuda::getCurrentCUDAStream(device_).stream();
    DTRAIN_NCCL_CHECK(ncclAllGather(mine.data_ptr(), all.data_ptr(), 1, ncclInt32, child, s));
    at::Tensor host = all.cpu();  // synchronizes
    std::vector<int> members(host.data_ptr<int>(), host.data_ptr<int>() + n);
    if (n == 1) {
      DTRAIN_NCCL_CHECK(ncclCommDestroy(child));
      return make_self_communicator(name, members[0], uid, timeout);
    }
    return std::make_shared<NcclCommunicator>(child, device_, name, r, std::move(members), uid, timeout);
  }

 private:
  template <typename Issue>
  WorkPtr launch(OpKind kind, std::uint64_t seq, Timeout timeout, std::string what,
                 std::vector<at::Tensor> tensors, Issue&& issue,
                 std::function<void()> finish = nullptr) {
    raise_if_failed();
    c10::cuda::CUDAGuard guard(device_);
    auto op = std::make_shared<NcclInflight>();
    op->end = std::make_shared<Event>();
    op->deadline = std::chrono::steady_clock::now() + timeout;
    op->timeout = timeout;
    op->kind = kind;
    op->seq = seq;
    op->what = std::move(what);
    Event start;
    cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_).stream();
    DTRAIN_CUDA_CHECK(cudaEventRecord(start.ev, caller));
    DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), start.ev, 0));
    issue(stream_.stream());
    DTRAIN_CUDA_CHECK(cudaEventRecord(op->end->ev, stream_.stream()));
    for (const auto& t : tensors) {
      // The allocator must not hand this memory out again before our stream is done.
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inflight_.push_back(op);
    }
    cv_.notify_all();
    return std::make_shared<NcclWork>(
        std::static_pointer_cast<NcclCommunicator>(shared_from_this()), op, std::move(tensors),
        std::move(finish), timeout);
  }

  std::function<void()> integer_average(const at::Tensor& t, ReduceOp op) const {
    if (op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type())) return nullptr;
    const int n = size();
    return [t, n]() { t.div_(n, "trunc"); };
  }

  void fail(const std::string& message, bool timeout) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failure_.empty()) return;
      failure_ = located(message, "NCCL watchdog", __FILE__, __LINE__);
      failure_is_timeout_ = timeout;
    }
    log_error("{}; aborting the NCCL communicator", message);
    aborted_ = true;
    ncclCommAbort(comm_);  // unblocks kernels stuck waiting for peers; frees comm_
  }

  // Watchdog: retires finished ops, aborts on timeout or asynchronous NCCL error.
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_ || !failure_.empty()) continue;
      std::shared_ptr<NcclInflight> expired;
      for (auto it = inflight_.begin(); it != inflight_.end();) {
        if (cudaEventQuery((*it)->end->ev) == cudaSuccess) {
          it = inflight_.erase(it);
        } else {
          if (!expired && std::chrono::steady_clock::now() > (*it)->deadline) expired = *it;
          ++it;
        }
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      lock.unlock();
      if (async != ncclSuccess && async != ncclInProgress) {
        fail(str_cat("NCCL asynchronous error on communicator ", describe(), ": ",
                     ncclGetErrorString(async), " (", ncclGetLastError(nullptr), ")"),
             false);
      } else if (expired) {
        fail(timeout_message(expired->kind, expired->seq, expired->timeout, expired->what), true);
      }
      lock.lock();
    }
  }

  ncclComm_t comm_;
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream stream_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::list<std::shared_ptr<NcclInflight>> inflight_;
  std::string failure_;
  bool failure_is_timeout_ = false;
  std::atomic<bool> aborted_{false};
  bool stop_ = false;
  std::thread watchdog_;
};

bool NcclWork::completed() {
  return cudaEventQuery(op_->end->ev) == cudaSuccess;
}

void NcclWork::wait() {
  comm_->raise_if_failed();
  c10::cuda::CUDAGuard guard(comm_->device());
  cudaStream_t caller = c10::cuda::getCurrentCUDAStream(comm_->device()).stream();
  DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(caller, op_->end->ev, 0));
  if (finish_) std::call_once(finished_, finish_);  // enqueued on the caller's stream
}

void NcclWork::synchronize() {
  comm_->synchronize(*op_, timeout_);
  wait();
}

CommPtr make_nccl_world(int rank, int size, int device, const IdShare& share, Timeout timeout,
                        bool keep_size_one) {
  if (size == 1 && !keep_size_one) return make_self_communicator("world", rank, fnv1a("world"), timeout);
  DTRAIN_CHECK_ARG(device >= 0 && device < cuda_device_count(), "NCCL backend: device ", device,
                   " is not visible; this process sees ", cuda_device_count(), " CUDA devices");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  ncclUniqueId id;
  std::string bytes;
  if (rank == 0) {
    DTRAIN_NCCL_CHECK(ncclGetUniqueId(&id));
    bytes.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  share(bytes);
  DTRAIN_CHECK_T(CommError, bytes.size() == sizeof(id), "NCCL unique id has ", bytes.size(),
                 " bytes after sharing; expected ", sizeof(id));
  std::memcpy(&id, bytes.data(), sizeof(id));
  ncclComm_t comm = nullptr;
  DTRAIN_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
  std::vector<int> ranks(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  return std::make_shared<NcclCommunicator>(comm, device, "world", rank, std::move(ranks),
                                            fnv1a("world"), timeout);
}

}  // namespace dtrain::detail
