// Per-rank timelines as Chrome trace events (Perfetto-readable JSON): complete spans
// ("ph": "X") of this rank's compute and communication, one file per rank;
// examples/merge_traces joins the ranks' files into one and draws pipeline schedules.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::trace {

// Tracks (Chrome's "tid") of a rank's process: what it computes, and its point-to-point
// and collective waits.
enum class Track : int { kCompute = 0, kComm = 1 };

struct Event {
  std::string name, category;
  double start_us = 0, duration_us = 0;  // from the recorder's epoch
  Track track = Track::kCompute;
  std::vector<std::pair<std::string, std::int64_t>> args;
};

class Recorder {
 public:
  using Clock = std::chrono::steady_clock;
  // process_name: how viewers label this rank ("rank 3 (pp 1, dp 0, tp 1)").
  Recorder(int rank, std::string process_name);

  // Time zero from now (call right after a barrier so the ranks' timelines line up).
  void set_epoch() { epoch_ = Clock::now(); }
  // Run at the end of every span before it is timed (e.g. a device synchronize, so that
  // spans measure the device's work and not the host's queueing); none by default.
  void set_end_hook(std::function<void()> hook) { end_hook_ = std::move(hook); }

  // A span from construction to destruction (or end()).
  class Span {
   public:
    Span(Recorder* recorder, std::string name, std::string category, Track track,
         std::vector<std::pair<std::string, std::int64_t>> args = {});
    ~Span() { end(); }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;
    void end();

   private:
    Recorder* recorder_;
    Event event_;
    Clock::time_point start_;
  };

  void add(Event e) { events_.push_back(std::move(e)); }
  double now_us() const;
  const std::vector<Event>& events() const { return events_; }
  void clear() { events_.clear(); }
  int rank() const { return rank_; }

  // {"traceEvents": [...], "displayTimeUnit": "ms"} with pid = rank and thread names;
  // raises InvalidArgument naming the path when it cannot be written.
  void write(const std::string& path) const;

 private:
  int rank_;
  std::string process_name_;
  Clock::time_point epoch_ = Clock::now();
  std::function<void()> end_hook_;
  std::vector<Event> events_;
};

// A span only when a recorder is given (recorder may be null: nothing is recorded).
inline Recorder::Span span(Recorder* recorder, std::string name, std::string category,
                           Track track = Track::kCompute,
                           std::vector<std::pair<std::string, std::int64_t>> args = {}) {
  return Recorder::Span(recorder, std::move(name), std::move(category), track, std::move(args));
}

// "run/trace.json" -> "run/trace.rank3.json" (the extension kept; none: appended).
std::string rank_path(const std::string& path, int rank);

}  // namespace dtrain::trace
