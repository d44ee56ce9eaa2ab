// Softmax cross-entropy as one autograd Function over the CUDA kernel (kernels/loss) and
// a float32 reference path. On CUDA the forward writes the logit gradient for the
// announced upstream gradient and saves it; the backward hands it over, rescaled on the
// device when autograd's upstream gradient differs (a retained graph's later backwards
// get a rescaled copy: the first one's may still be held, by a hook for one). The
// reference path saves the logits and the row log-sum-exp and rebuilds softmax - onehot.
#include "dtrain/ops/cross_entropy.hpp"

#include <torch/torch.h>

#include <cmath>

#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/cross_entropy.h"
#endif

namespace dtrain::ops {
namespace {

constexpr const char* kOp = "cross_entropy";

bool use_kernel(const at::Tensor& logits) {
  const auto t = logits.scalar_type();
  return detail::on_kernel_device(logits) && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}

class CrossEntropyFn : public torch::autograd::Function<CrossEntropyFn> {
 public:
  // want_grad: the caller's logits need a gradient (decided outside, where grad mode is
  // the caller's).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits_in,
                            const at::Tensor& target, std::int64_t ignore_index, double grad_scale, bool in_place,
                            bool want_grad) {
    auto logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
    const auto rows = logits.size(0), vocab = logits.size(1);
    auto valid = target != ignore_index;
    auto count = valid.sum();  // int64 scalar on the device: no host synchronisation
#ifdef DTRAIN_WITH_CUDA
    if (use_kernel(logits)) {
      const detail::DeviceGuard guard(logits.device());
      auto rows_loss = at::empty({rows}, logits.options().dtype(at::kFloat));
      at::Tensor dlogits, written;
      if (want_grad) {
        dlogits = in_place ? logits : at::empty(logits.sizes(), logits.options());
        written = at::full({1}, grad_scale, logits.options().dtype(at::kFloat));
      }
      dtrain_cross_entropy_fwd_params p{};
      p.logits = logits.data_ptr();
      p.target = target.data_ptr<std::int64_t>();
      p.loss = rows_loss.data_ptr<float>();
      p.dlogits = want_grad ? dlogits.data_ptr() : nullptr;
      p.count = count.data_ptr<std::int64_t>();
      p.grad_scale = static_cast<float>(grad_scale);
      p.rows = rows;
      p.vocab = vocab;
      p.logits_stride = logits.stride(0);
      p.dlogits_stride = want_grad ? dlogits.stride(0) : 0;
      p.ignore_index = ignore_index;
      p.dtype = detail::kernel_dtype(logits, kOp, "logits");
      DTRAIN_CUDA_CHECK(dtrain_cross_entropy_fwd(&p, detail::current_stream(logits)));
      // The logits changed under autograd's feet: a graph that saved them now fails loudly
      // in its backward instead of reading the gradient.
      if (want_grad && in_place) logits.unsafeGetTensorImpl()->bump_version();
      if (want_grad) {
        ctx->save_for_backward({dlogits, written});
        ctx->saved_data["handed_over"] = false;
      }
      return rows_loss.sum() / count.clamp_min(1);
    }
#endif
    (void)grad_scale;
    (void)in_place;
    (void)want_grad;
    detail::NoAutocast no_autocast;
    const auto bad = valid & ((target < 0) | (target >= vocab));
    DTRAIN_OP_CHECK(!bad.any().item<bool>(), kOp, "a target is outside [0, ", vocab, ") and is not ignore_index ",
                    ignore_index, " (the CUDA kernel gives that row a NaN loss)");
    auto lf = logits.to(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    auto lse = lf.logsumexp(1);
    auto picked = lf.gather(1, target.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1);
    ctx->save_for_backward({logits, target, lse, count});
    ctx->saved_data["ignore_index"] = ignore_index;
    return ((lse - picked) * valid).sum() / count.clamp_min(1);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    at::Tensor dlogits;
#ifdef DTRAIN_WITH_CUDA
    if (s.size() == 2) {  // the kernel's: the gradient and the upstream gradient it holds
      const auto &saved = s[0], &written = s[1];
      const detail::DeviceGuard guard(saved.device());
      const auto stream = detail::current_stream(saved);
      auto grad = grads[0].to(saved.device(), at::kFloat).contiguous();
      // The first backward rescales the saved gradient in place and hands it over; a
      // retained graph's later backwards write copies. The saved tensor itself is handed
      // over, not a detached alias: while the graph holds it, a leaf's AccumulateGrad
      // copies it instead of adopting it as .grad and adding the next ones into it.
      const bool first = !ctx->saved_data["handed_over"].toBool();
      dlogits = first ? saved : at::empty(saved.sizes(), saved.options());
      dtrain_cross_entropy_bwd_params p{saved.data_ptr(),
                                        dlogits.data_ptr(),
                                        grad.data_ptr<float>(),
                                        written.data_ptr<float>(),
                                        saved.size(0),
                                        saved.size(1),
                                        saved.stride(0),
                                        dlogits.stride(0),
                                        detail::kernel_dtype(saved, kOp, "logits")};
      DTRAIN_CUDA_CHECK(dtrain_cross_entropy_bwd(&p, stream));
      if (first) {
        // It now holds the gradient for this upstream gradient. Not copy_: that would bump
        // the saved tensor's version.
        DTRAIN_CUDA_CHECK(
            detail::copy_device_async(written.data_ptr<float>(), grad.data_ptr<float>(), sizeof(float), stream));
        ctx->saved_data["handed_over"] = true;
      }
    } else
#endif
    {
      const auto &logits = s[0], &target = s[1], &lse = s[2], &count = s[3];
      const auto ignore_index = ctx->saved_data["ignore_index"].toInt();
      detail::NoAutocast no_autocast;
      auto lf = logits.to(lse.scalar_type());
      auto valid = (target != ignore_index).unsqueeze(1);
      auto d = (lf - lse.unsqueeze(1)).exp();
      d.scatter_add_(1, target.clamp(0, logits.size(1) - 1).unsqueeze(1), -at::ones_like(lse).unsqueeze(1));
      d = d * valid * (grads[0].to(d.scalar_type()) / count.clamp_min(1));
      dlogits = d.to(logits.scalar_type());
    }
    return {dlogits, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, const CrossEntropyOptions& options) {
  DTRAIN_OP_CHECK(logits.dim() == 2 && logits.size(1) >= 1, kOp, "logits must be [rows, vocab]; got ",
                  logits.sizes());
  DTRAIN_OP_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), kOp, "target must be [", logits.size(0),
                  "]; got ", target.sizes());
  DTRAIN_OP_CHECK(target.scalar_type() == at::kLong, kOp, "target is ", detail::dtype_name(target),
                  "; it must be int64");
  DTRAIN_OP_CHECK(target.device() == logits.device(), kOp, "target is on ", target.device(), ", logits on ",
                  logits.device());
  const auto scale = static_cast<float>(options.grad_scale);
  DTRAIN_OP_CHECK(std::isfinite(scale) && scale != 0.f, kOp, "grad_scale is ", options.grad_scale,
                  "; allowed: finite and nonzero in float32");
  const bool want_grad = at::GradMode::is_enabled() && logits.requires_grad();
  return CrossEntropyFn::apply(logits, target.contiguous(), options.ignore_index, options.grad_scale,
                               options.in_place, want_grad);
}

}  // namespace dtrain::ops
