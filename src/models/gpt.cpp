// GPT-2 / Llama decoder: configuration and presets, blocks, activation checkpointing
// (a reentrant autograd function that recomputes a block in backward), initialisation.
#include "dtrain/models/gpt.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>

#include "dtrain/core/error.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/ops/cross_entropy.hpp"
#include "dtrain/ops/norm.hpp"
#include "dtrain/ops/rope.hpp"
#include "dtrain/ops/swiglu.hpp"
#include "dtrain/parallel/context_parallel.hpp"

namespace dtrain::models {

// ---------------------------------------------------------------------------------------
// Configuration

GptConfig GptConfig::preset(const std::string& name) {
  GptConfig c;
  if (name == "tiny") {  // byte-level, for tests: runs in seconds on a CPU
    c.vocab_size = 256, c.context = 64, c.n_layer = 2, c.n_head = 4, c.n_kv_head = 4, c.d_model = 64;
  } else if (name == "gpt2-124m") {
    // defaults: vocab 50304 (50257 padded to a multiple of 128, as llm.c), 12 x 768
  } else if (name == "gpt2-350m") {
    c.n_layer = 24, c.n_head = 16, c.n_kv_head = 16, c.d_model = 1024;
  } else if (name == "llama-1b") {  // Llama 3.2 1B shapes
    c.family = "llama", c.vocab_size = 128256, c.context = 2048, c.n_layer = 16;
    c.n_head = 32, c.n_kv_head = 8, c.d_model = 2048, c.ffn_hidden = 8192;
    c.rope_theta = 500000.0, c.tie_embeddings = true;
  } else {
    throw InvalidArgument("model preset '" + name +
                          "' is not known; allowed: tiny, gpt2-124m, gpt2-350m, llama-1b");
  }
  return c;
}

void GptConfig::validate() const {
  DTRAIN_CHECK_ARG(family == "gpt2" || family == "llama", "model family '", family,
                   "' is not known; allowed: gpt2, llama");
  DTRAIN_CHECK_ARG(vocab_size >= 2 && vocab_size <= 1 << 24, "vocab_size=", vocab_size,
                   " is out of range; allowed: 2..16777216");
  DTRAIN_CHECK_ARG(context >= 1, "context=", context, " must be at least 1");
  DTRAIN_CHECK_ARG(n_layer >= 1, "n_layer=", n_layer, " must be at least 1");
  DTRAIN_CHECK_ARG(n_head >= 1 && d_model % n_head == 0, "d_model=", d_model,
                   " must be a multiple of n_head=", n_head);
  DTRAIN_CHECK_ARG(n_kv_head >= 1 && n_head % n_kv_head == 0, "n_head=", n_head,
                   " must be a multiple of n_kv_head=", n_kv_head);
  DTRAIN_CHECK_ARG(family == "llama" || n_kv_head == n_head, "n_kv_head=", n_kv_head,
                   " differs from n_head=", n_head,
                   "; grouped-query attention needs family 'llama'");
  DTRAIN_CHECK_ARG(family == "gpt2" || head_dim() % 2 == 0, "head_dim=", head_dim(),
                   " must be even for rotary embeddings");
  DTRAIN_CHECK_ARG(ffn_hidden >= 0, "ffn_hidden=", ffn_hidden, " must not be negative");
  DTRAIN_CHECK_ARG(init_std > 0 && norm_eps > 0 && rope_theta > 0,
                   "init_std, norm_eps and rope_theta must be positive");
  DTRAIN_CHECK_ARG(attention_window >= 0, "attention_window=", attention_window,
                   " (--attention-window) is out of range; allowed: 0 (every earlier token) or a number of tokens >= 1");
  DTRAIN_CHECK_ARG(window_skip_every >= 0 && (window_skip_every == 0 || attention_window > 0), "window_skip_every=",
                   window_skip_every, " (--window-attn-skip-freq) is not allowed", attention_window > 0 ? "" :
                   " without --attention-window", "; allowed: 0 (every block windowed), or with --attention-window "
                   "N >= 1 (every N-th block attends to every earlier token)");
  DTRAIN_CHECK_ARG(std::isfinite(attention_softcap) && attention_softcap >= 0, "attention_softcap=",
                   attention_softcap, " (--attention-softcap) is out of range; allowed: 0 (none) or a finite cap > 0 "
                   "(Gemma 2: 50)");
  DTRAIN_CHECK_ARG(attention_softcap == 0 || attention == ops::AttentionBackend::kFlash, "attention_softcap=",
                   attention_softcap, " (--attention-softcap) needs --attention flash; got --attention ",
                   ops::to_string(attention), " (LibTorch's sdpa has no soft-capping)");
  DTRAIN_CHECK_ARG(softmax_type == "vanilla" || softmax_type == "off-by-one" || softmax_type == "learnable",
                   "softmax_type '", softmax_type, "' (--softmax-type) is not known; allowed: vanilla, off-by-one, "
                   "learnable");
  DTRAIN_CHECK_ARG(!attention_sinks() || attention == ops::AttentionBackend::kFlash, "softmax_type '", softmax_type,
                   "' (--softmax-type) needs --attention flash; got --attention ", ops::to_string(attention),
                   " (LibTorch's sdpa has no attention sinks)");
  DTRAIN_CHECK_ARG(document_separator >= -1 && document_separator < vocab_size, "document_separator=",
                   document_separator, " (--document-separator) is out of range; allowed: -1 (none) or a token id in "
                   "0..", vocab_size - 1);
  DTRAIN_CHECK_ARG(!reset_position_ids || document_separator >= 0, "reset_position_ids (--reset-position-ids) "
                   "restarts positions at each document; allowed only with document_separator >= 0 "
                   "(--document-separator ID)");
  DTRAIN_CHECK_ARG(recompute_blocks >= -1, "recompute_blocks=", recompute_blocks, " (--activation-checkpointing) is "
                   "out of range; allowed: -1 (every block), 0 (none) or a number of blocks >= 1");
  DTRAIN_CHECK_ARG(dropout >= 0 && dropout < 1, "dropout=", dropout,
                   " is out of range; allowed: [0, 1)");
  DTRAIN_CHECK_ARG(std::isfinite(z_loss) && z_loss >= 0, "z_loss=", z_loss,
                   " (--z-loss) is out of range; allowed: a finite number >= 0 (0: none; PaLM: 1e-4)");
  moe.validate();
}

void GptConfig::validate_tp(int tp) const {
  DTRAIN_CHECK_ARG(tp >= 1, "--tp=", tp, " must be at least 1");
  DTRAIN_CHECK_ARG(n_head % tp == 0, "n_head=", n_head, " (--n-head) is not divisible by --tp=",
                   tp, "; tensor parallelism splits the attention heads across tp ranks");
  DTRAIN_CHECK_ARG(mlp_hidden() % tp == 0, "the MLP width ", mlp_hidden(),
                   " (--ffn-hidden) is not divisible by --tp=", tp,
                   "; tensor parallelism splits it across tp ranks");
  DTRAIN_CHECK_ARG(!moe.enabled() || expert_hidden() % tp == 0, "the expert width ", expert_hidden(),
                   " (--moe-ffn-hidden) is not divisible by --tp=", tp,
                   "; tensor parallelism splits it across tp ranks");
}

std::int64_t GptConfig::mlp_hidden() const {
  if (ffn_hidden > 0) return ffn_hidden;
  if (family == "gpt2") return 4 * d_model;
  const std::int64_t h = (8 * d_model) / 3;
  return (h + 255) / 256 * 256;
}

std::int64_t GptConfig::num_parameters() const {
  const bool gpt2 = family == "gpt2";
  const std::int64_t hd = head_dim(), h = mlp_hidden();
  const std::int64_t norm = gpt2 ? 2 * d_model : d_model;
  std::int64_t block = 2 * norm + (qk_norm ? 2 * hd : 0) + (learned_sinks() ? n_head : 0);
  block += d_model * (n_head + 2 * n_kv_head) * hd + (gpt2 ? (n_head + 2 * n_kv_head) * hd : 0);
  block += n_head * hd * d_model + (gpt2 ? d_model : 0);
  block += gpt2 ? (d_model * h + h + h * d_model + d_model) : 3 * d_model * h;
  std::int64_t total = vocab_size * d_model + n_layer * block + norm;
  for (std::int64_t b = 0; b < n_layer; ++b) {  // a MoE block: router and experts, no MLP
    if (!moe.is_moe_block(b)) continue;
    total -= gpt2 ? (d_model * h + h + h * d_model + d_model) : 3 * d_model * h;
    total += moe.experts * d_model + moe.experts * 3 * d_model * expert_hidden();
  }
  if (gpt2) total += context * d_model;
  if (!tie_embeddings) total += vocab_size * d_model;
  return total;
}

std::vector<std::pair<std::string, std::vector<std::int64_t>>> GptConfig::parameter_shapes() const {
  // Module::named_parameters order: a module's own parameters, then its children's.
  const bool gpt2 = family == "gpt2";
  const std::int64_t d = d_model, qkv = (n_head + 2 * n_kv_head) * head_dim(), F = mlp_hidden();
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  out.push_back({"ln_f_weight", {d}});
  if (gpt2) out.push_back({"ln_f_bias", {d}});
  out.push_back({"tok_emb.weight", {vocab_size, d}});
  if (gpt2) out.push_back({"pos_emb.weight", {context, d}});
  for (std::int64_t i = 0; i < n_layer; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    out.push_back({h + "ln1_weight", {d}});
    out.push_back({h + "ln2_weight", {d}});
    if (gpt2) {
      out.push_back({h + "ln1_bias", {d}});
      out.push_back({h + "ln2_bias", {d}});
    }
    if (qk_norm) {
      out.push_back({h + "q_norm_weight", {head_dim()}});
      out.push_back({h + "k_norm_weight", {head_dim()}});
    }
    if (learned_sinks()) out.push_back({h + "attn_sinks", {n_head}});
    out.push_back({h + "attn_qkv.weight", {qkv, d}});
    if (gpt2) out.push_back({h + "attn_qkv.bias", {qkv}});
    out.push_back({h + "attn_proj.weight", {d, n_head * head_dim()}});
    if (gpt2) out.push_back({h + "attn_proj.bias", {d}});
    if (moe.is_moe_block(i)) {
      const std::int64_t E = moe.experts, Fe = expert_hidden();
      out.push_back({h + "moe.router.weight", {E, d}});
      out.push_back({h + "moe.fc.weight", {E, Fe, d}});
      out.push_back({h + "moe.gate.weight", {E, Fe, d}});
      out.push_back({h + "moe.proj.weight", {E, d, Fe}});
      continue;
    }
    out.push_back({h + "mlp_fc.weight", {F, d}});
    if (gpt2) out.push_back({h + "mlp_fc.bias", {F}});
    if (!gpt2) out.push_back({h + "mlp_gate.weight", {F, d}});
    out.push_back({h + "mlp_proj.weight", {d, F}});
    if (gpt2) out.push_back({h + "mlp_proj.bias", {d}});
  }
  if (!tie_embeddings) out.push_back({"lm_head.weight", {vocab_size, d}});
  return out;
}

double GptConfig::flops_per_token(std::int64_t seq_len) const {
  std::int64_t matmul = num_parameters();
  const bool gpt2 = family == "gpt2";
  const std::int64_t norm = gpt2 ? 2 * d_model : d_model;
  matmul -= (2 * n_layer + 1) * norm;  // norm weights (and biases)
  if (qk_norm) matmul -= 2 * n_layer * head_dim();
  if (learned_sinks()) matmul -= n_layer * n_head;  // sinks: one logit each
  if (gpt2) {
    matmul -= context * d_model;  // learned positions: a lookup, no matmul
    matmul -= n_layer * ((n_head + 2 * n_kv_head) * head_dim() + 2 * d_model + mlp_hidden());
  }
  for (std::int64_t b = 0; b < n_layer; ++b) {  // only topk of a MoE layer's experts run
    if (!moe.is_moe_block(b)) continue;
    if (gpt2) matmul += mlp_hidden() + d_model;  // the MLP biases taken off above are not there
    matmul -= (moe.experts - moe.topk) * 3 * d_model * expert_hidden();
  }
  std::int64_t keys = 0;  // per query, summed over the blocks
  for (std::int64_t b = 0; b < n_layer; ++b) keys += window_of(b) > 0 ? std::min(seq_len, window_of(b)) : seq_len;
  return 6.0 * static_cast<double>(matmul) + 12.0 * static_cast<double>(n_head * head_dim() * keys);
}

// ---------------------------------------------------------------------------------------
// Block

namespace {
// A parameter holder named like torch::nn::Linear's ("<name>.weight", "<name>.bias").
std::shared_ptr<torch::nn::Module> holder() { return std::make_shared<torch::nn::Module>(); }

// Where a tensor-parallel region sums gradients: a parameter whose gradient is partial on
// each tp rank (sequence-split activations, replicated key/value heads) enters through
// copy_to_region, so its gradient is summed across tp during backward.
torch::Tensor shared(const torch::Tensor& p, const TpEnv& tp) {
  return p.defined() ? tp::copy_to_region(p, tp.comm) : p;
}
}  // namespace

BlockImpl::BlockImpl(const GptConfig& c, TpEnv tp, std::int64_t index)
    : config_(c), tp_(std::move(tp)), window_(c.window_of(index)) {
  const bool gpt2 = c.family == "gpt2";
  const std::int64_t hd = c.head_dim();
  column_.bias = row_.bias = gpt2;
  column_.sequence_parallel = row_.sequence_parallel = tp_.sequence_parallel;
  ln1_w_ = register_parameter("ln1_weight", torch::ones({c.d_model}));
  ln2_w_ = register_parameter("ln2_weight", torch::ones({c.d_model}));
  if (gpt2) {
    ln1_b_ = register_parameter("ln1_bias", torch::zeros({c.d_model}));
    ln2_b_ = register_parameter("ln2_bias", torch::zeros({c.d_model}));
  }
  if (c.qk_norm) {
    q_norm_w_ = register_parameter("q_norm_weight", torch::ones({hd}));
    k_norm_w_ = register_parameter("k_norm_weight", torch::ones({hd}));
  }
  if (c.learned_sinks()) {
    sinks_ = register_parameter("attn_sinks", torch::zeros({c.n_head / tp_.size}));
  }
  const std::int64_t kv_local = kv_split() ? c.n_kv_head / tp_.size : c.n_kv_head;
  const std::int64_t qkv_rows = (c.n_head / tp_.size + 2 * kv_local) * hd;
  auto qkv = register_module("attn_qkv", holder());
  qkv_w_ = qkv->register_parameter("weight", torch::empty({qkv_rows, c.d_model}));
  if (gpt2) qkv_b_ = qkv->register_parameter("bias", torch::zeros({qkv_rows}));
  proj_ = register_module("attn_proj", tp::RowParallelLinear(c.n_head * hd, c.d_model, tp_.comm, row_));
  if (c.moe.is_moe_block(index)) {
    auto moe = c.moe;
    moe.fused_swiglu = c.fused_swiglu;
    moe_ = register_module("moe", Moe(moe, c.d_model, c.expert_hidden(), tp_.comm,
                                      tp_.sequence_parallel,
                                      tp_.ep ? tp_.ep : make_self_communicator("ep", 0), tp_.cp));
    return;
  }
  fc_ = register_module("mlp_fc", tp::ColumnParallelLinear(c.d_model, c.mlp_hidden(), tp_.comm, column_));
  if (!gpt2) {
    gate_ = register_module("mlp_gate", tp::ColumnParallelLinear(c.d_model, c.mlp_hidden(), tp_.comm, column_));
  }
  down_ = register_module("mlp_proj", tp::RowParallelLinear(c.mlp_hidden(), c.d_model, tp_.comm, row_));
}

namespace {
// RMSNorm over the last dim, in float32: the fused op, or ATen.
torch::Tensor rms_norm(const GptConfig& c, const torch::Tensor& x, const torch::Tensor& w) {
  if (c.fused_norm) return ops::rms_norm(x.contiguous(), w, c.norm_eps);
  auto xf = x.to(torch::kFloat);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + c.norm_eps)).to(x.scalar_type()) * w;
}

