// DTRAIN_* environment variables: lookup and validation.
#include "dtrain/core/env.hpp"

#include <cstdlib>

#include "dtrain/core/error.hpp"

namespace dtrain::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool parse_bool(const char* name, const std::string& value) {
  if (value == "1" || value == "true" || value == "on" || value == "yes") return true;
  if (value == "0" || value == "false" || value == "off" || value == "no") return false;
  throw InvalidArgument(detail::str_cat(name, "='", value,
                                        "' is not a boolean; allowed: 1/0, true/false, on/off, "
                                        "yes/no"));
}

double parse_positive_seconds(const char* name, const std::string& value) {
  double s = 0;
  std::size_t used = 0;
  try {
    s = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || !(s > 0)) {
    throw InvalidArgument(detail::str_cat(name, "='", value,
                                          "' is not a positive number of seconds (e.g. 600, "
                                          "0.5)"));
  }
  return s;
}

std::chrono::milliseconds comm_timeout() {
  auto v = get(kCommTimeoutS);
  const double s = v ? parse_positive_seconds(kCommTimeoutS, *v) : 600.0;
  return std::chrono::milliseconds(static_cast<long long>(s * 1000.0));
}

bool comm_check() {
  auto v = get(kCommCheck);
  return v ? parse_bool(kCommCheck, *v) : false;
}

std::string log_level() { return get(kLogLevel).value_or(""); }

bool log_all_ranks() {
  auto v = get(kLogAllRanks);
  return v ? parse_bool(kLogAllRanks, *v) : false;
}

std::string attention_kernel() {
  const std::string v = get(kAttentionKernel).value_or("auto");
  if (v != "auto" && v != "mma" && v != "wgmma") {
    throw InvalidArgument(detail::str_cat(kAttentionKernel, "='", v, "' is not a kernel; allowed: auto, mma, wgmma"));
  }
  return v;
}

ScopedOverride::ScopedOverride(const char* name, const std::string& value) : name_(name) {
  if (const char* v = std::getenv(name)) old_ = v;
  ::setenv(name, value.c_str(), 1);
}

ScopedOverride::~ScopedOverride() {
  if (old_) {
    ::setenv(name_, old_->c_str(), 1);
  } else {
    ::unsetenv(name_);
  }
}

}  // namespace dtrain::env
