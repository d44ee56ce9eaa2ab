// Vocabulary of the communication layer: reduce ops, backends, collective kinds and the
// per-call options structs (c10d style: defaults for everything, one struct per family).
#pragma once

#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

enum class ReduceOp : std::uint8_t { kSum, kAvg, kMax, kMin };
enum class Backend : std::uint8_t { kSelf, kMpi, kNccl };
enum class OpKind : std::uint8_t {
  kAllReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kSend,
  kRecv,
  kBarrier,
  kSplit,
};

const char* to_string(ReduceOp op);
const char* to_string(Backend backend);
const char* to_string(OpKind kind);
// Parses "sum", "avg", "max", "min"; throws InvalidArgument naming the allowed values.
ReduceOp parse_reduce_op(const std::string& name);

// dtypes every backend accepts: float32, float64, bfloat16, float16, int32, int64, uint8.
bool is_supported_dtype(c10::ScalarType dtype);
const char* supported_dtypes_text();

// 0 means "the communicator's default" (DTRAIN_COMM_TIMEOUT_S unless set at creation).
using Timeout = std::chrono::milliseconds;

struct CollectiveOptions {
  Timeout timeout{0};
};
struct ReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  Timeout timeout{0};
};
struct BroadcastOptions {
  int root = 0;
  Timeout timeout{0};
};
// Uneven all-to-all: rows (along dim 0) sent to / received from each rank. Empty means
// equal splits (dim 0 divided by the communicator size).
struct AllToAllOptions {
  std::vector<std::int64_t> output_splits;
  std::vector<std::int64_t> input_splits;
  Timeout timeout{0};
};
struct P2POptions {
  int tag = 0;
  Timeout timeout{0};
};

// Bytes each rank sends in a bandwidth-optimal (ring) algorithm for a collective over n
// ranks whose full buffer has `bytes` (all-reduce: 2(n-1)/n; all-gather output and
// reduce-scatter input: (n-1)/n; broadcast: 1; n = 1: 0). nccl-tests' "bus bytes";
// strategies report their traffic with it.
double wire_bytes(OpKind kind, double bytes, int n);

}  // namespace dtrain
