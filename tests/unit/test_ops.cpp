// The ops' reference paths (what runs off CUDA, and the reference of the GPU tests)
// against LibTorch's own ops: flash attention against scaled_dot_product_attention, the
// norms against at::rms_norm / at::layer_norm, SwiGLU against silu then multiply, RoPE against
// the half-split rotation in ATen ops, cross-entropy against at::cross_entropy,
// forward and backward; fused AdamW bitwise against torch::optim::AdamW; the named input
// checks; and the trainer with every fused option against the plain one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "common/corpus.hpp"
#include "common/errors.hpp"
#include "dtrain/ops/adamw.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/ops/cross_entropy.hpp"
#include "dtrain/ops/norm.hpp"
#include "dtrain/ops/rope.hpp"
#include "dtrain/ops/swiglu.hpp"
#include "dtrain/optim/optim.hpp"
#include "dtrain/parallel/context.hpp"
#include "dtrain/train/autocast.hpp"
#include "dtrain/train/trainer.hpp"
#include "dtrain_kernels/attention_dropout.h"

namespace dtrain {
namespace {

using testing::error_message;
using testing::expect_has;

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// ---- attention ---------------------------------------------------------------------------

// Which keys each query sees with a sliding window, written out element by element
// (independent of the ops' own masks): [sq, sk], true where i - w < j <= i, or without
// causal i - w < j < i + w.
at::Tensor window_mask(std::int64_t sq, std::int64_t sk, std::int64_t w, bool causal = true) {
  auto mask = torch::zeros({sq, sk}, torch::kBool);
  auto a = mask.accessor<bool, 2>();
  for (std::int64_t i = 0; i < sq; ++i) {
    const std::int64_t last = std::min(causal ? i : i + w - 1, sk - 1);
    for (std::int64_t j = std::max<std::int64_t>(0, i - w + 1); j <= last; ++j) a[i][j] = true;
  }
  return mask;
}

TEST(FlashAttentionReference, MatchesSdpaForwardAndBackward) {
  torch::manual_seed(0);
  struct Case {
    std::int64_t b, h, hkv, sq, sk, d;
    bool causal;
    std::int64_t window = 0;
  };
  // Sliding windows: across the reference path's 256-row chunks (GQA), of one key, and
  // past the keys' end (45 queries over 20 keys: rows 29.. see none, sdpa's all-masked
  // rows are not compared, below); causal and both ways.
  for (const auto& c : {Case{2, 4, 4, 33, 33, 16, true}, Case{1, 4, 2, 300, 300, 8, true},
                        Case{2, 2, 1, 20, 45, 8, false}, Case{1, 2, 2, 45, 20, 8, true},
                        Case{1, 4, 2, 300, 300, 8, true, 57}, Case{2, 2, 2, 33, 33, 16, true, 1},
                        Case{1, 2, 1, 45, 20, 8, true, 10}, Case{1, 4, 2, 300, 300, 8, false, 57},
                        Case{2, 2, 2, 33, 33, 16, false, 1}, Case{1, 2, 1, 45, 20, 8, false, 10}}) {
    SCOPED_TRACE("sq " + std::to_string(c.sq) + " sk " + std::to_string(c.sk) + (c.causal ? " causal" : "") +
                 " window " + std::to_string(c.window));
    auto q = torch::randn({c.b, c.h, c.sq, c.d}, torch::kDouble).requires_grad_();
    auto k = torch::randn({c.b, c.hkv, c.sk, c.d}, torch::kDouble).requires_grad_();
    auto v = torch::randn({c.b, c.hkv, c.sk, c.d}, torch::kDouble).requires_grad_();
    auto dout = torch::randn({c.b, c.h, c.sq, c.d}, torch::kDouble);
    auto got = ops::flash_attention(q, k, v, c.causal, 0.0, c.window);
    got.backward(dout);
    const auto dq = q.grad().clone(), dk = k.grad().clone(), dv = v.grad().clone();
    q.mutable_grad().reset(), k.mutable_grad().reset(), v.mutable_grad().reset();
    // The rows that see a key (all but, with a window, those past sk + window - 1): the
    // others give 0 and no gradient.
    const auto seen = c.window > 0 ? std::min(c.sq, c.sk + c.window - 1) : c.sq;
    if (seen < c.sq) {
      EXPECT_EQ(got.narrow(2, seen, c.sq - seen).abs().max().item<double>(), 0.0);
      EXPECT_EQ(dq.narrow(2, seen, c.sq - seen).abs().max().item<double>(), 0.0);
    }
    at::Tensor want;
    if (c.window > 0) {
      const auto group = c.h / c.hkv;
      want = at::scaled_dot_product_attention(q.narrow(2, 0, seen), k.repeat_interleave(group, 1),
                                              v.repeat_interleave(group, 1),
                                              window_mask(seen, c.sk, c.window, c.causal));
      // The sdpa backend's window is the same function.
      EXPECT_LT(max_abs(ops::attention(q.narrow(2, 0, seen), k, v, c.causal, 0.0, ops::AttentionBackend::kSdpa,
                                       c.window),
                        want),
                1e-10);
    } else {
      want = ops::attention(q, k, v, c.causal, 0.0, ops::AttentionBackend::kSdpa);
    }
    want.backward(dout.narrow(2, 0, seen));
    EXPECT_LT(max_abs(got.narrow(2, 0, seen), want), 1e-10);
    EXPECT_LT(max_abs(dq.narrow(2, 0, seen), q.grad().narrow(2, 0, seen)), 1e-10);
    EXPECT_LT(max_abs(dk, k.grad()), 1e-10);
    EXPECT_LT(max_abs(dv, v.grad()), 1e-10);
  }
  // float32 inputs stay float32 and agree with sdpa to float32 rounding.
  auto q = torch::randn({1, 2, 70, 16}), k = torch::randn({1, 2, 70, 16}), v = torch::randn({1, 2, 70, 16});
  auto o = ops::flash_attention(q, k, v, true);
  EXPECT_EQ(o.scalar_type(), at::kFloat);
  EXPECT_LT(max_abs(o, at::scaled_dot_product_attention(q, k, v, {}, 0.0, true)), 1e-5);
}

// Scores s [.., sq, sk] with the keys a causal query at token offset + i does not see (past
// it, or a window's reach) at -inf; s itself when not causal.
at::Tensor hide_unseen(const at::Tensor& s, bool causal, std::int64_t offset, std::int64_t window) {
  if (!causal) return s;
  auto rows = torch::arange(offset, offset + s.size(-2)).unsqueeze(1), cols = torch::arange(s.size(-1)).unsqueeze(0);
  auto hidden = cols > rows;
  if (window > 0) hidden = hidden.logical_or(cols <= rows - window);
  return s.masked_fill(hidden, -std::numeric_limits<double>::infinity());
}

// Attention dropout is a mask on the probabilities that reach v: the op's output and
// gradients are those of softmax(q k^T scale) Z / (1 - p) v written out with the mask Z
// the kernels' hash gives (dtrain_attention_dropout_keeps, rebuilt here element by
// element over the query tokens, the query offset counted) and differentiated by
// autograd; the mask keeps 1 - p of the probabilities, each of a hash's four draws alike,
// and neighbours independently; a seed gives one mask, another seed or head another; an
// unseeded call draws from the default generator.
TEST(FlashAttentionReference, DropoutIsAMaskOnTheProbabilities) {
  torch::manual_seed(4);
  const std::int64_t B = 2, H = 4, Hkv = 2, Sk = 40, D = 8;
  const double p = 0.3;
  const std::uint64_t seed = 0x5EED;
  auto z_of = [&](std::uint64_t s, std::int64_t sq, std::int64_t offset) {
    auto z = torch::empty({B, H, sq, Sk}, torch::kDouble);
    auto a = z.accessor<double, 4>();
    const auto threshold = dtrain_attention_dropout_threshold(static_cast<float>(p));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < H; ++h) {
        for (std::int64_t i = 0; i < sq; ++i) {
          for (std::int64_t j = 0; j < Sk; ++j) {
            a[b][h][i][j] = dtrain_attention_dropout_keeps(s, b * H + h, offset + i, j, threshold) ? 1.0 : 0.0;
          }
        }
      }
    }
    return z;
  };
  struct Case {
    bool causal;
    std::int64_t sq, offset, window;
  };
  for (const auto& c : {Case{true, Sk, 0, 0}, Case{false, Sk, 0, 0}, Case{true, 17, 23, 9}}) {
    SCOPED_TRACE(std::string(c.causal ? "causal" : "full") + " offset " + std::to_string(c.offset));
    auto q = torch::randn({B, H, c.sq, D}, torch::kDouble).requires_grad_();
    auto k = torch::randn({B, Hkv, Sk, D}, torch::kDouble).requires_grad_();
    auto v = torch::randn({B, Hkv, Sk, D}, torch::kDouble).requires_grad_();
    auto dout = torch::randn({B, H, c.sq, D}, torch::kDouble);
    auto got = ops::flash_attention(q, k, v, c.causal, 0.0, c.window, {}, c.offset, p, seed);
    got.backward(dout);
    const auto dq = q.grad().clone(), dk = k.grad().clone(), dv = v.grad().clone();
    q.mutable_grad().reset(), k.mutable_grad().reset(), v.mutable_grad().reset();
    auto s = at::matmul(q, k.repeat_interleave(H / Hkv, 1).transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
    s = hide_unseen(s, c.causal, c.offset, c.window);
    const auto z = z_of(seed, c.sq, c.offset);
    auto want = at::matmul(at::softmax(s, -1) * z / (1 - p), v.repeat_interleave(H / Hkv, 1));
    want.backward(dout);
    EXPECT_LT(max_abs(got, want), 1e-10);
    EXPECT_LT(max_abs(dq, q.grad()), 1e-10);
    EXPECT_LT(max_abs(dk, k.grad()), 1e-10);
    EXPECT_LT(max_abs(dv, v.grad()), 1e-10);
    EXPECT_GT(max_abs(got, at::matmul(at::softmax(s, -1), v.repeat_interleave(H / Hkv, 1))), 0.1)
        << "dropout changed nothing";
  }
  // 1 - p of the probabilities kept (over 1M, within 5 standard deviations), a mask per
  // seed and per head.
  const auto many = z_of(seed, 6400, 0);
  const double kept = many.mean().item<double>(), sd = std::sqrt(p * (1 - p) / many.numel());
  EXPECT_NEAR(kept, 1 - p, 5 * sd);
  // Each of a hash's four 16-bit draws (keys 4 j + i) keeps 1 - p, and neighbours are
  // independent: adjacent keys (within a quad and across) and adjacent queries are both
  // kept (1 - p)^2 of the time (a draw shared by two keys would give 1 - p).
  for (std::int64_t i = 0; i < 4; ++i) {
    const auto slice = many.slice(3, i, Sk, 4);
    EXPECT_NEAR(slice.mean().item<double>(), 1 - p, 5 * std::sqrt(p * (1 - p) / slice.numel())) << "draw " << i;
  }
  const double both = (1 - p) * (1 - p);
  for (const auto& pairs : {many.narrow(3, 0, Sk - 1) * many.narrow(3, 1, Sk - 1),
                            many.narrow(2, 0, 6399) * many.narrow(2, 1, 6399)}) {
    EXPECT_NEAR(pairs.mean().item<double>(), both, 5 * std::sqrt(both * (1 - both) / pairs.numel()));
  }
  EXPECT_FALSE(torch::equal(many.select(1, 0), many.select(1, 1))) << "heads share a mask";
  EXPECT_FALSE(torch::equal(many.narrow(2, 0, 40), z_of(seed + 1, 40, 0))) << "seeds share a mask";
  // Unseeded: a draw from the default generator, so the same generator seed gives the same
  // output and the next call another.
  auto q = torch::randn({B, H, 24, D}), k = torch::randn({B, Hkv, 24, D});
  torch::manual_seed(9);
  const auto a = ops::attention(q, k, k, true, p, ops::AttentionBackend::kFlash);
  const auto b = ops::attention(q, k, k, true, p, ops::AttentionBackend::kFlash);
  torch::manual_seed(9);
  EXPECT_TRUE(torch::equal(a, ops::attention(q, k, k, true, p, ops::AttentionBackend::kFlash)));
  EXPECT_FALSE(torch::equal(a, b));
}

// Attention sinks: the op's output and gradients (the sinks' too) are those of softmax over
// [q k^T scale, sink] written out with one more column per head, dropped before v, and
// differentiated by autograd (float64): causal, full, a window at a query offset, packed
// documents, GQA; a window that leaves rows no key gives them 0 and no sink gradient; the
// sinks change the result. fold_sinks over flash_attention_forward (what ring attention
// merges) gives the same output, and sinks_grad the same gradient. Sinks of the wrong
// shape, dtype or device, or on sdpa, are errors naming them.
TEST(FlashAttentionReference, SinksAreOneMoreLogitPerHead) {
  torch::manual_seed(7);
  const std::int64_t B = 2, H = 4, Hkv = 2, Sk = 40, D = 8;
  struct Case {
    bool causal;
    std::int64_t sq, offset, window;
    bool documents;
  };
  for (const auto& c : {Case{true, Sk, 0, 0, false}, Case{false, Sk, 0, 0, false}, Case{true, 17, 23, 9, false},
                        Case{true, Sk, 0, 0, true}, Case{false, 60, 0, 5, false}}) {
    SCOPED_TRACE(std::string(c.causal ? "causal" : "full") + " sq " + std::to_string(c.sq) + " offset " +
                 std::to_string(c.offset) + " window " + std::to_string(c.window) + (c.documents ? " documents" : ""));
    auto q = (2 * torch::randn({B, H, c.sq, D}, torch::kDouble)).requires_grad_();
    auto k = (2 * torch::randn({B, Hkv, Sk, D}, torch::kDouble)).requires_grad_();
    auto v = torch::randn({B, Hkv, Sk, D}, torch::kDouble).requires_grad_();
    auto sinks = (torch::randn({H}, torch::kDouble) * 2 + 1).requires_grad_();
    auto dout = torch::randn({B, H, c.sq, D}, torch::kDouble);
    // Documents of 7 tokens: the rows' own run of numbers.
    const auto ids = (torch::arange(Sk).div(7, "floor")).unsqueeze(0).expand({B, Sk}).contiguous();
    const ops::Documents docs = c.documents ? ops::Documents(ids) : ops::Documents();
    auto got = ops::flash_attention(q, k, v, c.causal, 0.0, c.window, docs, c.offset, 0.0, std::nullopt, 0.0, sinks);
    got.backward(dout);
    const auto dq = q.grad().clone(), dk = k.grad().clone(), dv = v.grad().clone(), ds = sinks.grad().clone();
    q.mutable_grad().reset(), k.mutable_grad().reset(), v.mutable_grad().reset(), sinks.mutable_grad().reset();

    auto s = at::matmul(q, k.repeat_interleave(H / Hkv, 1).transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
    auto seen = torch::ones({c.sq, Sk}, torch::kBool);
    if (c.window > 0) seen = window_mask(c.sq + c.offset, Sk, c.window, c.causal).narrow(0, c.offset, c.sq);
    else if (c.causal) seen = seen.tril(c.offset);
    if (c.documents) seen = seen.logical_and(ids[0].unsqueeze(1) == ids[0].unsqueeze(0));
    s = s.masked_fill(seen.logical_not(), -std::numeric_limits<double>::infinity());
    auto with_sink = at::cat({s, sinks.view({1, H, 1, 1}).expand({B, H, c.sq, 1})}, -1);
    auto probs = at::softmax(with_sink, -1).narrow(-1, 0, Sk);
    auto want = at::matmul(probs, v.repeat_interleave(H / Hkv, 1));
    want.backward(dout);
    EXPECT_LT(max_abs(got, want), 1e-10);
    EXPECT_LT(max_abs(dq, q.grad()), 1e-10);
    EXPECT_LT(max_abs(dk, k.grad()), 1e-10);
    EXPECT_LT(max_abs(dv, v.grad()), 1e-10);
    EXPECT_LT(max_abs(ds, sinks.grad()), 1e-10);
    EXPECT_GT(ds.abs().min().item<double>(), 1e-6) << "a head's sink got no gradient";
    const auto none = seen.logical_not().all(1);  // rows that see no key: output 0
    if (none.any().item<bool>()) {
      EXPECT_EQ(got.detach().index({torch::indexing::Slice(), torch::indexing::Slice(), none}).abs().max().item<double>(), 0.0);
    }
    const auto plain = ops::flash_attention(q, k, v, c.causal, 0.0, c.window, docs, c.offset);
    EXPECT_GT(max_abs(got, plain), 0.05) << "the sinks changed nothing";

    // The blocks' form: fold_sinks over the forward without sinks, sinks_grad.
    torch::NoGradGuard no_grad;
    const auto [o, lse] = ops::flash_attention_forward(q, k, v, c.causal, 0.0, c.window, docs, c.offset);
    const auto [fo, flse] = ops::fold_sinks(o, lse, sinks);
    EXPECT_LT(max_abs(fo, got), 1e-10);
    EXPECT_LT(max_abs(ops::sinks_grad(fo, flse, dout, sinks), ds), 1e-10);
    const auto g = ops::flash_attention_backward(q, k, v, fo, flse, dout, c.causal, 0.0, c.window, docs, c.offset);
    EXPECT_LT(max_abs(g[0], dq), 1e-10) << "the backward over the folded output and log-sum-exp";
    EXPECT_LT(max_abs(g[1], dk), 1e-10);
  }
  auto q = torch::randn({1, 2, 8, D});
  expect_has(error_message([&] {
               ops::flash_attention(q, q, q, true, 0.0, 0, {}, 0, 0.0, std::nullopt, 0.0, torch::zeros({3}));
             }),
             {"sinks must be [heads] = [2]", "[3]"});
  expect_has(error_message([&] {
               ops::flash_attention(q, q, q, true, 0.0, 0, {}, 0, 0.0, std::nullopt, 0.0,
                                    torch::zeros({2}, torch::kInt));
             }),
             {"sinks are Int", "allowed: a floating dtype"});
  expect_has(error_message([&] {
               ops::attention(q, q, q, true, 0.0, ops::AttentionBackend::kSdpa, 0, {}, 0, 0.0, torch::zeros({2}));
             }),
             {"sinks need the flash backend", "allowed with sdpa: none"});
  expect_has(error_message([&] { ops::fold_sinks(q, torch::zeros({1, 2, 8}), torch::zeros({4})); }),
             {"fold_sinks", "sinks must be [heads] = [2]"});
}

// Packed documents are independent sequences: each document's rows of the output, and its
// rows of the gradients, are those of causal attention over that document alone (sliced
// out, no mask), for both backends, with and without a window. Document numbers are runs:
// a number that recurs after another starts a new document (batch 1's 0 0 1 1 0 0 ...).
// Logit soft-capping: the op's output and gradients are those of softmax(softcap tanh(q k^T
// scale / softcap)) v written out and differentiated by autograd (float64), causal, full,
// and a window at a query offset, with GQA; the cap changes the result; a negative, NaN or
// infinite cap is an error naming softcap.
TEST(FlashAttentionReference, SoftcapIsTanhOnTheScores) {
  torch::manual_seed(5);
  const std::int64_t B = 2, H = 4, Hkv = 2, Sk = 40, D = 8;
  const double cap = 1.5;
  struct Case {
    bool causal;
    std::int64_t sq, offset, window;
  };
  for (const auto& c : {Case{true, Sk, 0, 0}, Case{false, Sk, 0, 0}, Case{true, 17, 23, 9}}) {
    SCOPED_TRACE(std::string(c.causal ? "causal" : "full") + " offset " + std::to_string(c.offset));
    auto q = (2 * torch::randn({B, H, c.sq, D}, torch::kDouble)).requires_grad_();
    auto k = (2 * torch::randn({B, Hkv, Sk, D}, torch::kDouble)).requires_grad_();
    auto v = torch::randn({B, Hkv, Sk, D}, torch::kDouble).requires_grad_();
    auto dout = torch::randn({B, H, c.sq, D}, torch::kDouble);
    auto got = ops::flash_attention(q, k, v, c.causal, 0.0, c.window, {}, c.offset, 0.0, std::nullopt, cap);
    got.backward(dout);
    const auto dq = q.grad().clone(), dk = k.grad().clone(), dv = v.grad().clone();
    q.mutable_grad().reset(), k.mutable_grad().reset(), v.mutable_grad().reset();
    auto s = at::matmul(q, k.repeat_interleave(H / Hkv, 1).transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
    const auto capped = hide_unseen((s / cap).tanh() * cap, c.causal, c.offset, c.window);
    s = hide_unseen(s, c.causal, c.offset, c.window);
    auto want = at::matmul(at::softmax(capped, -1), v.repeat_interleave(H / Hkv, 1));
    want.backward(dout);
    EXPECT_LT(max_abs(got, want), 1e-10);
    EXPECT_LT(max_abs(dq, q.grad()), 1e-10);
    EXPECT_LT(max_abs(dk, k.grad()), 1e-10);
    EXPECT_LT(max_abs(dv, v.grad()), 1e-10);
    EXPECT_GT(max_abs(got, at::matmul(at::softmax(s, -1), v.repeat_interleave(H / Hkv, 1))), 0.1)
        << "the cap changed nothing";
  }
  auto q = torch::randn({1, 2, 8, D});
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    expect_has(error_message([&] { ops::flash_attention(q, q, q, true, 0.0, 0, {}, 0, 0.0, std::nullopt, bad); }),
               {"softcap=", "allowed: 0 (none) or a finite cap > 0"});
  }
}

TEST(FlashAttentionReference, DocumentsAreIndependentSequences) {
  torch::manual_seed(3);
  const std::int64_t B = 2, H = 4, Hkv = 2, T = 300, D = 8;
  // Runs of 1, 2, 37, 200 (across the reference path's 256-row chunks) and 60 tokens; then
  // runs of 3 alternating between two numbers.
  auto documents = torch::empty({B, T}, torch::kInt);
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> runs(B);  // [start, end) per batch
  {
    auto a = documents.accessor<std::int32_t, 2>();
    std::int64_t i = 0, n = 0;
    for (std::int64_t len : {1, 2, 37, 200, 60}) {
      for (std::int64_t j = i; j < i + len; ++j) a[0][j] = static_cast<std::int32_t>(n);
      runs[0].push_back({i, i + len}), i += len, ++n;
    }
    for (i = 0; i < T; i += 3) {
      for (std::int64_t j = i; j < std::min(T, i + 3); ++j) a[1][j] = static_cast<std::int32_t>(i / 3 % 2);
      runs[1].push_back({i, std::min(T, i + 3)});
    }
  }
  const ops::Documents shared(documents);  // one for every call, as a model's layers share it
  // Causal, with a window, causal again (the kept mask), then bidirectional (twice, then
  // with a window both ways).
  for (const auto& [causal, window] : std::vector<std::pair<bool, std::int64_t>>{
           {true, 0}, {true, 25}, {true, 0}, {false, 0}, {false, 0}, {false, 25}}) {
    for (auto backend : {ops::AttentionBackend::kFlash, ops::AttentionBackend::kSdpa}) {
      SCOPED_TRACE(std::string(ops::to_string(backend)) + (causal ? " causal" : " bidirectional") + " window " +
                   std::to_string(window));
      auto q = torch::randn({B, H, T, D}, torch::kDouble).requires_grad_();
      auto k = torch::randn({B, Hkv, T, D}, torch::kDouble).requires_grad_();
      auto v = torch::randn({B, Hkv, T, D}, torch::kDouble).requires_grad_();
      auto dout = torch::randn({B, H, T, D}, torch::kDouble);
      auto got = ops::attention(q, k, v, causal, 0.0, backend, window, shared);
      got.backward(dout);
      for (std::int64_t b = 0; b < B; ++b) {
        for (const auto& run : runs[b]) {
          const std::int64_t r0 = run.first, r1 = run.second;
          SCOPED_TRACE("batch " + std::to_string(b) + " document [" + std::to_string(r0) + ", " +
                       std::to_string(r1) + ")");
          auto slice = [&](const at::Tensor& t) { return t.detach().narrow(0, b, 1).narrow(2, r0, r1 - r0); };
          auto qs = slice(q).requires_grad_(), ks = slice(k).requires_grad_(), vs = slice(v).requires_grad_();
          auto want = ops::flash_attention(qs, ks, vs, causal, 0.0, window);
          want.backward(slice(dout));
          EXPECT_LT(max_abs(slice(got), want), 1e-10);
          EXPECT_LT(max_abs(slice(q.grad()), qs.grad()), 1e-10);
          EXPECT_LT(max_abs(slice(k.grad()), ks.grad()), 1e-10);
          EXPECT_LT(max_abs(slice(v.grad()), vs.grad()), 1e-10);
        }
      }
    }
  }
}

// ops::Documents makes the bounds and sdpa's mask once, and its copies share them; the
// mask is additive in the dtype asked (0 for the keys of the query's own document up to
// the query, within the window, or without causal all of them; -inf elsewhere), its rows
// padded to 16 elements.
TEST(FlashAttentionReference, DocumentsMakeTheirMasksOnce) {
  const auto ids = torch::tensor({0, 0, 1, 1, 1, 0}, torch::kInt).view({1, 6});
  const ops::Documents documents(ids);
  const auto copy = documents;
  EXPECT_TRUE(copy.bounds().first.is_same(documents.bounds().first));
  EXPECT_TRUE(torch::equal(documents.bounds().first, torch::tensor({0, 0, 2, 2, 2, 5}, torch::kInt).view({1, 6})));
  EXPECT_TRUE(torch::equal(documents.bounds().second, torch::tensor({2, 2, 5, 5, 5, 6}, torch::kInt).view({1, 6})));
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (std::int64_t window : {0, 2}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " window " + std::to_string(window));
      const auto& mask = documents.sdpa_mask(window, dtype, 6, 6, at::kCPU);
      EXPECT_TRUE(copy.sdpa_mask(window, dtype, 6, 6, at::kCPU).is_same(mask));
      EXPECT_EQ(mask.scalar_type(), dtype);
      EXPECT_EQ(mask.sizes(), (std::vector<std::int64_t>{1, 1, 6, 6}));
      EXPECT_EQ(mask.stride(2), 16);
      EXPECT_EQ(mask.stride(3), 1);
      auto want = torch::full({1, 1, 6, 6}, -std::numeric_limits<float>::infinity());
      const std::int64_t start[] = {0, 0, 2, 2, 2, 5};
      for (std::int64_t i = 0; i < 6; ++i) {
        for (std::int64_t j = start[i]; j <= i; ++j) {
          if (window == 0 || j > i - window) want.index_put_({0, 0, i, j}, 0.0);
        }
      }
      EXPECT_TRUE(torch::equal(mask.to(at::kFloat), want)) << mask;
    }
    // Without causal: the whole document, later keys too.
    const auto& mask = documents.sdpa_mask(0, dtype, 6, 6, at::kCPU, 0, /*causal=*/false);
    EXPECT_TRUE(copy.sdpa_mask(0, dtype, 6, 6, at::kCPU, 0, false).is_same(mask));
    EXPECT_FALSE(documents.sdpa_mask(0, dtype, 6, 6, at::kCPU).is_same(mask));
    auto want = torch::full({1, 1, 6, 6}, -std::numeric_limits<float>::infinity());
    const std::int64_t start[] = {0, 0, 2, 2, 2, 5}, end[] = {2, 2, 5, 5, 5, 6};
    for (std::int64_t i = 0; i < 6; ++i) {
      for (std::int64_t j = start[i]; j < end[i]; ++j) want.index_put_({0, 0, i, j}, 0.0);
    }
    EXPECT_TRUE(torch::equal(mask.to(at::kFloat), want)) << mask;
  }
}

