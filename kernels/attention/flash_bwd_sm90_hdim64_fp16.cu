// Flash attention backward on wgmma (sm_90a), head dim 64, fp16 (one instantiation per file).
#include "attention/flash_bwd_sm90.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_bwd_sm90<__half, 64>(const dtrain_attention_bwd_params&, cudaStream_t);
}  // namespace dtrain_kernels
