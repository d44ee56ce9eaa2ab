// Decoder-only transformer in two families: GPT-2 (LayerNorm, GELU MLP, learned
// positions, tied embeddings) and Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention).
// Presets tiny / gpt2-124m / gpt2-350m / llama-1b; every field can be overridden. Tensor
// parallel over the context's tp group (heads, MLP and vocabulary split; optional sequence
// parallelism), starting from exactly the single-process model of the same seed.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/models/moe.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/optim/optim.hpp"
#include "dtrain/parallel/block_hooks.hpp"
#include "dtrain/parallel/context.hpp"
#include "dtrain/parallel/tensor_parallel.hpp"

namespace dtrain::models {

// A target the loss ignores (every loss path: the mean is over the other targets; 0 when
// none is left). PyTorch's default ignore_index.
inline constexpr std::int64_t kIgnoreTarget = -100;

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
  // QK-norm (Megatron's --qk-layernorm; Qwen3, OLMo 2): an RMSNorm over each head's query
  // and key before the rotary embedding, weights [head_dim] shared by the heads.
  bool qk_norm = false;
  // Activation checkpointing: the first recompute_blocks blocks of the model (of each
  // pipeline chunk) keep only their input and run their forward again in backward
  // (Megatron's --recompute-method block); -1: every block; 0: none.
  std::int64_t recompute_blocks = 0;
  // Sliding-window attention (Mistral's): 0 attends to every earlier token; W > 0 lets each
  // token attend to itself and the W - 1 before it (both attention backends).
  std::int64_t attention_window = 0;
  // Local and global layers (Megatron's --window-attn-skip-freq; gpt-oss: 2, Gemma 3: 6):
  // with attention_window, every N-th block (blocks N - 1, 2N - 1, ... from 0) attends to
  // every earlier token and the others keep the window; 0: every block windowed.
  std::int64_t window_skip_every = 0;
  // The window block `block` attends in (0: every earlier token).
  std::int64_t window_of(std::int64_t block) const {
    return window_skip_every > 0 && (block + 1) % window_skip_every == 0 ? 0 : attention_window;
  }
  // Logit soft-capping (Gemma 2: 50): the attention softmax takes c tanh(s / c) of each
  // scaled score s; 0: none. --attention flash only (sdpa has none); not with cp > 1.
  double attention_softcap = 0.0;
  // The attention softmax (Megatron's and Transformer Engine's --softmax-type): "vanilla";
  // "off-by-one", one more logit of 0 in every row's softmax (the probabilities of the keys
  // may sum to less than 1); "learnable", that logit a parameter per head and block
  // (attn_sinks [n_head], gpt-oss's attention sinks; starts at 0, no weight decay).
  // --attention flash only (sdpa has no sinks).
  std::string softmax_type = "vanilla";
  bool attention_sinks() const { return softmax_type != "vanilla"; }
  bool learned_sinks() const { return softmax_type == "learnable"; }
  // Packed documents (Megatron's --reset-attention-mask): -1 lets every token attend to
  // every earlier one; a token id >= 0 ends a document wherever it occurs, and tokens after
  // it attend only to tokens from there on (the separator belongs to the document it ends).
  // Both attention backends; a pipeline stage after the first takes the tokens alongside
  // its input (forward_stage).
  std::int64_t document_separator = -1;
  // Megatron's --reset-position-ids (needs document_separator): each document's positions
  // count from 0 (GPT-2's learned positions and Llama's rotary angles alike), so a packed
  // document is computed exactly as it would be alone at the start of a row.
  bool reset_position_ids = false;
  // Dropout on the embeddings, the attention probabilities and both residual branches
  // (training only); masks come from the model's tp::RngTracker.
  double dropout = 0.0;
  // PaLM's z-loss (training only): z_loss lse^2 added to each token's loss, lse the log of
  // its softmax's normaliser, which keeps the logits from drifting (PaLM: 1e-4; OLMo).
  // Every loss form takes it (ops::CrossEntropyOptions::z_loss); the loss in eval mode
  // (validation) is the cross-entropy alone. Finite, >= 0.
  double z_loss = 0.0;
  // Mixture of experts: the MLP of every moe.every-th block (from block 0) becomes
  // moe.experts SwiGLU experts of which the router picks moe.topk per token.
  ep::MoeOptions moe;
  // Which implementation of each op the model calls (not architecture: a checkpoint loads
  // under any choice). attention: sdpa (LibTorch) or flash (ops::flash_attention; no
  // dropout); fused_norm: ops::rms_norm / ops::layer_norm; fused_ce: ops::cross_entropy
  // (with tp > 1 over each rank's vocabulary columns: tp::fused_vocab_parallel_cross_entropy),
  // whose logit gradient replaces the logits in the forward; fused_swiglu: ops::swiglu for
  // the SwiGLU MLPs (llama, and every MoE expert); fused_rope: ops::rope for llama's rotary
  // embeddings; fused_linear_ce: ops::linear_cross_entropy, the head's matmul and the loss
  // over chunks of rows, never all the logits at once (with tp > 1 over each rank's rows
  // of the head: tp::fused_vocab_parallel_linear_cross_entropy).
  ops::AttentionBackend attention = ops::AttentionBackend::kSdpa;
  bool fused_norm = false;
  bool fused_ce = false;
  bool fused_swiglu = false;
  bool fused_rope = false;
  bool fused_linear_ce = false;

