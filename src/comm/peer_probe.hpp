// Where is every rank? Per-communicator progress counters, a process-wide registry of
// them, and the probe that asks peers for theirs when a collective times out.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/types.hpp"

namespace dtrain::detail {

// Identical on every member of a communicator: the world is fnv1a("world"); a split child
// mixes its parent's uid, the parent's split count and the color.
std::uint64_t fnv1a(const std::string& s, std::uint64_t h = 14695981039346656037ull);
std::uint64_t mix_uid(std::uint64_t parent, std::uint64_t split_index, int color);

struct CommProgress {
  explicit CommProgress(std::uint64_t id) : uid(id) {}
  const std::uint64_t uid;
  std::atomic<std::uint64_t> issued{0};  // seq of the last collective issued here
  std::atomic<int> last_op{-1};          // OpKind of that collective
};

// Registry of live communicators' progress, keyed by uid (weak references).
void register_progress(const std::shared_ptr<CommProgress>& progress);
std::shared_ptr<CommProgress> find_progress(std::uint64_t uid);

struct PeerState {
  int world_rank = -1;
  bool answered = false;
  bool known = false;       // the peer has a live communicator with this uid
  std::uint64_t issued = 0;
  int last_op = -1;
};

// Asks peers (by world rank) for their progress on communicator uid; waits up to grace.
class PeerProbe {
 public:
  virtual ~PeerProbe() = default;
  virtual std::vector<PeerState> query(std::uint64_t uid, const std::vector<int>& world_ranks,
                                       Timeout grace) = 0;
};

// Set by the runtime (MPI control channel); null when no probe is available.
void set_peer_probe(std::shared_ptr<PeerProbe> probe);
std::shared_ptr<PeerProbe> peer_probe();

}  // namespace dtrain::detail
