// SwiGLU as one autograd Function over the CUDA kernel (kernels/activation/swiglu.cu) and a
// reference path with the same float32 math in ATen ops.
#include "dtrain/ops/swiglu.hpp"

#include <torch/torch.h>

#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/swiglu.h"
#endif

namespace dtrain::ops {
namespace {

bool kernel_takes(const at::Tensor& t) { return detail::on_kernel_device(t) && detail::kernel_float(t); }

class SwigluFn : public torch::autograd::Function<SwigluFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_in, const at::Tensor& up_in) {
    at::Tensor gate = gate_in, up = up_in, y;
#ifdef DTRAIN_WITH_CUDA
    if (kernel_takes(gate)) {
      gate = gate.contiguous(), up = up.contiguous();
      y = at::empty_like(gate);
      if (gate.numel() > 0) {  // one row of every element: the kernel's grid covers it
        const detail::DeviceGuard guard(gate.device());
        dtrain_swiglu_fwd_params p{};
        p.gate = gate.data_ptr();
        p.up = up.data_ptr();
        p.y = y.data_ptr();
        p.rows = 1;
        p.cols = p.gate_stride = p.up_stride = p.y_stride = gate.numel();
        p.dtype = detail::kernel_dtype(gate, "swiglu", "gate");
        DTRAIN_CUDA_CHECK(dtrain_swiglu_fwd(&p, detail::current_stream(gate)));
      }
    } else
#endif
    {
      detail::NoAutocast no_autocast;
      const auto ct = detail::compute_type(gate);
      const auto g = gate.to(ct);
      y = (g * at::sigmoid(g) * up.to(ct)).to(gate.scalar_type());
    }
    ctx->save_for_backward({gate, up});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &gate = s[0], &up = s[1];
    at::Tensor dgate, dup;
#ifdef DTRAIN_WITH_CUDA
    if (kernel_takes(gate)) {
      const auto dy = grads[0].to(gate.scalar_type()).contiguous();
      dgate = at::empty_like(gate), dup = at::empty_like(up);
      if (gate.numel() > 0) {
        const detail::DeviceGuard guard(gate.device());
        dtrain_swiglu_bwd_params p{};
        p.dy = dy.data_ptr();
        p.gate = gate.data_ptr();
        p.up = up.data_ptr();
        p.dgate = dgate.data_ptr();
        p.dup = dup.data_ptr();
        p.rows = 1;
        p.cols = p.dy_stride = p.gate_stride = p.up_stride = p.dgate_stride = p.dup_stride = gate.numel();
        p.dtype = detail::kernel_dtype(gate, "swiglu", "gate");
        DTRAIN_CUDA_CHECK(dtrain_swiglu_bwd(&p, detail::current_stream(gate)));
      }
    } else
#endif
    {
      detail::NoAutocast no_autocast;
      const auto ct = detail::compute_type(gate);
      const auto g = gate.to(ct), u = up.to(ct), dy = grads[0].to(ct);
      const auto sig = at::sigmoid(g);
      dup = (dy * g * sig).to(up.scalar_type());
      dgate = (dy * u * sig * (1 + g * (1 - sig))).to(gate.scalar_type());
    }
    return {dgate, dup};
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
