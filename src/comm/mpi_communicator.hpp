// MPI backend of Communicator: CPU tensors; collectives on a per-communicator worker
// thread, send/recv on the process's MpiEngine thread.
#pragma once

#include <memory>
#include <string>

#include "comm/mpi_engine.hpp"
#include "dtrain/comm/communicator.hpp"

namespace dtrain::detail {

// The world communicator over the engine's private copy of MPI_COMM_WORLD (a Self
// communicator when the world has one rank).
CommPtr make_mpi_world(const std::shared_ptr<MpiEngine>& engine, Timeout timeout);

}  // namespace dtrain::detail
