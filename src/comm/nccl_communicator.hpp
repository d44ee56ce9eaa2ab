// NCCL backend of Communicator: CUDA tensors; every op runs on the communicator's own
// stream, ordered after the caller's current stream by events.
#pragma once

#include <functional>
#include <string>

#include "dtrain/comm/communicator.hpp"

namespace dtrain::detail {

// Number of visible CUDA devices (0 without a driver or GPU).
int cuda_device_count();

// Gives every rank the root's bytes (NCCL unique id): over MPI or the TCP store.
using IdShare = std::function<void(std::string& bytes)>;

// The NCCL world. A world of one rank is a Self communicator unless keep_size_one (tests
// that exercise NCCL itself on one GPU).
CommPtr make_nccl_world(int rank, int size, int device, const IdShare& share, Timeout timeout,
                        bool keep_size_one = false);

}  // namespace dtrain::detail
