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
  double current_mib = 0;  // CUDA: allocated by the caching allocator; CPU: resident set
  double peak_mib = 0;     // CUDA: peak allocated; CPU: peak resident set (ru_maxrss)
};
MemoryStats memory_stats(c10::Device device);

// Starts a new peak window on a CUDA device (the next memory_stats().peak_mib counts from
// now); returns false on the CPU, whose peak resident set cannot be reset.
bool reset_peak_memory(c10::Device device);

// Waits for the device's queued work (no-op on the CPU).
void synchronize(c10::Device device);

}  // namespace dtrain::train