// The family's norm: LayerNorm (weight, bias) for gpt2, RMSNorm (weight) for llama.
torch::Tensor apply_norm(const GptConfig& c, const torch::Tensor& x, const torch::Tensor& w,
                         const torch::Tensor& b) {
  if (c.family != "gpt2") return rms_norm(c, x, w);
  return c.fused_norm ? ops::layer_norm(x, w, b, c.norm_eps) : torch::layer_norm(x, {c.d_model}, w, b, c.norm_eps);
}

// A norm over the residual stream: on sequence shards its weights' gradients are partial.
torch::Tensor stream_norm(const GptConfig& c, const TpEnv& tp, const torch::Tensor& x,
                          const torch::Tensor& w, const torch::Tensor& b) {
  if (!tp.sequence_parallel) return apply_norm(c, x, w, b);
  return apply_norm(c, x, shared(w, tp), shared(b, tp));
}

// QK-norm: RMSNorm over the last dim (a head's) of q or k [B, T, heads, D]. The weight is
// replicated and each tp rank norms its own heads: its gradient is summed across tp.
torch::Tensor head_norm(const GptConfig& c, const TpEnv& tp, const torch::Tensor& x, const torch::Tensor& w) {
  return rms_norm(c, x, shared(w, tp));
}

// The dropout stream of the residual stream: replicated across tp, or split by sequence.
tp::RngTracker::Stream stream_of(const TpEnv& tp) {
  return tp.sequence_parallel ? tp::RngTracker::Stream::kSplit
                              : tp::RngTracker::Stream::kReplicated;
}
}  // namespace

