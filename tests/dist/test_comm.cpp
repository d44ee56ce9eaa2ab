// Communicator over MPI at world sizes 1-4: every op x dtype x reduce op against
// closed-form values, async progress, split and mesh sub-communicators, the timeout
// report for a rank that skips a collective, and the DTRAIN_COMM_CHECK mismatch report.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "dist_test.hpp"

namespace dtrain::testing {
namespace {

using namespace std::chrono_literals;

const std::vector<c10::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                              at::kInt,   at::kLong,   at::kByte};
const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax,
                                    ReduceOp::kMin};

std::string name_of(c10::ScalarType t) { return c10::toString(t); }

// Values are small integers (exact in every dtype); comparisons run in float64.
void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  const bool ok = at::equal(got.to(at::kDouble), want.to(at::kDouble));
  EXPECT_TRUE(ok) << what << "\n got: " << got.to(at::kDouble).flatten().slice(0, 0, 12)
                  << "\nwant: " << want.to(at::kDouble).flatten().slice(0, 0, 12);
}

// Reduction over ranks r = 0..n-1 of (base + r + 1), in closed form.
at::Tensor expected_reduction(const at::Tensor& base, int n, ReduceOp op, c10::ScalarType dtype) {
  switch (op) {
    case ReduceOp::kSum: return base * n + n * (n + 1) / 2.0;
    case ReduceOp::kMax: return base + n;
    case ReduceOp::kMin: return base + 1;
    case ReduceOp::kAvg: {
      at::Tensor avg = base + (n + 1) / 2.0;
      return at::isFloatingType(dtype) ? avg : avg.trunc();  // integer averages truncate
    }
  }
  return base;
}

class CommTest : public DistTest {};

// ---------------------------------------------------------------------------------------
// Collectives x dtypes x reduce ops

TEST_F(CommTest, AllReduceEveryDtypeAndOp) {
  const int n = nranks(), r = rank();
  const auto idx = at::arange(37, at::kDouble).remainder(5);  // odd length on purpose
  for (auto dtype : kDtypes) {
    for (auto op : kOps) {
      at::Tensor t = (idx + (r + 1)).to(dtype);
      world()->all_reduce(t, {op})->wait();
      expect_equal(t, expected_reduction(idx, n, op, dtype),
                   "all_reduce " + name_of(dtype) + " " + to_string(op));
    }
  }
}

TEST_F(CommTest, BroadcastFromEveryRoot) {
  const int n = nranks(), r = rank();
  for (auto dtype : kDtypes) {
    for (int root = 0; root < n; ++root) {
      const auto want = at::arange(11, at::kDouble).remainder(7) + root * 10;
      at::Tensor t = r == root ? want.to(dtype) : at::zeros({11}, dtype);
      world()->broadcast(t, {root})->wait();
      expect_equal(t, want, "broadcast " + name_of(dtype) + " root " + std::to_string(root));
    }
  }
}

TEST_F(CommTest, AllGatherEveryDtypeAndInPlace) {
  const int n = nranks(), r = rank();
  const int k = 5;
  at::Tensor want = (at::arange(n, at::kDouble).unsqueeze(1) * 16 + at::arange(k, at::kDouble))
                        .flatten();
  for (auto dtype : kDtypes) {
    at::Tensor in = (at::arange(k, at::kDouble) + r * 16).to(dtype);
    at::Tensor out = at::zeros({n * k}, dtype);
    world()->all_gather(out, in)->wait();
    expect_equal(out, want, "all_gather " + name_of(dtype));
    // In place: the input is this rank's slice of the output.
    at::Tensor buf = at::zeros({n * k}, dtype);
    at::Tensor mine = buf.slice(0, r * k, (r + 1) * k);
    mine.copy_(in);
    world()->all_gather(buf, mine)->wait();
    expect_equal(buf, want, "in-place all_gather " + name_of(dtype));
  }
}

