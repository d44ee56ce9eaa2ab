// Router, capacity, auxiliary losses and the autograd-aware token exchange of expert
// parallelism.
#include "dtrain/parallel/expert_parallel.hpp"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <numeric>

#include "dtrain/core/error.hpp"

namespace dtrain::ep {

void MoeOptions::validate() const {
  DTRAIN_CHECK_ARG(experts >= 0, "--moe-experts=", experts, " must be >= 0 (0: a dense model)");
  if (!enabled()) return;
  DTRAIN_CHECK_ARG(topk >= 1 && topk <= experts, "--moe-topk=", topk,
                   " is not allowed with --moe-experts ", experts, "; allowed: 1..", experts);
  DTRAIN_CHECK_ARG(every >= 1, "--moe-every=", every, " must be at least 1");
  DTRAIN_CHECK_ARG(ffn_hidden >= 0, "--moe-ffn-hidden=", ffn_hidden, " must be >= 0 (0: the MLP width)");
  DTRAIN_CHECK_ARG(capacity_factor >= 0 && std::isfinite(capacity_factor), "--moe-capacity=",
                   capacity_factor, " must be a finite factor >= 0 (0: dropless)");
  DTRAIN_CHECK_ARG(score == "softmax" || score == "sigmoid", "--moe-score '", score,
                   "' is not known; allowed: softmax, sigmoid");
  DTRAIN_CHECK_ARG(aux_loss_coeff >= 0 && z_loss_coeff >= 0 && bias_update_rate >= 0,
                   "--moe-aux-coeff, --moe-z-coeff and --moe-bias-rate must be >= 0 (got ",
                   aux_loss_coeff, ", ", z_loss_coeff, ", ", bias_update_rate, ")");
}

void MoeOptions::validate_ep(int ep) const {
  DTRAIN_CHECK_ARG(ep >= 1, "--ep=", ep, " must be at least 1");
  if (ep == 1) return;
  DTRAIN_CHECK_ARG(enabled(), "--ep=", ep, " needs a MoE model (--moe-experts E); allowed: --ep 1");
  DTRAIN_CHECK_ARG(experts % ep == 0, "--moe-experts=", experts, " is not divisible by --ep=", ep,
                   "; each ep rank holds experts / ep experts");
}

// ---------------------------------------------------------------------------------------
// Router

std::int64_t capacity(std::int64_t tokens, const MoeOptions& o) {
  if (o.capacity_factor <= 0) return -1;
  const double c = std::ceil(o.capacity_factor * static_cast<double>(tokens * o.topk) /
                             static_cast<double>(o.experts));
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(c));
}

at::Tensor capacity_mask(const at::Tensor& experts, std::int64_t num_experts, std::int64_t cap) {
  const auto N = experts.size(0), k = experts.size(1);
  // Slot-major: every token's first choice, then every second choice, ...
  const auto flat = experts.t().reshape({-1});
  const auto onehot = torch::one_hot(flat, num_experts);             // [k N, E]
  const auto position = (onehot.cumsum(0) * onehot).sum(1) - 1;      // within its expert
  return (position < cap).view({k, N}).t().contiguous();
}

at::Tensor load_balancing_loss(const at::Tensor& probs, const at::Tensor& experts,
                               std::int64_t num_experts, const CommPtr& sequence) {
  const auto N = experts.size(0), k = experts.size(1);
  auto counts = torch::zeros({num_experts}, probs.options());
  counts.index_add_(0, experts.reshape({-1}), torch::ones({N * k}, probs.options()));
  const int ranks = sequence ? sequence->size() : 1;
  if (ranks > 1) sequence->all_reduce(counts)->wait();  // no gradient: counts are constants
  const auto f = counts / static_cast<double>(N * k * ranks);
  return static_cast<double>(num_experts) * (f * probs.mean(0)).sum();
}

at::Tensor z_loss(const at::Tensor& logits) {
  return torch::logsumexp(logits, -1).pow(2).mean();
}

