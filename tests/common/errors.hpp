// The message of an expected InvalidArgument, for tests that check what an error names.
#pragma once

#include <functional>
#include <string>

#include "dtrain/core/error.hpp"

namespace dtrain::testing {

// The message of the InvalidArgument that f raises, or "(no error)".
inline std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace dtrain::testing
