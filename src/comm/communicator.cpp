// Communicator front end shared by every backend: argument validation, sequence numbers,
// the DTRAIN_COMM_CHECK cross-check and timeout diagnostics.
#include "dtrain/comm/communicator.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <map>
#include <numeric>
#include <sstream>

#include "comm/peer_probe.hpp"
#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"

namespace dtrain {

using detail::str_cat;

Communicator::Communicator(Backend backend, std::string name, int rank,
                           std::vector<int> world_ranks, std::uint64_t uid, Timeout timeout)
    : backend_(backend),
      name_(std::move(name)),
      rank_(rank),
      size_(static_cast<int>(world_ranks.size())),
      world_ranks_(std::move(world_ranks)),
      timeout_(timeout.count() > 0 ? timeout : env::comm_timeout()),
      cross_check_(env::comm_check()),
      progress_(std::make_shared<detail::CommProgress>(uid)) {
  DTRAIN_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "communicator '", name_,
               "': rank ", rank_, " of ", size_, " members");
  detail::register_progress(progress_);
}

Communicator::~Communicator() = default;

std::uint64_t Communicator::seq() const { return progress_->issued.load(); }

std::string Communicator::describe() const {
  return str_cat("'", name_, "' (", to_string(backend_), ", rank ", rank_, " of ", size_, ")");
}

// ---------------------------------------------------------------------------------------
// Validation

void Communicator::check_tensor(const at::Tensor& t, const char* arg) const {
  DTRAIN_CHECK_ARG(t.defined(), "communicator ", describe(), ": argument '", arg,
                   "' is an undefined tensor");
  DTRAIN_CHECK_ARG(t.is_contiguous(), "communicator ", describe(), ": argument '", arg,
                   "' must be contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
                   "); call .contiguous() first");
  DTRAIN_CHECK_ARG(is_supported_dtype(t.scalar_type()), "communicator ", describe(),
                   ": argument '", arg, "' has dtype ", t.scalar_type(),
                   "; allowed: ", supported_dtypes_text());
  check_tensor_device(t, arg);
}

void Communicator::check_peer(int peer, const char* arg) const {
  DTRAIN_CHECK_ARG(peer >= 0 && peer < size_, "communicator ", describe(), ": ", arg, "=",
                   peer, " is out of range; allowed: 0..", size_ - 1);
  DTRAIN_CHECK_ARG(peer != rank_, "communicator ", describe(), ": ", arg, "=", peer,
                   " is this rank; send/recv need another rank");
}

namespace {
void check_same_dtype(const at::Tensor& out, const at::Tensor& in, const std::string& who) {
  DTRAIN_CHECK_ARG(out.scalar_type() == in.scalar_type(), who, ": 'output' dtype ",
                   out.scalar_type(), " differs from 'input' dtype ", in.scalar_type());
}

std::string join(const std::vector<std::int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}
}  // namespace

// ---------------------------------------------------------------------------------------
// Sequence numbers and the cross-check

std::uint64_t Communicator::begin_collective(OpKind kind, const at::Tensor* t, ReduceOp op,
                                             int root) {
  const std::uint64_t seq = progress_->issued.load() + 1;
  if (cross_check_ && size_ > 1) cross_check(kind, t, op, root, seq);
  progress_->issued.store(seq);
  progress_->last_op.store(static_cast<int>(kind));
  return seq;
}

namespace {
constexpr int kDescLen = 6;
std::string describe_desc(const std::int64_t* d) {
  std::string s = str_cat("op=", to_string(static_cast<OpKind>(d[0])), " seq=", d[5]);
  if (d[1] >= 0) s += str_cat(" dtype=", static_cast<c10::ScalarType>(d[1]), " numel=", d[2]);
  if (d[3] >= 0) s += str_cat(" reduce=", to_string(static_cast<ReduceOp>(d[3])));
  if (d[4] >= 0) s += str_cat(" root=", d[4]);
  return s;
}
}  // namespace

