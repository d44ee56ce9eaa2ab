/* Fused RMSNorm and LayerNorm over the last dim of a [rows, cols] matrix, forward and
 * backward, float32 statistics whatever the input type.
 *   RMSNorm:   y = x * rstd * w,             rstd = 1 / sqrt(mean(x^2) + eps)
 *   LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var(x) + eps)
 * The forward saves rstd (and mean) per row; the backward computes dx per row and the
 * weight/bias gradients reduced over all rows: blocks write float32 partial sums into a
 * workspace (dtrain_norm_workspace_bytes), a second kernel sums them. Rows whose start
 * (pointer and stride) is 16-byte aligned, with cols a multiple of 16 bytes and 16-byte
 * aligned weight and bias, are read and written in 16-byte accesses; anything else is
 * correct at one element per access. */
#pragma once

#include "dtrain_kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* x;        /* [rows, cols], row stride x_stride elements, unit column stride */
  const void* weight;   /* [cols] weight_dtype, or NULL (no scale) */
  const void* bias;     /* [cols] weight_dtype, or NULL; LayerNorm only */
  void* y;              /* [rows, cols], row stride y_stride, dtype of x */
  float* mean;          /* [rows]; LayerNorm only (NULL: not saved) */
  float* rstd;          /* [rows]; NULL: not saved */
  int64_t rows, cols, x_stride, y_stride;
  float eps;
  int layer_norm;       /* 0: RMSNorm, 1: LayerNorm */
  dtrain_kernel_dtype dtype, weight_dtype;
} dtrain_norm_fwd_params;

typedef struct {
  const void* dy;       /* [rows, cols], row stride dy_stride, dtype */
  const void* x;        /* [rows, cols], row stride x_stride, dtype */
  const void* weight;   /* as in the forward, or NULL */
  const float* mean;    /* the forward's (LayerNorm) */
  const float* rstd;    /* the forward's */
  void* dx;             /* [rows, cols], row stride dx_stride, dtype */
  void* dweight;        /* [cols] weight_dtype, or NULL (not wanted / no weight) */
  void* dbias;          /* [cols] weight_dtype, or NULL (LayerNorm with a bias) */
  void* workspace;      /* dtrain_norm_workspace_bytes(this) bytes, 16-byte aligned, when
                           dweight/dbias */
  int64_t rows, cols, dy_stride, x_stride, dx_stride;
  int layer_norm;
  dtrain_kernel_dtype dtype, weight_dtype;
} dtrain_norm_bwd_params;

cudaError_t dtrain_norm_fwd(const dtrain_norm_fwd_params* params, cudaStream_t stream);
cudaError_t dtrain_norm_bwd(const dtrain_norm_bwd_params* params, cudaStream_t stream);
/* Workspace the backward with these params needs on the current device (it depends on the
 * shapes, dtypes and the alignment of the row pointers; the workspace field is not read). */
size_t dtrain_norm_workspace_bytes(const dtrain_norm_bwd_params* params);
/* The largest cols the kernels take (shared memory holds a block's partial sums). */
int64_t dtrain_norm_max_cols(void);

#ifdef __cplusplus
}
#endif
