// Checkpoint directories: staging, durable commit (fsync + rename), latest pointer,
// retention, verification and fallback to the newest good checkpoint.
#include "dtrain/checkpoint/directory.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dtrain/checkpoint/safetensors.hpp"
#include "dtrain/core/fs.hpp"
#include "file_io.hpp"

namespace dtrain::checkpoint {

namespace {

constexpr const char* kFormat = "dtrain-checkpoint";
constexpr int kVersion = 1;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw CheckpointError("checkpoint '" + path + "': " + problem);
}

std::string errno_text() { return std::strerror(errno); }

// fsync of a directory, so that renames and new entries in it are durable.
void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir, "cannot be opened to sync: " + errno_text());
  const bool ok = ::fsync(fd) == 0;
  const std::string problem = ok ? "" : errno_text();
  ::close(fd);
  if (!ok) fail(dir, "fsync failed: " + problem);
}

// Writes text to path durably (write, fsync, close).
void write_durable(const std::string& path, const std::string& text) {
  io::write_file(path, {{text.data(), text.size()}});
}

void rename_or_fail(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail(from, "cannot be renamed to '" + to + "': " + errno_text());
}

std::int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::int64_t>(st.st_size) : -1;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::string step_dir(const std::string& root, std::int64_t step) {
  return fs::join(root, "step_" + std::to_string(step));
}

std::string staging_dir(const std::string& root, std::int64_t step) {
  return fs::join(root, ".step_" + std::to_string(step) + ".tmp");
}

std::string begin_save(const std::string& root, std::int64_t step) {
  DTRAIN_CHECK_ARG(step >= 0, "checkpoint step ", step, " must not be negative");
  const auto dir = staging_dir(root, step);
  try {
    fs::make_directories(root);
    fs::remove_tree(dir);  // a stale staging directory of an interrupted save
    fs::make_directories(dir);
  } catch (const InvalidArgument& e) {
    fail(root, std::string("cannot stage a save: ") + e.what());
  }
  return dir;
}

void commit_save(const std::string& root, std::int64_t step, const std::string& manifest_text,
                 const std::vector<FileRecord>& files, int keep_last) {
  const auto staging = staging_dir(root, step), final_dir = step_dir(root, step);
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(manifest_text.empty() ? "{}" : manifest_text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(std::string("checkpoint manifest: not valid JSON: ") + e.what());
  }
  DTRAIN_CHECK_ARG(manifest.is_object(), "checkpoint manifest must be a JSON object");
  manifest["format"] = kFormat;
  manifest["version"] = kVersion;
  manifest["step"] = step;
  nlohmann::json listed = nlohmann::json::object();
  for (const auto& f : files) {
    const auto size = file_size(fs::join(staging, f.name));
    if (size != f.bytes) {
      fail(staging, "file '" + f.name + "' has " + std::to_string(size) + " bytes, not the " +
                        std::to_string(f.bytes) + " written (missing or changed before the commit)");
    }
    listed[f.name] = {{"bytes", f.bytes}, {"checksum", checksum_text(f.checksum)}};
  }
  manifest["files"] = listed;
  write_durable(fs::join(staging, "manifest.json"), manifest.dump(2) + "\n");
  sync_dir(staging);
  if (fs::exists(final_dir)) {  // a re-save of the same step: the old one goes first
    const auto old = final_dir + ".old";
    fs::remove_tree(old);
    rename_or_fail(final_dir, old);
    fs::remove_tree(old);
  }
  rename_or_fail(staging, final_dir);
  sync_dir(root);
  // latest: written aside, then renamed over the old pointer.
  const auto latest = fs::join(root, "latest");
  write_durable(latest + ".tmp", "step_" + std::to_string(step) + "\n");
  rename_or_fail(latest + ".tmp", latest);
  sync_dir(root);
  if (keep_last > 0) {
    auto steps = list_steps(root);
    const auto n = static_cast<int>(steps.size());
    for (int i = 0; i < n - keep_last; ++i) {
      if (steps[static_cast<std::size_t>(i)] != step) fs::remove_tree(step_dir(root, steps[static_cast<std::size_t>(i)]));
    }
  }
}

std::vector<std::int64_t> list_steps(const std::string& root) {
  std::vector<std::int64_t> out;
  DIR* d = ::opendir(root.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("step_", 0) != 0 || name.size() == 5) continue;
    const auto digits = name.substr(5);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (digits.size() > 18) continue;
    struct stat st {};
    if (::stat(fs::join(root, name).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) out.push_back(std::stoll(digits));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string verify(const std::string& dir) {
  const auto path = fs::join(dir, "manifest.json");
  if (!fs::exists(path)) fail(dir, "has no manifest.json (an incomplete or foreign directory)");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("malformed manifest: ") + e.what());
  }
  if (!m.is_object() || m.value("format", "") != kFormat) fail(path, std::string("is not a ") + kFormat + " manifest");
  if (m.value("version", 0) != kVersion) {
    fail(path, "manifest version " + m.value("version", nlohmann::json()).dump() + " is not supported; allowed: " +
                   std::to_string(kVersion));
  }
  if (!m.contains("files") || !m["files"].is_object()) fail(path, "manifest lists no files");
  for (const auto& [name, entry] : m["files"].items()) {
    const auto file = fs::join(dir, name);
    const auto size = file_size(file);
    if (size < 0) fail(file, "is missing (listed in the manifest)");
    const auto want = entry.value("bytes", std::int64_t{-1});
    if (size != want) {
      fail(file, "has " + std::to_string(size) + " bytes but the manifest says " + std::to_string(want) +
                     (size < want ? " (truncated)" : ""));
    }
    const auto sum = checksum_text(file_checksum(file));
    if (sum != entry.value("checksum", "")) {
      fail(file, "checksum mismatch: " + sum + " but the manifest says " + entry.value("checksum", "(none)") +
                     " (the file is corrupt)");
    }
  }
  return m.dump();
}

std::string latest_good(const std::string& root, std::vector<std::string>* skipped) {
  auto steps = list_steps(root);
  std::vector<std::string> why;
  // Newest first; the step `latest` names is tried first (it is the newest committed one).
  std::vector<std::string> candidates;
  const auto pointer = read_text(fs::join(root, "latest"));
  const auto named = pointer.substr(0, pointer.find_last_not_of(" \n") + 1);
  if (!named.empty()) candidates.push_back(fs::join(root, named));
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const auto dir = step_dir(root, *it);
    if (std::find(candidates.begin(), candidates.end(), dir) == candidates.end()) candidates.push_back(dir);
  }
  for (const auto& dir : candidates) {
    try {
      verify(dir);
      if (skipped != nullptr) *skipped = why;
      return dir;
    } catch (const CheckpointError& e) {
      why.push_back(e.what());
    }
  }
  std::string all;
  for (const auto& w : why) all += "\n  " + w;
  if (skipped != nullptr) *skipped = why;
  throw CheckpointError("no usable checkpoint under '" + root + "'" + (why.empty() ? " (none saved)" : ":" + all));
}

}  // namespace dtrain::checkpoint
