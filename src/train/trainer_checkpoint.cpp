// Trainer checkpoints: the rank's state as pieces of the single-process tensors, the
// collective save (rank files, then rank 0's manifest and the atomic commit), the load
// into any layout, resume at construction, and the per-step preemption check.
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sys/stat.h>

#include "dtrain/checkpoint/directory.hpp"
#include "dtrain/checkpoint/safetensors.hpp"
#include "dtrain/checkpoint/sharded.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/data/dataset.hpp"
#include "dtrain/models/hf_names.hpp"
#include "dtrain/core/logging.hpp"
#include "dtrain/train/trainer.hpp"
#include "train/faults.hpp"

#ifndef DTRAIN_VERSION
#define DTRAIN_VERSION "unknown"
#endif

namespace dtrain::train {

using checkpoint::CheckpointError;
using checkpoint::Runs;
using json = nlohmann::json;

// One tensor of this rank's state: `values` (1-D, live) are local elements of the global
// tensor `key`; `load` maps them all, `save` the ones this rank writes (each global element
// is written by exactly one rank: replicas and tied copies leave it to the first).
struct Trainer::StateTensor {
  std::string key;
  std::vector<std::int64_t> shape;
  at::Tensor values;
  Runs load, save;
};

namespace {

std::string rank_file(int rank) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank_%05d.safetensors", rank);
  return buf;
}

// Every rank's text, on every rank (two all-gathers: lengths, then padded bytes).
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text, at::Device device) {
  if (comm.size() == 1) return {text};
  const auto opts = torch::TensorOptions().device(device);
  auto lengths = torch::empty({comm.size()}, opts.dtype(torch::kLong));
  comm.all_gather(lengths, torch::full({1}, static_cast<std::int64_t>(text.size()), opts.dtype(torch::kLong)))->wait();
  const auto n = lengths.cpu();
  std::int64_t longest = 1;
  for (int r = 0; r < comm.size(); ++r) longest = std::max(longest, n[r].item<std::int64_t>());
  auto mine = torch::zeros({longest}, torch::kByte);
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  auto all = torch::empty({longest * comm.size()}, opts.dtype(torch::kByte));
  comm.all_gather(all, mine.to(device))->wait();
  const auto bytes = all.cpu();
  std::vector<std::string> out;
  for (int r = 0; r < comm.size(); ++r) {
    const auto* p = reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>()) + r * longest;
    out.emplace_back(p, static_cast<std::size_t>(n[r].item<std::int64_t>()));
  }
  return out;
}

// Raises CheckpointError on every rank when any rank's `error` is not empty (the first one,
// naming its rank when there are several).
void agree(Communicator& comm, const std::string& error, at::Device device) {
  const auto all = all_gather_text(comm, error, device);
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[static_cast<std::size_t>(r)].empty()) continue;
    throw CheckpointError(comm.size() > 1 ? format("rank {}: {}", r, all[static_cast<std::size_t>(r)])
                                          : all[static_cast<std::size_t>(r)]);
  }
}

// Architecture fields added after the first checkpoints, with the value every model had
// before them: what a checkpoint that lacks one was saved with.
const json& later_fields() {
  static const json fields = {{"qk_norm", false}, {"softmax_type", "vanilla"}};
  return fields;
}

// The architecture fields a checkpoint must share with the model that loads it.
json architecture(const models::GptConfig& c) {
  return {{"family", c.family},         {"vocab_size", c.vocab_size},
          {"n_layer", c.n_layer},       {"n_head", c.n_head},
          {"n_kv_head", c.n_kv_head},   {"d_model", c.d_model},
          {"mlp_hidden", c.mlp_hidden()}, {"tie_embeddings", c.tie_embeddings}, {"qk_norm", c.qk_norm},
          {"softmax_type", c.softmax_type},
          {"moe_experts", c.moe.experts}, {"moe_every", c.moe.every},
          {"expert_hidden", c.moe.experts > 0 ? c.expert_hidden() : 0}};
}

std::int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::int64_t>(st.st_size) : -1;
}

