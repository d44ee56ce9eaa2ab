// RMSNorm / LayerNorm as one autograd Function over the CUDA kernel (kernels/norm) and a
// reference path with the same float32 math in ATen ops.
#include "dtrain/ops/norm.hpp"

#include <torch/torch.h>

#include <cstdint>

#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/norm.h"
#endif

namespace dtrain::ops {
namespace {

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  DTRAIN_OP_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, "x ", x.sizes(), " needs a non-empty last dim");
  for (const auto& [what, t] : {std::make_pair("weight", weight), std::make_pair("bias", bias)}) {
    if (!t.defined()) continue;
    DTRAIN_OP_CHECK(t.dim() == 1 && t.size(0) == x.size(-1), op, what, " is ", t.sizes(), "; x ", x.sizes(),
                    " needs [", x.size(-1), "]");
    DTRAIN_OP_CHECK(t.device() == x.device(), op, what, " is on ", t.device(), ", x on ", x.device());
  }
  DTRAIN_OP_CHECK(!weight.defined() || !bias.defined() || weight.scalar_type() == bias.scalar_type(), op,
                  "weight is ", detail::dtype_name(weight), ", bias ", detail::dtype_name(bias), "; they must match");
}

#ifdef DTRAIN_WITH_CUDA
bool kernel_takes(const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias) {
  auto ok_type = [](const at::Tensor& t) { return !t.defined() || detail::kernel_float(t); };
  return detail::on_kernel_device(x2) && ok_type(x2) && ok_type(weight) && ok_type(bias) &&
         x2.size(1) <= dtrain_norm_max_cols();
}

