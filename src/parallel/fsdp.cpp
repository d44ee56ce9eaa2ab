// ShardedDataParallel (ZeRO-1/2): units of flat, padded, sharded parameters; gradient
// reduce-scatter after backward (zero1) or per unit from post-accumulate hooks (zero2);
// AdamW on the shards with per-element weight decay; all-gather of the parameters.
#include "dtrain/parallel/fsdp.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>

#include "dtrain/core/error.hpp"
#include "dtrain/core/logging.hpp"
#include "dtrain/ops/adamw.hpp"

namespace dtrain {

ShardingStrategy parse_sharding(const std::string& name) {
  if (name == "zero1") return ShardingStrategy::kZero1;
  if (name == "zero2") return ShardingStrategy::kZero2;
  if (name == "full") return ShardingStrategy::kFull;
  if (name == "hybrid") return ShardingStrategy::kHybrid;
  throw InvalidArgument(detail::str_cat("--fsdp '", name,
                                        "' is not known; allowed: none, zero1, zero2, full, hybrid"));
}

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kZero1: return "zero1";
    case ShardingStrategy::kZero2: return "zero2";
    case ShardingStrategy::kFull: return "full";
    case ShardingStrategy::kHybrid: return "hybrid";
  }
  return "?";
}

std::string block_wrap_policy(const std::string& name) {
  auto starts = [&](const char* prefix) { return name.rfind(prefix, 0) == 0; };
  if (starts("h.")) {
    const auto dot = name.find('.', 2);
    if (dot != std::string::npos) return name.substr(0, dot);
  }
  if (starts("tok_emb.") || starts("pos_emb.")) return "embed";
  if (starts("ln_f_") || starts("lm_head.")) return "head";
  return "root";
}

namespace {

// [lo, hi) of a parameter's flattened elements that lie in one shard of its unit.
struct Span {
  std::int64_t lo = 0, hi = 0;  // parameter-local element indices
  std::int64_t at = 0;          // index of element lo in the shard
};

Span span_in_shard(std::int64_t param_offset, std::int64_t param_numel, std::int64_t shard_begin,
                   std::int64_t shard_numel) {
  Span s;
  const std::int64_t lo = std::max(param_offset, shard_begin);
  const std::int64_t hi = std::min(param_offset + param_numel, shard_begin + shard_numel);
  if (hi <= lo) return s;
  s.lo = lo - param_offset;
  s.hi = hi - param_offset;
  s.at = lo - shard_begin;
  return s;
}

}  // namespace

struct ShardedDataParallel::Unit {
  std::string key;
  std::vector<std::size_t> params;  // indices into params_
  std::int64_t numel = 0;           // unpadded
  std::int64_t shard = 0;           // elements per rank
  at::Tensor flat;                  // [shard * size]: the parameters live here
  at::Tensor master;                // float32 shard the optimizer updates
  at::Tensor param_shard;           // the shard in the parameter dtype (all-gather input);
                                    // master itself when that is a view of flat
  // Runs (start, length) of this rank's shard where weight decay applies.
  std::vector<std::pair<std::int64_t, std::int64_t>> decay_runs;
  // Runs (start, length, replicated across tp) of the shard that the gradient norm counts
  // (FsdpOptions::tp_replicated, ::uncounted); padding and uncounted parameters are not in.
  struct NormRun {
    std::int64_t at, len;
    bool replicated;
  };
  std::vector<NormRun> norm_runs;
  at::Tensor grad_flat;             // [shard * size] during a sync
  at::Tensor grad_shard;            // [shard]
  std::size_t ready = 0;
  WorkPtr work;
  // full sharding: flat's storage is freed between uses and all-gathered again.
  bool reshard = false;             // freed after forward and after its backward
  bool gathered = true;
  WorkPtr pending;                  // an issued (prefetched) gather
  at::Tensor gather_out;            // alias of flat with its own version counter
  bool cast_by_step = false;        // the fused step wrote param_shard from master
};

// Gathers a unit in forward before its use and (through backward of the exit function)
// before its backward; releases it after its forward.
class ShardedDataParallel::Hooks final : public BlockHooks {
 public:
  explicit Hooks(ShardedDataParallel* owner) : owner_(owner) {}
  at::Tensor enter(std::size_t index, const at::Tensor& x) override;
  at::Tensor exit(std::size_t index, const at::Tensor& y) override;
  void enter_embedding() override;
  at::Tensor exit_embedding(const at::Tensor& x, bool reused) override;
  at::Tensor enter_head(const at::Tensor& x) override;

 private:
  ShardedDataParallel* owner_;
};

namespace {
struct AccumulatedHook : torch::autograd::PostAccumulateGradHook {
  explicit AccumulatedHook(std::function<void()> f) : fn(std::move(f)) {}
  void operator()(const torch::autograd::Variable&) override { fn(); }
  std::function<void()> fn;
};
}  // namespace

