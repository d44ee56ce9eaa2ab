// Pipeline runtime: executes one stage's list of a pipeline schedule (pipeline_schedule.hpp)
// over the pp communicator. Forwards receive activations from the previous virtual stage
// and send theirs on; backwards receive output gradients and send input gradients back;
// the last virtual stage computes the loss. Shapes are known up front (no shape exchange).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/core/trace.hpp"
#include "dtrain/parallel/pipeline_schedule.hpp"

namespace dtrain::pp {

// One model chunk of this rank (virtual stage chunk * p + rank).
struct StageChunk {
  // token ids [micro, seq] on virtual stage 0, else the previous stage's output -> output
  std::function<at::Tensor(const at::Tensor&)> forward;
  // last virtual stage: output, targets [micro, seq] -> mean loss of the micro-batch
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;
  std::vector<at::Tensor> parameters;  // what W (the weight-gradient part) differentiates
  // Called before each action that accumulates this chunk's parameter gradients (B, or W
  // under zb) with whether it is the chunk's last of the step: e.g. DataParallel::set_sync,
  // so the gradient reduction overlaps the last backward. Optional.
  std::function<void(bool last)> before_weight_grads;
  // Called before each forward with the micro-batch's token ids [micro, seq] (undefined
  // where run() got no inputs): what a later stage needs of them besides the activations,
  // e.g. the model's document mask (Gpt::forward_stage's tokens). Optional.
  std::function<void(const at::Tensor& tokens)> before_forward;
  // Called on the last virtual stage before each loss with the factor run() weighs that
  // micro-batch's loss by (its weight, 1/m without weights): e.g. the upstream gradient
  // the model's fused cross-entropy writes its logit gradient for. Optional.
  std::function<void(double weight)> before_loss;
};

struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::k1F1B;
  ScheduleShape shape;                          // stages = pp size
  std::vector<std::int64_t> activation_shape;   // what stages pass: [micro, seq, d]
  c10::ScalarType activation_dtype = c10::ScalarType::Float;
  // Spans of every action (F, B, Bi, W: compute track, args microbatch/chunk/stage) and
  // of every send post, receive wait and the final send wait (comm track); null: none.
  trace::Recorder* trace = nullptr;
};

class PipelineRuntime {
 public:
  // chunks: this rank's v chunks. Raises InvalidArgument when the shape does not fit the
  // schedule or the communicator (stages != pp size) or the chunk count is not v.
  PipelineRuntime(std::vector<StageChunk> chunks, CommPtr pp, PipelineOptions options);

  // Forward and backward of the m micro-batches of one step: inputs and targets are
  // [m * micro, seq] (read on the stages that use them). weights: each micro-batch's
  // factor in the step's loss (read on the last stage; empty: 1/m each, the mean of equal
  // micro-batches; e.g. their shares of the loss tokens when some targets are ignored).
  // Gradients accumulate into the chunks' parameters as d(weighted sum of the micro-batch
  // losses); returns that sum on the last stage's rank, NaN elsewhere.
  double run(const at::Tensor& inputs, const at::Tensor& targets, const std::vector<double>& weights = {});
  // Forward only (no graph): the weighted sum of the m micro-batch losses (weights as
  // above) on the last stage's rank, NaN elsewhere. Micro-batches in order, each through
  // this rank's chunks in order.
  double forward_only(const at::Tensor& inputs, const at::Tensor& targets, const std::vector<double>& weights = {});
  // The pp rank that holds the last virtual stage (the loss).
  int loss_rank() const { return pp_->size() - 1; }
  const std::vector<StageActions>& schedule() const { return schedule_; }

 private:
  std::vector<StageChunk> chunks_;
  CommPtr pp_;
  PipelineOptions options_;
  std::vector<StageActions> schedule_;
  // run() and forward_only() share the message plumbing.
  struct Transport;
};

}  // namespace dtrain::pp
