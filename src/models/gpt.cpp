// GPT-2 / Llama decoder: configuration and presets, blocks, activation checkpointing
// (a reentrant autograd function that recomputes a block in backward), initialisation.
#include "dtrain/models/gpt.hpp"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "dtrain/core/error.hpp"
#include "dtrain/ops/attention.hpp"

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
  std::int64_t block = 2 * norm;
  block += d_model * (n_head + 2 * n_kv_head) * hd + (gpt2 ? (n_head + 2 * n_kv_head) * hd : 0);
  block += n_head * hd * d_model + (gpt2 ? d_model : 0);
  block += gpt2 ? (d_model * h + h + h * d_model + d_model) : 3 * d_model * h;
  std::int64_t total = vocab_size * d_model + n_layer * block + norm;
  if (gpt2) total += context * d_model;
  if (!tie_embeddings) total += vocab_size * d_model;
  return total;
}

double GptConfig::flops_per_token(std::int64_t seq_len) const {
  std::int64_t matmul = num_parameters();
  const bool gpt2 = family == "gpt2";
  const std::int64_t norm = gpt2 ? 2 * d_model : d_model;
  matmul -= (2 * n_layer + 1) * norm;  // norm weights (and biases)
  if (gpt2) {
    matmul -= context * d_model;  // learned positions: a lookup, no matmul
    matmul -= n_layer * ((n_head + 2 * n_kv_head) * head_dim() + 2 * d_model + mlp_hidden());
  }
  return 6.0 * static_cast<double>(matmul) +
         12.0 * static_cast<double>(n_layer * n_head * head_dim() * seq_len);
}

// ---------------------------------------------------------------------------------------
// Block

BlockImpl::BlockImpl(const GptConfig& c) : config_(c) {
  const bool gpt2 = c.family == "gpt2";
  const std::int64_t hd = c.head_dim();
  ln1_w_ = register_parameter("ln1_weight", torch::ones({c.d_model}));
  ln2_w_ = register_parameter("ln2_weight", torch::ones({c.d_model}));
  if (gpt2) {
    ln1_b_ = register_parameter("ln1_bias", torch::zeros({c.d_model}));
    ln2_b_ = register_parameter("ln2_bias", torch::zeros({c.d_model}));
  }
  auto linear = [&](std::int64_t in, std::int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(gpt2));
  };
  qkv_ = register_module("attn_qkv", linear(c.d_model, (c.n_head + 2 * c.n_kv_head) * hd));
  proj_ = register_module("attn_proj", linear(c.n_head * hd, c.d_model));
  fc_ = register_module("mlp_fc", linear(c.d_model, c.mlp_hidden()));
  if (!gpt2) gate_ = register_module("mlp_gate", linear(c.d_model, c.mlp_hidden()));
  down_ = register_module("mlp_proj", linear(c.mlp_hidden(), c.d_model));
}

namespace {
// The family's norm: LayerNorm (weight, bias) for gpt2, RMSNorm (weight) in float32 for llama.
torch::Tensor apply_norm(const GptConfig& c, const torch::Tensor& x, const torch::Tensor& w,
                         const torch::Tensor& b) {
  if (c.family == "gpt2") return torch::layer_norm(x, {c.d_model}, w, b, c.norm_eps);
  auto xf = x.to(torch::kFloat);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + c.norm_eps)).to(x.scalar_type()) * w;
}
}  // namespace

torch::Tensor BlockImpl::norm(const torch::Tensor& x, const torch::Tensor& w,
                              const torch::Tensor& b) const {
  return apply_norm(config_, x, w, b);
}

namespace {
// Rotary embedding on [B, H, T, D] with the half-split convention.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto T = x.size(2), half = x.size(3) / 2;
  // In the activations' dtype (bfloat16 parameters give bfloat16 q and k).
  auto c = cos.slice(0, 0, T).to(x.scalar_type()), s = sin.slice(0, 0, T).to(x.scalar_type());
  auto x1 = x.slice(3, 0, half), x2 = x.slice(3, half);
  return torch::cat({x1 * c - x2 * s, x1 * s + x2 * c}, 3);
}
}  // namespace

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& rope_cos,
                                 const torch::Tensor& rope_sin) {
  const auto B = x.size(0), T = x.size(1);
  const auto H = config_.n_head, Hkv = config_.n_kv_head, D = config_.head_dim();
  auto qkv = qkv_->forward(norm(x, ln1_w_, ln1_b_));
  auto q = qkv.slice(2, 0, H * D).view({B, T, H, D}).transpose(1, 2);
  auto k = qkv.slice(2, H * D, (H + Hkv) * D).view({B, T, Hkv, D}).transpose(1, 2);
  auto v = qkv.slice(2, (H + Hkv) * D).view({B, T, Hkv, D}).transpose(1, 2);
  if (config_.family == "llama") {
    q = rope(q, rope_cos, rope_sin);
    k = rope(k, rope_cos, rope_sin);
  }
  auto y = ops::attention(q, k, v, /*causal=*/true).transpose(1, 2).reshape({B, T, H * D});
  auto h = x + proj_->forward(y);
  auto n2 = norm(h, ln2_w_, ln2_b_);
  torch::Tensor m;
  if (config_.family == "gpt2") {
    m = torch::gelu(fc_->forward(n2), "tanh");
  } else {
    m = torch::silu(gate_->forward(n2)) * fc_->forward(n2);
  }
  return h + down_->forward(m);
}

