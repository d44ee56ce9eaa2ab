// Small POSIX file-system helpers. dtrain does not use std::filesystem: the torch 2.11
// wheel's libtorch.so exports its own std::filesystem symbols, which interpose on
// libstdc++'s and crash (seen: std::filesystem::remove_all jumping to address 0).
#pragma once

#include <string>

namespace dtrain::fs {

// mkdir -p; raises InvalidArgument naming the path and the system error.
void make_directories(const std::string& path);
// rm -rf; a missing path is not an error.
void remove_tree(const std::string& path);
bool exists(const std::string& path);
// "a" + "b" -> "a/b" (no doubled separator).
std::string join(const std::string& a, const std::string& b);

}  // namespace dtrain::fs