std::string read_manifest(const std::string& dir) {
  const auto path = fs::join(dir, "manifest.json");
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw CheckpointError("checkpoint '" + dir + "': manifest.json is missing");
  std::string text;
  char buf[1 << 16];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  return text;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The AdamW state of p (null when the optimizer has not stepped it yet).
torch::optim::AdamWParamState* adam_state(const torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto& state = const_cast<torch::optim::Optimizer&>(opt).state();
  const auto it = state.find(p.unsafeGetTensorImpl());
  return it == state.end() ? nullptr : static_cast<torch::optim::AdamWParamState*>(it->second.get());
}

}  // namespace

std::vector<Trainer::StateTensor> Trainer::state_tensors(const ShardedState* fsdp) const {
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, shape] : model_config_.parameter_shapes()) shapes[name] = shape;
  struct Map {
    std::vector<std::int64_t> shape;
    Runs load, save;
  };
  std::map<std::string, Map> maps;
  std::vector<StateTensor> out;
  const bool ep = ctx_->ep_size() > 1;
  const int tp_rank = ctx_->tp_rank();
  const bool first_dp = ctx_->dp_cp_comm()->rank() == 0;  // cp ranks hold the same parameters too
  auto add = [&](const std::string& kind, const std::string& name, const at::Tensor& values, const Runs& load,
                 const Runs& save) {
    out.push_back({kind + "/" + name, maps.at(name).shape, values.reshape({-1}), load, save});
  };
  for (const auto& chunk : models()) {
    const auto params = chunk->parameter_list();
    const auto& shards = chunk->tp_shards();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      const auto& spec = shards[i].second;
      const bool expert = models::is_expert_parameter(name);
      Map m;
      m.shape = shapes.at(name);
      const auto rows = chunk->expert_rows();
      m.load = expert ? checkpoint::slice_runs(m.shape, spec.dim, spec.ranges, rows.first, rows.second)
                      : checkpoint::slice_runs(m.shape, spec.dim, spec.ranges);
      const bool copy = name == "tok_emb.weight" && !chunk->stage().embedding;
      const bool sharded = sdp_ && !(ep && expert);
      // The rank that writes among the replicas: dp x cp (or expert-dp) rank 0, the first FSDP
      // replica, tp rank 0 for the elements every tp rank holds.
      const bool writer = expert && ep ? ctx_->expert_dp_comm()->rank() == 0
                                       : (sharded ? sdp_->primary_replica() : first_dp);
      if (!copy && writer) m.save = tp_rank == 0 ? m.load : checkpoint::restrict_runs(m.load, 0, spec.replicated_from);
      maps[name] = m;
      if (sharded) continue;  // from the FSDP pieces below
      add("param", name, p.detach(), m.load, m.save);
      const auto* opt = sdp_ ? expert_optimizer_.get() : optimizer_.get();
      if (auto* st = adam_state(*opt, p)) {
        add("exp_avg", name, st->exp_avg(), m.load, m.save);
        add("exp_avg_sq", name, st->exp_avg_sq(), m.load, m.save);
      }
    }
    for (const auto& b : chunk->named_buffers()) {  // router biases: the same on every rank of a stage
      if (!ends_with(b.key(), "moe.bias")) continue;
      const Runs whole{{0, 0, b.value().numel()}};
      out.push_back({"buffer/" + b.key(), b.value().sizes().vec(), b.value().reshape({-1}), whole,
                     first_dp && tp_rank == 0 ? whole : Runs{}});
    }
  }
  if (fsdp != nullptr) {
    for (const auto& [kind, pieces] : {std::make_pair("param", &fsdp->params), std::make_pair("exp_avg", &fsdp->exp_avg),
                                       std::make_pair("exp_avg_sq", &fsdp->exp_avg_sq)}) {
      for (const auto& piece : *pieces) {
        const auto& m = maps.at(piece.name);
        const std::int64_t lo = piece.offset, hi = piece.offset + piece.values.numel();
        add(kind, piece.name, piece.values, checkpoint::restrict_runs(m.load, lo, hi),
            checkpoint::restrict_runs(m.save, lo, hi));
      }
    }
  }
  return out;
}

