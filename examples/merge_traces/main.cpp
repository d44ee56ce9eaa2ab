// merge_traces: joins the per-rank Chrome trace files that `pretrain_gpt --trace` writes
// into one file (Perfetto / chrome://tracing show every rank as a process), prints each
// rank's busy and idle time in one step, and can draw that step's pipeline schedule as SVG.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

using nlohmann::json;

namespace {

struct Span {
  int rank = 0;
  std::string name, category;
  double start = 0, duration = 0;  // microseconds
  json args;
};

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in.good()) throw std::runtime_error("input '" + path + "' cannot be read");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw std::runtime_error("input '" + path + "' is not JSON: " + e.what());
  }
}

// The pipeline actions' colours (forward, backward, input-gradient, weight-gradient).
const char* colour(const std::string& op) {
  if (op == "F") return "#4e79a7";
  if (op == "B") return "#59a14f";
  if (op == "Bi") return "#8cd17d";
  if (op == "W") return "#f28e2b";
  return "#bab0ac";
}

void write_svg(const std::string& path, const std::vector<Span>& actions, int ranks, double t0,
               double t1, const std::string& title) {
  const double width = 960, row = 26, left = 70, top = 30;
  const double scale = (width - left - 10) / std::max(1.0, t1 - t0);
  std::ofstream out(path);
  if (!out.good()) throw std::runtime_error("--svg '" + path + "' cannot be written");
  const double height = top + row * ranks + 30;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"monospace\" font-size=\"11\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"18\" font-size=\"13\">" << title << "</text>\n";
  for (int r = 0; r < ranks; ++r) {
    const double y = top + row * r;
    out << "<text x=\"4\" y=\"" << y + row * 0.65 << "\">rank " << r << "</text>\n"
        << "<rect x=\"" << left << "\" y=\"" << y + 2 << "\" width=\"" << width - left - 10
        << "\" height=\"" << row - 4 << "\" fill=\"#f4f4f4\"/>\n";
  }
  for (const auto& a : actions) {
    const double x = left + (a.start - t0) * scale, w = std::max(0.5, a.duration * scale);
    const double y = top + row * a.rank + 2;
    out << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << row - 4
        << "\" fill=\"" << colour(a.name) << "\" stroke=\"white\" stroke-width=\"0.5\"><title>"
        << a.name << " micro-batch " << a.args.value("microbatch", -1) << " chunk "
        << a.args.value("chunk", 0) << "</title></rect>\n";
    if (w >= 12) {
      out << "<text x=\"" << x + w / 2 << "\" y=\"" << y + row * 0.55 << "\" fill=\"white\" "
          << "text-anchor=\"middle\">" << a.args.value("microbatch", -1) << "</text>\n";
    }
  }
  const double ly = top + row * ranks + 18;
  double lx = left;
  for (const char* op : {"F", "B", "Bi", "W"}) {
    out << "<rect x=\"" << lx << "\" y=\"" << ly - 10 << "\" width=\"12\" height=\"12\" fill=\""
        << colour(op) << "\"/><text x=\"" << lx + 16 << "\" y=\"" << ly << "\">" << op << "</text>\n";
    lx += 50;
  }
  out << "<text x=\"" << lx + 10 << "\" y=\"" << ly << "\">" << (t1 - t0) / 1e3
      << " ms; numbers: micro-batch; white: idle</text>\n</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Joins per-rank Chrome traces (pretrain_gpt --trace) into one file"};
  std::string output, svg, title;
  std::vector<std::string> inputs;
  long step = -1;
  app.add_option("output", output, "merged trace file to write")->required();
  app.add_option("inputs", inputs, "per-rank trace files (t.rank0.json t.rank1.json ...)")->required();
  app.add_option("--step", step, "the step to summarise and draw (default: the last traced)");
  app.add_option("--svg", svg, "draw the step's pipeline actions per rank into this SVG file");
  app.add_option("--title", title, "the SVG's title (default: the inputs' step)");
  CLI11_PARSE(app, argc, argv);
  try {
    json merged = json::array();
    std::vector<Span> spans;
    int ranks = 0;
    for (const auto& path : inputs) {
      const auto doc = read_json(path);
      if (!doc.contains("traceEvents") || !doc["traceEvents"].is_array()) {
        throw std::runtime_error("input '" + path + "' has no traceEvents array");
      }
      for (const auto& e : doc["traceEvents"]) {
        merged.push_back(e);
        if (e.value("ph", "") != "X") continue;
        Span s{e.value("pid", 0), e.value("name", ""), e.value("cat", ""), e.value("ts", 0.0),
               e.value("dur", 0.0), e.value("args", json::object())};
        ranks = std::max(ranks, s.rank + 1);
        spans.push_back(std::move(s));
      }
    }
    std::ofstream out(output);
    if (!out.good()) throw std::runtime_error("output '" + output + "' cannot be written");
    out << json{{"traceEvents", merged}, {"displayTimeUnit", "ms"}}.dump() << '\n';
    std::printf("merged %zu events of %d rank(s) into %s\n", merged.size(), ranks, output.c_str());

    // The step's window: from its earliest start to its latest end over the ranks.
    long last = -1;
    for (const auto& s : spans) {
      if (s.name == "step") last = std::max(last, static_cast<long>(s.args.value("step", -1)));
    }
    if (step < 0) step = last;
    double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
    for (const auto& s : spans) {
      if (s.name == "step" && s.args.value("step", -1) == step) {
        t0 = std::min(t0, s.start);
        t1 = std::max(t1, s.start + s.duration);
      }
    }
    if (!(t1 > t0)) {
      if (step >= 0 || !svg.empty()) throw std::runtime_error("no \"step\" span for --step " + std::to_string(step));
      return 0;
    }
    // Per rank: time in pipeline compute (F, B, Bi, W) or in forward/backward, idle rest.
    std::vector<double> busy(static_cast<std::size_t>(ranks), 0.0);
    std::vector<Span> actions;
    for (const auto& s : spans) {
      if (s.start < t0 || s.start + s.duration > t1) continue;
      const bool pp = s.category == "pp" && (s.name == "F" || s.name == "B" || s.name == "Bi" || s.name == "W");
      if (pp || s.name == "forward" || s.name == "backward") busy[static_cast<std::size_t>(s.rank)] += s.duration;
      if (pp) actions.push_back(s);
    }
    std::printf("step %ld: %.3f ms\n%6s %12s %10s\n", step, (t1 - t0) / 1e3, "rank", "compute ms", "idle");
    for (int r = 0; r < ranks; ++r) {
      std::printf("%6d %12.3f %9.1f%%\n", r, busy[static_cast<std::size_t>(r)] / 1e3,
                  100.0 * (1.0 - busy[static_cast<std::size_t>(r)] / (t1 - t0)));
    }
    if (!svg.empty()) {
      write_svg(svg, actions, ranks, t0, t1, title.empty() ? "step " + std::to_string(step) : title);
      std::printf("drew %zu pipeline actions into %s\n", actions.size(), svg.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "merge_traces: %s\n", e.what());
    return 2;
  }
  return 0;
}
