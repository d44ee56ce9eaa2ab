// Fused AdamW: one pass over many tensors (the CUDA kernel for CUDA tensors, a reference
// path with LibTorch AdamW's exact float32 arithmetic elsewhere). float32 master weights
// and moments; gradients float32, bfloat16 or float16, multiplied by grad_scale (loss
// unscaling and clipping folded in); an optional bfloat16/float16 model copy of each
// parameter written in the same pass. Bias corrections come from the caller.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dtrain::ops {

struct AdamWSegment {
  at::Tensor param;        // float32, contiguous (a flat shard's run is a narrow of it)
  at::Tensor grad;         // same numel, contiguous
  at::Tensor exp_avg;      // float32, same numel
  at::Tensor exp_avg_sq;   // float32, same numel
  at::Tensor model_param;  // bfloat16/float16 copy of param to write, or undefined
  double weight_decay = 0;
};

struct AdamWHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t
  double grad_scale = 1;
  // Optional int32 [1] flags on the segments' device: found_inf is set to 1 when a
  // gradient element is not finite (that element is left as it was); a nonzero skip
  // leaves every tensor untouched (a flag computed earlier on the device).
  at::Tensor found_inf, skip;
};

// The hyperparameters of AdamW step `step` (1 for the first): bias corrections 1 - beta^step.
AdamWHyper adamw_hyper(double lr, double beta1, double beta2, double eps, std::int64_t step);

// InvalidArgument naming the segment and tensor when shapes, dtypes, devices or layouts
// do not fit.
void fused_adamw(const std::vector<AdamWSegment>& segments, const AdamWHyper& hyper);

}  // namespace dtrain::ops
