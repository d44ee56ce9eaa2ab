// Trainer: validation with agreement across ranks, the step (micro-batches, overlapped
// gradient averaging, clipping, AdamW), evaluation, and reporting (log line, JSON lines,
// progress bar).
#include "dtrain/train/trainer.hpp"

#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <nlohmann/json.hpp>

#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/core/logging.hpp"
#include "dtrain/data/dataset.hpp"
#include "dtrain/parallel/context_parallel.hpp"
#include "dtrain/parallel/pipeline.hpp"
#include "dtrain/parallel/pipeline_partition.hpp"
#include "dtrain/train/autocast.hpp"
#include "dtrain/train/device_stats.hpp"
#include "train/faults.hpp"

namespace dtrain::train {

namespace {

LrScheduleOptions lr_schedule_options(const TrainOptions& o) {
  LrScheduleOptions s;
  s.lr = o.adamw.lr;
  s.min_lr = o.min_lr.value_or(o.adamw.lr / 10);
  s.warmup_steps = o.warmup_steps;
  s.total_steps = o.steps;
  s.decay = parse_lr_decay(o.lr_decay);
  s.decay_steps = o.lr_decay_steps;
  return s;
}

// Tells the model the factor its next micro-batch's loss gets in backward: the loss scale
// times the micro-batch's weight in the step's loss (for the fused cross-entropy), and
// the loss scale over the micro-batches for its MoE auxiliary losses. A weight of 0 (no
// loss targets) cannot be announced; that loss and its gradient are 0 under any factor.
void announce_loss_weight(models::GptImpl& model, double scale, double weight, double microbatches) {
  const double per_micro_batch = scale / microbatches;
  model.set_loss_grad_scale(weight > 0 ? scale * weight : per_micro_batch, per_micro_batch);
}

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// float16 anywhere (autocast or FSDP parameters/reductions) needs dynamic loss scaling.
bool uses_float16(const TrainOptions& o) {
  return o.precision == "fp16" || o.param_dtype == "float16" || o.reduce_dtype == "float16";
}

LossScalerOptions scaler_options(const TrainOptions& o) {
  LossScalerOptions s;
  s.init_scale = o.loss_scale_init;
  s.growth_interval = o.loss_scale_window;
  return s;
}

// "float32" | "bfloat16" | "float16" for the option `option`.
c10::ScalarType parse_dtype(const char* option, const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw InvalidArgument(detail::str_cat(option, " '", name,
                                        "' is not known; allowed: float32, bfloat16, float16"));
}

// Samples per rank per forward: from --microbatches (global / (dp x M)), --micro-batch, or
// global / dp; 0 when --microbatches does not divide (check_options says so).
std::int64_t micro_batch_of(const TrainOptions& o, std::int64_t dp) {
  if (o.microbatches > 0) {
    return o.global_batch % (dp * o.microbatches) == 0 ? o.global_batch / (dp * o.microbatches) : 0;
  }
  return o.micro_batch > 0 ? o.micro_batch : o.global_batch / dp;
}

// Blocks per virtual stage: --pp-layers, or balanced by parameter count (the embeddings on
// the first stage; the head's matmul, vocabulary x d, on the last).
std::vector<int> stage_blocks(const models::GptConfig& c, const TrainOptions& o, int stages) {
  if (!o.pp_layers.empty()) return pp::parse_partition(o.pp_layers, static_cast<int>(c.n_layer), stages);
  double block = 0, first = 0, last = static_cast<double>(c.vocab_size * c.d_model);
  for (const auto& [name, shape] : c.parameter_shapes()) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    if (name.rfind("h.0.", 0) == 0) block += static_cast<double>(n);
    if (name.rfind("tok_emb.", 0) == 0 || name.rfind("pos_emb.", 0) == 0) first += static_cast<double>(n);
    if (name.rfind("ln_f_", 0) == 0) last += static_cast<double>(n);
  }
  return pp::balanced_partition(std::vector<double>(static_cast<std::size_t>(c.n_layer), block), first,
                                last, stages);
}

// Rows [begin, end) of a rank's sample list.
std::vector<std::int64_t> rows(const std::vector<std::int64_t>& all, std::int64_t begin,
                               std::int64_t end) {
  return {all.begin() + begin, all.begin() + end};
}

// A parameter of this rank's model (or pipeline chunks, in order) and how the gradient
// norm counts it: elements from `replicated_from` on are the same on every tp rank (counted
// once), the others are distinct across tp; a last stage's copy of tied embeddings is not
// counted (the first stage's is).
struct ParamRole {
  std::string name;
  at::Tensor param;
  std::int64_t replicated_from;
  bool copy;
  bool expert;  // split over ep (expert parallelism): distinct across the ep ranks
};

std::vector<ParamRole> param_roles(const std::vector<models::Gpt>& models) {
  std::vector<ParamRole> out;
  for (const auto& model : models) {
    const auto params = model->parameter_list();
    for (std::size_t i = 0; i < params.size(); ++i) {
      out.push_back({params[i].first, params[i].second, model->tp_shards()[i].second.replicated_from,
                     params[i].first == "tok_emb.weight" && !model->stage().embedding,
                     model->context()->ep_size() > 1 && models::is_expert_parameter(params[i].first)});
    }
  }
  return out;
}

// Gradient clipping groups over tensor, pipeline and expert parallelism with replicated
// data parallelism: tp-distinct elements summed over tp and pp, tp-replicated ones over pp,
// experts over tp, pp and ep, tied copies not counted. With only_experts, the expert group
// alone (what --fsdp adds to its own groups).
std::vector<GradGroup> grad_groups(const std::vector<ParamRole>& roles, Communicator* tp,
                                   Communicator* pp, Communicator* ep, bool only_experts = false) {
  GradGroup distinct, replicated, copies{{}, {}, /*counted=*/false};
  for (auto* c : {tp, pp}) {
    if (c != nullptr && c->size() > 1) distinct.over.push_back(c);
  }
  if (pp != nullptr && pp->size() > 1) replicated.over.push_back(pp);
  GradGroup experts{{}, distinct.over};
  if (ep != nullptr && ep->size() > 1) experts.over.push_back(ep);
  for (const auto& r : roles) {
    const auto& g = r.param.grad();
    if (!g.defined()) continue;
    const auto flat = g.view({-1});
    if (r.expert) {
      experts.grads.push_back(flat);
      continue;
    }
    if (only_experts) continue;
    const std::int64_t n = flat.numel(), from = std::min(r.replicated_from, n);
    if (r.copy) {
      copies.grads.push_back(flat);
      continue;
    }
    if (from > 0) distinct.grads.push_back(flat.narrow(0, 0, from));
    if (from < n) replicated.grads.push_back(flat.narrow(0, from, n - from));
  }
  if (only_experts) return {experts};
  return {distinct, replicated, copies, experts};
}

// Expert parallelism splits parameters in two: experts (their gradients averaged over the
// expert-data-parallel ranks) and the rest (over all data-parallel ranks).
std::pair<NamedParameters, NamedParameters> split_experts(const NamedParameters& params, int ep) {
  NamedParameters dense, experts;
  for (const auto& item : params) {
    (ep > 1 && models::is_expert_parameter(item.first) ? experts : dense).push_back(item);
  }
  return {dense, experts};
}

std::string duration_text(double seconds) {
  const auto s = static_cast<long>(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%02ld:%02ld", s / 60, s % 60);
  }
  return buf;
}

}  // namespace

// Rank 0's outputs: the log line, the metrics file and the progress bar.
struct Trainer::Reporter {
  bool active = false;  // rank 0
  bool bar = false;
  std::ofstream metrics;
  Clock::time_point start = Clock::now();
  std::int64_t first_step = 0;

