/* Fused SwiGLU, the gated activation of Llama's MLP: y = silu(gate) * up, where
 * silu(g) = g * sigmoid(g), over [rows, cols] matrices with row strides. float32 math
 * whatever the element type; one read of each input and one write of each output per pass.
 * The backward recomputes sigmoid(gate) from the inputs (nothing else is saved) and writes
 *   dgate = dy * up * s * (1 + gate * (1 - s)),  dup = dy * gate * s,  s = sigmoid(gate).
 * Rows whose starts are all 16-byte aligned (pointers and strides), with cols a multiple of
 * 16 bytes, move in 16-byte accesses; anything else is correct at one element per access. */
#pragma once

#include "dtrain_kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* gate;  /* [rows, cols], row stride gate_stride elements, unit column stride */
  const void* up;    /* [rows, cols], row stride up_stride */
  void* y;           /* [rows, cols], row stride y_stride */
  int64_t rows, cols, gate_stride, up_stride, y_stride;
  dtrain_kernel_dtype dtype; /* of all three */
} dtrain_swiglu_fwd_params;

typedef struct {
  const void* dy;    /* [rows, cols], row stride dy_stride */
  const void* gate;  /* the forward's inputs */
  const void* up;
  void* dgate;       /* [rows, cols], row stride dgate_stride */
  void* dup;         /* [rows, cols], row stride dup_stride */
  int64_t rows, cols, dy_stride, gate_stride, up_stride, dgate_stride, dup_stride;
  dtrain_kernel_dtype dtype; /* of all five */
} dtrain_swiglu_bwd_params;

cudaError_t dtrain_swiglu_fwd(const dtrain_swiglu_fwd_params* params, cudaStream_t stream);
cudaError_t dtrain_swiglu_bwd(const dtrain_swiglu_bwd_params* params, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
