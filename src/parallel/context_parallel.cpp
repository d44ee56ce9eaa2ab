// Context parallelism: the load-balanced chunk layout, and attention over the whole
// sequence by gathered keys or by heads exchanged for positions.
#include "dtrain/parallel/context_parallel.hpp"

#include <torch/torch.h>

#include <limits>
#include <vector>

#include "dtrain/core/error.hpp"
#include "dtrain/parallel/tensor_parallel.hpp"

namespace dtrain::cp {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The chunk (of 2 cp) that rank r holds in its slot s (0, 1).
std::int64_t chunk_of(int cp, int r, int s) { return s == 0 ? r : 2 * cp - 1 - r; }

// Positions laid out in rank order (rank r's two chunks at slots 2r, 2r + 1, as an
// all-gather or all-to-all delivers them) put in sequence order along dim, or back.
at::Tensor reorder(const at::Tensor& x, std::int64_t dim, int cp, bool to_sequence) {
  const auto L = x.size(dim) / (2 * cp);
  std::vector<std::int64_t> source(static_cast<std::size_t>(2 * cp));  // per destination chunk
  for (int r = 0; r < cp; ++r) {
    for (int s = 0; s < 2; ++s) {
      const std::int64_t chunk = chunk_of(cp, r, s), slot = 2 * r + s;
      source[static_cast<std::size_t>(to_sequence ? chunk : slot)] = to_sequence ? slot : chunk;
    }
  }
  std::vector<at::Tensor> index;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(x.device());
  for (auto from : source) index.push_back(at::arange(from * L, (from + 1) * L, opts));
  return x.index_select(dim, at::cat(index));
}

// Heads for positions: x [B, cp, G, Tl, D] (G heads for each rank, this rank's Tl
// positions) -> [B, G, cp Tl, D] (this rank's G heads, every rank's positions in rank
// order); and its inverse. One all-to-all each.
at::Tensor heads_from_positions(const at::Tensor& x, Communicator& c) {
  const auto B = x.size(0), N = x.size(1), G = x.size(2), Tl = x.size(3), D = x.size(4);
  const auto in = x.transpose(0, 1).contiguous();  // [cp, B, G, Tl, D]: row j goes to rank j
  auto out = at::empty_like(in);                   // row i: rank i's positions
  c.all_to_all(out, in)->wait();
  return out.permute({1, 2, 0, 3, 4}).reshape({B, G, N * Tl, D});
}
at::Tensor positions_from_heads(const at::Tensor& y, Communicator& c) {
  const auto B = y.size(0), G = y.size(1), N = static_cast<std::int64_t>(c.size()), D = y.size(3);
  const auto Tl = y.size(2) / N;
  const auto in = y.reshape({B, G, N, Tl, D}).permute({2, 0, 1, 3, 4}).contiguous();  // row i: rank i's positions
  auto out = at::empty_like(in);  // row j: rank j's heads
  c.all_to_all(out, in)->wait();
  return out.transpose(0, 1).contiguous();  // [B, cp, G, Tl, D]
}

// The exchange with autograd: the gradient goes back by the inverse exchange.
struct HeadExchange : public torch::autograd::Function<HeadExchange> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::int64_t comm, bool to_heads) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["to_heads"] = to_heads;
    auto& c = *reinterpret_cast<Communicator*>(comm);
    return to_heads ? heads_from_positions(x, c) : positions_from_heads(x, c);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& c = *reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const bool to_heads = ctx->saved_data["to_heads"].toBool();
    return {to_heads ? positions_from_heads(grads[0], c) : heads_from_positions(grads[0], c), at::Tensor(),
            at::Tensor()};
  }
};
at::Tensor exchange(const at::Tensor& x, const CommPtr& cp, bool to_heads) {
  return HeadExchange::apply(x, reinterpret_cast<std::int64_t>(cp.get()), to_heads);
}