  void clear_bar() const {
    if (bar) std::fputs("\r\033[K", stderr);
  }
  void draw_bar(std::int64_t done, std::int64_t total) const {
    if (!bar) return;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const double per = done > first_step ? elapsed / static_cast<double>(done - first_step) : 0;
    const int width = 30;
    const int filled = static_cast<int>(width * done / std::max<std::int64_t>(1, total));
    std::string line(static_cast<std::size_t>(filled), '=');
    line.resize(width, ' ');
    std::fprintf(stderr, "\r\033[K[%s] %lld/%lld  %.2f s/step  ETA %s", line.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total), per,
                 duration_text(per * static_cast<double>(total - done)).c_str());
    std::fflush(stderr);
  }
};

// Pipeline parallelism: this rank's model chunks (virtual stages chunk x p + pp rank), the
// runtime executing the schedule, and the group of the first and last stage (tied
// embeddings: the two copies' gradients are summed).
struct Trainer::Pipeline {
  std::vector<models::Gpt> chunks;
  std::vector<int> blocks;  // per virtual stage
  std::unique_ptr<pp::PipelineRuntime> runtime;
  // Replicated data parallelism: one per chunk, synchronising on the chunk's last backward.
  std::vector<std::unique_ptr<DataParallel>> ddp;
  std::vector<std::unique_ptr<DataParallel>> expert_ddp;  // ep > 1: per chunk, its experts
  CommPtr tied;
  double scale = 1;     // the loss scale of the running step
  double dp_bytes = 0;  // last step: bytes of the data-parallel gradient average
};

void use_deterministic_algorithms() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);  // an existing value is the user's
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
}

Trainer::Trainer(ContextPtr ctx, models::GptConfig model, TrainOptions options)
    : ctx_(std::move(ctx)), model_config_(std::move(model)), options_(std::move(options)) {
  DTRAIN_CHECK_ARG(ctx_ != nullptr, "Trainer needs a ParallelContext");
  validate_and_agree();
  if (options_.deterministic) use_deterministic_algorithms();
  // LibTorch seeds its default generators from the OS; seeding them from the run's seed
  // makes every process (and so every checkpoint file) reproducible. The model draws its
  // initialisation and dropout masks from generators of its own.
  torch::manual_seed(options_.seed + 1000003ULL * static_cast<std::uint64_t>(ctx_->rank()));
  if (!options_.trace_path.empty()) {
    trace_ = std::make_unique<trace::Recorder>(
        ctx_->rank(), format("rank {} (pp {}, dp {}, cp {}, tp {})", ctx_->rank(), ctx_->pp_rank(),
                             ctx_->dp_rank(), ctx_->cp_rank(), ctx_->tp_rank()));
    if (!ctx_->device().is_cpu()) {
      const auto device = ctx_->device();
      trace_->set_end_hook([device] { synchronize(device); });
    }
  }
  if (ctx_->pp_size() > 1) {
    build_pipeline();
    model_ = pipeline_->chunks.front();
    for (auto& chunk : pipeline_->chunks) {
      for (auto& item : chunk->parameter_list()) params_.push_back(std::move(item));
    }
  } else {
    model_ = models::Gpt(ctx_, model_config_, options_.seed);
    params_ = model_->parameter_list();
  }
  const auto& params = params_;
  const int ep = ctx_->ep_size();
  auto [dense, experts] = split_experts(params, ep);
  schedule_ = std::make_unique<LrSchedule>(lr_schedule_options(options_));
  if (!pipeline_ && !experts.empty()) {
    expert_ddp_ = std::make_unique<DataParallel>(experts, ctx_->expert_dp_comm(), options_.ddp);
  } else if (pipeline_ && ep > 1) {
    for (auto& chunk : pipeline_->chunks) {
      pipeline_->expert_ddp.push_back(std::make_unique<DataParallel>(
          split_experts(chunk->parameter_list(), ep).second, ctx_->expert_dp_comm(), options_.ddp));
    }
  }
  if (options_.fsdp == "none") {
    optimizer_ = make_adamw(params, options_.adamw);
    if (!pipeline_) {
      ddp_ = std::make_unique<DataParallel>(dense, ctx_->dp_cp_comm(), options_.ddp);
    } else if (ctx_->dp_cp_comm()->size() > 1) {
      for (auto& chunk : pipeline_->chunks) {
        pipeline_->ddp.push_back(std::make_unique<DataParallel>(
            split_experts(chunk->parameter_list(), ep).first, ctx_->dp_cp_comm(), options_.ddp));
      }
    }
  } else {
    FsdpOptions fo;
    fo.strategy = parse_sharding(options_.fsdp);
    fo.adamw = options_.adamw;
    fo.allow_unused = options_.ddp.allow_unused;
    fo.broadcast_parameters = options_.ddp.broadcast_parameters;
    fo.prefetch = options_.fsdp_prefetch;
    fo.param_dtype = parse_dtype("--param-dtype", options_.param_dtype);
    fo.reduce_dtype = parse_dtype("--reduce-dtype", options_.reduce_dtype);
    fo.reshard_after_forward = options_.fsdp_reshard_after_forward;
    fo.tp = ctx_->tp_comm();
    fo.pp = ctx_->pp_comm();
    for (const auto& r : param_roles(models())) {
      if (r.expert) continue;  // not sharded: split over ep
      if (r.replicated_from < r.param.numel()) fo.tp_replicated.emplace_back(r.name, r.replicated_from);
      if (r.copy) fo.uncounted.push_back(r.name);
    }
    if (fo.strategy == ShardingStrategy::kHybrid) {
      sdp_ = std::make_unique<ShardedDataParallel>(dense, ctx_->shard_comm(), fo,
                                                   ctx_->replicate_comm());
    } else {
      sdp_ = std::make_unique<ShardedDataParallel>(dense, ctx_->dp_cp_comm(), fo);
    }
    if (!experts.empty()) expert_optimizer_ = make_adamw(experts, options_.adamw);
    // Full sharding: gather around blocks.
    for (auto& m : models()) m->set_block_hooks(sdp_->block_hooks());
  }
  if (uses_float16(options_)) scaler_ = std::make_unique<DynamicLossScaler>(scaler_options(options_));
  flops_per_token_ = model_config_.flops_per_token(options_.seq_len);
  device_name_ = device_name(ctx_->device());
  peak_tflops_ = options_.peak_tflops > 0 ? options_.peak_tflops : known_peak_tflops(device_name_);

  reporter_ = std::make_unique<Reporter>();
  reporter_->active = ctx_->rank() == 0;
  if (reporter_->active) {
    reporter_->bar = options_.progress == "on" || (options_.progress == "auto" && isatty(2));
    if (!options_.metrics_path.empty()) {
      // A resumed run appends to the metrics of the steps before it.
      reporter_->metrics.open(options_.metrics_path,
                              std::ios::out | (options_.resume.empty() ? std::ios::trunc : std::ios::app));
      DTRAIN_CHECK_ARG(reporter_->metrics.good(), "--metrics '", options_.metrics_path,
                       "' cannot be written");
    }
  }
  if (!options_.init_from.empty()) load_hf(options_.init_from);
  if (!options_.resume.empty()) resume();
}

Trainer::~Trainer() {
  for (auto& m : models()) m->set_block_hooks(nullptr);
}

std::vector<models::Gpt> Trainer::models() const {
  if (pipeline_) return pipeline_->chunks;
  if (model_) return {model_};
  return {};
}

