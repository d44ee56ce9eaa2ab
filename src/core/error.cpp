// Error formatting and the backend-specific throw helpers behind the check macros.
#include "dtrain/core/error.hpp"

#include <unistd.h>

#include <mutex>

#ifdef DTRAIN_WITH_MPI
#include <mpi.h>
#endif
#ifdef DTRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace dtrain::detail {

namespace {
std::mutex g_identity_mutex;
std::string g_identity;  // empty until the runtime knows the rank

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}
}  // namespace

void set_process_identity(int rank, int world_size) {
  std::lock_guard<std::mutex> lock(g_identity_mutex);
  g_identity = str_cat("rank ", rank, "/", world_size, " host ", host_name());
}

std::string process_identity() {
  std::lock_guard<std::mutex> lock(g_identity_mutex);
  return g_identity.empty() ? str_cat("host ", host_name()) : g_identity;
}

std::string located(const std::string& message, const char* statement, const char* file,
                    int line) {
  return str_cat(message, " [", statement, " at ", file, ":", line, ", ", process_identity(),
                 "]");
}

void throw_mpi(int code, const char* statement, const char* file, int line) {
#ifdef DTRAIN_WITH_MPI
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) std::snprintf(text, sizeof(text), "?");
  throw MpiError(located(str_cat("MPI error ", code, ": ", text), statement, file, line));
#else
  throw MpiError(located(str_cat("MPI error ", code), statement, file, line));
#endif
}

void throw_cuda(int code, const char* statement, const char* file, int line) {
#ifdef DTRAIN_WITH_CUDA
  const char* text = cudaGetErrorString(static_cast<cudaError_t>(code));
  throw CudaError(located(str_cat("CUDA error ", code, ": ", text), statement, file, line));
#else
  throw CudaError(located(str_cat("CUDA error ", code), statement, file, line));
#endif
}

void throw_nccl(int code, const char* statement, const char* file, int line) {
#ifdef DTRAIN_WITH_CUDA
  const auto r = static_cast<ncclResult_t>(code);
  const char* last = ncclGetLastError(nullptr);
  throw NcclError(located(str_cat("NCCL error ", code, " (", ncclGetErrorString(r), ", NCCL ",
                                  NCCL_MAJOR, ".", NCCL_MINOR, ".", NCCL_PATCH, "): ",
                                  (last && *last) ? last : "no further detail"),
                          statement, file, line));
#else
  throw NcclError(located(str_cat("NCCL error ", code), statement, file, line));
#endif
}

}  // namespace dtrain::detail