torch::Tensor BlockImpl::norm(const torch::Tensor& x, const torch::Tensor& w,
                              const torch::Tensor& b) const {
  return stream_norm(config_, tp_, x, w, b);
}

namespace {
// Rotary embedding on [B, H, T, D] with the half-split convention; cos and sin are
// [>= T, D / 2] (position t's angles in row t) or [B, 1, T, D / 2] (each token's own).
// fused: ops::rope (float32 angles); else LibTorch's ops with the angles in x's dtype.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, bool fused) {
  if (fused) return ops::rope(x, cos, sin);
  const auto T = x.size(2), half = x.size(3) / 2;
  // In the activations' dtype (bfloat16 parameters give bfloat16 q and k).
  const bool rows = cos.dim() == 2;
  auto c = (rows ? cos.slice(0, 0, T) : cos).to(x.scalar_type());
  auto s = (rows ? sin.slice(0, 0, T) : sin).to(x.scalar_type());
  auto x1 = x.slice(3, 0, half), x2 = x.slice(3, half);
  return torch::cat({x1 * c - x2 * s, x1 * s + x2 * c}, 3);
}
}  // namespace

// Attention of this rank's heads on the (gathered) normed input; [B, T, H/tp * D].
torch::Tensor BlockImpl::attention(const torch::Tensor& in, const torch::Tensor& rope_cos,
                                   const torch::Tensor& rope_sin, const ops::Documents& documents) {
  const auto B = in.size(0), T = in.size(1);
  const auto D = config_.head_dim(), H = config_.n_head / tp_.size;
  namespace F = torch::nn::functional;
  torch::Tensor q, k, v;
  if (kv_split()) {
    const auto Hkv = config_.n_kv_head / tp_.size;
    auto qkv = F::linear(in, qkv_w_, qkv_b_.defined() ? qkv_b_ : torch::Tensor());
    q = qkv.slice(2, 0, H * D).view({B, T, H, D});
    k = qkv.slice(2, H * D, (H + Hkv) * D).view({B, T, Hkv, D});
    v = qkv.slice(2, (H + Hkv) * D).view({B, T, Hkv, D});
  } else {
    // Every key/value head on every rank; each rank's gradient for them is partial.
    const auto Hkv = config_.n_kv_head;
    auto part = [&](const torch::Tensor& t, std::int64_t from, std::int64_t len) {
      return t.defined() ? t.narrow(0, from, len) : t;
    };
    q = F::linear(in, part(qkv_w_, 0, H * D), part(qkv_b_, 0, H * D)).view({B, T, H, D});
    auto kv = F::linear(in, shared(part(qkv_w_, H * D, 2 * Hkv * D), tp_),
                        shared(part(qkv_b_, H * D, 2 * Hkv * D), tp_));
    // The key/value head of each local query head (head g uses kv head g / group).
    const auto group = config_.n_head / Hkv;
    std::vector<std::int64_t> heads;
    for (std::int64_t j = 0; j < H; ++j) heads.push_back((tp_.rank * H + j) / group);
    auto index = torch::tensor(heads, torch::TensorOptions().dtype(torch::kLong).device(in.device()));
    k = kv.slice(2, 0, Hkv * D).view({B, T, Hkv, D}).index_select(2, index);
    v = kv.slice(2, Hkv * D).view({B, T, Hkv, D}).index_select(2, index);
  }
  if (config_.qk_norm) {
    q = head_norm(config_, tp_, q, q_norm_w_);
    k = head_norm(config_, tp_, k, k_norm_w_);
  }
  q = q.transpose(1, 2), k = k.transpose(1, 2), v = v.transpose(1, 2);
  if (config_.family == "llama") {
    q = rope(q, rope_cos, rope_sin, config_.fused_rope);
    k = rope(k, rope_cos, rope_sin, config_.fused_rope);
  }
  const double p = is_training() ? config_.dropout : 0.0;
  // This rank's heads' sinks: the parameter, or the off-by-one softmax's zeros (made once).
  if (config_.attention_sinks() && !sinks_.defined() &&
      (!zero_sinks_.defined() || zero_sinks_.device() != q.device())) {
    zero_sinks_ = torch::zeros({H}, q.options().dtype(torch::kFloat));
  }
  const auto& sinks = sinks_.defined() ? sinks_ : zero_sinks_;
  torch::Tensor y;
  if (tp_.cp && tp_.cp->size() > 1) {  // no dropout: the Gpt constructor checks
    y = cp::attention(q, k, v, tp_.cp, tp_.cp_comm, config_.attention, 0.0, window_, documents,
                      config_.attention_softcap, sinks);
  } else {
    std::unique_ptr<tp::RngTracker::Fork> fork;  // dropout: heads differ across tp, the split stream
    if (p > 0) fork = tp_.rng->fork(tp::RngTracker::Stream::kSplit);
    y = ops::attention(q, k, v, /*causal=*/true, p, config_.attention, window_, documents, 0,
                       config_.attention_softcap, sinks);
  }
  return y.transpose(1, 2).reshape({B, T, H * D});
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& rope_cos,
                                 const torch::Tensor& rope_sin, const ops::Documents& documents) {
  const double p = config_.dropout;
  auto& rng = *tp_.rng;
  auto a = attention(tp::enter_column_region(norm(x, ln1_w_, ln1_b_), tp_.comm, column_),
                     rope_cos, rope_sin, documents);
  auto h = x + tp::dropout(proj_->forward(a), p, is_training(), rng, stream_of(tp_));
  if (moe_) {
    return h + tp::dropout(moe_->forward(norm(h, ln2_w_, ln2_b_)), p, is_training(), rng, stream_of(tp_));
  }
  auto n2 = tp::enter_column_region(norm(h, ln2_w_, ln2_b_), tp_.comm, column_);
  torch::Tensor m;
  if (config_.family == "gpt2") {
    m = torch::gelu(fc_->forward_entered(n2), "tanh");
  } else {
    const auto g = gate_->forward_entered(n2), u = fc_->forward_entered(n2);
    m = config_.fused_swiglu ? ops::swiglu(g, u) : torch::silu(g) * u;
  }
  return h + tp::dropout(down_->forward(m), p, is_training(), rng, stream_of(tp_));
}

