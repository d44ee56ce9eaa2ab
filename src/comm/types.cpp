// Names and parsing for the communication vocabulary.
#include "dtrain/comm/types.hpp"

#include "dtrain/core/error.hpp"

namespace dtrain {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::kSelf: return "self";
    case Backend::kMpi: return "mpi";
    case Backend::kNccl: return "nccl";
  }
  return "?";
}

double wire_bytes(OpKind kind, double bytes, int n) {
  if (n <= 1) return 0;
  switch (kind) {
    case OpKind::kAllReduce: return bytes * 2.0 * (n - 1) / n;
    case OpKind::kAllGather:
    case OpKind::kReduceScatter:
    case OpKind::kAllToAll: return bytes * (n - 1) / n;
    default: return bytes;
  }
}

const char* to_string(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSplit: return "split";
  }
  return "?";
}

ReduceOp parse_reduce_op(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "avg") return ReduceOp::kAvg;
  if (name == "max") return ReduceOp::kMax;
  if (name == "min") return ReduceOp::kMin;
  throw InvalidArgument(
      detail::str_cat("reduce op '", name, "' is not known; allowed: sum, avg, max, min"));
}

bool is_supported_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kBFloat16:
    case c10::kHalf:
    case c10::kInt:
    case c10::kLong:
    case c10::kByte:
      return true;
    default:
      return false;
  }
}

const char* supported_dtypes_text() {
  return "float32, float64, bfloat16, float16, int32, int64, uint8";
}

}  // namespace dtrain
