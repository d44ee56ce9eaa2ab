// Tensor-parallel region functions (autograd Functions over the tp communicator) and the
// column/row parallel linear layers.
#include "dtrain/parallel/tensor_parallel.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>

#include "dtrain/core/error.hpp"

namespace dtrain::tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The communicator travels through autograd as an integer (IValue holds no raw pointers);
// the layers and callers keep it alive for as long as the graph exists.
std::int64_t handle(const CommPtr& c) { return reinterpret_cast<std::int64_t>(c.get()); }
Communicator& comm(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
}

CommStats g_stats;

// Every collective of this file goes through here (counted).
void all_reduce_counted(const at::Tensor& t, Communicator& c, ReduceOp op = ReduceOp::kSum) {
  g_stats.bytes += wire_bytes(OpKind::kAllReduce, static_cast<double>(t.nbytes()), c.size());
  ++g_stats.calls;
  c.all_reduce(t, {op})->wait();
}

at::Tensor all_reduce_sum(const at::Tensor& x, Communicator& c) {
  if (c.size() == 1) return x;
  auto y = x.contiguous().clone();
  all_reduce_counted(y, c);
  return y;
}

std::int64_t checked_dim(const at::Tensor& x, std::int64_t dim) {
  const auto d = dim < 0 ? dim + x.dim() : dim;
  DTRAIN_CHECK_ARG(d >= 0 && d < x.dim(), "tensor parallel: dim ", dim, " is out of range for a ",
                   x.dim(), "-d tensor");
  return d;
}

// checked_dim, for a dimension that is split across the ranks: its size must divide.
std::int64_t split_dim_index(const at::Tensor& x, Communicator& c, std::int64_t dim) {
  dim = checked_dim(x, dim);
  DTRAIN_CHECK_ARG(x.size(dim) % c.size() == 0, "tensor parallel: dimension ", dim, " of size ",
                   x.size(dim), " is not divisible by tp=", c.size());
  return dim;
}

// The ranks' tensors concatenated along dim, in rank order.
at::Tensor all_gather_dim(const at::Tensor& x, Communicator& c, std::int64_t dim) {
  if (c.size() == 1) return x;
  dim = checked_dim(x, dim);
  const auto moved = x.movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  sizes[0] *= c.size();
  auto out = at::empty(sizes, moved.options());
  g_stats.bytes += wire_bytes(OpKind::kAllGather, static_cast<double>(out.nbytes()), c.size());
  ++g_stats.calls;
  c.all_gather(out, moved)->wait();
  return out.movedim(0, dim).contiguous();
}

// Slice r (of size/tp) along dim of the sum over ranks.
at::Tensor reduce_scatter_dim(const at::Tensor& x, Communicator& c, std::int64_t dim) {
  if (c.size() == 1) return x;
  dim = split_dim_index(x, c, dim);
  const auto moved = x.movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  sizes[0] /= c.size();
  auto out = at::empty(sizes, moved.options());
  g_stats.bytes += wire_bytes(OpKind::kReduceScatter, static_cast<double>(moved.nbytes()), c.size());
  ++g_stats.calls;
  c.reduce_scatter(out, moved)->wait();
  return out.movedim(0, dim).contiguous();
}

// This rank's slice along dim.
at::Tensor split_dim(const at::Tensor& x, Communicator& c, std::int64_t dim) {
  if (c.size() == 1) return x;
  dim = split_dim_index(x, c, dim);
  return x.chunk(c.size(), dim)[static_cast<std::size_t>(c.rank())].contiguous();
}

// One autograd Function per region: Fwd and Bwd name the communication of each pass.
enum class Op { kIdentity, kAllReduce, kSplit, kGather, kReduceScatter };

at::Tensor apply_op(Op op, const at::Tensor& x, Communicator& c, std::int64_t dim) {
  switch (op) {
    case Op::kIdentity: return x;
    case Op::kAllReduce: return all_reduce_sum(x, c);
    case Op::kSplit: return split_dim(x, c, dim);
    case Op::kGather: return all_gather_dim(x, c, dim);
    case Op::kReduceScatter: return reduce_scatter_dim(x, c, dim);
  }
  return x;
}

