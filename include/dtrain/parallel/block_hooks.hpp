// BlockHooks: what a model calls around each transformer block's forward (and around its
// embeddings and head), so that a strategy that keeps parameters sharded between uses
// (FSDP full sharding) can gather them before use and release them after, in forward and
// in backward.
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
  // Around the embeddings and the head (final norm and output projection):
  // enter_embedding() before the lookup, exit_embedding(x) on its output (reused: the head
  // uses the embedding weight again, tied embeddings), enter_head(x) on the head's input.
  // By default they do nothing.
  virtual void enter_embedding() {}
  virtual at::Tensor exit_embedding(const at::Tensor& x, bool reused) {
    (void)reused;
    return x;
  }
  virtual at::Tensor enter_head(const at::Tensor& x) { return x; }
};

}  // namespace dtrain
