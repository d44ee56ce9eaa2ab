// BlockHooks: what a model calls around each transformer block's forward, so that a
// strategy that keeps a block's parameters sharded between uses (FSDP full sharding) can
// gather them before the block and release them after it, in forward and in backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>

namespace dtrain {

class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  // Around block `index`: enter(x) before its forward, exit(y) after it. Both return their
  // argument (possibly through an autograd function whose backward does the reverse).
  virtual at::Tensor enter(std::size_t index, const at::Tensor& x) = 0;
  virtual at::Tensor exit(std::size_t index, const at::Tensor& y) = 0;
};

}  // namespace dtrain