void Communicator::cross_check(OpKind kind, const at::Tensor* t, ReduceOp op, int root,
                               std::uint64_t seq) {
  const bool reduces = kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter;
  std::array<std::int64_t, kDescLen> mine = {
      static_cast<std::int64_t>(kind),
      t ? static_cast<std::int64_t>(t->scalar_type()) : -1,
      t ? t->numel() : -1,
      reduces ? static_cast<std::int64_t>(op) : -1,
      kind == OpKind::kBroadcast ? root : -1,
      static_cast<std::int64_t>(seq)};
  const auto opts = at::TensorOptions().dtype(at::kLong).device(check_device());
  at::Tensor in = at::from_blob(mine.data(), {kDescLen}, at::kLong).to(opts);
  at::Tensor out = at::empty({kDescLen * size_}, opts);
  do_all_gather(out, in, 0, timeout_)->synchronize();
  at::Tensor all = out.cpu();
  const std::int64_t* d = all.data_ptr<std::int64_t>();

  std::map<std::string, std::vector<int>> groups;  // descriptor -> ranks
  for (int r = 0; r < size_; ++r) groups[describe_desc(d + r * kDescLen)].push_back(r);
  if (groups.size() == 1) return;
  std::ostringstream os;
  os << "DTRAIN_COMM_CHECK: ranks of communicator " << describe()
     << " disagree on collective #" << seq << ":";
  for (const auto& [desc, ranks] : groups) {
    os << (ranks.size() == 1 ? " rank " : " ranks ");
    for (std::size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
    os << ": " << desc << ";";
  }
  throw CommError(detail::located(os.str(), to_string(kind), __FILE__, __LINE__));
}

std::string Communicator::timeout_message(OpKind kind, std::uint64_t seq, Timeout timeout,
                                          const std::string& what) const {
  std::ostringstream os;
  os << to_string(kind) << " on communicator " << describe() << " did not complete within "
     << timeout.count() / 1000.0 << " s (" << env::kCommTimeoutS << " or the call's timeout)";
  if (seq > 0) os << ": collective #" << seq;
  if (!what.empty()) os << ", " << what;
  auto probe = detail::peer_probe();
  if (!probe) {
    os << ". Peer states unavailable (no MPI control channel in this run).";
    return os.str();
  }
  std::vector<int> peers;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) peers.push_back(world_ranks_[r]);
  }
  const auto states = probe->query(progress_->uid, peers, std::chrono::milliseconds(3000));
  std::vector<std::string> behind, silent, ahead_or_equal;
  for (std::size_t i = 0; i < states.size(); ++i) {
    const auto& s = states[i];
    const auto it = std::find(world_ranks_.begin(), world_ranks_.end(), s.world_rank);
    const int r = static_cast<int>(it - world_ranks_.begin());
    if (!s.answered) {
      silent.push_back(std::to_string(r));
    } else if (!s.known || (seq > 0 && s.issued < seq)) {
      std::string desc = str_cat(r, " (at collective #", s.issued);
      if (s.last_op >= 0) desc += str_cat(", last ", to_string(static_cast<OpKind>(s.last_op)));
      behind.push_back(desc + ")");
    } else {
      ahead_or_equal.push_back(std::to_string(r));
    }
  }
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
    return s.empty() ? std::string("none") : s;
  };
  if (seq > 0) {
    os << ". Ranks that did not arrive: " << list(behind) << ". Ranks that did not answer: "
       << list(silent) << ". Ranks that arrived: " << list(ahead_or_equal) << ".";
  } else {
    os << ". Peers that did not answer: " << list(silent) << ".";
  }
  return os.str();
}

// ---------------------------------------------------------------------------------------
// Public entry points

WorkPtr Communicator::all_reduce(const at::Tensor& tensor, const ReduceOptions& opts) {
  check_tensor(tensor, "tensor");
  const auto seq = begin_collective(OpKind::kAllReduce, &tensor, opts.op, -1);
  return do_all_reduce(tensor, opts.op, seq, resolve(opts.timeout));
}

