// Pipeline schedules (gpipe, 1f1b, interleaved 1f1b, ZB-H1), their validation and a
// simulator of their execution.
#include "dtrain/parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <tuple>

#include "dtrain/core/error.hpp"

namespace dtrain::pp {

const char* to_string(Op op) {
  switch (op) {
    case Op::kForward: return "F";
    case Op::kBackward: return "B";
    case Op::kBackwardInput: return "Bi";
    case Op::kBackwardWeight: return "W";
  }
  return "?";
}

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGPipe;
  if (name == "1f1b") return ScheduleKind::k1F1B;
  if (name == "interleaved") return ScheduleKind::kInterleaved;
  if (name == "zb") return ScheduleKind::kZeroBubble;
  throw InvalidArgument("--pp-schedule '" + name +
                        "' is not known; allowed: gpipe, 1f1b, interleaved, zb");
}

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZeroBubble: return "zb";
  }
  return "?";
}

void check_shape(ScheduleKind kind, const ScheduleShape& s) {
  DTRAIN_CHECK_ARG(s.stages >= 1, "--pp=", s.stages, " must be at least 1");
  DTRAIN_CHECK_ARG(s.microbatches >= 1, "--microbatches=", s.microbatches, " must be at least 1");
  DTRAIN_CHECK_ARG(s.virtual_stages >= 1, "--virtual-stages=", s.virtual_stages,
                   " must be at least 1");
  DTRAIN_CHECK_ARG(kind == ScheduleKind::kInterleaved || s.virtual_stages == 1, "--virtual-stages=",
                   s.virtual_stages, " needs --pp-schedule interleaved (got ", to_string(kind), ")");
  DTRAIN_CHECK_ARG(kind != ScheduleKind::kInterleaved || s.microbatches % s.stages == 0,
                   "--microbatches=", s.microbatches, " is not a multiple of --pp=", s.stages,
                   "; the interleaved schedule runs micro-batches in groups of pp");
}

namespace {

StageActions gpipe(const ScheduleShape& s) {
  StageActions a;
  for (int i = 0; i < s.microbatches; ++i) a.push_back({Op::kForward, i, 0});
  for (int i = 0; i < s.microbatches; ++i) a.push_back({Op::kBackward, i, 0});
  return a;
}

StageActions one_f_one_b(const ScheduleShape& s, int rank) {
  const int m = s.microbatches, warm = std::min(s.stages - rank - 1, m);
  StageActions a;
  for (int i = 0; i < warm; ++i) a.push_back({Op::kForward, i, 0});
  for (int i = 0; i < m - warm; ++i) {
    a.push_back({Op::kForward, warm + i, 0});
    a.push_back({Op::kBackward, i, 0});
  }
  for (int i = m - warm; i < m; ++i) a.push_back({Op::kBackward, i, 0});
  return a;
}

// Megatron's interleaved order: unit k of the m * v (micro-batch, chunk) units runs chunk
// (k mod p v) / p (reversed for backward) on micro-batch (k / p v) p + k mod p.
StageActions interleaved(const ScheduleShape& s, int rank) {
  const int p = s.stages, v = s.virtual_stages, total = s.microbatches * v;
  auto chunk = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  const int warm = s.microbatches == p ? total : std::min((p - rank - 1) * 2 + (v - 1) * p, total);
  StageActions a;
  for (int k = 0; k < warm; ++k) a.push_back({Op::kForward, microbatch(k), chunk(k, true)});
  for (int i = 0; i < total - warm; ++i) {
    a.push_back({Op::kForward, microbatch(warm + i), chunk(warm + i, true)});
    a.push_back({Op::kBackward, microbatch(i), chunk(i, false)});
  }
  for (int k = total - warm; k < total; ++k) a.push_back({Op::kBackward, microbatch(k), chunk(k, false)});
  return a;
}

// ZB-H1: 1F1B with B split into Bi and W; stage `rank` lets up to `rank` weight gradients
// wait during the steady phase (the later stages wait less for input gradients there) and
// pays one back after each Bi of the cool-down, the rest at the end. Forwards whose W has
// not run stay at most p per stage, as in 1F1B.
StageActions zero_bubble(const ScheduleShape& s, int rank) {
  const int m = s.microbatches, warm = std::min(s.stages - rank - 1, m);
  StageActions a;
  std::deque<int> pending;
  auto weight = [&]() {
    a.push_back({Op::kBackwardWeight, pending.front(), 0});
    pending.pop_front();
  };
  for (int i = 0; i < warm; ++i) a.push_back({Op::kForward, i, 0});
  for (int i = 0; i < m - warm; ++i) {
    a.push_back({Op::kForward, warm + i, 0});
    a.push_back({Op::kBackwardInput, i, 0});
    pending.push_back(i);
    while (static_cast<int>(pending.size()) > rank) weight();
  }
  for (int i = m - warm; i < m; ++i) {
    a.push_back({Op::kBackwardInput, i, 0});
    pending.push_back(i);
    weight();
  }
  while (!pending.empty()) weight();
  return a;
}

bool is_backward_input(Op op) { return op == Op::kBackward || op == Op::kBackwardInput; }

}  // namespace

