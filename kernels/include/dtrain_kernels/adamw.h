/* Fused AdamW: one launch updates many tensors (the multi-tensor form; an FSDP shard is
 * the same call with one segment per run of its flat buffer). Per element, in float32:
 *   g = grad * grad_scale            (unscaling by the loss scale and clipping, folded)
 *   p *= 1 - lr * weight_decay       (decoupled decay; per segment)
 *   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
 *   p -= lr / bias_correction1 * m / (sqrt(v / bias_correction2) + eps)
 * and, when model_param is set, the bfloat16/float16 model copy of p is written in the
 * same pass. Bias corrections (1 - beta^t) come from the host. A non-finite g leaves that
 * element's p, m, v as they were (the model copy is written from p either way) and sets
 * *found_inf = 1 (when given); when *skip is nonzero at launch (a flag an earlier kernel
 * computed) nothing is updated. */
#pragma once

#include "dtrain_kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  float* param;              /* float32 master weights */
  const void* grad;          /* grad_dtype */
  float* exp_avg;            /* float32 */
  float* exp_avg_sq;         /* float32 */
  void* model_param;         /* model_dtype copy of param, or NULL */
  int64_t numel;
  float weight_decay;        /* 0 for the no-decay group */
} dtrain_adamw_segment;

typedef struct {
  float lr, beta1, beta2, eps;
  float bias_correction1, bias_correction2; /* 1 - beta1^t, 1 - beta2^t */
  float grad_scale;                         /* multiplies every gradient */
  dtrain_kernel_dtype grad_dtype;           /* F32, BF16 or F16 */
  dtrain_kernel_dtype model_dtype;          /* BF16 or F16 (used when model_param is set) */
  int* found_inf;                           /* device flag set to 1 on a non-finite g; or NULL */
  const int* skip;                          /* device flag: nonzero skips the update; or NULL */
} dtrain_adamw_params;

/* segments: a host array of n entries (device pointers inside). A segment whose param,
 * exp_avg and exp_avg_sq are 16-byte aligned (grad and model_param to 4 elements) moves 4
 * elements per access; any alignment is correct. */
cudaError_t dtrain_adamw(const dtrain_adamw_segment* segments, int n, const dtrain_adamw_params* params,
                         cudaStream_t stream);

#ifdef __cplusplus
}
#endif
