// The mixture-of-experts MLP of a transformer block: a router picks top-k SwiGLU experts
// per token; the experts are split over the ep group (tokens exchanged by all-to-all) and
// their width over tp. Keeps per-step routing statistics for telemetry and bias balancing.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/parallel/expert_parallel.hpp"

namespace dtrain::models {

// Routing statistics since the last reset (device tensors: no synchronisation while
// training). counts: assignments per expert [E] before dropping; the scalars are sums over
// the forwards recorded.
struct MoeStats {
  at::Tensor counts;          // [E] float64
  at::Tensor dropped;         // assignments dropped by capacity
  at::Tensor aux_loss, z_loss;  // with their coefficients
  std::int64_t forwards = 0;
};

// Parameters (names as Gpt registers them under the block): router.weight [E, d]
// (replicated), fc.weight and gate.weight [E/ep, F/tp, d], proj.weight [E/ep, d, F/tp]
// (this rank's experts, this tp rank's slice of their width).
class MoeImpl : public torch::nn::Module {
 public:
  // tp: the tensor-parallel group (sequence_parallel: the input is split by sequence);
  // ep: the expert-parallel group; cp: the context-parallel group (each rank routes its
  // positions of the sequences; the load-balancing loss counts all of theirs), or null.
  MoeImpl(const ep::MoeOptions& options, std::int64_t d_model, std::int64_t hidden, CommPtr tp,
          bool sequence_parallel, CommPtr ep, CommPtr cp = nullptr);
  // x: the block's normed input [B, T (/ tp with sequence parallelism), d] -> the MLP output
  // of the same shape. Dropped assignments add nothing (the token keeps its residual). In
  // training the auxiliary losses enter the backward (see set_aux_loss_scale) and the
  // routing is recorded in stats().
  at::Tensor forward(const at::Tensor& x);
  // The factor the caller multiplies the training loss by before backward (accumulation,
  // loss scaling): the auxiliary losses' gradients get the same. 1 by default.
  void set_aux_loss_scale(double scale) { aux_scale_ = scale; }
  const MoeStats& stats() const { return stats_; }
  void reset_stats();
  // Aux-loss-free balancing: bias += rate * sign(mean load - load) from the step's global
  // assignments per expert [E] (the same on every rank, so the biases stay equal).
  void update_bias(const at::Tensor& global_counts);
  const at::Tensor& bias() const { return bias_; }
  const ep::MoeOptions& options() const { return options_; }
  std::int64_t local_experts() const { return options_.experts / ep_->size(); }

  at::Tensor router, fc, gate, proj;

 private:
  at::Tensor experts(const at::Tensor& rows, const std::vector<std::int64_t>& rows_per_expert);
  ep::MoeOptions options_;
  std::int64_t d_;
  CommPtr tp_, ep_, cp_;
  bool sequence_parallel_;
  double aux_scale_ = 1.0;
  at::Tensor bias_;
  MoeStats stats_;
};
TORCH_MODULE(Moe);

// While alive, MoE layers do not record statistics (activation checkpointing's
// recomputation of a forward that was already recorded).
class MoeRecomputeScope {
 public:
  MoeRecomputeScope();
  ~MoeRecomputeScope();
  MoeRecomputeScope(const MoeRecomputeScope&) = delete;
  MoeRecomputeScope& operator=(const MoeRecomputeScope&) = delete;
  static bool active();

 private:
  bool previous_;
};

// True for the parameters that hold experts (split over ep): "*.moe.fc.weight",
// "*.moe.gate.weight", "*.moe.proj.weight"; the router is not.
bool is_expert_parameter(const std::string& name);

}  // namespace dtrain::models
