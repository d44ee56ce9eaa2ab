// Fused softmax cross-entropy with autograd: mean over the rows whose target is not
// ignore_index, from [rows, vocab] logits in their own dtype. On CUDA one kernel reads the
// logits and, when they need a gradient, writes it in the same call (for the upstream
// gradient the caller announces); the backward returns it. A reference path computes the
// same function with ATen ops in float32 on other devices. The logits may be one rank's
// columns of a vocabulary split across ranks (options.combine): then one kernel call for
// the statistics, the exchange, and one for the gradient. linear_cross_entropy runs the
// head's matmul and the loss in chunks of rows, never holding all the logits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace dtrain::ops {

struct CrossEntropyOptions {
  std::int64_t ignore_index = -100;
  // The gradient the caller will give the loss in backward: the factor it multiplies the
  // loss by before backward() (1 for loss.backward()). The CUDA forward writes the logit
  // gradient for it; a backward with another one costs a pass over the gradient to
  // rescale it (same result, one more rounding in 16-bit dtypes). Finite, nonzero.
  double grad_scale = 1.0;
  // CUDA: the gradient replaces the logits (their values are gone after the call, and
  // nothing else may still need them): one logits-sized buffer instead of two. The
  // reference path leaves them as they are.
  bool in_place = false;
  // PaLM's z-loss: z_loss lse^2 added to each row's loss (lse: its log-sum-exp, the log of
  // the softmax's normaliser), which keeps lse near 0 and the logits from drifting (PaLM:
  // 1e-4). Finite, >= 0; 0: none.
  double z_loss = 0.0;
  // A vocabulary split across ranks (a tensor-parallel head:
  // tp::fused_vocab_parallel_cross_entropy sets these). The logits are columns [vocab_start, vocab_start + cols) of a vocabulary
  // of vocab_size ids; columns at or past vocab_size are padding (no loss, gradient 0);
  // targets are global ids. `combine` is the exchange between the ranks: given this rank's
  // [2, rows] statistics (log-sum-exp over its columns, -inf where it holds none; the
  // target's logit where it holds the target, else 0), it returns them over the whole
  // vocabulary (the log-sum-exp of the ranks' first rows and the sum of their second).
  // Unset: the logits are the whole vocabulary.
  std::function<at::Tensor(const at::Tensor&)> combine;
  std::int64_t vocab_start = 0;
  std::int64_t vocab_size = -1;  // with combine: the whole vocabulary's ids
};

// logits [rows, vocab] (or this rank's columns of it), target [rows] int64; 0 when every
// row is ignored. InvalidArgument naming the input or option for other shapes, dtypes or
// values.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, const CrossEntropyOptions& options = {});

// cross_entropy(hidden weight^T, target) without the [rows, vocab] logits in memory at
// once (Liger-Kernel's fused linear cross-entropy): chunks of chunk_rows rows each get
// their logits, the loss kernel's in-place gradient, and that chunk's share of the hidden
// states' and the weight's gradients, all in the forward; the backward hands those over
// (scaled when autograd's upstream gradient is not options.grad_scale). Peak memory: one
// chunk's logits, the hidden states' gradient and a float32 [vocab, hidden] weight
// gradient, instead of [rows, vocab] logits. The same matmuls as the unfused form.
// hidden [rows, hidden], weight [vocab, hidden]; options as cross_entropy's. With
// options.combine, weight is this rank's rows of a split vocabulary (its logits' columns):
// each chunk's loss call exchanges the chunk's statistics, so every rank must make the
// same call (same rows and chunk_rows), and the hidden states' gradient is this rank's
// share, which the caller sums across the ranks (tp::fused_vocab_parallel_linear_cross_entropy
// behind tp's column region does). chunk_rows 0: rows / ceil(vocab / hidden), so that a
// chunk's logits hold about as many elements as hidden, at least 128 rows.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                const CrossEntropyOptions& options = {}, std::int64_t chunk_rows = 0);

}  // namespace dtrain::ops