void Trainer::build_pipeline() {
  const auto& o = options_;
  const int p = ctx_->pp_size(), v = o.virtual_stages, r = ctx_->pp_rank();
  pipeline_ = std::make_unique<Pipeline>();
  auto& pl = *pipeline_;
  pl.blocks = stage_blocks(model_config_, o, p * v);
  std::vector<pp::StageChunk> chunks;
  for (int c = 0; c < v; ++c) {
    const int g = pp::virtual_stage(r, c, p);
    std::int64_t first = 0;
    for (int k = 0; k < g; ++k) first += pl.blocks[static_cast<std::size_t>(k)];
    const models::GptStage stage{first, first + pl.blocks[static_cast<std::size_t>(g)], g == 0, g == p * v - 1};
    pl.chunks.emplace_back(ctx_, model_config_, o.seed, stage);
    auto model = pl.chunks.back();
    Pipeline* owner = &pl;
    // The micro-batch's tokens, which a later stage's document mask needs (before_forward).
    auto tokens = std::make_shared<at::Tensor>();
    const auto m = static_cast<double>(accum_);
    chunks.push_back({[model, tokens](const at::Tensor& x) mutable { return model->forward_stage(x, *tokens); },
                      [model, owner](const at::Tensor& h, const at::Tensor& t) mutable {
                        return model->loss_from_hidden(h, t) * owner->scale;
                      },
                      model->parameters(),
                      [owner, c](bool last) {
                        if (!owner->ddp.empty()) owner->ddp[static_cast<std::size_t>(c)]->set_sync(last);
                        if (!owner->expert_ddp.empty()) {
                          owner->expert_ddp[static_cast<std::size_t>(c)]->set_sync(last);
                        }
                      },
                      [tokens](const at::Tensor& t) { *tokens = t; },
                      [model, owner, m](double weight) mutable {
                        announce_loss_weight(*model, owner->scale, weight, m);
                      }});
  }
  pp::PipelineOptions po;
  po.schedule = pp::parse_schedule(o.pp_schedule);
  po.shape = {p, static_cast<int>(accum_), v};
  po.trace = trace_.get();
  // Context and sequence parallelism: each cp rank passes its positions, each tp rank its
  // part of them.
  const auto positions = o.seq_len / ctx_->cp_size();
  po.activation_shape = {micro_batch_, ctx_->sequence_parallel() ? positions / ctx_->tp_size() : positions,
                         model_config_.d_model};
  pl.runtime = std::make_unique<pp::PipelineRuntime>(std::move(chunks), ctx_->pp_comm(), po);
  if (model_config_.tie_embeddings) {
    pl.tied = ctx_->pp_comm()->split(r == 0 || r == p - 1 ? 0 : -1, r, "pp_tied");
  }
}

Trainer::StepBatch Trainer::step_batch(data::TokenDataset& data, const std::vector<std::int64_t>& samples) {
  StepBatch out{data.batch(rows(samples, 0, accum_ * micro_batch_)), {}};
  out.weights.assign(static_cast<std::size_t>(accum_), 1.0 / static_cast<double>(accum_));
  if (!options_.eod_mask_loss) return out;
  auto& [inputs, targets] = out.batch;
  targets.masked_fill_(inputs.eq(model_config_.document_separator), models::kIgnoreTarget);
  // Each micro-batch weighs by its share of the loss tokens of the step, counted over the
  // positions this rank's loss covers (under cp: its own).
  const auto mine = cp::take_local(targets, 1, ctx_->cp_size(), ctx_->cp_rank());
  const auto counts = mine.ne(models::kIgnoreTarget).view({accum_, -1}).sum(1);
  auto total = counts.sum().to(torch::kDouble).reshape({1}).to(ctx_->device());
  const auto& dp = ctx_->dp_cp_comm();
  dp->all_reduce(total)->wait();
  const double n = total.cpu().item<double>(), share = n > 0 ? dp->size() / n : 0.0;
  for (std::int64_t k = 0; k < accum_; ++k) {
    out.weights[static_cast<std::size_t>(k)] = static_cast<double>(counts[k].item<std::int64_t>()) * share;
  }
  return out;
}

double Trainer::pipeline_loss(double local) {
  auto t = torch::full({1}, std::isnan(local) ? 0.0 : local,
                       torch::TensorOptions().dtype(torch::kDouble).device(ctx_->device()));
  ctx_->pp_comm()->broadcast(t, {pipeline_->runtime->loss_rank()})->wait();
  ctx_->dp_cp_comm()->all_reduce(t, {ReduceOp::kAvg})->wait();
  return t.cpu().item<double>();
}

// One step's forward and backward through the pipeline, the data-parallel average of the
// gradients and the tied embedding's sum; returns the step's mean loss (every rank).
double Trainer::pipeline_step(StepMetrics& m, double scale) {
  auto& pl = *pipeline_;
  const auto device = ctx_->device();
  for (auto& chunk : pl.chunks) chunk->train();
  const auto [batch, weights] = step_batch(*train_, sampler_->indices(step_));
  pl.scale = scale;
  // Gradients accumulate over the micro-batches; the data-parallel reduction follows run().
  if (sdp_) sdp_->set_sync(false);
  auto t = Clock::now();
  double local = 0;
  {
    AutocastScope autocast(precision_dtype(options_.precision), device.type());
    local = pl.runtime->run(batch.inputs.to(device), batch.targets.to(device), weights) / scale;
  }
  if (options_.sync_timing) synchronize(device);
  m.forward_ms = ms_since(t);  // forward and backward interleave: the whole pipeline
  t = Clock::now();
  auto sync_span = trace::span(trace_.get(), "grad-sync", "train", trace::Track::kComm);
  // Replicated dp: each chunk's buckets were all-reduced during its last backward. The
  // tied copies' sum commutes with the dp average; FSDP needs it on the full gradients,
  // before its reduce-scatter.
  pl.dp_bytes = 0;
  for (auto* list : {&pl.ddp, &pl.expert_ddp}) {
    for (auto& d : *list) {
      d->finish_gradient_sync();
      pl.dp_bytes += d->stats().comm_bytes;
    }
  }
  if (pl.tied) {  // the first stage's embedding and the last stage's head copy
    for (auto& chunk : pl.chunks) {
      const auto params = chunk->named_parameters();
      if (params.contains("tok_emb.weight") && params["tok_emb.weight"].grad().defined()) {
        pl.tied->all_reduce(params["tok_emb.weight"].mutable_grad())->wait();
      }
    }
  }
  if (sdp_) sdp_->finish_gradient_sync();  // reduce-scatter every unit
  sync_span.end();
  if (options_.sync_timing) synchronize(device);
  m.sync_ms = ms_since(t);
  return pipeline_loss(local);
}

void Trainer::gather_parameters() {
  if (sdp_) sdp_->gather_parameters();
}

NamedParameters Trainer::full_parameters() {
  gather_parameters();
  if (!pipeline_) return model_->full_parameters();
  // Each tensor from the stage that owns it (a tied head copy is skipped), summed over pp.
  std::map<std::string, at::Tensor> mine;
  for (auto& chunk : pipeline_->chunks) {
    for (auto& [name, t] : chunk->full_parameters()) {
      if (name == "tok_emb.weight" && !chunk->stage().embedding) continue;
      mine[name] = t;
    }
  }
  NamedParameters out;
  for (const auto& [name, shape] : model_config_.parameter_shapes()) {
    const auto it = mine.find(name);
    auto t = it != mine.end() ? it->second.clone()
                              : torch::zeros(shape, torch::TensorOptions().device(ctx_->device()));
    ctx_->pp_comm()->all_reduce(t)->wait();
    out.emplace_back(name, t);
  }
  return out;
}