// A save between its snapshot and its commit: what every rank writes (host copies) and
// what rank 0 puts in the manifest. Async saves write from a thread while training goes on.
struct Trainer::PendingSave {
  std::string root;
  std::int64_t step = 0;
  json meta;  // manifest fields known at the snapshot
  std::vector<checkpoint::ShardEntry> entries;
  std::vector<std::pair<std::string, at::Tensor>> extra;
  json result;  // this rank's file record, or {"error": ...}
  std::thread writer;
  std::atomic<bool> written{false};
  std::chrono::steady_clock::time_point start;
  double snapshot_ms = 0;
  bool async = false;
  ~PendingSave() {
    if (writer.joinable()) writer.join();
  }
};

std::shared_ptr<Trainer::PendingSave> Trainer::snapshot(const std::string& root) {
  torch::NoGradGuard no_grad;
  auto& world = *ctx_->world();
  const auto device = ctx_->device();
  auto p = std::make_shared<PendingSave>();
  p->root = root;
  p->step = step_;
  p->start = std::chrono::steady_clock::now();
  std::string error;
  if (world.rank() == 0) {
    try {
      checkpoint::begin_save(root, step_);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree(world, error, device);
  try {
    // Host copies: training may change the live tensors while the file is written.
    const auto sharded = sdp_ ? sdp_->sharded_state() : ShardedState{};
    for (auto& t : state_tensors(sdp_ ? &sharded : nullptr)) {
      if (t.save.empty()) continue;
      p->entries.push_back({t.key, t.shape, t.values.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true), t.save});
    }
    p->extra.emplace_back("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
    if (!device.is_cpu()) p->extra.emplace_back("rng/device", at::globalContext().defaultGenerator(device).get_state());
    auto chunks = models();
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const auto states = chunks[c]->rng().states();
      for (std::size_t k = 0; k < states.size(); ++k) p->extra.emplace_back(format("rng/chunk{}/{}", c, k), states[k]);
    }
  } catch (const Error& e) {
    error = e.what();
  }
  agree(world, error, device);
  if (world.rank() == 0) {
    const auto& o = options_;
    const auto& pc = ctx_->config();
    json& m = p->meta;
    m["dtrain_version"] = DTRAIN_VERSION;
    m["model"] = architecture(model_config_);
    m["parallel"] = {{"world", world.size()},   {"pp", ctx_->pp_size()},
                     {"dp", ctx_->dp_size()},   {"ep", ctx_->ep_size()},
                     {"tp", ctx_->tp_size()},   {"cp", ctx_->cp_size()},
                     {"dp_shard", pc.dp_shard},
                     {"sequence_parallel", ctx_->sequence_parallel()},
                     {"virtual_stages", o.virtual_stages}, {"fsdp", o.fsdp}};
    std::int64_t adam_steps = 0;
    if (sdp_) adam_steps = sdp_->sharded_state().optimizer_step;
    for (const auto* opt : {optimizer_.get(), expert_optimizer_.get()}) {
      if (opt == nullptr) continue;
      for (const auto& [key, st] : opt->state()) {
        adam_steps = std::max<std::int64_t>(adam_steps, static_cast<const torch::optim::AdamWParamState&>(*st).step());
      }
    }
    m["train"] = {{"step", step_}, {"tokens", tokens_}, {"skipped_steps", skipped_},
                  {"skipped_in_a_row", skipped_in_a_row_}, {"optimizer_steps", adam_steps}};
    m["sampler"] = {{"step", step_}, {"seed", o.seed}, {"global_batch", o.global_batch},
                    {"seq_len", o.seq_len}, {"num_samples", train_->num_samples()},
                    {"epoch", step_ / sampler_->steps_per_epoch()}};
    if (blend_.size() > 1) {
      json blend = json::array();
      for (std::size_t c = 0; c < blend_.size(); ++c) {
        blend.push_back({{"weight", blend_[c].weight}, {"pattern", blend_[c].pattern},
                         {"samples", train_->component_samples(c)}});
      }
      m["sampler"]["blend"] = blend;
    }
    const auto& lr = schedule_->options();
    m["schedule"] = {{"kind", to_string(lr.decay)}, {"lr", lr.lr}, {"min_lr", lr.min_lr},
                     {"warmup_steps", lr.warmup_steps}, {"decay_start", schedule_->decay_start()},
                     {"steps", lr.total_steps}, {"next_lr", schedule_->lr(step_)}};
    if (scaler_) {
      const auto& st = scaler_->state();
      m["loss_scaler"] = {{"scale", st.scale}, {"good_steps", st.good_steps}, {"skipped_steps", st.skipped_steps}};
    }
    m["rng"] = "per rank in its file: rng/cpu, rng/device, rng/chunk<c>/<k> (restored only into the same layout)";
  }
  p->snapshot_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p->start).count();
  return p;
}

