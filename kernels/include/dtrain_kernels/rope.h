/* Rotary position embedding (RoPE) in the half-split convention of GPT-NeoX and Llama, on
 * x [batch, heads, seq, head_dim] with any strides over the first three dims and head_dim
 * contiguous. With the angles a of (batch, position, i) for i < head_dim / 2:
 *   y[i] = x[i] cos a - x[i + head_dim / 2] sin a,  y[i + head_dim / 2] = x[i] sin a + x[i + head_dim / 2] cos a.
 * inverse = 1 rotates by -a instead: the backward (dx from dy; the rotation is orthogonal,
 * so nothing of the forward is saved but the angles). float32 math, one read of x and one
 * write of y; y may be x itself (in place). 16-byte accesses where every row start (x, y,
 * cos, sin) is 16-byte aligned and head_dim / 2 is a multiple of 16 bytes, else one
 * element per access. */
#pragma once

#include "dtrain_kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* x;
  void* y;
  const float* cos;          /* [batch or 1, seq, head_dim / 2], unit stride over the last */
  const float* sin;          /* the same shape and strides as cos */
  int64_t batch, heads, seq, head_dim;
  int64_t x_stride[3];       /* x's batch, head and seq strides (elements) */
  int64_t y_stride[3];       /* y's */
  int64_t angle_stride[2];   /* cos' and sin's batch stride (0: one set for the batch) and seq stride */
  int inverse;               /* 1: rotate by -a (the backward) */
  dtrain_kernel_dtype dtype; /* of x and y */
} dtrain_rope_params;

cudaError_t dtrain_rope(const dtrain_rope_params* params, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
