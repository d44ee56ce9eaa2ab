// Flash attention backward, head dim 32, fp16 (one dtype and head dim per file).
#include "attention/flash_bwd.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_bwd<__half, 32>(const dtrain_attention_bwd_params&, cudaStream_t);
template size_t flash_bwd_smem_bytes<__half, 32>();
}  // namespace dtrain_kernels