ShardedDataParallel::ShardedDataParallel(NamedParameters params, CommPtr shard_comm,
                                         FsdpOptions options, CommPtr replicate_comm)
    : params_(std::move(params)), comm_(std::move(shard_comm)), options_(std::move(options)) {
  DTRAIN_CHECK_ARG(comm_ != nullptr, "ShardedDataParallel needs a data-parallel communicator");
  DTRAIN_CHECK_ARG(options_.strategy == ShardingStrategy::kHybrid || replicate_comm == nullptr ||
                       replicate_comm->size() == 1,
                   "ShardedDataParallel: a replicate communicator needs the hybrid strategy");
  if (replicate_comm && replicate_comm->size() > 1) replicate_ = std::move(replicate_comm);
  DTRAIN_CHECK_ARG(!params_.empty(), "ShardedDataParallel: no parameters");
  const int world = comm_->size(), rank = comm_->rank();
  // Units in order of their first parameter.
  std::map<std::string, std::size_t> index;
  unit_of_.assign(params_.size(), 0);
  offset_of_.assign(params_.size(), 0);
  seen_.assign(params_.size(), false);
  const auto given = params_[0].second.scalar_type();
  const auto device = params_[0].second.device();
  const auto dtype = options_.param_dtype == c10::ScalarType::Undefined ? given : options_.param_dtype;
  reduce_dtype_ = options_.reduce_dtype == c10::ScalarType::Undefined ? at::kFloat : options_.reduce_dtype;
  for (auto t : {dtype, reduce_dtype_}) {
    DTRAIN_CHECK_ARG(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
                     "ShardedDataParallel: dtype ", t, " is not allowed; allowed: float32, bfloat16, float16");
  }
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const auto& [name, p] = params_[k];
    DTRAIN_CHECK_ARG(p.requires_grad(), "ShardedDataParallel: parameter '", name,
                     "' does not require grad; pass only trainable parameters");
    DTRAIN_CHECK_ARG(p.scalar_type() == given && p.device() == device,
                     "ShardedDataParallel: parameter '", name, "' is ", p.scalar_type(), " on ",
                     p.device(), "; every parameter must be ", given, " on ", device);
    const std::string key = options_.wrap(name);
    auto it = index.find(key);
    if (it == index.end()) {
      it = index.emplace(key, units_.size()).first;
      units_.push_back(std::make_unique<Unit>());
      units_.back()->key = key;
    }
    auto& u = *units_[it->second];
    unit_of_[k] = it->second;
    offset_of_[k] = u.numel;
    u.params.push_back(k);
    u.numel += p.numel();
  }
  torch::NoGradGuard no_grad;
  for (auto& up : units_) {
    auto& u = *up;
    u.shard = (u.numel + world - 1) / world;
    // The given values, exactly, then cast to the compute dtype.
    auto full = torch::zeros({u.shard * world}, torch::TensorOptions().dtype(given).device(device));
    for (std::size_t k : u.params) {
      auto& [name, p] = params_[k];
      full.narrow(0, offset_of_[k], p.numel()).copy_(p.detach().reshape({-1}));
      // Elements [from, from + count) of the parameter, as a run of this rank's shard.
      auto add_run = [&](std::vector<std::pair<std::int64_t, std::int64_t>>& runs,
                         std::int64_t from, std::int64_t count) {
        const Span sp = span_in_shard(offset_of_[k] + from, count, rank * u.shard, u.shard);
        if (sp.hi == sp.lo) return;
        if (!runs.empty() && runs.back().first + runs.back().second == sp.at) {
          runs.back().second += sp.hi - sp.lo;  // adjacent: one run
        } else {
          runs.emplace_back(sp.at, sp.hi - sp.lo);
        }
      };
      if (decays(name, p, options_.adamw)) add_run(u.decay_runs, 0, p.numel());
      if (std::find(options_.uncounted.begin(), options_.uncounted.end(), name) ==
          options_.uncounted.end()) {
        std::int64_t from = p.numel();  // tp-replicated from this element on
        for (const auto& [rname, f] : options_.tp_replicated) {
          if (rname == name) from = std::min(from, f);
        }
        for (const bool replicated : {false, true}) {
          const std::int64_t lo = replicated ? from : 0, hi = replicated ? p.numel() : from;
          const Span sp = span_in_shard(offset_of_[k] + lo, hi - lo, rank * u.shard, u.shard);
          if (sp.hi == sp.lo) continue;
          auto& runs = u.norm_runs;
          if (!runs.empty() && runs.back().replicated == replicated &&
              runs.back().at + runs.back().len == sp.at) {
            runs.back().len += sp.hi - sp.lo;  // adjacent: one run
          } else {
            runs.push_back({sp.at, sp.hi - sp.lo, replicated});
          }
        }
      }
    }
    if (options_.broadcast_parameters) {
      comm_->broadcast(full, {0})->wait();
      if (replicate_) replicate_->broadcast(full, {0})->wait();
    }
    u.flat = dtype == given ? full : full.to(dtype);
    for (std::size_t k : u.params) {
      auto& p = params_[k].second;
      // The parameter now lives in the flat buffer (in the compute dtype).
      p.set_data(u.flat.narrow(0, offset_of_[k], p.numel()).view(p.sizes()));
    }
    // zero1/zero2 in float32 update the shard inside the flat buffer; otherwise (full
    // sharding frees the buffer; mixed precision needs float32) the master is apart.
    u.master = full.narrow(0, rank * u.shard, u.shard);
    if (full_sharding() || dtype != given || given != at::kFloat) {
      u.master = u.master.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      // The all-gather input: the master itself when no cast is needed.
      u.param_shard = dtype == at::kFloat ? u.master : u.master.to(dtype, false, true);
    } else {
      u.param_shard = u.master;
    }
    stats_.shard_numel += u.shard;
  }
  stats_.units = static_cast<std::int64_t>(units_.size());
  stats_.gathered_units = stats_.peak_gathered_units = stats_.units;
  for (auto& u : units_) stats_.gathered_bytes += static_cast<std::int64_t>(u->flat.nbytes());

  // AdamW without its own decay (applied per element in step()).
  std::vector<at::Tensor> masters;
  for (auto& u : units_) masters.push_back(u->master);
  const auto& o = options_.adamw;
  DTRAIN_CHECK_ARG(o.lr > 0 && o.eps > 0 && o.weight_decay >= 0 && o.beta1 >= 0 && o.beta1 < 1 &&
                       o.beta2 >= 0 && o.beta2 < 1,
                   "ShardedDataParallel: AdamW options out of range (lr ", o.lr, ", betas ", o.beta1,
                   "/", o.beta2, ", eps ", o.eps, ", weight_decay ", o.weight_decay, ")");
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      masters, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(0.0));

  if (full_sharding()) {
    // The units in the order forward uses them: embed, "h.0", "h.1", ..., head.
    auto add = [&](const std::string& key) {
      auto it = index.find(key);
      if (it == index.end()) return false;
      order_.push_back(units_[it->second].get());
      return true;
    };
    add("embed");
    first_block_ = static_cast<std::int64_t>(order_.size());
    // The blocks h.<b>, h.<b + 1>, ... from the lowest index (a pipeline stage's first).
    std::int64_t lowest = -1, blocks = 0;
    for (const auto& [key, at] : index) {
      if (key.rfind("h.", 0) != 0) continue;
      ++blocks;
      const std::int64_t b = std::stoll(key.substr(2));
      lowest = lowest < 0 ? b : std::min(lowest, b);
    }
    while (lowest >= 0 && add("h." + std::to_string(lowest + n_blocks_))) ++n_blocks_;
    if (add("head")) head_at_ = static_cast<std::int64_t>(order_.size()) - 1;
    DTRAIN_CHECK_ARG(n_blocks_ > 0, "--fsdp ", to_string(options_.strategy),
                     " needs one unit per transformer block "
                     "(parameters named h.<i>.*, the default wrap policy)");
    DTRAIN_CHECK_ARG(n_blocks_ == blocks, "--fsdp ", to_string(options_.strategy), " needs the ",
                     "blocks of consecutive indices (h.", lowest, " ...); these parameters hold ",
                     blocks, " blocks of which ", n_blocks_, " are consecutive (several pipeline ",
                     "chunks per rank, --virtual-stages > 1, are not supported)");
    DTRAIN_CHECK_ARG(options_.prefetch >= 0, "FSDP prefetch=", options_.prefetch, " must be >= 0");
    for (auto* u : order_) {
      u->reshard = true;  // a "root" unit, if any, stays gathered
      release(*u);
    }
    hooks_ = std::make_unique<Hooks>(this);
  }
  if (options_.strategy != ShardingStrategy::kZero1) {
    for (std::size_t k = 0; k < params_.size(); ++k) {
      torch::autograd::impl::set_post_acc_grad_hooks(
          params_[k].second, std::make_unique<AccumulatedHook>([this, k] { on_grad_accumulated(k); }));
    }
  }
}

