// Flash attention backward on wgmma (sm_90a), head dim 256, fp16 (one dtype and head dim per file).
#include "attention/flash_bwd_sm90.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_bwd_sm90<__half, 256>(const dtrain_attention_bwd_params&, cudaStream_t);
template size_t flash_bwd_sm90_smem_bytes<__half, 256>();
}  // namespace dtrain_kernels
