// Rotary embedding as one autograd Function over the CUDA kernel (kernels/position/rope.cu)
// and a reference path with the same float32 math in ATen ops. Both write their result
// into [B, T, H, D] storage viewed as [B, H, T, D].
#include "dtrain/ops/rope.hpp"

#include <torch/torch.h>

#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/rope.h"
#endif

namespace dtrain::ops {
namespace {

// [B, H, T, D] over [B, T, H, D] storage.
at::Tensor empty_output(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).permute({0, 2, 1, 3});
}

// x rotated by +angles (sign 1) or -angles (sign -1) into out; c and s as rope() takes them,
// cut to x's T positions.
void rotate(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, double sign, at::Tensor& out) {
#ifdef DTRAIN_WITH_CUDA
  if (detail::on_kernel_device(x) && detail::kernel_float(x) && c.scalar_type() == at::kFloat) {
    const auto xin = x.stride(3) == 1 ? x : x.contiguous();
    const bool same = c.strides() == s.strides() && c.stride(-1) == 1;
    const auto cc = same ? c : c.contiguous(), ss = same ? s : s.contiguous();
    const detail::DeviceGuard guard(x.device());
    dtrain_rope_params p{};
    p.x = xin.data_ptr();
    p.y = out.data_ptr();
    p.cos = cc.data_ptr<float>();
    p.sin = ss.data_ptr<float>();
    p.batch = x.size(0), p.heads = x.size(1), p.seq = x.size(2), p.head_dim = x.size(3);
    for (int d = 0; d < 3; ++d) p.x_stride[d] = xin.stride(d), p.y_stride[d] = out.stride(d);
    if (cc.dim() == 2) {
      p.angle_stride[0] = 0, p.angle_stride[1] = cc.stride(0);
    } else {
      p.angle_stride[0] = cc.size(0) == 1 ? 0 : cc.stride(0), p.angle_stride[1] = cc.stride(2);
    }
    p.inverse = sign < 0 ? 1 : 0;
    p.dtype = detail::kernel_dtype(x, "rope", "x");
    DTRAIN_CUDA_CHECK(dtrain_rope(&p, detail::current_stream(x)));
    return;
  }
#endif
  detail::NoAutocast no_autocast;
  const auto ct = detail::compute_type(x);
  const auto half = x.size(3) / 2;
  const auto xf = x.to(ct), cf = c.to(ct), sf = s.to(ct) * sign;
  const auto x1 = xf.narrow(3, 0, half), x2 = xf.narrow(3, half, half);
  out.copy_(at::cat({x1 * cf - x2 * sf, x1 * sf + x2 * cf}, 3));
}

class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& c,
                            const at::Tensor& s) {
    auto y = empty_output(x);
    if (y.numel() > 0) rotate(x, c, s, 1.0, y);
    ctx->save_for_backward({c, s});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& dy = grads[0];
    auto dx = empty_output(dy);
    if (dx.numel() > 0) rotate(dy, saved[0], saved[1], -1.0, dx);
    return {dx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  DTRAIN_OP_CHECK(x.dim() == 4 && x.size(3) > 0 && x.size(3) % 2 == 0, "rope", "x is ", x.sizes(),
                  "; needs [B, H, T, D] with D even");
  DTRAIN_OP_CHECK(at::isFloatingType(x.scalar_type()), "rope", "x is ", detail::dtype_name(x),
                  "; allowed: float32, bfloat16, float16, float64");
  DTRAIN_OP_CHECK(cos.defined() && sin.defined() && cos.sizes() == sin.sizes(), "rope", "cos is ",
                  cos.defined() ? cos.sizes() : at::IntArrayRef{}, ", sin ", sin.defined() ? sin.sizes() : at::IntArrayRef{},
                  "; they must have one shape");
  const auto B = x.size(0), T = x.size(2), half = x.size(3) / 2;
  const bool rows = cos.dim() == 2 && cos.size(0) >= T && cos.size(1) == half;
  const bool per_token = cos.dim() == 4 && (cos.size(0) == B || cos.size(0) == 1) && cos.size(1) == 1 &&
                         cos.size(2) == T && cos.size(3) == half;
  DTRAIN_OP_CHECK(rows || per_token, "rope", "cos and sin are ", cos.sizes(), "; x ", x.sizes(), " needs [>= ", T,
                  ", ", half, "] or [", B, ", 1, ", T, ", ", half, "]");
  const auto want = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  DTRAIN_OP_CHECK(cos.scalar_type() == want && sin.scalar_type() == want, "rope", "cos is ", detail::dtype_name(cos),
                  ", sin ", detail::dtype_name(sin), "; x of ", detail::dtype_name(x), " needs ",
                  c10::toString(want));
  DTRAIN_OP_CHECK(cos.device() == x.device() && sin.device() == x.device(), "rope", "cos is on ", cos.device(),
                  ", sin on ", sin.device(), ", x on ", x.device());
  return RopeFn::apply(x, rows ? cos.narrow(0, 0, T) : cos, rows ? sin.narrow(0, 0, T) : sin);
}

}  // namespace dtrain::ops