ShardedDataParallel::~ShardedDataParallel() {
  for (auto& u : units_) {
    if (u->pending) u->pending->wait();
  }
  if (options_.strategy == ShardingStrategy::kZero1) return;
  for (auto& [name, p] : params_) torch::autograd::impl::post_acc_grad_hooks(p).reset();
}

std::vector<std::pair<std::string, std::string>> ShardedDataParallel::layout() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    out.emplace_back(params_[k].first, units_[unit_of_[k]]->key);
  }
  return out;
}

void ShardedDataParallel::on_grad_accumulated(std::size_t k) {
  if (!sync_) return;
  if (!in_backward_) {
    in_backward_ = true;
    stats_.launched_during_backward = 0;
  }
  DTRAIN_CHECK(!seen_[k], "ShardedDataParallel: parameter '", params_[k].first,
               "' received two gradients in one backward");
  seen_[k] = true;
  auto& u = *units_[unit_of_[k]];
  if (++u.ready == u.params.size()) launch_ready_units();
}

// Units are reduce-scattered in reverse order (the order backward completes them), strictly
// one after another so that every rank issues the same collectives in the same order.
void ShardedDataParallel::launch_ready_units() {
  while (next_launch_ < units_.size()) {
    auto& u = *units_[units_.size() - 1 - next_launch_];
    if (u.ready != u.params.size()) break;
    if (in_backward_) ++stats_.launched_during_backward;
    launch(u);
    ++next_launch_;
  }
}