void Trainer::check_options() const {
  const auto& o = options_;
  model_config_.validate();
  model_config_.validate_tp(ctx_->tp_size());
  model_config_.moe.validate_ep(ctx_->ep_size());
  DTRAIN_CHECK_ARG(!o.train_data.empty(), "--train-data is required (a glob of token shards)");
  DTRAIN_CHECK_ARG(!o.eod_mask_loss || model_config_.document_separator >= 0, "--eod-mask-loss drops the loss "
                   "at each document separator; allowed only with --document-separator ID (got ",
                   model_config_.document_separator, ")");
  DTRAIN_CHECK_ARG(o.seq_len >= 1 && o.seq_len <= model_config_.context, "--seq-len=", o.seq_len,
                   " is not allowed: the model context is ", model_config_.context,
                   " (--context); allowed: 1..", model_config_.context);
  if (ctx_->cp_size() > 1) cp::check_sequence(o.seq_len, ctx_->cp_size());
  DTRAIN_CHECK_ARG(!ctx_->sequence_parallel() || o.seq_len % (ctx_->cp_size() * ctx_->tp_size()) == 0, "--seq-len=",
                   o.seq_len, " is not divisible by --tp=", ctx_->tp_size(),
                   ctx_->cp_size() > 1 ? format(" x --cp={}", ctx_->cp_size()) : std::string(),
                   "; --sequence-parallel splits every sequence across the tp ranks",
                   ctx_->cp_size() > 1 ? " (each context-parallel rank's part of it)" : "");
  DTRAIN_CHECK_ARG(o.steps >= 1, "--steps=", o.steps, " must be at least 1");
  DTRAIN_CHECK_ARG(o.global_batch >= 1, "--global-batch=", o.global_batch, " must be at least 1");
  DTRAIN_CHECK_ARG(o.micro_batch >= 0, "--micro-batch=", o.micro_batch,
                   " must be at least 1 (or 0: global batch / data-parallel size)");
  const std::int64_t dp = ctx_->dp_size();
  DTRAIN_CHECK_ARG(o.microbatches >= 0, "--microbatches=", o.microbatches,
                   " must be at least 1 (or 0: from --micro-batch)");
  DTRAIN_CHECK_ARG(o.microbatches == 0 || o.micro_batch == 0, "--microbatches and --micro-batch ",
                   "both set (", o.microbatches, ", ", o.micro_batch, "); give one of them");
  DTRAIN_CHECK_ARG(o.microbatches == 0 || o.global_batch % (dp * o.microbatches) == 0,
                   "--global-batch=", o.global_batch, " is not divisible by data-parallel size ", dp,
                   " x --microbatches ", o.microbatches);
  const std::int64_t micro = micro_batch_of(o, dp);
  DTRAIN_CHECK_ARG(micro >= 1 && o.global_batch % (dp * micro) == 0, "--global-batch=",
                   o.global_batch, " is not divisible by data-parallel size ", dp,
                   " x --micro-batch ", micro, " = ", dp * micro,
                   "; allowed: a multiple of ", dp * std::max<std::int64_t>(1, micro));
  DTRAIN_CHECK_ARG(o.warmup_steps >= 0 && o.warmup_steps <= o.steps, "--warmup-steps=",
                   o.warmup_steps, " is not allowed; allowed: 0..--steps (", o.steps, ")");
  DTRAIN_CHECK_ARG(o.adamw.lr > 0 && std::isfinite(o.adamw.lr), "--lr=", o.adamw.lr,
                   " is not allowed; allowed: a finite learning rate > 0");
  DTRAIN_CHECK_ARG(!o.min_lr || (*o.min_lr >= 0 && *o.min_lr <= o.adamw.lr), "--min-lr=", o.min_lr.value_or(0),
                   " is not allowed; allowed: 0..--lr (", o.adamw.lr, ")");
  const auto decay = parse_lr_decay(o.lr_decay);  // raises naming --lr-decay
  DTRAIN_CHECK_ARG(o.lr_decay_steps >= 0 && o.warmup_steps + o.lr_decay_steps <= o.steps, "--lr-decay-steps=",
                   o.lr_decay_steps, " is not allowed; allowed: 0..--steps - --warmup-steps (", o.steps, " - ",
                   o.warmup_steps, " = ", o.steps - o.warmup_steps, ")");
  DTRAIN_CHECK_ARG(decay != LrDecay::kConstant || o.lr_decay_steps == 0, "--lr-decay-steps=", o.lr_decay_steps,
                   " is not allowed with --lr-decay constant (it has no decay); allowed: 0");
  DTRAIN_CHECK_ARG(o.grad_clip >= 0, "--grad-clip=", o.grad_clip, " must be >= 0 (0 disables)");
  precision_dtype(o.precision);  // raises naming --precision
  if (model_config_.attention == ops::AttentionBackend::kFlash && ctx_->device().is_cuda()) {
    // The kernel takes 16-bit inputs and head dims up to 256: say so before step 0.
    DTRAIN_CHECK_ARG(o.precision != "fp32" || o.param_dtype != "float32", "--attention flash on CUDA needs 16-bit "
                     "activations (--precision bf16|fp16, or --param-dtype bfloat16|float16 with --fsdp); got "
                     "--precision fp32. Allowed otherwise: --attention sdpa");
    DTRAIN_CHECK_ARG(ops::flash_kernel_supports_head_dim(model_config_.head_dim()), "--attention flash on CUDA ",
                     "takes head dims that are ", ops::kFlashKernelHeadDims, "; this model's is ",
                     model_config_.head_dim(), " (--d-model / --n-head). Allowed otherwise: --attention sdpa");
  }
  DTRAIN_CHECK_ARG(o.progress == "auto" || o.progress == "on" || o.progress == "off",
                   "--progress '", o.progress, "' is not known; allowed: auto, on, off");
  DTRAIN_CHECK_ARG(o.eval_every >= 0, "--eval-every=", o.eval_every, " must be >= 0");
  DTRAIN_CHECK_ARG(o.eval_batches >= 1, "--eval-batches=", o.eval_batches, " must be >= 1");
  DTRAIN_CHECK_ARG(o.log_every >= 1, "--log-every=", o.log_every, " must be >= 1");
  if (!o.trace_path.empty()) {  // fail now, not after training
    const auto path = trace::rank_path(o.trace_path, ctx_->rank());
    DTRAIN_CHECK_ARG(std::ofstream(path, std::ios::out | std::ios::app).good(), "--trace '",
                     o.trace_path, "': this rank's file '", path, "' cannot be written");
  }
  DTRAIN_CHECK_ARG(o.save_every >= 0, "--save-every=", o.save_every, " must be >= 0 (0: only at the end)");
  DTRAIN_CHECK_ARG(o.save_every == 0 || !o.save_dir.empty(), "--save-every ", o.save_every,
                   " needs --save-dir (where the checkpoints go)");
  if (!o.save_dir.empty()) {  // fail now, not at the first save after hours of training
    try {
      fs::make_directories(o.save_dir);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("--save-dir '", o.save_dir, "': ", e.what()));
    }
    DTRAIN_CHECK_ARG(::access(o.save_dir.c_str(), W_OK | X_OK) == 0, "--save-dir '", o.save_dir,
                     "' is not writable: ", std::strerror(errno));
  }
  DTRAIN_CHECK_ARG(o.keep_checkpoints >= 0, "--keep-checkpoints=", o.keep_checkpoints,
                   " must be >= 0 (0: keep all)");
  DTRAIN_CHECK_ARG(o.resume != "auto" || !o.save_dir.empty(),
                   "--resume auto needs --save-dir (the directory it searches for checkpoints)");
  DTRAIN_CHECK_ARG(o.max_skipped_steps >= 1, "--max-skipped-steps=", o.max_skipped_steps, " must be >= 1");
  DTRAIN_CHECK_ARG(o.exit_duration_mins >= 0 && std::isfinite(o.exit_duration_mins), "--exit-duration-mins=",
                   o.exit_duration_mins, " is not allowed; allowed: minutes >= 0 (0: no limit)");
  DTRAIN_CHECK_ARG(o.exit_duration_mins == 0 || !o.save_dir.empty(), "--exit-duration-mins ", o.exit_duration_mins,
                   " saves and stops the run; it needs --save-dir");
  DTRAIN_CHECK_ARG(o.peak_tflops >= 0, "--peak-tflops=", o.peak_tflops, " must be >= 0");
  if (o.fsdp != "none") parse_sharding(o.fsdp);  // raises naming --fsdp
  DTRAIN_CHECK_ARG(o.fsdp_prefetch >= 0 && o.fsdp_prefetch <= 16, "--fsdp-prefetch=",
                   o.fsdp_prefetch, " is not allowed; allowed: 0..16");
  parse_dtype("--param-dtype", o.param_dtype);
  parse_dtype("--reduce-dtype", o.reduce_dtype);
  DTRAIN_CHECK_ARG(o.fsdp != "none" || (o.param_dtype == "float32" && o.reduce_dtype == "float32"),
                   "--param-dtype / --reduce-dtype other than float32 need --fsdp (got --fsdp none, ",
                   "--param-dtype ", o.param_dtype, ", --reduce-dtype ", o.reduce_dtype,
                   "); use --precision bf16 for autocast with replicated data parallelism");
  if (uses_float16(o)) DynamicLossScaler(scaler_options(o));  // raises naming the option
  const int pp = ctx_->pp_size();
  const auto schedule = pp::parse_schedule(o.pp_schedule);  // raises naming --pp-schedule
  if (pp > 1) {
    DTRAIN_CHECK_ARG(o.virtual_stages == 1 || (o.fsdp != "full" && o.fsdp != "hybrid"), "--fsdp ",
                     o.fsdp, " with --virtual-stages ", o.virtual_stages, " is not available: full ",
                     "sharding gathers one rank's consecutive blocks; allowed: --virtual-stages 1, ",
                     "or --fsdp none, zero1, zero2");
    pp::check_shape(schedule, {pp, static_cast<int>(o.global_batch / (dp * micro)), o.virtual_stages});
    stage_blocks(model_config_, o, pp * o.virtual_stages);  // raises naming the sizes
  } else {
    DTRAIN_CHECK_ARG(o.virtual_stages == 1 && o.pp_layers.empty(), "--virtual-stages / --pp-layers ",
                     "need --pp > 1 (got --pp 1, --virtual-stages ", o.virtual_stages,
                     ", --pp-layers '", o.pp_layers, "')");
  }
  const int dp_shard = ctx_->config().dp_shard;
  DTRAIN_CHECK_ARG((o.fsdp == "hybrid") == (dp_shard > 0),
                   o.fsdp == "hybrid" ? "--fsdp hybrid needs --dp-shard N (ranks per replica)"
                                      : "--dp-shard is only used by --fsdp hybrid",
                   "; got --fsdp ", o.fsdp, " --dp-shard ", dp_shard);
}