WorkPtr Communicator::broadcast(const at::Tensor& tensor, const BroadcastOptions& opts) {
  check_tensor(tensor, "tensor");
  DTRAIN_CHECK_ARG(opts.root >= 0 && opts.root < size_, "broadcast on communicator ",
                   describe(), ": root=", opts.root, " is out of range; allowed: 0..",
                   size_ - 1);
  const auto seq = begin_collective(OpKind::kBroadcast, &tensor, ReduceOp::kSum, opts.root);
  return do_broadcast(tensor, opts.root, seq, resolve(opts.timeout));
}

WorkPtr Communicator::all_gather(const at::Tensor& output, const at::Tensor& input,
                                 const CollectiveOptions& opts) {
  check_tensor(output, "output");
  check_tensor(input, "input");
  const std::string who = str_cat("all_gather on communicator ", describe());
  check_same_dtype(output, input, who);
  DTRAIN_CHECK_ARG(output.numel() == input.numel() * size_, who, ": 'output' has ",
                   output.numel(), " elements; it must hold size() x input.numel() = ", size_,
                   " x ", input.numel(), " = ", input.numel() * size_);
  const auto seq = begin_collective(OpKind::kAllGather, &input, ReduceOp::kSum, -1);
  return do_all_gather(output, input, seq, resolve(opts.timeout));
}

WorkPtr Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                     const ReduceOptions& opts) {
  check_tensor(output, "output");
  check_tensor(input, "input");
  const std::string who = str_cat("reduce_scatter on communicator ", describe());
  check_same_dtype(output, input, who);
  DTRAIN_CHECK_ARG(input.numel() == output.numel() * size_, who, ": 'input' has ",
                   input.numel(), " elements; it must hold size() x output.numel() = ", size_,
                   " x ", output.numel(), " = ", output.numel() * size_);
  const auto seq = begin_collective(OpKind::kReduceScatter, &input, opts.op, -1);
  return do_reduce_scatter(output, input, opts.op, seq, resolve(opts.timeout));
}

WorkPtr Communicator::all_to_all(const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& opts) {
  check_tensor(output, "output");
  check_tensor(input, "input");
  const std::string who = str_cat("all_to_all on communicator ", describe());
  check_same_dtype(output, input, who);
  std::vector<std::int64_t> out_counts(size_), in_counts(size_);
  const bool uneven = !opts.input_splits.empty() || !opts.output_splits.empty();
  if (!uneven) {
    DTRAIN_CHECK_ARG(input.numel() % size_ == 0, who, ": 'input' has ", input.numel(),
                     " elements, not divisible by the communicator size ", size_);
    DTRAIN_CHECK_ARG(output.numel() == input.numel(), who, ": 'output' has ",
                     output.numel(), " elements; equal splits need input.numel() = ",
                     input.numel());
    std::fill(out_counts.begin(), out_counts.end(), input.numel() / size_);
    std::fill(in_counts.begin(), in_counts.end(), input.numel() / size_);
  } else {
    DTRAIN_CHECK_ARG(input.dim() >= 1 && output.dim() >= 1, who,
                     ": uneven splits need tensors with at least one dim");
    const std::int64_t row_in = input.size(0) ? input.numel() / input.size(0) : 0;
    const std::int64_t row_out = output.size(0) ? output.numel() / output.size(0) : 0;
    DTRAIN_CHECK_ARG(row_in == row_out || input.size(0) == 0 || output.size(0) == 0, who,
                     ": rows of 'input' (", row_in, " elements) and 'output' (", row_out,
                     " elements) differ");
    const std::int64_t row = row_in ? row_in : row_out;
    auto check_splits = [&](const std::vector<std::int64_t>& splits, const char* arg,
                            const at::Tensor& t, std::vector<std::int64_t>& counts) {
      DTRAIN_CHECK_ARG(static_cast<int>(splits.size()) == size_, who, ": ", arg, " has ",
                       splits.size(), " entries ", join(splits), "; it needs one per rank (",
                       size_, ")");
      std::int64_t sum = 0;
      for (int r = 0; r < size_; ++r) {
        DTRAIN_CHECK_ARG(splits[r] >= 0, who, ": ", arg, "[", r, "]=", splits[r],
                         " is negative");
        sum += splits[r];
        counts[r] = splits[r] * row;
      }
      DTRAIN_CHECK_ARG(sum == t.size(0), who, ": ", arg, " ", join(splits), " add up to ", sum,
                       " rows but the tensor has ", t.size(0), " rows along dim 0");
    };
    check_splits(opts.input_splits, "input_splits", input, in_counts);
    check_splits(opts.output_splits, "output_splits", output, out_counts);
  }
  const auto seq = begin_collective(OpKind::kAllToAll, &input, ReduceOp::kSum, -1);
  return do_all_to_all(output, input, out_counts, in_counts, seq, resolve(opts.timeout));
}