// This rank's file (no collective: runs in the writer thread of an async save).
void Trainer::write_rank_file(PendingSave& p, int rank) {
  try {
    const auto name = rank_file(rank);
    const auto path = fs::join(checkpoint::staging_dir(p.root, p.step), name);
    std::vector<checkpoint::ShardSummary> summaries;
    const auto checksum = checkpoint::write_shard_file(
        path, p.entries, p.extra, {{"format", "dtrain-checkpoint rank file"}, {"rank", std::to_string(rank)}},
        &summaries);
    json tensors = json::array();
    for (const auto& s : summaries) tensors.push_back({s.key, s.shape, s.dtype, s.lo, s.hi, s.numel});
    p.result = {{"file", name},
                {"bytes", file_size(path)},
                {"checksum", checksum},
                {"mesh", {{"pp", ctx_->pp_rank()}, {"dp", ctx_->dp_rank()}, {"ep", ctx_->ep_rank()}, {"cp", ctx_->cp_rank()},
                          {"tp", ctx_->tp_rank()}}},
                {"tensors", tensors}};
  } catch (const std::exception& e) {
    p.result = {{"error", e.what()}};
  }
  p.entries.clear();  // free the host copies
  p.extra.clear();
  p.written = true;
}

std::string Trainer::commit(const std::shared_ptr<PendingSave>& p) {
  auto& world = *ctx_->world();
  const auto device = ctx_->device();
  if (p->writer.joinable()) p->writer.join();
  const auto all = all_gather_text(world, p->result.dump(), device);
  const auto staging = checkpoint::staging_dir(p->root, p->step);
  std::string error;
  for (int r = 0; r < world.size() && error.empty(); ++r) {
    const auto j = json::parse(all[static_cast<std::size_t>(r)]);
    if (j.contains("error")) error = format("rank {}: {}", r, j["error"].get<std::string>());
  }
  if (!error.empty()) {
    if (world.rank() == 0) fs::remove_tree(staging);  // best effort; begin_save clears it anyway
    throw CheckpointError("checkpoint step " + std::to_string(p->step) + " was not saved: " + error);
  }
  std::int64_t bytes = 0;
  if (world.rank() == 0) {
    try {
      json manifest = p->meta;
      std::vector<checkpoint::FileRecord> files;
      json tensors = json::object(), ranks = json::array();
      for (int r = 0; r < world.size(); ++r) {
        const auto j = json::parse(all[static_cast<std::size_t>(r)]);
        files.push_back({j["file"], j["bytes"], j["checksum"]});
        bytes += j["bytes"].get<std::int64_t>();
        ranks.push_back({{"rank", r}, {"file", j["file"]}, {"mesh", j["mesh"]}});
        for (const auto& t : j["tensors"]) {
          auto& entry = tensors[t[0].get<std::string>()];
          entry["shape"] = t[1];
          entry["dtype"] = t[2];
          entry["shards"].push_back({{"rank", r}, {"file", j["file"]}, {"lo", t[3]}, {"hi", t[4]}, {"numel", t[5]}});
        }
      }
      manifest["ranks"] = ranks;
      manifest["tensors"] = tensors;
      checkpoint::commit_save(p->root, p->step, manifest.dump(1), files, options_.keep_checkpoints);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree(world, error, device);
  const auto dir = checkpoint::step_dir(p->root, p->step);
  last_save_ = {p->snapshot_ms,
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p->start).count()};
  if (world.rank() == 0) {
    log_info("checkpoint: step {} saved to {} ({} MiB in {} s, {} file(s){})", p->step, dir,
             std::round(static_cast<double>(bytes) / (1 << 20) * 100) / 100, std::round(last_save_.total_ms) / 1000,
             world.size(), p->async ? format(", async: training paused {} ms", std::round(p->snapshot_ms)) : std::string());
  }
  return dir;
}

std::string Trainer::save_checkpoint(const std::string& root_in, bool async) {
  const std::string root = root_in.empty() ? options_.save_dir : root_in;
  DTRAIN_CHECK_ARG(!root.empty(), "save_checkpoint: no directory given and no --save-dir");
  finish_save();  // the previous async save first
  auto p = snapshot(root);
  const int rank = ctx_->world()->rank();
  if (!async) {
    write_rank_file(*p, rank);
    return commit(p);
  }
  p->async = true;
  auto* raw = p.get();
  p->writer = std::thread([this, raw, rank] { write_rank_file(*raw, rank); });
  pending_ = p;
  return checkpoint::step_dir(root, p->step);
}

std::string Trainer::finish_save(bool only_if_written) {
  if (!pending_) return "";
  if (only_if_written) {
    // Commit only when every rank's writer is done (one small all-reduce).
    auto flag = torch::full({1}, pending_->written ? 1 : 0, torch::TensorOptions().dtype(torch::kInt).device(ctx_->device()));
    ctx_->world()->all_reduce(flag, {ReduceOp::kMin})->wait();
    if (flag.cpu().item<int>() == 0) return "";
  }
  auto p = std::move(pending_);
  return commit(p);
}

void Trainer::load_checkpoint(const std::string& dir) {
  finish_save();
  torch::NoGradGuard no_grad;
  auto& world = *ctx_->world();
  const auto device = ctx_->device();
  // Phase 1 (local): read everything into CPU copies; nothing live changes yet.
  json manifest;
  ShardedState fsdp_state;  // FSDP: the shard pieces, filled in place
  struct Loaded {
    at::Tensor live;    // copied into in phase 2 (undefined: an FSDP piece, filled in place)
    at::Tensor values;  // CPU
    at::Tensor param;   // a moment with no optimizer state yet: the parameter it belongs to
    bool sq = false;
  };
  std::vector<Loaded> loaded;
  std::vector<std::pair<std::string, at::Tensor>> rng;
  std::int64_t adam_steps = 0;
  bool same_layout = false;
  std::string error;
  try {
    try {
      manifest = json::parse(read_manifest(dir));
    } catch (const json::exception& e) {
      throw CheckpointError("checkpoint '" + dir + "': manifest.json is not valid JSON: " + e.what());
    }
    if (!manifest.contains("model") || !manifest.contains("tensors") || !manifest.contains("train")) {
      throw CheckpointError("checkpoint '" + dir + "': manifest.json lacks model, tensors or train");
    }
    const json here = architecture(model_config_);
    for (const auto& [field, value] : here.items()) {
      const auto there = manifest["model"].value(field, later_fields().value(field, json()));
      if (there != value) {
        throw CheckpointError("checkpoint '" + dir + "' is from a different model: " + field + " is " + there.dump() +
                              " there, " + value.dump() + " here");
      }
    }
    std::map<std::string, std::vector<checkpoint::ShardReader::Shard>> index;
    for (const auto& [key, t] : manifest["tensors"].items()) {
      for (const auto& s : t["shards"]) {
        index[key].push_back({s["file"].get<std::string>(),
                              {key, t["shape"].get<std::vector<std::int64_t>>(), t["dtype"].get<std::string>(),
                               s["lo"].get<std::int64_t>(), s["hi"].get<std::int64_t>(), s["numel"].get<std::int64_t>()}});
      }
    }
    checkpoint::ShardReader reader(dir, std::move(index));
    adam_steps = manifest["train"].value("optimizer_steps", std::int64_t{0});
    if (sdp_) {
      fsdp_state = sdp_->sharded_state();
      fsdp_state.exp_avg.clear();
      fsdp_state.exp_avg_sq.clear();
      for (auto& piece : fsdp_state.params) {
        piece.values = piece.values.detach().to(at::kCPU, at::kFloat).clone();
        if (adam_steps > 0) {
          fsdp_state.exp_avg.push_back({piece.name, piece.shape, piece.offset, torch::zeros_like(piece.values)});
          fsdp_state.exp_avg_sq.push_back({piece.name, piece.shape, piece.offset, torch::zeros_like(piece.values)});
        }
      }
      fsdp_state.optimizer_step = adam_steps;
    }
    std::set<const void*> pieces;
    for (const auto* list : {&fsdp_state.params, &fsdp_state.exp_avg, &fsdp_state.exp_avg_sq}) {
      for (const auto& piece : *list) pieces.insert(piece.values.data_ptr());
    }
    auto check_shape = [&](const std::string& key, const std::vector<std::int64_t>& shape) {
      const auto& there = reader.shape(key);  // raises when absent
      if (there != shape) {
        throw CheckpointError(format("checkpoint '{}' is from a different model: tensor {} is {} there, {} here", dir,
                                     key, at::IntArrayRef(there), at::IntArrayRef(shape)));
      }
    };
    std::map<std::string, Runs> param_runs;
    std::set<std::string> have;
    for (auto& t : state_tensors(sdp_ ? &fsdp_state : nullptr)) {
      if (t.key.rfind("exp_avg", 0) == 0 && adam_steps == 0) continue;  // a checkpoint before any step
      check_shape(t.key, t.shape);
      have.insert(t.key);
      if (t.key.rfind("param/", 0) == 0) param_runs[t.key.substr(6)] = t.load;
      if (pieces.count(t.values.data_ptr())) {  // an FSDP piece: filled in place
        reader.fill(t.key, t.load, t.values);
        continue;
      }
      // Elements no run maps (padding) keep their values.
      Loaded l{t.values, t.values.detach().to(at::kCPU).clone(), {}, false};
      reader.fill(t.key, t.load, l.values);
      loaded.push_back(std::move(l));
    }
    // Moments of parameters whose optimizer has no state yet (a trainer that has not
    // stepped): loaded here, attached as new AdamW states in phase 2.
    if (adam_steps > 0) {
      for (const auto& chunk : models()) {
        for (const auto& [name, p] : chunk->parameter_list()) {
          if (sdp_ && !(ctx_->ep_size() > 1 && models::is_expert_parameter(name))) continue;
          for (const bool sq : {false, true}) {
            const std::string key = std::string(sq ? "exp_avg_sq/" : "exp_avg/") + name;
            if (have.count(key)) continue;
            check_shape(key, reader.shape("param/" + name));
            auto values = torch::zeros({p.numel()}, torch::kFloat);
            reader.fill(key, param_runs.at(name), values);
            loaded.push_back({{}, values, p, sq});
          }
        }
      }
    }
    const auto par = manifest.value("parallel", json::object());
    same_layout = par.value("world", -1) == world.size() && par.value("pp", -1) == ctx_->pp_size() &&
                  par.value("tp", -1) == ctx_->tp_size() && par.value("ep", -1) == ctx_->ep_size() &&
                  par.value("dp", -1) == ctx_->dp_size() && par.value("cp", 1) == ctx_->cp_size() &&
                  par.value("virtual_stages", -1) == options_.virtual_stages;
    if (same_layout) {
      const auto file = rank_file(world.rank());
      std::vector<std::string> names{"rng/cpu", "rng/device"};
      for (std::size_t c = 0; c < models().size(); ++c) {
        for (int k = 0; k < 2; ++k) names.push_back(format("rng/chunk{}/{}", c, k));
      }
      for (const auto& name : names) {
        auto t = reader.read_extra(file, name);
        if (t.defined()) rng.emplace_back(name, t);
      }
    }
  } catch (const Error& e) {
    error = e.what();
  } catch (const json::exception& e) {
    error = "checkpoint '" + dir + "': manifest.json is malformed: " + e.what();
  }
  agree(world, error, device);

  // Phase 2: every rank read its part; install it.
  std::map<const c10::TensorImpl*, std::pair<at::Tensor, at::Tensor>> fresh;  // parameter -> (exp_avg, exp_avg_sq)
  for (auto& l : loaded) {
    if (l.param.defined()) {
      auto& slot = fresh[l.param.unsafeGetTensorImpl()];
      (l.sq ? slot.second : slot.first) = l.values.view(l.param.sizes()).to(l.param.device());
    } else {
      l.live.copy_(l.values);
    }
  }
  for (auto* opt : {optimizer_.get(), expert_optimizer_.get()}) {
    if (opt == nullptr || fresh.empty()) continue;
    for (const auto& group : opt->param_groups()) {
      for (const auto& p : group.params()) {
        const auto it = fresh.find(p.unsafeGetTensorImpl());
        if (it == fresh.end()) continue;
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        st->step(adam_steps);
        st->exp_avg(it->second.first);
        st->exp_avg_sq(it->second.second);
        opt->state()[p.unsafeGetTensorImpl()] = std::move(st);
      }
    }
  }
  if (sdp_) sdp_->load_state(fsdp_state);  // a collective: into the shards, then gathered
  const auto& train = manifest["train"];
  step_ = train.value("step", std::int64_t{0});
  tokens_ = train.value("tokens", std::int64_t{0});
  skipped_ = train.value("skipped_steps", std::int64_t{0});
  skipped_in_a_row_ = train.value("skipped_in_a_row", std::int64_t{0});
  if (scaler_ && manifest.contains("loss_scaler")) {
    const auto& s = manifest["loss_scaler"];
    scaler_->load_state({s.value("scale", scaler_->scale()), s.value("good_steps", std::int64_t{0}),
                         s.value("skipped_steps", std::int64_t{0})});
  }
  auto chunks = models();
  if (same_layout) {
    std::map<std::string, at::Tensor> by_name(rng.begin(), rng.end());
    if (by_name.count("rng/cpu")) {
      auto gen = at::detail::getDefaultCPUGenerator();
      gen.set_state(by_name["rng/cpu"]);
    }
    if (by_name.count("rng/device") && !device.is_cpu()) {
      auto gen = at::globalContext().defaultGenerator(device);
      gen.set_state(by_name["rng/device"]);
    }
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const auto a = format("rng/chunk{}/0", c), b = format("rng/chunk{}/1", c);
      if (by_name.count(a) && by_name.count(b)) chunks[c]->rng().set_states({by_name[a], by_name[b]});
    }
  } else {
    // Another layout: the dropout streams restart from a seed of (seed, step).
    for (auto& chunk : chunks) {
      tp::RngTracker fresh_rng(options_.seed + 1000003ULL * static_cast<std::uint64_t>(step_), ctx_->tp_rank(), device);
      chunk->rng().set_states(fresh_rng.states());
    }
  }
  const auto sampler = manifest.value("sampler", json::object());
  if (ctx_->rank() == 0) {
    log_info("checkpoint: resumed from {} at step {} ({} tokens){}", dir, step_, tokens_,
             same_layout ? "" : "; another layout: state resharded, dropout RNG streams reseeded");
    if (sampler.value("seed", options_.seed) != options_.seed ||
        sampler.value("global_batch", options_.global_batch) != options_.global_batch ||
        sampler.value("seq_len", options_.seq_len) != options_.seq_len) {
      log_warn("checkpoint: --seed, --global-batch or --seq-len differ from the checkpoint's ({}, {}, {}): the data "
               "order does not continue the saved run's",
               sampler.value("seed", std::uint64_t{0}), sampler.value("global_batch", std::int64_t{0}),
               sampler.value("seq_len", std::int64_t{0}));
    }
  }
}

