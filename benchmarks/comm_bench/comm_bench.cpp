// comm_bench: collective bandwidth, nccl-tests style. For each message size it times the
// raw MPI call and the same collective through dtrain's Communicator in the same run, and
// prints size, count, type, redop, time, algbw, busbw and #wrong, plus JSON lines.
//
//   mpirun -np 4 build/benchmarks/comm_bench -b 1K -e 64M -f 4 --op all --impl both
#include <ATen/ATen.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "comm/mpi_engine.hpp"
#include "dtrain/dtrain.hpp"

namespace {

using dtrain::CommPtr;
using dtrain::ReduceOp;

// ---------------------------------------------------------------------------------------
// Options

struct Options {
  std::string min_bytes = "8", max_bytes = "64M";
  double factor = 2;
  int iters = 20, warmup = 5, check = 1, rounds = 5;
  std::string op = "all_reduce", impl = "both", dtype = "float", redop = "sum", json;
};

std::int64_t parse_size(const std::string& s, const char* flag) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = s.substr(used);
  std::map<std::string, double> mult = {{"", 1}, {"K", 1024}, {"M", 1 << 20}, {"G", 1 << 30}};
  if (used == 0 || !mult.count(unit) || v <= 0) {
    throw dtrain::InvalidArgument(dtrain::detail::str_cat(
        flag, "='", s, "' is not a size; allowed: a positive number with optional K, M or G"));
  }
  return static_cast<std::int64_t>(v * mult[unit]);
}

c10::ScalarType parse_dtype(const std::string& s) {
  static const std::map<std::string, c10::ScalarType> m = {
      {"float", at::kFloat},   {"double", at::kDouble}, {"bfloat16", at::kBFloat16},
      {"half", at::kHalf},     {"int32", at::kInt},     {"int64", at::kLong},
      {"uint8", at::kByte}};
  auto it = m.find(s);
  if (it == m.end()) {
    throw dtrain::InvalidArgument("-d/--dtype '" + s +
                                  "' is not known; allowed: float, double, bfloat16, half, "
                                  "int32, int64, uint8");
  }
  return it->second;
}

// ---------------------------------------------------------------------------------------
// One op: buffers, the raw MPI call, the dtrain call, the bus-bandwidth factor, the check.

struct Case {
  std::string op;
  int n = 1, rank = 0;
  std::int64_t count = 0;  // elements of the "size" buffer (nccl-tests convention)
  at::Tensor a, b;         // op-specific input / output
  std::int64_t bytes() const { return count * a.element_size(); }
};

double busbw_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return double(n - 1) / n;
  return 1.0;  // broadcast, sendrecv
}

// Element counts are rounded so that every rank's piece is whole.
Case make_case(const std::string& op, std::int64_t bytes, c10::ScalarType dtype, int n, int rank) {
  Case c;
  c.op = op;
  c.n = n;
  c.rank = rank;
  const std::int64_t es = c10::elementSize(dtype);
  std::int64_t count = std::max<std::int64_t>(1, bytes / es);
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") {
    count = std::max<std::int64_t>(n, count / n * n);
  }
  c.count = count;
  if (op == "all_gather") {
    c.a = at::full({count / n}, rank + 1, dtype);
    c.b = at::zeros({count}, dtype);
  } else if (op == "reduce_scatter") {
    c.a = at::full({count}, rank + 1, dtype);
    c.b = at::zeros({count / n}, dtype);
  } else {
    c.a = at::full({count}, rank + 1, dtype);
    c.b = at::zeros({count}, dtype);
  }
  return c;
}

