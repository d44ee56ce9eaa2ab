// Every DTRAIN_* environment variable, declared once with its default and parsed with a
// clear error for bad values. Launcher variables (OMPI_*, SLURM_*, RANK...) live in
// comm/launch_env.hpp.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace dtrain::env {

// Names, for messages and docs.
inline constexpr const char* kCommTimeoutS = "DTRAIN_COMM_TIMEOUT_S";  // default 600
inline constexpr const char* kCommCheck = "DTRAIN_COMM_CHECK";         // 0/1, default 0
inline constexpr const char* kLogLevel = "DTRAIN_LOG_LEVEL";  // trace|debug|info|warn|error
inline constexpr const char* kLogAllRanks = "DTRAIN_LOG_ALL_RANKS";  // 0/1, default 0
// Which flash attention kernel the CUDA op runs: auto (wgmma on Hopper, else mma.sync),
// mma or wgmma. For comparing kernels and for keeping to mma.sync if wgmma misbehaves.
inline constexpr const char* kAttentionKernel = "DTRAIN_ATTENTION_KERNEL";  // default auto
// Fault injection (tests): world rank DTRAIN_FAULT_KILL_RANK kills itself when step
// DTRAIN_FAULT_AT_STEP begins, unless DTRAIN_RESTART_COUNT (set by dtrain-run on each
// relaunch) is above 0.
inline constexpr const char* kFaultKillRank = "DTRAIN_FAULT_KILL_RANK";
inline constexpr const char* kFaultAtStep = "DTRAIN_FAULT_AT_STEP";
inline constexpr const char* kRestartCount = "DTRAIN_RESTART_COUNT";

// Raw value, or nullopt when unset or empty.
std::optional<std::string> get(const char* name);

// Parsers shared by the accessors below; they throw InvalidArgument naming the variable,
// the value and what is allowed.
bool parse_bool(const char* name, const std::string& value);
double parse_positive_seconds(const char* name, const std::string& value);

// Collective timeout (DTRAIN_COMM_TIMEOUT_S, default 10 minutes).
std::chrono::milliseconds comm_timeout();
// Cross-check (op, dtype, numel, seq) across ranks before every collective.
bool comm_check();
// Log level name; empty when unset (the logger then picks by rank).
std::string log_level();
bool log_all_ranks();
// DTRAIN_ATTENTION_KERNEL: "auto" (also when unset), "mma" or "wgmma".
std::string attention_kernel();

// Sets a variable for the life of the object, then restores what was there: for tests and
// benchmarks that compare settings in one process. Not thread-safe (setenv is not).
class ScopedOverride {
 public:
  ScopedOverride(const char* name, const std::string& value);
  ~ScopedOverride();
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace dtrain::env
