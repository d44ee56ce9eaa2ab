// Work helpers shared by all backends.
#include "dtrain/comm/work.hpp"

namespace dtrain {

WorkPtr make_completed_work(OpKind kind, std::uint64_t seq) {
  return std::make_shared<CompletedWork>(kind, seq);
}

}  // namespace dtrain
