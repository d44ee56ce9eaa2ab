// Typed exceptions and the check macros behind every CUDA, NCCL and MPI call.
// A message names the failed statement, file:line and the process (rank/world, host),
// so a failure in a 64-rank job says where it happened without a debugger.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dtrain {

// Base of every exception dtrain throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};
// A caller passed an option, argument or input outside what is allowed.
class InvalidArgument : public Error { using Error::Error; };
// A communication backend failed (MPI, NCCL) or ranks disagree about a collective.
class CommError : public Error { using Error::Error; };
class MpiError : public CommError { using CommError::CommError; };
class NcclError : public CommError { using CommError::CommError; };
// A collective did not complete within its timeout.
class TimeoutError : public CommError { using CommError::CommError; };
class CudaError : public Error { using Error::Error; };

namespace detail {
// Process identity used in every error message: "rank 2/4 host node3" (set by the runtime).
void set_process_identity(int rank, int world_size);
std::string process_identity();

// Concatenates any streamable values.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// "<message> [<statement> at file:line, rank r/w host h]"
std::string located(const std::string& message, const char* statement, const char* file,
                    int line);

[[noreturn]] void throw_mpi(int code, const char* statement, const char* file, int line);
[[noreturn]] void throw_cuda(int code, const char* statement, const char* file, int line);
[[noreturn]] void throw_nccl(int code, const char* statement, const char* file, int line);
}  // namespace detail

}  // namespace dtrain

// The one generic check: throws ExcType with the message, statement and location.
#define DTRAIN_CHECK_T(ExcType, cond, ...)                                                  \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      throw ExcType(::dtrain::detail::located(::dtrain::detail::str_cat(__VA_ARGS__), #cond, \
                                              __FILE__, __LINE__));                         \
    }                                                                                       \
  } while (0)

#define DTRAIN_CHECK(cond, ...) DTRAIN_CHECK_T(::dtrain::Error, cond, __VA_ARGS__)
#define DTRAIN_CHECK_ARG(cond, ...) DTRAIN_CHECK_T(::dtrain::InvalidArgument, cond, __VA_ARGS__)

// MPI calls run with MPI_ERRORS_RETURN; a non-success code becomes an MpiError with
// MPI_Error_string's text.
#define DTRAIN_MPI_CHECK(stmt)                                                \
  do {                                                                        \
    int dtrain_mpi_rc_ = (stmt);                                              \
    if (dtrain_mpi_rc_ != 0) {                                                \
      ::dtrain::detail::throw_mpi(dtrain_mpi_rc_, #stmt, __FILE__, __LINE__); \
    }                                                                         \
  } while (0)

#define DTRAIN_CUDA_CHECK(stmt)                                                                \
  do {                                                                                         \
    int dtrain_cuda_rc_ = static_cast<int>(stmt);                                              \
    if (dtrain_cuda_rc_ != 0) {                                                                \
      ::dtrain::detail::throw_cuda(dtrain_cuda_rc_, #stmt, __FILE__, __LINE__);                \
    }                                                                                          \
  } while (0)

// NCCL errors carry the NCCL version and ncclGetLastError's detail.
#define DTRAIN_NCCL_CHECK(stmt)                                                \
  do {                                                                         \
    int dtrain_nccl_rc_ = static_cast<int>(stmt);                              \
    if (dtrain_nccl_rc_ != 0) {                                                \
      ::dtrain::detail::throw_nccl(dtrain_nccl_rc_, #stmt, __FILE__, __LINE__); \
    }                                                                          \
  } while (0)