void ShardedDataParallel::launch(Unit& u) {
  torch::NoGradGuard no_grad;
  u.grad_flat = torch::zeros({u.shard * comm_->size()}, u.flat.options().dtype(reduce_dtype_));
  for (std::size_t k : u.params) {
    auto& p = params_[k].second;
    if (p.grad().defined()) {
      u.grad_flat.narrow(0, offset_of_[k], p.numel()).copy_(p.grad().reshape({-1}));
      p.mutable_grad() = at::Tensor();  // only the shard is kept
    }
  }
  u.grad_shard = torch::empty({u.shard}, u.grad_flat.options());
  u.work = comm_->reduce_scatter(u.grad_shard, u.grad_flat, {ReduceOp::kAvg});
  stats_.comm_bytes += wire_bytes(OpKind::kReduceScatter, static_cast<double>(u.grad_flat.nbytes()),
                                  comm_->size());
  // Every use of the unit's parameters in backward is done once all its gradients exist.
  if (u.reshard) release(u);
  in_flight_.push_back(&u);
  while (in_flight_.size() > kMaxInFlight) {
    finish_reduce_scatter(*in_flight_.front());
    in_flight_.erase(in_flight_.begin());
  }
}

void ShardedDataParallel::finish_reduce_scatter(Unit& u) {
  u.work->wait();
  u.work.reset();
  u.grad_flat = at::Tensor();
  if (replicate_) {
    // Hybrid: each shard's gradient is averaged across the replicas too.
    u.work = replicate_->all_reduce(u.grad_shard, {ReduceOp::kAvg});
    stats_.comm_bytes += wire_bytes(OpKind::kAllReduce, static_cast<double>(u.grad_shard.nbytes()),
                                    replicate_->size());
  }
}

// ---------------------------------------------------------------------------------------
// Full sharding: gather and release

void ShardedDataParallel::issue_gather(Unit& u) {
  if (u.gathered || u.pending) return;
  auto* storage = u.flat.storage().unsafeGetStorageImpl();
  const std::size_t nbytes = static_cast<std::size_t>(u.flat.numel()) * u.flat.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
  // Written through an alias with its own version counter: the parameters (views of flat)
  // may be saved for backward, and a gather must not count as an in-place change of them.
  u.gather_out = at::from_blob(u.flat.data_ptr(), {u.flat.numel()}, u.flat.options());
  u.pending = comm_->all_gather(u.gather_out, u.param_shard);
  stats_.comm_bytes += wire_bytes(OpKind::kAllGather, static_cast<double>(nbytes), comm_->size());
  stats_.peak_gathered_units = std::max(stats_.peak_gathered_units, ++stats_.gathered_units);
  stats_.gathered_bytes += static_cast<std::int64_t>(nbytes);
}

void ShardedDataParallel::ensure_gathered(Unit& u) {
  if (u.gathered) return;
  issue_gather(u);
  u.pending->wait();
  u.pending.reset();
  u.gather_out = at::Tensor();
  u.gathered = true;
}

void ShardedDataParallel::release(Unit& u) {
  if (!u.gathered) return;
  auto* storage = u.flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, u.flat.device()));
  storage->set_nbytes(0);
  u.gathered = false;
  --stats_.gathered_units;
  stats_.gathered_bytes -= static_cast<std::int64_t>(u.flat.numel()) * u.flat.element_size();
}

ShardedDataParallel::Unit* ShardedDataParallel::unit_at(std::ptrdiff_t position) {
  if (position < 0 || position >= static_cast<std::ptrdiff_t>(order_.size())) return nullptr;
  return order_[static_cast<std::size_t>(position)];
}

void ShardedDataParallel::gather_parameters() {
  for (auto& u : units_) ensure_gathered(*u);
}