void Trainer::load_data() {
  const auto& o = options_;
  const std::int64_t dp = ctx_->dp_size();
  micro_batch_ = micro_batch_of(o, dp);
  accum_ = o.global_batch / (dp * micro_batch_);
  auto open = [&](const char* option, const std::string& value, const std::vector<std::string>& patterns) {
    std::unique_ptr<data::TokenDataset> ds;
    try {
      ds = std::make_unique<data::TokenDataset>(patterns, o.seq_len);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat(option, " '", value, "': ", e.what()));
    }
    const int max_token = ds->max_token();
    DTRAIN_CHECK_ARG(max_token < model_config_.vocab_size, option, " '", value,
                     "' holds token id ", max_token, " but the model's vocabulary is ",
                     model_config_.vocab_size, " (--vocab-size); allowed: ids below the vocabulary size");
    return ds;
  };
  blend_ = data::parse_blend(o.train_data, "--train-data");
  std::vector<std::string> patterns;
  std::vector<double> weights;
  for (const auto& c : blend_) patterns.push_back(c.pattern), weights.push_back(c.weight);
  train_ = open("--train-data", o.train_data, patterns);
  if (blend_.size() > 1) {
    std::unique_ptr<data::BlendedSampler> blended;
    try {
      blended = std::make_unique<data::BlendedSampler>(*train_, weights, o.global_batch, ctx_->dp_rank(),
                                                       static_cast<int>(dp), o.seed);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("--train-data '", o.train_data, "': ", e.what()));
    }
    // The shares the sampler deals (the weights rounded in its period), for the log and manifest.
    for (std::size_t c = 0; c < blend_.size(); ++c) {
      blend_[c].weight = static_cast<double>(blended->period_share(c)) / data::BlendedSampler::kPeriod;
    }
    sampler_ = std::move(blended);
  } else {
    DTRAIN_CHECK_ARG(o.global_batch <= train_->num_samples(), "--global-batch=", o.global_batch,
                     " exceeds the ", train_->num_samples(), " samples of --seq-len ", o.seq_len,
                     " in --train-data '", o.train_data, "'");
    sampler_ = std::make_unique<data::DistributedSampler>(
        train_->num_samples(), o.global_batch, ctx_->dp_rank(), static_cast<int>(dp), o.seed);
  }
  if (!o.val_data.empty()) {
    DTRAIN_CHECK_ARG(!data::is_blend(o.val_data), "--val-data '", o.val_data,
                     "' is a blend; allowed: one glob (blends are for --train-data)");
    val_ = open("--val-data", o.val_data, {o.val_data});
    DTRAIN_CHECK_ARG(o.global_batch <= val_->num_samples(), "--val-data '", o.val_data, "' holds ",
                     val_->num_samples(), " samples of --seq-len ", o.seq_len,
                     "; one eval batch needs --global-batch=", o.global_batch);
    val_sampler_ = std::make_unique<data::DistributedSampler>(
        val_->num_samples(), o.global_batch, ctx_->dp_rank(), static_cast<int>(dp), o.seed,
        /*shuffle=*/false);
  }
}

void Trainer::validate_and_agree() {
  std::string error;
  try {
    check_options();
    load_data();
  } catch (const Error& e) {
    error = e.what();
  }
  // Every rank learns which ranks failed, so all raise together instead of hanging.
  const auto& world = ctx_->world();
  std::vector<int> failed;
  if (world->size() == 1) {
    if (!error.empty()) failed.push_back(0);
  } else {
    auto mine = torch::full({1}, error.empty() ? 0 : 1,
                            torch::TensorOptions().dtype(torch::kInt).device(ctx_->device()));
    auto all = torch::empty({world->size()}, mine.options());
    world->all_gather(all, mine)->synchronize();
    auto flags = all.cpu();
    for (int r = 0; r < world->size(); ++r) {
      if (flags[r].item<int>() != 0) failed.push_back(r);
    }
  }
  if (failed.empty()) return;
  if (!error.empty()) {
    // When rank 0 is fine, only this rank knows the cause: say whose error it is.
    if (failed.front() != 0) throw InvalidArgument(format("rank {}: {}", ctx_->rank(), error));
    throw InvalidArgument(error);
  }
  std::string ranks;
  for (int r : failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw InvalidArgument("the run cannot start: rank(s) " + ranks +
                        " rejected the configuration or data (see their error)");
}

std::int64_t Trainer::model_state_bytes() const {
  std::set<const void*> seen;
  std::int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    const auto* storage = t.storage().unsafeGetStorageImpl();
    if (seen.insert(storage).second) bytes += static_cast<std::int64_t>(storage->nbytes());
  };
  for (const auto& [name, p] : params_) {
    add(p);
    add(p.grad());
  }
  std::vector<const torch::optim::Optimizer*> optimizers{sdp_ ? &sdp_->optimizer() : optimizer_.get()};
  if (expert_optimizer_) optimizers.push_back(expert_optimizer_.get());
  for (const auto* opt : optimizers) {
    for (const auto& group : opt->param_groups()) {
      for (const auto& p : group.params()) {
        add(p);
        add(p.grad());
      }
    }
    for (const auto& [key, state] : opt->state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
      add(s.exp_avg());
      add(s.exp_avg_sq());
      add(s.max_exp_avg_sq());
    }
  }
  return bytes;
}

double Trainer::comm_bytes() const {
  if (pipeline_) return pipeline_->dp_bytes + (sdp_ ? sdp_->stats().comm_bytes : 0.0);
  const double experts = expert_ddp_ ? expert_ddp_->stats().comm_bytes : 0.0;
  return experts + (sdp_ ? sdp_->stats().comm_bytes : ddp_->stats().comm_bytes);
}

