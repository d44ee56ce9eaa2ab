// Runtime: process start-up and shut-down for distributed runs. Detects the launcher,
// initialises MPI (and its progress thread) or the TCP store, picks the CUDA device from
// the local rank, and builds the world communicators.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/comm/launch_env.hpp"

namespace dtrain {

struct RuntimeOptions {
  // "auto" (NCCL when CUDA is built and a GPU is visible, else MPI), "mpi" or "nccl".
  std::string backend = "auto";
  // Default collective timeout; 0 means DTRAIN_COMM_TIMEOUT_S (default 600 s).
  Timeout timeout{0};
};

// One per process, created at the top of main and destroyed at its end (finalises MPI if
// it initialised it). Not copyable. world() and cpu_world() may be used from one thread.
class Runtime {
 public:
  Runtime(int* argc, char*** argv, const RuntimeOptions& options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const LaunchEnv& launch() const { return launch_; }
  int rank() const { return launch_.rank; }
  int size() const { return launch_.world_size; }
  // The device this rank computes on: cuda:<local rank mod devices> with NCCL, else cpu.
  c10::Device device() const { return device_; }
  Backend backend() const { return backend_; }

  // The world communicator of the chosen backend (tensors on device()).
  CommPtr world() const { return world_; }
  // A world communicator for CPU tensors (MPI, or Self in a one-process run). Raises
  // when the run has several ranks but no MPI (torchrun-style launch without mpirun).
  CommPtr cpu_world() const;

  // Ends the whole job now with `code`: MPI_Abort when MPI runs (peers blocked in a
  // collective end too), else std::_Exit. For errors after the ranks stopped agreeing.
  [[noreturn]] void abort(int code) const;

 private:
  struct Impl;
  LaunchEnv launch_;
  c10::Device device_{c10::kCPU};
  Backend backend_ = Backend::kSelf;
  std::shared_ptr<Impl> impl_;
  CommPtr world_;
  CommPtr cpu_world_;
};

}  // namespace dtrain
