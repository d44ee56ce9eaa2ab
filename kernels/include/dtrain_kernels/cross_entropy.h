/* Fused softmax cross-entropy over [rows, vocab] logits with int64 targets, the loss and
 * the logit gradients from one kernel. The forward reads each row in vocabulary chunks
 * with an online max/sum (no float32 copy of the logits), writes the row's loss (0 where
 * the target is ignore_index) and, when asked, then walks the row again (backwards, so the
 * chunks it read last and L2 still holds come first) writing
 *   dlogits = (softmax (1 + 2 z lse) - onehot(target)) * grad_scale / max(*count, 1)
 * where grad_scale is the upstream gradient the caller expects the mean loss to get and
 * *count (a device scalar: no host synchronisation) the rows not ignored; ignored rows get
 * zeros. z (z_loss, 0: none) adds PaLM's z-loss z lse^2 to each row's loss, lse - x_target
 * (lse: the row's log-sum-exp, the log of the softmax's normaliser). dlogits may be the
 * logits themselves (same pointer and stride): the gradient then replaces them, and no
 * second logits-sized buffer exists.
 * The backward only corrects a gradient written for the wrong upstream gradient: it
 * writes out = dlogits * *grad / *written, where *grad is the one autograd gives; a ratio
 * within 1e-6 of 1 counts as 1. In place (out == dlogits), a ratio of 1 returns at once:
 * that is the cost of a backward whose upstream gradient the forward was told.
 * A vocabulary split across ranks (a tensor-parallel head) takes two calls around the
 * caller's exchange: the first, with target_logit, writes per row the log-sum-exp over
 * this call's columns and the target's logit where they hold it (0 elsewhere); the second,
 * given the whole vocabulary's log-sum-exp (given_lse), reduces nothing and writes dlogits
 * alone. vocab_start places the columns in the vocabulary: targets are global ids. */
#pragma once

#include "dtrain_kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* logits;     /* [rows, vocab], row stride logits_stride, dtype */
  const int64_t* target;  /* [rows] global ids: column t - vocab_start */
  float* loss;            /* [rows], or null */
  float* lse;             /* [rows] log-sum-exp over these columns, or null */
  float* target_logit;    /* [rows] the target's logit where these columns hold it, else 0; or null */
  const float* given_lse; /* [rows] or null: the whole vocabulary's log-sum-exp; only dlogits is written */
  int64_t vocab_start;    /* the vocabulary id of column 0 (0 unless the vocabulary is split) */
  void* dlogits;          /* [rows, vocab], row stride dlogits_stride, dtype; null: loss only */
  const int64_t* count;   /* device scalar: rows whose target is not ignore_index (with dlogits) */
  float grad_scale;       /* the upstream gradient dlogits is written for (with dlogits) */
  float z_loss;           /* z-loss coefficient (finite, >= 0; 0: none): in loss and dlogits */
  int64_t rows, vocab, logits_stride, dlogits_stride, ignore_index;
  dtrain_kernel_dtype dtype;
} dtrain_cross_entropy_fwd_params;

typedef struct {
  const void* dlogits;   /* the forward's: [rows, vocab], row stride dlogits_stride, dtype */
  void* out;             /* the same, or rows of its own (row stride out_stride) */
  const float* grad;     /* device scalar: the upstream gradient of the mean loss */
  const float* written;  /* device scalar: the one dlogits holds the gradient for */
  int64_t rows, vocab, dlogits_stride, out_stride;
  dtrain_kernel_dtype dtype;
} dtrain_cross_entropy_bwd_params;

/* A target outside [vocab_start, vocab_start + vocab) that is not ignore_index gives a NaN
 * loss for its row (and a gradient without the onehot term): with a split vocabulary the
 * caller reads target_logit instead. */
cudaError_t dtrain_cross_entropy_fwd(const dtrain_cross_entropy_fwd_params* params, cudaStream_t stream);
cudaError_t dtrain_cross_entropy_bwd(const dtrain_cross_entropy_bwd_params* params, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
