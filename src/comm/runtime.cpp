// Runtime start-up: launcher detection, MPI engine or TCP store, device choice, worlds.
#include "dtrain/comm/runtime.hpp"

#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/peer_probe.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/logging.hpp"

#ifdef DTRAIN_WITH_MPI
#include "comm/mpi_communicator.hpp"
#endif
#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/nccl_communicator.hpp"
#endif

namespace dtrain {

using detail::str_cat;

struct Runtime::Impl {
#ifdef DTRAIN_WITH_MPI
  std::shared_ptr<detail::MpiEngine> engine;
#endif
#ifdef DTRAIN_WITH_CUDA
  c10::intrusive_ptr<c10d::Store> store;
#endif
};

namespace {
bool mpi_built() {
#ifdef DTRAIN_WITH_MPI
  return true;
#else
  return false;
#endif
}
bool cuda_built() {
#ifdef DTRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}
int gpu_count() {
#ifdef DTRAIN_WITH_CUDA
  return detail::cuda_device_count();
#else
  return 0;
#endif
}
}  // namespace

Runtime::Runtime(int* argc, char*** argv, const RuntimeOptions& options)
    : launch_(detect_launch_env()), impl_(std::make_shared<Impl>()) {
  const std::string& b = options.backend;
  DTRAIN_CHECK_ARG(b == "auto" || b == "mpi" || b == "nccl", "backend '", b,
                   "' is not known; allowed: auto, mpi, nccl");
  const int gpus = gpu_count();
  bool use_nccl = b == "nccl" || (b == "auto" && gpus > 0);
  DTRAIN_CHECK_ARG(!use_nccl || gpus > 0,
                   "backend 'nccl' needs a visible CUDA GPU; this process sees none (CUDA built: ",
                   cuda_built() ? "yes" : "no", "); use backend 'mpi' or 'auto'");
  DTRAIN_CHECK_ARG(!(b == "mpi" && !mpi_built() && launch_.world_size > 1),
                   "backend 'mpi' was requested for ", launch_.world_size,
                   " ranks but this build has no MPI (DTRAIN_WITH_MPI=OFF)");

  detail::set_process_identity(launch_.rank, launch_.world_size);
  init_logging(launch_.rank, launch_.world_size);

#ifdef DTRAIN_WITH_MPI
  if (launch_.mpi_launched()) {  // also at one rank: user code may call MPI
    impl_->engine = detail::MpiEngine::start(argc, argv);
    DTRAIN_CHECK_T(CommError, impl_->engine->world_size() == launch_.world_size &&
                                  impl_->engine->world_rank() == launch_.rank,
                   "MPI world (rank ", impl_->engine->world_rank(), " of ",
                   impl_->engine->world_size(), ") disagrees with the launcher's variables (",
                   launch_.describe(), ")");
    detail::set_peer_probe(impl_->engine);
    cpu_world_ = detail::make_mpi_world(impl_->engine, options.timeout);
  }
#endif
  if (!cpu_world_ && launch_.world_size == 1) {
    cpu_world_ = make_self_communicator("world", 0, 0, options.timeout);
  }

  if (use_nccl) {
#ifdef DTRAIN_WITH_CUDA
    const int dev = launch_.local_rank % gpus;
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dev));
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(dev));
    detail::IdShare share;
#ifdef DTRAIN_WITH_MPI
    if (impl_->engine) {
      auto engine = impl_->engine;
      share = [engine](std::string& bytes) {
        bytes.resize(128);  // sizeof(ncclUniqueId)
        DTRAIN_MPI_CHECK(MPI_Bcast(bytes.data(), 128, MPI_BYTE, 0, engine->world_comm()));
      };
    }
#endif
    if (!share && launch_.world_size > 1) {
      DTRAIN_CHECK_ARG(launch_.launcher == Launcher::kTorchrun,
                       "NCCL with ", launch_.world_size, " ranks needs MPI or torchrun-style "
                       "MASTER_ADDR/MASTER_PORT to exchange its id; launcher: ",
                       launch_.describe());
      c10d::TCPStoreOptions so;
      so.port = static_cast<std::uint16_t>(launch_.master_port);
      so.isServer = launch_.rank == 0;
      so.numWorkers = launch_.world_size;
      so.waitWorkers = true;
      impl_->store = c10::make_intrusive<c10d::TCPStore>(launch_.master_addr, so);
      auto store = impl_->store;
      const bool root = launch_.rank == 0;
      share = [store, root](std::string& bytes) {
        const std::string key = "dtrain/nccl_unique_id/world";
        if (root) {
          store->set(key, std::vector<std::uint8_t>(bytes.begin(), bytes.end()));
        } else {
          auto v = store->get(key);
          bytes.assign(v.begin(), v.end());
        }
      };
    }
    world_ = detail::make_nccl_world(launch_.rank, launch_.world_size, dev, share,
                                     options.timeout);
    backend_ = Backend::kNccl;
#endif
  } else {
    DTRAIN_CHECK_ARG(cpu_world_ != nullptr, "CPU collectives across ", launch_.world_size,
                     " ranks need MPI; launch with mpirun or srun (launcher detected: ",
                     launch_.describe(), ", MPI built: ", mpi_built() ? "yes" : "no", ")");
    world_ = cpu_world_;
    backend_ = world_->backend();
  }
  // Share the cores among the ranks on this node unless the user chose (OMP_NUM_THREADS).
  std::string threads_source = "OMP_NUM_THREADS";
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    at::set_num_threads(default_intra_op_threads(cores, launch_.local_world_size));
    threads_source = format("{} cores / {} local ranks", cores, launch_.local_world_size);
  }
  log_info("dtrain runtime: {}; backend {}; device {}; {} intra-op threads ({})",
           launch_.describe(), to_string(world_->backend()), device_, at::get_num_threads(),
           threads_source);
}

Runtime::~Runtime() {
  world_.reset();
  cpu_world_.reset();
  detail::set_peer_probe(nullptr);
  impl_.reset();  // stops the MPI engine and finalises MPI when we initialised it
}

void Runtime::abort(int code) const {
  std::fflush(stdout);
  std::fflush(stderr);
#ifdef DTRAIN_WITH_MPI
  if (impl_ && impl_->engine) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::_Exit(code);
}

CommPtr Runtime::cpu_world() const {
  DTRAIN_CHECK_ARG(cpu_world_ != nullptr, "no CPU communicator: ", launch_.world_size,
                   " ranks launched without MPI (", launch_.describe(), ")");
  return cpu_world_;
}

}  // namespace dtrain