void Trainer::log_summary() const {
  const auto& o = options_;
  log_info("model: {} family, {} layers, d_model {}, {} heads ({} kv), context {}{}, vocab {}: "
           "{}M parameters, {} GFLOP per token (seq {})",
           model_config_.family, model_config_.n_layer, model_config_.d_model,
           model_config_.n_head, model_config_.n_kv_head, model_config_.context,
           (model_config_.attention_window > 0
                ? format(" (attention window {}{})", model_config_.attention_window,
                         model_config_.window_skip_every > 0
                             ? format(", global every {} blocks", model_config_.window_skip_every)
                             : std::string())
                : std::string()) +
               (model_config_.attention_softcap > 0
                    ? format(" (attention softcap {})", model_config_.attention_softcap)
                    : std::string()) +
               (model_config_.attention_sinks() ? format(" ({} softmax)", model_config_.softmax_type)
                                                : std::string()) +
               (model_config_.document_separator >= 0
                    ? format(" (documents end at token {}{})", model_config_.document_separator,
                             std::string(model_config_.reset_position_ids ? ", positions restart" : "") +
                                 (o.eod_mask_loss ? ", no loss at separators" : ""))
                    : std::string()),
           model_config_.vocab_size,
           std::round(static_cast<double>(model_config_.num_parameters()) / 1e4) / 100,
           flops_per_token_ / 1e9, o.seq_len);
  log_info("data: train {} tokens in {} shard(s) ({} samples){}", train_->num_tokens(),
           train_->num_shards(), train_->num_samples(),
           val_ ? format(", val {} tokens", val_->num_tokens()) : std::string(", no val split"));
  for (std::size_t c = 0; blend_.size() > 1 && c < blend_.size(); ++c) {
    log_info("data: blend {} of each batch from '{}' ({} samples)", blend_[c].weight, blend_[c].pattern,
             train_->component_samples(c));
  }
  log_info("batch: {} samples x {} tokens per step = dp {} x micro-batch {} x accumulation {}; "
           "{} steps, {} steps per epoch",
           o.global_batch, o.seq_len, ctx_->dp_size(), micro_batch_, accum_, o.steps,
           sampler_->steps_per_epoch());
  if (ctx_->tp_size() > 1) {
    log_info("tensor parallel: {} ranks{}: heads, MLP and vocabulary split ({} per rank)",
             ctx_->tp_size(), ctx_->sequence_parallel() ? " with sequence parallelism" : "",
             format("{} heads, {} kv heads", model_config_.n_head / ctx_->tp_size(),
                    model_config_.n_kv_head % ctx_->tp_size() == 0
                        ? std::to_string(model_config_.n_kv_head / ctx_->tp_size())
                        : std::to_string(model_config_.n_kv_head) + " (replicated)"));
  }
  if (ctx_->cp_size() > 1) {
    log_info("context parallel: {} ranks split each sequence, {} positions per rank (2 chunks of {}); {}; "
             "gradients averaged over dp x cp = {} rank(s)",
             ctx_->cp_size(), o.seq_len / ctx_->cp_size(), o.seq_len / (2 * ctx_->cp_size()),
             ctx_->config().cp_comm == CpComm::kAllToAll ? "heads exchanged for positions around attention (all-to-all)"
             : ctx_->config().cp_comm == CpComm::kRing   ? "keys and values passed round the ring (p2p)"
                                                         : "keys and values all-gathered per layer",
             ctx_->dp_cp_comm()->size());
  }
  if (model_config_.moe.enabled()) {
    const auto& moe = model_config_.moe;
    std::int64_t layers = 0;
    for (std::int64_t b = 0; b < model_config_.n_layer; ++b) layers += moe.is_moe_block(b) ? 1 : 0;
    log_info("moe: {} layer(s) (every {} block(s)) of {} SwiGLU experts x {} wide, top-{} {} routing, {}; "
             "aux {} z {} bias rate {}; ep {}: {} experts per rank, expert gradients averaged over {} rank(s)",
             layers, moe.every, moe.experts, model_config_.expert_hidden(), moe.topk, moe.score,
             moe.capacity_factor > 0 ? format("capacity factor {}", moe.capacity_factor) : std::string("dropless"),
             moe.aux_loss_coeff, moe.z_loss_coeff, moe.bias_update_rate, ctx_->ep_size(),
             moe.experts / ctx_->ep_size(), ctx_->dp_size() / ctx_->ep_size() * ctx_->cp_size());
  }
  log_info("device: {}; peak {} TFLOP/s per device{}{}", device_name_, peak_tflops_,
           peak_tflops_ > 0 ? "" : " (unknown: MFU not reported; --peak-tflops)",
           o.deterministic ? "; deterministic algorithms (bitwise-reproducible)" : "");
  if (pipeline_) {
    std::string blocks;
    for (int b : pipeline_->blocks) blocks += (blocks.empty() ? "" : ",") + std::to_string(b);
    log_info("pipeline: {} stages x {} chunk(s), schedule {}, {} micro-batches of {}; blocks per "
             "virtual stage {}; gradients reduced over {} data-parallel rank(s) (replicated: during each "
             "chunk's last backward; FSDP: after the pipeline)",
             ctx_->pp_size(), options_.virtual_stages, options_.pp_schedule, accum_, micro_batch_,
             blocks, ctx_->dp_cp_comm()->size());
  }
  if (sdp_) {
    log_info("sharding: {} over {} rank(s){}, {} unit(s), {} parameter elements per rank",
             to_string(sdp_->strategy()), ctx_->dp_cp_comm()->size(),
             ctx_->config().dp_shard > 0
                 ? format(" ({} replicas x {} shards)", ctx_->dp_size() / ctx_->config().dp_shard,
                          ctx_->shard_comm()->size())
                 : std::string(),
             sdp_->stats().units, sdp_->stats().shard_numel);
  } else if (ddp_) {
    log_info("data parallel: replicated over {} rank(s), {} gradient bucket(s)", ctx_->dp_cp_comm()->size(),
             ddp_->stats().buckets);
  }
  if (expert_ddp_) {
    log_info("experts: replicated over {} rank(s) (dp / ep), {} gradient bucket(s){}",
             expert_ddp_->comm()->size(), expert_ddp_->stats().buckets,
             sdp_ ? ", their own AdamW (not sharded)" : "");
  }
}

