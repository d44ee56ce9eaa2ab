// Flash attention forward on wgmma (sm_90a), head dim 64, fp16 (one dtype and head dim per file).
#include "attention/flash_fwd_sm90.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_fwd_sm90<__half, 64>(const dtrain_attention_fwd_params&, cudaStream_t);
template size_t flash_fwd_sm90_smem_bytes<__half, 64>();
}  // namespace dtrain_kernels
