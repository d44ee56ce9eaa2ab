// Fused AdamW: validation, then the multi-tensor CUDA kernel (kernels/optim) or the
// reference path (LibTorch's AdamW sequence of in-place ops, so its float32 results are
// bitwise those of torch::optim::AdamW).
#include "dtrain/ops/adamw.hpp"

#include <torch/torch.h>

#include <cmath>

#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/adamw.h"
#endif

namespace dtrain::ops {
namespace {

constexpr const char* kOp = "fused_adamw";

void check(const std::vector<AdamWSegment>& segments, const AdamWHyper& h) {
  DTRAIN_CHECK_ARG(h.lr >= 0 && h.eps > 0 && h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1 &&
                       h.bias_correction1 > 0 && h.bias_correction2 > 0,
                   kOp, ": hyperparameters out of range (lr ", h.lr, ", betas ", h.beta1, "/", h.beta2, ", eps ", h.eps,
                   ", bias corrections ", h.bias_correction1, "/", h.bias_correction2, ")");
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    const auto n = s.param.numel();
    const auto& first = segments.front();
    auto named = [&](const char* what) { return ::dtrain::detail::str_cat("segment ", i, " ", what); };
    DTRAIN_OP_CHECK(s.param.defined() && s.param.scalar_type() == at::kFloat && s.param.is_contiguous(), kOp,
                    named("param"), " must be a contiguous float32 tensor");
    for (const auto& [what, t] : {std::make_pair("exp_avg", s.exp_avg), std::make_pair("exp_avg_sq", s.exp_avg_sq)}) {
      DTRAIN_OP_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, kOp,
                      named(what), " must be a contiguous float32 tensor of ", n, " elements");
    }
    DTRAIN_OP_CHECK(s.grad.defined() && s.grad.is_contiguous() && s.grad.numel() == n, kOp, named("grad"),
                    " must be contiguous with ", n, " elements");
    const auto gt = s.grad.scalar_type();
    DTRAIN_OP_CHECK(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf, kOp, named("grad"), " is ",
                    detail::dtype_name(s.grad), "; allowed: float32, bfloat16, float16");
    DTRAIN_OP_CHECK(gt == first.grad.scalar_type(), kOp, named("grad"), " is ", detail::dtype_name(s.grad),
                    ", segment 0's ", detail::dtype_name(first.grad), "; one call takes one gradient dtype");
    if (s.model_param.defined()) {
      const auto mt = s.model_param.scalar_type();
      DTRAIN_OP_CHECK((mt == at::kBFloat16 || mt == at::kHalf) && s.model_param.is_contiguous() &&
                          s.model_param.numel() == n,
                      kOp, named("model_param"), " must be a contiguous bfloat16 or float16 tensor of ", n,
                      " elements");
      for (const auto& o : segments) {
        DTRAIN_OP_CHECK(!o.model_param.defined() || o.model_param.scalar_type() == mt, kOp,
                        "model copies of one call must share a dtype");
      }
    }
    for (const auto* t : {&s.grad, &s.exp_avg, &s.exp_avg_sq, &s.model_param}) {
      DTRAIN_OP_CHECK(!t->defined() || t->device() == first.param.device(), kOp, named("tensors"),
                      " must all be on ", first.param.device());
    }
    DTRAIN_OP_CHECK(s.weight_decay >= 0, kOp, named("weight_decay"), "=", s.weight_decay, " must not be negative");
  }
  for (const auto& [what, t] : {std::make_pair("found_inf", h.found_inf), std::make_pair("skip", h.skip)}) {
    DTRAIN_OP_CHECK(!t.defined() || (t.scalar_type() == at::kInt && t.numel() == 1 &&
                                     (segments.empty() || t.device() == segments.front().param.device())),
                    kOp, what, " must be an int32 tensor of one element on the segments' device");
  }
}

