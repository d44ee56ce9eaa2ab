// The flash attention kernels' shared configuration and the per-(dtype, head dim) entry
// points that flash_api.cu dispatches to; each instantiation lives in its own .cu file so
// that they compile in parallel.
#pragma once

#include "dtrain_kernels/attention.h"

namespace dtrain_kernels {

constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct FlashConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kPitch = D + 8;  // shared-memory row pitch (elements): no bank conflicts
  // Forward: a warp owns kFwdRowTiles x 16 query rows, so that each K or V fragment read
  // from shared memory feeds that many MMAs; key tiles of kFwdBlockN.
  static constexpr int kFwdRowTiles = 2;
  static constexpr int kFwdBlockM = 16 * kFwdRowTiles * kWarps;
  static constexpr int kFwdBlockN = 64;
  // Backward: a warp owns 16 keys; query tiles of kBwdBlockM.
  static constexpr int kBwdBlockN = 16 * kWarps;
  static constexpr int kBwdBlockM = 64;
  static constexpr int kPitchS = kBwdBlockN + 8;  // the backward's dS tile [query][key]
};

template <typename T, int D>
cudaError_t run_flash_fwd(const dtrain_attention_fwd_params& p, cudaStream_t stream);
template <typename T, int D>
cudaError_t run_flash_fwd_sm90(const dtrain_attention_fwd_params& p, cudaStream_t stream);  // wgmma
template <typename T, int D>
cudaError_t run_flash_bwd(const dtrain_attention_bwd_params& p, cudaStream_t stream);
template <typename T, int D>
cudaError_t run_flash_bwd_sm90(const dtrain_attention_bwd_params& p, cudaStream_t stream);  // wgmma

// The backward's workspace: dq in float32 [batch, heads, seq_q, head_dim] (accumulated
// by atomics), then delta = rowsum(dout * o) [batch, heads, seq_q].
inline size_t flash_bwd_workspace_floats(const dtrain_attention_bwd_params& p) {
  const size_t rows = static_cast<size_t>(p.batch) * static_cast<size_t>(p.heads) * static_cast<size_t>(p.seq_q);
  return rows * static_cast<size_t>(p.head_dim) + rows;
}

}  // namespace dtrain_kernels