std::vector<StageActions> make_schedule(ScheduleKind kind, const ScheduleShape& shape) {
  check_shape(kind, shape);
  std::vector<StageActions> out;
  for (int r = 0; r < shape.stages; ++r) {
    switch (kind) {
      case ScheduleKind::kGPipe: out.push_back(gpipe(shape)); break;
      case ScheduleKind::k1F1B: out.push_back(one_f_one_b(shape, r)); break;
      case ScheduleKind::kInterleaved: out.push_back(interleaved(shape, r)); break;
      case ScheduleKind::kZeroBubble: out.push_back(zero_bubble(shape, r)); break;
    }
  }
  return out;
}

std::string check_message_order(const std::vector<StageActions>& schedule, const ScheduleShape& s) {
  const int p = s.stages, last = s.stages * s.virtual_stages - 1;
  // (sender rank, receiver rank) -> messages "F<mb>@<sender stage>" / "B<mb>@<sender stage>".
  std::map<std::pair<int, int>, std::vector<std::string>> sent, received;
  auto name = [](bool backward, int mb, int stage) {
    return std::string(backward ? "B" : "F") + std::to_string(mb) + "@" + std::to_string(stage);
  };
  for (int r = 0; r < p && r < static_cast<int>(schedule.size()); ++r) {
    for (const auto& a : schedule[static_cast<std::size_t>(r)]) {
      const int g = virtual_stage(r, a.chunk, p);
      if (a.op == Op::kForward) {
        if (g < last && (g + 1) % p != r) sent[{r, (g + 1) % p}].push_back(name(false, a.microbatch, g));
        if (g > 0 && (g - 1) % p != r) received[{(g - 1) % p, r}].push_back(name(false, a.microbatch, g - 1));
      } else if (a.op != Op::kBackwardWeight) {
        if (g > 0 && (g - 1) % p != r) sent[{r, (g - 1) % p}].push_back(name(true, a.microbatch, g));
        if (g < last && (g + 1) % p != r) received[{(g + 1) % p, r}].push_back(name(true, a.microbatch, g + 1));
      }
    }
  }
  for (const auto& [pair, messages] : sent) {
    const auto& expected = received[pair];
    for (std::size_t i = 0; i < std::max(messages.size(), expected.size()); ++i) {
      const std::string a = i < messages.size() ? messages[i] : "nothing";
      const std::string b = i < expected.size() ? expected[i] : "nothing";
      if (a != b) {
        return "rank " + std::to_string(pair.first) + " sends " + a + " as its message " + std::to_string(i) +
               " to rank " + std::to_string(pair.second) + ", which receives " + b + " there";
      }
    }
  }
  return {};
}

std::string validate(const std::vector<StageActions>& schedule, const ScheduleShape& s) {
  const int p = s.stages, v = s.virtual_stages, m = s.microbatches;
  if (static_cast<int>(schedule.size()) != p) {
    return detail::str_cat(schedule.size(), " stage lists for ", p, " stages");
  }
  // Per virtual stage: the micro-batch order of forwards and of input gradients.
  std::vector<std::vector<int>> fwd_order(static_cast<std::size_t>(p * v)), bwd_order(fwd_order.size());
  for (int r = 0; r < p; ++r) {
    // Per (micro-batch, chunk): 1 forward, then B, or Bi then W.
    std::map<std::pair<int, int>, std::string> seen;
    for (const auto& a : schedule[static_cast<std::size_t>(r)]) {
      if (a.microbatch < 0 || a.microbatch >= m || a.chunk < 0 || a.chunk >= v) {
        return detail::str_cat("stage ", r, ": ", to_string(a.op), " of micro-batch ", a.microbatch,
                                " chunk ", a.chunk, " is out of range");
      }
      auto& h = seen[{a.microbatch, a.chunk}];
      const std::string op = to_string(a.op);
      const bool ok = (a.op == Op::kForward && h.empty()) ||
                      (a.op == Op::kBackward && h == "F") ||
                      (a.op == Op::kBackwardInput && h == "F") ||
                      (a.op == Op::kBackwardWeight && h == "FBi");
      if (!ok) {
        return detail::str_cat("stage ", r, ": ", op, " of micro-batch ", a.microbatch, " chunk ",
                               a.chunk, " after [", h, "]");
      }
      h += op;
      const auto g = static_cast<std::size_t>(virtual_stage(r, a.chunk, p));
      if (a.op == Op::kForward) fwd_order[g].push_back(a.microbatch);
      if (is_backward_input(a.op)) bwd_order[g].push_back(a.microbatch);
    }
    for (int i = 0; i < m; ++i) {
      for (int c = 0; c < v; ++c) {
        const auto it = seen.find({i, c});
        const std::string h = it == seen.end() ? "" : it->second;
        if (h != "FB" && h != "FBiW") {
          return detail::str_cat("stage ", r, ": micro-batch ", i, " chunk ", c, " runs [", h,
                                 "], not a forward and a whole backward");
        }
      }
    }
  }
  for (std::size_t g = 1; g < fwd_order.size(); ++g) {
    if (fwd_order[g] != fwd_order[g - 1]) {
      return detail::str_cat("virtual stages ", g - 1, " and ", g,
                             " run their forwards in different micro-batch orders (messages would not pair)");
    }
    if (bwd_order[g] != bwd_order[g - 1]) {
      return detail::str_cat("virtual stages ", g, " and ", g - 1,
                             " run their backwards in different micro-batch orders (messages would not pair)");
    }
  }
  return {};
}