namespace {
// Activation checkpointing: forward without a graph, recompute in backward (reentrant),
// parameter gradients accumulate during the recomputation's own backward.
struct CheckpointBlock : public torch::autograd::Function<CheckpointBlock> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               torch::Tensor cos, torch::Tensor sin, BlockImpl* block) {
    ctx->save_for_backward({x, cos, sin});
    // The block outlives the autograd graph (the model owns it); IValue cannot hold it.
    ctx->saved_data["block"] = reinterpret_cast<std::int64_t>(block);
    torch::NoGradGuard no_grad;
    return block->forward(x, cos, sin);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto* block = reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    torch::Tensor x = saved[0].detach().requires_grad_(true);
    torch::Tensor out;
    {
      torch::AutoGradMode enable(true);
      out = block->forward(x, saved[1], saved[2]);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace

// ---------------------------------------------------------------------------------------
// Model

GptImpl::GptImpl(ContextPtr ctx, const GptConfig& config, std::uint64_t seed)
    : ctx_(std::move(ctx)), config_(config) {
  DTRAIN_CHECK_ARG(ctx_ != nullptr, "Gpt needs a ParallelContext (ParallelContext::single_process() for one process)");
  config_.validate();
  const auto& c = config_;
  const bool gpt2 = c.family == "gpt2";
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(c.vocab_size, c.d_model));
  if (gpt2) pos_emb_ = register_module("pos_emb", torch::nn::Embedding(c.context, c.d_model));
  auto list = register_module("h", torch::nn::ModuleList());  // parameters "h.<i>.*"
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    blocks_.emplace_back(c);
    list->push_back(blocks_.back());
  }
  norm_weight_ = register_parameter("ln_f_weight", torch::ones({c.d_model}));
  if (gpt2) norm_bias_ = register_parameter("ln_f_bias", torch::zeros({c.d_model}));
  if (!c.tie_embeddings) {
    lm_head_ = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.vocab_size).bias(false)));
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
  // Initialisation: a pure function of the seed.
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double residual_std = c.init_std / std::sqrt(2.0 * c.n_layer);
  for (auto& item : named_parameters()) {
    auto& p = item.value();
    const auto& name = item.key();
    if (name.find("ln") != std::string::npos && name.find("weight") != std::string::npos && p.dim() == 1) {
      p.fill_(1.0);
    } else if (p.dim() == 1) {
      p.zero_();
    } else {
      const bool residual = name.find("attn_proj") != std::string::npos ||
                            name.find("mlp_proj") != std::string::npos;
      p.normal_(0.0, residual ? residual_std : c.init_std, gen);
    }
  }
  to(ctx_->device());
  if (rope_cos_.defined() && rope_cos_.numel() == 0) rope_cos_ = rope_sin_ = rope_cos_.to(ctx_->device());
}

NamedParameters GptImpl::parameter_list() const {
  NamedParameters out;
  for (const auto& item : named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx) {
  const auto& c = config_;
  DTRAIN_CHECK_ARG(idx.dim() == 2 && idx.size(1) <= c.context, "model input must be [batch, time] with time <= context ",
                   c.context, "; got ", idx.sizes());
  if (hooks_ != nullptr) hooks_->enter_embedding();
  auto x = tok_emb_->forward(idx);
  if (pos_emb_) x = x + pos_emb_->forward(torch::arange(idx.size(1), idx.options()));
  if (hooks_ != nullptr) x = hooks_->exit_embedding(x, c.tie_embeddings);
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    auto& block = blocks_[i];
    if (hooks_ != nullptr) x = hooks_->enter(i, x);
    if (c.activation_checkpointing && is_training() && torch::GradMode::is_enabled()) {
      x = CheckpointBlock::apply(x, rope_cos_, rope_sin_, block.get());
    } else {
      x = block->forward(x, rope_cos_, rope_sin_);
    }
    if (hooks_ != nullptr) x = hooks_->exit(i, x);
  }
  if (hooks_ != nullptr) x = hooks_->enter_head(x);
  x = apply_norm(c, x, norm_weight_, norm_bias_);
  return c.tie_embeddings ? torch::matmul(x, tok_emb_->weight.t()) : lm_head_->forward(x);
}

torch::Tensor GptImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  auto logits = forward(idx);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), targets.reshape({-1}));
}

}  // namespace dtrain::models
