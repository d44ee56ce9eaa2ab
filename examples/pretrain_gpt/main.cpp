// pretrain_gpt: GPT-2 / Llama pretraining with data parallelism, on CPUs over MPI or on
// GPUs over NCCL. Options come from CLI11 flags and an optional JSON config whose keys are
// the long flag names ({"preset": "tiny", "seq-len": 64}); flags given on the command line
// override the file. Exit codes: 0 done, 2 bad input (named in the message; an unusable
// --resume checkpoint too), 1 failure, 75 preempted (SIGTERM/SIGUSR1 or --exit-duration-mins:
// saved, then stopped).
//
//   mpirun -np 2 build/examples/pretrain_gpt --config examples/configs/tiny.json
//       --train-data 'data/fortunes/fortunes_train_*.bin' --val-data 'data/fortunes/fortunes_val_*.bin'
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtrain/checkpoint/safetensors.hpp"
#include "dtrain/comm/launch_env.hpp"
#include "dtrain/comm/runtime.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/models/hf_names.hpp"
#include "dtrain/core/logging.hpp"
#include "dtrain/train/trainer.hpp"

namespace {

using dtrain::InvalidArgument;

constexpr int kExitBadInput = 2;
constexpr int kExitFailure = 1;
constexpr int kExitPreempted = 75;  // EX_TEMPFAIL: stopped after saving (a signal or the time limit)

struct Options {
  std::string config;
  std::string backend = "auto";
  int dp = 0, dp_shard = 0, tp = 1, pp = 1, ep = 1, cp = 1;
  std::string cp_comm = "all_gather";
  dtrain::ep::MoeOptions moe;
  bool moe_dropless = false;
  bool sequence_parallel = false;
  double dropout = 0.0;
  double z_loss = 0.0;
  // Model: the preset, then any field overridden (-1 / empty: the preset's value).
  std::string preset = "tiny";
  std::string family, tie_embeddings, activation_checkpointing = "none";
  std::int64_t vocab_size = -1, context = -1, n_layer = -1, n_head = -1, n_kv_head = -1,
               d_model = -1, ffn_hidden = -1;
  std::int64_t attention_window = 0;
  std::int64_t window_skip_every = 0;
  double attention_softcap = 0.0;
  std::string softmax_type = "vanilla";
  std::int64_t document_separator = -1;
  bool reset_position_ids = false;
  bool qk_norm = false;
  double bucket_mb = 25;
  std::string export_hf;
  bool eval_only = false;
  // Kernels (docs/kernels.md): which implementation of attention, norms and the loss.
  std::string attention = "sdpa";
  // The fused norm, loss and optimizer: on by default on CUDA (the faster choice on an H200,
  // docs/benchmarks.md), LibTorch's ops on the CPU, where the kernels' reference paths are
  // slower; --fused-* / --no-fused-* force either way.
  bool fused_norm = false, fused_ce = false, fused_adamw = false, fused_swiglu = false, fused_rope = false;
  bool no_fused_norm = false, no_fused_ce = false, no_fused_adamw = false, no_fused_swiglu = false, no_fused_rope = false;
  // The head and the loss over chunks of rows (memory, not speed: off unless asked for).
  bool fused_linear_ce = false;
  dtrain::train::TrainOptions train;
};

void define(CLI::App& app, Options& o) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)->always_capture_default();
  auto& t = o.train;
  app.add_option("--config", o.config, "JSON file of options (keys: the long flag names); flags override it")
      ->check(CLI::ExistingFile);
  const char* run = "Run";
  app.add_option("--backend", o.backend, "communication backend")->check(CLI::IsMember({"auto", "mpi", "nccl"}))->group(run);
  app.add_option("--dp", o.dp, "data-parallel degree (0: all ranks)")->group(run);
  app.add_option("--dp-shard", o.dp_shard, "ranks per replica for --fsdp hybrid (0: no hybrid)")->group(run);
  app.add_option("--tp", o.tp, "tensor-parallel degree (adjacent ranks; heads, MLP width and vocabulary split)")->group(run);
  app.add_flag("--sequence-parallel", o.sequence_parallel, "with --tp: split the activations between tensor-parallel layers along the sequence")->group(run);
  app.add_option("--cp", o.cp, "context-parallel degree (each sequence split across cp ranks; --seq-len a multiple of 2 x cp)")->group(run);
  app.add_option("--cp-comm", o.cp_comm, "with --cp: all_gather (keys and values gathered; any --attention), a2a (heads exchanged for positions; any --attention, heads divisible by cp) or p2p (ring attention; --attention flash)")->check(CLI::IsMember({"all_gather", "a2a", "p2p"}))->group(run);
  app.add_option("--ep", o.ep, "expert-parallel degree (splits the dp ranks; each holds experts / ep of every MoE layer)")->group(run);
  app.add_option("--pp", o.pp, "pipeline stages (outermost axis; blocks cut into consecutive stages)")->group(run);
  app.add_option("--pp-schedule", t.pp_schedule, "with --pp: gpipe, 1f1b, interleaved or zb (zero bubble, ZB-H1)")->group(run);
  app.add_option("--microbatches", t.microbatches, "micro-batches per step (global batch / (dp x M) samples each; 0: from --micro-batch)")->group(run);
  app.add_option("--virtual-stages", t.virtual_stages, "with --pp-schedule interleaved: model chunks per rank")->group(run);
  app.add_option("--pp-layers", t.pp_layers, "with --pp: blocks per virtual stage, e.g. 3,3,2,2 (default: balanced by parameter count)")->group(run);
  app.add_option("--steps", t.steps, "optimizer steps")->group(run);
  app.add_option("--seed", t.seed, "seed of the initialisation and of the data order")->group(run);
  app.add_option("--precision", t.precision, "fp32, bf16 or fp16: autocast matmuls to that dtype (fp16 with dynamic loss scaling)")->group(run);
  app.add_flag("--deterministic", t.deterministic, "bitwise-reproducible runs: LibTorch's deterministic algorithms, cuBLAS's deterministic workspace and flash attention's deterministic backward (slower on GPUs; Megatron's --deterministic-mode)")->group(run);
  app.add_option("--loss-scale-init", t.loss_scale_init, "float16: initial dynamic loss scale")->group(run);
  app.add_option("--loss-scale-window", t.loss_scale_window, "float16: overflow-free steps before the loss scale doubles")->group(run);

  const char* model = "Model";
  app.add_option("--preset", o.preset, "model preset: tiny, gpt2-124m, gpt2-350m, llama-1b")->group(model);
  app.add_option("--family", o.family, "gpt2 or llama (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--vocab-size", o.vocab_size, "vocabulary size (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--context", o.context, "maximum sequence length (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--n-layer", o.n_layer, "transformer blocks (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--n-head", o.n_head, "attention heads (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--n-kv-head", o.n_kv_head, "key/value heads, llama only (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--d-model", o.d_model, "model width (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--ffn-hidden", o.ffn_hidden, "MLP width, 0: 4 x d (gpt2) or SwiGLU 8/3 x d (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--tie-embeddings", o.tie_embeddings, "true or false (default: the preset's)")->default_str("preset")->group(model);
  app.add_option("--attention-window", o.attention_window, "sliding-window attention: each token attends to itself and the W - 1 before it (0: all earlier tokens)")->group(model);
  app.add_option("--window-attn-skip-freq", o.window_skip_every, "with --attention-window: every N-th block attends to every earlier token, the others keep the window (local and global layers: gpt-oss 2, Gemma 3 6; Megatron's --window-attn-skip-freq; 0: every block windowed)")->group(model);
  app.add_option("--attention-softcap", o.attention_softcap, "logit soft-capping: the attention softmax takes c tanh(s / c) of each scaled score (Gemma 2: 50; 0: none; --attention flash)")->group(model);
  app.add_option("--softmax-type", o.softmax_type, "the attention softmax: vanilla, off-by-one (one more logit of 0 in every row) or learnable (that logit a parameter per head and block: gpt-oss's attention sinks); Megatron's --softmax-type; not vanilla: --attention flash")->group(model);
  app.add_option("--document-separator", o.document_separator, "packed documents: this token id ends a document, and tokens after it attend only to tokens from there on (Megatron's --reset-attention-mask; GPT-2's <|endoftext|> is 50256, the byte tokenizer's newline 10; -1: none)")->group(model);
  app.add_flag("--reset-position-ids", o.reset_position_ids, "with --document-separator: each document's positions count from 0 (Megatron's --reset-position-ids)")->group(model);
  app.add_flag("--qk-norm", o.qk_norm, "RMSNorm over each head's query and key before the rotary embedding (Megatron's --qk-layernorm; Qwen3, OLMo 2)")->group(model);
  app.add_option("--dropout", o.dropout, "dropout on embeddings, attention probabilities and residual branches (training only)")->group(model);
  app.add_option("--z-loss", o.z_loss, "PaLM's z-loss coefficient: z x log(Z)^2 added to each token's training loss, Z its softmax's normaliser (PaLM: 1e-4; 0: none; validation loss leaves it out)")->group(model);
  app.add_option("--activation-checkpointing", o.activation_checkpointing, "none, full (every block recomputes its forward in backward), or N: the first N blocks of the model (of each pipeline chunk)")->group(model);

  const char* kernels = "Kernels";
  app.add_option("--attention", o.attention, "sdpa (LibTorch's scaled_dot_product_attention) or flash (dtrain's kernel on CUDA: bf16/fp16, head dims multiples of 8 up to 256)")->group(kernels);
  auto on_off = [&](const std::string& name, bool& on, bool& off, const std::string& what) {
    auto* yes = app.add_flag("--" + name, on, what + " (default: on CUDA, not on the CPU)")->group(kernels);
    app.add_flag("--no-" + name, off, "LibTorch's op instead of --" + name)->group(kernels)->excludes(yes);
  };
  on_off("fused-norm", o.fused_norm, o.no_fused_norm, "fused RMSNorm/LayerNorm (one kernel each way)");
  on_off("fused-ce", o.fused_ce, o.no_fused_ce, "fused softmax cross-entropy from the logits' own dtype (with --tp: over each rank's vocabulary columns)");
  on_off("fused-swiglu", o.fused_swiglu, o.no_fused_swiglu,
         "fused SwiGLU, silu(gate) * up (llama MLPs and MoE experts; one kernel each way, silu(gate) not saved)");
  on_off("fused-rope", o.fused_rope, o.no_fused_rope,
         "fused rotary embeddings (llama; one kernel each way, float32 angles)");
  app.add_flag("--fused-linear-ce", o.fused_linear_ce,
               "the head's matmul and the loss over chunks of rows, never all the logits in memory (Liger's fused "
               "linear cross-entropy; at --tp > 1 over each rank's rows of the head; default off)")
      ->group(kernels);
  on_off("fused-adamw", o.fused_adamw, o.no_fused_adamw,
         "one multi-tensor AdamW pass per step (with --fsdp: the 16-bit parameter shard written in the same pass)");

  const char* data = "Data";
  const char* moe = "Mixture of experts";
  app.add_option("--moe-experts", o.moe.experts, "experts per MoE layer (0: dense MLPs)")->group(moe);
  app.add_option("--moe-topk", o.moe.topk, "experts each token is routed to")->group(moe);
  app.add_option("--moe-every", o.moe.every, "block b is a MoE block when b % N == 0")->group(moe);
  app.add_option("--moe-ffn-hidden", o.moe.ffn_hidden, "each expert's SwiGLU width (0: the MLP width)")->group(moe);
  auto* capacity = app.add_option("--moe-capacity", o.moe.capacity_factor,
                                  "capacity factor: an expert takes at most C x tokens x topk / experts of a rank's tokens per forward; the rest pass through the residual (0: dropless)")->group(moe);
  app.add_flag("--moe-dropless", o.moe_dropless, "no capacity limit (the default; same as --moe-capacity 0)")->excludes(capacity)->group(moe);
  app.add_option("--moe-score", o.moe.score, "router scores: softmax or sigmoid")->group(moe);
  app.add_option("--moe-aux-coeff", o.moe.aux_loss_coeff, "load-balancing loss coefficient (Switch/GShard)")->group(moe);
  app.add_option("--moe-z-coeff", o.moe.z_loss_coeff, "router z-loss coefficient")->group(moe);
  app.add_option("--moe-bias-rate", o.moe.bias_update_rate, "aux-loss-free balancing: per-expert bias update rate per step (0: off)")->group(moe);
  app.add_option("--train-data", t.train_data, "glob of training token shards (llm.c format), or a blend \"W1 GLOB1 W2 GLOB2 ...\": each batch takes shares W of its samples from the globs (Megatron's --data-path)")->group(data);
  app.add_option("--val-data", t.val_data, "glob of validation token shards (empty: no evaluation)")->group(data);
  app.add_option("--seq-len", t.seq_len, "tokens per sample")->group(data);
  app.add_option("--global-batch", t.global_batch, "samples per optimizer step over all ranks")->group(data);
  app.add_option("--micro-batch", t.micro_batch, "samples per rank per forward (0: global / dp, no accumulation)")->group(data);
  app.add_flag("--eod-mask-loss", t.eod_mask_loss, "with --document-separator: no loss on the prediction made at a separator; the loss is the mean over the global batch's other targets (Megatron's --eod-mask-loss)")->group(data);

  const char* optim = "Optimizer";
  app.add_option("--lr", t.adamw.lr, "peak learning rate")->group(optim);
  app.add_option("--min-lr", t.min_lr, "learning rate at the end of the decay")->default_str("lr / 10")->group(optim);
  app.add_option("--warmup-steps", t.warmup_steps, "linear warm-up steps")->group(optim);
  app.add_option("--lr-decay", t.lr_decay, "decay from lr to min-lr: cosine, linear, sqrt (1 - sqrt) or constant (none)")->group(optim);
  app.add_option("--lr-decay-steps", t.lr_decay_steps, "the decay spans the last N steps, lr held before them (warmup-stable-decay); 0: every step after the warm-up")->group(optim);
  app.add_option("--weight-decay", t.adamw.weight_decay, "AdamW decoupled weight decay (not on norms, biases, embeddings)")->group(optim);
  app.add_option("--beta1", t.adamw.beta1, "AdamW beta1")->group(optim);
  app.add_option("--beta2", t.adamw.beta2, "AdamW beta2")->group(optim);
  app.add_option("--grad-clip", t.grad_clip, "clip gradients to this global L2 norm (0: off)")->group(optim);

  const char* ddp = "Data parallelism";
  app.add_option("--fsdp", t.fsdp, "sharding: none (replicated), zero1 (optimizer state), zero2 (+ gradients), full (+ parameters), hybrid (full within --dp-shard ranks, replicated across)")
      ->group(ddp);
  app.add_option("--fsdp-prefetch", t.fsdp_prefetch, "full/hybrid: blocks whose all-gather is issued ahead")
      ->group(ddp);
  app.add_option("--fsdp-reshard-after-forward", t.fsdp_reshard_after_forward,
                 "full/hybrid: free each block between its forward and its backward (false: keep, more memory)")
      ->group(ddp);
  app.add_option("--param-dtype", t.param_dtype, "--fsdp: parameters' compute dtype: float32, bfloat16, float16 (float32 masters)")
      ->group(ddp);
  app.add_option("--reduce-dtype", t.reduce_dtype, "--fsdp: gradient reduction dtype: float32, bfloat16, float16")->group(ddp);
  app.add_option("--bucket-mb", o.bucket_mb, "gradient bucket size in MiB")->group(ddp);
  app.add_flag("--bf16-reduce", t.ddp.bf16_reduce, "all-reduce gradients in bfloat16")->group(ddp);
  app.add_flag("--allow-unused", t.ddp.allow_unused, "reduce parameters without a gradient as zeros instead of failing")->group(ddp);

  const char* report = "Reporting";
  app.add_option("--eval-every", t.eval_every, "evaluate on --val-data every N steps (0: at the end only)")->group(report);
  app.add_option("--eval-batches", t.eval_batches, "val batches (of --global-batch samples) per evaluation")->group(report);
  app.add_option("--log-every", t.log_every, "log a step line every N steps")->group(report);
  app.add_option("--metrics", t.metrics_path, "JSON-lines metrics file written by rank 0")->group(report);
  app.add_option("--trace", t.trace_path, "Chrome trace (Perfetto) per rank: FILE.json -> FILE.rank<r>.json; merge_traces joins them")
      ->group(report);
  app.add_option("--peak-tflops", t.peak_tflops, "peak TFLOP/s of one device for MFU (0: known-GPU table)")->group(report);
  app.add_option("--progress", t.progress, "progress bar: auto (terminal), on, off")->group(report);
  app.add_flag("--sync-timing", t.sync_timing, "synchronize the device between phases for an exact time breakdown")->group(report);
  const char* ckpt = "Checkpoints and faults";
  app.add_option("--save-dir", t.save_dir, "checkpoint directory (step_<N>/ per save; also saved after the last step and on SIGTERM/SIGUSR1)")->group(ckpt);
  app.add_option("--save-every", t.save_every, "save every N steps (0: only at the end and on a preemption signal)")->group(ckpt);
  app.add_flag("--async-save", t.async_save, "periodic saves copy the state to host memory and write it in the background")->group(ckpt);
  app.add_option("--keep-checkpoints", t.keep_checkpoints, "keep the newest N checkpoints (0: all)")->group(ckpt);
  app.add_option("--resume", t.resume, "auto (newest good checkpoint under --save-dir, if any) or a checkpoint directory; any layout loads into any other")->group(ckpt);
  app.add_option("--export-hf", o.export_hf, "after training, write the whole model under Hugging Face names to this safetensors file")->group(ckpt);
  app.add_option("--init-from", t.init_from, "start from the parameters of a Hugging Face-named safetensors file (fine-tuning; optimizer fresh)")->group(ckpt);
  app.add_flag("--eval-only", o.eval_only, "no training: evaluate the model (from --resume or --init-from) on --val-data, log its val loss and exit (then --export-hf, if given)")->group(ckpt);
  app.add_option("--exit-duration-mins", t.exit_duration_mins, "save and stop (exit 75, as on SIGTERM) after the first step that ends this many minutes after start-up; 0: no limit")->group(ckpt);
  app.add_option("--max-skipped-steps", t.max_skipped_steps, "abort after N steps in a row with non-finite gradients (each is skipped)")->group(ckpt);
}