void reference(const std::vector<AdamWSegment>& segments, const AdamWHyper& h) {
  torch::NoGradGuard no_grad;
  if (h.skip.defined() && h.skip.item<int>() != 0) return;
  const double step_size = h.lr / h.bias_correction1, sqrt_bc2 = std::sqrt(h.bias_correction2);
  for (const auto& s : segments) {
    auto g = s.grad.to(at::kFloat);
    if (h.grad_scale != 1) g = g * h.grad_scale;
    const auto finite = g.isfinite();
    const bool all_finite = finite.all().item<bool>();
    at::Tensor p = s.param, m = s.exp_avg, v = s.exp_avg_sq;
    at::Tensor p0, m0, v0;
    if (!all_finite) {
      if (h.found_inf.defined()) h.found_inf.fill_(1);
      p0 = p.clone(), m0 = m.clone(), v0 = v.clone();
      g = g.masked_fill(finite.logical_not(), 0);
    }
    // torch::optim::AdamW::step, op for op.
    if (s.weight_decay != 0) p.mul_(1 - h.lr * s.weight_decay);
    m.mul_(h.beta1).add_(g, 1 - h.beta1);
    v.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
    auto denom = (v.sqrt() / sqrt_bc2).add_(h.eps);
    p.addcdiv_(m, denom, -step_size);
    if (!all_finite) {
      const auto bad = finite.logical_not();
      p.copy_(at::where(bad, p0, p));
      m.copy_(at::where(bad, m0, m));
      v.copy_(at::where(bad, v0, v));
    }
    if (s.model_param.defined()) s.model_param.copy_(p);
  }
}

#ifdef DTRAIN_WITH_CUDA
void kernel(const std::vector<AdamWSegment>& segments, const AdamWHyper& h) {
  const auto& first = segments.front();
  const detail::DeviceGuard guard(first.param.device());
  std::vector<dtrain_adamw_segment> segs;
  segs.reserve(segments.size());
  dtrain_kernel_dtype model_type = DTRAIN_KERNEL_BF16;
  for (const auto& s : segments) {
    if (s.model_param.defined()) model_type = detail::kernel_dtype(s.model_param, kOp, "model_param");
    segs.push_back({s.param.data_ptr<float>(), s.grad.data_ptr(), s.exp_avg.data_ptr<float>(),
                    s.exp_avg_sq.data_ptr<float>(), s.model_param.defined() ? s.model_param.data_ptr() : nullptr,
                    s.param.numel(), static_cast<float>(s.weight_decay)});
  }
  dtrain_adamw_params p{};
  p.lr = static_cast<float>(h.lr);
  p.beta1 = static_cast<float>(h.beta1);
  p.beta2 = static_cast<float>(h.beta2);
  p.eps = static_cast<float>(h.eps);
  p.bias_correction1 = static_cast<float>(h.bias_correction1);
  p.bias_correction2 = static_cast<float>(h.bias_correction2);
  p.grad_scale = static_cast<float>(h.grad_scale);
  p.grad_dtype = detail::kernel_dtype(first.grad, kOp, "grad");
  p.model_dtype = model_type;
  p.found_inf = h.found_inf.defined() ? h.found_inf.data_ptr<int>() : nullptr;
  p.skip = h.skip.defined() ? h.skip.data_ptr<int>() : nullptr;
  DTRAIN_CUDA_CHECK(dtrain_adamw(segs.data(), static_cast<int>(segs.size()), &p, detail::current_stream(first.param)));
}
#endif

}  // namespace

AdamWHyper adamw_hyper(double lr, double beta1, double beta2, double eps, std::int64_t step) {
  AdamWHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  h.bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  return h;
}

void fused_adamw(const std::vector<AdamWSegment>& segments, const AdamWHyper& hyper) {
  if (segments.empty()) return;
  check(segments, hyper);
#ifdef DTRAIN_WITH_CUDA
  if (detail::on_kernel_device(segments.front().param)) {
    kernel(segments, hyper);
    return;
  }
#endif
  reference(segments, hyper);
}

}  // namespace dtrain::ops
