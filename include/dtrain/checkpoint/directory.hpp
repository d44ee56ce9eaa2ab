// The checkpoint directory layout and its atomic update: <root>/step_<N>/ holds the ranks'
// files and manifest.json; a save goes to <root>/.step_<N>.tmp/ and becomes step_<N> by a
// rename after everything is fsynced; <root>/latest names the newest step and is replaced
// last. An interrupted save leaves the previous checkpoint loadable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::checkpoint {

// "<root>/step_<step>" and its staging directory "<root>/.step_<step>.tmp".
std::string step_dir(const std::string& root, std::int64_t step);
std::string staging_dir(const std::string& root, std::int64_t step);

// Creates an empty staging directory for `step` (removing a stale one from an interrupted
// save) and returns it; the ranks write their files into it. One rank calls it, the
// others wait (a barrier) before writing.
std::string begin_save(const std::string& root, std::int64_t step);

// One rank, after every rank's files are in the staging directory: writes manifest.json
// there: the JSON object `manifest` (text; "{}" for none) completed with "format", "version", "step" and "files" (name ->
// {"bytes", "checksum"}, from `files`: name, size and checksum of each written file), fsyncs
// the directory, renames it to step_<step> (replacing an older one of the same step),
// points `latest` at it and removes all but the newest keep_last steps (0: keep all).
// CheckpointError (naming the path) on any failure; the previous checkpoint stays intact.
struct FileRecord {
  std::string name;
  std::int64_t bytes = 0;
  std::uint64_t checksum = 0;
};
void commit_save(const std::string& root, std::int64_t step, const std::string& manifest,
                 const std::vector<FileRecord>& files, int keep_last = 0);

// Steps that have a step_<N> directory under root, ascending (staging directories and
// anything else ignored). An absent root has none.
std::vector<std::int64_t> list_steps(const std::string& root);

// The manifest (JSON text) of a checkpoint directory after checking it: it parses, names
// this format, and every file it lists exists with its size and checksum. CheckpointError
// naming the file and the problem otherwise (missing, truncated, checksum mismatch,
// malformed).
std::string verify(const std::string& dir);

// The newest step directory under root that verifies, starting from the one `latest`
// names; every newer or named one that fails is reported in `skipped` ("<dir>: <error>").
// CheckpointError when none verifies (or root has none), listing why.
std::string latest_good(const std::string& root, std::vector<std::string>* skipped = nullptr);

}  // namespace dtrain::checkpoint
