// Decoder-only transformer in two families: GPT-2 (LayerNorm, GELU MLP, learned
// positions, tied embeddings) and Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention).
// Presets tiny / gpt2-124m / gpt2-350m / llama-1b; every field can be overridden.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/optim/optim.hpp"
#include "dtrain/parallel/block_hooks.hpp"
#include "dtrain/parallel/context.hpp"

namespace dtrain::models {

struct GptConfig {
  std::string family = "gpt2";  // "gpt2" or "llama"
  std::int64_t vocab_size = 50304;
  std::int64_t context = 1024;
  std::int64_t n_layer = 12;
  std::int64_t n_head = 12;
  std::int64_t n_kv_head = 12;   // llama: < n_head for grouped-query attention
  std::int64_t d_model = 768;
  std::int64_t ffn_hidden = 0;   // 0: 4*d (gpt2) or SwiGLU's 8/3*d rounded up to 256 (llama)
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  bool tie_embeddings = true;     // output projection shares the token embedding
  bool activation_checkpointing = false;  // recompute each block in backward

  // Raises InvalidArgument listing the known presets.
  static GptConfig preset(const std::string& name);
  // Raises InvalidArgument naming the field, its value and what is allowed.
  void validate() const;
  std::int64_t head_dim() const { return d_model / n_head; }
  std::int64_t mlp_hidden() const;
  // Parameter count from the shapes (what the module registers).
  std::int64_t num_parameters() const;
  // Training FLOPs (forward + backward) per token at sequence length seq_len: 6 per
  // weight used in a matmul (every parameter except norms, biases and learned positions;
  // the tied embedding counts once, as the output projection) plus attention's
  // 12 * n_layer * n_head * head_dim * seq_len (scores and values, causal mask ignored,
  // as in PaLM and nanoGPT).
  double flops_per_token(std::int64_t seq_len) const;
};

// One transformer block (pre-norm attention + MLP with residuals).
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& config);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cos,
                        const torch::Tensor& rope_sin);

 private:
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) const;
  GptConfig config_;
  torch::Tensor ln1_w_, ln1_b_, ln2_w_, ln2_b_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr};  // attention in / out
  torch::nn::Linear fc_{nullptr}, gate_{nullptr}, down_{nullptr};  // MLP (gate: llama)
};
TORCH_MODULE(Block);

// forward(idx [B, T] int64) -> logits [B, T, vocab]. Initialisation is a pure function of
// the seed given to the constructor: normal(0, init_std) weights, zero biases, residual
// output projections scaled by 1/sqrt(2 * n_layer) (GPT-2); drawn on the CPU, then moved
// to the context's device, so every device and layout starts from the same model.
class GptImpl : public torch::nn::Module {
 public:
  // Raises InvalidArgument for an invalid config (see GptConfig::validate).
  GptImpl(ContextPtr ctx, const GptConfig& config, std::uint64_t seed);
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of the next-token predictions.
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);
  const GptConfig& config() const { return config_; }
  const ContextPtr& context() const { return ctx_; }
  // Trainable parameters with their names ("tok_emb.weight", "h.0.attn_qkv.weight", ...)
  // in registration order.
  NamedParameters parameter_list() const;
  // Installs hooks called around every block's forward (null removes them); the caller
  // keeps them alive while the model runs.
  void set_block_hooks(BlockHooks* hooks) { hooks_ = hooks; }

 private:
  BlockHooks* hooks_ = nullptr;
  ContextPtr ctx_;
  GptConfig config_;
  torch::nn::Embedding tok_emb_{nullptr}, pos_emb_{nullptr};  // pos: gpt2 only
  std::vector<Block> blocks_;
  torch::Tensor norm_weight_, norm_bias_;  // final norm (bias: gpt2 only)
  torch::nn::Linear lm_head_{nullptr};     // only without tied embeddings
  torch::Tensor rope_cos_, rope_sin_;      // llama only: [context, head_dim / 2]
};
TORCH_MODULE(Gpt);

}  // namespace dtrain::models
