// AdamW parameter groups, the learning-rate schedule, global-norm gradient clipping.
#include "dtrain/optim/optim.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/ops/adamw.hpp"

namespace dtrain {

namespace {

// LibTorch's AdamW with step() as one ops::fused_adamw call per (group, step count): the
// same AdamWParamState (created on a parameter's first gradient, as LibTorch does), so
// state_dict, checkpoints and FSDP's state code read it unchanged.
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      torch::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      DTRAIN_CHECK_ARG(!o.amsgrad(), "fused AdamW has no amsgrad");
      const auto [beta1, beta2] = o.betas();
      std::map<std::int64_t, std::vector<ops::AdamWSegment>> by_step;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& st = advance_adamw_state(*this, p);
        auto grad = p.grad().is_contiguous() ? p.grad() : p.grad().contiguous();
        by_step[st.step()].push_back({p, grad, st.exp_avg(), st.exp_avg_sq(), {}, o.weight_decay()});
      }
      for (const auto& [step, segments] : by_step) {
        ops::fused_adamw(segments, ops::adamw_hyper(o.lr(), beta1, beta2, o.eps(), step));
      }
    }
    return loss;
  }
};

}  // namespace

bool decays(const std::string& name, const at::Tensor& param, const AdamWOptions& options) {
  if (param.dim() < 2) return false;
  for (const auto& part : options.no_decay_name_parts) {
    if (!part.empty() && name.find(part) != std::string::npos) return false;
  }
  return true;
}

std::unique_ptr<torch::optim::Optimizer> make_adamw(const NamedParameters& params,
                                                    const AdamWOptions& o) {
  DTRAIN_CHECK_ARG(o.lr > 0, "AdamW lr=", o.lr, " must be positive");
  DTRAIN_CHECK_ARG(o.beta1 >= 0 && o.beta1 < 1, "AdamW beta1=", o.beta1, " must be in [0, 1)");
  DTRAIN_CHECK_ARG(o.beta2 >= 0 && o.beta2 < 1, "AdamW beta2=", o.beta2, " must be in [0, 1)");
  DTRAIN_CHECK_ARG(o.eps > 0, "AdamW eps=", o.eps, " must be positive");
  DTRAIN_CHECK_ARG(o.weight_decay >= 0, "AdamW weight_decay=", o.weight_decay,
                   " must not be negative");
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& [name, p] : params) {
    if (!p.requires_grad()) continue;
    (decays(name, p, o) ? decay : no_decay).push_back(p);
  }
  auto base = torch::optim::AdamWOptions(o.lr)
                  .betas({o.beta1, o.beta2})
                  .eps(o.eps)
                  .weight_decay(o.weight_decay);
  auto none = std::make_unique<torch::optim::AdamWOptions>(base);
  none->weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(base));
  groups.emplace_back(no_decay, std::move(none));
  if (o.fused) return std::make_unique<FusedAdamW>(std::move(groups), base);
  return std::make_unique<torch::optim::AdamW>(std::move(groups), base);
}

torch::optim::AdamWParamState& advance_adamw_state(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  auto& slot = optimizer.state()[param.unsafeGetTensorImpl()];
  if (!slot) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(0);
    st->exp_avg(torch::zeros_like(param, torch::MemoryFormat::Contiguous));
    st->exp_avg_sq(torch::zeros_like(param, torch::MemoryFormat::Contiguous));
    slot = std::move(st);
  }
  auto& st = static_cast<torch::optim::AdamWParamState&>(*slot);
  st.step(st.step() + 1);
  return st;
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

LrDecay parse_lr_decay(const std::string& name) {
  if (name == "cosine") return LrDecay::kCosine;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "sqrt") return LrDecay::kSqrt;
  if (name == "constant") return LrDecay::kConstant;
  throw InvalidArgument("--lr-decay '" + name + "' is not known; allowed: cosine, linear, sqrt, constant");
}

const char* to_string(LrDecay decay) {
  switch (decay) {
    case LrDecay::kCosine: return "cosine";
    case LrDecay::kLinear: return "linear";
    case LrDecay::kSqrt: return "sqrt";
    case LrDecay::kConstant: return "constant";
  }
  return "?";
}