// Without documents, a sliding window's mask is made once too (the model's one
// ops::Documents per forward holds it for every layer): [seq_q, seq_k] additive, rows padded
// to 16 elements, 0 where i - W < j <= i; the op takes the one `documents` holds (one
// doctored to hide nothing gives full attention), and its output is sdpa's with the window
// as a boolean mask.
TEST(FlashAttentionReference, WindowMaskIsMadeOnce) {
  const ops::Documents none;
  const auto copy = none;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto& mask = none.sdpa_mask(3, dtype, 7, 9, at::kCPU);
    EXPECT_TRUE(copy.sdpa_mask(3, dtype, 7, 9, at::kCPU).is_same(mask));
    EXPECT_EQ(mask.sizes(), (std::vector<std::int64_t>{7, 9}));
    EXPECT_EQ(mask.stride(0), 16);
    EXPECT_EQ(mask.scalar_type(), dtype);
    const auto want =
        torch::full({7, 9}, -std::numeric_limits<float>::infinity()).masked_fill(window_mask(7, 9, 3), 0.0);
    EXPECT_TRUE(torch::equal(mask.to(at::kFloat), want)) << mask;
  }
  torch::manual_seed(5);
  auto q = torch::randn({2, 4, 20, 16}), k = torch::randn({2, 4, 20, 16}), v = torch::randn({2, 4, 20, 16});
  const ops::Documents doctored;
  doctored.sdpa_mask(5, at::kFloat, 20, 20, at::kCPU).zero_();
  EXPECT_LT(max_abs(ops::attention(q, k, v, true, 0.0, ops::AttentionBackend::kSdpa, 5, doctored),
                    at::scaled_dot_product_attention(q, k, v, {}, 0.0, false)),
            1e-5);
  EXPECT_LT(max_abs(ops::attention(q, k, v, true, 0.0, ops::AttentionBackend::kSdpa, 5),
                    at::scaled_dot_product_attention(q, k, v, window_mask(20, 20, 5), 0.0, false)),
            1e-5);
}

