// Where the kernel tests run, for both builds of them: the CPU emulator of the kernels'
// sources (DTRAIN_KERNELS_EMULATE: host tensors, every machine) or the compiled kernels
// on a CUDA device (skipped without one). The suite prefix, the device, a sync, the size
// of the cases, helpers for buffers on that device, and the attention kernels to run.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/core/env.hpp"
#include "dtrain_kernels/attention.h"
#include "dtrain_kernels/common.h"

#ifdef DTRAIN_KERNELS_EMULATE
#define KERNEL_SUITE(name) Emulated##name
inline at::Device kernel_device() { return at::kCPU; }
inline void kernel_sync() {}
#define KERNEL_DEVICE_OR_SKIP()
constexpr bool kLargeCases = false;  // the emulator runs a block in milliseconds, not microseconds
// The emulated device gives a block `bytes` of shared memory while this lives (then 227 KB).
struct ScopedBlockSmemLimit {
  explicit ScopedBlockSmemLimit(std::size_t bytes) { dtrain_emu_set_block_smem_limit(bytes); }
  ~ScopedBlockSmemLimit() { dtrain_emu_set_block_smem_limit(227 * 1024); }
  ScopedBlockSmemLimit(const ScopedBlockSmemLimit&) = delete;
  ScopedBlockSmemLimit& operator=(const ScopedBlockSmemLimit&) = delete;
};
// Each launch runs its blocks in a permutation drawn from `seed` while this lives (then
// in launch order), as a GPU's scheduler runs them in an order of its own.
struct ScopedBlockOrder {
  explicit ScopedBlockOrder(std::uint64_t seed) { dtrain_emu_set_block_order(seed); }
  ~ScopedBlockOrder() { dtrain_emu_set_block_order(0); }
  ScopedBlockOrder(const ScopedBlockOrder&) = delete;
  ScopedBlockOrder& operator=(const ScopedBlockOrder&) = delete;
};
constexpr bool kBlockOrderVaries = true;
#else
#define KERNEL_SUITE(name) Gpu##name
// A GPU's scheduler orders the blocks by itself.
struct ScopedBlockOrder {
  explicit ScopedBlockOrder(std::uint64_t) {}
};
constexpr bool kBlockOrderVaries = false;
inline at::Device kernel_device() { return at::kCUDA; }
inline void kernel_sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }
#define KERNEL_DEVICE_OR_SKIP()                                                   \
  do {                                                                            \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";      \
  } while (0)
constexpr bool kLargeCases = true;
#endif

// The attention launchers take the device to give a block at most `bytes` of shared memory
// while this lives (dtrain_attention_set_smem_cap), on either build.
struct ScopedAttentionSmemCap {
  explicit ScopedAttentionSmemCap(std::size_t bytes) { dtrain_attention_set_smem_cap(bytes); }
  ~ScopedAttentionSmemCap() { dtrain_attention_set_smem_cap(0); }
  ScopedAttentionSmemCap(const ScopedAttentionSmemCap&) = delete;
  ScopedAttentionSmemCap& operator=(const ScopedAttentionSmemCap&) = delete;
};

namespace {

inline dtrain_kernel_dtype kernel_dtype(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return DTRAIN_KERNEL_BF16;
  if (t.scalar_type() == at::kHalf) return DTRAIN_KERNEL_F16;
  return DTRAIN_KERNEL_F32;
}

// A copy on the kernels' device (also on the host: the tensor stays the reference's input).
inline at::Tensor dev(const at::Tensor& t) {
  return t.to(kernel_device(), t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}
// An output buffer full of NaN (of an integer type: all ones bits) on the kernels' device.
inline at::Tensor poisoned(at::IntArrayRef sizes, at::ScalarType type) {
  return torch::full(sizes, std::nan(""), torch::TensorOptions().dtype(type).device(kernel_device()));
}

inline double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.cpu().to(at::kDouble) - b.cpu().to(at::kDouble)).abs().max().item<double>();
}

// The attention kernels to test: every one this device runs, or the one
// DTRAIN_ATTENTION_KERNEL names (so that a broken kernel can be kept out of a run).
inline std::vector<dtrain_attention_kernel> attention_kernels() {
  const std::string only = dtrain::env::attention_kernel();
  std::vector<dtrain_attention_kernel> out;
  for (auto kernel : {DTRAIN_ATTENTION_KERNEL_MMA, DTRAIN_ATTENTION_KERNEL_WGMMA}) {
    const bool named = only == "auto" || (only == "mma") == (kernel == DTRAIN_ATTENTION_KERNEL_MMA);
    if (named && dtrain_attention_kernel_available(kernel)) out.push_back(kernel);
  }
  return out;
}

}  // namespace
