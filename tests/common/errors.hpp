// The message of an expected error (InvalidArgument by default), and the check that it
// names what it should, for tests of what an error says.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

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

// Every part appears in text.
inline void expect_has(const std::string& text, const std::vector<std::string>& parts) {
  for (const auto& part : parts) EXPECT_NE(text.find(part), std::string::npos) << "'" << text << "' lacks '" << part << "'";
}

}  // namespace dtrain::testing
