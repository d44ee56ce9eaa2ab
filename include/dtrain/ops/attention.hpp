// The attention op every model calls: [B, H, T, D] queries, [B, Hkv, T, D] keys/values
// (grouped-query attention when Hkv < H). For now LibTorch's scaled_dot_product_attention;
// the kernels issue puts a custom kernel behind this same function.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::ops {

// dropout_p: dropout on the attention probabilities, drawn from the default generator.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                     double dropout_p = 0.0);

}  // namespace dtrain::ops
