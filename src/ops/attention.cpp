// Attention through at::scaled_dot_product_attention, with key/value heads repeated for
// grouped-query attention.
#include "dtrain/ops/attention.hpp"

#include <ATen/ATen.h>

#include "dtrain/core/error.hpp"

namespace dtrain::ops {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                     double dropout_p) {
  DTRAIN_CHECK_ARG(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                   "attention: q, k, v must be [batch, heads, time, head_dim]; got ", q.sizes(),
                   ", ", k.sizes(), ", ", v.sizes());
  const auto h = q.size(1), hkv = k.size(1);
  DTRAIN_CHECK_ARG(hkv >= 1 && h % hkv == 0, "attention: ", h, " query heads are not a multiple of ",
                   hkv, " key/value heads");
  at::Tensor kk = k, vv = v;
  if (hkv != h) {
    kk = k.repeat_interleave(h / hkv, 1);
    vv = v.repeat_interleave(h / hkv, 1);
  }
  return at::scaled_dot_product_attention(q, kk, vv, /*attn_mask=*/{}, dropout_p, causal);
}

}  // namespace dtrain::ops
