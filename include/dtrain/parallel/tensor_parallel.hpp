// Megatron-style tensor parallelism over a tensor-parallel communicator: autograd-aware
// region functions (the communication of a TP layer, with its transpose in backward) and
// the column- and row-parallel linear layers built from them, with optional sequence
// parallelism (activations split along the sequence between TP layers).
#pragma once

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/ops/cross_entropy.hpp"

namespace dtrain::tp {

// Identity forward; all-reduce (sum) of the gradient across tp in backward. Marks where a
// replicated activation enters a region whose ranks each use it for a different slice.
at::Tensor copy_to_region(const at::Tensor& x, const CommPtr& tp);
// All-reduce (sum) across tp forward; identity backward. Sums partial results.
at::Tensor reduce_from_region(const at::Tensor& x, const CommPtr& tp);
// Keeps this rank's slice of the last dimension; backward all-gathers the gradient.
at::Tensor scatter_to_region(const at::Tensor& x, const CommPtr& tp);
// All-gathers the ranks' slices along the last dimension; backward keeps this rank's slice.
at::Tensor gather_from_region(const at::Tensor& x, const CommPtr& tp);
// Sequence parallelism along dimension `dim`: reduce-scatter (sum, each rank keeps its
// sequence slice) forward and all-gather backward; and its transpose, all-gather forward
// and reduce-scatter backward.
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const CommPtr& tp, std::int64_t dim);
at::Tensor gather_from_sequence(const at::Tensor& x, const CommPtr& tp, std::int64_t dim);

// Traffic of the tensor-parallel functions in this process (region functions, the
// vocabulary-parallel embedding and cross-entropy), counted with wire_bytes: what
// tp_bench compares with the analytical count. Not thread-safe; reset between steps.
struct CommStats {
  double bytes = 0;         // bytes this rank sent
  std::int64_t calls = 0;   // collectives issued
};
const CommStats& comm_stats();
void reset_comm_stats();

struct ParallelLinearOptions {
  bool bias = true;
  // Column: all-gather the output's last dimension (else each rank keeps out/tp features).
  bool gather_output = false;
  // Row: the input already holds this rank's in/tp features (else it is split here).
  bool input_is_parallel = true;
  // Row: return the output without the bias (the caller fuses it later; bias() has it).
  bool skip_bias_add = false;
  // Sequence parallelism: the column layer's input and the row layer's output are split
  // along sequence_dim across tp (all-gather before, reduce-scatter after).
  bool sequence_parallel = false;
  std::int64_t sequence_dim = 1;  // [batch, time, features]
};

// Where a replicated (or, with sequence parallelism, sequence-split along sequence_dim)
// activation enters column-parallel layers: copy_to_region, or gather_from_sequence.
// Several column layers that read the same input share one entry (one all-gather).
at::Tensor enter_column_region(const at::Tensor& x, const CommPtr& tp,
                               const ParallelLinearOptions& options);

// Y = X A^T + b with A [out, in] split by output features: this rank holds rows
// [r * out/tp, (r+1) * out/tp) of A and b. Input replicated (or sequence-split).
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  // InvalidArgument naming out_features and tp when tp does not divide out_features.
  ColumnParallelLinearImpl(std::int64_t in_features, std::int64_t out_features, CommPtr tp,
                           ParallelLinearOptions options = {});
  // Copies this rank's slice of the full weight [out, in] and bias [out].
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});
  at::Tensor forward(const at::Tensor& x);
  // forward() for an input that already went through enter_column_region.
  at::Tensor forward_entered(const at::Tensor& entered);
  at::Tensor weight, bias;  // this rank's slices

 private:
  CommPtr tp_;
  std::int64_t in_, out_;
  ParallelLinearOptions options_;
};
TORCH_MODULE(ColumnParallelLinear);

// Y = X A^T + b with A [out, in] split by input features: this rank holds columns
// [r * in/tp, (r+1) * in/tp) of A; the partial products are summed across tp (or
// reduce-scattered along the sequence); the bias is replicated and added after the sum
// (on a sequence shard with sequence parallelism: its gradient is then summed across tp).
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  // InvalidArgument naming in_features and tp when tp does not divide in_features.
  RowParallelLinearImpl(std::int64_t in_features, std::int64_t out_features, CommPtr tp,
                        ParallelLinearOptions options = {});
  void load_full(const at::Tensor& weight, const at::Tensor& bias = {});
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;  // weight: this rank's columns; bias: whole, replicated

 private:
  CommPtr tp_;
  std::int64_t in_, out_;
  ParallelLinearOptions options_;
};
TORCH_MODULE(RowParallelLinear);

