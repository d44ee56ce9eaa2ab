/* The kernel API's shared vocabulary: element types and the launch convention.
 * Every launcher takes a params struct of raw device pointers and element strides plus a
 * cudaStream_t, validates what it can see, launches asynchronously on that stream and
 * returns cudaSuccess, cudaErrorInvalidValue (a bad or unsupported parameter), or the
 * launch error. No LibTorch here: src/ops fills the structs from tensors. */
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef DTRAIN_KERNELS_EMULATE
/* The CPU-emulated build of the same sources (kernels/emulator, for tests) renames every
 * entry point, so that it links beside the real kernels. */
#define dtrain_adamw dtrain_emu_adamw
#define dtrain_norm_fwd dtrain_emu_norm_fwd
#define dtrain_norm_bwd dtrain_emu_norm_bwd
#define dtrain_norm_workspace_bytes dtrain_emu_norm_workspace_bytes
#define dtrain_norm_max_cols dtrain_emu_norm_max_cols
#define dtrain_cross_entropy_fwd dtrain_emu_cross_entropy_fwd
#define dtrain_cross_entropy_bwd dtrain_emu_cross_entropy_bwd
#define dtrain_swiglu_fwd dtrain_emu_swiglu_fwd
#define dtrain_swiglu_bwd dtrain_emu_swiglu_bwd
#define dtrain_rope dtrain_emu_rope
#define dtrain_attention_fwd dtrain_emu_attention_fwd
#define dtrain_attention_bwd dtrain_emu_attention_bwd
#define dtrain_attention_fwd_workspace_bytes dtrain_emu_attention_fwd_workspace_bytes
#define dtrain_attention_bwd_workspace_bytes dtrain_emu_attention_bwd_workspace_bytes
#define dtrain_attention_supports_head_dim dtrain_emu_attention_supports_head_dim
#define dtrain_attention_kernel_available dtrain_emu_attention_fwd_kernel_available
#define dtrain_attention_fwd_kernel_takes_head_dim dtrain_emu_attention_fwd_kernel_takes_head_dim
#define dtrain_attention_bwd_kernel_takes_head_dim dtrain_emu_attention_bwd_kernel_takes_head_dim
#define dtrain_attention_fwd_smem_bytes dtrain_emu_attention_fwd_smem_bytes
#define dtrain_attention_bwd_smem_bytes dtrain_emu_attention_bwd_smem_bytes
#define dtrain_attention_device_smem_bytes dtrain_emu_attention_device_smem_bytes
#define dtrain_attention_set_smem_cap dtrain_emu_attention_set_smem_cap
/* For tests: the shared memory the emulated device gives a block (227 KB, Hopper's,
 * unless set), which launches and dtrain_attention_device_smem_bytes see. */
/* For tests: the order in which each launch runs its blocks: seed 0 (the default) launch
 * order (x fastest), else a permutation drawn from the seed and the launch's number, as a
 * GPU's scheduler may run them in any order. */
#ifdef __cplusplus
extern "C" void dtrain_emu_set_block_smem_limit(size_t bytes);
extern "C" void dtrain_emu_set_block_order(uint64_t seed);
#else
void dtrain_emu_set_block_smem_limit(size_t bytes);
void dtrain_emu_set_block_order(uint64_t seed);
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  DTRAIN_KERNEL_F32 = 0,
  DTRAIN_KERNEL_BF16 = 1,
  DTRAIN_KERNEL_F16 = 2,
} dtrain_kernel_dtype;

#ifdef __cplusplus
}
#endif