WorkPtr Communicator::send(const at::Tensor& tensor, int dst, const P2POptions& opts) {
  check_tensor(tensor, "tensor");
  check_peer(dst, "dst");
  DTRAIN_CHECK_ARG(opts.tag >= 0 && opts.tag < 32768, "send on communicator ", describe(),
                   ": tag=", opts.tag, " is out of range; allowed: 0..32767");
  return do_send(tensor, dst, opts.tag, resolve(opts.timeout));
}

WorkPtr Communicator::recv(const at::Tensor& tensor, int src, const P2POptions& opts) {
  check_tensor(tensor, "tensor");
  check_peer(src, "src");
  DTRAIN_CHECK_ARG(opts.tag >= 0 && opts.tag < 32768, "recv on communicator ", describe(),
                   ": tag=", opts.tag, " is out of range; allowed: 0..32767");
  return do_recv(tensor, src, opts.tag, resolve(opts.timeout));
}

std::vector<WorkPtr> Communicator::batch_p2p(const std::vector<P2POp>& ops, Timeout timeout) {
  for (const auto& op : ops) {
    const bool send = op.kind == P2POp::Kind::kSend;
    check_tensor(op.tensor, "tensor");
    check_peer(op.peer, send ? "dst" : "src");
    DTRAIN_CHECK_ARG(op.tag >= 0 && op.tag < 32768, send ? "send" : "recv", " on communicator ",
                     describe(), ": tag=", op.tag, " is out of range; allowed: 0..32767");
  }
  return do_batch_p2p(ops, resolve(timeout));
}

std::vector<WorkPtr> Communicator::do_batch_p2p(const std::vector<P2POp>& ops, Timeout timeout) {
  std::vector<WorkPtr> works;
  for (const auto& op : ops) {
    works.push_back(op.kind == P2POp::Kind::kSend ? do_send(op.tensor, op.peer, op.tag, timeout)
                                                  : do_recv(op.tensor, op.peer, op.tag, timeout));
  }
  return works;
}

WorkPtr Communicator::barrier(const CollectiveOptions& opts) {
  const auto seq = begin_collective(OpKind::kBarrier, nullptr, ReduceOp::kSum, -1);
  return do_barrier(seq, resolve(opts.timeout));
}

CommPtr Communicator::split(int color, int key, const std::string& name) {
  DTRAIN_CHECK_ARG(!name.empty(), "split on communicator ", describe(),
                   ": 'name' must not be empty (it names the new communicator in errors)");
  // Everyone must be here before the (blocking) backend split: a barrier with a timeout
  // turns a missing member into a TimeoutError instead of a hang.
  barrier()->synchronize();
  const std::uint64_t uid = detail::mix_uid(progress_->uid, ++splits_, color);
  return do_split(color, key, name, uid, timeout_);
}

}  // namespace dtrain
