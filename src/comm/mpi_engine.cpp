// MPI progress engine: the thread that issues and polls every MPI request, user-defined
// float32-accumulating reductions for bfloat16/float16, and the control channel that
// answers timeout probes.
#include "comm/mpi_engine.hpp"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <sched.h>

#include <algorithm>

#include "dtrain/core/error.hpp"
#include "dtrain/core/logging.hpp"

namespace dtrain::detail {

namespace {
constexpr int kQueryTag = 1;
constexpr int kReplyTagBase = 100;  // + query id % kReplyTagSpan
constexpr int kReplyTagSpan = 30000;

// ---------------------------------------------------------------------------------------
// bfloat16 / float16 reductions: each pairwise combine runs in float32 and rounds once.
template <typename T, int kOp>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    float r;
    if constexpr (kOp == 0) {
      r = x + y;
    } else if constexpr (kOp == 1) {
      r = std::max(x, y);
    } else {
      r = std::min(x, y);
    }
    b[i] = static_cast<T>(r);
  }
}
}  // namespace

// ---------------------------------------------------------------------------------------
// MpiOpState

bool MpiOpState::wait_until(std::chrono::steady_clock::time_point deadline) {
  if (done()) return true;
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_until(lock, deadline, [&] { return done(); });
}

std::exception_ptr MpiOpState::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void MpiOpState::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------
// MpiWorker

MpiWorker::MpiWorker() : thread_([this] { loop(); }) {}

MpiWorker::~MpiWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<MpiOpState> MpiWorker::post(std::function<void()> fn) {
  auto state = std::make_shared<MpiOpState>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(std::move(fn), state);
  }
  cv_.notify_one();
  return state;
}

void MpiWorker::run(std::function<void()> fn) {
  auto state = post(std::move(fn));
  state->wait_until(std::chrono::steady_clock::time_point::max());
  if (auto err = state->error()) std::rethrow_exception(err);
}

void MpiWorker::loop() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<MpiOpState>> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr err;
    try {
      task.first();
    } catch (...) {
      err = std::current_exception();
    }
    task.first = nullptr;  // release captured tensors before signalling completion
    task.second->finish(err);
  }
}

// ---------------------------------------------------------------------------------------
// Start and stop

std::shared_ptr<MpiEngine> MpiEngine::start(int* argc, char*** argv) {
  std::shared_ptr<MpiEngine> e(new MpiEngine());
  int initialized = 0;
  DTRAIN_MPI_CHECK(MPI_Initialized(&initialized));
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    DTRAIN_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
    e->owns_mpi_ = true;
  } else {
    DTRAIN_MPI_CHECK(MPI_Query_thread(&provided));
  }
  DTRAIN_CHECK_T(MpiError, provided == MPI_THREAD_MULTIPLE,
                 "the MPI library provides thread level ", provided,
                 "; dtrain's MPI backend calls MPI from its progress and worker threads and "
                 "needs MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE, ")");
  DTRAIN_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  DTRAIN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &e->world_rank_));
  DTRAIN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &e->world_size_));
  DTRAIN_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &e->world_comm_));
  DTRAIN_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &e->control_comm_));
  MPI_User_function* fns[2][3] = {
      {&half_reduce<c10::BFloat16, 0>, &half_reduce<c10::BFloat16, 1>,
       &half_reduce<c10::BFloat16, 2>},
      {&half_reduce<c10::Half, 0>, &half_reduce<c10::Half, 1>, &half_reduce<c10::Half, 2>}};
  for (int t = 0; t < 2; ++t) {
    for (int o = 0; o < 3; ++o) DTRAIN_MPI_CHECK(MPI_Op_create(fns[t][o], 1, &e->half_ops_[t][o]));
  }
  e->start_control_recv();
  e->thread_ = std::thread([raw = e.get()] { raw->loop(); });
  return e;
}

MpiEngine::~MpiEngine() {
  try {
    stop();
  } catch (const std::exception& ex) {
    log_error("MPI engine shutdown: {}", ex.what());
  }
}

void MpiEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // From here on this (main) thread is the only MPI caller.
  if (query_req_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&query_req_);
    MPI_Wait(&query_req_, MPI_STATUS_IGNORE);
  }
  for (auto& r : replies_) MPI_Wait(&r.second, MPI_STATUS_IGNORE);
  for (auto& t : half_ops_) {
    for (auto& op : t) {
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
    }
  }
  if (control_comm_ != MPI_COMM_NULL) MPI_Comm_free(&control_comm_);
  if (world_comm_ != MPI_COMM_NULL) MPI_Comm_free(&world_comm_);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_mpi_ && !finalized) MPI_Finalize();
}

// ---------------------------------------------------------------------------------------
// Submission

std::shared_ptr<MpiOpState> MpiEngine::submit(IssueFn issue) {
  auto state = std::make_shared<MpiOpState>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DTRAIN_CHECK_T(CommError, !stopping_, "MPI engine is shut down; no more communication");
    pending_.push_back(Task{std::move(issue), state, {}});
  }
  cv_.notify_one();
  return state;
}

void MpiEngine::abandon(const std::shared_ptr<MpiOpState>& op) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    to_abandon_.push_back(op);
  }
  cv_.notify_one();
}

MPI_Datatype MpiEngine::datatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat: return MPI_FLOAT;
    case c10::kDouble: return MPI_DOUBLE;
    case c10::kBFloat16:
    case c10::kHalf: return MPI_UINT16_T;
    case c10::kInt: return MPI_INT32_T;
    case c10::kLong: return MPI_INT64_T;
    case c10::kByte: return MPI_UINT8_T;
    default:
      throw InvalidArgument(str_cat("MPI backend: dtype ", dtype, " is not supported; allowed: ",
                                    "float32, float64, bfloat16, float16, int32, int64, uint8"));
  }
}

MPI_Op MpiEngine::reduce_op(ReduceOp op, c10::ScalarType dtype) const {
  const int o = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;  // avg = sum, then /n
  if (dtype == c10::kBFloat16) return half_ops_[0][o];
  if (dtype == c10::kHalf) return half_ops_[1][o];
  return o == 1 ? MPI_MAX : o == 2 ? MPI_MIN : MPI_SUM;
}

// ---------------------------------------------------------------------------------------
// The progress loop

void MpiEngine::loop() {
  for (;;) {
    std::deque<Task> incoming;
    std::vector<std::shared_ptr<MpiOpState>> abandon;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (active_.empty() && pending_.empty() && to_abandon_.empty() && !stopping_) {
        // Idle: wake for new work, and every 2 ms to answer control probes.
        cv_.wait_for(lock, std::chrono::milliseconds(2));
      }
      if (stopping_ && pending_.empty() && active_.empty()) return;
      incoming.swap(pending_);
      abandon.swap(to_abandon_);
    }
    for (auto& task : incoming) {
      try {
        task.issue(task.requests);
        active_.push_back(std::move(task));
      } catch (...) {
        // Requests issued before the failure still need completing; MPI cannot undo them.
        task.state->finish(std::current_exception());
        if (!task.requests.empty()) {
          task.state = std::make_shared<MpiOpState>();
          active_.push_back(std::move(task));
        }
      }
    }
    for (const auto& op : abandon) {
      auto it = std::find_if(active_.begin(), active_.end(),
                             [&](const Task& t) { return t.state == op; });
      if (it == active_.end()) continue;
      for (auto& r : it->requests) {
        if (r == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
        if (!flag) {
          MPI_Cancel(&r);  // receives cancel; sends complete in the background
          MPI_Request_free(&r);
        }
      }
      it->state->finish(std::make_exception_ptr(CommError("abandoned")));
      graveyard_.push_back(std::move(*it));  // buffers of freed sends must outlive them
      active_.erase(it);
    }
    for (auto it = active_.begin(); it != active_.end();) {
      int flag = 0;
      const int rc = MPI_Testall(static_cast<int>(it->requests.size()), it->requests.data(),
                                 &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        std::exception_ptr err;
        try {
          throw_mpi(rc, "MPI_Testall", __FILE__, __LINE__);
        } catch (...) {
          err = std::current_exception();
        }
        it->state->finish(err);
        it = active_.erase(it);
      } else if (flag) {
        it->state->finish(nullptr);
        it = active_.erase(it);
      } else {
        ++it;
      }
    }
    try {
      service_control();
    } catch (const std::exception& ex) {
      warn_once("mpi-control", str_cat("MPI control channel: ", ex.what()));
    }
    if (!active_.empty()) sched_yield();  // polling; let the compute threads run
  }
}