Simulation simulate(const std::vector<StageActions>& schedule, const ScheduleShape& s,
                    const ActionCosts& costs) {
  const int p = s.stages, vstages = s.stages * s.virtual_stages;
  Simulation sim;
  sim.timeline.resize(static_cast<std::size_t>(p));
  sim.peak_in_flight.assign(static_cast<std::size_t>(p), 0);
  // End time of (kind, micro-batch, virtual stage); kind 0: forward, 1: input gradient, 2: W.
  std::map<std::tuple<int, int, int>, double> done;
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> free(static_cast<std::size_t>(p), 0.0), busy(free);
  std::vector<int> in_flight(static_cast<std::size_t>(p), 0);
  auto cost = [&](Op op) {
    switch (op) {
      case Op::kForward: return costs.forward;
      case Op::kBackward: return costs.backward;
      case Op::kBackwardInput: return costs.backward_input;
      case Op::kBackwardWeight: return costs.backward_weight;
    }
    return 0.0;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& list = schedule[static_cast<std::size_t>(r)];
      auto& k = next[static_cast<std::size_t>(r)];
      while (k < list.size()) {
        const Action& a = list[k];
        const int g = virtual_stage(r, a.chunk, p);
        // (dependency, from another stage)
        std::vector<std::pair<std::tuple<int, int, int>, bool>> deps;
        if (a.op == Op::kForward) {
          if (g > 0) deps.push_back({{0, a.microbatch, g - 1}, (g - 1) % p != r});
        } else if (is_backward_input(a.op)) {
          deps.push_back({{0, a.microbatch, g}, false});
          if (g < vstages - 1) deps.push_back({{1, a.microbatch, g + 1}, (g + 1) % p != r});
        } else {
          deps.push_back({{1, a.microbatch, g}, false});
        }
        double start = free[static_cast<std::size_t>(r)];
        bool ready = true;
        for (const auto& [key, remote] : deps) {
          const auto it = done.find(key);
          if (it == done.end()) {
            ready = false;
            break;
          }
          start = std::max(start, it->second + (remote ? costs.transfer : 0.0));
        }
        if (!ready) break;
        const double end = start + cost(a.op);
        free[static_cast<std::size_t>(r)] = end;
        busy[static_cast<std::size_t>(r)] += cost(a.op);
        done[{a.op == Op::kForward ? 0 : is_backward_input(a.op) ? 1 : 2, a.microbatch, g}] = end;
        sim.timeline[static_cast<std::size_t>(r)].push_back({a, start, end});
        // In flight: forwards whose activations are still held (until B, or W).
        auto& f = in_flight[static_cast<std::size_t>(r)];
        if (a.op == Op::kForward) f += 1;
        if (a.op == Op::kBackward || a.op == Op::kBackwardWeight) f -= 1;
        sim.peak_in_flight[static_cast<std::size_t>(r)] = std::max(sim.peak_in_flight[static_cast<std::size_t>(r)], f);
        ++k;
        progress = true;
      }
    }
  }
  sim.completed = true;
  for (int r = 0; r < p; ++r) {
    const auto k = next[static_cast<std::size_t>(r)];
    const auto& list = schedule[static_cast<std::size_t>(r)];
    if (k < list.size()) {
      sim.completed = false;
      sim.deadlock += detail::str_cat(sim.deadlock.empty() ? "" : "; ", "stage ", r, " waits in ",
                                      to_string(list[k].op), " of micro-batch ", list[k].microbatch,
                                      " chunk ", list[k].chunk);
    }
  }
  double first = 0, last = 0, total_busy = 0;
  bool any = false;
  for (int r = 0; r < p; ++r) {
    const auto& t = sim.timeline[static_cast<std::size_t>(r)];
    if (t.empty()) continue;
    first = any ? std::min(first, t.front().start) : t.front().start;
    last = any ? std::max(last, t.back().end) : t.back().end;
    any = true;
    total_busy += busy[static_cast<std::size_t>(r)];
  }
  sim.makespan = last - first;
  sim.bubble = sim.makespan > 0 ? 1.0 - total_busy / (p * sim.makespan) : 0.0;
  return sim;
}

double theory_bubble(ScheduleKind kind, const ScheduleShape& s) {
  const double p = s.stages, m = s.microbatches;
  switch (kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::k1F1B: return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved: {
      const double w = (p - 1) / s.virtual_stages;
      return w / (m + w);
    }
    case ScheduleKind::kZeroBubble: return (p - 1) / (3 * m + p - 1);  // F = Bi = W
  }
  return 0;
}

}  // namespace dtrain::pp