// "--key value" tokens for every entry of the JSON config, checked against the app.
std::vector<std::string> config_tokens(const CLI::App& app, const std::string& path) {
  std::ifstream in(path);
  DTRAIN_CHECK_ARG(in.good(), "--config '", path, "' cannot be read");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(dtrain::detail::str_cat("--config '", path, "' is not valid JSON: ", e.what()));
  }
  DTRAIN_CHECK_ARG(j.is_object(), "--config '", path, "' must hold one JSON object");
  std::vector<std::string> out;
  for (const auto& [key, value] : j.items()) {
    DTRAIN_CHECK_ARG(key != "config" && app.get_option_no_throw("--" + key) != nullptr,
                     "--config '", path, "': unknown key '", key,
                     "'; allowed: the long option names listed by --help, without the dashes");
    std::string text;
    if (value.is_string()) {
      text = value.get<std::string>();
    } else if (value.is_boolean() || value.is_number()) {
      text = value.dump();
    } else {
      throw InvalidArgument(dtrain::detail::str_cat("--config '", path, "': key '", key,
                                                    "' must be a string, number or boolean"));
    }
    out.push_back("--" + key + "=" + text);
  }
  return out;
}

// The config file's path, found before the real parse (the file's values go first).
std::string find_config(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) return argv[i + 1];
    if (a.rfind("--config=", 0) == 0) return a.substr(9);
  }
  return "";
}