// Ring attention (Megatron-Core's p2p): keys and values go round the ring of cp ranks,
// cp - 1 hops, the next hop posted before this one's blocks are computed; each rank runs
// flash attention on the blocks of (its query chunk, the visiting key chunk) it may see and
// merges them by log-sum-exp. The backward sends them round again; their gradients follow
// one hop behind (each rank adds its blocks' share to what the previous rank sent and
// passes the sum on while it computes the next hop's blocks) and reach their owner after
// the last hop; each block's gradients come from the merged output and log-sum-exp
// (ops::flash_attention_backward).
struct Block {
  std::int64_t row, col;  // local positions of the L queries and the L keys
  std::int64_t offset;    // the query chunk's first token minus the key chunk's (>= 0)
  std::int64_t first;     // the key chunk's first token in the sequence
};
// What rank r's query chunks (r, 2N - 1 - r) see of rank s's key chunks (s, 2N - 1 - s):
// causal attention over each pair whose key chunk is not after its query chunk, at query
// offset (query chunk - key chunk) L: the diagonal for the same chunk, every key of an
// earlier one (less what the window and the documents hide). A window of W keys drops the
// pairs whose nearest key is W or more tokens back.
std::vector<Block> visible_blocks(int n, int r, int s, std::int64_t L, std::int64_t window) {
  const std::int64_t mine[2] = {r, 2 * n - 1 - r}, theirs[2] = {s, 2 * n - 1 - s};
  std::vector<Block> blocks;
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      if (theirs[j] > mine[i]) continue;
      const auto offset = (mine[i] - theirs[j]) * L;
      if (window > 0 && offset - (L - 1) >= window) continue;
      blocks.push_back({i * L, j * L, offset, theirs[j] * L});
    }
  }
  return blocks;
}

// What a block's flash attention takes besides q, k, v: the window, the documents of the
// tokens from its key chunk's first to its query chunk's last (ops::Documents::slice, made
// once per range for the forward's layers, again in each layer's backward), and the logit
// soft-cap (elementwise on the scores: blocks capped alike merge as the whole would).
struct RingMask {
  std::int64_t window;
  ops::Documents documents;  // the whole sequence's; undefined: none
  double softcap = 0.0;
  ops::Documents of(const Block& b, std::int64_t L) const {
    return documents.defined() ? documents.slice(b.first, b.offset + L) : ops::Documents();
  }
};

// Sends t to the next rank of the ring and receives the previous rank's into a new tensor
// (tag: keys 0, their gradients 1, which may be in flight together).
at::Tensor pass_on(Communicator& c, const at::Tensor& t, std::vector<WorkPtr>& works, int tag = 0) {
  auto in = at::empty_like(t);
  const int n = c.size(), r = c.rank();
  works = c.batch_p2p({{P2POp::Kind::kSend, t, (r + 1) % n, tag}, {P2POp::Kind::kRecv, in, (r + n - 1) % n, tag}});
  return in;
}
void wait_all(std::vector<WorkPtr>& works) {
  for (auto& w : works) w->wait();
  works.clear();
}