TEST_F(CommTest, ReduceScatterEveryDtypeAndOp) {
  const int n = nranks(), r = rank();
  const int k = 3;
  const auto j = at::arange(n * k, at::kDouble);  // global element index
  for (auto dtype : kDtypes) {
    for (auto op : kOps) {
      at::Tensor in = (j.remainder(7) + (r + 1)).to(dtype);
      at::Tensor out = at::zeros({k}, dtype);
      world()->reduce_scatter(out, in, {op})->wait();
      const auto base = j.slice(0, r * k, (r + 1) * k).remainder(7);
      expect_equal(out, expected_reduction(base, n, op, dtype),
                   "reduce_scatter " + name_of(dtype) + " " + to_string(op));
    }
  }
}

TEST_F(CommTest, AllToAllEqualSplits) {
  const int n = nranks(), r = rank();
  const int k = 2;
  for (auto dtype : kDtypes) {
    // Element t of the block for rank d: r*16 + d*4 + t.
    auto d = at::arange(n, at::kDouble).repeat_interleave(k);
    auto t = at::arange(k, at::kDouble).repeat(n);
    at::Tensor in = (d * 4 + t + r * 16).to(dtype).reshape({n * k, 1});
    at::Tensor out = at::zeros({n * k, 1}, dtype);
    world()->all_to_all(out, in)->wait();
    // Block s of the output came from rank s: s*16 + r*4 + t.
    auto s = at::arange(n, at::kDouble).repeat_interleave(k);
    expect_equal(out.flatten(), s * 16 + r * 4 + t, "all_to_all " + name_of(dtype));
  }
}

TEST_F(CommTest, AllToAllUnevenSplits) {
  const int n = nranks(), r = rank();
  const int width = 3;
  // Rank a sends (a + b) % 3 rows to rank b (some zero); row i of that block holds
  // a*100 + b*10 + i in every column.
  auto rows = [](int a, int b) { return static_cast<std::int64_t>((a + b) % 3); };
  std::vector<std::int64_t> in_splits(n), out_splits(n);
  std::vector<double> in_vals, want_vals;
  for (int b = 0; b < n; ++b) {
    in_splits[b] = rows(r, b);
    for (int i = 0; i < rows(r, b); ++i) in_vals.push_back(r * 100 + b * 10 + i);
  }
  for (int a = 0; a < n; ++a) {
    out_splits[a] = rows(a, r);
    for (int i = 0; i < rows(a, r); ++i) want_vals.push_back(a * 100 + r * 10 + i);
  }
  auto to_rows = [&](const std::vector<double>& v) {
    return at::tensor(v, at::kDouble).reshape({-1, 1}).repeat({1, width});
  };
  for (auto dtype : {at::kFloat, at::kLong, at::kDouble}) {
    at::Tensor in = in_vals.empty() ? at::zeros({0, width}, dtype) : to_rows(in_vals).to(dtype);
    at::Tensor out = at::full({static_cast<std::int64_t>(want_vals.size()), width}, -1, dtype);
    world()->all_to_all(out, in, {out_splits, in_splits})->wait();
    if (!want_vals.empty()) expect_equal(out, to_rows(want_vals), "uneven all_to_all " + name_of(dtype));
  }
}

TEST_F(CommTest, SendRecvRing) {
  const int n = nranks(), r = rank();
  if (n == 1) GTEST_SKIP() << "send/recv need two ranks";
  for (auto dtype : kDtypes) {
    at::Tensor out = (at::arange(9, at::kDouble) + r * 20).to(dtype);
    at::Tensor in = at::zeros({9}, dtype);
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    auto recv = world()->recv(in, prev, {7});
    auto send = world()->send(out, next, {7});
    send->wait();
    recv->wait();
    expect_equal(in, at::arange(9, at::kDouble) + prev * 20, "send/recv " + name_of(dtype));
  }
}