// Queries at an offset into the keys' sequence (a context-parallel rank's chunk): the rows
// of the whole sequence's attention, forward and backward (the keys past the chunk get no
// gradient from it), with grouped-query heads, a window and documents of the whole
// sequence, on both backends (flash: its reference path, the kernel's function); sdpa's
// masks of several chunks are kept side by side. Queries past the keys' end (a ring
// attention block of earlier keys) against attention written out element by element.
// Negative offsets and offsets without causal are refused by name.
TEST(Attention, QueryOffsetGivesTheRowsOfTheWholeSequence) {
  torch::manual_seed(8);
  const std::int64_t T = 20;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  const auto q = torch::randn({2, 4, T, 8}, f64), k = torch::randn({2, 2, T, 8}, f64);
  const auto v = torch::randn({2, 2, T, 8}, f64), dy = torch::randn({2, 4, T, 8}, f64);
  const ops::Documents documents((torch::rand({2, T}) < 0.25).to(torch::kLong).cumsum(1));
  struct Chunk {
    std::int64_t offset, queries, keys;
  };
  for (const auto backend : {ops::AttentionBackend::kSdpa, ops::AttentionBackend::kFlash}) {
  for (const bool docs : {false, true}) {
    for (const std::int64_t window : {0, 6}) {
      const auto& d = docs ? documents : ops::Documents();
      auto qw = q.clone().requires_grad_(), kw = k.clone().requires_grad_(), vw = v.clone().requires_grad_();
      // The whole sequence on sdpa, so that flash's chunks are checked against the other backend.
      const auto whole = ops::attention(qw, kw, vw, true, 0.0, ops::AttentionBackend::kSdpa, window, d);
      for (const auto& c : {Chunk{0, 5, 5}, Chunk{7, 6, 13}, Chunk{15, 5, 20}, Chunk{3, 4, 12}}) {
        SCOPED_TRACE(::testing::Message() << ops::to_string(backend) << " documents " << docs << " window " << window
                                        << " offset " << c.offset << " queries " << c.queries << " keys " << c.keys);
        auto qc = q.narrow(2, c.offset, c.queries).clone().requires_grad_();
        auto kc = k.narrow(2, 0, c.keys).clone().requires_grad_(), vc = v.narrow(2, 0, c.keys).clone().requires_grad_();
        const auto rows = dy.narrow(2, c.offset, c.queries);
        const auto got = ops::attention(qc, kc, vc, true, 0.0, backend, window, d, c.offset);
        (got * rows).sum().backward();
        EXPECT_LT(max_abs(got, whole.narrow(2, c.offset, c.queries)), 1e-12);
        for (auto* t : {&qw, &kw, &vw}) t->mutable_grad() = at::Tensor();
        (whole.narrow(2, c.offset, c.queries) * rows).sum().backward({}, /*retain_graph=*/true);
        EXPECT_LT(max_abs(qc.grad(), qw.grad().narrow(2, c.offset, c.queries)), 1e-12);
        EXPECT_LT(max_abs(kc.grad(), kw.grad().narrow(2, 0, c.keys)), 1e-12);
        EXPECT_LT(max_abs(vc.grad(), vw.grad().narrow(2, 0, c.keys)), 1e-12);
        if (c.keys < T) EXPECT_EQ(kw.grad().narrow(2, c.keys, T - c.keys).abs().max().item<double>(), 0.0);
      }
    }
  }
  }
  // Queries 12-16 over keys 0-7, written out: query i (token 12 + i) sees key j when j <=
  // 12 + i, 12 + i - W < j and both are in one document (documents of tokens 0-13, 14-15
  // and 16-19: queries 14-16 see no key).
  const auto past_ids = (torch::arange(T) >= 14).to(torch::kLong) + (torch::arange(T) >= 16).to(torch::kLong);
  const ops::Documents past(past_ids.expand({2, T}).contiguous());
  for (const auto backend : {ops::AttentionBackend::kSdpa, ops::AttentionBackend::kFlash}) {
    for (const bool docs : {false, true}) {
      for (const std::int64_t window : {0, 10}) {
        SCOPED_TRACE(::testing::Message() << ops::to_string(backend) << " past the keys, documents " << docs
                                          << " window " << window);
        const std::int64_t O = 12, nq = 5, nk = 8;
        const auto ids = past.ids();
        auto allowed = torch::zeros({2, 1, nq, nk}, torch::kBool);
        for (std::int64_t b = 0; b < 2; ++b) {
          for (std::int64_t i = 0; i < nq; ++i) {
            for (std::int64_t j = 0; j < nk; ++j) {
              const bool seen = j <= O + i && (window == 0 || j > O + i - window) &&
                                (!docs || ids[b][O + i].item<std::int64_t>() == ids[b][j].item<std::int64_t>());
              allowed[b][0][i][j] = seen;
            }
          }
        }
        const auto qs = q.narrow(2, O, nq), ks = k.narrow(2, 0, nk), vs = v.narrow(2, 0, nk);
        auto s = at::matmul(qs, ks.repeat_interleave(2, 1).transpose(-2, -1)) / std::sqrt(8.0);
        s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
        const auto seen_any = allowed.any(-1, /*keepdim=*/true);
        auto want = at::matmul(at::softmax(s, -1).masked_fill(seen_any.logical_not(), 0.0), vs.repeat_interleave(2, 1));
        const auto got = ops::attention(qs, ks, vs, true, 0.0, backend, window, docs ? past : ops::Documents(), O);
        // Rows that see no key: flash gives 0; sdpa's all-masked softmax is its own affair.
        const auto rows = seen_any.expand_as(want);
        EXPECT_LT(max_abs(got.masked_select(rows), want.masked_select(rows)), 1e-12);
        if (backend == ops::AttentionBackend::kFlash) {
          EXPECT_TRUE(got.masked_select(rows.logical_not()).eq(0).all().item<bool>());
        }
      }
    }
  }

  // Two chunks' masks, asked in turn, are each made once.
  const auto& first = documents.sdpa_mask(0, at::kDouble, 5, 5, at::kCPU, 0);
  const auto& second = documents.sdpa_mask(0, at::kDouble, 5, 20, at::kCPU, 15);
  EXPECT_TRUE(documents.sdpa_mask(0, at::kDouble, 5, 5, at::kCPU, 0).is_same(first));
  EXPECT_TRUE(documents.sdpa_mask(0, at::kDouble, 5, 20, at::kCPU, 15).is_same(second));
  EXPECT_TRUE(torch::equal(second, documents.sdpa_mask(0, at::kDouble, T, T, at::kCPU).narrow(2, 15, 5)));

  for (const auto backend : {ops::AttentionBackend::kSdpa, ops::AttentionBackend::kFlash}) {
    SCOPED_TRACE(ops::to_string(backend));
    const std::string op = backend == ops::AttentionBackend::kFlash ? "flash_attention: " : "attention: ";
    expect_has(error_message([&] { ops::attention(q, k, v, false, 0.0, backend, 0, {}, 2); }),
               {op + "query_offset=2 without causal", "allowed: 0"});
    expect_has(error_message([&] { ops::attention(q, k, v, true, 0.0, backend, 0, {}, -1); }),
               {op + "query_offset=-1", "allowed: 0"});
    expect_has(error_message([&] {
                 ops::attention(q.narrow(2, 0, 4), k.narrow(2, 0, 12), v.narrow(2, 0, 12), true, 0.0, backend, 0,
                                ops::Documents(torch::zeros({2, 10}, torch::kLong)), 3);
               }),
               {op + "documents must be [batch, time] = [2, >= 12]", "[2, 10]"});
  }
}

