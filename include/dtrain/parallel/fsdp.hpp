// Sharded data parallelism (ZeRO / FSDP): parameters are grouped into units (by default
// one per transformer block, plus one for the rest), each unit flattened into one buffer
// padded so every rank's shard has the same size. zero1: gradients are reduce-scattered
// after backward and each rank updates only its shard (optimizer state sharded); zero2: a
// unit's gradients are reduce-scattered as soon as its backward is done and kept only as
// shards; full (ZeRO-3): a block's parameters exist in full only around its forward and
// its backward (all-gathered before, with the next block's gather prefetched, and freed
// after); between uses each rank holds its shard.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/optim/optim.hpp"
#include "dtrain/parallel/block_hooks.hpp"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

// kHybrid: kFull inside each replica (the shard communicator), gradients averaged across
// replicas (the replicate communicator).
enum class ShardingStrategy { kZero1, kZero2, kFull, kHybrid };

// "zero1" | "zero2" | "full" | "hybrid"; raises InvalidArgument naming --fsdp and the
// allowed values.
ShardingStrategy parse_sharding(const std::string& name);
const char* to_string(ShardingStrategy s);

// Parameter name -> unit key; parameters with the same key form one unit. Units are
// ordered by their first parameter.
using WrapPolicy = std::function<std::string(const std::string& name)>;
// The Gpt model's units: "h.<i>.*" -> "h.<i>" (one per transformer block), the token and
// position embeddings -> "embed", the final norm and output projection -> "head";
// anything else -> "root". Under full sharding "h.<i>", "embed" and "head" are gathered
// only around their use (the model calls BlockHooks around each); "root" stays gathered.
std::string block_wrap_policy(const std::string& name);

struct FsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::kZero1;
  WrapPolicy wrap = block_wrap_policy;
  bool allow_unused = false;         // a parameter without a gradient is an error by default
  bool broadcast_parameters = true;  // copy rank 0's parameters to every rank at start
  AdamWOptions adamw;                // weight decay as make_adamw decides it, per element
  // full: free a unit's parameters after its forward (never the last block, whose
  // backward comes next, nor the head; nor tied embeddings, which the head uses again);
  // units are always freed after their backward.
  bool reshard_after_forward = true;
  int prefetch = 1;                   // full: units gathered ahead, in forward and backward
  // Mixed precision: the dtype the parameters are computed in (Undefined: as given; e.g.
  // BFloat16) and the dtype gradients are reduced in (Undefined: float32). Master weights
  // and optimizer state are always float32 shards.
  c10::ScalarType param_dtype = c10::ScalarType::Undefined;
  c10::ScalarType reduce_dtype = c10::ScalarType::Undefined;
  // Tensor parallelism underneath (each rank's parameters are its tp slices): the tp group
  // and, per parameter name, the element offset from which it is the same on every tp rank
  // (0: wholly replicated, like norm weights; a parameter not listed is wholly distinct).
  // Only clip_grad_norm uses them: distinct elements are summed over tp, replicated ones
  // counted once.
  CommPtr tp;
  std::vector<std::pair<std::string, std::int64_t>> tp_replicated;
  // Pipeline parallelism around (each rank's parameters are its stage's): the norm is
  // summed over pp too; `uncounted` parameters (a last stage's copy of tied embeddings,
  // which the first stage's counts) stay out of it. Only clip_grad_norm uses them.
  CommPtr pp;
  std::vector<std::string> uncounted;
};

struct FsdpStats {
  std::int64_t units = 0;
  std::int64_t launched_during_backward = 0;  // last sync: units reduce-scattered from hooks
  std::int64_t shard_numel = 0;               // this rank's elements over all units (padded)
  double sync_wait_ms = 0;                    // last sync: time blocked after backward
  std::int64_t gathered_units = 0;            // full: units whose parameters exist now
  std::int64_t gathered_bytes = 0;            // full: bytes of those units' flat buffers
  std::int64_t peak_gathered_units = 0;       // full: most at once since the last zero_grad
  double comm_bytes = 0;  // since the last zero_grad: bytes this rank sent (wire_bytes)
};

// One piece of a global (unsharded) tensor: its elements [offset, offset + numel) in
// row-major order. A rank's pieces plus the global shapes place its shards in the global
// tensors (what a checkpoint stores); pieces from any layout can be loaded into any other.
struct TensorPiece {
  std::string name;                 // the parameter's name, e.g. "h.0.attn_qkv.weight"
  std::vector<std::int64_t> shape;  // the global tensor's shape
  std::int64_t offset = 0;          // flattened index of values[0] in the global tensor
  at::Tensor values;                // 1-D
};

// Model and optimizer state as pieces: float32 master parameters and AdamW's moments
// (exp_avg, exp_avg_sq: empty before the first optimizer step).
struct ShardedState {
  std::int64_t optimizer_step = 0;  // AdamW steps taken (its bias correction)
  std::vector<TensorPiece> params, exp_avg, exp_avg_sq;
};