// batch_p2p: every rank sends to both neighbours and then receives from both in one batch
// (the crossing pattern of pipeline stages), twice with two tags per pair; one Work per op.
TEST_F(CommTest, BatchedSendRecvCrossBetweenNeighbours) {
  const int n = nranks(), r = rank();
  if (n == 1) GTEST_SKIP() << "send/recv need two ranks";
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int round = 0; round < 2; ++round) {
    auto to_next = at::full({5}, 100.0 * r + round), to_prev = at::full({5}, 100.0 * r + 50 + round);
    auto from_prev = at::zeros({5}), from_next = at::zeros({5});
    auto works = world()->batch_p2p({{P2POp::Kind::kSend, to_next, next, 1},
                                     {P2POp::Kind::kSend, to_prev, prev, 2},
                                     {P2POp::Kind::kRecv, from_prev, prev, 1},
                                     {P2POp::Kind::kRecv, from_next, next, 2}});
    ASSERT_EQ(works.size(), 4u);
    for (auto& w : works) w->wait();
    expect_equal(from_prev, at::full({5}, 100.0 * prev + round), "from the previous rank");
    expect_equal(from_next, at::full({5}, 100.0 * next + 50 + round), "from the next rank");
  }
  const auto e = [&] {
    try {
      world()->batch_p2p({{P2POp::Kind::kRecv, at::zeros({1}), n + 1, 0}});
    } catch (const InvalidArgument& err) {
      return std::string(err.what());
    }
    return std::string("(no error)");
  }();
  EXPECT_NE(e.find("src=" + std::to_string(n + 1) + " is out of range"), std::string::npos) << e;
}

TEST_F(CommTest, BarrierAndSequenceNumbers) {
  const auto before = world()->seq();
  auto w = world()->barrier();
  w->wait();
  EXPECT_TRUE(w->completed());
  EXPECT_EQ(w->seq(), before + 1);
  EXPECT_EQ(world()->seq(), before + 1);
}

TEST_F(CommTest, HalfPrecisionSumsAccumulateInFloat32) {
  // Non-integer values: the result must match the float32 reduction rounded once per
  // pairwise step, i.e. within n half-precision ulps of the exact sum.
  const int n = nranks(), r = rank();
  const auto base = at::linspace(-3.0, 3.0, 64, at::kDouble);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    at::Tensor t = (base * (r + 1) / 7.0).to(dtype);
    at::Tensor exact = at::zeros({64}, at::kDouble);
    for (int q = 0; q < n; ++q) exact += (base * (q + 1) / 7.0).to(dtype).to(at::kDouble);
    world()->all_reduce(t)->wait();
    const double eps = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
    const auto err = (t.to(at::kDouble) - exact).abs();
    const auto bound = exact.abs().clamp_min(1.0) * eps * n;
    EXPECT_TRUE(err.le(bound).all().item<bool>())
        << name_of(dtype) << " max error " << err.max().item<double>();
  }
}

// ---------------------------------------------------------------------------------------
// Async progress

TEST_F(CommTest, WorkIsNotCompleteBeforeAllRanksJoin) {
  const int n = nranks(), r = rank();
  if (n == 1) GTEST_SKIP() << "needs peers";
  at::Tensor t = at::full({1000}, static_cast<float>(r + 1));
  if (r == 0) std::this_thread::sleep_for(400ms);  // rank 0 joins late
  auto w = world()->all_reduce(t);
  if (r != 0) {
    std::this_thread::sleep_for(100ms);
    EXPECT_FALSE(w->completed()) << "all_reduce completed before rank 0 joined";
  }
  w->wait();
  EXPECT_TRUE(w->completed());
  expect_equal(t, at::full({1000}, n * (n + 1) / 2.0), "late all_reduce");
}