StepMetrics Trainer::train_step() {
  const auto device = ctx_->device();
  const auto t_step = Clock::now();
  auto timed_sync = [&]() {
    if (options_.sync_timing) synchronize(device);
  };
  inject_fault(ctx_->rank(), step_ + 1);
  StepMetrics m;
  m.step = step_ + 1;  // steps completed once this one is done
  m.lr = schedule_->lr(step_);
  const double scale = scaler_ ? scaler_->scale() : 1.0;
  if (sdp_) {
    sdp_->zero_grad();
  } else {
    optimizer_->zero_grad();
  }
  if (expert_optimizer_) expert_optimizer_->zero_grad();
  // The factor each micro-batch's loss gets in backward: MoE auxiliary losses get it too,
  // and the fused cross-entropy writes its gradient for it (micro-batches weighed by their
  // loss targets set their own below, and in the pipeline's before_loss).
  for (auto& model : models()) model->set_loss_grad_scale(scale / static_cast<double>(accum_));
  ep::reset_comm_stats();
  double pipeline_mean = 0;
  auto loss_sum = torch::zeros({}, torch::TensorOptions().device(device));
  if (pipeline_) {
    pipeline_mean = pipeline_step(m, scale);
  } else {
  model_->train();
  const auto [batch, weights] = step_batch(*train_, sampler_->indices(step_));
  for (std::int64_t k = 0; k < accum_; ++k) {
    const double weight = weights[static_cast<std::size_t>(k)];
    announce_loss_weight(*model_, scale, weight, static_cast<double>(accum_));
    auto inputs = batch.inputs.narrow(0, k * micro_batch_, micro_batch_).to(device);
    auto targets = batch.targets.narrow(0, k * micro_batch_, micro_batch_).to(device);
    if (sdp_) {
      sdp_->set_sync(k == accum_ - 1);
    } else {
      ddp_->set_sync(k == accum_ - 1);
    }
    if (expert_ddp_) expert_ddp_->set_sync(k == accum_ - 1);
    auto t = Clock::now();
    torch::Tensor loss;
    {
      auto span = trace::span(trace_.get(), "forward", "train", trace::Track::kCompute, {{"microbatch", k}});
      AutocastScope autocast(precision_dtype(options_.precision), device.type());
      loss = model_->loss(inputs, targets);
    }
    timed_sync();
    m.forward_ms += ms_since(t);
    t = Clock::now();
    {
      auto span = trace::span(trace_.get(), "backward", "train", trace::Track::kCompute, {{"microbatch", k}});
      (loss * (scale * weight)).backward();
    }
    timed_sync();
    m.backward_ms += ms_since(t);
    // A micro-batch without loss tokens here (weight 0) has the mean 0/0: it adds nothing.
    if (weight > 0) loss_sum += loss.detach().to(torch::kFloat) * weight;
  }
  auto t = Clock::now();
  {
    auto span = trace::span(trace_.get(), "grad-sync", "train", trace::Track::kComm);
    if (sdp_) {
      sdp_->finish_gradient_sync();
    } else {
      ddp_->finish_gradient_sync();
    }
    if (expert_ddp_) expert_ddp_->finish_gradient_sync();
  }
  timed_sync();
  m.sync_ms = ms_since(t);
  }
  auto t = Clock::now();
  auto optimizer_span = trace::span(trace_.get(), "optimizer", "train");
  const double max_norm =
      options_.grad_clip > 0 ? options_.grad_clip : std::numeric_limits<double>::infinity();
  // Clipping also unscales; an overflow (norm inf/nan, the same on every rank) skips the
  // update when loss scaling is on.
  if (sdp_) {
    // Experts (split over ep, outside the shards) join the sharded gradients' norm.
    m.grad_norm = sdp_->clip_grad_norm(
        max_norm, scale,
        expert_optimizer_ ? grad_groups(param_roles(models()), ctx_->tp_comm().get(), ctx_->pp_comm().get(),
                                        ctx_->ep_comm().get(), /*only_experts=*/true)
                          : std::vector<GradGroup>{});
  } else if (pipeline_ || ctx_->tp_size() > 1 || ctx_->ep_size() > 1) {
    m.grad_norm = clip_grad_norm(grad_groups(param_roles(models()), ctx_->tp_comm().get(),
                                             ctx_->pp_comm().get(), ctx_->ep_comm().get()),
                                 max_norm, scale);
  } else {
    m.grad_norm = clip_grad_norm(model_->parameters(), max_norm, nullptr, scale);
  }
  // The norm is the same on every rank: they all skip, or none does.
  const bool finite = std::isfinite(m.grad_norm);
  if (scaler_) {
    m.loss_scale = scale;
    scaler_->update(finite);
  }
  const bool apply = finite;
  m.skipped = !apply;
  skipped_ += apply ? 0 : 1;
  m.skipped_steps = skipped_;
  // A float16 overflow that lowered the loss scale is the scaler searching for its scale
  // (2^k can take many halvings), not divergence: it does not count toward
  // --max-skipped-steps unless the scale was already at its floor or the loss itself is
  // not finite (checked below, once the global loss is known).
  const bool scaler_backoff = scaler_ && !finite && scale > scaler_->options().min_scale;
  if (apply && expert_optimizer_) {
    set_learning_rate(*expert_optimizer_, m.lr);
    expert_optimizer_->step();
  }
  if (apply && sdp_) {
    sdp_->step(m.lr);
  } else if (apply) {
    set_learning_rate(*optimizer_, m.lr);
    optimizer_->step();
  }
  optimizer_span.end();
  timed_sync();
  m.optimizer_ms = ms_since(t);
  // The global mean loss: one scalar all-reduce over the data-parallel ranks.
  if (pipeline_) {
    m.loss = pipeline_mean;
  } else {
    ctx_->dp_cp_comm()->all_reduce(loss_sum, {ReduceOp::kAvg})->wait();
    m.loss = loss_sum.item<double>();
  }
  if (model_config_.moe.enabled()) collect_moe(m.moe);
  m.step_ms = ms_since(t_step);
  if (apply) {
    skipped_in_a_row_ = 0;
  } else if (!(scaler_backoff && std::isfinite(m.loss))) {
    ++skipped_in_a_row_;
  }
  if (skipped_in_a_row_ >= options_.max_skipped_steps) {
    throw Error(format("training diverged: {} steps in a row up to step {} had non-finite gradients "
                       "(last loss {}, grad norm {}) and were skipped; --max-skipped-steps {}. "
                       "Lower --lr or resume from an earlier checkpoint",
                       skipped_in_a_row_, step_ + 1, m.loss, m.grad_norm, options_.max_skipped_steps));
  }

  ++step_;
  const std::int64_t step_tokens = options_.global_batch * options_.seq_len;
  tokens_ += step_tokens;
  m.tokens = tokens_;
  m.tokens_per_s = static_cast<double>(step_tokens) / (m.step_ms / 1e3);
  m.tflops = flops_per_token_ * m.tokens_per_s / ctx_->world_size() / 1e12;
  m.mfu = peak_tflops_ > 0 ? m.tflops / peak_tflops_ : -1;
  const auto mem = memory_stats(device);
  m.mem_mib = mem.current_mib;
  m.peak_mem_mib = mem.peak_mib;
  return m;
}

void Trainer::collect_moe(MoeMetrics& m) {
  const auto& moe = model_config_.moe;
  const auto E = moe.experts;
  std::vector<std::int64_t> blocks;
  std::map<std::int64_t, std::int64_t> row_of;
  for (std::int64_t b = 0; b < model_config_.n_layer; ++b) {
    if (!moe.is_moe_block(b)) continue;
    row_of[b] = static_cast<std::int64_t>(blocks.size());
    blocks.push_back(b);
  }
  const auto L = static_cast<std::int64_t>(blocks.size());
  // Per layer: E counts, dropped, aux and z sums, forwards; a last row: a2a bytes and ms.
  // tp ranks route the same tokens: only tp rank 0 counts them. Summed over the world
  // (each layer lives on one pipeline stage).
  auto table = torch::zeros({L + 1, E + 4}, torch::TensorOptions().dtype(torch::kDouble).device(ctx_->device()));
  std::vector<std::pair<std::int64_t, models::Moe>> mine;
  for (auto& model : models()) {
    for (auto& layer : model->moe_layers()) mine.push_back(layer);
  }
  if (ctx_->tp_rank() == 0) {
    for (auto& [block, layer] : mine) {
      const auto& st = layer->stats();
      auto row = table[row_of[block]];
      row.narrow(0, 0, E).copy_(st.counts);
      row[E] = st.dropped;
      row[E + 1] = st.aux_loss;
      row[E + 2] = st.z_loss;
      row[E + 3] = static_cast<double>(st.forwards);
    }
  }
  const auto& a2a = ep::comm_stats();
  table[L][0] = a2a.bytes;
  table[L][1] = a2a.ms;
  ctx_->world()->all_reduce(table)->wait();
  const auto all = table.cpu();
  for (auto& [block, layer] : mine) {
    layer->update_bias(all[row_of[block]].narrow(0, 0, E).to(ctx_->device()));
    layer->reset_stats();
  }
  const int ep = ctx_->ep_size();
  double assigned = 0, dropped = 0, aux = 0, z = 0, forwards = 0;
  for (std::int64_t l = 0; l < L; ++l) {
    const auto row = all[l];
    const auto counts = row.narrow(0, 0, E);
    std::vector<double> per(static_cast<std::size_t>(E));
    for (std::int64_t e = 0; e < E; ++e) per[static_cast<std::size_t>(e)] = counts[e].item<double>();
    const double mean = counts.mean().item<double>();
    if (mean > 0) {
      m.expert_load_max_over_mean = std::max(m.expert_load_max_over_mean, counts.max().item<double>() / mean);
      const auto per_rank = counts.view({ep, E / ep}).sum(1);
      m.ep_load_max_over_mean =
          std::max(m.ep_load_max_over_mean, (per_rank.max() / per_rank.mean()).item<double>());
    }
    assigned += counts.sum().item<double>();
    dropped += row[E].item<double>();
    aux += row[E + 1].item<double>();
    z += row[E + 2].item<double>();
    forwards += row[E + 3].item<double>();
    m.tokens_per_expert.push_back(std::move(per));
  }
  m.layers = blocks;
  m.dropped_fraction = assigned > 0 ? dropped / assigned : 0;
  m.aux_loss = forwards > 0 ? aux / forwards : 0;
  m.z_loss = forwards > 0 ? z / forwards : 0;
  m.a2a_bytes = all[L][0].item<double>() / ctx_->world_size();
  m.a2a_ms = all[L][1].item<double>() / ctx_->world_size();
}

