// Launcher detection from environment variables.
#include "dtrain/comm/launch_env.hpp"

#include <algorithm>
#include <cstdlib>

#include "dtrain/core/error.hpp"

namespace dtrain {

using detail::str_cat;

const char* to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "single process";
    case Launcher::kOpenMpi: return "Open MPI (OMPI_COMM_WORLD_*)";
    case Launcher::kPmi: return "PMI (PMI_RANK, PMI_SIZE)";
    case Launcher::kSlurm: return "Slurm (SLURM_PROCID, SLURM_NTASKS)";
    case Launcher::kTorchrun: return "torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)";
  }
  return "?";
}

std::string LaunchEnv::describe() const {
  std::string s = str_cat(to_string(launcher), ": rank ", rank, " of ", world_size,
                          ", local rank ", local_rank, " of ", local_world_size);
  if (launcher == Launcher::kTorchrun) s += str_cat(", store ", master_addr, ":", master_port);
  return s;
}

int default_intra_op_threads(int cores, int local_world_size) {
  return std::max(1, cores / std::max(1, local_world_size));
}

namespace {

struct Reader {
  const EnvLookup& lookup;

  bool has(const char* name) const { return lookup(name).has_value(); }

  // Integer variable; `fallback` when unset; InvalidArgument when malformed or < min.
  int integer(const char* name, std::optional<int> fallback, int min = 0) const {
    auto v = lookup(name);
    if (!v) {
      DTRAIN_CHECK_ARG(fallback.has_value(), "environment variable ", name,
                       " is required by this launcher but is not set");
      return *fallback;
    }
    char* end = nullptr;
    const long x = std::strtol(v->c_str(), &end, 10);
    DTRAIN_CHECK_ARG(end && *end == '\0' && !v->empty() && x >= min && x <= 1 << 30,
                     "environment variable ", name, "='", *v, "' is not an integer >= ", min);
    return static_cast<int>(x);
  }
};

// Slurm's SLURM_TASKS_PER_NODE looks like "4(x2),3": the first node's count is enough
// for the local size on homogeneous allocations.
std::optional<int> slurm_tasks_per_node(const EnvLookup& lookup) {
  auto v = lookup("SLURM_STEP_TASKS_PER_NODE");
  if (!v) v = lookup("SLURM_TASKS_PER_NODE");
  if (!v) return std::nullopt;
  const int n = std::atoi(v->c_str());
  return n > 0 ? std::optional<int>(n) : std::nullopt;
}

}  // namespace

LaunchEnv detect_launch_env(const EnvLookup& lookup) {
  Reader r{lookup};
  LaunchEnv e;
  if (r.has("OMPI_COMM_WORLD_RANK")) {
    e.launcher = Launcher::kOpenMpi;
    e.rank = r.integer("OMPI_COMM_WORLD_RANK", std::nullopt);
    e.world_size = r.integer("OMPI_COMM_WORLD_SIZE", std::nullopt, 1);
    e.local_rank = r.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    e.local_world_size = r.integer("OMPI_COMM_WORLD_LOCAL_SIZE", e.world_size, 1);
  } else if (r.has("RANK") && r.has("WORLD_SIZE")) {
    e.launcher = Launcher::kTorchrun;
    e.rank = r.integer("RANK", std::nullopt);
    e.world_size = r.integer("WORLD_SIZE", std::nullopt, 1);
    e.local_rank = r.integer("LOCAL_RANK", 0);
    e.local_world_size = r.integer("LOCAL_WORLD_SIZE", e.world_size, 1);
    e.master_addr = lookup("MASTER_ADDR").value_or("");
    e.master_port = r.integer("MASTER_PORT", 0);
    DTRAIN_CHECK_ARG(e.world_size == 1 || (!e.master_addr.empty() && e.master_port > 0),
                     "torchrun-style launch with WORLD_SIZE=", e.world_size,
                     " needs MASTER_ADDR and MASTER_PORT (got MASTER_ADDR='", e.master_addr,
                     "', MASTER_PORT=", e.master_port, ")");
    DTRAIN_CHECK_ARG(e.master_port < 65536, "MASTER_PORT=", e.master_port,
                     " is out of range; allowed: 1..65535");
  } else if (r.has("PMI_RANK") && r.has("PMI_SIZE")) {
    e.launcher = Launcher::kPmi;
    e.rank = r.integer("PMI_RANK", std::nullopt);
    e.world_size = r.integer("PMI_SIZE", std::nullopt, 1);
    e.local_rank = r.integer("MPI_LOCALRANKID", 0);
    e.local_world_size = r.integer("MPI_LOCALNRANKS", e.world_size, 1);
  } else if (r.has("SLURM_PROCID") && (r.has("SLURM_STEP_NUM_TASKS") || r.has("SLURM_NTASKS"))) {
    e.launcher = Launcher::kSlurm;
    e.rank = r.integer("SLURM_PROCID", std::nullopt);
    e.world_size = r.has("SLURM_STEP_NUM_TASKS") ? r.integer("SLURM_STEP_NUM_TASKS", 1, 1)
                                                 : r.integer("SLURM_NTASKS", 1, 1);
    e.local_rank = r.integer("SLURM_LOCALID", 0);
    e.local_world_size = slurm_tasks_per_node(lookup).value_or(e.world_size);
  }
  DTRAIN_CHECK_ARG(e.rank < e.world_size, to_string(e.launcher), ": rank ", e.rank,
                   " is not below the world size ", e.world_size);
  DTRAIN_CHECK_ARG(e.local_rank < e.local_world_size, to_string(e.launcher), ": local rank ",
                   e.local_rank, " is not below the local world size ", e.local_world_size);
  return e;
}

LaunchEnv detect_launch_env() {
  return detect_launch_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  });
}

}  // namespace dtrain
