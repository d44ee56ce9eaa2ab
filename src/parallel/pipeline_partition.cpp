// Balanced contiguous partition of the block stack (min-max by dynamic programming over
// suffixes, then the cuts that reach it taking blocks early) and the --pp-layers list.
#include "dtrain/parallel/pipeline_partition.hpp"

#include <algorithm>
#include <limits>
#include <sstream>

#include "dtrain/core/error.hpp"

namespace dtrain::pp {

std::vector<int> balanced_partition(const std::vector<double>& block_costs, double first_extra,
                                    double last_extra, int stages) {
  const int n = static_cast<int>(block_costs.size());
  DTRAIN_CHECK_ARG(stages >= 1, "pipeline: ", stages, " stages; allowed: at least 1");
  DTRAIN_CHECK_ARG(stages <= n, "pipeline: ", stages, " virtual stages (--pp x --virtual-stages) but the model has ",
                   n, " blocks (--n-layer); allowed: at most one stage per block");
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + block_costs[static_cast<std::size_t>(i)];
  // Cost of stage s holding blocks [a, b).
  auto cost = [&](int s, int a, int b) {
    return prefix[b] - prefix[a] + (s == 0 ? first_extra : 0.0) + (s == stages - 1 ? last_extra : 0.0);
  };
  const double inf = std::numeric_limits<double>::infinity();
  // rest[s][a]: the smallest max cost of stages s.. holding blocks [a, n), each >= 1 block.
  std::vector<std::vector<double>> rest(static_cast<std::size_t>(stages) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  rest[stages][n] = 0;
  for (int s = stages - 1; s >= 0; --s) {
    for (int a = s; a <= n - (stages - s); ++a) {
      for (int b = a + 1; b <= n - (stages - s - 1); ++b) {
        rest[s][a] = std::min(rest[s][a], std::max(cost(s, a, b), rest[s + 1][b]));
      }
    }
  }
  const double bound = rest[0][0] * (1 + 1e-12) + 1e-300;
  // Among the cuts that reach the optimum, the most even one (least sum of squared stage
  // costs); ties go to fewer blocks on earlier stages (they hold more activations in 1F1B).
  std::vector<std::vector<double>> even(static_cast<std::size_t>(stages) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  even[stages][n] = 0;
  for (int s = stages - 1; s >= 0; --s) {
    for (int a = s; a <= n - (stages - s); ++a) {
      for (int b = a + 1; b <= n - (stages - s - 1); ++b) {
        const double c = cost(s, a, b);
        if (c <= bound) even[s][a] = std::min(even[s][a], c * c + even[s + 1][b]);
      }
    }
  }
  std::vector<int> counts;
  int at = 0;
  for (int s = 0; s < stages; ++s) {
    const double target = even[s][at];
    int b = at + 1;
    for (; b <= n - (stages - s - 1); ++b) {
      const double c = cost(s, at, b);
      if (c <= bound && c * c + even[s + 1][b] <= target * (1 + 1e-12) + 1e-300) break;
    }
    counts.push_back(b - at);
    at = b;
  }
  return counts;
}

std::vector<int> parse_partition(const std::string& text, int n_blocks, int stages) {
  std::vector<int> counts;
  std::stringstream in(text);
  std::string item;
  int sum = 0;
  while (std::getline(in, item, ',')) {
    int v = 0;
    std::size_t used = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DTRAIN_CHECK_ARG(used == item.size() && !item.empty() && v >= 1, "--pp-layers '", text,
                     "': '", item, "' is not a positive block count");
    counts.push_back(v);
    sum += v;
  }
  DTRAIN_CHECK_ARG(static_cast<int>(counts.size()) == stages && sum == n_blocks, "--pp-layers '",
                   text, "' lists ", counts.size(), " stages holding ", sum, " blocks; allowed: ",
                   stages, " positive counts (--pp x --virtual-stages) summing to ", n_blocks,
                   " (--n-layer)");
  return counts;
}

}  // namespace dtrain::pp