// Usage per optimizer step: zero_grad(); for each micro-batch set_sync(is_last), backward;
// finish_gradient_sync(); clip_grad_norm(max); step(lr). The parameters handed in are
// re-pointed into the units' flat buffers (same tensors, same names). Not copyable.
class ShardedDataParallel {
 public:
  // shard_comm: the ranks that split each unit; replicate_comm (hybrid only): the ranks
  // that hold the same shard in the other replicas (null or size 1: none).
  ShardedDataParallel(NamedParameters params, CommPtr shard_comm, FsdpOptions options = {},
                      CommPtr replicate_comm = nullptr);
  ~ShardedDataParallel();
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  void set_sync(bool sync) { sync_ = sync; }
  // Every unit's gradient reduced (averaged) into this rank's shard; full gradients freed.
  void finish_gradient_sync();
  // Global L2 norm of the sharded gradients (one all-reduce; two under tensor
  // parallelism, see FsdpOptions::tp and ::pp); clips them to max_norm
  // (infinity: no clipping) and returns the norm before clipping. grad_scale: the loss
  // scale the gradients carry (dtrain::clip_grad_norm unscales them in the same pass).
  // extra: gradients outside the shards that share the norm and are clipped with them
  // (experts split over ep, see train::Trainer).
  double clip_grad_norm(double max_norm, double grad_scale = 1.0,
                        const std::vector<GradGroup>& extra = {});
  // AdamW on this rank's shards at learning rate lr, then the all-gather of the
  // parameters.
  void step(double lr);
  // Drops gradients (full and sharded).
  void zero_grad();
  // full: every unit's parameters gathered (e.g. to read or save them); they are freed
  // again by the next forward. zero1/zero2: nothing to do.
  void gather_parameters();
  // full: the hooks the model must call around each block (models::Gpt::set_block_hooks);
  // null for zero1/zero2.
  BlockHooks* block_hooks();
  // The sharded AdamW (its state holds this rank's shards only).
  const torch::optim::Optimizer& optimizer() const { return *optimizer_; }

  const FsdpStats& stats() const { return stats_; }
  ShardingStrategy strategy() const { return options_.strategy; }
  // Name and unit of every parameter, in order ("h.0" ...), for logs and checkpoints.
  std::vector<std::pair<std::string, std::string>> layout() const;

  // This rank's shards as pieces (views of the live state, no copies; padding excluded; a
  // parameter with no element on this rank has no piece). primary_replica() says whether
  // this rank's replica should save them (hybrid: replica 0; otherwise every rank).
  // Under tensor parallelism the "whole" tensors of these states are this tp rank's slices
  // (models::GptImpl::tp_shards() places them in the model's tensors): states load only
  // into the same tp layout until checkpoints map slices (issue 9).
  ShardedState sharded_state() const;
  bool primary_replica() const;
  // Whole tensors (one piece each, offset 0, float32) on `root` of the shard communicator;
  // a collective: every rank calls it, the others get only optimizer_step.
  ShardedState full_state(int root = 0);
  // Copies every element of `state` that falls in this rank's shards: pieces of any layout
  // and world size (all ranks' sharded_state() together) or a full_state(). Every element
  // this rank holds must be covered, and names and shapes must match: otherwise
  // InvalidArgument naming the tensor. Empty moments reset the optimizer. Parameters are
  // then all-gathered (a collective).
  void load_state(const ShardedState& state);

 private:
  struct Unit;
  class Hooks;
  void on_grad_accumulated(std::size_t index);
  void launch_ready_units();
  void launch(Unit& u);
  // Waits for u's reduce-scatter and frees its full-size buffer; hybrid: then issues the
  // all-reduce of the shard across replicas.
  void finish_reduce_scatter(Unit& u);
  void issue_gather(Unit& u);
  void ensure_gathered(Unit& u);
  void release(Unit& u);
  Unit* unit_at(std::ptrdiff_t position);  // order_[position]; null when out of range
  void gather_at(std::int64_t position, int direction);
  // After the masters changed (step, load): cast into the parameter-dtype shards and
  // all-gather (zero1/zero2) or mark gathered units stale and regather (full).
  void publish_parameters();
  void fused_step(double lr);
  // Full sharding around block forward/backward (called from autograd functions).
  static void before_forward(std::int64_t owner, std::int64_t position);
  static void after_forward(std::int64_t owner, std::int64_t position);
  static void before_backward(std::int64_t owner, std::int64_t position);

  bool full_sharding() const {
    return options_.strategy == ShardingStrategy::kFull ||
           options_.strategy == ShardingStrategy::kHybrid;
  }

  NamedParameters params_;
  CommPtr comm_;
  CommPtr replicate_;  // null unless hybrid with several replicas
  c10::ScalarType reduce_dtype_ = c10::ScalarType::Float;
  FsdpOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;  // in parameter order
  std::vector<std::size_t> unit_of_;
  std::vector<std::int64_t> offset_of_;
  std::vector<bool> seen_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<Hooks> hooks_;
  // full: the units in the order forward uses them (embed, blocks, head; each that
  // exists), and where block 0 and the head sit in it (-1: none).
  std::vector<Unit*> order_;
  std::int64_t first_block_ = 0, n_blocks_ = 0, head_at_ = -1;
  std::size_t next_launch_ = 0;  // index into the reverse unit order
  // Units whose reduce-scatter is in flight with their full-size gradient buffer, oldest
  // first; at most kMaxInFlight stay (older ones are finished when a new one launches),
  // so full gradients never exist for more than a few units at once.
  std::vector<Unit*> in_flight_;
  static constexpr std::size_t kMaxInFlight = 2;
  bool sync_ = true;
  bool in_backward_ = false;
  FsdpStats stats_;
};

}  // namespace dtrain