namespace {
// Activation checkpointing: forward without a graph, recompute in backward (reentrant),
// parameter gradients accumulate during the recomputation's own backward. The dropout
// streams are replayed from their state at the forward, so the recomputation draws the
// same masks.
// The documents travel as a non-Tensor argument (a Tensor argument is tracked as an input
// of the graph, which an undefined one cannot be); the recomputation makes its own mask.
struct BlockDocuments {
  ops::Documents documents;
};
struct CheckpointBlock : public torch::autograd::Function<CheckpointBlock> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               torch::Tensor cos, torch::Tensor sin, const BlockDocuments& docs, BlockImpl* block) {
    const auto& documents = docs.documents;
    ctx->save_for_backward({x, cos, sin});
    ctx->saved_data["documents"] = documents.ids();
    // The block outlives the autograd graph (the model owns it); IValue cannot hold it.
    ctx->saved_data["block"] = reinterpret_cast<std::int64_t>(block);
    const auto states = block->rng().states();
    ctx->saved_data["rng_replicated"] = states[0];
    ctx->saved_data["rng_split"] = states[1];
    torch::NoGradGuard no_grad;
    return block->forward(x, cos, sin, documents);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto* block = reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    torch::Tensor x = saved[0].detach().requires_grad_(true);
    torch::Tensor out;
    {
      const auto now = block->rng().states();
      block->rng().set_states({ctx->saved_data["rng_replicated"].toTensor(),
                               ctx->saved_data["rng_split"].toTensor()});
      torch::AutoGradMode enable(true);
      MoeRecomputeScope recompute;  // routing statistics were recorded in the forward
      out = block->forward(x, saved[1], saved[2], ops::Documents(ctx->saved_data["documents"].toTensor()));
      block->rng().set_states(now);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace

// ---------------------------------------------------------------------------------------
// Model

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The tensor-parallel layout of parameter `name` on tp rank r of n; replicated_from < 0
// and an empty full_shape mean "fill in from the local tensor" (see GptImpl's constructor).
TpShard shard_of(const GptConfig& c, const std::string& name, int r, int n, int ep) {
  TpShard s;
  s.replicated_from = -1;
  const std::int64_t d = c.d_model, hd = c.head_dim(), H = c.n_head, Hkv = c.n_kv_head;
  const std::int64_t F = c.mlp_hidden();
  auto part = [&](std::int64_t total) { return std::make_pair(total / n * r, total / n); };
  const bool weight = ends_with(name, ".weight");
  if (ends_with(name, "tok_emb.weight") || ends_with(name, "lm_head.weight")) {
    const std::int64_t padded = tp::padded_vocab_size(c.vocab_size, n);
    s.full_shape = {c.vocab_size, d}, s.dim = 0, s.ranges = {{padded / n * r, padded / n}};
  } else if (ends_with(name, "attn_qkv.weight") || ends_with(name, "attn_qkv.bias")) {
    const std::int64_t rows = (H + 2 * Hkv) * hd, hl = H / n;
    s.full_shape = weight ? std::vector<std::int64_t>{rows, d} : std::vector<std::int64_t>{rows};
    s.dim = 0;
    s.ranges = {{r * hl * hd, hl * hd}};
    if (Hkv % n == 0) {
      const std::int64_t kl = Hkv / n;
      s.ranges.emplace_back(H * hd + r * kl * hd, kl * hd);
      s.ranges.emplace_back((H + Hkv) * hd + r * kl * hd, kl * hd);
    } else {  // every key/value head, on every rank
      s.ranges.emplace_back(H * hd, 2 * Hkv * hd);
      s.replicated_from = hl * hd * (weight ? d : 1);
    }
  } else if (ends_with(name, "attn_proj.weight")) {
    s.full_shape = {d, H * hd}, s.dim = 1, s.ranges = {part(H * hd)};
  } else if (ends_with(name, "attn_sinks")) {  // per query head, as the heads split
    s.full_shape = {H}, s.dim = 0, s.ranges = {part(H)};
  } else if (ends_with(name, "mlp_fc.weight") || ends_with(name, "mlp_gate.weight")) {
    s.full_shape = {F, d}, s.dim = 0, s.ranges = {part(F)};
  } else if (ends_with(name, "mlp_fc.bias") || ends_with(name, "mlp_gate.bias")) {
    s.full_shape = {F}, s.dim = 0, s.ranges = {part(F)};
  } else if (ends_with(name, "mlp_proj.weight")) {
    s.full_shape = {d, F}, s.dim = 1, s.ranges = {part(F)};
  } else if (is_expert_parameter(name)) {  // this rank's experts, their width split over tp
    const std::int64_t local = c.moe.experts / ep, Fe = c.expert_hidden();
    const bool down = ends_with(name, "moe.proj.weight");
    s.full_shape = down ? std::vector<std::int64_t>{local, d, Fe} : std::vector<std::int64_t>{local, Fe, d};
    s.dim = down ? 2 : 1, s.ranges = {part(Fe)};
  }
  return s;  // anything else (norms, row biases, positions): replicated
}

// This rank's slice of a full tensor: its ranges along spec.dim, zeros past the end.
torch::Tensor slice_of(const torch::Tensor& full, const TpShard& spec) {
  if (spec.dim < 0) return full;
  std::vector<torch::Tensor> pieces;
  for (const auto& [start, len] : spec.ranges) {
    const std::int64_t have = std::clamp<std::int64_t>(full.size(spec.dim) - start, 0, len);
    if (have > 0) pieces.push_back(full.narrow(spec.dim, start, have));
    if (have < len) {
      auto shape = full.sizes().vec();
      shape[static_cast<std::size_t>(spec.dim)] = len - have;
      pieces.push_back(torch::zeros(shape, full.options()));
    }
  }
  return torch::cat(pieces, spec.dim);
}

}  // namespace

GptImpl::GptImpl(ContextPtr ctx, const GptConfig& config, std::uint64_t seed, GptStage stage)
    : ctx_(std::move(ctx)), config_(config), stage_(stage) {
  DTRAIN_CHECK_ARG(ctx_ != nullptr, "Gpt needs a ParallelContext (ParallelContext::single_process() for one process)");
  config_.validate();
  config_.validate_tp(ctx_->tp_size());
  if (stage_.end_block < 0) stage_.end_block = config_.n_layer;
  DTRAIN_CHECK_ARG(stage_.first_block >= 0 && stage_.first_block < stage_.end_block &&
                       stage_.end_block <= config_.n_layer,
                   "pipeline stage: blocks [", stage_.first_block, ", ", stage_.end_block,
                   ") are not a non-empty range of the model's ", config_.n_layer, " blocks");
  const auto& c = config_;
  const bool gpt2 = c.family == "gpt2";
  tp_.comm = ctx_->tp_comm();
  tp_.rank = ctx_->tp_rank();
  tp_.size = ctx_->tp_size();
  tp_.sequence_parallel = ctx_->sequence_parallel();
  if (!ctx_->device().is_cpu()) at::globalContext().lazyInitDevice(ctx_->device().type());
  tp_.rng = std::make_shared<tp::RngTracker>(seed, tp_.rank, ctx_->device());
  c.moe.validate_ep(ctx_->ep_size());
  tp_.ep = ctx_->ep_comm();
  tp_.cp = ctx_->cp_comm();
  tp_.cp_comm = ctx_->config().cp_comm;
  if (ctx_->cp_size() > 1) {
    const auto cp = ctx_->cp_size();
    if (tp_.cp_comm == CpComm::kRing) {
      DTRAIN_CHECK_ARG(c.attention == ops::AttentionBackend::kFlash, "--cp-comm p2p (ring attention) runs flash ",
                       "attention's passes on blocks of keys; got --attention ", ops::to_string(c.attention),
                       "; allowed: --attention flash, or --cp-comm all_gather or a2a");
    } else if (tp_.cp_comm == CpComm::kAllToAll) {
      DTRAIN_CHECK_ARG((c.n_head / tp_.size) % cp == 0, "n_head=", c.n_head, " (--n-head) over --tp=", tp_.size,
                       " leaves ", c.n_head / tp_.size, " heads per rank, which --cp=", cp, " --cp-comm a2a cannot ",
                       "split; allowed: a --cp that divides them, or --cp-comm all_gather");
    }
    DTRAIN_CHECK_ARG(c.dropout == 0, "--dropout=", c.dropout, " with --cp=", cp,
                     " is not available; allowed: --dropout 0");
  }
  // Registration order is parameter_shapes() order (own parameters first).
  if (stage_.head) {
    norm_weight_ = register_parameter("ln_f_weight", torch::ones({c.d_model}));
    if (gpt2) norm_bias_ = register_parameter("ln_f_bias", torch::zeros({c.d_model}));
  }
  if (stage_.embedding || (stage_.head && c.tie_embeddings)) {
    tok_emb_ = register_module(
        "tok_emb", tp::VocabParallelEmbedding(c.vocab_size, c.d_model, tp_.comm, tp_.sequence_parallel));
  }
  if (gpt2 && stage_.embedding) pos_emb_ = register_module("pos_emb", torch::nn::Embedding(c.context, c.d_model));
  // Blocks under "h" by their index in the whole model: parameters "h.<i>.*".
  auto list = register_module("h", std::make_shared<torch::nn::Module>());
  for (std::int64_t i = stage_.first_block; i < stage_.end_block; ++i) {
    blocks_.emplace_back(c, tp_, i);
    list->register_module(std::to_string(i), blocks_.back());
  }
  if (stage_.head && !c.tie_embeddings) {
    tp::ParallelLinearOptions head;
    head.bias = false;
    lm_head_ = register_module(
        "lm_head", tp::ColumnParallelLinear(c.d_model, tp::padded_vocab_size(c.vocab_size, tp_.size),
                                            tp_.comm, head));
  }
  if (gpt2) {
    rope_cos_ = rope_sin_ = torch::empty({0});  // unused; defined so autograd can carry them
  } else {
    const auto hd = c.head_dim();
    auto inv = torch::pow(c.rope_theta, -torch::arange(0, hd, 2, torch::kDouble) / hd);
    auto ang = torch::outer(torch::arange(c.context, torch::kDouble), inv);
    rope_cos_ = register_buffer("rope_cos", ang.cos().to(torch::kFloat));
    rope_sin_ = register_buffer("rope_sin", ang.sin().to(torch::kFloat));
  }
  for (const auto& item : named_parameters()) {
    auto spec = shard_of(c, item.key(), tp_.rank, tp_.size, ctx_->ep_size());
    const auto& p = item.value();
    if (spec.dim < 0) spec.full_shape = p.sizes().vec();
    if (spec.replicated_from < 0) spec.replicated_from = spec.dim < 0 ? 0 : p.numel();
    auto local = spec.full_shape;
    if (spec.dim >= 0) {
      local[static_cast<std::size_t>(spec.dim)] = 0;
      for (const auto& range : spec.ranges) local[static_cast<std::size_t>(spec.dim)] += range.second;
    }
    DTRAIN_CHECK(p.sizes().vec() == local, "internal: parameter ", item.key(), " is ", p.sizes(),
                 " but its tensor-parallel layout says ", at::IntArrayRef(local));
    shards_.emplace_back(item.key(), std::move(spec));
  }
  initialise(seed);
  to(ctx_->device());
  if (rope_cos_.defined() && rope_cos_.numel() == 0) rope_cos_ = rope_sin_ = rope_cos_.to(ctx_->device());
}

// Each full tensor of the whole model in parameter order from one generator (so every tp
// size and pipeline stage draws the same numbers), of which this rank keeps the slices of
// the parameters it holds.
void GptImpl::initialise(std::uint64_t seed) {
  torch::NoGradGuard no_grad;
  const auto& c = config_;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double residual_std = c.init_std / std::sqrt(2.0 * c.n_layer);
  const auto params = named_parameters();
  std::map<std::string, const TpShard*> held;
  for (const auto& [name, spec] : shards_) held[name] = &spec;
  std::size_t filled = 0;
  for (const auto& [name, shape] : c.parameter_shapes()) {
    auto full = torch::empty(shape);
    const bool norm = name.find("ln") != std::string::npos || name.find("norm") != std::string::npos;
    if (norm && name.find("weight") != std::string::npos && full.dim() == 1) {  // ln*, q_norm, k_norm
      full.fill_(1.0);
    } else if (full.dim() == 1) {
      full.zero_();
    } else {
      const bool residual = name.find("attn_proj") != std::string::npos ||
                            name.find("mlp_proj") != std::string::npos ||
                            name.find("moe.proj") != std::string::npos;
      full.normal_(0.0, residual ? residual_std : c.init_std, gen);
    }
    const auto it = held.find(name);
    if (it == held.end()) continue;
    if (is_expert_parameter(name)) full = full.narrow(0, expert_rows().first, expert_rows().second);
    params[name].copy_(slice_of(full, *it->second));
    ++filled;
  }
  DTRAIN_CHECK(filled == shards_.size(), "internal: ", shards_.size() - filled,
               " parameter(s) of the model are not in GptConfig::parameter_shapes()");
}

NamedParameters GptImpl::parameter_list() const {
  NamedParameters out;
  for (const auto& item : named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

NamedParameters GptImpl::full_parameters() const {
  NamedParameters out;
  const auto params = named_parameters();
  // Expert parameters: this rank's experts (tp-assembled), then every ep rank's in order.
  auto add = [&](const std::string& name, at::Tensor t) {
    if (is_expert_parameter(name) && tp_.ep->size() > 1) {
      auto shape = t.sizes().vec();
      shape[0] *= tp_.ep->size();
      auto all = torch::empty(shape, t.options());
      tp_.ep->all_gather(all, t.contiguous())->wait();
      t = all;
    }
    out.emplace_back(name, t);
  };
  for (const auto& [name, spec] : shards_) {
    const auto local = params[name].detach().contiguous();
    if (spec.dim < 0 || tp_.size == 1) {
      add(name, local.clone());
      continue;
    }
    auto shape = local.sizes().vec();
    shape.insert(shape.begin(), tp_.size);
    auto all = torch::empty(shape, local.options());
    tp_.comm->all_gather(all, local)->wait();
    auto full = torch::zeros(spec.full_shape, local.options());
    for (int k = 0; k < tp_.size; ++k) {
      std::int64_t at = 0;
      for (const auto& [start, len] : shard_of(config_, name, k, tp_.size, ctx_->ep_size()).ranges) {
        const std::int64_t have = std::clamp<std::int64_t>(full.size(spec.dim) - start, 0, len);
        if (have > 0) full.narrow(spec.dim, start, have).copy_(all[k].narrow(spec.dim, at, have));
        at += len;
      }
    }
    add(name, full);
  }
  return out;
}

std::pair<std::int64_t, std::int64_t> GptImpl::expert_rows() const {
  const std::int64_t local = config_.moe.experts / tp_.ep->size();
  return {local * tp_.ep->rank(), local};
}

std::vector<std::pair<std::int64_t, Moe>> GptImpl::moe_layers() const {
  std::vector<std::pair<std::int64_t, Moe>> out;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    auto m = blocks_[i]->moe();
    if (m) out.emplace_back(stage_.first_block + static_cast<std::int64_t>(i), m);
  }
  return out;
}

void GptImpl::set_loss_grad_scale(double scale, double aux_scale) {
  loss_grad_scale_ = scale;
  for (auto& [index, m] : moe_layers()) m->set_aux_loss_scale(aux_scale);
}

bool GptImpl::is_whole() const {
  return stage_.embedding && stage_.head && stage_.first_block == 0 && stage_.end_block == config_.n_layer;
}

std::pair<torch::Tensor, torch::Tensor> GptImpl::rope_angles(const torch::Tensor& positions) const {
  if (!positions.defined() || rope_cos_.numel() == 0) return {rope_cos_, rope_sin_};
  if (positions.dim() == 1) return {rope_cos_.index_select(0, positions), rope_sin_.index_select(0, positions)};
  auto per_token = [&](const torch::Tensor& table) {
    return table.index_select(0, positions.reshape({-1})).view({positions.size(0), 1, positions.size(1), -1});
  };
  return {per_token(rope_cos_), per_token(rope_sin_)};
}

torch::Tensor GptImpl::forward_stage(const torch::Tensor& input, const torch::Tensor& tokens) {
  const auto& c = config_;
  // Packed documents: each token's document number (the separators before it; one
  // ops::Documents for every block, which makes the attention masks once) and, with
  // reset_position_ids, its position in its document, from the micro-batch's tokens.
  ops::Documents documents;
  torch::Tensor positions;
  if (c.document_separator >= 0) {
    const auto& ids = stage_.embedding ? input : tokens;
    DTRAIN_CHECK_ARG(ids.defined() && ids.dim() == 2 && ids.size(0) == input.size(0), "document_separator=",
                     c.document_separator, " (--document-separator): a pipeline stage after the first needs the "
                     "micro-batch's tokens [batch, time] with its input ", input.sizes());
    const auto ends = ids.eq(c.document_separator).to(torch::kInt);
    documents = ops::Documents(ends.cumsum(1, torch::kInt) - ends);
    if (c.reset_position_ids) {
      // A document starts at 0 and after each separator; a token's position counts from
      // the last start at or before it.
      const auto t = torch::arange(ids.size(1), ids.options().dtype(torch::kLong)).expand(ids.sizes());
      auto starts = t * torch::cat({torch::ones_like(ends.narrow(1, 0, 1)), ends.narrow(1, 0, ids.size(1) - 1)}, 1);
      positions = t - std::get<0>(starts.cummax(1));
    }
  }
  // Context parallelism: this rank's positions of the whole sequence (documents stay whole:
  // the attention reads them for every key).
  const int cp = ctx_->cp_size();
  if (cp > 1) {
    const auto& whole = stage_.embedding ? input : tokens;
    DTRAIN_CHECK_ARG(whole.defined() && whole.dim() == 2 && whole.size(1) <= c.context,
                     "context parallelism: every stage needs the micro-batch's token ids [batch, time <= ", c.context,
                     "]; got ", whole.defined() ? whole.sizes() : torch::IntArrayRef{});
    cp::check_sequence(whole.size(1), cp, "the sequence length (--seq-len)");
    positions = positions.defined() ? cp::take_local(positions, 1, cp, ctx_->cp_rank())
                                    : cp::local_positions(whole.size(1), cp, ctx_->cp_rank(), whole.device());
  }
  torch::Tensor x;
  if (stage_.embedding) {
    const auto idx = cp::take_local(input, 1, cp, ctx_->cp_rank());
    DTRAIN_CHECK_ARG(idx.dim() == 2 && input.size(1) <= c.context, "model input must be [batch, time] with time <= context ",
                     c.context, "; got ", input.sizes());
    const std::int64_t T = idx.size(1);  // this rank's positions
    DTRAIN_CHECK_ARG(!tp_.sequence_parallel || T % tp_.size == 0, "sequence parallelism splits the ",
                     T, " positions of the input", cp > 1 ? " this context-parallel rank holds" : "",
                     " across tp=", tp_.size, "; allowed: a sequence length divisible by tp",
                     cp > 1 ? " x cp" : "");
    if (hooks_ != nullptr) hooks_->enter_embedding();
    x = tok_emb_->forward(idx);  // [B, T / tp, d] with sequence parallelism
    if (pos_emb_) {
      auto pos = positions.defined() ? positions : torch::arange(T, idx.options());
      if (tp_.sequence_parallel) {  // this rank's T / tp positions of the sequence
        const std::int64_t n = T / tp_.size;
        pos = pos.narrow(-1, n * tp_.rank, n);
        x = x + torch::embedding(shared(pos_emb_->weight, tp_), pos);
      } else {
        x = x + pos_emb_->forward(pos);
      }
    }
    x = tp::dropout(x, c.dropout, is_training(), *tp_.rng, stream_of(tp_));
    if (hooks_ != nullptr) x = hooks_->exit_embedding(x, c.tie_embeddings);
  } else {
    DTRAIN_CHECK_ARG(input.dim() == 3 && input.size(2) == c.d_model, "pipeline stage input must be the previous "
                     "stage's [batch, time, ", c.d_model, "] output; got ", input.sizes());
    x = input;
    // A last stage's copy of tied embeddings: gathered for the head (kept into backward).
    if (hooks_ != nullptr && tok_emb_) hooks_->enter_embedding();
  }
  const auto [rope_cos, rope_sin] = rope_angles(positions);
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    auto& block = blocks_[i];
    if (hooks_ != nullptr) x = hooks_->enter(i, x);
    const bool recompute = c.recompute_blocks < 0 || static_cast<std::int64_t>(i) < c.recompute_blocks;
    if (recompute && is_training() && torch::GradMode::is_enabled()) {
      x = CheckpointBlock::apply(x, rope_cos, rope_sin, BlockDocuments{documents}, block.get());
    } else {
      x = block->forward(x, rope_cos, rope_sin, documents);
    }
    if (hooks_ != nullptr) x = hooks_->exit(i, x);
  }
  if (!stage_.head) return x;
  if (hooks_ != nullptr) x = hooks_->enter_head(x);
  return stream_norm(c, tp_, x, norm_weight_, norm_bias_);
}

torch::Tensor GptImpl::head_input(const torch::Tensor& h) {
  tp::ParallelLinearOptions head;
  head.sequence_parallel = tp_.sequence_parallel;
  return tp::enter_column_region(h, tp_.comm, head);
}

torch::Tensor GptImpl::local_logits(const torch::Tensor& h) {
  const auto in = head_input(h);
  return config_.tie_embeddings ? torch::matmul(in, tok_emb_->weight.t())
                                : lm_head_->forward_entered(in);
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx) {
  DTRAIN_CHECK_ARG(is_whole(), "Gpt::forward needs the whole model; a pipeline stage runs forward_stage");
  auto logits = cp::gather_sequence(local_logits(forward_stage(idx)), 1, tp_.cp);
  if (tp_.size == 1) return logits;
  return tp::gather_from_region(logits, tp_.comm).narrow(-1, 0, config_.vocab_size);
}

torch::Tensor GptImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  DTRAIN_CHECK_ARG(is_whole(), "Gpt::loss needs the whole model; a pipeline stage runs forward_stage and loss_from_hidden");
  return loss_from_hidden(forward_stage(idx), targets);
}