// Under autocast, sdpa computes in autocast's dtype, and the documents' mask is made in it
// (a float32 one is refused beside bfloat16 queries); the output is the float32 run's
// within bfloat16's rounding.
TEST(FlashAttentionReference, DocumentsUnderAutocast) {
  torch::manual_seed(4);
  auto q = torch::randn({2, 4, 40, 16}), k = torch::randn({2, 2, 40, 16}), v = torch::randn({2, 2, 40, 16});
  const ops::Documents documents(torch::arange(40, torch::kInt).div(13, "floor").repeat({2, 1}).contiguous());
  const auto want = ops::attention(q, k, v, true, 0.0, ops::AttentionBackend::kSdpa, 0, documents);
  at::Tensor got;
  {
    train::AutocastScope autocast(at::kBFloat16, at::kCPU);
    got = ops::attention(q, k, v, true, 0.0, ops::AttentionBackend::kSdpa, 0, documents);
  }
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_LT(max_abs(got, want), 0.05);
  EXPECT_EQ(documents.sdpa_mask(0, at::kBFloat16, 40, 40, at::kCPU).scalar_type(), at::kBFloat16);
}

// Grouped-query attention on the sdpa backend: sdpa's own (enable_gqa), which reads k and v
// as they are: its backward node adds into k's and v's gradients directly, with no copy of
// them per query head between. Output and gradients are those of sdpa over k and v
// repeated per query head, with and without autocast, causal, with a window and with
// documents. With dropout, where sdpa's CPU choice is its math backend, k and v are
// repeated (the same call as before, same random numbers).
TEST(SdpaAttention, GroupedQueryAttentionCopiesNoKeys) {
  const ops::Documents documents(torch::arange(24, torch::kInt).div(7, "floor").repeat({2, 1}).contiguous());
  struct Case {
    const char* name;
    std::int64_t window;
    bool documents, autocast;
  };
  for (const Case& c : {Case{"causal", 0, false, false}, Case{"window", 5, false, false},
                        Case{"documents", 0, true, false}, Case{"documents, window", 4, true, false},
                        Case{"causal, autocast", 0, false, true}, Case{"window, autocast", 5, false, true}}) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(9);
    auto q = torch::randn({2, 4, 24, 16}).requires_grad_(), k = torch::randn({2, 2, 24, 16}).requires_grad_(),
         v = torch::randn({2, 2, 24, 16}).requires_grad_();
    const auto docs = c.documents ? documents : ops::Documents();
    std::optional<train::AutocastScope> autocast;
    if (c.autocast) autocast.emplace(at::kBFloat16, at::kCPU);
    auto o = ops::attention(q, k, v, true, 0.0, ops::AttentionBackend::kSdpa, c.window, docs);
    // k and v (cast under autocast) feed sdpa's backward node themselves.
    std::set<const torch::autograd::Node*> inputs;
    for (const auto& e : o.grad_fn()->next_edges()) inputs.insert(e.function.get());
    for (const auto* t : {&k, &v}) {
      const torch::autograd::Node* node = torch::autograd::impl::grad_accumulator(*t).get();
      if (c.autocast) {
        // The cast's node, whose only input is the leaf's accumulator.
        bool found = false;
        for (const auto* n : inputs) {
          if (n != nullptr && n->num_inputs() == 1 && n->next_edges().size() == 1 &&
              n->next_edges()[0].function.get() == node) {
            found = true;
          }
        }
        EXPECT_TRUE(found) << "k or v reaches sdpa through more than its cast";
      } else {
        EXPECT_EQ(inputs.count(node), 1u) << "k or v reaches sdpa through a copy";
      }
    }
    const auto grad = torch::randn(o.sizes()).to(o.scalar_type());
    const auto g = torch::autograd::grad({o}, {q, k, v}, {grad});
    // The former call: sdpa over k and v repeated, with the mask the op makes.
    auto q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_(),
         v2 = v.detach().clone().requires_grad_();
    const auto dt = c.autocast ? at::kBFloat16 : at::kFloat;
    std::optional<at::Tensor> mask;
    if (c.documents) {
      mask = docs.sdpa_mask(c.window, dt, 24, 24, at::kCPU);
    } else if (c.window > 0) {
      mask = window_mask(24, 24, c.window);
    }
    auto want = at::scaled_dot_product_attention(q2.to(dt), k2.to(dt).repeat_interleave(2, 1),
                                                 v2.to(dt).repeat_interleave(2, 1), mask, 0.0, !mask.has_value());
    auto g2 = torch::autograd::grad({want}, {q2, k2, v2}, {grad});
    const double tol = c.autocast ? 2e-2 : 1e-5;
    EXPECT_EQ(o.scalar_type(), dt);
    EXPECT_LT(max_abs(o, want), tol);
    EXPECT_LT(max_abs(g[0], g2[0]), tol);
    EXPECT_LT(max_abs(g[1], g2[1]), 2 * tol);
    EXPECT_LT(max_abs(g[2], g2[2]), 2 * tol);
  }
  // Dropout: the repeated call, bitwise, for the same random numbers.
  auto q = torch::randn({1, 4, 24, 16}), k = torch::randn({1, 2, 24, 16}), v = torch::randn({1, 2, 24, 16});
  torch::manual_seed(3);
  const auto got = ops::attention(q, k, v, true, 0.25, ops::AttentionBackend::kSdpa);
  torch::manual_seed(3);
  const auto want = at::scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), {},
                                                     0.25, true);
  EXPECT_TRUE(torch::equal(got, want));
}

