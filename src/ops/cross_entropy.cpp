// Softmax cross-entropy as one autograd Function over the CUDA kernel (kernels/loss) and
// a float32 reference path. On CUDA the forward writes the logit gradient for the
// announced upstream gradient and saves it; the backward hands it over, rescaled on the
// device when autograd's upstream gradient differs (a retained graph's later backwards
// get a rescaled copy: the first one's may still be held, by a hook for one). The
// reference path saves the logits and the row log-sum-exp and rebuilds softmax - onehot
// (softmax (1 + 2 z lse) - onehot with the z-loss).
// Over a vocabulary split across ranks (options.combine) both paths exchange two floats
// per row between their statistics and the gradient (two kernel calls on CUDA).
#include "dtrain/ops/cross_entropy.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/cross_entropy.h"
#endif

namespace dtrain::ops {
namespace {

constexpr const char* kOp = "cross_entropy";

#ifdef DTRAIN_WITH_CUDA
bool use_kernel(const at::Tensor& logits) {
  const auto t = logits.scalar_type();
  return detail::on_kernel_device(logits) && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}
#endif

// Where the logits sit in the vocabulary: columns [start, start + cols), of which the
// first `valid` hold ids below its size (the rest: a split vocabulary's padding).
struct Columns {
  std::int64_t start, valid;
};

Columns columns_of(const at::Tensor& logits, const CrossEntropyOptions& o) {
  if (!o.combine) return {0, logits.size(1)};
  return {o.vocab_start, std::clamp<std::int64_t>(o.vocab_size - o.vocab_start, 0, logits.size(1))};
}

// The rank's [2, rows] statistics over the whole vocabulary, from o.combine.
at::Tensor combined(const CrossEntropyOptions& o, const at::Tensor& stats) {
  auto all = o.combine(stats);
  DTRAIN_OP_CHECK(all.defined() && all.sizes() == stats.sizes(), kOp, "combine returned ",
                  all.defined() ? all.sizes() : at::IntArrayRef{}, "; it must return the [2, rows] = ", stats.sizes(),
                  " it was given, over the whole vocabulary");
  return all;
}

class CrossEntropyFn : public torch::autograd::Function<CrossEntropyFn> {
 public:
  // want_grad: the caller's logits need a gradient (decided outside, where grad mode is
  // the caller's).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits_in,
                            const at::Tensor& target, const CrossEntropyOptions& o, bool want_grad) {
    auto logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
    const auto rows = logits.size(0), vocab = logits.size(1);
    const Columns cols = columns_of(logits, o);
    auto valid = target != o.ignore_index;
    auto count = valid.sum();  // int64 scalar on the device: no host synchronisation
#ifdef DTRAIN_WITH_CUDA
    if (use_kernel(logits)) {
      const detail::DeviceGuard guard(logits.device());
      const auto stream = detail::current_stream(logits);
      at::Tensor dlogits, written;
      if (want_grad) {
        dlogits = o.in_place ? logits : at::empty(logits.sizes(), logits.options());
        written = at::full({1}, o.grad_scale, logits.options().dtype(at::kFloat));
      }
      dtrain_cross_entropy_fwd_params p{};
      p.logits = logits.data_ptr();
      p.target = target.data_ptr<std::int64_t>();
      p.dlogits = want_grad ? dlogits.data_ptr() : nullptr;
      p.count = count.data_ptr<std::int64_t>();
      p.grad_scale = static_cast<float>(o.grad_scale);
      p.z_loss = static_cast<float>(o.z_loss);
      p.rows = rows;
      p.vocab = cols.valid;
      p.vocab_start = cols.start;
      p.logits_stride = logits.stride(0);
      p.dlogits_stride = want_grad ? dlogits.stride(0) : 0;
      p.ignore_index = o.ignore_index;
      p.dtype = detail::kernel_dtype(logits, kOp, "logits");
      at::Tensor rows_loss;
      if (!o.combine) {  // one call: loss and gradient
        rows_loss = at::empty({rows}, logits.options().dtype(at::kFloat));
        p.loss = rows_loss.data_ptr<float>();
        DTRAIN_CUDA_CHECK(dtrain_cross_entropy_fwd(&p, stream));
      } else {  // the statistics, the ranks' exchange, then the gradient for the whole lse
        auto stats = at::empty({2, rows}, logits.options().dtype(at::kFloat));
        if (cols.valid > 0) {
          auto stat_call = p;
          stat_call.dlogits = nullptr;
          stat_call.lse = stats[0].data_ptr<float>();
          stat_call.target_logit = stats[1].data_ptr<float>();
          DTRAIN_CUDA_CHECK(dtrain_cross_entropy_fwd(&stat_call, stream));
        } else {  // padding alone: no terms, no target
          stats[0].fill_(-std::numeric_limits<float>::infinity());
          stats[1].zero_();
        }
        const auto all = combined(o, stats);
        const auto lse = all[0].to(at::kFloat).contiguous();
        // As the one-call kernel: 0 for an ignored row, NaN for a target outside the vocabulary.
        const auto bad = valid & ((target < 0) | (target >= o.vocab_size));
        rows_loss = at::where(valid, lse - all[1].to(at::kFloat) + o.z_loss * lse * lse, 0.f).masked_fill(bad, NAN);
        if (want_grad) {
          p.given_lse = lse.data_ptr<float>();
          if (cols.valid > 0) DTRAIN_CUDA_CHECK(dtrain_cross_entropy_fwd(&p, stream));
          if (cols.valid < vocab) dlogits.narrow(1, cols.valid, vocab - cols.valid).zero_();
        }
      }
      // The logits changed under autograd's feet: a graph that saved them now fails loudly
      // in its backward instead of reading the gradient.
      if (want_grad && o.in_place) logits.unsafeGetTensorImpl()->bump_version();
      if (want_grad) {
        ctx->save_for_backward({dlogits, written});
        ctx->saved_data["handed_over"] = false;
      }
      return rows_loss.sum() / count.clamp_min(1);
    }
#endif
    (void)want_grad;
    detail::NoAutocast no_autocast;
    const auto ids = o.combine ? o.vocab_size : vocab;
    const auto bad = valid & ((target < 0) | (target >= ids));
    DTRAIN_OP_CHECK(!bad.any().item<bool>(), kOp, "a target is outside [0, ", ids, ") and is not ignore_index ",
                    o.ignore_index, " (the CUDA kernel gives that row a NaN loss)");
    auto lf = logits.to(detail::compute_type(logits));
    const auto local = target - cols.start, inside = (local >= 0) & (local < cols.valid);
    auto lse = cols.valid > 0 ? lf.narrow(1, 0, cols.valid).logsumexp(1)
                              : at::full({rows}, -std::numeric_limits<double>::infinity(), lf.options());
    auto picked = lf.gather(1, local.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1).masked_fill(~inside, 0);
    if (o.combine) {
      const auto all = combined(o, at::stack({lse, picked}));
      lse = all[0].to(lf.scalar_type());
      picked = all[1].to(lf.scalar_type());
    }
    ctx->save_for_backward({logits, target, lse, count});
    ctx->saved_data["ignore_index"] = o.ignore_index;
    ctx->saved_data["start"] = cols.start;
    ctx->saved_data["valid"] = cols.valid;
    ctx->saved_data["z_loss"] = o.z_loss;
    return ((lse - picked + o.z_loss * lse * lse) * valid).sum() / count.clamp_min(1);
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
      const auto start = ctx->saved_data["start"].toInt(), valid_cols = ctx->saved_data["valid"].toInt();
      const auto vocab = logits.size(1);
      detail::NoAutocast no_autocast;
      auto lf = logits.to(lse.scalar_type());
      auto valid = (target != ignore_index).unsqueeze(1);
      const double z = ctx->saved_data["z_loss"].toDouble();
      auto d = (lf - lse.unsqueeze(1)).exp();
      if (z != 0) d.mul_((2 * z * lse + 1).unsqueeze(1));  // the z-loss's share: softmax 2 z lse
      if (valid_cols < vocab) d.narrow(1, valid_cols, vocab - valid_cols).zero_();  // padding
      const auto local = target - start, inside = (local >= 0) & (local < valid_cols);
      d.scatter_add_(1, local.clamp(0, vocab - 1).unsqueeze(1), -inside.to(d.scalar_type()).unsqueeze(1));
      d = d * valid * (grads[0].to(d.scalar_type()) / count.clamp_min(1));
      dlogits = d.to(logits.scalar_type());
    }
    return {dlogits, at::Tensor(), at::Tensor(), at::Tensor()};
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
  DTRAIN_OP_CHECK(std::isfinite(options.z_loss) && options.z_loss >= 0, kOp, "z_loss is ", options.z_loss,
                  "; allowed: finite and >= 0 (0: none; PaLM: 1e-4)");
  if (options.combine) {
    DTRAIN_OP_CHECK(options.vocab_size >= 1 && options.vocab_start >= 0, kOp, "a split vocabulary (combine) needs ",
                    "vocab_size >= 1 and vocab_start >= 0; got vocab_size ", options.vocab_size, ", vocab_start ",
                    options.vocab_start);
  } else {
    DTRAIN_OP_CHECK(options.vocab_start == 0 && options.vocab_size == -1, kOp, "vocab_start ", options.vocab_start,
                    " and vocab_size ", options.vocab_size, " describe a split vocabulary and need combine; ",
                    "without it the logits are the whole vocabulary (allowed: 0 and -1)");
  }
  const bool want_grad = at::GradMode::is_enabled() && logits.requires_grad();
  return CrossEntropyFn::apply(logits, target.contiguous(), options, want_grad);
}

}  // namespace dtrain::ops
