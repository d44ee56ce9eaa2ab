// Pipeline schedules as pure functions: for p stages, m micro-batches and v virtual stages
// (model chunks) per rank, the ordered list of forward / backward (/ weight-gradient)
// actions each stage runs; validation of the pairing and ordering rules a runtime relies
// on, and a simulator that executes the lists with given action costs (bubble, makespan,
// peak in-flight micro-batches). No tensors, no communication.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::pp {

// kBackward: input and weight gradients together. The zero-bubble schedule splits it into
// kBackwardInput (the gradient the previous stage waits for) and kBackwardWeight (the
// parameters' gradients, deferrable to fill the bubble).
enum class Op : std::uint8_t { kForward, kBackward, kBackwardInput, kBackwardWeight };
const char* to_string(Op op);  // "F", "B", "Bi", "W"

struct Action {
  Op op = Op::kForward;
  int microbatch = 0;
  int chunk = 0;  // model chunk on this rank, 0..v-1 (virtual stage chunk * p + rank)
  bool operator==(const Action& o) const {
    return op == o.op && microbatch == o.microbatch && chunk == o.chunk;
  }
};
using StageActions = std::vector<Action>;

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved, kZeroBubble };
// "gpipe" | "1f1b" | "interleaved" | "zb"; InvalidArgument naming --pp-schedule otherwise.
ScheduleKind parse_schedule(const std::string& name);
const char* to_string(ScheduleKind kind);

struct ScheduleShape {
  int stages = 1;          // p
  int microbatches = 1;    // m
  int virtual_stages = 1;  // v: model chunks per rank (interleaved only)
};

// The virtual stage that chunk c of rank r runs: c * p + r (Megatron's interleaving; the
// model's layers are cut into p * v consecutive pieces).
inline int virtual_stage(int rank, int chunk, int stages) { return chunk * stages + rank; }

// Raises InvalidArgument naming the option (--pp, --microbatches, --virtual-stages) when
// the shape does not fit the kind: every size >= 1; v > 1 only with interleaved; interleaved
// needs m a multiple of p.
void check_shape(ScheduleKind kind, const ScheduleShape& shape);

// One list per stage (index = pipeline rank):
//   gpipe: every forward, then every backward (micro-batches in order);
//   1f1b: p - rank - 1 warm-up forwards (at most m), then one forward / one backward, then
//     the remaining backwards;
//   interleaved: Megatron's interleaved 1F1B over v chunks (m a multiple of p): units of p
//     micro-batches per chunk in turn, warm-up (p - rank - 1) * 2 + (v - 1) * p;
//   zb: ZB-H1, 1F1B order with each backward split into Bi and W; stage `rank` lets up to
//     `rank` weight gradients wait in the steady phase and runs one after each Bi of the
//     cool-down, where 1F1B waits; at most p forwards hold activations (until their W), as
//     in 1F1B. With F = Bi = W its bubble is (p - 1) / (3m + p - 1), against 1F1B's
//     (p - 1) / (m + p - 1).
std::vector<StageActions> make_schedule(ScheduleKind kind, const ScheduleShape& shape);

// Empty when the lists are a valid schedule for the shape, else the first problem found:
// each (micro-batch, chunk) has exactly one forward and one backward (B, or Bi then W) on
// every stage, its forward before its backward; and between adjacent virtual stages the
// micro-batches pass in the same order in both directions (so point-to-point messages pair
// up in issue order). Deadlock freedom is simulate()'s.
std::string validate(const std::vector<StageActions>& schedule, const ScheduleShape& shape);

// For backends that match point-to-point messages between two ranks by order alone (NCCL
// ignores tags): empty when, for every ordered pair of ranks, the messages the runtime sends
// from one to the other (activations after F, input gradients after B / Bi) leave in the
// order the other receives them; else the first disagreement. Messages within one rank
// are not counted.
std::string check_message_order(const std::vector<StageActions>& schedule, const ScheduleShape& shape);

struct ActionCosts {
  double forward = 1, backward = 2;              // B = Bi + W
  double backward_input = 1, backward_weight = 1;
  double transfer = 0;  // latency of a point-to-point message between stages
};

struct Span {
  Action action;
  double start = 0, end = 0;
};

struct Simulation {
  bool completed = false;
  std::string deadlock;        // completed == false: which action each stuck stage waits in
  double makespan = 0;         // first start to last end over all stages
  double bubble = 0;           // idle fraction: 1 - sum(busy) / (p * makespan)
  std::vector<int> peak_in_flight;  // per stage: most forwards whose backward has not run
  std::vector<std::vector<Span>> timeline;  // per stage, in execution order
};

// Runs every stage's list in order: an action starts when its stage is free and its inputs
// exist (forward: the previous virtual stage's forward of that micro-batch; backward / Bi:
// this stage's forward and the next virtual stage's backward input gradient; W: this
// stage's Bi), plus `transfer` for an input from another stage.
Simulation simulate(const std::vector<StageActions>& schedule, const ScheduleShape& shape,
                    const ActionCosts& costs = {});

// The bubble fraction with equal-cost stages: gpipe and 1f1b (p - 1) / (m + p - 1);
// interleaved divides the (p - 1) warm-up/cool-down by v: ((p - 1) / v) / (m + (p - 1) / v);
// zb with F = Bi = W: (p - 1) / (3m + p - 1).
double theory_bubble(ScheduleKind kind, const ScheduleShape& shape);

}  // namespace dtrain::pp