// sinks: [H], or empty for none (ops::fold_sinks after the last block's merge).
struct RingAttention : public torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& sinks, std::int64_t comm, const RingMask& mask) {
    auto& c = *reinterpret_cast<Communicator*>(comm);
    const int n = c.size(), r = c.rank();
    const auto L = q.size(2) / 2, hkv = k.size(1);
    constexpr double kInf = std::numeric_limits<double>::infinity();
    // The merge runs in float32 (float64 for float64 inputs).
    const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    auto o = at::zeros(q.sizes(), q.options().dtype(acc));
    auto lse = at::full({q.size(0), q.size(1), q.size(2)}, -kInf, q.options().dtype(acc));
    auto kv = at::cat({k, v}, 1).contiguous();
    std::vector<WorkPtr> works;
    for (int i = 0; i < n; ++i) {
      const auto next = i + 1 < n ? pass_on(c, kv, works) : at::Tensor();
      for (const auto& b : visible_blocks(n, r, (r + n - i) % n, L, mask.window)) {
        const auto keys = kv.narrow(2, b.col, L);
        const auto [ob, lb] =
            ops::flash_attention_forward(q.narrow(2, b.row, L), keys.narrow(1, 0, hkv), keys.narrow(1, hkv, hkv),
                                         /*causal=*/true, 0.0, mask.window, mask.of(b, L), b.offset, mask.softcap);
        // A row that sees no key of this block (a window, a document) has log-sum-exp +inf
        // and output 0: it adds nothing (-inf); a row that has seen no key yet keeps
        // weights 0 rather than exp(-inf + inf).
        const auto lbf = lb.to(acc).masked_fill(lb == kInf, -kInf);
        auto rows_lse = lse.narrow(2, b.row, L), rows_o = o.narrow(2, b.row, L);
        const auto merged = at::logaddexp(rows_lse, lbf);
        const auto base = merged.masked_fill(merged == -kInf, 0.0);
        rows_o.copy_(rows_o * (rows_lse - base).exp().unsqueeze(-1) + ob.to(acc) * (lbf - base).exp().unsqueeze(-1));
        rows_lse.copy_(merged);
      }
      wait_all(works);
      if (next.defined()) kv = next;
    }
    // The sinks join each row's softmax once, over the merged blocks.
    if (sinks.numel() > 0) std::tie(o, lse) = ops::fold_sinks(o, lse, sinks.detach());
    auto out = o.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, lse, sinks.numel() > 0 ? sinks.detach() : at::Tensor()});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["window"] = mask.window;
    ctx->saved_data["documents"] = mask.documents.ids();
    ctx->saved_data["softcap"] = mask.softcap;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& c = *reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const RingMask mask{ctx->saved_data["window"].toInt(), ops::Documents(ctx->saved_data["documents"].toTensor()),
                        ctx->saved_data["softcap"].toDouble()};
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const auto dout = grads[0].contiguous();
    const int n = c.size(), r = c.rank();
    const auto L = q.size(2) / 2, hkv = k.size(1);
    const auto acc = lse.scalar_type();
    auto dq = at::zeros(q.sizes(), q.options().dtype(acc));
    auto kv = at::cat({k, v}, 1).contiguous();
    // The visiting keys' gradients: this rank's blocks' share (dkv), and the sum of the
    // ranks' before it (arriving, one hop behind the keys; none for the rank's own keys).
    at::Tensor arriving, sent;
    std::vector<WorkPtr> works, grad_works;
    for (int i = 0; i < n; ++i) {
      const auto next = i + 1 < n ? pass_on(c, kv, works) : at::Tensor();
      auto dkv = at::zeros(kv.sizes(), kv.options().dtype(acc));
      for (const auto& b : visible_blocks(n, r, (r + n - i) % n, L, mask.window)) {
        const auto keys = kv.narrow(2, b.col, L);
        const auto g = ops::flash_attention_backward(
            q.narrow(2, b.row, L), keys.narrow(1, 0, hkv), keys.narrow(1, hkv, hkv), o.narrow(2, b.row, L),
            lse.narrow(2, b.row, L), dout.narrow(2, b.row, L), /*causal=*/true, 0.0, mask.window, mask.of(b, L),
            b.offset, mask.softcap);
        dq.narrow(2, b.row, L).add_(g[0].to(acc));
        dkv.narrow(2, b.col, L).narrow(1, 0, hkv).add_(g[1].to(acc));
        dkv.narrow(2, b.col, L).narrow(1, hkv, hkv).add_(g[2].to(acc));
      }
      wait_all(works);
      // The previous hop's sum has gone and the previous rank's has arrived: add this
      // rank's share and pass it on, to be waited for after the next hop's blocks. After
      // the last hop each rank receives its own keys' gradients.
      wait_all(grad_works);
      sent = i == 0 ? dkv : arriving.add_(dkv);
      arriving = pass_on(c, sent, grad_works, /*tag=*/1);
      if (next.defined()) kv = next;
    }
    wait_all(grad_works);
    at::Tensor dsinks;
    if (saved[5].defined() && ctx->needs_input_grad(3)) dsinks = ops::sinks_grad(o, lse, dout, saved[5]);
    return {dq.to(q.scalar_type()), arriving.narrow(1, 0, hkv).to(k.scalar_type()),
            arriving.narrow(1, hkv, hkv).to(v.scalar_type()), dsinks, at::Tensor(), at::Tensor()};
  }
};

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp,
                          ops::AttentionBackend backend, double dropout_p, std::int64_t window,
                          const ops::Documents& documents, double softcap, const at::Tensor& sinks) {
  DTRAIN_CHECK_ARG(backend == ops::AttentionBackend::kFlash && dropout_p == 0,
                   "context parallel attention: --cp-comm p2p runs flash attention's passes on blocks of keys, "
                   "without dropout; got --attention ", ops::to_string(backend), ", dropout ", dropout_p,
                   "; allowed: --attention flash without dropout, or --cp-comm all_gather or a2a");
  const auto sinks_in = sinks.defined() ? sinks : at::empty({0}, q.options().dtype(at::kFloat));
  return RingAttention::apply(q, k, v, sinks_in, reinterpret_cast<std::int64_t>(cp.get()),
                              RingMask{window, documents, softcap});
}

