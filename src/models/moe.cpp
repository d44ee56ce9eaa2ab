// The MoE block MLP: router, token sort by expert, dispatch over ep, SwiGLU experts,
// combine; routing statistics and the aux-loss-free bias.
#include "dtrain/models/moe.hpp"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include "dtrain/core/error.hpp"
#include "dtrain/ops/swiglu.hpp"
#include "dtrain/parallel/tensor_parallel.hpp"

namespace dtrain::models {

namespace {
thread_local bool g_recomputing = false;

at::Tensor holder_weight(torch::nn::Module& owner, const char* name, at::Tensor init) {
  auto m = owner.register_module(name, std::make_shared<torch::nn::Module>());
  return m->register_parameter("weight", std::move(init));
}
}  // namespace

MoeRecomputeScope::MoeRecomputeScope() : previous_(g_recomputing) { g_recomputing = true; }
MoeRecomputeScope::~MoeRecomputeScope() { g_recomputing = previous_; }
bool MoeRecomputeScope::active() { return g_recomputing; }

bool is_expert_parameter(const std::string& name) {
  for (const char* part : {"moe.fc.weight", "moe.gate.weight", "moe.proj.weight"}) {
    const std::string p(part);
    if (name.size() >= p.size() && name.compare(name.size() - p.size(), p.size(), p) == 0) return true;
  }
  return false;
}

MoeImpl::MoeImpl(const ep::MoeOptions& options, std::int64_t d_model, std::int64_t hidden, CommPtr tp,
                 bool sequence_parallel, CommPtr ep, CommPtr cp)
    : options_(options), d_(d_model), tp_(std::move(tp)), ep_(std::move(ep)), cp_(std::move(cp)),
      sequence_parallel_(sequence_parallel && tp_->size() > 1) {
  options_.validate();
  options_.validate_ep(ep_->size());
  DTRAIN_CHECK_ARG(hidden % tp_->size() == 0, "the expert width ", hidden,
                   " (--moe-ffn-hidden) is not divisible by --tp=", tp_->size());
  const auto E = options_.experts, local = E / ep_->size(), width = hidden / tp_->size();
  router = holder_weight(*this, "router", torch::empty({E, d_model}));
  fc = holder_weight(*this, "fc", torch::empty({local, width, d_model}));
  gate = holder_weight(*this, "gate", torch::empty({local, width, d_model}));
  proj = holder_weight(*this, "proj", torch::empty({local, d_model, width}));
  bias_ = register_buffer("bias", torch::zeros({E}));
  reset_stats();
}

void MoeImpl::reset_stats() {
  const auto opts = torch::TensorOptions().dtype(torch::kDouble).device(bias_.device());
  stats_.counts = torch::zeros({options_.experts}, opts);
  stats_.dropped = torch::zeros({}, opts);
  stats_.aux_loss = torch::zeros({}, opts);
  stats_.z_loss = torch::zeros({}, opts);
  stats_.forwards = 0;
}

void MoeImpl::update_bias(const at::Tensor& global_counts) {
  if (options_.bias_update_rate <= 0) return;
  torch::NoGradGuard no_grad;
  const auto c = global_counts.to(bias_.options());
  bias_.add_(options_.bias_update_rate * torch::sign(c.mean() - c));
}

// Rows grouped by local expert (rows_per_expert[j] rows for expert j) through each
// expert's SwiGLU: proj(silu(gate x) * fc x).
at::Tensor MoeImpl::experts(const at::Tensor& rows, const std::vector<std::int64_t>& rows_per_expert) {
  // Each expert's gradient sums the contributions of every ep rank's tokens; the average
  // over the data-parallel ranks then divides by dp / ep only: 1 / ep here completes it.
  const double scale = 1.0 / static_cast<double>(ep_->size());
  auto w_fc = scale == 1.0 ? fc : ep::scale_grad(fc, scale);
  auto w_gate = scale == 1.0 ? gate : ep::scale_grad(gate, scale);
  auto w_proj = scale == 1.0 ? proj : ep::scale_grad(proj, scale);
  std::vector<at::Tensor> outs;
  std::int64_t at = 0;
  for (std::size_t j = 0; j < rows_per_expert.size(); ++j) {
    // An expert without tokens still runs (on zero rows): its weights get a zero gradient.
    const auto x = rows.narrow(0, at, rows_per_expert[j]);
    at += rows_per_expert[j];
    const auto e = static_cast<std::int64_t>(j);
    const auto g = torch::mm(x, w_gate[e].t()), u = torch::mm(x, w_fc[e].t());
    const auto h = options_.fused_swiglu ? ops::swiglu(g, u) : torch::silu(g) * u;
    outs.push_back(torch::mm(h, w_proj[e].t()));
  }
  return torch::cat(outs, 0);
}

at::Tensor MoeImpl::forward(const at::Tensor& x) {
  const auto& o = options_;
  const int tp = tp_->size();
  tp::ParallelLinearOptions region;
  region.sequence_parallel = sequence_parallel_;
  // Every tp rank routes all of the sequence (gathered under sequence parallelism) and
  // computes its slice of each expert's width; the partial outputs are summed at the end.
  const auto in = tp > 1 ? tp::enter_column_region(x, tp_, region) : x;
  const auto flat = in.reshape({-1, d_});
  const auto N = flat.size(0);
  at::Tensor logits;
  {  // the router in float32, also under autocast
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    // Its gradient is partial on each tp rank (partial expert outputs): summed across tp.
    const auto w = tp > 1 ? tp::copy_to_region(router, tp_) : router;
    logits = torch::mm(flat.to(torch::kFloat), w.to(torch::kFloat).t());
  }
  const auto r = ep::route(logits, o.bias_update_rate > 0 ? bias_ : at::Tensor(), o, cp_);
  if (is_training() && !MoeRecomputeScope::active()) {
    torch::NoGradGuard no_grad;
    if (stats_.counts.device() != bias_.device()) reset_stats();  // the module moved
    stats_.counts += r.counts.to(torch::kDouble);
    stats_.dropped += r.kept.logical_not().sum().to(torch::kDouble);
    stats_.aux_loss += r.aux_loss.detach().to(torch::kDouble);
    stats_.z_loss += r.z_loss.detach().to(torch::kDouble);
    ++stats_.forwards;
  }
  // The kept assignments sorted by expert (stable: token order within an expert).
  auto expert = r.experts.reshape({-1});
  auto token = torch::arange(N, expert.options()).repeat_interleave(o.topk);
  auto weight = r.weights.reshape({-1});
  if (o.capacity_factor > 0) {
    const auto keep = r.kept.reshape({-1}).nonzero().squeeze(1);
    expert = expert.index_select(0, keep), token = token.index_select(0, keep);
    weight = weight.index_select(0, keep);
  }
  const auto order = std::get<1>(expert.sort(/*stable=*/true, 0, false));
  expert = expert.index_select(0, order), token = token.index_select(0, order);
  weight = weight.index_select(0, order);
  auto counts = torch::zeros({o.experts}, expert.options());
  counts.index_add_(0, expert, torch::ones_like(expert));
  const auto rows = flat.index_select(0, token);
  at::Tensor out;
  if (ep_->size() > 1) {
    const auto plan = ep::plan_exchange(counts, ep_);
    out = ep::combine(experts(ep::dispatch(rows, plan, ep_), plan.expert_rows), plan, ep_);
  } else {
    const auto c = counts.cpu();
    out = experts(rows, {c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel()});
  }
  const auto weighted = (out.to(torch::kFloat) * weight.unsqueeze(1)).to(flat.scalar_type());
  auto y = torch::zeros({N, d_}, flat.options()).index_add(0, token, weighted).view(in.sizes());
  if (is_training() && torch::GradMode::is_enabled() && (o.aux_loss_coeff > 0 || o.z_loss_coeff > 0)) {
    // Each tp rank routed the same tokens: its share of the losses' gradient is 1 / tp
    // (the router's and the input's gradients are summed across tp).
    y = ep::attach_loss(y, r.aux_loss + r.z_loss, aux_scale_ / tp);
  }
  if (tp == 1) return y;
  return sequence_parallel_ ? tp::reduce_scatter_to_sequence(y, tp_, 1) : tp::reduce_from_region(y, tp_);
}

}  // namespace dtrain::models