// Token embedding with the vocabulary split across tp: the table is padded to a multiple
// of tp rows (padded_vocab), each rank holds rows [r * padded/tp, (r+1) * padded/tp); a
// token outside this rank's rows contributes zeros and the ranks' lookups are summed
// (reduce-scattered along dimension 1 of [batch, time] ids with sequence parallelism).
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(std::int64_t vocab_size, std::int64_t dim, CommPtr tp,
                             bool sequence_parallel = false);
  // Copies this rank's rows of the full table [vocab, dim]; padding rows are zero.
  void load_full(const at::Tensor& weight);
  at::Tensor forward(const at::Tensor& ids);
  std::int64_t padded_vocab() const { return padded_; }
  std::int64_t first_row() const { return padded_ / tp_->size() * tp_->rank(); }
  at::Tensor weight;  // [padded/tp, dim]

 private:
  CommPtr tp_;
  std::int64_t vocab_, padded_, dim_;
  bool sequence_parallel_;
};
TORCH_MODULE(VocabParallelEmbedding);

// The smallest multiple of tp that holds vocab_size.
std::int64_t padded_vocab_size(std::int64_t vocab_size, int tp);

// Mean cross-entropy over the rows of logits whose last dimension is split across tp
// (this rank's padded_vocab/tp columns, as a column-parallel head without gather_output
// produces), never gathering the full logits: the row max, the sum of exponentials and
// the target logit are reduced across tp. Columns at or beyond vocab_size (padding) are
// ignored. targets: [rows] in [0, vocab_size), or ignore_index: such rows are left out of
// the mean (0 when every row is) and get no gradient. Gradient flows to local_logits.
// z_loss: PaLM's z-loss coefficient, as ops::CrossEntropyOptions::z_loss.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        std::int64_t vocab_size, const CommPtr& tp,
                                        std::int64_t ignore_index = -100, double z_loss = 0.0);

// The same loss by dtrain's fused cross-entropy over the split vocabulary (the model's
// fused_ce, --fused-ce): on CUDA one kernel pass over this rank's logits for its row
// statistics, one all-gather of two floats per row and rank, and one pass writing the
// gradient (in place of the logits with options.in_place, so no float32 copy and no
// saved softmax); the op's reference path elsewhere. options gives ignore_index,
// grad_scale, in_place and z_loss; vocab_start, vocab_size and combine are set here.
at::Tensor fused_vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                              std::int64_t vocab_size, const CommPtr& tp,
                                              ops::CrossEntropyOptions options = {});

// The same loss of hidden local_weight^T without those logits in memory at once
// (ops::linear_cross_entropy over this rank's rows of the head, the model's
// fused_linear_ce at tp > 1): chunks of chunk_rows rows (0: automatic, the same on every
// rank), one all-gather of two floats per row and rank each. hidden [rows, hidden] must
// have entered the column region (tp::enter_column_region), whose backward sums the
// ranks' shares of its gradient; local_weight [padded vocab / tp, hidden].
at::Tensor fused_vocab_parallel_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& local_weight,
                                                     const at::Tensor& targets, std::int64_t vocab_size,
                                                     const CommPtr& tp, ops::CrossEntropyOptions options = {},
                                                     std::int64_t chunk_rows = 0);

// Dropout randomness under tensor parallelism (as Megatron's RNG tracker): two generator
// states, "replicated" (seeded alike on every rank of a tp group: activations that are
// the same on every tp rank get the same mask) and "split" (seed + 2718 + tp rank:
// activations split across tp, by heads or by sequence, get independent masks). fork()
// swaps one state into the device's default generator for a scope; dropout drawn inside
// uses it and advances it. Not thread-safe; one tracker per model.
class RngTracker {
 public:
  enum class Stream { kReplicated, kSplit };
  RngTracker(std::uint64_t seed, int tp_rank, c10::Device device);

  class Fork {
   public:
    ~Fork();
    Fork(const Fork&) = delete;
    Fork& operator=(const Fork&) = delete;

   private:
    friend class RngTracker;
    Fork(RngTracker* owner, Stream stream);
    RngTracker* owner_;
    Stream stream_;
    at::Tensor saved_;  // the default generator's state before the fork
  };
  [[nodiscard]] std::unique_ptr<Fork> fork(Stream stream);
  // Both states, to replay the same masks (activation checkpointing recomputes a block).
  std::vector<at::Tensor> states() const;
  void set_states(const std::vector<at::Tensor>& states);

 private:
  c10::Device device_;
  at::Tensor states_[2];
};

// Dropout (inverted scaling) drawn from one of the tracker's streams; identity when not
// training or p == 0.
at::Tensor dropout(const at::Tensor& x, double p, bool training, RngTracker& rng,
                   RngTracker::Stream stream);

}  // namespace dtrain::tp
