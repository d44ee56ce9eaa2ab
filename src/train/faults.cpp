// Preemption signals and fault injection.
#include "train/faults.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"

namespace dtrain::train {

namespace {

volatile sig_atomic_t g_signalled = 0;
struct sigaction g_old_term, g_old_usr1;

void on_signal(int) { g_signalled = 1; }

std::int64_t parse_int(const char* name, const std::string& value) {
  std::size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DTRAIN_CHECK_ARG(used == value.size() && v >= 0, name, "='", value, "' is not allowed; allowed: an integer >= 0");
  return v;
}

}  // namespace

PreemptionSignals::PreemptionSignals(bool enable) : enabled_(enable) {
  if (!enabled_) return;
  g_signalled = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
}

PreemptionSignals::~PreemptionSignals() {
  if (!enabled_) return;
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
}

bool preemption_signalled() { return g_signalled != 0; }

void inject_fault(int rank, std::int64_t step) {
  const auto kill_rank = env::get(env::kFaultKillRank);
  const auto at_step = env::get(env::kFaultAtStep);
  if (!kill_rank && !at_step) return;
  DTRAIN_CHECK_ARG(kill_rank && at_step, env::kFaultKillRank, " and ", env::kFaultAtStep,
                   " must be set together");
  const auto restart = env::get(env::kRestartCount);
  if (restart && parse_int(env::kRestartCount, *restart) > 0) return;
  if (parse_int(env::kFaultKillRank, *kill_rank) != rank || parse_int(env::kFaultAtStep, *at_step) != step) return;
  std::fprintf(stderr, "dtrain: fault injection: rank %d kills itself at step %lld (%s, %s)\n", rank,
               static_cast<long long>(step), env::kFaultKillRank, env::kFaultAtStep);
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
}

}  // namespace dtrain::train