BlockHooks* ShardedDataParallel::block_hooks() { return hooks_.get(); }

namespace {
// Identity functions that run a strategy callback in forward (EnterBlock, ExitBlock) and
// in backward (ExitBlock: before the block's backward). The owner and the block index
// travel as integers (IValue holds no raw pointers); the owner outlives the graph.
using Callback = void (*)(std::int64_t owner, std::int64_t block);

struct EnterBlock : public torch::autograd::Function<EnterBlock> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x,
                               std::int64_t owner, std::int64_t block, std::int64_t before) {
    reinterpret_cast<Callback>(before)(owner, block);
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct ExitBlock : public torch::autograd::Function<ExitBlock> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor y,
                               std::int64_t owner, std::int64_t block, std::int64_t after,
                               std::int64_t before_backward) {
    ctx->saved_data["owner"] = owner;
    ctx->saved_data["block"] = block;
    ctx->saved_data["before_backward"] = before_backward;
    reinterpret_cast<Callback>(after)(owner, block);
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    reinterpret_cast<Callback>(ctx->saved_data["before_backward"].toInt())(
        ctx->saved_data["owner"].toInt(), ctx->saved_data["block"].toInt());
    return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace

// Gathers the unit at `position` of order_ after issuing the gathers of the `prefetch`
// units that run next (direction +1 in forward, -1 in backward).
void ShardedDataParallel::gather_at(std::int64_t position, int direction) {
  for (int k = 1; k <= options_.prefetch; ++k) {
    if (auto* next = unit_at(position + direction * k)) issue_gather(*next);
  }
  if (auto* u = unit_at(position)) ensure_gathered(*u);
}

void ShardedDataParallel::before_forward(std::int64_t owner, std::int64_t position) {
  reinterpret_cast<ShardedDataParallel*>(owner)->gather_at(position, +1);
}

// After a unit's forward: free it, unless it is the last block (whose backward comes
// right after the head's).
void ShardedDataParallel::after_forward(std::int64_t owner, std::int64_t position) {
  auto* o = reinterpret_cast<ShardedDataParallel*>(owner);
  auto* u = o->unit_at(position);
  if (u != nullptr && u->reshard && o->options_.reshard_after_forward &&
      position != o->first_block_ + o->n_blocks_ - 1) {
    o->release(*u);
  }
}

void ShardedDataParallel::before_backward(std::int64_t owner, std::int64_t position) {
  reinterpret_cast<ShardedDataParallel*>(owner)->gather_at(position, -1);
}

namespace {
void keep(std::int64_t, std::int64_t) {}
}  // namespace

// Block i sits at first_block_ + i of order_; the embed unit (if any) at 0.
at::Tensor ShardedDataParallel::Hooks::enter(std::size_t index, const at::Tensor& x) {
  const auto owner = reinterpret_cast<std::int64_t>(owner_);
  const auto at = owner_->first_block_ + static_cast<std::int64_t>(index);
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) {
    before_forward(owner, at);
    return x;
  }
  return EnterBlock::apply(x, owner, at, reinterpret_cast<std::int64_t>(&before_forward));
}

at::Tensor ShardedDataParallel::Hooks::exit(std::size_t index, const at::Tensor& y) {
  const auto owner = reinterpret_cast<std::int64_t>(owner_);
  const auto at = owner_->first_block_ + static_cast<std::int64_t>(index);
  if (!torch::GradMode::is_enabled() || !y.requires_grad()) {
    after_forward(owner, at);
    return y;
  }
  return ExitBlock::apply(y, owner, at, reinterpret_cast<std::int64_t>(&after_forward),
                          reinterpret_cast<std::int64_t>(&before_backward));
}

void ShardedDataParallel::Hooks::enter_embedding() {
  if (owner_->first_block_ > 0) owner_->gather_at(0, +1);
}

// The embeddings are freed after their forward unless the head uses them again (tied),
// and gathered again before their backward (the last of the step).
at::Tensor ShardedDataParallel::Hooks::exit_embedding(const at::Tensor& x, bool reused) {
  if (owner_->first_block_ == 0) return x;  // no embed unit
  const auto owner = reinterpret_cast<std::int64_t>(owner_);
  const auto after = reinterpret_cast<std::int64_t>(reused ? &keep : &after_forward);
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) {
    reinterpret_cast<void (*)(std::int64_t, std::int64_t)>(after)(owner, 0);
    return x;
  }
  return ExitBlock::apply(x, owner, 0, after, reinterpret_cast<std::int64_t>(&before_backward));
}

// The head is gathered before its forward (prefetched by the last blocks) and stays
// gathered into backward, which starts with it; it is freed once its gradients are
// reduce-scattered.
at::Tensor ShardedDataParallel::Hooks::enter_head(const at::Tensor& x) {
  if (owner_->head_at_ >= 0) owner_->gather_at(owner_->head_at_, +1);
  return x;
}

