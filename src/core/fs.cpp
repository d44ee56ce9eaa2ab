// POSIX implementations of the file-system helpers (see fs.hpp for why not std::filesystem).
#include "dtrain/core/fs.hpp"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "dtrain/core/error.hpp"

namespace dtrain::fs {

void make_directories(const std::string& path) {
  DTRAIN_CHECK_ARG(!path.empty(), "directory path is empty");
  std::string prefix;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    prefix = path.substr(0, pos);
    if (prefix.empty() || exists(prefix)) continue;
    DTRAIN_CHECK_ARG(::mkdir(prefix.c_str(), 0755) == 0 || errno == EEXIST, "directory '",
                     prefix, "' cannot be created: ", std::strerror(errno));
  }
  struct stat st {};
  DTRAIN_CHECK_ARG(::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "'", path,
                   "' exists but is not a directory");
}

void remove_tree(const std::string& path) {
  if (!exists(path)) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return std::remove(p); };
  DTRAIN_CHECK_ARG(::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) == 0, "'", path,
                   "' cannot be removed: ", std::strerror(errno));
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

}  // namespace dtrain::fs
