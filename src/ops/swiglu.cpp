// SwiGLU as one autograd Function over the CUDA kernel (kernels/activation/swiglu.cu) and a
// reference path with the same float32 math in ATen ops.
#include "dtrain/ops/swiglu.hpp"

#include <torch/torch.h>

#include <utility>

#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/swiglu.h"
#endif

namespace dtrain::ops {
namespace {

#ifdef DTRAIN_WITH_CUDA
bool kernel_takes(const at::Tensor& t) { return detail::on_kernel_device(t) && detail::kernel_float(t); }

// gate and up as the kernel's [rows, cols] matrices: one row of every element where both
// are contiguous; else rows of the last dim, views where the layout allows (the two
// halves of one fused gate-and-up matrix need no copy), contiguous copies where not.
std::pair<at::Tensor, at::Tensor> as_rows(const at::Tensor& gate, const at::Tensor& up) {
  if (gate.is_contiguous() && up.is_contiguous()) return {gate.view({1, gate.numel()}), up.view({1, up.numel()})};
  auto rows = [](const at::Tensor& t) {
    const auto cols = t.dim() == 0 ? 1 : t.size(-1);
    auto r = t.dim() > 0 && t.stride(-1) == 1 ? t.reshape({-1, cols}) : t.contiguous().view({-1, cols});
    return r.size(0) > 1 && r.stride(0) < cols ? r.contiguous() : r;  // rows must not overlap
  };
  return {rows(gate), rows(up)};
}
#endif

class SwigluFn : public torch::autograd::Function<SwigluFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    at::Tensor y;
#ifdef DTRAIN_WITH_CUDA
    if (kernel_takes(gate)) {
      const auto [g, u] = as_rows(gate, up);
      y = at::empty(g.sizes(), g.options());
      if (g.numel() > 0) {
        const detail::DeviceGuard guard(g.device());
        dtrain_swiglu_fwd_params p{};
        p.gate = g.data_ptr();
        p.up = u.data_ptr();
        p.y = y.data_ptr();
        p.rows = g.size(0), p.cols = g.size(1);
        p.gate_stride = g.stride(0), p.up_stride = u.stride(0), p.y_stride = y.stride(0);
        p.dtype = detail::kernel_dtype(g, "swiglu", "gate");
        DTRAIN_CUDA_CHECK(dtrain_swiglu_fwd(&p, detail::current_stream(g)));
      }
      ctx->save_for_backward({g, u});
      ctx->saved_data["sizes"] = gate.sizes().vec();
      return y.view(gate.sizes());
    }
#endif
    detail::NoAutocast no_autocast;
    const auto ct = detail::compute_type(gate);
    const auto g = gate.to(ct);
    y = (g * at::sigmoid(g) * up.to(ct)).to(gate.scalar_type());
    ctx->save_for_backward({gate, up});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &gate = s[0], &up = s[1];
#ifdef DTRAIN_WITH_CUDA
    if (kernel_takes(gate)) {  // gate and up as the forward's [rows, cols]
      const auto sizes = ctx->saved_data["sizes"].toIntVector();
      const auto dy = grads[0].to(gate.scalar_type()).reshape(gate.sizes()).contiguous();
      auto dgate = at::empty(gate.sizes(), gate.options()), dup = at::empty(gate.sizes(), gate.options());
      if (gate.numel() > 0) {
        const detail::DeviceGuard guard(gate.device());
        dtrain_swiglu_bwd_params p{};
        p.dy = dy.data_ptr();
        p.gate = gate.data_ptr();
        p.up = up.data_ptr();
        p.dgate = dgate.data_ptr();
        p.dup = dup.data_ptr();
        p.rows = gate.size(0), p.cols = gate.size(1);
        p.dy_stride = dy.stride(0), p.gate_stride = gate.stride(0), p.up_stride = up.stride(0);
        p.dgate_stride = dgate.stride(0), p.dup_stride = dup.stride(0);
        p.dtype = detail::kernel_dtype(gate, "swiglu", "gate");
        DTRAIN_CUDA_CHECK(dtrain_swiglu_bwd(&p, detail::current_stream(gate)));
      }
      return {dgate.view(sizes), dup.view(sizes)};
    }
#endif
    detail::NoAutocast no_autocast;
    const auto ct = detail::compute_type(gate);
    const auto g = gate.to(ct), u = up.to(ct), dy = grads[0].to(ct);
    const auto sig = at::sigmoid(g);
    return {(dy * u * sig * (1 + g * (1 - sig))).to(gate.scalar_type()), (dy * g * sig).to(up.scalar_type())};
  }
};

}  // namespace

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  DTRAIN_OP_CHECK(gate.defined() && up.defined(), "swiglu", "gate and up must both be given");
  DTRAIN_OP_CHECK(gate.sizes() == up.sizes(), "swiglu", "up is ", up.sizes(), "; gate ", gate.sizes(),
                  " needs the same shape");
  DTRAIN_OP_CHECK(gate.scalar_type() == up.scalar_type(), "swiglu", "up is ", detail::dtype_name(up), ", gate ",
                  detail::dtype_name(gate), "; they must match");
  DTRAIN_OP_CHECK(gate.device() == up.device(), "swiglu", "up is on ", up.device(), ", gate on ", gate.device());
  DTRAIN_OP_CHECK(at::isFloatingType(gate.scalar_type()), "swiglu", "gate is ", detail::dtype_name(gate),
                  "; allowed: float32, bfloat16, float16, float64");
  return SwigluFn::apply(gate, up);
}

}  // namespace dtrain::ops