double Trainer::evaluate() {
  DTRAIN_CHECK_ARG(val_ != nullptr, "evaluate() needs --val-data");
  torch::NoGradGuard no_grad;
  const auto device = ctx_->device();
  const std::int64_t batches = std::min(options_.eval_batches, val_sampler_->steps_per_epoch());
  if (pipeline_) {
    for (auto& chunk : pipeline_->chunks) chunk->eval();
    pipeline_->scale = 1;
    double sum = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      const auto [batch, weights] = step_batch(*val_, val_sampler_->indices(b));
      AutocastScope autocast(precision_dtype(options_.precision), device.type());
      sum += pipeline_->runtime->forward_only(batch.inputs.to(device), batch.targets.to(device), weights);
    }
    for (auto& chunk : pipeline_->chunks) chunk->train();
    return pipeline_loss(sum / static_cast<double>(batches));
  }
  model_->eval();
  auto sum = torch::zeros({}, torch::TensorOptions().device(device));
  for (std::int64_t b = 0; b < batches; ++b) {
    const auto [batch, weights] = step_batch(*val_, val_sampler_->indices(b));
    for (std::int64_t k = 0; k < accum_; ++k) {
      AutocastScope autocast(precision_dtype(options_.precision), device.type());
      // Every rank runs the forward (its collectives); one without loss tokens adds nothing.
      const auto loss = model_->loss(batch.inputs.narrow(0, k * micro_batch_, micro_batch_).to(device),
                                     batch.targets.narrow(0, k * micro_batch_, micro_batch_).to(device));
      const double weight = weights[static_cast<std::size_t>(k)];
      if (weight > 0) sum += loss.to(torch::kFloat) * weight;
    }
  }
  model_->train();
  auto mean = sum / static_cast<double>(batches);
  ctx_->dp_cp_comm()->all_reduce(mean, {ReduceOp::kAvg})->wait();
  return mean.item<double>();
}

std::vector<StepMetrics> Trainer::run() {
  std::vector<StepMetrics> out;
  const PreemptionSignals signals(!options_.save_dir.empty());
  auto& rep = *reporter_;
  rep.start = Clock::now();
  rep.first_step = step_;
  const auto& o = options_;
  if (trace_) {  // time zero after a barrier: the ranks' timelines line up
    ctx_->world()->barrier()->wait();
    trace_->set_epoch();
  }
  while (step_ < o.steps) {
    auto step_span = trace::span(trace_.get(), "step", "train", trace::Track::kCompute, {{"step", step_ + 1}});
    StepMetrics m = train_step();
    step_span.end();
    const bool last = step_ == o.steps;
    if (val_ && (last || (o.eval_every > 0 && step_ % o.eval_every == 0))) {
      auto span = trace::span(trace_.get(), "eval", "train");
      m.val_loss = evaluate();
    }
    if (rep.active) {
      if (m.step % o.log_every == 0 || m.step == 1 || last || m.val_loss >= 0 || m.skipped) {
        char mfu[32] = "n/a";
        if (m.mfu >= 0) std::snprintf(mfu, sizeof(mfu), "%.1f%%", 100 * m.mfu);
        char scaling[128] = "";
        if (m.loss_scale > 0) {
          std::snprintf(scaling, sizeof(scaling), " | loss scale %g%s | skipped %lld", m.loss_scale,
                        m.skipped ? " (overflow, step skipped)" : "",
                        static_cast<long long>(m.skipped_steps));
        } else if (m.skipped) {
          std::snprintf(scaling, sizeof(scaling), " | non-finite gradients: step skipped (%lld in a row, %lld in all)",
                        static_cast<long long>(skipped_in_a_row_), static_cast<long long>(m.skipped_steps));
        }
        char line[640];
        std::snprintf(line, sizeof(line),
                      "step %5lld/%lld | loss %.4f | grad_norm %.3f | lr %.3e | %.0f tok/s | "
                      "%.3f TFLOP/s | mfu %s | mem %.0f MiB | %.0f ms%s",
                      static_cast<long long>(m.step), static_cast<long long>(o.steps), m.loss,
                      m.grad_norm, m.lr, m.tokens_per_s, m.tflops, mfu, m.peak_mem_mib, m.step_ms,
                      scaling);
        rep.clear_bar();
        log_info("{}", line);
        if (!m.moe.layers.empty()) {
          std::snprintf(line, sizeof(line),
                        "step %5lld: moe aux %.4f z %.4f | load max/mean: experts %.2f, ep ranks %.2f | "
                        "dropped %.1f%% | all-to-all %.2f MiB %.1f ms per rank",
                        static_cast<long long>(m.step), m.moe.aux_loss, m.moe.z_loss,
                        m.moe.expert_load_max_over_mean, m.moe.ep_load_max_over_mean,
                        100 * m.moe.dropped_fraction, m.moe.a2a_bytes / (1 << 20), m.moe.a2a_ms);
          log_info("{}", line);
        }
        if (m.val_loss >= 0) {
          std::snprintf(line, sizeof(line), "step %5lld: val loss %.4f",
                        static_cast<long long>(m.step), m.val_loss);
          log_info("{}", line);
        }
      }
      if (rep.metrics.is_open()) {
        nlohmann::json j = {{"step", m.step},
                            {"loss", m.loss},
                            {"grad_norm", m.grad_norm},
                            {"lr", m.lr},
                            {"tokens", m.tokens},
                            {"tokens_per_s", m.tokens_per_s},
                            {"tflops", m.tflops},
                            {"mfu", m.mfu >= 0 ? nlohmann::json(m.mfu) : nlohmann::json()},
                            {"step_ms", m.step_ms},
                            {"forward_ms", m.forward_ms},
                            {"backward_ms", m.backward_ms},
                            {"sync_ms", m.sync_ms},
                            {"optimizer_ms", m.optimizer_ms},
                            {"mem_mib", m.mem_mib},
                            {"peak_mem_mib", m.peak_mem_mib}};
        if (m.val_loss >= 0) j["val_loss"] = m.val_loss;
        if (!m.moe.layers.empty()) {
          j["moe"] = {{"layers", m.moe.layers},
                      {"tokens_per_expert", m.moe.tokens_per_expert},
                      {"expert_load_max_over_mean", m.moe.expert_load_max_over_mean},
                      {"ep_load_max_over_mean", m.moe.ep_load_max_over_mean},
                      {"dropped_fraction", m.moe.dropped_fraction},
                      {"aux_loss", m.moe.aux_loss},
                      {"z_loss", m.moe.z_loss},
                      {"a2a_bytes", m.moe.a2a_bytes},
                      {"a2a_ms", m.moe.a2a_ms}};
        }
        if (m.loss_scale > 0) j["loss_scale"] = m.loss_scale;
        if (m.loss_scale > 0 || m.skipped_steps > 0) {
          j["skipped"] = m.skipped;
          j["skipped_steps"] = m.skipped_steps;
        }
        rep.metrics << j.dump() << '\n';
        rep.metrics.flush();
      }
      rep.draw_bar(step_, o.steps);
    }
    out.push_back(m);
    const std::string stop_reason = stop_requested();
    const bool stop = !stop_reason.empty();
    if (pending_) finish_save(/*only_if_written=*/true);
    if (!o.save_dir.empty() && (stop || last || (o.save_every > 0 && step_ % o.save_every == 0))) {
      rep.clear_bar();
      save_checkpoint("", o.async_save && !stop && !last);
    }
    if (stop) {
      preempted_ = true;
      if (rep.active) {
        log_info("preempted ({}): stopped after step {} with a checkpoint; resume with --resume auto", stop_reason, step_);
      }
      break;
    }
  }
  rep.clear_bar();
  finish_save();
  if (trace_) {
    const auto path = trace::rank_path(o.trace_path, ctx_->rank());
    trace_->write(path);
    if (rep.active) log_info("trace: {} (one file per rank; merge_traces joins them)", path);
  }
  return out;
}

}  // namespace dtrain::train