  // Raises InvalidArgument listing the known presets.
  static GptConfig preset(const std::string& name);
  // Raises InvalidArgument naming the field, its value and what is allowed.
  void validate() const;
  // Raises InvalidArgument naming the size and tp when tensor parallelism over tp ranks
  // cannot split it: n_head and the MLP width must be multiples of tp (n_kv_head need not:
  // key/value heads are replicated when tp does not divide them; the vocabulary is padded).
  void validate_tp(int tp) const;
  std::int64_t head_dim() const { return d_model / n_head; }
  std::int64_t mlp_hidden() const;
  std::int64_t expert_hidden() const { return moe.ffn_hidden > 0 ? moe.ffn_hidden : mlp_hidden(); }
  // Parameter count from the shapes (what the module registers).
  std::int64_t num_parameters() const;
  // The single-process model's parameters (name, shape) in registration order: the order
  // the initialisation draws them in.
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> parameter_shapes() const;
  // Training FLOPs (forward + backward) per token at sequence length seq_len: 6 per
  // weight used in a matmul (of a MoE layer: the router and topk experts) (every parameter except norms, biases and learned positions;
  // the tied embedding counts once, as the output projection) plus attention's
  // 12 * n_layer * n_head * head_dim * seq_len (scores and values, causal mask ignored,
  // as in PaLM and nanoGPT; with a sliding window, min(seq_len, window) keys in each block
  // that has one, window_of).
  double flops_per_token(std::int64_t seq_len) const;
};

// How one of a rank's parameters relates to the single-process parameter of the same
// name under tensor parallelism: the rank holds the ranges of the full tensor along dim,
// concatenated in order (a range running past the full size is padding: zeros).
struct TpShard {
  std::vector<std::int64_t> full_shape;
  std::int64_t dim = -1;  // -1: the whole tensor, replicated on every tp rank
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;  // (start, length) along dim
  // Local elements [replicated_from, numel) are the same on every tp rank and get the same
  // gradient: 0 for a replicated tensor, the key/value rows of attn_qkv when tp does not
  // divide n_kv_head, numel for a tensor wholly split.
  std::int64_t replicated_from = 0;
};

// What a block needs of its tensor-parallel group.
struct TpEnv {
  CommPtr comm;
  int rank = 0, size = 1;
  bool sequence_parallel = false;
  std::shared_ptr<tp::RngTracker> rng;
  CommPtr ep;  // the expert-parallel group (MoE blocks)
  CommPtr cp;  // the context-parallel group (attention over the whole sequence); null: none
  CpComm cp_comm = CpComm::kAllGather;
};