void raw_call(Case& c, MPI_Comm comm, MPI_Op mop) {
  const MPI_Datatype dt = dtrain::detail::MpiEngine::datatype(c.a.scalar_type());
  const int cnt = static_cast<int>(c.count);
  if (c.op == "all_reduce") {
    MPI_Allreduce(MPI_IN_PLACE, c.a.data_ptr(), cnt, dt, mop, comm);
  } else if (c.op == "all_gather") {
    MPI_Allgather(c.a.data_ptr(), cnt / c.n, dt, c.b.data_ptr(), cnt / c.n, dt, comm);
  } else if (c.op == "reduce_scatter") {
    MPI_Reduce_scatter_block(c.a.data_ptr(), c.b.data_ptr(), cnt / c.n, dt, mop, comm);
  } else if (c.op == "all_to_all") {
    MPI_Alltoall(c.a.data_ptr(), cnt / c.n, dt, c.b.data_ptr(), cnt / c.n, dt, comm);
  } else if (c.op == "broadcast") {
    MPI_Bcast(c.a.data_ptr(), cnt, dt, 0, comm);
  } else {  // sendrecv ring
    MPI_Sendrecv(c.a.data_ptr(), cnt, dt, (c.rank + 1) % c.n, 0, c.b.data_ptr(), cnt, dt,
                 (c.rank + c.n - 1) % c.n, 0, comm, MPI_STATUS_IGNORE);
  }
}

void dtrain_call(Case& c, dtrain::Communicator& comm, ReduceOp op) {
  if (c.op == "all_reduce") {
    comm.all_reduce(c.a, {op})->wait();
  } else if (c.op == "all_gather") {
    comm.all_gather(c.b, c.a)->wait();
  } else if (c.op == "reduce_scatter") {
    comm.reduce_scatter(c.b, c.a, {op})->wait();
  } else if (c.op == "all_to_all") {
    comm.all_to_all(c.b, c.a)->wait();
  } else if (c.op == "broadcast") {
    comm.broadcast(c.a, {0})->wait();
  } else {
    auto r = comm.recv(c.b, (c.rank + c.n - 1) % c.n);
    auto s = comm.send(c.a, (c.rank + 1) % c.n);
    s->wait();
    r->wait();
  }
}

// Wrong elements after one call on fresh buffers (sum for reductions).
std::int64_t count_wrong(Case& c) {
  const int n = c.n, r = c.rank;
  at::Tensor got, want;
  if (c.op == "all_reduce") {
    got = c.a, want = at::full_like(c.a, n * (n + 1) / 2.0);
  } else if (c.op == "all_gather") {
    got = c.b;
    want = (at::arange(n, at::kDouble) + 1).repeat_interleave(c.count / n);
  } else if (c.op == "reduce_scatter") {
    got = c.b, want = at::full_like(c.b, n * (n + 1) / 2.0);
  } else if (c.op == "all_to_all") {
    got = c.b;
    want = (at::arange(n, at::kDouble) + 1).repeat_interleave(c.count / n);
  } else if (c.op == "broadcast") {
    got = c.a, want = at::full_like(c.a, 1);
  } else {
    got = c.b, want = at::full_like(c.b, (r + n - 1) % n + 1);
  }
  return got.to(at::kDouble).ne(want.to(at::kDouble)).sum().item<std::int64_t>();
}

// Wrong elements of one call on fresh buffers, summed over ranks.
template <typename Fn>
std::int64_t check_call(const std::string& op, std::int64_t bytes, c10::ScalarType dtype, int n,
                        int rank, MPI_Comm comm, Fn&& call) {
  Case fresh = make_case(op, bytes, dtype, n, rank);
  call(fresh);
  std::int64_t wrong = count_wrong(fresh);
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, comm);
  return wrong;
}

// Mean time of `iters` calls in microseconds; the slowest rank counts.
template <typename Fn>
double time_calls(Case& c, int iters, MPI_Comm comm, Fn&& call) {
  MPI_Barrier(comm);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) call(c);
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                  .count() / iters;
  MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, comm);
  return us;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace

int main(int argc, char** argv) {
  dtrain::Runtime rt(&argc, &argv, dtrain::RuntimeOptions{"mpi"});
  if (!rt.launch().mpi_launched()) {
    std::fprintf(stderr, "comm_bench: start it with mpirun or srun (it compares against raw MPI); "
                         "launcher detected: %s\n", rt.launch().describe().c_str());
    return 2;
  }
  const int rank = rt.rank(), n = rt.size();
  Options o;
  CLI::App app{"dtrain comm_bench: collective bandwidth, raw MPI vs dtrain Communicator"};
  app.add_option("-b,--minbytes", o.min_bytes, "smallest message size (K, M, G suffixes)");
  app.add_option("-e,--maxbytes", o.max_bytes, "largest message size");
  app.add_option("-f,--stepfactor", o.factor, "size multiplication factor")->check(CLI::Range(1.01, 1024.0));
  app.add_option("-n,--iters", o.iters, "timed iterations per size")->check(CLI::PositiveNumber);
  app.add_option("-w,--warmup_iters", o.warmup, "untimed warm-up iterations")->check(CLI::NonNegativeNumber);
  app.add_option("-R,--rounds", o.rounds, "interleaved timing rounds; the median is reported")->check(CLI::PositiveNumber);
  app.add_option("-c,--check", o.check, "check results (0/1)")->check(CLI::Range(0, 1));
  app.add_option("--op", o.op, "collective")
      ->check(CLI::IsMember({"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                             "broadcast", "sendrecv", "all"}));
  app.add_option("--impl", o.impl, "what to time")->check(CLI::IsMember({"raw", "dtrain", "both"}));
  app.add_option("-d,--datatype", o.dtype, "float, double, bfloat16, half, int32, int64, uint8");
  app.add_option("-o,--op_type", o.redop, "reduction: sum, avg, max, min");
  app.add_option("-J,--json", o.json, "append one JSON object per row to this file");
  int rc = 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Only rank 0 prints; every rank exits with the same code.
    if (rank == 0) rc = app.exit(e);
    else rc = e.get_exit_code();
    return rc;
  }
  // Validation: every rank reaches the same verdict, so a bad flag exits cleanly.
  std::int64_t lo = 0, hi = 0;
  c10::ScalarType dtype = at::kFloat;
  ReduceOp redop = ReduceOp::kSum;
  try {
    lo = parse_size(o.min_bytes, "-b/--minbytes");
    hi = parse_size(o.max_bytes, "-e/--maxbytes");
    if (hi < lo) {
      throw dtrain::InvalidArgument(dtrain::detail::str_cat(
          "-e/--maxbytes (", hi, ") is below -b/--minbytes (", lo, ")"));
    }
    dtype = parse_dtype(o.dtype);
    redop = dtrain::parse_reduce_op(o.redop);
    if (n < 2 && o.op == "sendrecv") {
      throw dtrain::InvalidArgument("--op sendrecv needs at least 2 ranks");
    }
    if ((dtype == at::kBFloat16 || dtype == at::kHalf) && o.impl != "dtrain") {
      throw dtrain::InvalidArgument(
          "-d " + o.dtype + " with --impl " + o.impl +
          ": MPI has no 16-bit float reductions to compare with; use --impl dtrain");
    }
  } catch (const dtrain::InvalidArgument& e) {
    if (rank == 0) std::fprintf(stderr, "comm_bench: %s\n", e.what());
    return 2;
  }
  std::ofstream json;
  int json_ok = 1;
  if (rank == 0 && !o.json.empty()) {
    json.open(o.json, std::ios::app);
    json_ok = json ? 1 : 0;
  }
  MPI_Bcast(&json_ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (!json_ok) {
    if (rank == 0) std::fprintf(stderr, "comm_bench: -J/--json '%s' cannot be opened for writing\n", o.json.c_str());
    return 2;
  }

  try {
    std::vector<std::string> ops = {o.op};
    if (o.op == "all") ops = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"};
    if (o.op == "all" && n > 1) ops.push_back("sendrecv");

    MPI_Comm raw;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    auto comm = rt.cpu_world();
    const MPI_Op raw_op = redop == ReduceOp::kMax ? MPI_MAX : redop == ReduceOp::kMin ? MPI_MIN : MPI_SUM;
    const std::vector<std::string> impls =
        o.impl == "both" ? std::vector<std::string>{"raw", "dtrain"} : std::vector<std::string>{o.impl};
    for (const auto& op : ops) {
      if (rank == 0) {
            std::printf("# dtrain comm_bench: op %s, nranks %d, dtype %s, redop %s, iters %d x %d rounds (median), warmup %d\n",
                    op.c_str(), n, o.dtype.c_str(), o.redop.c_str(), o.iters, o.rounds, o.warmup);
        std::printf("# %12s %12s %9s %6s %7s %11s %12s %12s %7s %9s\n", "size", "count", "type",
                    "redop", "impl", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "vs raw");
      }
      std::map<std::string, std::pair<double, int>> avg;  // impl -> (sum busbw, rows)
      for (double bytes = static_cast<double>(lo); bytes <= hi * 1.0000001; bytes *= o.factor) {
        const std::int64_t b = static_cast<std::int64_t>(bytes);
        Case c = make_case(op, b, dtype, n, rank);
        auto call = [&](const std::string& impl, Case& x) {
          if (impl == "raw") {
            raw_call(x, raw, raw_op);
          } else {
            dtrain_call(x, *comm, redop);
          }
        };
        std::map<std::string, std::int64_t> wrong;
        std::map<std::string, std::vector<double>> times;
        for (const auto& impl : impls) {
          if (o.check) {
            wrong[impl] = check_call(op, b, dtype, n, rank, raw, [&](Case& x) { call(impl, x); });
          }
          for (int i = 0; i < o.warmup; ++i) call(impl, c);
        }
        // Interleaved rounds: machine noise hits both implementations alike; the median
        // of each is reported.
        // The order alternates between rounds so neither implementation always goes first.
        for (int round = 0; round < o.rounds; ++round) {
          for (std::size_t k = 0; k < impls.size(); ++k) {
            const auto& impl = impls[round % 2 ? impls.size() - 1 - k : k];
            times[impl].push_back(time_calls(c, o.iters, raw, [&](Case& x) { call(impl, x); }));
          }
        }
        double raw_busbw = 0;
        for (const auto& impl : impls) {
          const double time_us = median(times[impl]);
          const double algbw = c.bytes() / time_us / 1e3;  // GB/s
          const double busbw = algbw * busbw_factor(op, n);
          if (impl == "raw") raw_busbw = busbw;
          const double ratio = impl == "dtrain" && raw_busbw > 0 ? busbw / raw_busbw : 0;
          avg[impl].first += busbw;
          avg[impl].second += 1;
          if (rank == 0) {
            char vs[16] = "";
            if (ratio > 0) std::snprintf(vs, sizeof(vs), "%.3f", ratio);
            std::printf("  %12lld %12lld %9s %6s %7s %11.2f %12.3f %12.3f %7lld %9s\n",
                        static_cast<long long>(c.bytes()), static_cast<long long>(c.count),
                        o.dtype.c_str(),
                        (op == "all_reduce" || op == "reduce_scatter") ? o.redop.c_str() : "none",
                        impl.c_str(), time_us, algbw, busbw,
                        static_cast<long long>(wrong[impl]), vs);
            if (json) {
              nlohmann::json j = {{"op", op},            {"impl", impl},
                                  {"bytes", c.bytes()},  {"count", c.count},
                                  {"dtype", o.dtype},    {"redop", o.redop},
                                  {"nranks", n},         {"time_us", time_us},
                                  {"algbw_gbps", algbw}, {"busbw_gbps", busbw},
                                  {"wrong", wrong[impl]}, {"rounds", o.rounds},
                                  {"iters", o.iters}};
              if (ratio > 0) j["busbw_ratio_vs_raw"] = ratio;
              json << j.dump() << std::endl;
            }
          }
        }
      }
      if (rank == 0) {
        for (const auto& [impl, s] : avg) {
          std::printf("# Avg bus bandwidth (%s, %s): %.3f GB/s\n", op.c_str(), impl.c_str(),
                      s.first / std::max(1, s.second));
        }
        std::printf("#\n");
      }
    }
    MPI_Comm_free(&raw);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench (rank %d): %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);  // peers may be inside a collective
  }
  return 0;
}
