// ParallelContext: the parallel layout of one run (degrees per mesh axis), the DeviceMesh
// built from it over the world communicator, and the device this rank computes on. Models
// and strategies are built from it; with every degree 1 it describes a single process.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/mesh/device_mesh.hpp"

namespace dtrain {

// How attention crosses the context-parallel ranks (--cp-comm): kAllGather gathers every
// rank's keys and values (Llama 3's form: any head count, either attention backend, the
// queries at their offset); kAllToAll exchanges heads for positions around attention
// (DeepSpeed-Ulysses: each rank attends over the whole sequence with n_head / cp of the
// heads, on any attention backend); kRing passes keys and values round the ranks (ring
// attention: flash attention on blocks of keys at their query offsets, merged by
// log-sum-exp; the flash backend only).
enum class CpComm { kAllGather, kAllToAll, kRing };
// "all_gather" | "a2a" | "p2p" (Megatron-Core's names); InvalidArgument naming `option`,
// the value and the allowed ones.
CpComm parse_cp_comm(const std::string& name, const char* option = "--cp-comm");
const char* to_string(CpComm comm);

struct ParallelConfig {
  int dp = 0;  // data-parallel degree; 0: whatever the world size leaves after the others
  int tp = 1;  // tensor parallel (innermost axis)
  int pp = 1;  // pipeline stages (outermost axis)
  // Expert parallel: splits the dp ranks into groups of ep that each hold E / ep of every
  // MoE layer's experts and exchange tokens (must divide dp; does not add ranks).
  int ep = 1;
  int cp = 1;  // context parallel: each sequence split across cp ranks (parallel/context_parallel.hpp)
  CpComm cp_comm = CpComm::kAllGather;
  // Hybrid sharding (HSDP): the dp ranks form dp / dp_shard replicas of dp_shard ranks
  // each (mesh axes dp_replicate x dp_shard); 0: no such split (axis dp).
  int dp_shard = 0;
  // Sequence parallelism (needs tp > 1 to change anything): activations between the
  // tensor-parallel layers are split along the sequence across tp.
  bool sequence_parallel = false;

  // The mesh axes for `world_size` ranks, in mesh order. Raises InvalidArgument naming
  // the degrees and the world size when they do not multiply to it.
  MeshAxes mesh_axes(int world_size) const;
  // "dp=2 tp=1 pp=1 ep=1 cp=1" (resolved when world_size > 0)
  std::string describe(int world_size = 0) const;
};

class ParallelContext;
using ContextPtr = std::shared_ptr<ParallelContext>;

// Thread-safety: use from the thread that drives training. Creating a context is
// collective over `world` only when an axis has size > 1 and its communicator is asked for.
class ParallelContext {
 public:
  // Raises InvalidArgument for degrees that do not fit the world, naming the options.
  ParallelContext(CommPtr world, ParallelConfig config, c10::Device device = c10::kCPU);
  // One process, every degree 1, on `device`.
  static ContextPtr single_process(c10::Device device = c10::kCPU);

  const ParallelConfig& config() const { return config_; }  // dp resolved
  c10::Device device() const { return device_; }
  DeviceMesh& mesh() { return mesh_; }
  const CommPtr& world() const { return mesh_.world(); }
  int rank() const { return world()->rank(); }
  int world_size() const { return world()->size(); }
  // The data-parallel group: it splits the batch (with dp_shard: the dp_replicate x
  // dp_shard ranks together). Its ranks' cp groups hold the same samples.
  CommPtr dp_comm();
  int dp_rank() const;
  int dp_size() const { return config_.dp; }
  // The ranks that hold the same parameters and average their gradients (and shard them
  // under ZeRO/FSDP): the data-parallel ranks with their context-parallel ones, dp x cp.
  // dp_comm() at cp = 1.
  CommPtr dp_cp_comm();
  // Hybrid sharding: the ranks that share one model's shards (dp_shard x cp), and the ranks
  // that hold the same shard (one per replica). Without dp_shard: dp_cp_comm(), and a Self
  // communicator.
  CommPtr shard_comm();
  CommPtr replicate_comm();
  // Context parallelism: the ranks that split each sample's sequence (cp::take_local).
  CommPtr cp_comm() { return mesh_.comm("cp"); }
  int cp_rank() const { return mesh_.coord("cp"); }
  int cp_size() const { return config_.cp; }
  // The tensor-parallel group (adjacent ranks; a Self communicator at tp = 1).
  CommPtr tp_comm() { return mesh_.comm("tp"); }
  int tp_rank() const { return mesh_.coord("tp"); }
  int tp_size() const { return config_.tp; }
  bool sequence_parallel() const { return config_.sequence_parallel && config_.tp > 1; }
  // The pipeline group: the ranks holding the stages of one model replica (outermost axis).
  CommPtr pp_comm() { return mesh_.comm("pp"); }
  int pp_rank() const { return mesh_.coord("pp"); }
  int pp_size() const { return config_.pp; }
  // Expert parallelism: the ranks that split each MoE layer's experts (part of the dp
  // group, tp and cp coordinates fixed), and the ranks that hold the same experts (dp / ep
  // of them, x cp: expert gradients are averaged over it). Self and dp_cp_comm() at ep = 1.
  CommPtr ep_comm() { return mesh_.comm("ep"); }
  int ep_rank() const { return mesh_.coord("ep"); }
  int ep_size() const { return config_.ep; }
  CommPtr expert_dp_comm() {
    if (config_.ep == 1) return dp_cp_comm();
    return config_.cp > 1 ? mesh_.comm({"dp", "cp"}) : mesh_.comm("dp");
  }
  bool is_single_process() const { return world_size() == 1; }

 private:
  ParallelConfig config_;
  c10::Device device_;
  DeviceMesh mesh_;
};

}  // namespace dtrain
