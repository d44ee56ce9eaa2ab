// Chrome trace events: spans recorded in memory, written as one JSON document per rank.
#include "dtrain/core/trace.hpp"

#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/core/error.hpp"

namespace dtrain::trace {

Recorder::Recorder(int rank, std::string process_name)
    : rank_(rank), process_name_(std::move(process_name)) {}

double Recorder::now_us() const {
  return std::chrono::duration<double, std::micro>(Clock::now() - epoch_).count();
}

Recorder::Span::Span(Recorder* recorder, std::string name, std::string category, Track track,
                     std::vector<std::pair<std::string, std::int64_t>> args)
    : recorder_(recorder) {
  if (recorder_ == nullptr) return;
  event_.name = std::move(name);
  event_.category = std::move(category);
  event_.track = track;
  event_.args = std::move(args);
  start_ = Clock::now();
}

void Recorder::Span::end() {
  if (recorder_ == nullptr) return;
  if (recorder_->end_hook_) recorder_->end_hook_();
  const auto end = Clock::now();
  event_.start_us = std::chrono::duration<double, std::micro>(start_ - recorder_->epoch_).count();
  event_.duration_us = std::chrono::duration<double, std::micro>(end - start_).count();
  recorder_->add(std::move(event_));
  recorder_ = nullptr;
}

void Recorder::write(const std::string& path) const {
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", process_name_}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"sort_index", rank_}}}});
  for (const auto& [tid, name] : {std::pair{Track::kCompute, "compute"}, std::pair{Track::kComm, "comm"}}) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_},
                      {"tid", static_cast<int>(tid)}, {"args", {{"name", name}}}});
  }
  for (const auto& e : events_) {
    json args = json::object();
    for (const auto& [k, v] : e.args) args[k] = v;
    events.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"pid", rank_},
                      {"tid", static_cast<int>(e.track)}, {"ts", e.start_us},
                      {"dur", e.duration_us}, {"args", args}});
  }
  std::ofstream out(path, std::ios::out | std::ios::trunc);
  DTRAIN_CHECK_ARG(out.good(), "--trace '", path, "' cannot be written");
  out << json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << '\n';
  out.close();
  DTRAIN_CHECK_ARG(!out.fail(), "--trace '", path, "': writing failed");
}

std::string rank_path(const std::string& path, int rank) {
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  const std::string tag = ".rank" + std::to_string(rank);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash) ||
      dot == (slash == std::string::npos ? 0 : slash + 1)) {
    return path + tag;
  }
  return path.substr(0, dot) + tag + path.substr(dot);
}

}  // namespace dtrain::trace