torch::Tensor GptImpl::loss_from_hidden(const torch::Tensor& hidden, const torch::Tensor& whole_targets) {
  DTRAIN_CHECK_ARG(stage_.head, "loss_from_hidden needs the stage that holds the head (the last)");
  const auto targets = cp::take_local(whole_targets, 1, ctx_->cp_size(), ctx_->cp_rank());
  const double z_loss = is_training() ? config_.z_loss : 0.0;  // validation: the cross-entropy alone
  if (config_.fused_linear_ce) {  // the head (this rank's rows of it at tp > 1) and the loss in chunks
    ops::CrossEntropyOptions o;
    o.grad_scale = loss_grad_scale_;
    o.ignore_index = kIgnoreTarget;
    o.z_loss = z_loss;
    const auto& w = config_.tie_embeddings ? tok_emb_->weight : lm_head_->weight;
    if (tp_.size == 1) {
      return ops::linear_cross_entropy(hidden.reshape({-1, hidden.size(-1)}), w, targets.reshape({-1}), o);
    }
    const auto in = head_input(hidden);
    return tp::fused_vocab_parallel_linear_cross_entropy(in.reshape({-1, in.size(-1)}), w, targets.reshape({-1}),
                                                         config_.vocab_size, tp_.comm, o);
  }
  auto logits = local_logits(hidden);
  if (config_.fused_ce) {
    // The logits are this call's own: their gradient may take their place.
    ops::CrossEntropyOptions o;
    o.grad_scale = loss_grad_scale_;
    o.in_place = true;
    o.ignore_index = kIgnoreTarget;
    o.z_loss = z_loss;
    const auto flat = logits.reshape({-1, logits.size(-1)});
    if (tp_.size == 1) return ops::cross_entropy(flat, targets.reshape({-1}), o);
    return tp::fused_vocab_parallel_cross_entropy(flat, targets.reshape({-1}), config_.vocab_size, tp_.comm, o);
  }
  if (tp_.size == 1) {
    const auto flat = logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), t = targets.reshape({-1});
    auto loss = torch::nn::functional::cross_entropy(
        flat, t, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnoreTarget));
    if (z_loss == 0) return loss;
    const auto keep = t.ne(kIgnoreTarget);
    return loss + z_loss * (flat.logsumexp(-1).square() * keep).sum() / keep.sum().clamp_min(1);
  }
  // Never the full logits: max, sum of exponentials and target logit reduced across tp.
  return tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                                          config_.vocab_size, tp_.comm, kIgnoreTarget, z_loss);
}

}  // namespace dtrain::models