at::Tensor all_gather_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp,
                                ops::AttentionBackend backend, double dropout_p, std::int64_t window,
                                const ops::Documents& documents, double softcap, const at::Tensor& sinks) {
  const int n = cp->size();
  const auto hkv = k.size(1), L = q.size(2) / 2;
  // One all-gather for keys and values together.
  const auto kv = gather_sequence(at::cat({k, v}, 1), 2, cp);
  const auto keys = kv.narrow(1, 0, hkv), values = kv.narrow(1, hkv, hkv);
  std::vector<at::Tensor> out;
  for (int s = 0; s < 2; ++s) {
    const auto g = chunk_of(n, cp->rank(), s);
    const auto seen = (g + 1) * L;  // the keys up to the chunk's end
    out.push_back(ops::attention(q.narrow(2, s * L, L), keys.narrow(2, 0, seen), values.narrow(2, 0, seen),
                                 /*causal=*/true, dropout_p, backend, window, documents, g * L, softcap, sinks));
  }
  return at::cat(out, 2);
}

at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp,
                                ops::AttentionBackend backend, double dropout_p, std::int64_t window,
                                const ops::Documents& documents, double softcap, const at::Tensor& sinks) {
  const std::int64_t n = cp->size(), B = q.size(0), H = q.size(1), Tl = q.size(2), D = q.size(3);
  DTRAIN_CHECK_ARG(H % n == 0, "context parallel attention: --cp-comm a2a splits the ", H,
                   " query heads (of this tensor-parallel rank) across --cp=", n,
                   "; allowed: a --cp that divides them, or --cp-comm all_gather");
  // Key/value heads split as the query heads that read them, or repeated per query head.
  const bool repeat = k.size(1) % n != 0;
  const auto keys = repeat ? k.repeat_interleave(H / k.size(1), 1) : k;
  const auto values = repeat ? v.repeat_interleave(H / v.size(1), 1) : v;
  const auto h = H / n, hkv = keys.size(1) / n;
  auto per_rank = [&](const at::Tensor& t) { return t.reshape({B, n, t.size(1) / n, Tl, D}); };
  // One all-to-all for q, k and v: [B, h + 2 hkv, T, D] in sequence order.
  const auto whole =
      reorder(exchange(at::cat({per_rank(q), per_rank(keys), per_rank(values)}, 2), cp, true), 2, n, true);
  // This rank's heads after the exchange: [rank h, rank h + h) of H (and of the sinks).
  const auto y = ops::attention(whole.narrow(1, 0, h), whole.narrow(1, h, hkv), whole.narrow(1, h + hkv, hkv),
                                /*causal=*/true, dropout_p, backend, window, documents, 0, softcap,
                                sinks.defined() ? sinks.narrow(0, cp->rank() * h, h) : sinks);
  return exchange(reorder(y, 2, n, false), cp, false).reshape({B, H, Tl, D});
}
}  // namespace