// One transformer block (pre-norm attention + MLP with residuals): attention heads and the
// MLP width split across tp (column-parallel in, row-parallel out); block `index` of a MoE
// model may have a Moe in place of the MLP.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GptConfig& config, TpEnv tp, std::int64_t index = 0);
  // documents: each token's document (undefined: one document per row).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& rope_cos, const torch::Tensor& rope_sin,
                        const ops::Documents& documents = {});
  // Whether this rank holds its own n_kv_head / tp key/value heads (else all of them).
  bool kv_split() const { return config_.n_kv_head % tp_.size == 0; }
  // Its attention's sliding window (0: every earlier token; GptConfig::window_of).
  std::int64_t window() const { return window_; }
  tp::RngTracker& rng() { return *tp_.rng; }
  Moe moe() const { return moe_; }  // null for a dense block

 private:
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) const;
  torch::Tensor attention(const torch::Tensor& in, const torch::Tensor& rope_cos, const torch::Tensor& rope_sin,
                          const ops::Documents& documents);
  GptConfig config_;
  TpEnv tp_;
  std::int64_t window_ = 0;
  tp::ParallelLinearOptions column_, row_;
  torch::Tensor ln1_w_, ln1_b_, ln2_w_, ln2_b_;
  torch::Tensor q_norm_w_, k_norm_w_;                       // qk_norm: [head_dim], replicated
  torch::Tensor sinks_;  // softmax_type learnable: [n_head / tp], this rank's heads'
  torch::Tensor zero_sinks_;  // off-by-one: float32 zeros [n_head / tp], made on the first forward's device
  torch::Tensor qkv_w_, qkv_b_;                             // attn_qkv: this rank's q, k, v rows
  tp::RowParallelLinear proj_{nullptr}, down_{nullptr};     // attention out, MLP out
  tp::ColumnParallelLinear fc_{nullptr}, gate_{nullptr};    // MLP in (gate: llama)
  Moe moe_{nullptr};                                        // in place of the MLP
};
TORCH_MODULE(Block);

// The part of the model one pipeline stage holds (the whole model by default): blocks
// [first_block, end_block), the embeddings on the first stage, the final norm and the
// output projection on the last; with tied embeddings the last stage holds its own copy of
// the token embedding for the head (the pipeline sums the two copies' gradients).
struct GptStage {
  std::int64_t first_block = 0;
  std::int64_t end_block = -1;  // -1: n_layer
  bool embedding = true;
  bool head = true;
};