Routing route(const at::Tensor& logits, const at::Tensor& bias, const MoeOptions& o, const CommPtr& sequence) {
  DTRAIN_CHECK_ARG(logits.dim() == 2 && logits.size(1) == o.experts, "router logits must be [tokens, ",
                   o.experts, "]; got ", logits.sizes());
  const auto E = o.experts;
  const auto logits32 = logits.to(torch::kFloat);
  Routing r;
  const bool sigmoid = o.score == "sigmoid";
  const auto scores = sigmoid ? torch::sigmoid(logits32) : torch::softmax(logits32, -1);
  auto selection = scores.detach();
  if (bias.defined()) selection = selection + bias.to(selection.options());
  r.experts = std::get<1>(selection.topk(o.topk, -1));
  r.weights = scores.gather(1, r.experts);
  if (o.topk > 1) r.weights = r.weights / r.weights.sum(-1, true);
  r.probs = sigmoid ? scores / scores.sum(-1, true) : scores;
  r.counts = torch::zeros({E}, r.experts.options());
  r.counts.index_add_(0, r.experts.reshape({-1}), torch::ones_like(r.experts.reshape({-1})));
  const auto zero = torch::zeros({}, logits32.options());
  r.aux_loss =
      o.aux_loss_coeff > 0 ? o.aux_loss_coeff * load_balancing_loss(r.probs, r.experts, E, sequence) : zero;
  r.z_loss = o.z_loss_coeff > 0 ? o.z_loss_coeff * z_loss(logits32) : zero;
  const auto cap = capacity(logits.size(0), o);
  r.kept = cap < 0 ? torch::ones_like(r.experts, torch::kBool) : capacity_mask(r.experts, E, cap);
  return r;
}

// ---------------------------------------------------------------------------------------
// Autograd helpers

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AttachLoss : public torch::autograd::Function<AttachLoss> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, at::Tensor loss, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["loss_options"] = torch::empty({0}, loss.options());
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto like = ctx->saved_data["loss_options"].toTensor();
    return {grads[0], torch::full({}, ctx->saved_data["scale"].toDouble(), like.options()), at::Tensor()};
  }
};

struct ScaleGrad : public torch::autograd::Function<ScaleGrad> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, double scale) {
    ctx->saved_data["scale"] = scale;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0] * ctx->saved_data["scale"].toDouble(), at::Tensor()};
  }
};

CommStats g_stats;

// The exchange itself, counted: rows to other ranks are what goes over the wire.
at::Tensor exchange(const at::Tensor& x, Communicator& comm, const std::vector<std::int64_t>& send,
                    const std::vector<std::int64_t>& recv) {
  const auto t0 = std::chrono::steady_clock::now();
  auto in = x.contiguous();
  auto shape = in.sizes().vec();
  shape[0] = std::accumulate(recv.begin(), recv.end(), std::int64_t{0});
  auto out = torch::empty(shape, in.options());
  AllToAllOptions opts;
  opts.input_splits = send;
  opts.output_splits = recv;
  comm.all_to_all(out, in, opts)->wait();
  const std::int64_t row_bytes = in.dim() == 0 ? 0 : static_cast<std::int64_t>(in.element_size()) *
                                                       (in.size(0) > 0 ? in.numel() / in.size(0) : 0);
  std::int64_t sent = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (r != comm.rank()) sent += send[static_cast<std::size_t>(r)];
  }
  g_stats.bytes += static_cast<double>(sent * row_bytes);
  ++g_stats.calls;
  g_stats.ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