TEST(FlashAttentionReference, NamedInputChecks) {
  auto q = torch::randn({1, 4, 8, 16}), k = torch::randn({1, 3, 8, 16});
  expect_has(error_message([&] { ops::flash_attention(q, k, k, true); }),
             {"flash_attention", "4 query heads are not a multiple of 3"});
  expect_has(error_message([&] { ops::flash_attention(q, q.to(at::kDouble), q, true); }),
             {"flash_attention", "one dtype", "Double"});
  expect_has(error_message([&] { ops::flash_attention(q.view({4, 8, 16}), q, q, true); }),
             {"[batch, heads, time, head_dim]"});
  expect_has(error_message([&] { ops::attention(q, q, q, true, 1.0, ops::AttentionBackend::kFlash); }),
             {"flash_attention", "dropout_p=1", "allowed: [0, 1)"});
  expect_has(error_message([&] { ops::flash_attention(q, q, q, true, 0.0, 0, {}, 0, -0.1); }),
             {"dropout_p=-0.1", "allowed: [0, 1)"});
  expect_has(error_message([&] { ops::parse_attention_backend("fast"); }), {"--attention=fast", "sdpa, flash"});
  expect_has(error_message([&] { ops::flash_attention(q, q, q, false, 0.0, -16); }),
             {"flash_attention", "window=-16", "allowed: 0 (none) or a number of keys >= 1"});
  expect_has(error_message([&] { ops::flash_attention(q, q, q, true, 0.0, -1); }), {"window=-1", "allowed"});
  expect_has(error_message([&] { ops::attention(q, q, q, false, 0.0, ops::AttentionBackend::kSdpa, -4); }),
             {"attention", "window=-4"});
  // Packed documents: integer [batch, time] over one sequence (without causal, no offset).
  const auto docs = torch::zeros({1, 8}, torch::kLong);
  expect_has(error_message([&] { ops::flash_attention(q, q, q, false, 0.0, 0, docs, 2); }),
             {"flash_attention", "query_offset=2 without causal", "allowed"});
  expect_has(error_message([&] { ops::flash_attention(q, q, q, true, 0.0, 0, docs.view({8})); }),
             {"flash_attention", "documents must be [batch, time] = [1, >= 8]", "[8]"});
  expect_has(error_message([&] { ops::flash_attention(q, q, q, true, 0.0, 0, docs.to(at::kFloat)); }),
             {"flash_attention", "documents are Float", "integer"});
  for (auto backend : {ops::AttentionBackend::kSdpa, ops::AttentionBackend::kFlash}) {
    expect_has(error_message([&] { ops::attention(q, q, q, true, 0.0, backend, 0, docs.narrow(1, 0, 7)); }),
               {"documents must be [batch, time]", "[1, 7]"});
  }
}

