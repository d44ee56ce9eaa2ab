// Dynamic loss scaling for float16 training: the loss is multiplied by scale() before
// backward so small gradients survive float16; a step whose gradients overflow (inf/nan)
// is skipped and the scale backs off, and after growth_interval good steps in a row it
// grows again. Host-side bookkeeping only; the trainer unscales through clip_grad_norm.
#pragma once

#include <cstdint>

namespace dtrain {

struct LossScalerOptions {
  double init_scale = 65536.0;        // 2^16, as PyTorch's GradScaler and Megatron
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 1000;  // good steps in a row before the scale grows
  double min_scale = 1.0;             // backoff never goes below this
};

// What a checkpoint needs to resume the scaler exactly.
struct LossScalerState {
  double scale = 0;
  std::int64_t good_steps = 0;     // finite steps since the last change of scale
  std::int64_t skipped_steps = 0;  // overflowed steps since the start of training
};

class DynamicLossScaler {
 public:
  // InvalidArgument naming the option when a value is out of range.
  explicit DynamicLossScaler(LossScalerOptions options = {});

  double scale() const { return state_.scale; }
  // Records one step's outcome; returns whether its update should be applied (the
  // gradients were finite). An overflow multiplies the scale by backoff_factor (not below
  // min_scale); growth_interval finite steps in a row multiply it by growth_factor.
  bool update(bool finite);

  std::int64_t skipped_steps() const { return state_.skipped_steps; }
  const LossScalerState& state() const { return state_; }
  void load_state(const LossScalerState& state);
  const LossScalerOptions& options() const { return options_; }

 private:
  LossScalerOptions options_;
  LossScalerState state_;
};

}  // namespace dtrain
