// Who launched this process, and as which rank: Open MPI (mpirun), MPICH/PMI, Slurm
// (srun) or torchrun-style variables. Pure detection over an environment lookup, so every
// launcher style is unit-testable without launching anything.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace dtrain {

enum class Launcher { kNone, kOpenMpi, kPmi, kSlurm, kTorchrun };
const char* to_string(Launcher launcher);

struct LaunchEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // torchrun style only
  int master_port = 0;

  // MPI is the launcher's rendezvous (mpirun, srun, hydra); torchrun uses the TCP store.
  bool mpi_launched() const {
    return launcher == Launcher::kOpenMpi || launcher == Launcher::kPmi ||
           launcher == Launcher::kSlurm;
  }
  // "Open MPI (OMPI_COMM_WORLD_*): rank 1 of 4, local rank 1 of 4"
  std::string describe() const;
};

// Intra-op threads for one rank: the machine's cores shared among the ranks on this node
// (at least 1), so co-located ranks do not oversubscribe the CPU.
int default_intra_op_threads(int cores, int local_world_size);

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Precedence: Open MPI, torchrun (RANK + WORLD_SIZE), PMI (PMI_RANK + PMI_SIZE), Slurm
// (SLURM_PROCID + SLURM_NTASKS), otherwise a single process. Bad values raise
// InvalidArgument naming the variable.
LaunchEnv detect_launch_env(const EnvLookup& lookup);
LaunchEnv detect_launch_env();  // from the process environment

}  // namespace dtrain