// The CUDA kernel's head dims (the reference path above takes any): multiples of 8 up to
// 256; none in a build without CUDA.
TEST(FlashAttentionReference, KernelHeadDims) {
  for (std::int64_t d : {8, 32, 40, 64, 80, 96, 128, 136, 200, 256}) {
#ifdef DTRAIN_WITH_CUDA
    EXPECT_TRUE(ops::flash_kernel_supports_head_dim(d)) << d;
#else
    EXPECT_FALSE(ops::flash_kernel_supports_head_dim(d)) << d;
#endif
  }
  for (std::int64_t d : {0, 4, 100, 260, 264, 512}) EXPECT_FALSE(ops::flash_kernel_supports_head_dim(d)) << d;
}

// ---- norms -------------------------------------------------------------------------------

TEST(NormReference, MatchesLibTorchForwardAndBackward) {
  torch::manual_seed(1);
  for (bool layer : {false, true}) {
    for (auto type : {at::kDouble, at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(layer ? "layer_norm " : "rms_norm ") + c10::toString(type));
      auto x = (torch::randn({3, 5, 40}, torch::kDouble) * 3 + 1).to(type).requires_grad_();
      auto w = torch::randn({40}, torch::kDouble).requires_grad_();
      auto b = torch::randn({40}, torch::kDouble).requires_grad_();
      auto dy = torch::randn({3, 5, 40}, torch::kDouble).to(type);
      auto y = layer ? ops::layer_norm(x, w.to(at::kFloat), b.to(at::kFloat), 1e-5)
                     : ops::rms_norm(x, w.to(at::kFloat), 1e-5);
      EXPECT_EQ(y.scalar_type(), type) << "the output keeps x's dtype";
      y.backward(dy);
      auto xr = x.detach().to(at::kDouble).requires_grad_();
      auto wr = w.detach().clone().requires_grad_(), br = b.detach().clone().requires_grad_();
      auto yr = layer ? at::layer_norm(xr, {40}, wr, br, 1e-5) : at::rms_norm(xr, {40}, wr, 1e-5);
      yr.backward(dy.to(at::kDouble));
      const double tol = type == at::kBFloat16 ? 0.05 : 1e-4;
      EXPECT_LT(max_abs(y, yr), tol);
      EXPECT_LT(max_abs(x.grad(), xr.grad()), tol);
      EXPECT_LT(max_abs(w.grad(), wr.grad()), type == at::kBFloat16 ? 0.2 : 1e-3);
      if (layer) {
        EXPECT_LT(max_abs(b.grad(), br.grad()), type == at::kBFloat16 ? 0.2 : 1e-3);
      }
    }
  }
  auto x = torch::randn({2, 8});
  expect_has(error_message([&] { ops::rms_norm(x, torch::ones({7}), 1e-5); }),
             {"rms_norm", "weight is [7]", "needs [8]"});
  expect_has(error_message([&] { ops::layer_norm(x, torch::ones({8}), torch::ones({8}, torch::kDouble), 1e-5); }),
             {"layer_norm", "must match"});
}

// ---- SwiGLU and RoPE -----------------------------------------------------------------------

// The reference path against LibTorch's silu then multiply, forward and backward.
TEST(SwigluReference, MatchesLibTorchSiluTimesUp) {
  torch::manual_seed(2);
  for (auto type : {at::kDouble, at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(type));
    auto g = (torch::randn({3, 5, 40}, torch::kDouble) * 3).to(type).requires_grad_();
    auto u = torch::randn({3, 5, 40}, torch::kDouble).to(type).requires_grad_();
    auto dy = torch::randn({3, 5, 40}, torch::kDouble).to(type);
    auto y = ops::swiglu(g, u);
    EXPECT_EQ(y.scalar_type(), type);
    y.backward(dy);
    auto gr = g.detach().to(at::kDouble).requires_grad_(), ur = u.detach().to(at::kDouble).requires_grad_();
    auto yr = torch::silu(gr) * ur;
    yr.backward(dy.to(at::kDouble));
    const double tol = type == at::kBFloat16 ? 0.1 : type == at::kFloat ? 1e-5 : 1e-12;
    EXPECT_LT(max_abs(y, yr), tol);
    EXPECT_LT(max_abs(g.grad(), gr.grad()), tol);
    EXPECT_LT(max_abs(u.grad(), ur.grad()), tol);
  }
  auto a = torch::randn({2, 8});
  expect_has(error_message([&] { ops::swiglu(a, torch::randn({2, 7})); }), {"swiglu", "up is [2, 7]", "same shape"});
  expect_has(error_message([&] { ops::swiglu(a, a.to(at::kDouble)); }), {"swiglu", "must match"});
  expect_has(error_message([&] { ops::swiglu(a.to(at::kInt), a.to(at::kInt)); }), {"swiglu", "gate is Int", "allowed"});
}

// The reference path against the rotation written with LibTorch's ops as the model had it
// (half-split, angles of position t in row t, or each token's own), its backward against
// autograd through that; the result in [B, T, H, D] storage; the checks.
TEST(RopeReference, MatchesTheHalfSplitRotation) {
  torch::manual_seed(3);
  const std::int64_t B = 2, H = 3, T = 7, D = 8;
  auto rotate = [](const at::Tensor& x, const at::Tensor& c, const at::Tensor& s) {
    auto x1 = x.narrow(3, 0, x.size(3) / 2), x2 = x.narrow(3, x.size(3) / 2, x.size(3) / 2);
    return torch::cat({x1 * c - x2 * s, x1 * s + x2 * c}, 3);
  };
  for (bool per_token : {false, true}) {
    for (auto type : {at::kDouble, at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(c10::toString(type)) + (per_token ? " per-token" : " rows"));
      const auto angle_type = type == at::kDouble ? at::kDouble : at::kFloat;
      auto angles = (per_token ? torch::rand({B, 1, T, D / 2}) : torch::rand({T + 2, D / 2})).to(angle_type) * 10;
      auto x = torch::randn({B, H, T, D}, torch::kDouble).to(type).requires_grad_();
      auto dy = torch::randn({B, H, T, D}, torch::kDouble).to(type);
      auto y = ops::rope(x, angles.cos(), angles.sin());
      EXPECT_EQ(y.scalar_type(), type);
      EXPECT_TRUE(y.permute({0, 2, 1, 3}).is_contiguous()) << "stored as [B, T, H, D]";
      y.backward(dy);
      auto a = (per_token ? angles : angles.narrow(0, 0, T)).to(at::kDouble);
      auto xr = x.detach().to(at::kDouble).requires_grad_();
      auto yr = rotate(xr, a.cos(), a.sin());
      yr.backward(dy.to(at::kDouble));
      const double tol = type == at::kBFloat16 ? 0.05 : type == at::kFloat ? 1e-5 : 1e-12;
      EXPECT_LT(max_abs(y, yr), tol);
      EXPECT_LT(max_abs(x.grad(), xr.grad()), tol);
    }
  }
  auto x = torch::randn({B, H, T, D});
  auto c = torch::ones({T, D / 2});
  expect_has(error_message([&] { ops::rope(x.view({B, H, T * D}), c, c); }), {"rope", "x is [2, 3, 56]", "[B, H, T, D]"});
  expect_has(error_message([&] { ops::rope(x, c.narrow(0, 0, T - 1), c.narrow(0, 0, T - 1)); }),
             {"rope", "cos and sin are [6, 4]", "needs [>= 7, 4] or [2, 1, 7, 4]"});
  expect_has(error_message([&] { ops::rope(x, c.to(at::kBFloat16), c.to(at::kBFloat16)); }),
             {"rope", "cos is BFloat16", "needs Float"});
  expect_has(error_message([&] { ops::rope(x, c, torch::ones({T, 3})); }), {"rope", "one shape"});
}

// ---- cross-entropy -----------------------------------------------------------------------

