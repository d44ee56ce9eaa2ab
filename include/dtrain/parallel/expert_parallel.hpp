// Expert parallelism for mixture-of-experts layers: the router (softmax or sigmoid scores,
// top-k, load-balancing and z losses, capacity), the token exchange over the ep group
// (per-expert counts first, then an all-to-all with uneven splits, autograd-aware), and
// the autograd helpers that carry auxiliary losses and expert gradient scaling.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.hpp"

namespace dtrain::ep {

// A model's MoE layers (pretrain_gpt --moe-*). experts == 0: a dense model.
struct MoeOptions {
  std::int64_t experts = 0;     // experts per MoE layer (--moe-experts)
  std::int64_t topk = 2;        // experts per token (--moe-topk)
  std::int64_t every = 1;       // block b is a MoE block when b % every == 0 (--moe-every)
  std::int64_t ffn_hidden = 0;  // each expert's SwiGLU width; 0: the model's MLP width
  // Capacity factor: each expert takes at most ceil(factor * tokens * topk / experts) of a
  // rank's tokens per forward, the rest are dropped (--moe-capacity); 0: dropless.
  double capacity_factor = 0;
  std::string score = "softmax";  // softmax | sigmoid (--moe-score)
  double aux_loss_coeff = 1e-2;   // load-balancing loss (Switch / GShard form)
  double z_loss_coeff = 1e-3;     // router z-loss (ST-MoE)
  // Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the
  // selection only, moved by this rate towards the mean load after every step; 0: off.
  double bias_update_rate = 0;
  // The experts' activation: ops::swiglu (one kernel each way on CUDA) instead of silu
  // then multiply. An implementation choice, not architecture: GptConfig::fused_swiglu sets it.
  bool fused_swiglu = false;

  bool enabled() const { return experts > 0; }
  bool is_moe_block(std::int64_t block) const { return enabled() && block % every == 0; }
  // InvalidArgument naming the --moe-* option, its value and what is allowed.
  void validate() const;
  // InvalidArgument when ep ranks cannot split the experts.
  void validate_ep(int ep) const;
};

// The router's decision for N tokens over E experts.
struct Routing {
  at::Tensor probs;    // [N, E] float32: softmax, or sigmoid normalised over the experts
  at::Tensor experts;  // [N, k] int64: chosen experts, best first
  at::Tensor weights;  // [N, k] float32 combine weights (renormalised over k when k > 1)
  at::Tensor kept;     // [N, k] bool: within capacity (all true when dropless)
  at::Tensor counts;   // [E] int64: assignments per expert before dropping
  at::Tensor aux_loss;  // scalar: aux_loss_coeff * load_balancing_loss
  at::Tensor z_loss;    // scalar: z_loss_coeff * z_loss
};

// Routes N tokens from router logits [N, E] (float32). bias: [E] added to the scores for
// the top-k selection only (undefined: none). Gradients flow into logits through the
// weights and both losses. sequence: the ranks that route the rest of these tokens'
// sequences (context parallelism; null or one rank: none), over which the load-balancing
// loss's expert fractions are summed, so that its mean over them is the whole sequence's.
Routing route(const at::Tensor& logits, const at::Tensor& bias, const MoeOptions& options,
              const CommPtr& sequence = nullptr);

// Tokens each expert takes of `tokens` (ceil(factor * tokens * topk / experts), at least
// 1); -1 when dropless.
std::int64_t capacity(std::int64_t tokens, const MoeOptions& options);

// Which assignments of experts [N, k] fit `capacity` slots per expert: first choices
// before second ones (GShard), and within a choice earlier tokens first.
at::Tensor capacity_mask(const at::Tensor& experts, std::int64_t num_experts, std::int64_t capacity);

// E * sum_e f_e * P_e with f_e the fraction of the N * k assignments given to expert e and
// P_e the mean of probs[:, e] (1 when perfectly balanced); differentiable in probs. With
// `sequence` (as route's), f_e counts the assignments of all its ranks (equal N each): the
// mean of the ranks' losses is then the loss of all their tokens together.
at::Tensor load_balancing_loss(const at::Tensor& probs, const at::Tensor& experts,
                               std::int64_t num_experts, const CommPtr& sequence = nullptr);
// mean over tokens of logsumexp(logits)^2.
at::Tensor z_loss(const at::Tensor& logits);

// Identity forward; backward also sends `scale` as the gradient of the scalar `loss`:
// how a layer adds an auxiliary loss to the training loss without returning it.
at::Tensor attach_loss(const at::Tensor& x, const at::Tensor& loss, double scale);
// Identity forward; the gradient times `scale` in backward.
at::Tensor scale_grad(const at::Tensor& x, double scale);

// All-to-all over comm along dim 0: send_rows[r] rows go to rank r (in order), recv_rows[r]
// come from rank r; backward is the reverse exchange. Zero rows are allowed anywhere.
at::Tensor all_to_all(const at::Tensor& x, const CommPtr& comm, std::vector<std::int64_t> send_rows,
                      std::vector<std::int64_t> recv_rows);

// The exchange of one MoE forward: rows sorted by global expert go to the ep rank that
// holds the expert (experts [r * E/ep, (r+1) * E/ep) on rank r) and come back.
struct Exchange {
  std::vector<std::int64_t> send_rows, recv_rows;  // per ep rank
  std::vector<std::int64_t> expert_rows;           // per local expert, after dispatch
  at::Tensor order;  // row of the received (source-major) tensor for each expert-major row
  at::Tensor inverse;
};
// Collective over ep: exchanges counts [E] (rows this rank sends per global expert).
Exchange plan_exchange(const at::Tensor& counts, const CommPtr& ep);
// Rows sorted by global expert -> this rank's rows grouped by local expert.
at::Tensor dispatch(const at::Tensor& rows, const Exchange& plan, const CommPtr& ep);
// The inverse: expert outputs grouped by local expert -> the sender's rows, in its order.
at::Tensor combine(const at::Tensor& rows, const Exchange& plan, const CommPtr& ep);

// Traffic of the all-to-alls in this process (forward and backward): bytes this rank sent
// to other ranks, calls, and wall time spent in them. Not thread-safe; reset between steps.
struct CommStats {
  double bytes = 0;
  std::int64_t calls = 0;
  double ms = 0;
};
const CommStats& comm_stats();
void reset_comm_stats();

}  // namespace dtrain::ep
