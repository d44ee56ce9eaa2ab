// Progress registry and the process-wide peer probe slot.
#include "comm/peer_probe.hpp"

#include <mutex>
#include <unordered_map>

namespace dtrain::detail {

namespace {
std::mutex g_mutex;
std::unordered_map<std::uint64_t, std::weak_ptr<CommProgress>>& registry() {
  static std::unordered_map<std::uint64_t, std::weak_ptr<CommProgress>> r;
  return r;
}
std::shared_ptr<PeerProbe>& probe_slot() {
  static std::shared_ptr<PeerProbe> p;
  return p;
}
}  // namespace

std::uint64_t fnv1a(const std::string& s, std::uint64_t h) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::uint64_t mix_uid(std::uint64_t parent, std::uint64_t split_index, int color) {
  return fnv1a(std::to_string(parent) + "/" + std::to_string(split_index) + ":" +
               std::to_string(color));
}

void register_progress(const std::shared_ptr<CommProgress>& progress) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& r = registry();
  for (auto it = r.begin(); it != r.end();) {  // drop dead entries as we go
    it = it->second.expired() ? r.erase(it) : std::next(it);
  }
  r[progress->uid] = progress;
}

std::shared_ptr<CommProgress> find_progress(std::uint64_t uid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = registry().find(uid);
  return it == registry().end() ? nullptr : it->second.lock();
}

void set_peer_probe(std::shared_ptr<PeerProbe> probe) {
  std::lock_guard<std::mutex> lock(g_mutex);
  probe_slot() = std::move(probe);
}

std::shared_ptr<PeerProbe> peer_probe() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return probe_slot();
}

}  // namespace dtrain::detail