struct Region : public torch::autograd::Function<Region> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t comm,
                            std::int64_t dim, std::int64_t fwd, std::int64_t bwd) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["bwd"] = bwd;
    return apply_op(static_cast<Op>(fwd), x, *reinterpret_cast<Communicator*>(comm), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto op = static_cast<Op>(ctx->saved_data["bwd"].toInt());
    return {apply_op(op, grads[0], comm(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor region(const at::Tensor& x, const CommPtr& tp, std::int64_t dim, Op fwd, Op bwd) {
  DTRAIN_CHECK_ARG(tp != nullptr, "tensor parallel: no tp communicator");
  if (tp->size() == 1) return x;  // every op is the identity on one rank
  return Region::apply(x, handle(tp), dim, static_cast<std::int64_t>(fwd),
                       static_cast<std::int64_t>(bwd));
}

void check_divisible(const char* what, std::int64_t n, const CommPtr& tp) {
  DTRAIN_CHECK_ARG(tp != nullptr, "tensor parallel: no tp communicator");
  DTRAIN_CHECK_ARG(n > 0 && n % tp->size() == 0, what, "=", n, " is not divisible by tp=",
                   tp->size(), "; allowed: a positive multiple of tp");
}

}  // namespace

const CommStats& comm_stats() { return g_stats; }
void reset_comm_stats() { g_stats = CommStats{}; }

at::Tensor copy_to_region(const at::Tensor& x, const CommPtr& tp) {
  return region(x, tp, -1, Op::kIdentity, Op::kAllReduce);
}
at::Tensor reduce_from_region(const at::Tensor& x, const CommPtr& tp) {
  return region(x, tp, -1, Op::kAllReduce, Op::kIdentity);
}
at::Tensor scatter_to_region(const at::Tensor& x, const CommPtr& tp) {
  return region(x, tp, -1, Op::kSplit, Op::kGather);
}
at::Tensor gather_from_region(const at::Tensor& x, const CommPtr& tp) {
  return region(x, tp, -1, Op::kGather, Op::kSplit);
}
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const CommPtr& tp, std::int64_t dim) {
  return region(x, tp, dim, Op::kReduceScatter, Op::kGather);
}
at::Tensor gather_from_sequence(const at::Tensor& x, const CommPtr& tp, std::int64_t dim) {
  return region(x, tp, dim, Op::kGather, Op::kReduceScatter);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(std::int64_t in_features,
                                                   std::int64_t out_features, CommPtr tp,
                                                   ParallelLinearOptions options)
    : tp_(std::move(tp)), in_(in_features), out_(out_features), options_(options) {
  check_divisible("ColumnParallelLinear out_features", out_, tp_);
  DTRAIN_CHECK_ARG(in_ > 0, "ColumnParallelLinear in_features=", in_, " must be positive");
  weight = register_parameter("weight", torch::empty({out_ / tp_->size(), in_}));
  if (options_.bias) bias = register_parameter("bias", torch::zeros({out_ / tp_->size()}));
}

void ColumnParallelLinearImpl::load_full(const at::Tensor& w, const at::Tensor& b) {
  DTRAIN_CHECK_ARG(w.sizes() == at::IntArrayRef({out_, in_}), "ColumnParallelLinear: full weight ",
                   w.sizes(), " is not [", out_, ", ", in_, "]");
  torch::NoGradGuard no_grad;
  const auto rows = out_ / tp_->size();
  weight.copy_(w.narrow(0, rows * tp_->rank(), rows));
  if (bias.defined() && b.defined()) bias.copy_(b.narrow(0, rows * tp_->rank(), rows));
}

at::Tensor enter_column_region(const at::Tensor& x, const CommPtr& tp,
                               const ParallelLinearOptions& options) {
  return options.sequence_parallel ? gather_from_sequence(x, tp, options.sequence_dim)
                                   : copy_to_region(x, tp);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return forward_entered(enter_column_region(x, tp_, options_));
}

at::Tensor ColumnParallelLinearImpl::forward_entered(const at::Tensor& in) {
  auto y = torch::nn::functional::linear(in, weight, bias.defined() ? bias : at::Tensor());
  return options_.gather_output ? gather_from_region(y, tp_) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(std::int64_t in_features, std::int64_t out_features,
                                             CommPtr tp, ParallelLinearOptions options)
    : tp_(std::move(tp)), in_(in_features), out_(out_features), options_(options) {
  check_divisible("RowParallelLinear in_features", in_, tp_);
  DTRAIN_CHECK_ARG(out_ > 0, "RowParallelLinear out_features=", out_, " must be positive");
  weight = register_parameter("weight", torch::empty({out_, in_ / tp_->size()}));
  if (options_.bias) bias = register_parameter("bias", torch::zeros({out_}));
}

void RowParallelLinearImpl::load_full(const at::Tensor& w, const at::Tensor& b) {
  DTRAIN_CHECK_ARG(w.sizes() == at::IntArrayRef({out_, in_}), "RowParallelLinear: full weight ",
                   w.sizes(), " is not [", out_, ", ", in_, "]");
  torch::NoGradGuard no_grad;
  const auto cols = in_ / tp_->size();
  weight.copy_(w.narrow(1, cols * tp_->rank(), cols));
  if (bias.defined() && b.defined()) bias.copy_(b);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const auto in = options_.input_is_parallel ? x : scatter_to_region(x, tp_);
  const auto partial = torch::nn::functional::linear(in, weight);
  auto y = options_.sequence_parallel
               ? reduce_scatter_to_sequence(partial, tp_, options_.sequence_dim)
               : reduce_from_region(partial, tp_);
  if (bias.defined() && !options_.skip_bias_add) {
    // On a sequence shard each rank's bias gradient is partial: summed across tp.
    y = y + (options_.sequence_parallel ? copy_to_region(bias, tp_) : bias);
  }
  return y;
}

std::int64_t padded_vocab_size(std::int64_t vocab_size, int tp) {
  DTRAIN_CHECK_ARG(vocab_size > 0 && tp > 0, "vocab_size=", vocab_size, " and tp=", tp,
                   " must be positive");
  return (vocab_size + tp - 1) / tp * tp;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(std::int64_t vocab_size, std::int64_t dim,
                                                       CommPtr tp, bool sequence_parallel)
    : tp_(std::move(tp)), vocab_(vocab_size), dim_(dim), sequence_parallel_(sequence_parallel) {
  DTRAIN_CHECK_ARG(tp_ != nullptr, "tensor parallel: no tp communicator");
  DTRAIN_CHECK_ARG(dim_ > 0, "VocabParallelEmbedding dim=", dim_, " must be positive");
  padded_ = padded_vocab_size(vocab_, tp_->size());
  weight = register_parameter("weight", torch::zeros({padded_ / tp_->size(), dim_}));
}

void VocabParallelEmbeddingImpl::load_full(const at::Tensor& w) {
  DTRAIN_CHECK_ARG(w.sizes() == at::IntArrayRef({vocab_, dim_}), "VocabParallelEmbedding: full ",
                   "table ", w.sizes(), " is not [", vocab_, ", ", dim_, "]");
  torch::NoGradGuard no_grad;
  const std::int64_t rows = padded_ / tp_->size(), first = first_row();
  weight.zero_();
  const std::int64_t n = std::max<std::int64_t>(0, std::min(rows, vocab_ - first));
  if (n > 0) weight.narrow(0, 0, n).copy_(w.narrow(0, first, n));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  const std::int64_t rows = padded_ / tp_->size(), first = first_row();
  if (tp_->size() == 1) return torch::embedding(weight, ids);
  const auto outside = (ids < first).logical_or(ids >= first + rows);
  const auto local = (ids - first).masked_fill(outside, 0);
  auto out = torch::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return sequence_parallel_ ? reduce_scatter_to_sequence(out, tp_, 1) : reduce_from_region(out, tp_);
}

namespace {

// Loss per row (with the z-loss: + z lse^2); backward: (softmax (1 + 2 z lse) - onehot) x grad,
// on this rank's columns only.
struct VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            std::int64_t vocab, std::int64_t comm_handle, double z_loss) {
    auto& c = *reinterpret_cast<Communicator*>(comm_handle);
    const std::int64_t cols = logits.size(-1), first = cols * c.rank();
    auto x = logits.detach().to(at::kFloat);
    if (first + cols > vocab) {  // padding columns never win and add nothing
      x = x.clone();
      x.narrow(-1, std::max<std::int64_t>(0, vocab - first), first + cols - std::max(vocab, first))
          .fill_(-std::numeric_limits<float>::infinity());
    }
    auto row_max = std::get<0>(x.max(-1));
    if (c.size() > 1) all_reduce_counted(row_max, c, ReduceOp::kMax);
    auto shifted = x - row_max.unsqueeze(-1);
    auto exp = shifted.exp();
    auto sum_exp = exp.sum(-1);
    const auto outside = (targets < first).logical_or(targets >= first + cols);
    const auto local = (targets - first).masked_fill(outside, 0);
    auto target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
    if (c.size() > 1) {
      all_reduce_counted(sum_exp, c);
      all_reduce_counted(target_logit, c);
    }
    // The z-loss z lse^2 (lse = max + log sum_exp) adds softmax 2 z lse to the gradient.
    const auto lse = row_max + sum_exp.log();
    auto softmax = exp / sum_exp.unsqueeze(-1);
    if (z_loss != 0) softmax.mul_((2 * z_loss * lse + 1).unsqueeze(-1));
    ctx->save_for_backward({softmax, local, outside});
    ctx->saved_data["dtype"] = static_cast<std::int64_t>(logits.scalar_type());
    return sum_exp.log() - target_logit + z_loss * lse * lse;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();  // softmax (times 1 + 2 z lse) over the whole vocabulary, this rank's columns
    const auto& local = saved[1];
    const auto inside = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1));
    grad.mul_(grads[0].unsqueeze(-1));
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// local_logits: the shape of this rank's logits (the linear form's would-be ones).
void check_vocab_parallel(const char* fn, at::IntArrayRef local_logits, const at::Tensor& targets,
                          std::int64_t vocab_size, const CommPtr& tp) {
  DTRAIN_CHECK_ARG(tp != nullptr, "tensor parallel: no tp communicator");
  DTRAIN_CHECK_ARG(local_logits.size() == 2 && targets.dim() == 1 && targets.size(0) == local_logits[0], fn,
                   ": logits must be [rows, vocab/tp] and targets [rows]; got ", local_logits, " and ",
                   targets.sizes());
  DTRAIN_CHECK_ARG(local_logits[1] * tp->size() == padded_vocab_size(vocab_size, tp->size()), fn, ": ",
                   local_logits[1], " columns per rank x tp=", tp->size(), " is not the padded vocabulary ",
                   padded_vocab_size(vocab_size, tp->size()), " of vocab_size=", vocab_size);
}

// options for the fused loss over this rank's `cols` columns of the split vocabulary.
ops::CrossEntropyOptions split_vocabulary(ops::CrossEntropyOptions options, std::int64_t cols,
                                          std::int64_t vocab_size, Communicator& c) {
  options.vocab_start = cols * c.rank();
  options.vocab_size = vocab_size;
  // [2, rows] per rank -> [tp, 2, rows] -> the log-sum-exp over the ranks, the target
  // logit summed (one rank holds it; the others give 0).
  options.combine = [&c](const at::Tensor& stats) {
    const auto all = all_gather_dim(stats.unsqueeze(0), c, 0);
    return at::stack({all.select(1, 0).logsumexp(0), all.select(1, 1).sum(0)});
  };
  return options;
}
}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        std::int64_t vocab_size, const CommPtr& tp, std::int64_t ignore_index,
                                        double z_loss) {
  check_vocab_parallel("vocab_parallel_cross_entropy", local_logits.sizes(), targets, vocab_size, tp);
  DTRAIN_CHECK_ARG(std::isfinite(z_loss) && z_loss >= 0, "vocab_parallel_cross_entropy: z_loss is ", z_loss,
                   "; allowed: finite and >= 0 (0: none; PaLM: 1e-4)");
  // An ignored row's loss is finite (its target is outside every rank's columns) and is
  // multiplied by 0, which also zeroes its gradient.
  const auto keep = targets.ne(ignore_index);
  const auto rows = VocabParallelCrossEntropy::apply(local_logits, targets, vocab_size, handle(tp), z_loss);
  return (rows * keep).sum() / keep.sum().clamp_min(1);
}

at::Tensor fused_vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                              std::int64_t vocab_size, const CommPtr& tp,
                                              ops::CrossEntropyOptions options) {
  check_vocab_parallel("fused_vocab_parallel_cross_entropy", local_logits.sizes(), targets, vocab_size, tp);
  return ops::cross_entropy(local_logits, targets, split_vocabulary(options, local_logits.size(1), vocab_size, *tp));
}

at::Tensor fused_vocab_parallel_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& local_weight,
                                                     const at::Tensor& targets, std::int64_t vocab_size,
                                                     const CommPtr& tp, ops::CrossEntropyOptions options,
                                                     std::int64_t chunk_rows) {
  constexpr const char* kFn = "fused_vocab_parallel_linear_cross_entropy";
  DTRAIN_CHECK_ARG(hidden.dim() == 2 && local_weight.dim() == 2, kFn, ": hidden must be [rows, hidden] and ",
                   "local_weight [vocab/tp, hidden]; got ", hidden.sizes(), " and ", local_weight.sizes());
  // The shape checks of the logits this rank would have: [rows, vocab/tp].
  check_vocab_parallel(kFn, {hidden.size(0), local_weight.size(0)}, targets, vocab_size, tp);
  return ops::linear_cross_entropy(hidden, local_weight, targets,
                                   split_vocabulary(options, local_weight.size(0), vocab_size, *tp), chunk_rows);
}

