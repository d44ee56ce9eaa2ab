// Faults around the training loop (internal to src/train): preemption signals caught while
// training, and the fault injection the tests use to kill a rank at a chosen step.
#pragma once

#include <cstdint>

namespace dtrain::train {

// While alive (and enabled), SIGTERM and SIGUSR1 only set a flag that
// preemption_signalled() reads (the trainer finishes the step, saves and stops); the
// previous handlers come back afterwards.
class PreemptionSignals {
 public:
  explicit PreemptionSignals(bool enable);
  ~PreemptionSignals();
  PreemptionSignals(const PreemptionSignals&) = delete;
  PreemptionSignals& operator=(const PreemptionSignals&) = delete;

 private:
  bool enabled_;
};
bool preemption_signalled();

// With DTRAIN_FAULT_KILL_RANK=r and DTRAIN_FAULT_AT_STEP=s, world rank r kills itself
// (SIGKILL, as a crash or the OOM killer would) when step s begins, on the first attempt
// only (DTRAIN_RESTART_COUNT unset or 0; dtrain-run sets it on restarts). InvalidArgument
// naming the variable for a malformed value.
void inject_fault(int rank, std::int64_t step);

}  // namespace dtrain::train