TEST_F(CommTest, CollectivesProgressWhileTheCallerComputes) {
  // The caller never calls into MPI between issue and the check: only the progress
  // thread can move the (multi-message) all_reduce forward.
  const int n = nranks();
  at::Tensor t = at::ones({1 << 20});
  auto w = world()->all_reduce(t);
  at::Tensor a = at::randn({64, 64});
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  int iters = 0;
  while (!w->completed() && std::chrono::steady_clock::now() < deadline) {
    a = at::tanh(a.matmul(a) * 0.01);  // compute, no communication calls
    ++iters;
  }
  EXPECT_TRUE(w->completed()) << "all_reduce made no progress during " << iters << " compute steps";
  w->wait();
  EXPECT_EQ(t[12345].item<float>(), static_cast<float>(n));
}

// ---------------------------------------------------------------------------------------
// Sub-communicators

TEST_F(CommTest, SplitByColorOrderedByKey) {
  const int n = nranks(), r = rank();
  const int color = r % 2;
  auto sub = world()->split(color, -r, "parity");  // key -r: reverse rank order
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int q = n - 1; q >= 0; --q) {
    if (q % 2 == color) members.push_back(q);
  }
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(sub->world_ranks(), members);
  EXPECT_EQ(sub->world_ranks()[sub->rank()], r);
  EXPECT_EQ(sub->backend(), members.size() == 1 ? Backend::kSelf : Backend::kMpi);
  at::Tensor t = at::full({4}, static_cast<std::int64_t>(r), at::kLong);
  sub->all_reduce(t)->wait();
  std::int64_t want = 0;
  for (int q : members) want += q;
  expect_equal(t, at::full({4}, static_cast<double>(want)), "all_reduce on split");
  // color < 0 opts out.
  auto none = world()->split(r == 0 ? -1 : 0, r, "without0");
  EXPECT_EQ(none == nullptr, r == 0);
  if (none) {
    EXPECT_EQ(none->size(), n - 1);
  }
}

TEST_F(CommTest, MeshSubCommunicators) {
  const int n = nranks(), r = rank();
  MeshAxes axes = n % 2 == 0 ? MeshAxes{{"dp", n / 2}, {"tp", 2}} : MeshAxes{{"dp", n}, {"tp", 1}};
  DeviceMesh mesh(world(), axes);
  for (const std::string axis : {"dp", "tp"}) {
    auto c = mesh.comm(axis);
    const auto group = mesh.layout().group(r, {axis});
    EXPECT_EQ(c->size(), static_cast<int>(group.size())) << axis;
    EXPECT_EQ(c->world_ranks(), group) << axis;
    EXPECT_EQ(c->rank(), mesh.coord(axis)) << axis;
    at::Tensor t = at::full({3}, static_cast<double>(r), at::kDouble);
    c->all_reduce(t)->wait();
    double want = 0;
    for (int q : group) want += q;
    expect_equal(t, at::full({3}, want), "mesh all_reduce over " + axis);
    EXPECT_EQ(mesh.comm(axis).get(), c.get()) << "sub-communicators are cached";
  }
  EXPECT_EQ(mesh.comm({"tp", "dp"}).get(), world().get()) << "all axes = the world";
}

// ---------------------------------------------------------------------------------------
// Failure reports