void check_sequence(std::int64_t seq_len, int cp, const std::string& option) {
  DTRAIN_CHECK_ARG(cp >= 1, "--cp=", cp, " must be at least 1");
  DTRAIN_CHECK_ARG(seq_len > 0 && seq_len % (2 * cp) == 0, option, "=", seq_len,
                   " cannot be split across --cp=", cp, " (each rank holds 2 of 2 x cp equal chunks); allowed: a ",
                   "multiple of ", 2 * cp);
}

at::Tensor local_positions(std::int64_t seq_len, int cp, int rank, c10::Device device) {
  check_sequence(seq_len, cp);
  DTRAIN_CHECK_ARG(rank >= 0 && rank < cp, "context parallel rank ", rank, " is not in [0, ", cp, ")");
  const auto L = seq_len / (2 * cp);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  if (cp == 1) return at::arange(seq_len, opts);
  return at::cat({at::arange(chunk_of(cp, rank, 0) * L, (chunk_of(cp, rank, 0) + 1) * L, opts),
                  at::arange(chunk_of(cp, rank, 1) * L, (chunk_of(cp, rank, 1) + 1) * L, opts)});
}

at::Tensor take_local(const at::Tensor& x, std::int64_t dim, int cp, int rank) {
  if (cp == 1) return x;
  return x.index_select(dim, local_positions(x.size(dim), cp, rank, x.device()));
}

at::Tensor gather_sequence(const at::Tensor& x, std::int64_t dim, const CommPtr& cp) {
  DTRAIN_CHECK_ARG(cp != nullptr, "context parallel: no cp communicator");
  const int n = cp->size();
  if (n == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  DTRAIN_CHECK_ARG(dim >= 0 && dim < x.dim() && x.size(dim) % 2 == 0, "context parallel: dimension ", dim,
                   " of ", x.sizes(), " is not a rank's two chunks of the sequence");
  return reorder(tp::gather_from_sequence(x, cp, dim), dim, n, /*to_sequence=*/true);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp,
                     CpComm method, ops::AttentionBackend backend, double dropout_p, std::int64_t window,
                     const ops::Documents& documents, double softcap, const at::Tensor& sinks) {
  DTRAIN_CHECK_ARG(cp != nullptr, "context parallel: no cp communicator");
  if (cp->size() == 1) {
    return ops::attention(q, k, v, /*causal=*/true, dropout_p, backend, window, documents, 0, softcap, sinks);
  }
  DTRAIN_CHECK_ARG(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                       q.size(2) == k.size(2) && q.size(2) % 2 == 0 && q.size(1) % k.size(1) == 0,
                   "context parallel attention: q, k, v must be [batch, heads, 2 chunks of time, head_dim] with k "
                   "and v alike and a multiple of their heads in q; got ", q.sizes(), ", ", k.sizes(), ", ",
                   v.sizes());
  switch (method) {
    case CpComm::kAllToAll:
      return all_to_all_attention(q, k, v, cp, backend, dropout_p, window, documents, softcap, sinks);
    case CpComm::kRing: return ring_attention(q, k, v, cp, backend, dropout_p, window, documents, softcap, sinks);
    case CpComm::kAllGather: break;
  }
  return all_gather_attention(q, k, v, cp, backend, dropout_p, window, documents, softcap, sinks);
}

}  // namespace dtrain::cp
