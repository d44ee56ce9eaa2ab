/* Fused softmax cross-entropy over [rows, vocab] logits with int64 targets. The forward
 * reads each row once in vocabulary chunks with an online max/sum (no float32 copy of the
 * logits) and writes the row's loss and log-sum-exp; rows whose target is ignore_index
 * get loss 0. The backward writes dlogits = (softmax - onehot(target)) * scale from the
 * logits and the saved log-sum-exp in one pass over the row, where scale is *grad_scale /
 * max(*count, 1) read on the device (the mean over non-ignored rows times the upstream
 * gradient, with no host synchronisation); ignored rows get zeros. */
#pragma once

#include "dtrain_kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* logits;     /* [rows, vocab], row stride logits_stride, dtype */
  const int64_t* target;  /* [rows] */
  float* loss;            /* [rows] */
  float* lse;             /* [rows] */
  int64_t rows, vocab, logits_stride, ignore_index;
  dtrain_kernel_dtype dtype;
} dtrain_cross_entropy_fwd_params;

typedef struct {
  const void* logits;       /* as in the forward */
  const int64_t* target;
  const float* lse;         /* the forward's */
  const float* grad_scale;  /* device scalar: the upstream gradient of the mean loss */
  const int64_t* count;     /* device scalar: rows whose target is not ignore_index */
  void* dlogits;            /* [rows, vocab], row stride dlogits_stride, dtype */
  int64_t rows, vocab, logits_stride, dlogits_stride, ignore_index;
  dtrain_kernel_dtype dtype;
} dtrain_cross_entropy_bwd_params;

/* A target outside [0, vocab) that is not ignore_index gives a NaN loss for its row. */
cudaError_t dtrain_cross_entropy_fwd(const dtrain_cross_entropy_fwd_params* params, cudaStream_t stream);
cudaError_t dtrain_cross_entropy_bwd(const dtrain_cross_entropy_bwd_params* params, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