TEST_F(CommTest, RankThatSkipsACollectiveIsNamedInTheTimeout) {
  const int n = nranks(), r = rank();
  if (n == 1) GTEST_SKIP() << "needs peers";
  auto aux = world()->split(0, r, "aux");  // coordinates the recovery below
  const int skipper = n - 1;
  at::Tensor t = at::full({8}, 1.0f);
  WorkPtr w;
  if (r != skipper) {
    w = world()->all_reduce(t, {ReduceOp::kSum, Timeout(1500)});
    try {
      w->wait();
      ADD_FAILURE() << "wait() returned although rank " << skipper << " never joined";
    } catch (const TimeoutError& e) {
      const std::string msg = e.what();
      if (r == 0) std::printf("timeout report: %s\n", msg.c_str());
      EXPECT_NE(msg.find("all_reduce on communicator 'world'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("collective #" + std::to_string(w->seq())), std::string::npos) << msg;
      EXPECT_NE(msg.find("Ranks that did not arrive: " + std::to_string(skipper) + " (at collective #" + std::to_string(w->seq() - 1)), std::string::npos) << msg;
      EXPECT_NE(msg.find("Ranks that did not answer: none"), std::string::npos) << msg;
    }
  }
  // Everyone meets on the other communicator; then the skipper joins late and the
  // timed-out op completes, leaving the world usable.
  aux->barrier()->wait();
  if (r == skipper) w = world()->all_reduce(t, {ReduceOp::kSum, Timeout(30000)});
  w->wait();
  expect_equal(t, at::full({8}, static_cast<double>(n)), "late completion");
}

TEST_F(CommTest, CommCheckReportsDivergingRanks) {
  const int n = nranks(), r = rank();
  ::setenv(env::kCommCheck, "1", 1);
  auto checked = world()->split(0, r, "checked");
  ::unsetenv(env::kCommCheck);
  if (n == 1) GTEST_SKIP() << "needs peers";
  // Agreeing ranks pass the check.
  at::Tensor ok = at::ones({16});
  checked->all_reduce(ok)->wait();
  expect_equal(ok, at::full({16}, static_cast<double>(n)), "checked all_reduce");
  // Rank 0 disagrees on the element count.
  at::Tensor bad = at::ones({r == 0 ? 8 : 16});
  try {
    checked->all_reduce(bad)->wait();
    ADD_FAILURE() << "no mismatch reported";
  } catch (const CommError& e) {
    const std::string msg = e.what();
    if (r == 0) std::printf("check report: %s\n", msg.c_str());
    EXPECT_NE(msg.find("DTRAIN_COMM_CHECK"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0: op=all_reduce seq=2 dtype=Float numel=8"), std::string::npos) << msg;
    std::string others = n == 2 ? "rank 1:" : "ranks 1";
    EXPECT_NE(msg.find(others), std::string::npos) << msg;
    EXPECT_NE(msg.find("numel=16"), std::string::npos) << msg;
  }
  // Rank 0 calls a different op.
  try {
    if (r == 0) {
      checked->broadcast(ok, {0})->wait();
    } else {
      checked->all_reduce(ok)->wait();
    }
    ADD_FAILURE() << "no mismatch reported";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("op=broadcast"), std::string::npos) << e.what();
  }
}

TEST_F(CommTest, InvalidArgumentsAreNamed) {
  const int n = nranks();
  auto expect_arg_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  at::Tensor t = at::ones({6});
  expect_arg_error([&] { world()->broadcast(t, {n}); }, "root=" + std::to_string(n) + " is out of range; allowed: 0.." + std::to_string(n - 1));
  expect_arg_error([&] { world()->all_reduce(at::ones({4, 4}).t()); }, "must be contiguous");
  expect_arg_error([&] { world()->all_reduce(at::ones({4}, at::kBool)); }, "allowed: float32, float64, bfloat16, float16, int32, int64, uint8");
  expect_arg_error([&] { world()->all_gather(at::ones({n * 6 + 1}), t); }, "'output' has");
  expect_arg_error([&] { world()->reduce_scatter(at::ones({4}), t); }, "'input' has 6 elements");
  std::vector<std::int64_t> bad(n, 1);
  bad[0] = 2;
  expect_arg_error([&] { world()->all_to_all(at::ones({n, 1}), at::ones({n, 1}), {std::vector<std::int64_t>(n, 1), bad}); }, "input_splits");
  expect_arg_error([&] { world()->all_to_all(at::ones({n, 1}), at::ones({n, 1}), {std::vector<std::int64_t>(n, 1), std::vector<std::int64_t>(n + 1, 1)}); }, "it needs one per rank");
  expect_arg_error([&] { world()->send(t, rank()); }, "is this rank");
  expect_arg_error([&] { world()->recv(t, n + 2); }, "src=" + std::to_string(n + 2) + " is out of range");
  expect_arg_error([&] { world()->split(0, 0, ""); }, "'name' must not be empty");
}

}  // namespace
}  // namespace dtrain::testing