TEST(CrossEntropyReference, MatchesLibTorchWithIgnoredRows) {
  torch::manual_seed(2);
  for (auto type : {at::kFloat, at::kBFloat16}) {
    auto logits = (torch::randn({30, 101}) * 4).to(type).requires_grad_();
    auto target = torch::randint(0, 101, {30}, torch::kLong);
    target[2] = -100;
    target[17] = -100;
    auto loss = ops::cross_entropy(logits, target);
    (loss * 3).backward();
    auto ref = logits.detach().to(at::kDouble).requires_grad_();
    auto want = at::cross_entropy_loss(ref, target, {}, at::Reduction::Mean, -100);
    (want * 3).backward();
    EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-5);
    EXPECT_LT(max_abs(logits.grad(), ref.grad()), type == at::kFloat ? 1e-6 : 1e-3);
    EXPECT_EQ(logits.grad()[2].abs().sum().item<double>(), 0.0);
  }
  auto all_ignored = torch::full({4}, -100, torch::kLong);
  EXPECT_EQ(ops::cross_entropy(torch::randn({4, 7}), all_ignored).item<double>(), 0.0);
  expect_has(error_message([&] { ops::cross_entropy(torch::randn({4, 7}), torch::full({4}, 7, torch::kLong)); }),
             {"cross_entropy", "outside [0, 7)"});
  expect_has(error_message([&] { ops::cross_entropy(torch::randn({4, 7}), torch::zeros({4}, torch::kInt)); }),
             {"cross_entropy", "target is Int", "int64"});
  for (double bad : {0.0, 1e-50, 1e50, std::numeric_limits<double>::infinity()}) {
    ops::CrossEntropyOptions o;
    o.grad_scale = bad;
    expect_has(error_message([&] { ops::cross_entropy(torch::randn({4, 7}), torch::zeros({4}, torch::kLong), o); }),
               {"cross_entropy", "grad_scale is", "allowed: finite and nonzero in float32"});
  }
}

// The options change how the CUDA path works, never the function: the reference path gives
// the same loss and gradient whatever they say, and leaves the logits as they were.
TEST(CrossEntropyReference, OptionsLeaveTheFunctionAlone) {
  torch::manual_seed(5);
  auto logits = torch::randn({9, 33});
  auto target = torch::randint(0, 33, {9}, torch::kLong);
  target[4] = 5;
  auto run = [&](const ops::CrossEntropyOptions& o) {
    auto l = logits.clone().requires_grad_();
    auto loss = ops::cross_entropy(l, target, o);
    (loss * 0.25).backward();
    EXPECT_TRUE(torch::equal(l.detach(), logits));
    return std::make_pair(loss.detach(), l.grad());
  };
  const auto want = run({});
  ops::CrossEntropyOptions o;
  o.ignore_index = -1;
  o.grad_scale = 0.25;
  o.in_place = true;
  const auto got = run(o);
  EXPECT_TRUE(torch::equal(got.first, want.first));
  EXPECT_TRUE(torch::equal(got.second, want.second));
  o.ignore_index = 5;  // row 4's target: its row has no loss and no gradient
  EXPECT_EQ(run(o).second[4].abs().sum().item<double>(), 0.0);
}

// linear_cross_entropy against the head's matmul then LibTorch's cross-entropy, float64:
// loss and both gradients for chunks that divide the rows and not (one chunk, one row
// each, more than the rows, automatic), ignored rows (a chunk with none counted), an
// upstream gradient other than the announced one, twice through a retained graph, the
// weight used elsewhere too (its gradients add), the pipeline's split backward (one
// gradient, then the other), a frozen weight, no grad mode, every row ignored; the checks.
TEST(LinearCrossEntropy, MatchesTheMatmulThenTheLoss) {
  torch::manual_seed(4);
  const std::int64_t N = 37, d = 16, V = 50;
  const auto h0 = torch::randn({N, d}, torch::kDouble), w0 = torch::randn({V, d}, torch::kDouble) * 0.3;
  auto t = torch::randint(0, V, {N}, torch::kLong);
  t.narrow(0, 0, 10).fill_(-100);  // chunks of 8: the first counts no row
  t[20] = -100;
  auto reference = [&](const at::Tensor& target, double upstream) {
    auto h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    auto loss = at::cross_entropy_loss(at::matmul(h, w.t()), target, {}, at::Reduction::Mean, -100);
    (loss * upstream).backward();
    return std::vector<at::Tensor>{loss.detach(), h.grad(), w.grad()};
  };
  for (std::int64_t chunk : {0, 1, 8, 37, 100}) {
    for (double announced : {1.0, 0.25}) {
      SCOPED_TRACE("chunk rows " + std::to_string(chunk) + ", announced " + std::to_string(announced));
      ops::CrossEntropyOptions o;
      o.grad_scale = announced;
      auto h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
      auto loss = ops::linear_cross_entropy(h, w, t, o, chunk);
      (loss * 0.25).backward();
      const auto want = reference(t, 0.25);
      EXPECT_NEAR(loss.item<double>(), want[0].item<double>(), 1e-12);
      EXPECT_LT(max_abs(h.grad(), want[1]), 1e-12);
      EXPECT_LT(max_abs(w.grad(), want[2]), 1e-12);
    }
  }
  {  // twice through a retained graph, the weight also used elsewhere
    auto h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    auto loss = ops::linear_cross_entropy(h, w, t, {}, 8) + w.sum();
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    const auto want = reference(t, 2.0);
    EXPECT_LT(max_abs(h.grad(), want[1]), 1e-12);
    EXPECT_LT(max_abs(w.grad(), want[2] + 2), 1e-12);
  }
  {  // the pipeline's split backward: the hidden states' gradient, then the weight's
    auto h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    auto loss = ops::linear_cross_entropy(h, w, t, {}, 8);
    const auto dh = torch::autograd::grad({loss}, {h}, {}, /*retain_graph=*/true)[0];
    const auto dw = torch::autograd::grad({loss}, {w})[0];
    const auto want = reference(t, 1.0);
    EXPECT_LT(max_abs(dh, want[1]), 1e-12);
    EXPECT_LT(max_abs(dw, want[2]), 1e-12);
  }
  {  // a frozen weight: the hidden states' gradient alone
    auto h = h0.clone().requires_grad_();
    ops::linear_cross_entropy(h, w0, t, {}, 8).backward();
    EXPECT_LT(max_abs(h.grad(), reference(t, 1.0)[1]), 1e-12);
  }
  {  // no grad mode: the loss, no graph
    const double want = reference(t, 1.0)[0].item<double>();
    torch::NoGradGuard no_grad;
    auto h = h0.clone().requires_grad_();
    auto loss = ops::linear_cross_entropy(h, w0, t, {}, 8);
    EXPECT_FALSE(loss.requires_grad());
    EXPECT_NEAR(loss.item<double>(), want, 1e-12);
  }
  {  // every row ignored: 0, and no gradient
    auto h = h0.clone().requires_grad_();
    auto loss = ops::linear_cross_entropy(h, w0, torch::full({N}, -100, torch::kLong), {}, 8);
    loss.backward();
    EXPECT_EQ(loss.item<double>(), 0.0);
    EXPECT_EQ(h.grad().abs().sum().item<double>(), 0.0);
  }
  expect_has(error_message([&] { ops::linear_cross_entropy(h0, w0.narrow(1, 0, 8), t); }),
             {"linear_cross_entropy", "hidden is [37, 16], weight [50, 8]"});
  expect_has(error_message([&] { ops::linear_cross_entropy(h0, w0, t, {}, -1); }),
             {"linear_cross_entropy", "chunk_rows is -1", "allowed"});
}