LrSchedule::LrSchedule(const LrScheduleOptions& o) : o_(o) {
  DTRAIN_CHECK_ARG(o.lr > 0 && std::isfinite(o.lr), "learning rate ", o.lr, " must be positive and finite");
  DTRAIN_CHECK_ARG(o.decay == LrDecay::kConstant || (o.min_lr >= 0 && o.min_lr <= o.lr), "minimum learning rate ",
                   o.min_lr, " must be in [0, ", o.lr, "]");
  DTRAIN_CHECK_ARG(o.total_steps >= 1, "total steps ", o.total_steps, " must be at least 1");
  DTRAIN_CHECK_ARG(o.warmup_steps >= 0 && o.warmup_steps <= o.total_steps, "warm-up steps ", o.warmup_steps,
                   " must be in [0, total steps ", o.total_steps, "]");
  DTRAIN_CHECK_ARG(o.decay_steps >= 0 && o.warmup_steps + o.decay_steps <= o.total_steps, "decay steps ",
                   o.decay_steps, " must be in [0, total steps ", o.total_steps, " - warm-up steps ", o.warmup_steps,
                   "]");
  DTRAIN_CHECK_ARG(o.decay != LrDecay::kConstant || o.decay_steps == 0, "decay steps ", o.decay_steps,
                   " given to a constant learning rate (it has no decay)");
}

std::int64_t LrSchedule::decay_start() const {
  return o_.decay_steps > 0 ? o_.total_steps - o_.decay_steps : o_.warmup_steps;
}

double LrSchedule::lr(std::int64_t step) const {
  if (step < o_.warmup_steps) return o_.lr * static_cast<double>(step + 1) / static_cast<double>(o_.warmup_steps);
  if (o_.decay == LrDecay::kConstant) return o_.lr;
  const std::int64_t start = decay_start();
  if (step < start) return o_.lr;
  if (step >= o_.total_steps) return o_.min_lr;
  const double p = static_cast<double>(step - start) / static_cast<double>(std::max<std::int64_t>(1, o_.total_steps - start));
  double f = 0;  // the fraction of (lr - min_lr) left
  switch (o_.decay) {
    case LrDecay::kCosine: f = 0.5 * (1.0 + std::cos(M_PI * p)); break;
    case LrDecay::kLinear: f = 1.0 - p; break;
    case LrDecay::kSqrt: f = 1.0 - std::sqrt(p); break;
    case LrDecay::kConstant: f = 1.0; break;
  }
  return o_.min_lr + (o_.lr - o_.min_lr) * f;
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                      Communicator* shard_comm, double grad_scale) {
  GradGroup group;
  for (const auto& p : params) {
    if (p.grad().defined()) group.grads.push_back(p.grad());
  }
  group.over = {shard_comm};
  return clip_grad_norm(std::vector<GradGroup>{group}, max_norm, grad_scale);
}

double clip_grad_norm(const std::vector<GradGroup>& groups, double max_norm, double grad_scale) {
  DTRAIN_CHECK_ARG(max_norm > 0, "gradient clipping max_norm=", max_norm, " must be positive");
  DTRAIN_CHECK_ARG(grad_scale > 0 && std::isfinite(grad_scale), "gradient scale ", grad_scale,
                   " must be positive and finite");
  at::Device device(at::kCPU);
  for (const auto& g : groups) {
    if (!g.grads.empty()) device = g.grads[0].device();
  }
  // Per group: per-tensor norms in float32 (one multi-tensor kernel), their squares summed
  // in float64, then summed over the group's communicators.
  double sq_total = 0;
  for (const auto& group : groups) {
    if (!group.counted) continue;
    at::Tensor sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
    if (!group.grads.empty()) {
      std::vector<at::Tensor> detached;
      detached.reserve(group.grads.size());
      for (const auto& g : group.grads) detached.push_back(g.detach());
      const auto norms = at::_foreach_norm(detached, 2, at::kFloat);
      sq += at::stack(norms).to(at::kDouble).pow(2).sum();
    }
    for (Communicator* comm : group.over) {
      if (comm != nullptr && comm->size() > 1) comm->all_reduce(sq)->synchronize();
    }
    sq_total += sq.item<double>();
  }
  const double norm = std::sqrt(sq_total) / grad_scale;
  if (!std::isfinite(norm)) return norm;
  const double coef = std::min(1.0, max_norm / (norm + 1e-6)) / grad_scale;
  if (coef != 1.0) {  // one multi-tensor kernel per group, as for the norms
    for (const auto& group : groups) {
      if (!group.grads.empty()) at::_foreach_mul_(group.grads, coef);
    }
  }
  return norm;
}

}  // namespace dtrain
