// Facts about the compute device for training metrics: its name, its dense bfloat16 peak
// TFLOP/s from a table of known GPUs (for MFU), memory in use and at peak, and a host
// synchronize for timing.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace dtrain::train {

// "NVIDIA H200" for a CUDA device; "cpu (<N> threads)" for the CPU.
std::string device_name(c10::Device device);

// Dense (no sparsity) bfloat16 tensor-core peak of one device in TFLOP/s, matched by
// substring of the device name (H200, H100 SXM/PCIe, A100, L40S, ...); 0 when unknown,
// which includes every CPU: pass --peak-tflops to get an MFU there.
double known_peak_tflops(const std::string& device_name);

struct MemoryStats {
  double current_mib = 0;  // CUDA: allocated by the caching allocator; CPU: resident set,
                           // or the bytes of live CPU tensors once tracking is on
  double peak_mib = 0;     // CUDA: peak allocated; CPU: peak resident set (ru_maxrss), or
                           // the tracked peak
};
MemoryStats memory_stats(c10::Device device);

// Puts a counting wrapper around LibTorch's CPU allocator (for tensors allocated from now
// on), so that memory_stats(cpu) reports the bytes of live CPU tensors and their peak, as
// the CUDA caching allocator does on a GPU. For benchmarks; idempotent.
void enable_cpu_memory_tracking();

// Starts a new peak window (the next memory_stats().peak_mib counts from now) on a CUDA
// device, or on the CPU with tracking on; returns false otherwise (the peak resident set
// cannot be reset).
bool reset_peak_memory(c10::Device device);

// Waits for the device's queued work (no-op on the CPU).
void synchronize(c10::Device device);

}  // namespace dtrain::train
