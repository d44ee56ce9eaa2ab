// Flash attention forward, head dim 256, fp16 (one instantiation per file).
#include "attention/flash_fwd.cuh"

namespace dtrain_kernels {
template cudaError_t run_flash_fwd<__half, 256>(const dtrain_attention_fwd_params&, cudaStream_t);
}  // namespace dtrain_kernels
