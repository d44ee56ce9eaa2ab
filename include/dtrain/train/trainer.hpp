// Trainer: the pretraining loop of a GPT over a ParallelContext. Validates the whole run
// before step 0, then per step: micro-batches with gradient accumulation, data-parallel
// gradient averaging overlapped with backward, clipping, AdamW with a warm-up and decay schedule;
// eval on the val split, logs on rank 0, JSON-lines metrics and a progress bar.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/core/trace.hpp"
#include "dtrain/models/gpt.hpp"
#include "dtrain/optim/loss_scaler.hpp"
#include "dtrain/optim/optim.hpp"
#include "dtrain/parallel/context.hpp"
#include "dtrain/parallel/data_parallel.hpp"
#include "dtrain/data/dataset.hpp"
#include "dtrain/parallel/fsdp.hpp"

namespace dtrain::train {

struct TrainOptions {
  // Data: glob patterns of llm.c token shards. val_data may be empty (no evaluation).
  std::string train_data;          // a glob of token shards, or a blend "W1 GLOB1 W2 GLOB2 ..."
  std::string val_data;
  std::int64_t seq_len = 64;        // tokens per sample; at most the model's context
  std::int64_t global_batch = 16;   // samples per optimizer step over all ranks
  std::int64_t micro_batch = 0;     // samples per rank per forward; 0: global / dp
  // Megatron's --eod-mask-loss (needs the model's document_separator): no loss on the
  // prediction made at a separator (the next document's first token). The loss is then
  // the mean over the global batch's remaining targets: each micro-batch weighs its share
  // of them (one count all-reduced per step), so every layout computes the same function.
  bool eod_mask_loss = false;
  std::int64_t steps = 100;
  std::uint64_t seed = 1337;        // model init and data order
  // Optimizer and schedule (adamw.lr is the peak learning rate).
  AdamWOptions adamw;
  // The schedule (LrSchedule): linear warm-up, the peak held until the decay's last
  // lr_decay_steps (0: the decay spans every step after the warm-up; fewer: WSD), then
  // lr_decay (cosine | linear | sqrt | constant) to min_lr (unset: adamw.lr / 10).
  std::optional<double> min_lr;
  std::int64_t warmup_steps = 10;
  std::string lr_decay = "cosine";
  std::int64_t lr_decay_steps = 0;
  double grad_clip = 1.0;           // global-norm clipping; 0 disables
  std::string precision = "fp32";   // fp32 | bf16 | fp16 (autocast matmuls to that dtype)
  // Dynamic loss scaling, on with fp16 (precision, or an FSDP param/reduce dtype float16):
  // the initial scale and the overflow-free steps after which it doubles.
  double loss_scale_init = 65536.0;
  std::int64_t loss_scale_window = 1000;
  // Data parallelism: replicated (DataParallel) or sharded (ZeRO, ShardedDataParallel).
  std::string fsdp = "none";        // none | zero1 | zero2 | full | hybrid (ctx dp_shard)
  DataParallelOptions ddp;          // allow_unused and broadcast_parameters apply to both
  int fsdp_prefetch = 1;            // full/hybrid: blocks gathered ahead
  std::string param_dtype = "float32";   // --fsdp only: compute dtype of the parameters
  std::string reduce_dtype = "float32";  // --fsdp only: dtype of the gradient reduction
  bool fsdp_reshard_after_forward = true;  // full/hybrid: free blocks between forward and backward
  // Pipeline parallelism (context pp > 1): the schedule (gpipe | 1f1b | interleaved | zb),
  // the micro-batches per step (0: global batch / (dp x micro_batch); they are the
  // gradient accumulation), model chunks per rank (interleaved), and the blocks per
  // virtual stage ("": balanced by parameter count, e.g. "3,3,2,2").
  std::string pp_schedule = "1f1b";
  std::int64_t microbatches = 0;
  int virtual_stages = 1;
  std::string pp_layers;
  // Evaluation and reporting.
  std::int64_t eval_every = 0;      // 0: evaluate only after the last step
  std::int64_t eval_batches = 4;    // val batches of global_batch samples each
  std::int64_t log_every = 1;
  std::string metrics_path;         // JSON lines written by rank 0; empty: none
  double peak_tflops = 0;           // per device; 0: known GPU table (none for CPUs)
  std::string progress = "auto";    // auto (when stderr is a terminal) | on | off
  bool sync_timing = false;         // synchronize the device between phases (exact breakdown)
  // Chrome trace (Perfetto JSON) of every step's spans, one file per rank
  // (trace::rank_path: "t.json" -> "t.rank<r>.json"), written when run() ends; "": none.
  // On a GPU each span ends with a device synchronize.
  std::string trace_path;
  // Checkpoints (docs/checkpoints.md). save_dir: where they go (one step_<N> directory per
  // save); save_every: every N steps (0: only after the last step and on a preemption
  // signal, when save_dir is set); keep_checkpoints: the newest N are kept (0: all).
  // resume: "" starts fresh; "auto" loads the newest good checkpoint under save_dir
  // (fresh when there is none); a path loads that checkpoint directory (or the newest good
  // one of a save_dir). Any checkpoint loads into any layout and world size.
  std::string save_dir;
  std::int64_t save_every = 0;
  int keep_checkpoints = 0;
  std::string resume;
  bool async_save = false;  // periodic saves write in the background (the last one does not)
  // Wall-clock budget from the trainer's construction (Megatron's --exit-duration-in-mins):
  // the first step that ends past it saves and stops the run as a preemption signal does
  // (needs save_dir; exit code 75 in pretrain_gpt). 0: none.
  double exit_duration_mins = 0;
  // A Hugging Face safetensors file (export_hf's format) the parameters start from
  // (fine-tuning); a checkpoint found by `resume` takes precedence.
  std::string init_from;
  // Bitwise-reproducible runs (Megatron's --deterministic-mode): the same inputs, layout
  // and GPU model give the same losses and weights on every run. Process-wide, from the
  // trainer's construction: LibTorch's deterministic algorithms (torch's
  // use_deterministic_algorithms; an op that has none fails with LibTorch's error),
  // CUBLAS_WORKSPACE_CONFIG=:4096:8 where the environment sets none, and flash attention's
  // deterministic backward (docs/kernels.md). Slower on GPUs; CPU runs are reproducible
  // without it.
  bool deterministic = false;
  // Steps whose gradients are not finite (NaN/Inf loss or gradients; float16 overflows)
  // apply no update and are counted; this many in a row end the run with an error.
  std::int64_t max_skipped_steps = 20;
};

// What TrainOptions::deterministic does at the trainer's construction, for programs that
// run the ops without a trainer: LibTorch's deterministic algorithms, process-wide, and
// CUBLAS_WORKSPACE_CONFIG=:4096:8 where the environment sets none (before the first
// matmul makes cuBLAS's handle, which reads it).
void use_deterministic_algorithms();

// Mixture-of-experts telemetry of one step (every MoE layer of the model, all ranks).
struct MoeMetrics {
  std::vector<std::int64_t> layers;                    // block index of each MoE layer
  std::vector<std::vector<double>> tokens_per_expert;  // per layer: assignments per expert
  double expert_load_max_over_mean = 0;  // max / mean assignments over experts (worst layer)
  double ep_load_max_over_mean = 0;      // max / mean tokens received over ep ranks (worst layer)
  double dropped_fraction = 0;           // assignments dropped by capacity / all assignments
  double aux_loss = 0, z_loss = 0;       // mean per layer and micro-batch (coefficients applied)
  double a2a_bytes = 0;                  // per rank (mean): dispatch and combine, fwd + bwd
  double a2a_ms = 0;                     // per rank (mean): time in those all-to-alls
};

// What one optimizer step did. Times are milliseconds on this rank; the loss is the
// global mean over every rank and micro-batch.
struct StepMetrics {
  std::int64_t step = 0;  // 1 for the first step: steps completed including this one
  double loss = 0, grad_norm = 0, lr = 0;
  double step_ms = 0, forward_ms = 0, backward_ms = 0, sync_ms = 0, optimizer_ms = 0;
  double tokens_per_s = 0, tflops = 0;  // tflops: achieved per device
  double mfu = -1;                      // fraction of peak; -1 when the peak is unknown
  double mem_mib = 0, peak_mem_mib = 0;
  double val_loss = -1;                 // -1 when no evaluation ran after this step
  double loss_scale = 0;                // the scale this step's backward used; 0: no scaling
  bool skipped = false;                 // gradients not finite: no update was applied
  std::int64_t skipped_steps = 0;       // skipped steps so far
  std::int64_t tokens = 0;              // tokens trained so far (all ranks)
  MoeMetrics moe;                       // empty layers for a dense model
};

class Trainer {
 public:
  // Builds model, data, optimizer and data parallelism. Every check runs before training
  // and the ranks agree on the outcome: InvalidArgument naming the option, its value and
  // what is allowed (missing or malformed data, vocabulary or sequence larger than the
  // model, batch sizes that do not divide, ...) is raised on every rank together.
  Trainer(ContextPtr ctx, models::GptConfig model, TrainOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step (the (step()+1)-th); returns its metrics without logging them.
  StepMetrics train_step();
  // Mean loss over eval_batches val batches, averaged over the data-parallel ranks.
  double evaluate();
  // Trains from step() to options().steps with evaluation, logging on rank 0 (a line every
  // log_every steps, JSON lines, progress bar); returns every step's metrics.
  std::vector<StepMetrics> run();

  std::int64_t step() const { return step_; }  // optimizer steps done
  std::int64_t grad_accumulation() const { return accum_; }
  const TrainOptions& options() const { return options_; }
  // The model (with pipeline parallelism: this rank's first chunk).
  models::Gpt& model() { return model_; }
  // This rank's models: the whole model, or its pipeline chunks in order.
  std::vector<models::Gpt> models() const;
  // The single-process model's parameters, assembled from every rank's pieces (tensor-
  // parallel slices, pipeline stages); a collective over the tp and pp groups.
  NamedParameters full_parameters();
  // The strategy in use: data_parallel() without --fsdp, sharded() with it (else null).
  const DataParallel* data_parallel() const { return ddp_.get(); }
  const ShardedDataParallel* sharded() const { return sdp_.get(); }
  ShardedDataParallel* sharded() { return sdp_.get(); }
  // The float16 loss scaler; null when no float16 is in use.
  const DynamicLossScaler* loss_scaler() const { return scaler_.get(); }
  // Makes every parameter of model() readable (full sharding frees blocks between uses;
  // the next forward frees them again). A no-op for the other strategies.
  void gather_parameters();
  // Bytes this rank holds now for the model state: parameters (gathered storage only),
  // gradients (full and sharded) and optimizer state, each storage counted once.
  std::int64_t model_state_bytes() const;
  // Bytes this rank sent in the strategy's collectives during the last step.
  double comm_bytes() const;
  // Logs the run's shape: model size, data, batch layout, FLOPs per token, peak.
  void log_summary() const;
  // The spans recorded so far with TrainOptions::trace_path (null without it).
  const trace::Recorder* trace() const { return trace_.get(); }

  // Writes this step's checkpoint under root ("" : options().save_dir); a collective over
  // the world. Every rank writes the state it owns (parameters, AdamW moments, MoE router
  // biases, its RNG states) to its own file and rank 0 the manifest; returns the step
  // directory. On any rank's failure (disk full, permissions) every rank raises
  // checkpoint::CheckpointError naming it; training state is untouched and the previous
  // checkpoints stay loadable.
  // async: the state is copied to host memory (the only pause of training), then this
  // rank's file is written by a background thread; the save is committed (manifest,
  // rename, `latest`) by finish_save(), which the next save and run() call. A step
  // directory is returned either way.
  std::string save_checkpoint(const std::string& root = "", bool async = false);
  // Commits a pending async save (collective; a no-op without one) and returns its
  // directory. only_if_written: only when every rank's writer is done ("" otherwise).
  std::string finish_save(bool only_if_written = false);
  // The last committed save: milliseconds training paused (the snapshot) and in all.
  struct SaveTimes {
    double snapshot_ms = 0, total_ms = 0;
  };
  const SaveTimes& last_save() const { return last_save_; }
  // Loads a checkpoint directory written by any layout and world size (collective): each
  // rank reads the byte ranges of the elements it holds. Optimizer state, step, tokens,
  // data position, loss scaler and router biases resume; RNG states too when the layout
  // is the same. CheckpointError (every rank, naming the file and the problem) when it is
  // from another model, incomplete or corrupt; the trainer's state is then unchanged.
  void load_checkpoint(const std::string& dir);
  // The single-process model under Hugging Face names and layouts (models/hf_names.hpp)
  // as one safetensors file, written by rank 0; a collective (parameters are gathered).
  // CheckpointError (every rank) when it cannot be written.
  void export_hf(const std::string& path);
  // Sets every parameter from such a file (a released model, or an export) on every rank,
  // in any layout; the optimizer state is reset. TrainOptions::init_from does it at
  // construction. CheckpointError (every rank) naming the file and the missing or
  // misshapen tensor.
  void load_hf(const std::string& path);
  // Whether run() stopped early on SIGTERM or SIGUSR1 (after saving a checkpoint).
  bool preempted() const { return preempted_; }

 private:
  struct Reporter;
  struct Pipeline;  // pipeline parallelism: this rank's chunks and the runtime
  void validate_and_agree();
  void build_pipeline();
  // A step's (or an evaluation batch's) samples on the host, with the targets the loss
  // reads (eod_mask_loss), and each micro-batch's weight in the loss: 1/accum, or its
  // share of the loss targets of every data-parallel rank's batch, times dp (collective
  // over dp when eod_mask_loss is on).
  struct StepBatch {
    data::Batch batch;
    std::vector<double> weights;
  };
  StepBatch step_batch(data::TokenDataset& data, const std::vector<std::int64_t>& samples);
  double pipeline_step(StepMetrics& m, double scale);
  double pipeline_loss(double local);  // the last stage's loss, on every rank
  void check_options() const;
  void load_data();
  void collect_moe(MoeMetrics& m);  // one all-reduce over the world; updates router biases
  struct StateTensor;
  // This rank's state as pieces of the single-process tensors (trainer_checkpoint.cpp);
  // fsdp: the pieces standing for the sharded parameters and moments.
  std::vector<StateTensor> state_tensors(const ShardedState* fsdp) const;
  void resume();                   // options_.resume, at construction
  struct PendingSave;
  std::shared_ptr<PendingSave> snapshot(const std::string& root);  // collective
  void write_rank_file(PendingSave& p, int rank);                   // no collective
  std::string commit(const std::shared_ptr<PendingSave>& p);        // collective
  std::shared_ptr<PendingSave> pending_;  // an async save not yet committed
  SaveTimes last_save_;
  // Why the run stops after this step (collective): a preemption signal reached any rank,
  // or any rank's clock passed exit_duration_mins; neither: "".
  std::string stop_requested();
  std::chrono::steady_clock::time_point created_ = std::chrono::steady_clock::now();

  ContextPtr ctx_;
  models::GptConfig model_config_;
  TrainOptions options_;
  std::int64_t accum_ = 1, micro_batch_ = 0, step_ = 0, tokens_ = 0;
  std::int64_t skipped_ = 0, skipped_in_a_row_ = 0;  // steps without an update
  bool preempted_ = false;
  double flops_per_token_ = 0, peak_tflops_ = 0;
  std::string device_name_;
  std::unique_ptr<data::TokenDataset> train_, val_;
  std::vector<data::BlendComponent> blend_;  // --train-data's components (one: no blend), shares as dealt
  std::unique_ptr<data::Sampler> sampler_;
  std::unique_ptr<data::DistributedSampler> val_sampler_;
  models::Gpt model_{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<LrSchedule> schedule_;
  std::unique_ptr<DataParallel> ddp_;
  // Expert parallelism: expert gradients averaged over the expert-data-parallel ranks (and,
  // with --fsdp, their own AdamW: experts are split over ep, not sharded over dp).
  std::unique_ptr<DataParallel> expert_ddp_;
  std::unique_ptr<torch::optim::Optimizer> expert_optimizer_;
  std::unique_ptr<ShardedDataParallel> sdp_;
  std::unique_ptr<DynamicLossScaler> scaler_;
  std::unique_ptr<Reporter> reporter_;
  std::unique_ptr<Pipeline> pipeline_;
  std::unique_ptr<trace::Recorder> trace_;
  NamedParameters params_;  // this rank's trainable parameters (every chunk)
};

}  // namespace dtrain::train
