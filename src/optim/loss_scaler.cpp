// Dynamic loss scaler bookkeeping.
#include "dtrain/optim/loss_scaler.hpp"

#include <algorithm>
#include <cmath>

#include "dtrain/core/error.hpp"

namespace dtrain {

DynamicLossScaler::DynamicLossScaler(LossScalerOptions options) : options_(options) {
  const auto& o = options_;
  DTRAIN_CHECK_ARG(std::isfinite(o.init_scale) && o.init_scale >= 1, "--loss-scale-init=",
                   o.init_scale, " is not allowed; allowed: a finite number >= 1");
  DTRAIN_CHECK_ARG(o.growth_interval >= 1, "--loss-scale-window=", o.growth_interval,
                   " is not allowed; allowed: >= 1");
  DTRAIN_CHECK_ARG(o.growth_factor > 1 && std::isfinite(o.growth_factor),
                   "loss scaler growth_factor=", o.growth_factor, " must be > 1");
  DTRAIN_CHECK_ARG(o.backoff_factor > 0 && o.backoff_factor < 1,
                   "loss scaler backoff_factor=", o.backoff_factor, " must be in (0, 1)");
  DTRAIN_CHECK_ARG(o.min_scale > 0 && o.min_scale <= o.init_scale, "loss scaler min_scale=",
                   o.min_scale, " must be in (0, init_scale=", o.init_scale, "]");
  state_.scale = o.init_scale;
}

bool DynamicLossScaler::update(bool finite) {
  if (!finite) {
    state_.scale = std::max(state_.scale * options_.backoff_factor, options_.min_scale);
    state_.good_steps = 0;
    ++state_.skipped_steps;
    return false;
  }
  if (++state_.good_steps >= options_.growth_interval) {
    const double grown = state_.scale * options_.growth_factor;
    if (std::isfinite(grown)) state_.scale = grown;
    state_.good_steps = 0;
  }
  return true;
}

void DynamicLossScaler::load_state(const LossScalerState& state) {
  DTRAIN_CHECK_ARG(std::isfinite(state.scale) && state.scale > 0 && state.good_steps >= 0 &&
                       state.skipped_steps >= 0,
                   "loss scaler state (scale ", state.scale, ", good steps ", state.good_steps,
                   ", skipped ", state.skipped_steps, ") is not valid");
  state_ = state;
}

}  // namespace dtrain