// The fused kernels' choice, once the device is known: as given (--fused-x, also
// --fused-x=false from a config file, or --no-fused-x), else on CUDA only.
void resolve_kernels(const CLI::App& app, Options& o, bool cuda) {
  auto pick = [&](const std::string& name, bool on, bool off) {
    if (app.count("--" + name) > 0) return on;
    if (app.count("--no-" + name) > 0) return !off;
    return cuda;
  };
  o.fused_norm = pick("fused-norm", o.fused_norm, o.no_fused_norm);
  o.fused_ce = pick("fused-ce", o.fused_ce, o.no_fused_ce);
  o.fused_adamw = pick("fused-adamw", o.fused_adamw, o.no_fused_adamw);
  o.fused_swiglu = pick("fused-swiglu", o.fused_swiglu, o.no_fused_swiglu);
  o.fused_rope = pick("fused-rope", o.fused_rope, o.no_fused_rope);
  o.train.adamw.fused = o.fused_adamw;
}

// --activation-checkpointing: none (0), full (-1: every block) or a number of blocks.
std::int64_t recompute_blocks(const std::string& value) {
  if (value == "none") return 0;
  if (value == "full") return -1;
  std::size_t used = 0;
  std::int64_t n = 0;
  try {
    n = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DTRAIN_CHECK_ARG(used == value.size() && n >= 1, "--activation-checkpointing '", value,
                   "' is not allowed; allowed: none, full, or a number of blocks N >= 1");
  return n;
}

dtrain::models::GptConfig model_config(const Options& o) {
  auto c = dtrain::models::GptConfig::preset(o.preset);
  auto set = [](std::int64_t value, std::int64_t& field) {
    if (value >= 0) field = value;
  };
  if (!o.family.empty()) c.family = o.family;
  set(o.vocab_size, c.vocab_size);
  set(o.context, c.context);
  set(o.n_layer, c.n_layer);
  set(o.n_head, c.n_head);
  set(o.d_model, c.d_model);
  set(o.ffn_hidden, c.ffn_hidden);
  // gpt2 has one kv head per head: follow --n-head unless --n-kv-head says otherwise.
  if (o.n_head >= 0 && o.n_kv_head < 0 && c.family == "gpt2") c.n_kv_head = c.n_head;
  set(o.n_kv_head, c.n_kv_head);
  if (!o.tie_embeddings.empty()) {
    DTRAIN_CHECK_ARG(o.tie_embeddings == "true" || o.tie_embeddings == "false", "--tie-embeddings '",
                     o.tie_embeddings, "' is not allowed; allowed: true, false");
    c.tie_embeddings = o.tie_embeddings == "true";
  }
  c.recompute_blocks = recompute_blocks(o.activation_checkpointing);
  c.attention_window = o.attention_window;
  c.window_skip_every = o.window_skip_every;
  c.attention_softcap = o.attention_softcap;
  c.softmax_type = o.softmax_type;
  c.document_separator = o.document_separator;
  c.reset_position_ids = o.reset_position_ids;
  c.qk_norm = c.qk_norm || o.qk_norm;
  c.dropout = o.dropout;
  c.z_loss = o.z_loss;
  c.attention = dtrain::ops::parse_attention_backend(o.attention);
  c.fused_norm = o.fused_norm;
  c.fused_ce = o.fused_ce;
  c.fused_swiglu = o.fused_swiglu;
  c.fused_rope = o.fused_rope;
  c.fused_linear_ce = o.fused_linear_ce;
  c.moe = o.moe;
  if (o.moe_dropless) c.moe.capacity_factor = 0;
  c.validate();
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const bool leader = dtrain::detect_launch_env().rank == 0;  // prints parse errors and help
  Options o;
  CLI::App app{"pretrain_gpt: GPT-2 / Llama pretraining with data, tensor, pipeline and expert parallelism (MPI or NCCL)"};
  define(app, o);
  try {
    std::vector<std::string> args = {argv[0]};
    const std::string config = find_config(argc, argv);
    if (!config.empty()) {
      for (auto& t : config_tokens(app, config)) args.push_back(std::move(t));
    }
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    std::vector<const char*> ptrs;
    for (const auto& a : args) ptrs.push_back(a.c_str());
    app.parse(static_cast<int>(ptrs.size()), ptrs.data());
  } catch (const CLI::ParseError& e) {
    if (leader) return app.exit(e);
    return e.get_exit_code();
  } catch (const InvalidArgument& e) {
    if (leader) std::fprintf(stderr, "pretrain_gpt: error: %s\n", e.what());
    return kExitBadInput;
  }

  std::unique_ptr<dtrain::Runtime> runtime;
  std::unique_ptr<dtrain::train::Trainer> trainer;
  try {
    runtime = std::make_unique<dtrain::Runtime>(&argc, &argv, dtrain::RuntimeOptions{o.backend});
    resolve_kernels(app, o, runtime->device().is_cuda());
    if (runtime->rank() == 0) {
      dtrain::log_info("pretrain_gpt resolved config:\n{}", app.config_to_str(true, false));
      auto on = [](bool b) { return b ? "on" : "off"; };
      dtrain::log_info("kernels: attention {}, fused norm {}, fused cross-entropy {}, fused AdamW {}, fused SwiGLU {}, "
                       "fused RoPE {}, fused linear cross-entropy {}",
                       o.attention, on(o.fused_norm), on(o.fused_ce), on(o.fused_adamw), on(o.fused_swiglu),
                       on(o.fused_rope), on(o.fused_linear_ce));
    }
    const auto model = model_config(o);
    DTRAIN_CHECK_ARG(o.bucket_mb > 0, "--bucket-mb=", o.bucket_mb, " must be positive");
    if (!o.export_hf.empty()) {  // refused (no names) or warned about (no class computes it) before training
      std::string why;
      if (dtrain::models::hf_class(model, &why).empty()) {
        dtrain::log_warn("--export-hf: no transformers class computes this model from its weights ({}); the file "
                         "will serve --init-from", why);
      }
    }
    DTRAIN_CHECK_ARG(!o.eval_only || !o.train.val_data.empty(), "--eval-only evaluates on the validation data; "
                     "it needs --val-data");
    o.train.ddp.bucket_bytes = static_cast<std::int64_t>(o.bucket_mb * (1 << 20));
    dtrain::ParallelConfig parallel;
    parallel.dp = o.dp;
    parallel.dp_shard = o.dp_shard;
    parallel.tp = o.tp;
    parallel.pp = o.pp;
    parallel.ep = o.ep;
    parallel.cp = o.cp;
    parallel.cp_comm = dtrain::parse_cp_comm(o.cp_comm);
    parallel.sequence_parallel = o.sequence_parallel;
    auto ctx = std::make_shared<dtrain::ParallelContext>(runtime->world(), parallel, runtime->device());
    trainer = std::make_unique<dtrain::train::Trainer>(ctx, model, o.train);
    trainer->log_summary();
  } catch (const dtrain::checkpoint::CheckpointError& e) {
    // --resume: every rank raises the same error (the trainer makes them agree).
    if (!runtime || runtime->rank() == 0) std::fprintf(stderr, "pretrain_gpt: error: %s\n", e.what());
    return kExitBadInput;
  } catch (const InvalidArgument& e) {
    // Bad input is detected identically on every rank (the trainer makes the ranks agree).
    const std::string what = e.what();
    const int rank = runtime ? runtime->rank() : 0;
    if (rank == 0 || what.rfind("rank " + std::to_string(rank) + ":", 0) == 0) {
      std::fprintf(stderr, "pretrain_gpt: error: %s\n", what.c_str());
    }
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pretrain_gpt: error: %s\n", e.what());
    if (runtime && runtime->size() > 1) runtime->abort(kExitFailure);
    return kExitFailure;
  }
  try {
    if (o.eval_only) {
      const double val = trainer->evaluate();
      char line[96];
      std::snprintf(line, sizeof(line), "eval: step %lld, val loss %.4f", static_cast<long long>(trainer->step()), val);
      dtrain::log_info("{}", line);
      if (!o.export_hf.empty()) trainer->export_hf(o.export_hf);
      return 0;
    }
    const auto metrics = trainer->run();
    if (metrics.empty()) {
      dtrain::log_info("done: nothing to train, the run is at step {} of --steps {}", trainer->step(),
                       o.train.steps);
      if (!o.export_hf.empty()) trainer->export_hf(o.export_hf);
      return 0;
    }
    const auto& first = metrics.front();
    const auto& last = metrics.back();
    dtrain::log_info("{}: {} steps, loss {} -> {}{}", trainer->preempted() ? "preempted" : "done", metrics.size(),
                     first.loss, last.loss,
                     last.val_loss >= 0 ? dtrain::format(", val loss {}", last.val_loss) : std::string());
    if (trainer->preempted()) return kExitPreempted;
    if (!o.export_hf.empty()) trainer->export_hf(o.export_hf);
  } catch (const std::exception& e) {
    // Mid-run failures may leave peers inside a collective: end the whole job.
    std::fprintf(stderr, "pretrain_gpt: error during training: %s\n", e.what());
    if (runtime->size() > 1) runtime->abort(kExitFailure);
    return kExitFailure;
  }
  return 0;
}
