// AdamW parameter groups, cosine schedule, global-norm gradient clipping.
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

CosineSchedule::CosineSchedule(double max_lr, double min_lr, std::int64_t warmup_steps,
                               std::int64_t total_steps)
    : max_lr_(max_lr), min_lr_(min_lr), warmup_(warmup_steps), total_(total_steps) {
  DTRAIN_CHECK_ARG(max_lr > 0, "learning rate ", max_lr, " must be positive");
  DTRAIN_CHECK_ARG(min_lr >= 0 && min_lr <= max_lr, "minimum learning rate ", min_lr,
                   " must be in [0, ", max_lr, "]");
  DTRAIN_CHECK_ARG(warmup_steps >= 0 && warmup_steps <= total_steps, "warm-up steps ",
                   warmup_steps, " must be in [0, total steps ", total_steps, "]");
}

double CosineSchedule::lr(std::int64_t step) const {
  if (step < warmup_) return max_lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (step >= total_) return min_lr_;
  const double progress =
      static_cast<double>(step - warmup_) / static_cast<double>(std::max<std::int64_t>(1, total_ - warmup_));
  return min_lr_ + 0.5 * (max_lr_ - min_lr_) * (1.0 + std::cos(M_PI * progress));
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
  if (coef != 1.0) {
    for (const auto& group : groups) {
      for (const auto& g : group.grads) g.mul_(coef);
    }
  }
  return norm;
}

}  // namespace dtrain
