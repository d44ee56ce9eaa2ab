// spdlog set-up: one stderr logger, rank in the pattern, level by rank and environment.
// Compiled without LibTorch on the include path (see logging.hpp).
#include "dtrain/core/logging.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <mutex>
#include <set>

#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"

namespace dtrain {

namespace {
spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto made = std::make_shared<spdlog::logger>(
        "dtrain", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    made->set_pattern("[%H:%M:%S.%e] [dtrain] [%^%l%$] %v");
    made->set_level(spdlog::level::info);
    return made;
  }();
  return *l;
}

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return spdlog::level::trace;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}
}  // namespace

bool log_enabled(LogLevel level) { return logger().should_log(to_spdlog(level)); }

void log_message(LogLevel level, const std::string& message) {
  logger().log(to_spdlog(level), "{}", message);
}

void init_logging(int rank, int world_size) {
  auto& l = logger();
  l.set_pattern(detail::str_cat("[%H:%M:%S.%e] [dtrain r", rank, "/", world_size,
                                "] [%^%l%$] %v"));
  const bool all_ranks = env::log_all_ranks();
  spdlog::level::level_enum lvl =
      (rank == 0 || all_ranks) ? spdlog::level::info : spdlog::level::warn;
  const std::string name = env::log_level();
  if (!name.empty()) {
    lvl = spdlog::level::from_str(name);
    if (lvl == spdlog::level::off && name != "off") {
      throw InvalidArgument(detail::str_cat(env::kLogLevel, "='", name,
                                            "' is not a log level; allowed: trace, debug, "
                                            "info, warn, error, critical, off"));
    }
    if (rank != 0 && !all_ranks && lvl < spdlog::level::warn) lvl = spdlog::level::warn;
  }
  l.set_level(lvl);
}

void warn_once(const std::string& key, const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!seen.insert(key).second) return;
  }
  log_message(LogLevel::kWarn, message);
}

}  // namespace dtrain
