// Optimizer pieces shared by every strategy: AdamW with the usual decay / no-decay
// parameter groups, the learning-rate schedule (linear warm-up, then cosine, linear,
// 1 - sqrt or no decay, optionally over the last steps only: warmup-stable-decay), and
// gradient clipping by the global norm across the ranks that hold distinct gradient shards.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
struct AdamWParamState;
}

namespace dtrain {

class Communicator;

struct AdamWOptions {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  // Parameters whose name contains one of these get no weight decay, besides every
  // parameter with fewer than 2 dims (biases, norm weights).
  std::vector<std::string> no_decay_name_parts = {"emb"};
  // One fused multi-tensor pass per step (ops::fused_adamw: the CUDA kernel on GPUs)
  // instead of LibTorch's per-tensor ops; same state (AdamWParamState), so checkpoints and
  // everything that reads optimizer state see no difference.
  bool fused = false;
};

using NamedParameters = std::vector<std::pair<std::string, at::Tensor>>;

// True when the parameter gets weight decay under `options`.
bool decays(const std::string& name, const at::Tensor& param, const AdamWOptions& options);

// LibTorch's AdamW over two groups: group 0 decays, group 1 has weight_decay 0 (with
// options.fused, a torch::optim::AdamW whose step() is ops::fused_adamw).
// Raises InvalidArgument naming any option out of range.
std::unique_ptr<torch::optim::Optimizer> make_adamw(const NamedParameters& params,
                                                    const AdamWOptions& options);

// The AdamW state of `param` in `optimizer` (created with zero moments on first use, as
// LibTorch's AdamW does) with its step count advanced by one: what a fused step updates.
torch::optim::AdamWParamState& advance_adamw_state(torch::optim::Optimizer& optimizer, const at::Tensor& param);

// Sets the learning rate of every parameter group.
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

// The shape of the decay from the peak learning rate to the minimum: cosine
// (0.5 (1 + cos(pi p))), linear (1 - p), sqrt (1 - sqrt(p), the "1-sqrt" cooldown of
// Haegele et al. 2024) over the decay's progress p in [0, 1); constant: no decay.
enum class LrDecay { kCosine, kLinear, kSqrt, kConstant };
// "cosine" | "linear" | "sqrt" | "constant"; InvalidArgument names --lr-decay otherwise.
LrDecay parse_lr_decay(const std::string& name);
const char* to_string(LrDecay decay);

struct LrScheduleOptions {
  double lr = 0;                   // peak
  double min_lr = 0;               // reached at total_steps (ignored by kConstant)
  std::int64_t warmup_steps = 0;   // linear from lr / warmup_steps at step 0 to lr
  std::int64_t total_steps = 0;
  LrDecay decay = LrDecay::kCosine;
  // The decay spans the last decay_steps of total_steps, the peak held before them
  // (warmup-stable-decay, WSD); 0: every step after the warm-up.
  std::int64_t decay_steps = 0;
};

// Linear warm-up to lr, lr held until the decay starts, the decay to min_lr at
// total_steps, min_lr after that. Raises InvalidArgument naming an option out of range.
class LrSchedule {
 public:
  explicit LrSchedule(const LrScheduleOptions& options);
  double lr(std::int64_t step) const;
  const LrScheduleOptions& options() const { return o_; }
  std::int64_t decay_start() const;  // the first step of the decay

 private:
  LrScheduleOptions o_;
};

// Scales the gradients so that their global L2 norm is at most max_norm and returns the
// norm before clipping. shard_comm: the ranks that hold distinct pieces of the gradients
// (FSDP, tensor parallel); null when every rank holds all of them (data parallel after
// the all-reduce). Parameters without a gradient are skipped. grad_scale: the gradients
// hold grad_scale times their true values (loss scaling); the returned norm is the true
// one and one pass both unscales and clips. A norm that is not finite (an overflow)
// leaves the gradients untouched, and every rank of shard_comm sees the same norm.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                      Communicator* shard_comm = nullptr, double grad_scale = 1.0);

// Gradients that are distinct pieces across the ranks of each communicator in `over`
// (null entries and single ranks ignored): their squared norms are summed over those ranks.
// A gradient replicated on the ranks of a communicator leaves it out of `over`.
// counted = false: the gradients are clipped with the others but left out of the norm
// (another rank's identical copy counts them: a pipeline's tied embedding).
struct GradGroup {
  std::vector<at::Tensor> grads;
  std::vector<Communicator*> over;
  bool counted = true;
};
// clip_grad_norm over several groups (tensor parallelism: slices summed over tp,
// replicated norm weights counted once); the same contract as above.
double clip_grad_norm(const std::vector<GradGroup>& groups, double max_norm,
                      double grad_scale = 1.0);

}  // namespace dtrain