void ShardedDataParallel::finish_gradient_sync() {
  const auto start = std::chrono::steady_clock::now();
  in_backward_ = false;
  std::string missing;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    if (seen_[k]) continue;
    const bool has_grad = params_[k].second.grad().defined();
    if (!has_grad) missing += (missing.empty() ? "" : ", ") + params_[k].first;
    ++units_[unit_of_[k]]->ready;
  }
  DTRAIN_CHECK_ARG(missing.empty() || options_.allow_unused,
                   "ShardedDataParallel: parameters received no gradient in this backward: ",
                   missing, " (set allow_unused to reduce them as zeros)");
  launch_ready_units();
  torch::NoGradGuard no_grad;
  for (Unit* u : in_flight_) finish_reduce_scatter(*u);
  in_flight_.clear();
  for (auto& up : units_) {
    auto& u = *up;
    if (u.work) u.work->wait();  // hybrid: the all-reduce across replicas
    u.work.reset();
    // Accumulate into the shard's gradient (several syncs between zero_grad calls add up).
    if (u.master.grad().defined()) {
      u.master.mutable_grad().add_(u.grad_shard);
    } else {
      u.master.mutable_grad() = u.grad_shard.to(at::kFloat);
    }
    u.grad_shard = at::Tensor();
    u.ready = 0;
  }
  std::fill(seen_.begin(), seen_.end(), false);
  next_launch_ = 0;
  stats_.sync_wait_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

double ShardedDataParallel::clip_grad_norm(double max_norm, double grad_scale,
                                           const std::vector<GradGroup>& extra) {
  const bool tp = options_.tp != nullptr && options_.tp->size() > 1;
  const bool pp = options_.pp != nullptr && options_.pp->size() > 1;
  std::vector<at::Tensor> shards;
  for (auto& u : units_) shards.push_back(u->master);
  if (!tp && !pp && options_.uncounted.empty() && extra.empty()) {
    return dtrain::clip_grad_norm(shards, max_norm, comm_.get(), grad_scale);
  }
  // Elements distinct across tp are summed over tp as well, tp-replicated ones count once;
  // stages hold distinct parameters (summed over pp); uncounted ones are left out of the
  // norm but clipped with the rest.
  GradGroup distinct{{}, {comm_.get()}}, replicated{{}, {comm_.get()}}, rest{{}, {}, false};
  if (tp) distinct.over.push_back(options_.tp.get());
  if (pp) {
    distinct.over.push_back(options_.pp.get());
    replicated.over.push_back(options_.pp.get());
  }
  for (auto& u : units_) {
    const auto g = u->master.grad();
    if (!g.defined()) continue;
    std::int64_t at = 0;
    for (const auto& r : u->norm_runs) {
      if (r.at > at) rest.grads.push_back(g.narrow(0, at, r.at - at));
      (r.replicated ? replicated : distinct).grads.push_back(g.narrow(0, r.at, r.len));
      at = r.at + r.len;
    }
    if (at < g.numel()) rest.grads.push_back(g.narrow(0, at, g.numel() - at));
  }
  std::vector<GradGroup> groups{distinct, replicated, rest};
  groups.insert(groups.end(), extra.begin(), extra.end());
  return dtrain::clip_grad_norm(groups, max_norm, grad_scale);
}

void ShardedDataParallel::step(double lr) {
  torch::NoGradGuard no_grad;
  if (options_.adamw.fused) {
    fused_step(lr);
    publish_parameters();
    return;
  }
  const double wd = options_.adamw.weight_decay;
  for (auto& u : units_) {
    // AdamW's decoupled decay, p *= 1 - lr * wd, where the element decays.
    if (wd <= 0 || !u->master.grad().defined()) continue;
    for (const auto& [at, len] : u->decay_runs) u->master.narrow(0, at, len).mul_(1.0 - lr * wd);
  }
  set_learning_rate(*optimizer_, lr);
  optimizer_->step();
  publish_parameters();
}

