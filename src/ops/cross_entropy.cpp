// Softmax cross-entropy as one autograd Function over the CUDA kernel (kernels/loss) and
// a float32 reference path. The forward saves the row log-sum-exp; the backward rebuilds
// softmax - onehot from the logits in one pass.
#include "dtrain/ops/cross_entropy.hpp"

#include <torch/torch.h>

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
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits_in,
                            const at::Tensor& target, std::int64_t ignore_index) {
    auto logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
    const auto rows = logits.size(0), vocab = logits.size(1);
    auto valid = target != ignore_index;
    auto count = valid.sum();  // int64 scalar on the device: no host synchronisation
    at::Tensor loss, lse;
#ifdef DTRAIN_WITH_CUDA
    if (use_kernel(logits)) {
      const c10::cuda::CUDAGuard guard(logits.device());
      auto rows_loss = at::empty({rows}, logits.options().dtype(at::kFloat));
      lse = at::empty({rows}, logits.options().dtype(at::kFloat));
      dtrain_cross_entropy_fwd_params p{logits.data_ptr(), target.data_ptr<std::int64_t>(),
                                        rows_loss.data_ptr<float>(), lse.data_ptr<float>(), rows, vocab,
                                        logits.stride(0), ignore_index, detail::kernel_dtype(logits, kOp, "logits")};
      DTRAIN_CUDA_CHECK(dtrain_cross_entropy_fwd(&p, detail::current_stream(logits)));
      loss = rows_loss.sum() / count.clamp_min(1);
    } else
#endif
    {
      detail::NoAutocast no_autocast;
      const auto bad = valid & ((target < 0) | (target >= vocab));
      DTRAIN_OP_CHECK(!bad.any().item<bool>(), kOp, "a target is outside [0, ", vocab, ") and is not ignore_index ",
                      ignore_index, " (the CUDA kernel gives that row a NaN loss)");
      auto lf = logits.to(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
      lse = lf.logsumexp(1);
      auto picked = lf.gather(1, target.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1);
      loss = ((lse - picked) * valid).sum() / count.clamp_min(1);
    }
    ctx->save_for_backward({logits, target, lse, count});
    ctx->saved_data["ignore_index"] = ignore_index;
    return loss;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &logits = s[0], &target = s[1], &lse = s[2], &count = s[3];
    const auto ignore_index = ctx->saved_data["ignore_index"].toInt();
    at::Tensor dlogits;
#ifdef DTRAIN_WITH_CUDA
    if (use_kernel(logits)) {
      const c10::cuda::CUDAGuard guard(logits.device());
      auto scale = grads[0].to(at::kFloat).contiguous();
      dlogits = at::empty(logits.sizes(), logits.options());
      dtrain_cross_entropy_bwd_params p{logits.data_ptr(), target.data_ptr<std::int64_t>(), lse.data_ptr<float>(),
                                        scale.data_ptr<float>(), count.data_ptr<std::int64_t>(), dlogits.data_ptr(),
                                        logits.size(0), logits.size(1), logits.stride(0), dlogits.stride(0),
                                        ignore_index, detail::kernel_dtype(logits, kOp, "logits")};
      DTRAIN_CUDA_CHECK(dtrain_cross_entropy_bwd(&p, detail::current_stream(logits)));
    } else
#endif
    {
      detail::NoAutocast no_autocast;
      auto lf = logits.to(lse.scalar_type());
      auto valid = (target != ignore_index).unsqueeze(1);
      auto d = (lf - lse.unsqueeze(1)).exp();
      d.scatter_add_(1, target.clamp(0, logits.size(1) - 1).unsqueeze(1), -at::ones_like(lse).unsqueeze(1));
      d = d * valid * (grads[0].to(d.scalar_type()) / count.clamp_min(1));
      dlogits = d.to(logits.scalar_type());
    }
    return {dlogits, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, std::int64_t ignore_index) {
  DTRAIN_OP_CHECK(logits.dim() == 2 && logits.size(1) >= 1, kOp, "logits must be [rows, vocab]; got ",
                  logits.sizes());
  DTRAIN_OP_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), kOp, "target must be [", logits.size(0),
                  "]; got ", target.sizes());
  DTRAIN_OP_CHECK(target.scalar_type() == at::kLong, kOp, "target is ", detail::dtype_name(target),
                  "; it must be int64");
  DTRAIN_OP_CHECK(target.device() == logits.device(), kOp, "target is on ", target.device(), ", logits on ",
                  logits.device());
  return CrossEntropyFn::apply(logits, target.contiguous(), ignore_index);
}

}  // namespace dtrain::ops