// forward(idx [B, T] int64) -> logits [B, T, vocab]. Initialisation is a pure function of
// the seed given to the constructor: normal(0, init_std) weights, zero biases, residual
// output projections scaled by 1/sqrt(2 * n_layer) (GPT-2); each full tensor is drawn on
// the CPU in turn and this rank keeps its tensor-parallel slice, then moved to the
// context's device, so every device and layout starts from the same model.
//
// Tensor parallelism (ctx tp > 1): vocabulary-parallel embedding and output projection
// (the loss never gathers the logits), heads and MLP width split; with sequence
// parallelism the residual stream, norms and dropout hold T / tp positions per rank.
// Expert parallelism (ctx ep > 1): each rank holds experts expert_rows() of every MoE
// layer. MoE auxiliary losses are not part of loss(): their gradients enter in backward,
// scaled by set_loss_grad_scale.
// Context parallelism (ctx cp > 1): every cp rank is given the whole micro-batch (token
// ids, targets) and computes its cp::take_local share of the positions; attention sees
// the whole sequence through cp::attention (ctx's cp_comm). forward() gathers the logits
// of every position; loss() is the mean over this rank's positions (the trainer weighs it).
class GptImpl : public torch::nn::Module {
 public:
  // Raises InvalidArgument for an invalid config (see GptConfig::validate) or stage.
  // A stage's parameters equal the whole model's parameters of the same names.
  GptImpl(ContextPtr ctx, const GptConfig& config, std::uint64_t seed, GptStage stage = {});
  // The whole model only (forward_stage for a pipeline stage).
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of the next-token predictions over the targets that are not
  // kIgnoreTarget (the whole model only; under cp, over this rank's positions).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);
  // This stage on `input` (token ids [B, T] when it holds the embeddings, else the previous
  // stage's output): the output the next stage receives, or, on the last stage, the final
  // norm's output, which loss_from_hidden() finishes.
  // tokens: the micro-batch's token ids [B, T], which a stage after the first needs with a
  // document separator (the first stage's input is them).
  torch::Tensor forward_stage(const torch::Tensor& input, const torch::Tensor& tokens = {});
  torch::Tensor loss_from_hidden(const torch::Tensor& hidden, const torch::Tensor& targets);
  const GptStage& stage() const { return stage_; }
  bool is_whole() const;
  const GptConfig& config() const { return config_; }
  const ContextPtr& context() const { return ctx_; }
  // Trainable parameters with their names ("tok_emb.weight", "h.0.attn_qkv.weight", ...)
  // in registration order.
  NamedParameters parameter_list() const;
  // Installs hooks called around every block's forward (null removes them); the caller
  // keeps them alive while the model runs.
  void set_block_hooks(BlockHooks* hooks) { hooks_ = hooks; }
  // Each parameter's tensor-parallel layout, in parameter_list() order. For an expert
  // parameter (is_expert_parameter) it is relative to this rank's experts: full_shape's
  // first dimension is E / ep, the rows expert_rows() of the single-process tensor.
  const std::vector<std::pair<std::string, TpShard>>& tp_shards() const { return shards_; }
  // The single-process parameters, assembled from every tp rank's slices and every ep
  // rank's experts (collective over the tp and ep groups; copies, on the model's device). With one tp rank: copies of the local ones.
  NamedParameters full_parameters() const;
  tp::RngTracker& rng() { return *tp_.rng; }
  // (first, count) of the experts this rank holds in every MoE layer ((0, E) at ep = 1).
  std::pair<std::int64_t, std::int64_t> expert_rows() const;
  // This stage's MoE layers with their block indices, in order.
  std::vector<std::pair<std::int64_t, Moe>> moe_layers() const;
  // The factor the caller multiplies the loss by before backward; 1 by default. Every MoE
  // layer's auxiliary losses get the same, and the fused cross-entropy writes the logit
  // gradient for it in the forward (another factor costs its backward a rescaling pass).
  void set_loss_grad_scale(double scale) { set_loss_grad_scale(scale, scale); }
  // The same with another factor for the MoE auxiliary losses (the trainer weighs the
  // loss of a micro-batch by its share of the step's loss tokens, the auxiliary losses by
  // micro-batch).
  void set_loss_grad_scale(double scale, double aux_scale);

 private:
  torch::Tensor head_input(const torch::Tensor& h);    // h in tp's column region (whole sequence)
  torch::Tensor local_logits(const torch::Tensor& h);  // [B, T, padded vocab / tp]
  void initialise(std::uint64_t seed);

  BlockHooks* hooks_ = nullptr;
  ContextPtr ctx_;
  GptConfig config_;
  GptStage stage_;
  double loss_grad_scale_ = 1.0;
  TpEnv tp_;
  tp::VocabParallelEmbedding tok_emb_{nullptr};  // first stage; last stage too when tied
  torch::nn::Embedding pos_emb_{nullptr};  // gpt2 only; replicated
  std::vector<Block> blocks_;               // this stage's, from stage_.first_block
  torch::Tensor norm_weight_, norm_bias_;   // final norm (bias: gpt2 only)
  tp::ColumnParallelLinear lm_head_{nullptr};  // only without tied embeddings (padded vocab)
  torch::Tensor rope_cos_, rope_sin_;       // llama only: [context, head_dim / 2]
  // cos and sin for the blocks' rope: rope_cos_/rope_sin_ as they are, or, with positions
  // [B, T], theirs per token [B, 1, T, head_dim / 2], or with positions [T] their rows.
  std::pair<torch::Tensor, torch::Tensor> rope_angles(const torch::Tensor& positions) const;
  std::vector<std::pair<std::string, TpShard>> shards_;
};
TORCH_MODULE(Gpt);

}  // namespace dtrain::models