// One fused AdamW pass over every unit's shard: a segment per run of decay and of no
// decay, with the bfloat16/float16 parameter shard written in the same pass. The moments
// live in optimizer_'s AdamWParamState, as the unfused step keeps them.
void ShardedDataParallel::fused_step(double lr) {
  const auto& o = options_.adamw;
  std::map<std::pair<std::int64_t, c10::ScalarType>, std::vector<ops::AdamWSegment>> groups;
  for (auto& u : units_) {
    u->cast_by_step = false;
    const auto& grad = u->master.grad();
    if (!grad.defined()) continue;
    auto& st = advance_adamw_state(*optimizer_, u->master);
    const auto mt = u->param_shard.scalar_type();
    at::Tensor model;
    if (!u->param_shard.is_same(u->master) && (mt == at::kBFloat16 || mt == at::kHalf)) {
      model = u->param_shard;
      u->cast_by_step = true;
    }
    auto g = grad.is_contiguous() ? grad : grad.contiguous();
    auto& segs = groups[{st.step(), g.scalar_type()}];
    auto add = [&](std::int64_t at, std::int64_t len, double wd) {
      if (len <= 0) return;
      segs.push_back({u->master.narrow(0, at, len), g.narrow(0, at, len), st.exp_avg().narrow(0, at, len),
                      st.exp_avg_sq().narrow(0, at, len), model.defined() ? model.narrow(0, at, len) : at::Tensor(),
                      wd});
    };
    std::int64_t at = 0;
    for (const auto& [start, len] : u->decay_runs) {
      add(at, start - at, 0.0);
      add(start, len, o.weight_decay);
      at = start + len;
    }
    add(at, u->master.numel() - at, 0.0);
  }
  for (const auto& [key, segs] : groups) ops::fused_adamw(segs, ops::adamw_hyper(lr, o.beta1, o.beta2, o.eps, key.first));
}

void ShardedDataParallel::publish_parameters() {
  torch::NoGradGuard no_grad;
  for (auto& u : units_) {
    // Cast (unless the fused step already wrote the shard in the parameter dtype).
    if (!u->param_shard.is_same(u->master) && !u->cast_by_step) u->param_shard.copy_(u->master);
    u->cast_by_step = false;
  }
  if (!full_sharding()) {
    std::vector<WorkPtr> works;
    for (auto& u : units_) {
      works.push_back(comm_->all_gather(u->flat, u->param_shard));  // in place in float32
      stats_.comm_bytes += wire_bytes(OpKind::kAllGather, static_cast<double>(u->flat.nbytes()),
                                      comm_->size());
    }
    for (auto& w : works) w->wait();
    return;
  }
  // Full sharding: units still gathered hold stale values. Units that reshard are freed
  // (the next forward gathers them); a "root" unit is gathered again now.
  for (auto& u : units_) {
    if (u->reshard) {
      release(*u);
    } else {
      u->gathered = false;  // stale
      --stats_.gathered_units;
      issue_gather(*u);
    }
  }
  for (auto& u : units_) {
    if (!u->reshard) ensure_gathered(*u);
  }
}

bool ShardedDataParallel::primary_replica() const { return !replicate_ || replicate_->rank() == 0; }

ShardedState ShardedDataParallel::sharded_state() const {
  ShardedState st;
  const std::int64_t rank = comm_->rank();
  std::vector<at::Tensor> avg(units_.size()), sq(units_.size());
  for (std::size_t i = 0; i < units_.size(); ++i) {
    auto it = optimizer_->state().find(units_[i]->master.unsafeGetTensorImpl());
    if (it == optimizer_->state().end()) continue;
    const auto& ps = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    avg[i] = ps.exp_avg();
    sq[i] = ps.exp_avg_sq();
    st.optimizer_step = ps.step();
  }
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const auto& u = *units_[unit_of_[k]];
    const std::string& name = params_[k].first;  // not a structured binding: C++17
    const at::Tensor& p = params_[k].second;      // lambdas cannot capture those
    const Span s = span_in_shard(offset_of_[k], p.numel(), rank * u.shard, u.shard);
    if (s.hi == s.lo) continue;
    auto piece = [&](const at::Tensor& shard) {
      return TensorPiece{name, p.sizes().vec(), s.lo, shard.narrow(0, s.at, s.hi - s.lo)};
    };
    st.params.push_back(piece(u.master));
    if (avg[unit_of_[k]].defined()) {
      st.exp_avg.push_back(piece(avg[unit_of_[k]]));
      st.exp_avg_sq.push_back(piece(sq[unit_of_[k]]));
    }
  }
  return st;
}

