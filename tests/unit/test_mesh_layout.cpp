// MeshLayout rank arithmetic over many shapes, its validation messages, and the worked
// 16-rank table of docs/parallelism.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "dtrain/core/error.hpp"
#include "dtrain/mesh/device_mesh.hpp"

namespace dtrain {
namespace {

std::string error_of(const MeshAxes& axes, int world) {
  try {
    MeshLayout l(axes, world);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(MeshLayout, EveryShapeRoundTripsAndPartitions) {
  const std::vector<MeshAxes> shapes = {
      {{"dp", 1}},
      {{"dp", 3}},
      {{"dp", 2}, {"tp", 2}},
      {{"pp", 2}, {"dp", 2}, {"tp", 4}},
      {{"pp", 3}, {"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}},
      {{"dp_shard", 5}, {"cp", 1}, {"ep", 3}},
      {{"pp", 2}, {"dp_replicate", 1}, {"dp_shard", 3}, {"cp", 2}, {"ep", 1}, {"tp", 2}},
  };
  for (const auto& axes : shapes) {
    int world = 1;
    for (const auto& a : axes) world *= a.second;
    MeshLayout l(axes, world);
    for (int r = 0; r < world; ++r) EXPECT_EQ(l.rank_of(l.coords(r)), r);
    // Every subset of axes: groups partition the world, colors identify the groups, keys
    // give the group order.
    const int na = static_cast<int>(axes.size());
    for (int mask = 1; mask < (1 << na); ++mask) {
      std::vector<std::string> sel;
      for (int i = 0; i < na; ++i) {
        if (mask & (1 << i)) sel.push_back(axes[i].first);
      }
      std::set<int> covered;
      for (int r = 0; r < world; ++r) {
        const auto g = l.group(r, sel);
        int expected_size = 1;
        for (const auto& s : sel) expected_size *= l.size(s);
        ASSERT_EQ(static_cast<int>(g.size()), expected_size);
        const auto [color, key] = l.color_key(r, sel);
        EXPECT_EQ(g[key], r) << "key is the position in the group";
        for (int q : g) {
          EXPECT_EQ(l.color_key(q, sel).first, color);
          EXPECT_EQ(l.group(q, sel), g);
          // Members differ from r only on the selected axes.
          for (const auto& [name, size] : axes) {
            if (std::find(sel.begin(), sel.end(), name) == sel.end()) {
              EXPECT_EQ(l.coord(q, name), l.coord(r, name));
            }
          }
        }
        covered.insert(g.begin(), g.end());
      }
      EXPECT_EQ(static_cast<int>(covered.size()), world);
    }
  }
}

TEST(MeshLayout, TpIsFastestVarying) {
  MeshLayout l({{"dp", 2}, {"tp", 4}}, 8);
  EXPECT_EQ(l.group(5, {"tp"}), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(l.group(5, {"dp"}), (std::vector<int>{1, 5}));
  EXPECT_EQ(l.size("pp"), 1);
  EXPECT_EQ(l.coord(5, "pp"), 0);
  EXPECT_EQ(l.group(5, {"pp"}), (std::vector<int>{5}));
}

// The worked table in docs/parallelism.md: 16 ranks, pp2 x dp2 x tp4.
TEST(MeshLayout, DocumentedSixteenRankTable) {
  MeshLayout l({{"pp", 2}, {"dp", 2}, {"tp", 4}}, 16);
  EXPECT_EQ(l.coords(0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(l.coords(6), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(l.coords(9), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(l.coords(15), (std::vector<int>{1, 1, 3}));
  EXPECT_EQ(l.group(6, {"tp"}), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(l.group(6, {"dp"}), (std::vector<int>{2, 6}));
  EXPECT_EQ(l.group(6, {"pp"}), (std::vector<int>{6, 14}));
  EXPECT_EQ(l.group(9, {"dp", "tp"}), (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
}

TEST(MeshLayout, ValidationMessagesPrintEveryFactorAndTheWorld) {
  EXPECT_NE(error_of({{"pp", 2}, {"dp", 2}, {"tp", 4}}, 12)
                .find("device mesh pp=2 x dp=2 x tp=4 = 16 ranks does not match the world size 12"),
            std::string::npos);
  EXPECT_NE(error_of({{"tp", 2}, {"dp", 2}}, 4).find("axis 'dp' is out of order"),
            std::string::npos);
  EXPECT_NE(error_of({{"dp", 2}, {"dp", 2}}, 4).find("axis 'dp' appears twice"),
            std::string::npos);
  EXPECT_NE(error_of({{"data", 4}}, 4).find("axis 'data' is not known; allowed, in this order: "
                                            "pp, dp, dp_replicate, dp_shard, cp, ep, tp"),
            std::string::npos);
  EXPECT_NE(error_of({{"dp", 0}}, 1).find("axis dp=0 must be at least 1"), std::string::npos);
  EXPECT_NE(error_of({{"dp", 2}, {"dp_shard", 2}}, 4).find("either 'dp' or"), std::string::npos);
  EXPECT_NE(error_of({}, 1).find("at least one axis"), std::string::npos);
  MeshLayout l({{"dp", 2}}, 2);
  EXPECT_THROW(l.coords(2), InvalidArgument);
  EXPECT_THROW(l.group(0, {"bogus"}), InvalidArgument);
  EXPECT_THROW(l.group(0, {"dp", "dp"}), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
