// Flash attention forward on wgmma (sm_90a), head dim 128, bf16 (one dtype and head dim per file).
#include "attention/flash_fwd_sm90.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_fwd_sm90<__nv_bfloat16, 128>(const dtrain_attention_fwd_params&, cudaStream_t);
template size_t flash_fwd_sm90_smem_bytes<__nv_bfloat16, 128>();
}  // namespace dtrain_kernels
