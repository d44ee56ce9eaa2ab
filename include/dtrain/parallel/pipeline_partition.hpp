// Stage partitioning for pipeline parallelism: the transformer blocks cut into contiguous
// runs, one per virtual stage, balanced by cost (parameter count by default; the
// embedding's cost lands on the first virtual stage, the head's on the last) or given
// explicitly (--pp-layers).
#pragma once

#include <string>
#include <vector>

namespace dtrain::pp {

// Blocks per virtual stage (stages entries, each >= 1, summing to block_costs.size()) that
// minimise the largest stage cost, where stage 0 also carries first_extra and the last
// stage last_extra; among optimal cuts the most even (least sum of squared stage costs),
// ties giving earlier stages fewer blocks (in 1F1B they hold the most activations).
// InvalidArgument naming the stage and block counts when there are more stages than blocks.
std::vector<int> balanced_partition(const std::vector<double>& block_costs, double first_extra,
                                    double last_extra, int stages);

// "3,3,2,2" -> {3, 3, 2, 2}: InvalidArgument naming --pp-layers unless it lists `stages`
// positive counts summing to n_blocks.
std::vector<int> parse_partition(const std::string& text, int n_blocks, int stages);

}  // namespace dtrain::pp
