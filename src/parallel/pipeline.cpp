// Pipeline runtime: the schedule's actions with point-to-point activation and gradient
// transfers (asynchronous sends, receives waited when needed; tag = chunk x direction).
#include "dtrain/parallel/pipeline.hpp"

#include <torch/torch.h>

#include <deque>
#include <limits>
#include <map>
#include <optional>

#include "dtrain/core/error.hpp"

namespace dtrain::pp {

PipelineRuntime::PipelineRuntime(std::vector<StageChunk> chunks, CommPtr pp, PipelineOptions options)
    : chunks_(std::move(chunks)), pp_(std::move(pp)), options_(std::move(options)) {
  DTRAIN_CHECK_ARG(pp_ != nullptr, "pipeline: no pp communicator");
  DTRAIN_CHECK_ARG(options_.shape.stages == pp_->size(), "pipeline: the schedule has ",
                   options_.shape.stages, " stages but the pp group has ", pp_->size(), " ranks");
  DTRAIN_CHECK_ARG(static_cast<int>(chunks_.size()) == options_.shape.virtual_stages, "pipeline: ",
                   chunks_.size(), " model chunks on this rank for --virtual-stages=",
                   options_.shape.virtual_stages);
  DTRAIN_CHECK_ARG(options_.activation_shape.size() == 3, "pipeline: activation shape must be "
                   "[micro, seq, d]");
  schedule_ = make_schedule(options_.schedule, options_.shape);
  if (pp_->backend() == Backend::kNccl) {  // messages pair up by order, not by tag
    const auto order = check_message_order(schedule_, options_.shape);
    DTRAIN_CHECK_ARG(order.empty(), "pipeline: --pp-schedule ", to_string(options_.schedule), " with --pp ",
                     options_.shape.stages, ", --microbatches ", options_.shape.microbatches,
                     ", --virtual-stages ", options_.shape.virtual_stages, " cannot run over NCCL, which ",
                     "pairs messages by order: ", order, "; allowed: another schedule or shape");
  }
}

// Point-to-point messages between virtual stages. A message is tagged with its sender's
// chunk and direction; both ends know the sender (forward: virtual stage g - 1, backward:
// g + 1). Messages to this rank itself (one rank holding consecutive virtual stages, p = 1)
// go through a local queue. A send is held until the next receive and issued with it in
// one batch (Communicator::batch_p2p: on NCCL one group, so two neighbours that each send
// and then receive cannot wait on each other), or issued alone by flush() when the next
// action receives nothing. Sends are waited by finish().
struct PipelineRuntime::Transport {
  Transport(PipelineRuntime& rt, const at::TensorOptions& opts) : rt(rt), opts(opts) {}
  int tag(int sender_stage, bool backward) const {
    return 2 * (sender_stage / rt.options_.shape.stages) + (backward ? 1 : 0);
  }
  bool local(int stage) const { return stage % rt.options_.shape.stages == rt.pp_->rank(); }
  void send(const at::Tensor& t, int to_stage, int t_tag) {
    auto c = t.detach().contiguous();
    if (local(to_stage)) {
      local_queue[t_tag].push_back(c);
    } else {
      pending.push_back({P2POp::Kind::kSend, c, to_stage % rt.options_.shape.stages, t_tag});
    }
  }
  void flush() {
    if (pending.empty()) return;
    auto s = trace::span(rt.options_.trace, "send", "pp", trace::Track::kComm,
                         {{"to_rank", pending.front().peer}, {"sends", static_cast<std::int64_t>(pending.size())}});
    for (auto& w : rt.pp_->batch_p2p(pending)) sends.push_back(std::move(w));
    pending.clear();
  }
  at::Tensor recv(int from_stage, int t_tag) {
    if (local(from_stage)) {
      flush();
      auto& q = local_queue[t_tag];
      DTRAIN_CHECK(!q.empty(), "pipeline: stage ", rt.pp_->rank(),
                   " expects a message from itself that was not sent");
      auto t = q.front();
      q.pop_front();
      return t;
    }
    auto t = at::empty(rt.options_.activation_shape, opts);
    auto s = trace::span(rt.options_.trace, "recv", "pp", trace::Track::kComm,
                         {{"from_stage", from_stage}, {"sends", static_cast<std::int64_t>(pending.size())}});
    auto ops = std::move(pending);
    pending.clear();
    ops.push_back({P2POp::Kind::kRecv, t, from_stage % rt.options_.shape.stages, t_tag});
    auto works = rt.pp_->batch_p2p(ops);
    for (std::size_t i = 0; i + 1 < works.size(); ++i) sends.push_back(std::move(works[i]));
    works.back()->wait();
    return t;
  }
  void finish() {
    flush();
    auto s = trace::span(rt.options_.trace, "send-wait", "pp", trace::Track::kComm);
    for (auto& w : sends) w->wait();
    sends.clear();
  }
  PipelineRuntime& rt;
  at::TensorOptions opts;
  std::vector<P2POp> pending;
  std::vector<WorkPtr> sends;
  std::map<int, std::deque<at::Tensor>> local_queue;
};

namespace {
// Micro-batch i's factor in the step's loss (run's weights).
double loss_weight(const std::vector<double>& weights, int i, int m) {
  return weights.empty() ? 1.0 / m : weights[static_cast<std::size_t>(i)];
}
void check_weights(const std::vector<double>& weights, int m) {
  DTRAIN_CHECK_ARG(weights.empty() || weights.size() == static_cast<std::size_t>(m), "pipeline: ", weights.size(),
                   " loss weights for ", m, " micro-batches; allowed: none (1/m each) or one per micro-batch");
}
at::TensorOptions activation_options(const PipelineOptions& o, const at::Tensor& inputs) {
  return at::TensorOptions().dtype(o.activation_dtype).device(
      inputs.defined() ? inputs.device() : at::Device(at::kCPU));
}
}  // namespace

double PipelineRuntime::forward_only(const at::Tensor& inputs, const at::Tensor& targets,
                                     const std::vector<double>& weights) {
  torch::NoGradGuard no_grad;
  const int p = options_.shape.stages, v = options_.shape.virtual_stages, m = options_.shape.microbatches;
  check_weights(weights, m);
  const int rank = pp_->rank(), last = p * v - 1;
  const std::int64_t micro = options_.activation_shape[0];
  Transport io(*this, activation_options(options_, inputs));
  double loss_sum = 0;
  for (int i = 0; i < m; ++i) {
    for (int c = 0; c < v; ++c) {
      const int g = virtual_stage(rank, c, p);
      auto& chunk = chunks_[static_cast<std::size_t>(c)];
      const auto x = g == 0 ? inputs.narrow(0, micro * i, micro) : io.recv(g - 1, io.tag(g - 1, false));
      if (chunk.before_forward) chunk.before_forward(inputs.defined() ? inputs.narrow(0, micro * i, micro) : at::Tensor());
      const auto y = chunk.forward(x);
      if (g == last) {
        const double weight = loss_weight(weights, i, m);
        if (chunk.before_loss) chunk.before_loss(weight);
        const double loss = chunk.loss(y, targets.narrow(0, micro * i, micro)).item<double>();
        if (weight > 0) loss_sum += loss * weight;  // weight 0: no loss tokens, a mean of 0/0
      } else {
        io.send(y, g + 1, io.tag(g, false));
        io.flush();
      }
    }
  }
  io.finish();
  return rank == loss_rank() ? loss_sum : std::numeric_limits<double>::quiet_NaN();
}

double PipelineRuntime::run(const at::Tensor& inputs, const at::Tensor& targets, const std::vector<double>& weights) {
  const int p = options_.shape.stages, v = options_.shape.virtual_stages, m = options_.shape.microbatches;
  check_weights(weights, m);
  const int rank = pp_->rank(), last = p * v - 1;
  const std::int64_t micro = options_.activation_shape[0];
  struct Live {
    at::Tensor input, output, loss, output_grad;
  };
  std::map<std::pair<int, int>, Live> live;  // (micro-batch, chunk)
  Transport io(*this, activation_options(options_, inputs));
  auto tag = [&](int sender_stage, bool backward) { return io.tag(sender_stage, backward); };
  auto send = [&](const at::Tensor& t, int to_stage, int t_tag) { io.send(t, to_stage, t_tag); };
  auto recv = [&](int from_stage, int t_tag) { return io.recv(from_stage, t_tag); };
  double loss_sum = 0;
  const auto& actions = schedule_[static_cast<std::size_t>(rank)];
  // Whether an action starts by receiving from another rank (its input or output gradient).
  auto receives_remotely = [&](const Action& a) {
    const int g = virtual_stage(rank, a.chunk, p);
    if (a.op == Op::kForward) return g > 0 && !io.local(g - 1);
    return a.op != Op::kBackwardWeight && g != last && !io.local(g + 1);
  };
  std::vector<int> weight_grads_done(chunks_.size(), 0);  // per chunk: B or W actions run
  for (const auto& a : actions) {
    // Sends of the previous action wait for this one's receive (one batch) unless it has none.
    if (!receives_remotely(a)) io.flush();
    if (a.op == Op::kBackward || a.op == Op::kBackwardWeight) {
      const auto& hook = chunks_[static_cast<std::size_t>(a.chunk)].before_weight_grads;
      if (hook) hook(++weight_grads_done[static_cast<std::size_t>(a.chunk)] == m);
    }
    const int g = virtual_stage(rank, a.chunk, p);
    auto& chunk = chunks_[static_cast<std::size_t>(a.chunk)];
    auto& st = live[{a.microbatch, a.chunk}];
    // The action's compute span (receives before it and sends after it are their own).
    std::optional<trace::Recorder::Span> span;
    auto compute = [&] {
      span.emplace(options_.trace, to_string(a.op), "pp", trace::Track::kCompute,
                   std::vector<std::pair<std::string, std::int64_t>>{
                       {"microbatch", a.microbatch}, {"chunk", a.chunk}, {"stage", g}});
    };
    if (a.op == Op::kForward) {
      st.input = g == 0 ? inputs.narrow(0, micro * a.microbatch, micro)
                        : recv(g - 1, tag(g - 1, false)).requires_grad_(true);
      compute();
      if (chunk.before_forward) {
        chunk.before_forward(inputs.defined() ? inputs.narrow(0, micro * a.microbatch, micro) : at::Tensor());
      }
      st.output = chunk.forward(st.input);
      if (g == last) {
        const double weight = loss_weight(weights, a.microbatch, m);
        if (chunk.before_loss) chunk.before_loss(weight);
        const auto loss = chunk.loss(st.output, targets.narrow(0, micro * a.microbatch, micro));
        st.loss = weights.empty() ? loss / m : loss * weight;
        if (weight > 0) loss_sum += st.loss.item<double>();  // weight 0: no loss tokens, a mean of 0/0
        span.reset();
      } else {
        span.reset();
        send(st.output, g + 1, tag(g, false));
      }
      continue;
    }
    if (a.op != Op::kBackwardWeight && g != last) st.output_grad = recv(g + 1, tag(g + 1, true));
    compute();
    const at::Tensor target = g == last ? st.loss : st.output;
    const std::vector<at::Tensor> seed =
        g == last ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{st.output_grad};
    if (a.op == Op::kBackward) {
      torch::autograd::backward({target}, seed);
      span.reset();
      if (g > 0) send(st.input.grad(), g - 1, tag(g, true));
      live.erase({a.microbatch, a.chunk});
    } else if (a.op == Op::kBackwardInput) {
      // The input gradient now (the previous stage waits for it); the graph stays for W.
      if (g > 0) {
        auto grads = torch::autograd::grad({target}, {st.input}, seed, /*retain_graph=*/true);
        span.reset();
        send(grads[0], g - 1, tag(g, true));
      }
    } else {  // W: the parameters' gradients, from the graph Bi kept
      torch::autograd::backward({target}, seed, /*retain_graph=*/false, /*create_graph=*/false,
                                chunk.parameters);
      live.erase({a.microbatch, a.chunk});
    }
  }
  io.finish();
  return rank == loss_rank() ? loss_sum : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace dtrain::pp