void Trainer::export_hf(const std::string& path) {
  const auto full = full_parameters();  // collective over tp, pp and ep
  std::string error;
  if (ctx_->world()->rank() == 0) {
    try {
      const auto slash = path.rfind('/');
      if (slash != std::string::npos && slash > 0) fs::make_directories(path.substr(0, slash));
      // The metadata names the transformers class (none where no class computes the
      // model: the file then serves --init-from) and, beside the architecture, what its
      // config needs that the weights do not carry: the sliding window, the experts per token.
      std::string why;
      const auto cls = models::hf_class(model_config_, &why);
      json model = architecture(model_config_);
      if (!cls.empty()) model["hf_class"] = cls;
      model["attention_window"] = model_config_.attention_window;
      model["moe_topk"] = model_config_.moe.enabled() ? model_config_.moe.topk : 0;
      checkpoint::write_safetensors(path, models::to_hf(model_config_, full),
                                    {{"format", "pt"}, {"dtrain_model", model.dump()}});
      log_info("export: {} ({} tensors, Hugging Face {} names{})", path, full.size(),
               cls.empty() ? (model_config_.family == "gpt2" ? "GPT-2" : "Llama") : cls,
               model_config_.attention_window > 0 ? format(", sliding_window {}", model_config_.attention_window)
                                                  : std::string());
      if (cls.empty()) log_warn("export: no transformers class computes this model from its weights ({})", why);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree(*ctx_->world(), error, ctx_->device());
}

void Trainer::load_hf(const std::string& path) {
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> full;
  std::string error;
  try {
    checkpoint::SafetensorsReader reader(path);
    for (auto& [name, t] : models::from_hf(model_config_, [&](const std::string& n) {
           return reader.contains(n) ? reader.read(n).to(at::kFloat) : at::Tensor();
         })) {
      full[name] = t.reshape({-1});
    }
  } catch (const Error& e) {
    error = "--init-from '" + path + "': " + e.what();
  }
  agree(*ctx_->world(), error, ctx_->device());
  ShardedState fsdp_state;
  if (sdp_) {
    fsdp_state = sdp_->sharded_state();
    fsdp_state.exp_avg.clear();
    fsdp_state.exp_avg_sq.clear();
    fsdp_state.optimizer_step = 0;
    for (auto& piece : fsdp_state.params) piece.values = piece.values.detach().to(at::kCPU, at::kFloat).clone();
  }
  std::set<const void*> pieces;
  for (const auto& piece : fsdp_state.params) pieces.insert(piece.values.data_ptr());
  for (auto& t : state_tensors(sdp_ ? &fsdp_state : nullptr)) {
    if (t.key.rfind("param/", 0) != 0) continue;
    const auto& flat = full.at(t.key.substr(6));
    const bool piece = pieces.count(t.values.data_ptr()) != 0;
    auto values = piece ? t.values : t.values.detach().to(at::kCPU).clone();  // padding keeps its values
    for (const auto& r : t.load) values.narrow(0, r.local, r.numel).copy_(flat.narrow(0, r.global, r.numel));
    if (!piece) t.values.copy_(values);
  }
  for (auto* opt : {optimizer_.get(), expert_optimizer_.get()}) {
    if (opt != nullptr) opt->state().clear();
  }
  if (sdp_) sdp_->load_state(fsdp_state);  // no moments: the sharded AdamW starts afresh
  if (ctx_->rank() == 0) log_info("init: parameters from {} (Hugging Face names); optimizer state fresh", path);
}

void Trainer::resume() {
  auto& world = *ctx_->world();
  std::string dir, error;
  if (world.rank() == 0) {
    try {
      const auto& r = options_.resume;
      const std::string root = r == "auto" ? options_.save_dir : r;
      if (r != "auto" && fs::exists(fs::join(r, "manifest.json"))) {
        checkpoint::verify(r);  // an explicit checkpoint must be good: no fallback
        dir = r;
      } else if (!checkpoint::list_steps(root).empty()) {
        std::vector<std::string> skipped;
        dir = checkpoint::latest_good(root, &skipped);
        for (const auto& s : skipped) log_warn("checkpoint: skipping {}; falling back to an older one", s);
      } else if (r != "auto") {
        throw CheckpointError("--resume '" + r + "' is neither a checkpoint (no manifest.json) nor a directory " +
                              "of step_<N> checkpoints");
      } else {
        log_info("checkpoint: none under {}: starting from step 0", root);
      }
    } catch (const Error& e) {
      error = e.what();
    }
  }
  const auto answer = all_gather_text(world, json{{"dir", dir}, {"error", error}}.dump(), ctx_->device());
  const auto j = json::parse(answer.front());
  if (!j["error"].get<std::string>().empty()) throw CheckpointError(j["error"].get<std::string>());
  dir = j["dir"].get<std::string>();
  if (!dir.empty()) load_checkpoint(dir);
}

std::string Trainer::stop_requested() {
  if (options_.save_dir.empty()) return "";
  const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - created_).count() / 60;
  const bool out_of_time = options_.exit_duration_mins > 0 && minutes >= options_.exit_duration_mins;
  auto flags = torch::tensor({preemption_signalled() ? 1 : 0, out_of_time ? 1 : 0}, torch::kInt).to(ctx_->device());
  ctx_->world()->all_reduce(flags, {ReduceOp::kMax})->wait();
  flags = flags.cpu();
  if (flags[0].item<int>() != 0) return "a preemption signal";
  if (flags[1].item<int>() != 0) return format("--exit-duration-mins {}", options_.exit_duration_mins);
  return "";
}

}  // namespace dtrain::train
