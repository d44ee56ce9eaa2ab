// ParallelContext: degrees -> mesh axes, validation of what this build implements.
#include "dtrain/parallel/context.hpp"

#include "dtrain/core/error.hpp"

namespace dtrain {

CpComm parse_cp_comm(const std::string& name, const char* option) {
  if (name == "all_gather") return CpComm::kAllGather;
  if (name == "a2a") return CpComm::kAllToAll;
  if (name == "p2p") return CpComm::kRing;
  DTRAIN_CHECK_ARG(false, option, "=", name,
                   " is not a context-parallel communication; allowed: all_gather, a2a, p2p");
  return CpComm::kAllGather;
}

const char* to_string(CpComm comm) {
  switch (comm) {
    case CpComm::kAllToAll: return "a2a";
    case CpComm::kRing: return "p2p";
    case CpComm::kAllGather: break;
  }
  return "all_gather";
}

MeshAxes ParallelConfig::mesh_axes(int world_size) const {
  DTRAIN_CHECK_ARG(tp >= 1 && pp >= 1 && ep >= 1 && cp >= 1 && dp >= 0 && dp_shard >= 0,
                   "parallel degrees must be positive (dp may be 0 for automatic); got ",
                   describe());
  // Expert parallelism splits the data-parallel ranks (as in Megatron-Core): it does not
  // multiply into the world size.
  const int others = tp * pp * cp;
  int d = dp;
  if (d == 0) {
    DTRAIN_CHECK_ARG(world_size % others == 0, "world size ", world_size,
                     " is not divisible by tp x pp x cp = ", others, " (", describe(), ")");
    d = world_size / others;
  }
  DTRAIN_CHECK_ARG(d * others == world_size, "parallel degrees ", describe(), " multiply to ",
                   d * others, " ranks but the world has ", world_size,
                   "; set --dp 0 to fill the world with data parallelism");
  DTRAIN_CHECK_ARG(d % ep == 0, "--ep=", ep, " does not divide the data-parallel size ", d,
                   " (", describe(world_size), "); expert parallelism splits the data-parallel ",
                   "ranks: allowed: a divisor of ", d);
  DTRAIN_CHECK_ARG(ep == 1 || dp_shard == 0, "--ep=", ep, " with --dp-shard ", dp_shard,
                   " (hybrid sharding) is not available; allowed: --ep 1, or --fsdp none, "
                   "zero1, zero2, full");
  MeshAxes axes;
  axes.emplace_back("pp", pp);
  if (ep > 1) {
    axes.emplace_back("dp", d / ep);  // the expert-data-parallel part; ep below
  } else if (dp_shard > 0) {
    DTRAIN_CHECK_ARG(d % dp_shard == 0, "--dp-shard=", dp_shard,
                     " does not divide the data-parallel size ", d,
                     "; allowed: a divisor of ", d);
    axes.emplace_back("dp_replicate", d / dp_shard);
    axes.emplace_back("dp_shard", dp_shard);
  } else {
    axes.emplace_back("dp", d);
  }
  axes.emplace_back("cp", cp);
  axes.emplace_back("ep", ep);
  axes.emplace_back("tp", tp);
  return axes;
}

std::string ParallelConfig::describe(int world_size) const {
  int d = dp;
  if (d == 0 && world_size > 0) d = world_size / (tp * pp * cp);
  return detail::str_cat("dp=", d == 0 ? std::string("auto") : std::to_string(d),
                         dp_shard > 0 ? " (dp_shard=" + std::to_string(dp_shard) + ")" : "",
                         " tp=", tp, sequence_parallel ? " (sequence parallel)" : "", " pp=", pp,
                         " ep=", ep, " cp=", cp, cp > 1 ? std::string(" (") + to_string(cp_comm) + ")" : "");
}

namespace {
ParallelConfig resolved(ParallelConfig c, int world_size) {
  int d = 1;
  for (const auto& [axis, size] : c.mesh_axes(world_size)) {
    if (axis == "dp" || axis == "dp_replicate" || axis == "dp_shard" || axis == "ep") d *= size;
  }
  c.dp = d;
  return c;
}
}  // namespace

ParallelContext::ParallelContext(CommPtr world, ParallelConfig config, c10::Device device)
    : config_(resolved(config, world->size())),
      device_(device),
      mesh_(world, config_.mesh_axes(world->size())) {
  DTRAIN_CHECK_ARG(!config_.sequence_parallel || config_.tp > 1,
                   "--sequence-parallel needs --tp > 1 (got --tp ", config_.tp, ")");
}

CommPtr ParallelContext::dp_comm() {
  if (config_.dp_shard > 0) return mesh_.comm({"dp_replicate", "dp_shard"});
  return mesh_.comm({"dp", "ep"});  // ep has size 1 without expert parallelism
}

int ParallelContext::dp_rank() const {
  if (config_.dp_shard == 0) return mesh_.coord("dp") * config_.ep + mesh_.coord("ep");
  return mesh_.coord("dp_replicate") * config_.dp_shard + mesh_.coord("dp_shard");
}

CommPtr ParallelContext::dp_cp_comm() {
  if (config_.cp == 1) return dp_comm();  // the same group: no second communicator
  if (config_.dp_shard > 0) return mesh_.comm({"dp_replicate", "dp_shard", "cp"});
  return mesh_.comm({"dp", "cp", "ep"});
}

CommPtr ParallelContext::shard_comm() {
  if (config_.dp_shard == 0) return dp_cp_comm();
  return config_.cp == 1 ? mesh_.comm("dp_shard") : mesh_.comm({"dp_shard", "cp"});
}

CommPtr ParallelContext::replicate_comm() {
  return mesh_.comm("dp_replicate");  // a Self communicator without dp_shard
}

ContextPtr ParallelContext::single_process(c10::Device device) {
  return std::make_shared<ParallelContext>(make_self_communicator("world", 0), ParallelConfig{}, device);
}

}  // namespace dtrain
