// The message of an expected error (InvalidArgument by default), for tests that check what
// an error names.
#pragma once

#include <functional>
#include <string>

#include "dtrain/core/error.hpp"

namespace dtrain::testing {

// The message of the E that f raises, or "(no error)".
template <typename E = InvalidArgument>
std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace dtrain::testing