namespace {
at::Generator default_generator(c10::Device device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator()
                         : at::globalContext().defaultGenerator(device);
}
}  // namespace

RngTracker::RngTracker(std::uint64_t seed, int tp_rank, c10::Device device) : device_(device) {
  // Each state: the default generator's state after seeding it (device-independent code).
  auto gen = default_generator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const auto saved = gen.get_state();
  const std::uint64_t seeds[2] = {seed + 1, seed + 2718 + static_cast<std::uint64_t>(tp_rank)};
  for (int i = 0; i < 2; ++i) {
    gen.set_current_seed(seeds[i]);
    states_[i] = gen.get_state();
  }
  gen.set_state(saved);
}

RngTracker::Fork::Fork(RngTracker* owner, Stream stream) : owner_(owner), stream_(stream) {
  auto gen = default_generator(owner_->device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  saved_ = gen.get_state();
  gen.set_state(owner_->states_[static_cast<int>(stream_)]);
}

RngTracker::Fork::~Fork() {
  auto gen = default_generator(owner_->device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  owner_->states_[static_cast<int>(stream_)] = gen.get_state();
  gen.set_state(saved_);
}

std::unique_ptr<RngTracker::Fork> RngTracker::fork(Stream stream) {
  return std::unique_ptr<Fork>(new Fork(this, stream));
}

std::vector<at::Tensor> RngTracker::states() const {
  return {states_[0].clone(), states_[1].clone()};
}

void RngTracker::set_states(const std::vector<at::Tensor>& states) {
  DTRAIN_CHECK_ARG(states.size() == 2, "RngTracker::set_states: expected 2 states, got ",
                   states.size());
  states_[0] = states[0].clone();
  states_[1] = states[1].clone();
}

at::Tensor dropout(const at::Tensor& x, double p, bool training, RngTracker& rng,
                   RngTracker::Stream stream) {
  DTRAIN_CHECK_ARG(p >= 0 && p < 1, "dropout probability ", p, " is out of range; allowed: [0, 1)");
  if (!training || p == 0) return x;
  const auto fork = rng.fork(stream);
  return torch::dropout(x, p, /*train=*/true);
}

}  // namespace dtrain::tp
