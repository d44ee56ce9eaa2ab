// The dtrain log: rank in every line; rank 0 logs at info, other ranks at warn, unless
// DTRAIN_LOG_LEVEL / DTRAIN_LOG_ALL_RANKS say otherwise. Backed by spdlog in one
// translation unit (LibTorch bundles a newer fmt than Debian's spdlog accepts, so spdlog
// never meets torch headers); callers format with "{}" placeholders.
#pragma once

#include <sstream>
#include <string>
#include <string_view>

namespace dtrain {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kOff };

// Replaces each "{}" in pattern by the next argument (streamed with operator<<).
template <typename... Args>
std::string format(std::string_view pattern, const Args&... args) {
  std::ostringstream os;
  std::size_t pos = 0;
  [[maybe_unused]] auto emit = [&](const auto& arg) {
    const std::size_t at = pattern.find("{}", pos);
    if (at == std::string_view::npos) return;
    os << pattern.substr(pos, at - pos) << arg;
    pos = at + 2;
  };
  (emit(args), ...);
  os << pattern.substr(pos);
  return os.str();
}

bool log_enabled(LogLevel level);
void log_message(LogLevel level, const std::string& message);

template <typename... Args>
void log_debug(std::string_view pattern, const Args&... args) {
  if (log_enabled(LogLevel::kDebug)) log_message(LogLevel::kDebug, format(pattern, args...));
}
template <typename... Args>
void log_info(std::string_view pattern, const Args&... args) {
  if (log_enabled(LogLevel::kInfo)) log_message(LogLevel::kInfo, format(pattern, args...));
}
template <typename... Args>
void log_warn(std::string_view pattern, const Args&... args) {
  if (log_enabled(LogLevel::kWarn)) log_message(LogLevel::kWarn, format(pattern, args...));
}
template <typename... Args>
void log_error(std::string_view pattern, const Args&... args) {
  if (log_enabled(LogLevel::kError)) log_message(LogLevel::kError, format(pattern, args...));
}

// Sets the pattern "[time] [dtrain r<rank>/<world>] [level] msg" and the level by rank.
// Raises InvalidArgument for a bad DTRAIN_LOG_LEVEL.
void init_logging(int rank, int world_size);

// Logs a warning once per distinct key for the life of the process.
void warn_once(const std::string& key, const std::string& message);

}  // namespace dtrain
