// Fused linear cross-entropy: the head's matmul and the loss over chunks of rows, each
// chunk's gradients computed in the forward (the loss op writes its logits' gradient in
// place on CUDA), so that one chunk's logits exist at a time. The backward scales what the
// forward computed by autograd's upstream gradient over the announced one. Over a split
// vocabulary (options.combine) each chunk's loss call exchanges its rows' statistics.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dtrain/core/error.hpp"
#include "dtrain/ops/cross_entropy.hpp"
#include "ops/kernel_launch.hpp"

namespace dtrain::ops {
namespace {

constexpr const char* kOp = "linear_cross_entropy";

// Rows per chunk when the caller leaves it to us: a chunk's logits about the size of the
// hidden states (rows x hidden elements), at least 128 rows.
std::int64_t auto_chunk_rows(std::int64_t rows, std::int64_t vocab, std::int64_t hidden) {
  const std::int64_t chunks = std::max<std::int64_t>(1, (vocab + hidden - 1) / hidden);
  return std::max<std::int64_t>(128, (rows + chunks - 1) / chunks);
}

class LinearCrossEntropyFn : public torch::autograd::Function<LinearCrossEntropyFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target, const CrossEntropyOptions& o, std::int64_t chunk_rows,
                            bool want_dhidden, bool want_dweight) {
    const auto rows = hidden.size(0);
    const bool want = want_dhidden || want_dweight;
    // The mean over the rows whose target counts: each chunk's mean weighs its share.
    const auto ct = detail::compute_type(hidden);  // float32, float64 for float64 inputs
    const auto total = (target != o.ignore_index).sum().clamp_min(1).to(ct);
    at::Tensor loss, dhidden, dweight;
    if (want_dhidden) dhidden = at::empty(hidden.sizes(), hidden.options());
    if (want_dweight) dweight = at::zeros(weight.sizes(), weight.options().dtype(ct));
    CrossEntropyOptions chunk_options = o;
    chunk_options.in_place = true;  // the chunk's logits are ours alone
    const auto announced = at::full({}, o.grad_scale, hidden.options().dtype(at::kFloat));  // as the loss op holds it
    for (std::int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const auto n = std::min(chunk_rows, rows - r0);
      const auto h = hidden.narrow(0, r0, n), t = target.narrow(0, r0, n);
      const auto share = (t != o.ignore_index).sum().to(ct) / total;
      auto logits = at::matmul(h, weight.t());  // autograd is off in a Function's forward
      if (!want) {
        const auto part = cross_entropy(logits, t, chunk_options) * share;
        loss = loss.defined() ? loss + part : part;
        continue;
      }
      at::Tensor chunk_loss, dlogits;
      {
        const at::AutoGradMode grad_on(true);
        logits.requires_grad_();
        chunk_loss = cross_entropy(logits, t, chunk_options);
        // The announced upstream gradient: the loss kernel's gradient needs no rescaling.
        dlogits = torch::autograd::grad({chunk_loss}, {logits}, {announced.to(chunk_loss.scalar_type())})[0];
      }
      const auto part = chunk_loss.detach() * share;
      loss = loss.defined() ? loss + part : part;
      // This chunk's mean weighs `share` of the whole; the weight's gradient accumulates
      // in float32 (float64), scaled as it is added.
      if (want_dhidden) dhidden.narrow(0, r0, n).copy_(at::matmul(dlogits, weight) * share);
      if (want_dweight) dweight.addcmul_(at::matmul(dlogits.t(), h), share);
    }
    if (want) {
      ctx->save_for_backward({dhidden, dweight, announced});
      ctx->saved_data["weight_type"] = static_cast<std::int64_t>(weight.scalar_type());
    }
    return loss;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &dhidden = s[0], &dweight = s[1], &announced = s[2];
    const auto factor = grads[0].to(announced.scalar_type()) / announced;
    const auto weight_type = static_cast<at::ScalarType>(ctx->saved_data["weight_type"].toInt());
    // Only what this backward asks for: the pipeline's split backward asks for the hidden
    // states' gradient first and the weight's later.
    const bool dh = dhidden.defined() && ctx->needs_input_grad(0), dw = dweight.defined() && ctx->needs_input_grad(1);
    // The weight's gradient scaled in float32 and stored in the weight's dtype in one pass:
    // for a 16-bit weight no float32 [vocab, hidden] product beside the saved one.
    at::Tensor dweight_out;
    if (dw) {
      dweight_out = at::empty(dweight.sizes(), dweight.options().dtype(weight_type));
      at::mul_out(dweight_out, dweight, factor);
    }
    return {dh ? dhidden * factor.to(dhidden.scalar_type()) : at::Tensor(),
            dweight_out,
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                const CrossEntropyOptions& options, std::int64_t chunk_rows) {
  DTRAIN_OP_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1) && weight.size(0) >= 1,
                  kOp, "hidden is ", hidden.sizes(), ", weight ", weight.sizes(),
                  "; they must be [rows, hidden] and [vocab, hidden]");
  DTRAIN_OP_CHECK(target.dim() == 1 && target.size(0) == hidden.size(0), kOp, "target must be [", hidden.size(0),
                  "]; got ", target.sizes());
  DTRAIN_OP_CHECK(weight.device() == hidden.device(), kOp, "weight is on ", weight.device(), ", hidden on ",
                  hidden.device());
  DTRAIN_OP_CHECK(chunk_rows >= 0, kOp, "chunk_rows is ", chunk_rows, "; allowed: 0 (automatic) or positive");
  const auto rows = hidden.size(0);
  if (rows == 0) return at::zeros({}, hidden.options().dtype(at::kFloat));
  if (chunk_rows == 0) chunk_rows = auto_chunk_rows(rows, weight.size(0), weight.size(1));
  const bool grad = at::GradMode::is_enabled();
  return LinearCrossEntropyFn::apply(hidden, weight, target.contiguous(), options, chunk_rows,
                                     grad && hidden.requires_grad(), grad && weight.requires_grad());
}

}  // namespace dtrain::ops