// ---------------------------------------------------------------------------------------
// Control channel: answering and asking "which collective are you at?"

void MpiEngine::start_control_recv() {
  DTRAIN_MPI_CHECK(MPI_Irecv(query_in_, 2, MPI_INT64_T, MPI_ANY_SOURCE, kQueryTag,
                             control_comm_, &query_req_));
}

void MpiEngine::service_control() {
  while (!replies_.empty()) {  // retire finished replies, oldest first
    int flag = 0;
    DTRAIN_MPI_CHECK(MPI_Test(&replies_.front().second, &flag, MPI_STATUS_IGNORE));
    if (!flag) break;
    replies_.pop_front();
  }
  for (;;) {
    int flag = 0;
    MPI_Status status;
    DTRAIN_MPI_CHECK(MPI_Test(&query_req_, &flag, &status));
    if (!flag) return;
    const std::int64_t qid = query_in_[0];
    auto progress = find_progress(static_cast<std::uint64_t>(query_in_[1]));
    std::array<std::int64_t, 4> reply = {
        qid, progress ? 1 : 0, progress ? static_cast<std::int64_t>(progress->issued.load()) : 0,
        progress ? progress->last_op.load() : -1};
    replies_.emplace_back(reply, MPI_REQUEST_NULL);
    auto& slot = replies_.back();
    DTRAIN_MPI_CHECK(MPI_Isend(slot.first.data(), 4, MPI_INT64_T, status.MPI_SOURCE,
                               kReplyTagBase + static_cast<int>(qid % kReplyTagSpan),
                               control_comm_, &slot.second));
    start_control_recv();
  }
}

std::vector<PeerState> MpiEngine::query(std::uint64_t uid, const std::vector<int>& world_ranks,
                                        Timeout grace) {
  const std::int64_t qid = next_query_id_.fetch_add(1);
  const int tag = kReplyTagBase + static_cast<int>(qid % kReplyTagSpan);
  struct Buffers {
    std::int64_t question[2];
    std::vector<std::array<std::int64_t, 4>> answers;
    std::vector<MPI_Request> recv_reqs;
  };
  auto buf = std::make_shared<Buffers>();
  buf->question[0] = qid;
  buf->question[1] = static_cast<std::int64_t>(uid);
  buf->answers.assign(world_ranks.size(), {-1, 0, 0, -1});

  // One op per peer, so that an unresponsive peer does not hide the others' answers.
  std::vector<std::shared_ptr<MpiOpState>> ops;
  for (std::size_t i = 0; i < world_ranks.size(); ++i) {
    const int peer = world_ranks[i];
    ops.push_back(submit([this, buf, i, peer, tag](std::vector<MPI_Request>& reqs) {
      reqs.resize(2, MPI_REQUEST_NULL);
      DTRAIN_MPI_CHECK(MPI_Irecv(buf->answers[i].data(), 4, MPI_INT64_T, peer, tag,
                                 control_comm_, &reqs[0]));
      DTRAIN_MPI_CHECK(MPI_Isend(buf->question, 2, MPI_INT64_T, peer, kQueryTag, control_comm_,
                                 &reqs[1]));
    }));
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  std::vector<PeerState> out(world_ranks.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    out[i].world_rank = world_ranks[i];
    const bool done = ops[i]->wait_until(deadline) && !ops[i]->error();
    if (!done) {
      abandon(ops[i]);
      continue;
    }
    const auto& a = buf->answers[i];
    out[i].answered = a[0] == qid;
    out[i].known = a[1] != 0;
    out[i].issued = static_cast<std::uint64_t>(a[2]);
    out[i].last_op = static_cast<int>(a[3]);
  }
  return out;
}

}  // namespace dtrain::detail
