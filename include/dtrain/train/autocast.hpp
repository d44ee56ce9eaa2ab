// Mixed-precision autocast for a forward pass: inside an AutocastScope, LibTorch runs
// matmuls in the chosen low-precision dtype and keeps reductions in float32. The one place
// that maps the training `--precision` names (fp32, bf16, fp16) to dtypes.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace dtrain::train {

// fp32 -> Float (no autocast), bf16 -> BFloat16, fp16 -> Half; InvalidArgument naming
// `option` otherwise.
c10::ScalarType precision_dtype(const std::string& precision, const char* option = "--precision");

class AutocastScope {
 public:
  // Autocast to `dtype` on `device` until destruction; Float leaves autocast off.
  AutocastScope(c10::ScalarType dtype, c10::DeviceType device);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool on_;
  c10::DeviceType device_;
};

}  // namespace dtrain::train
