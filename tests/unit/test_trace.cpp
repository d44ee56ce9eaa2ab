// Trace recorder: spans are recorded with their track, arguments and nesting; a null
// recorder records nothing; the written file is Chrome trace JSON with the rank as pid and
// named tracks; rank_path inserts the rank before the extension; an unwritable path is an
// error naming it.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <unistd.h>

#include "common/errors.hpp"
#include "dtrain/core/fs.hpp"
#include "dtrain/core/trace.hpp"

namespace dtrain::trace {
namespace {

TEST(Trace, RankPathKeepsTheExtension) {
  EXPECT_EQ(rank_path("run/trace.json", 3), "run/trace.rank3.json");
  EXPECT_EQ(rank_path("trace", 0), "trace.rank0");
  EXPECT_EQ(rank_path("a.b/trace", 1), "a.b/trace.rank1");
  EXPECT_EQ(rank_path("dir/.hidden", 2), "dir/.hidden.rank2");
}

TEST(Trace, SpansNestAndCarryTheirArguments) {
  Recorder r(2, "rank 2");
  r.set_epoch();
  int hooks = 0;
  r.set_end_hook([&] { ++hooks; });
  {
    auto outer = span(&r, "step", "train", Track::kCompute, {{"step", 1}});
    {
      auto inner = span(&r, "F", "pp", Track::kCompute, {{"microbatch", 4}, {"chunk", 1}});
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    auto wait = span(&r, "recv", "pp", Track::kComm);
    wait.end();
    wait.end();  // ending twice records once
  }
  { auto nothing = span(nullptr, "F", "pp"); }
  ASSERT_EQ(r.events().size(), 3u);
  EXPECT_EQ(hooks, 3);
  const auto& f = r.events()[0];
  const auto& recv = r.events()[1];
  const auto& step = r.events()[2];  // recorded when it ends, last
  EXPECT_EQ(f.name, "F");
  EXPECT_GE(f.duration_us, 2000.0);
  EXPECT_EQ(f.args, (std::vector<std::pair<std::string, std::int64_t>>{{"microbatch", 4}, {"chunk", 1}}));
  EXPECT_EQ(recv.track, Track::kComm);
  EXPECT_EQ(step.name, "step");
  EXPECT_LE(step.start_us, f.start_us);
  EXPECT_GE(step.start_us + step.duration_us, recv.start_us + recv.duration_us);
}

TEST(Trace, WritesChromeTraceJson) {
  const std::string dir = "/tmp/dtrain_unit_trace_" + std::to_string(::getpid());
  fs::make_directories(dir);
  Recorder r(5, "rank 5 (pp 1)");
  { auto s = span(&r, "W", "pp", Track::kCompute, {{"microbatch", 0}}); }
  { auto s = span(&r, "send", "pp", Track::kComm, {{"to_stage", 2}}); }
  const auto path = rank_path(dir + "/t.json", 5);
  r.write(path);
  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  const auto& events = doc.at("traceEvents");
  int spans = 0, names = 0;
  for (const auto& e : events) {
    EXPECT_EQ(e.at("pid"), 5);
    if (e.at("ph") == "M" && e.at("name") == "process_name") {
      EXPECT_EQ(e.at("args").at("name"), "rank 5 (pp 1)");
      ++names;
    }
    if (e.at("ph") != "X") continue;
    ++spans;
    if (e.at("name") == "W") {
      EXPECT_EQ(e.at("tid"), 0);
      EXPECT_EQ(e.at("cat"), "pp");
      EXPECT_EQ(e.at("args").at("microbatch"), 0);
    } else {
      EXPECT_EQ(e.at("tid"), 1);
      EXPECT_EQ(e.at("args").at("to_stage"), 2);
    }
    EXPECT_GE(e.at("dur").get<double>(), 0.0);
  }
  EXPECT_EQ(spans, 2);
  EXPECT_EQ(names, 1);
  const auto e = testing::error_message([&] { r.write(dir + "/missing/t.json"); });
  EXPECT_NE(e.find("--trace '" + dir + "/missing/t.json' cannot be written"), std::string::npos) << e;
  fs::remove_tree(dir);
}

}  // namespace
}  // namespace dtrain::trace