// The weight or bias as the kernel reads it fastest: contiguous and 16-byte aligned (a view
// into a flat FSDP buffer may start anywhere; copying [cols] elements keeps the kernel's
// 16-byte accesses for the whole activation).
at::Tensor kernel_vector(const at::Tensor& t) {
  if (!t.defined()) return t;
  auto c = t.contiguous();
  return reinterpret_cast<std::uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

dtrain_kernel_dtype weight_type(const at::Tensor& weight, const at::Tensor& bias, const char* op) {
  if (weight.defined()) return detail::kernel_dtype(weight, op, "weight");
  if (bias.defined()) return detail::kernel_dtype(bias, op, "bias");
  return DTRAIN_KERNEL_F32;
}
#endif

at::Tensor absent(const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; }
at::Tensor placeholder(const at::Tensor& t, const at::Tensor& x) {
  return t.defined() ? t : at::empty({0}, x.options().dtype(at::kFloat));
}

class NormFn : public torch::autograd::Function<NormFn> {
 public:
  // An absent weight or bias travels as an empty tensor (autograd Functions take no
  // undefined inputs) and gets an undefined gradient.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight_in,
                            const at::Tensor& bias_in, double eps, bool layer) {
    const auto weight = absent(weight_in), bias = absent(bias_in);
    const auto cols = x.size(-1), rows = x.numel() / cols;
    auto x2 = x.reshape({rows, cols}).contiguous();
    at::Tensor y, mean, rstd;
#ifdef DTRAIN_WITH_CUDA
    if (kernel_takes(x2, weight, bias)) {
      const char* op = layer ? "layer_norm" : "rms_norm";
      const detail::DeviceGuard guard(x.device());
      auto w = kernel_vector(weight), b = kernel_vector(bias);
      y = at::empty_like(x2);
      rstd = at::empty({rows}, x2.options().dtype(at::kFloat));
      if (layer) mean = at::empty({rows}, x2.options().dtype(at::kFloat));
      dtrain_norm_fwd_params p{};
      p.x = x2.data_ptr();
      p.weight = w.defined() ? w.data_ptr() : nullptr;
      p.bias = b.defined() ? b.data_ptr() : nullptr;
      p.y = y.data_ptr();
      p.mean = layer ? mean.data_ptr<float>() : nullptr;
      p.rstd = rstd.data_ptr<float>();
      p.rows = rows;
      p.cols = p.x_stride = p.y_stride = cols;
      p.eps = static_cast<float>(eps);
      p.layer_norm = layer ? 1 : 0;
      p.dtype = detail::kernel_dtype(x2, op, "x");
      p.weight_dtype = weight_type(w, b, op);
      DTRAIN_CUDA_CHECK(dtrain_norm_fwd(&p, detail::current_stream(x2)));
    } else
#endif
    {
      detail::NoAutocast no_autocast;
      auto xf = x2.to(detail::compute_type(x2));
      if (layer) {
        mean = xf.mean(-1);
        xf = xf - mean.unsqueeze(1);
      }
      rstd = at::rsqrt(xf.pow(2).mean(-1) + eps);
      auto v = xf * rstd.unsqueeze(1);
      if (weight.defined()) v = v * weight.to(v.scalar_type());
      if (bias.defined()) v = v + bias.to(v.scalar_type());
      y = v.to(x.scalar_type());
    }
    ctx->save_for_backward({x2, weight, bias, mean, rstd});
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["sizes"] = x.sizes().vec();
    return y.view(x.sizes());
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x2 = s[0], &weight = s[1], &bias = s[2], &mean = s[3], &rstd = s[4];
    const bool layer = ctx->saved_data["layer"].toBool();
    const auto rows = x2.size(0), cols = x2.size(1);
    auto dy = grads[0].reshape({rows, cols}).contiguous();
    at::Tensor dx, dw, db;
#ifdef DTRAIN_WITH_CUDA
    if (kernel_takes(x2, weight, bias)) {
      const char* op = layer ? "layer_norm" : "rms_norm";
      const detail::DeviceGuard guard(x2.device());
      if (dy.scalar_type() != x2.scalar_type()) dy = dy.to(x2.scalar_type());
      auto w = kernel_vector(weight);
      dx = at::empty_like(x2);
      if (weight.defined()) dw = at::empty_like(w);
      if (bias.defined()) db = at::empty_like(bias);
      dtrain_norm_bwd_params p{};
      p.dy = dy.data_ptr();
      p.x = x2.data_ptr();
      p.weight = w.defined() ? w.data_ptr() : nullptr;
      p.mean = layer ? mean.data_ptr<float>() : nullptr;
      p.rstd = rstd.data_ptr<float>();
      p.dx = dx.data_ptr();
      p.dweight = dw.defined() ? dw.data_ptr() : nullptr;
      p.dbias = db.defined() ? db.data_ptr() : nullptr;
      p.rows = rows;
      p.cols = p.dy_stride = p.x_stride = p.dx_stride = cols;
      p.layer_norm = layer ? 1 : 0;
      p.dtype = detail::kernel_dtype(x2, op, "x");
      p.weight_dtype = weight_type(w, bias, op);
      at::Tensor workspace;  // sized for these params (the kernel's plan reads their alignment)
      if (dw.defined() || db.defined()) {
        workspace = at::empty({static_cast<std::int64_t>(dtrain_norm_workspace_bytes(&p) / sizeof(float))},
                              x2.options().dtype(at::kFloat));
        p.workspace = workspace.data_ptr();
      }
      DTRAIN_CUDA_CHECK(dtrain_norm_bwd(&p, detail::current_stream(x2)));
    } else
#endif
    {
      detail::NoAutocast no_autocast;
      const auto ct = detail::compute_type(x2);
      auto xf = x2.to(ct), dyf = dy.to(ct);
      auto r = rstd.to(ct).unsqueeze(1);
      auto xhat = (layer ? xf - mean.to(ct).unsqueeze(1) : xf) * r;
      auto g = weight.defined() ? dyf * weight.to(ct) : dyf;
      auto inner = g - xhat * (g * xhat).mean(-1, /*keepdim=*/true);
      if (layer) inner = inner - g.mean(-1, /*keepdim=*/true);
      dx = (r * inner).to(x2.scalar_type());
      if (weight.defined()) dw = (dyf * xhat).sum(0).to(weight.scalar_type());
      if (bias.defined()) db = dyf.sum(0).to(bias.scalar_type());
    }
    return {dx.view(ctx->saved_data["sizes"].toIntVector()), dw, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs("rms_norm", x, weight, at::Tensor());
  DTRAIN_CHECK_ARG(eps >= 0, "rms_norm: eps=", eps, " must not be negative");
  return NormFn::apply(x, placeholder(weight, x), placeholder(at::Tensor(), x), eps, false);
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_inputs("layer_norm", x, weight, bias);
  DTRAIN_CHECK_ARG(eps >= 0, "layer_norm: eps=", eps, " must not be negative");
  return NormFn::apply(x, placeholder(weight, x), placeholder(bias, x), eps, true);
}

}  // namespace dtrain::ops
