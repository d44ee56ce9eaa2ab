// The size-1 communicator: every collective is the identity (or a local copy between two
// buffers), so a mesh axis of size 1 costs nothing. Accepts tensors on any device.
#include <ATen/ATen.h>

#include "comm/peer_probe.hpp"
#include "dtrain/comm/communicator.hpp"
#include "dtrain/core/error.hpp"

namespace dtrain {

namespace {

class SelfCommunicator final : public Communicator {
 public:
  SelfCommunicator(const std::string& name, int world_rank, std::uint64_t uid, Timeout timeout)
      : Communicator(Backend::kSelf, name, 0, {world_rank}, uid, timeout) {}

 protected:
  void check_tensor_device(const at::Tensor&, const char*) const override {}

  WorkPtr do_all_reduce(const at::Tensor&, ReduceOp, std::uint64_t seq, Timeout) override {
    return make_completed_work(OpKind::kAllReduce, seq);  // sum/avg/max/min of one value
  }
  WorkPtr do_broadcast(const at::Tensor&, int, std::uint64_t seq, Timeout) override {
    return make_completed_work(OpKind::kBroadcast, seq);
  }
  WorkPtr do_all_gather(const at::Tensor& out, const at::Tensor& in, std::uint64_t seq,
                        Timeout) override {
    copy_if_distinct(out, in);
    return make_completed_work(OpKind::kAllGather, seq);
  }
  WorkPtr do_reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp,
                            std::uint64_t seq, Timeout) override {
    copy_if_distinct(out, in);
    return make_completed_work(OpKind::kReduceScatter, seq);
  }
  WorkPtr do_all_to_all(const at::Tensor& out, const at::Tensor& in,
                        const std::vector<std::int64_t>&, const std::vector<std::int64_t>&,
                        std::uint64_t seq, Timeout) override {
    copy_if_distinct(out, in);
    return make_completed_work(OpKind::kAllToAll, seq);
  }
  WorkPtr do_send(const at::Tensor&, int, int, Timeout) override {
    throw InvalidArgument("send on a size-1 communicator: there is no peer");  // unreachable
  }
  WorkPtr do_recv(const at::Tensor&, int, int, Timeout) override {
    throw InvalidArgument("recv on a size-1 communicator: there is no peer");  // unreachable
  }
  WorkPtr do_barrier(std::uint64_t seq, Timeout) override {
    return make_completed_work(OpKind::kBarrier, seq);
  }
  CommPtr do_split(int color, int, const std::string& name, std::uint64_t uid,
                   Timeout timeout) override {
    if (color < 0) return nullptr;
    return std::make_shared<SelfCommunicator>(name, world_ranks()[0], uid, timeout);
  }

 private:
  static void copy_if_distinct(const at::Tensor& out, const at::Tensor& in) {
    if (out.data_ptr() != in.data_ptr()) out.view({-1}).copy_(in.view({-1}));
  }
};

}  // namespace

CommPtr make_self_communicator(const std::string& name, int world_rank, std::uint64_t uid,
                               Timeout timeout) {
  return std::make_shared<SelfCommunicator>(name, world_rank,
                                            uid ? uid : detail::fnv1a(name), timeout);
}

}  // namespace dtrain