struct AllToAll : public torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, std::int64_t comm,
                            std::vector<std::int64_t> send, std::vector<std::int64_t> recv) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return exchange(x, *reinterpret_cast<Communicator*>(comm), send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& comm = *reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const auto send = ctx->saved_data["send"].toIntVector();
    const auto recv = ctx->saved_data["recv"].toIntVector();
    return {exchange(grads[0], comm, recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor attach_loss(const at::Tensor& x, const at::Tensor& loss, double scale) {
  return AttachLoss::apply(x, loss, scale);
}

at::Tensor scale_grad(const at::Tensor& x, double scale) { return ScaleGrad::apply(x, scale); }

at::Tensor all_to_all(const at::Tensor& x, const CommPtr& comm, std::vector<std::int64_t> send_rows,
                      std::vector<std::int64_t> recv_rows) {
  const auto n = static_cast<std::size_t>(comm->size());
  DTRAIN_CHECK_ARG(send_rows.size() == n && recv_rows.size() == n, "ep::all_to_all needs one send and one ",
                   "receive row count per rank (", n, "); got ", send_rows.size(), " and ", recv_rows.size());
  DTRAIN_CHECK_ARG(x.dim() >= 1 && std::accumulate(send_rows.begin(), send_rows.end(), std::int64_t{0}) == x.size(0),
                   "ep::all_to_all: the send row counts do not add up to the input's ", x.sizes(), " rows");
  // The communicator travels as an integer; the caller keeps it alive with the graph.
  return AllToAll::apply(x, reinterpret_cast<std::int64_t>(comm.get()), std::move(send_rows),
                         std::move(recv_rows));
}

Exchange plan_exchange(const at::Tensor& counts, const CommPtr& ep) {
  const int n = ep->size();
  const auto E = counts.size(0);
  DTRAIN_CHECK_ARG(E % n == 0, "expert parallel: ", E, " experts do not split over ep=", n);
  const auto local = E / n;
  auto mine = counts.to(torch::kLong).contiguous();
  auto theirs = torch::empty_like(mine);
  ep->all_to_all(theirs, mine)->wait();  // theirs[s * local + j]: rows rank s sends to my expert j
  const auto send = mine.view({n, local}).sum(1).cpu();
  const auto recv_c = theirs.cpu();
  const auto* rc = recv_c.data_ptr<std::int64_t>();
  Exchange x;
  x.send_rows.assign(send.data_ptr<std::int64_t>(), send.data_ptr<std::int64_t>() + n);
  x.recv_rows.assign(static_cast<std::size_t>(n), 0);
  x.expert_rows.assign(static_cast<std::size_t>(local), 0);
  std::vector<std::int64_t> start(static_cast<std::size_t>(n * local));  // in the received tensor
  std::int64_t at = 0;
  for (int s = 0; s < n; ++s) {
    for (std::int64_t j = 0; j < local; ++j) {
      start[static_cast<std::size_t>(s * local + j)] = at;
      at += rc[s * local + j];
      x.recv_rows[static_cast<std::size_t>(s)] += rc[s * local + j];
      x.expert_rows[static_cast<std::size_t>(j)] += rc[s * local + j];
    }
  }
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(at));
  for (std::int64_t j = 0; j < local; ++j) {
    for (int s = 0; s < n; ++s) {
      const auto from = start[static_cast<std::size_t>(s * local + j)];
      for (std::int64_t i = 0; i < rc[s * local + j]; ++i) order.push_back(from + i);
    }
  }
  x.order = torch::tensor(order, torch::kLong).to(counts.device());
  x.inverse = torch::empty_like(x.order);
  x.inverse.index_put_({x.order}, torch::arange(at, x.order.options()));
  return x;
}

at::Tensor dispatch(const at::Tensor& rows, const Exchange& plan, const CommPtr& ep) {
  return all_to_all(rows, ep, plan.send_rows, plan.recv_rows).index_select(0, plan.order);
}

at::Tensor combine(const at::Tensor& rows, const Exchange& plan, const CommPtr& ep) {
  return all_to_all(rows.index_select(0, plan.inverse), ep, plan.recv_rows, plan.send_rows);
}

const CommStats& comm_stats() { return g_stats; }
void reset_comm_stats() { g_stats = CommStats{}; }

}  // namespace dtrain::ep
