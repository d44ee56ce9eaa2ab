// Flash attention forward, head dim 96, bf16 (one dtype and head dim per file).
#include "attention/flash_fwd.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_fwd<__nv_bfloat16, 96>(const dtrain_attention_fwd_params&, cudaStream_t);
template size_t flash_fwd_smem_bytes<__nv_bfloat16, 96>();
}  // namespace dtrain_kernels