// linear_cross_entropy over a vocabulary split across 3 ranks (the head's rows padded to a
// multiple of 3), each rank's call on its own, float64: its combine adds the other shards'
// statistics for the chunk's rows, computed here from the whole, as the ranks' exchange
// would. Per rank: the loss of the whole, its rows of the weight's gradient (padding rows
// 0), and a share of the hidden states' gradient; the shares sum to the whole's. Chunks of
// 8 (the first counts no row) and automatic; each chunk's exchange sees its own rows.
TEST(LinearCrossEntropy, SplitVocabularyIsTheWhole) {
  torch::manual_seed(6);
  const std::int64_t N = 37, d = 16, V = 50, tp = 3, per = (V + tp - 1) / tp;
  const auto h0 = torch::randn({N, d}, torch::kDouble);
  auto w_padded = torch::randn({per * tp, d}, torch::kDouble) * 0.3;
  w_padded.narrow(0, V, per * tp - V).fill_(5);  // padding: would dominate if used
  auto t = torch::randint(0, V, {N}, torch::kLong);
  t.narrow(0, 0, 10).fill_(-100);
  t[2 + 10] = V - 1;  // the last id: the padded shard holds it
  auto h = h0.clone().requires_grad_(), w = w_padded.narrow(0, 0, V).clone().requires_grad_();
  auto want = at::cross_entropy_loss(at::matmul(h, w.t()), t, {}, at::Reduction::Mean, -100);
  want.backward();
  // Each shard's statistics of every row [2, N]: lse over its ids, the target's logit or 0.
  const auto logits = at::matmul(h0, w_padded.narrow(0, 0, V).t());
  std::vector<at::Tensor> exact;
  for (std::int64_t r = 0; r < tp; ++r) {
    const auto cols = std::min(per, V - r * per);
    auto x = logits.narrow(1, r * per, cols);
    const auto local = t - r * per, inside = (local >= 0) & (local < cols);
    exact.push_back(torch::stack(
        {x.logsumexp(1), x.gather(1, local.clamp(0, cols - 1).unsqueeze(1)).squeeze(1).masked_fill(~inside, 0)}));
  }
  for (std::int64_t chunk : {8, 0}) {
    at::Tensor dh_sum = torch::zeros({N, d}, torch::kDouble);
    for (std::int64_t r = 0; r < tp; ++r) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + " rank " + std::to_string(r));
      auto hr = h0.clone().requires_grad_(), wr = w_padded.narrow(0, r * per, per).clone().requires_grad_();
      ops::CrossEntropyOptions o;
      o.vocab_start = r * per;
      o.vocab_size = V;
      std::int64_t row0 = 0;  // the next chunk's first row: the chunks come in order
      o.combine = [&](const at::Tensor& mine) {
        const auto n = mine.size(1);
        auto all = exact;
        for (auto& a : all) a = a.narrow(1, row0, n);
        all[r] = mine;
        row0 += n;
        auto stacked = torch::stack(all);
        return torch::stack({stacked.select(1, 0).logsumexp(0), stacked.select(1, 1).sum(0)});
      };
      auto loss = ops::linear_cross_entropy(hr, wr, t, o, chunk);
      EXPECT_EQ(row0, N) << "every row exchanged once";
      loss.backward();
      EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-12);
      const auto cols = std::min(per, V - r * per);
      EXPECT_LT((wr.grad().narrow(0, 0, cols) - w.grad().narrow(0, r * per, cols)).abs().max().item<double>(), 1e-12);
      if (cols < per) EXPECT_EQ(wr.grad().narrow(0, cols, per - cols).abs().sum().item<double>(), 0.0) << "padding";
      dh_sum += hr.grad();
    }
    EXPECT_LT((dh_sum - h.grad()).abs().max().item<double>(), 1e-12);
  }
}

// ---- fused AdamW ---------------------------------------------------------------------------

TEST(FusedAdamW, ReferencePathIsBitwiseLibTorchAdamW) {
  torch::manual_seed(3);
  NamedParameters a, b;
  for (auto shape : {std::vector<std::int64_t>{7, 3}, {5}, {4, 4}}) {
    auto p = torch::randn(shape, torch::requires_grad());
    a.emplace_back("w" + std::to_string(a.size()), p);
    b.emplace_back("w" + std::to_string(b.size()), p.detach().clone().requires_grad_());
  }
  AdamWOptions o;
  o.lr = 1e-2;
  auto plain = make_adamw(a, o);
  o.fused = true;
  auto fused = make_adamw(b, o);
  for (int step = 0; step < 5; ++step) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      auto g = torch::randn(a[i].second.sizes());
      a[i].second.mutable_grad() = g;
      b[i].second.mutable_grad() = g.clone();
    }
    plain->step();
    fused->step();
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
    const auto& sa = static_cast<const torch::optim::AdamWParamState&>(*plain->state().at(a[i].second.unsafeGetTensorImpl()));
    const auto& sb = static_cast<const torch::optim::AdamWParamState&>(*fused->state().at(b[i].second.unsafeGetTensorImpl()));
    EXPECT_EQ(sa.step(), sb.step());
    EXPECT_TRUE(torch::equal(sa.exp_avg_sq(), sb.exp_avg_sq())) << a[i].first;
  }
}

TEST(FusedAdamW, FlagsModelCopyAndChecks) {
  auto p = torch::randn({10}), g = torch::randn({10}), m = torch::zeros({10}), v = torch::zeros({10});
  auto model = torch::zeros({10}, torch::kBFloat16);
  g[4] = std::numeric_limits<float>::quiet_NaN();
  const auto before = p.clone();
  ops::AdamWHyper h;
  h.lr = 0.1;
  h.bias_correction1 = 0.1;
  h.bias_correction2 = 0.001;
  h.found_inf = torch::zeros({1}, torch::kInt);
  ops::fused_adamw({{p, g, m, v, model, 0.1}}, h);
  EXPECT_EQ(h.found_inf.item<int>(), 1);
  EXPECT_EQ(p[4].item<float>(), before[4].item<float>());
  EXPECT_EQ(m[4].item<float>(), 0.f);
  EXPECT_NE(p[3].item<float>(), before[3].item<float>());
  EXPECT_TRUE(torch::equal(model, p.to(at::kBFloat16)));
  h.skip = torch::ones({1}, torch::kInt);
  const auto frozen = p.clone();
  ops::fused_adamw({{p, g, m, v, model, 0.1}}, h);
  EXPECT_TRUE(torch::equal(p, frozen));
  h.skip = at::Tensor();
  expect_has(error_message([&] { ops::fused_adamw({{p, g, m, torch::zeros({9}), {}, 0}}, h); }),
             {"fused_adamw", "segment 0 exp_avg_sq", "10 elements"});
  expect_has(error_message([&] { ops::fused_adamw({{p.to(at::kDouble), g, m, v, {}, 0}}, h); }),
             {"segment 0 param", "float32"});
  expect_has(error_message([&] { ops::fused_adamw({{p, g.to(at::kDouble), m, v, {}, 0}}, h); }),
             {"segment 0 grad", "Double", "allowed: float32, bfloat16, float16"});
}

// ---- the trainer with every fused option -------------------------------------------------

TEST(FusedOps, TrainerMatchesThePlainRun) {
  testing::TestCorpus corpus("fusedops");
  for (const std::string family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    auto cfg = models::GptConfig::preset("tiny");
    cfg.family = family;
    if (family == "llama") cfg.n_kv_head = cfg.n_head / 2;
    if (family == "llama") cfg.attention_window = 9;  // sdpa's mask against flash's window
    train::TrainOptions o;
    o.train_data = corpus.train();
    o.progress = "off";
    o.steps = 6;
    o.warmup_steps = 1;
    o.seq_len = 32;
    o.global_batch = 4;
    for (bool linear : {false, true}) {  // the loss alone, or with the head (fused_linear_ce)
      SCOPED_TRACE(linear ? "fused linear cross-entropy" : "fused cross-entropy");
      train::Trainer plain(ParallelContext::single_process(), cfg, o);
      auto fused_cfg = cfg;
      fused_cfg.attention = ops::AttentionBackend::kFlash;
      fused_cfg.fused_norm = fused_cfg.fused_ce = fused_cfg.fused_swiglu = fused_cfg.fused_rope = true;
      fused_cfg.fused_linear_ce = linear;
      auto fo = o;
      fo.adamw.fused = true;
      train::Trainer fused(ParallelContext::single_process(), fused_cfg, fo);
      for (int s = 0; s < o.steps; ++s) {
        const auto a = plain.train_step(), b = fused.train_step();
        EXPECT_NEAR(a.loss, b.loss, 1e-4 * std::abs(a.loss)) << "step " << s;
        EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-3 * a.grad_norm) << "step " << s;
      }
      // The fused run's graph is made of the ops' Functions (a run ignoring the options
      // would match the plain one too).
      auto idx = torch::randint(0, cfg.vocab_size, {2, 16}, torch::kLong);
      auto loss = fused.model()->loss(idx, idx);
      std::set<std::string> names;
      std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
      while (!todo.empty()) {
        auto* node = todo.back();
        todo.pop_back();
        if (node == nullptr || !names.insert(node->name() + "@" + std::to_string(reinterpret_cast<std::uintptr_t>(node))).second) continue;
        for (const auto& e : node->next_edges()) todo.push_back(e.function.get());
      }
      std::string all;
      for (const auto& n : names) all += n + "\n";
      std::vector<const char*> fns = {"FlashAttentionFn", "NormFn", linear ? "LinearCrossEntropyFn" : "CrossEntropyFn"};
      if (family == "llama") fns.insert(fns.end(), {"SwigluFn", "RopeFn"});
      for (const char* fn : fns) {
        EXPECT_NE(all.find(fn), std::string::npos) << fn << " is not in the fused model's graph";
      }
      const auto pa = plain.full_parameters(), pb = fused.full_parameters();
      for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_LT(max_abs(pa[i].second, pb[i].second), 1e-4) << pa[i].first;
    }
  }
  auto cfg = models::GptConfig::preset("tiny");
  cfg.attention = ops::AttentionBackend::kFlash;
  cfg.dropout = 0.1;
  EXPECT_NO_THROW(cfg.validate()) << "flash attention has dropout";
}

}  // namespace
}  // namespace dtrain
