// Flash attention forward, head dim 32, fp16 (one dtype and head dim per file).
#include "attention/flash_fwd.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_fwd<__half, 32>(const dtrain_attention_fwd_params&, cudaStream_t);
template size_t flash_fwd_smem_bytes<__half, 32>();
}  // namespace dtrain_kernels
