// Autocast scope and precision names.
#include "dtrain/train/autocast.hpp"

#include <ATen/autocast_mode.h>

#include "dtrain/core/error.hpp"

namespace dtrain::train {

c10::ScalarType precision_dtype(const std::string& precision, const char* option) {
  if (precision == "fp32") return at::kFloat;
  if (precision == "bf16") return at::kBFloat16;
  if (precision == "fp16") return at::kHalf;
  throw InvalidArgument(detail::str_cat(option, " '", precision,
                                        "' is not known; allowed: fp32, bf16, fp16"));
}

AutocastScope::AutocastScope(c10::ScalarType dtype, c10::DeviceType device)
    : on_(dtype != at::kFloat), device_(device) {
  if (!on_) return;
  at::autocast::set_autocast_dtype(device_, dtype);
  at::autocast::set_autocast_enabled(device_, true);
}

AutocastScope::~AutocastScope() {
  if (!on_) return;
  at::autocast::set_autocast_enabled(device_, false);
  at::autocast::clear_cache();
}

}  // namespace dtrain::train
