// Device facts for metrics: names, known peaks, memory, synchronize.
#include "dtrain/train/device_stats.hpp"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "dtrain/core/logging.hpp"

#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include "dtrain/core/error.hpp"
#endif

namespace dtrain::train {

std::string device_name(c10::Device device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp prop{};
    DTRAIN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.index() < 0 ? 0 : device.index()));
    return prop.name;
  }
#endif
  return format("cpu ({} threads)", at::get_num_threads());
}

double known_peak_tflops(const std::string& name) {
  // Vendor data sheets, dense bf16. More specific names first (GH200 before H200, etc.).
  static const std::pair<const char*, double> table[] = {
      {"GB200", 2500.0},   {"B200", 2250.0},  {"GH200", 989.5},   {"H200", 989.5},
      {"H100 PCIe", 756.5}, {"H100 NVL", 835.5}, {"H100", 989.5},  {"H800", 989.5},
      {"A100", 312.0},     {"A800", 312.0},     {"L40S", 362.1},   {"L40", 181.0},
      {"L4", 121.0},       {"A10G", 70.0},      {"A10", 125.0},    {"RTX 4090", 165.2},
      {"RTX 6000 Ada", 364.2}, {"V100", 125.0},  // V100: fp16 tensor cores
  };
  for (const auto& [key, tflops] : table) {
    if (name.find(key) != std::string::npos) return tflops;
  }
  return 0.0;
}

namespace {

// Counts the bytes of CPU tensors allocated through it (and their peak). The memory comes
// from c10::alloc_cpu; the data pointer is its own context (what raw_allocate, used by
// some kernels, requires), and the sizes are kept in a map.
class TrackingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* data = n > 0 ? c10::alloc_cpu(n) : nullptr;
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = n;
      current_ += static_cast<std::int64_t>(n);
      peak_ = std::max(peak_, current_);
    }
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  std::int64_t current() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return current_;
  }
  std::int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = current_;
  }

 private:
  static void release(void* data);
  mutable std::mutex mutex_;
  std::unordered_map<void*, std::size_t> sizes_;
  std::int64_t current_ = 0, peak_ = 0;
};

TrackingCpuAllocator* cpu_tracker = nullptr;

void TrackingCpuAllocator::release(void* data) {
  if (data == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(cpu_tracker->mutex_);
    const auto it = cpu_tracker->sizes_.find(data);
    if (it != cpu_tracker->sizes_.end()) {
      cpu_tracker->current_ -= static_cast<std::int64_t>(it->second);
      cpu_tracker->sizes_.erase(it);
    }
  }
  c10::free_cpu(data);
}

}  // namespace

void enable_cpu_memory_tracking() {
  static std::once_flag once;
  std::call_once(once, [] {
    cpu_tracker = new TrackingCpuAllocator();  // lives for the process
    c10::SetCPUAllocator(cpu_tracker, /*priority=*/100);
  });
}

MemoryStats memory_stats(c10::Device device) {
  MemoryStats m;
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::kCUDA);  // the allocator exists only after init
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto& all = stats.allocated_bytes[0];  // StatType::AGGREGATE
    m.current_mib = static_cast<double>(all.current) / (1 << 20);
    m.peak_mib = static_cast<double>(all.peak) / (1 << 20);
    return m;
  }
#endif
  (void)device;
  if (cpu_tracker != nullptr) {
    m.current_mib = static_cast<double>(cpu_tracker->current()) / (1 << 20);
    m.peak_mib = static_cast<double>(cpu_tracker->peak()) / (1 << 20);
    return m;
  }
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  m.current_mib = static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  m.peak_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
  return m;
}

bool reset_peak_memory(c10::Device device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    at::globalContext().lazyInitDevice(c10::kCUDA);
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    return true;
  }
#endif
  if (device.is_cpu() && cpu_tracker != nullptr) {
    cpu_tracker->reset_peak();
    return true;
  }
  return false;
}

void synchronize(c10::Device device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)device;
}

}  // namespace dtrain::train