ShardedState ShardedDataParallel::full_state(int root) {
  DTRAIN_CHECK_ARG(root >= 0 && root < comm_->size(), "full_state: root ", root,
                   " is not a rank of the ", comm_->size(), "-rank shard communicator");
  torch::NoGradGuard no_grad;
  const ShardedState mine = sharded_state();
  ShardedState st;
  st.optimizer_step = mine.optimizer_step;
  const bool have_moments = !optimizer_->state().empty();  // the same on every rank
  const bool is_root = comm_->rank() == root;
  for (auto& up : units_) {
    auto& u = *up;
    auto gather = [&](const at::Tensor& shard) {
      auto out = at::empty({u.shard * comm_->size()}, shard.options());
      comm_->all_gather(out, shard.contiguous())->wait();
      return out;
    };
    std::vector<at::Tensor> fulls;  // gathered: master, then exp_avg and exp_avg_sq
    std::vector<std::vector<TensorPiece>*> outs;
    fulls.push_back(gather(u.master));
    outs.push_back(&st.params);
    if (have_moments) {
      auto it = optimizer_->state().find(u.master.unsafeGetTensorImpl());
      DTRAIN_CHECK(it != optimizer_->state().end(), "full_state: unit ", u.key, " has no AdamW state");
      const auto& ps = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      fulls.push_back(gather(ps.exp_avg()));
      outs.push_back(&st.exp_avg);
      fulls.push_back(gather(ps.exp_avg_sq()));
      outs.push_back(&st.exp_avg_sq);
    }
    if (!is_root) continue;
    for (std::size_t k : u.params) {
      const auto& [name, p] = params_[k];
      for (std::size_t j = 0; j < fulls.size(); ++j) {
        outs[j]->push_back(TensorPiece{name, p.sizes().vec(), 0,
                                       fulls[j].narrow(0, offset_of_[k], p.numel()).clone()});
      }
    }
  }
  return st;
}

void ShardedDataParallel::load_state(const ShardedState& state) {
  torch::NoGradGuard no_grad;
  const std::int64_t rank = comm_->rank();
  // Copies the pieces of `pieces` into `shards` (one per unit), checking coverage.
  auto load = [&](const std::vector<TensorPiece>& pieces, std::vector<at::Tensor>& shards,
                  const char* what) {
    std::map<std::string, std::vector<const TensorPiece*>> by_name;
    for (const auto& piece : pieces) by_name[piece.name].push_back(&piece);
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const auto& u = *units_[unit_of_[k]];
      const auto& [name, p] = params_[k];
      const Span s = span_in_shard(offset_of_[k], p.numel(), rank * u.shard, u.shard);
      if (s.hi == s.lo) continue;
      auto it = by_name.find(name);
      DTRAIN_CHECK_ARG(it != by_name.end(), "load_state: ", what, " of '", name,
                       "' is missing (this rank holds its elements ", s.lo, "..", s.hi, ")");
      std::vector<std::pair<std::int64_t, std::int64_t>> covered;
      for (const TensorPiece* piece : it->second) {
        DTRAIN_CHECK_ARG(piece->shape == p.sizes().vec(), "load_state: ", what, " of '", name,
                         "' has shape ", at::IntArrayRef(piece->shape), "; the model's is ",
                         p.sizes());
        const std::int64_t n = piece->values.numel();
        DTRAIN_CHECK_ARG(piece->offset >= 0 && piece->offset + n <= p.numel(), "load_state: ",
                         what, " of '", name, "' has a piece at ", piece->offset, "+", n,
                         " outside its ", p.numel(), " elements");
        const std::int64_t lo = std::max(s.lo, piece->offset), hi = std::min(s.hi, piece->offset + n);
        if (hi <= lo) continue;
        shards[unit_of_[k]]
            .narrow(0, s.at + (lo - s.lo), hi - lo)
            .copy_(piece->values.reshape({-1}).narrow(0, lo - piece->offset, hi - lo));
        covered.emplace_back(lo, hi);
      }
      std::sort(covered.begin(), covered.end());
      std::int64_t reach = s.lo;
      for (const auto& [lo, hi] : covered) {
        if (lo > reach) break;
        reach = std::max(reach, hi);
      }
      DTRAIN_CHECK_ARG(reach >= s.hi, "load_state: ", what, " of '", name, "' does not cover element ",
                       reach, " (this rank holds ", s.lo, "..", s.hi, ")");
    }
  };
  std::vector<at::Tensor> masters;
  for (auto& u : units_) masters.push_back(u->master);
  load(state.params, masters, "parameter");
  optimizer_->state().clear();
  if (!state.exp_avg.empty() || !state.exp_avg_sq.empty()) {
    std::vector<at::Tensor> avg, sq;
    for (auto& u : units_) {
      avg.push_back(at::zeros_like(u->master));
      sq.push_back(at::zeros_like(u->master));
    }
    load(state.exp_avg, avg, "exp_avg");
    load(state.exp_avg_sq, sq, "exp_avg_sq");
    for (std::size_t i = 0; i < units_.size(); ++i) {
      auto ps = std::make_unique<torch::optim::AdamWParamState>();
      ps->step(state.optimizer_step);
      ps->exp_avg(avg[i]);
      ps->exp_avg_sq(sq[i]);
      optimizer_->state()[units_[i]->master.unsafeGetTensorImpl()] = std::move(ps);
    }
  }
  publish_parameters();
}

void ShardedDataParallel::zero_grad() {
  stats_.peak_gathered_units = stats_.gathered_units;
  stats_.comm_bytes = 0;
  for (auto& u : units_) u->master.mutable_grad() = at::Tensor();
  for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
}

}  // namespace dtrain
