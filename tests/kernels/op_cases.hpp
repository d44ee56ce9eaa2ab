// The ops' test cases (src/ops: autograd Functions over the kernels), compiled twice like
// kernel_cases.hpp: on CUDA with the compiled kernels (test_kernels_gpu.cpp), and on the
// host with the CPU emulator (test_ops_emulated.cpp: the ops' own sources built with
// DTRAIN_OPS_EMULATED, where host tensors take the kernel paths). The reference is the
// same op on float64 host tensors, which always takes its reference path.
#pragma once

#include <ATen/SDPBackend.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/corpus.hpp"
#include "common/errors.hpp"
#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/ops/adamw.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/ops/cross_entropy.hpp"
#include "dtrain/ops/norm.hpp"
#include "dtrain/ops/rope.hpp"
#include "dtrain/ops/swiglu.hpp"
#include "dtrain/parallel/context.hpp"
#include "dtrain/train/trainer.hpp"
#include "kernel_device.hpp"

namespace dtrain {
namespace {

// Document numbers [batch, tokens] (int64, host) of packed documents with these lengths,
// taken in turn (wrapping) and running on across rows; and the cumulative starts of the
// documents over the rows laid end to end (FlashAttention's cu_seqlens, int32).
std::pair<at::Tensor, at::Tensor> packed_documents(std::int64_t batch, std::int64_t tokens,
                                                   const std::vector<std::int64_t>& lengths) {
  auto ids = torch::empty({batch, tokens}, torch::kLong);
  std::vector<std::int32_t> cu = {0};
  std::size_t next = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0, doc = 0; i < tokens; ++doc) {
      const std::int64_t len = std::min(lengths[next++ % lengths.size()], tokens - i);
      ids[b].narrow(0, i, len).fill_(doc);
      i += len;
      cu.push_back(static_cast<std::int32_t>(b * tokens + i));
    }
  }
  return {ids, torch::tensor(cu, torch::kInt)};
}

// The autograd op against the same op's reference path in float64 on the host: within
// twice the error of LibTorch's attention run in the same 16-bit dtype on the same device.
// The op with each kernel DTRAIN_ATTENTION_KERNEL can name here (see attention_kernels).
TEST(KERNEL_SUITE(Ops), FlashAttentionAutogradMatchesTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  if (!dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_WGMMA)) {
    env::ScopedOverride wgmma(env::kAttentionKernel, "wgmma");
    auto q = torch::randn({1, 2, 8, 64}, torch::TensorOptions().device(kernel_device()).dtype(torch::kBFloat16));
    EXPECT_THROW(ops::flash_attention(q, q, q, true), InvalidArgument) << "wgmma asked for where it cannot run";
  }
  for (auto kernel : attention_kernels()) {
  env::ScopedOverride only(env::kAttentionKernel, kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma" : "wgmma");
  SCOPED_TRACE(kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma.sync" : "wgmma");
  torch::manual_seed(11);
  // The emulator runs a block in milliseconds: fewer heads and tokens there.
  const std::int64_t nb = kLargeCases ? 2 : 1, nh = kLargeCases ? 8 : 4, nt = kLargeCases ? 300 : 70;
  // (causal, sliding window, packed documents, query offset): a window that starts inside
  // the first key tile and ends inside the last query tile's; documents of one token to
  // more than a tile; half as many queries as keys, from a quarter of the way in (a
  // context-parallel chunk: keys on both sides of the queries), alone and with the others;
  // and without causal, the window both ways within documents.
  const std::int64_t w = kLargeCases ? 100 : 23, off = nt / 4;
  const auto docs = packed_documents(nb, nt, kLargeCases ? std::vector<std::int64_t>{150, 1, 77, 40, 200}
                                                        : std::vector<std::int64_t>{20, 1, 30, 45});
  struct Mask {
    bool causal;
    std::int64_t window;
    at::Tensor documents;
    std::int64_t offset = 0;
  };
  for (const auto& mask : {Mask{true, 0, {}}, Mask{false, 0, {}}, Mask{true, w, {}}, Mask{true, 0, docs.first},
                           Mask{true, w, docs.first}, Mask{true, 0, {}, off}, Mask{true, w, docs.first, off},
                           Mask{false, w, docs.first}}) {
    const bool causal = mask.causal;
    const std::int64_t window = mask.window, nq = mask.offset > 0 ? nt / 2 : nt;
    for (std::int64_t d : {64, 128, 32, 80, 256}) {
      auto q = torch::randn({nb, nh, nq, d}), k = torch::randn({nb, 2, nt, d}), v = torch::randn({nb, 2, nt, d});
      if (!dtrain_attention_bwd_kernel_takes_head_dim(kernel, d)) {
        // A head dim wgmma's backward does not take (none today: it goes up to 256), by
        // name: a forward that will have a backward is an error naming it, before anything
        // runs; one without (no input requires grad, or grad mode off) runs wgmma's
        // forward, within twice sdpa's error as the others.
        ASSERT_TRUE(dtrain_attention_fwd_kernel_takes_head_dim(kernel, d)) << d;
        auto forward = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool sdpa) {
          const auto documents = mask.documents.defined() ? mask.documents.to(a.device()) : at::Tensor();
          auto o = sdpa ? ops::attention(a, b, c, causal, 0.0, ops::AttentionBackend::kSdpa, window, documents,
                                         mask.offset)
                        : ops::flash_attention(a, b, c, causal, 0.0, window, documents, mask.offset);
          return o.cpu().to(at::kDouble);
        };
        auto cu = [](const at::Tensor& t) { return t.to(kernel_device(), at::kBFloat16); };
        EXPECT_THROW(forward(cu(q).requires_grad_(), cu(k), cu(v), false), InvalidArgument) << "wgmma, d " << d;
        {
          torch::NoGradGuard no_grad;  // inputs that require grad, but no backward to come
          EXPECT_NO_THROW(forward(cu(q).requires_grad_(), cu(k), cu(v), false)) << "wgmma, d " << d;
        }
        const auto want = forward(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), false);
        const double e = (forward(cu(q), cu(k), cu(v), false) - want).abs().max().item<double>();
        const double base = (forward(cu(q), cu(k), cu(v), true) - want).abs().max().item<double>();
        EXPECT_LE(e, 2 * base + 1e-3) << "wgmma forward, d " << d << ": flash " << e << ", sdpa " << base;
        continue;
      }
      auto dout = torch::randn({nb, nh, nq, d});
      auto run = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& g,
                     bool sdpa) -> std::vector<at::Tensor> {
        auto qa = a.detach().requires_grad_(), kb = b.detach().requires_grad_(), vc = c.detach().requires_grad_();
        const auto documents = mask.documents.defined() ? mask.documents.to(a.device()) : at::Tensor();
        auto o = sdpa ? ops::attention(qa, kb, vc, causal, 0.0, ops::AttentionBackend::kSdpa, window, documents,
                                       mask.offset)
                      : ops::flash_attention(qa, kb, vc, causal, 0.0, window, documents, mask.offset);
        o.backward(g);
        return {o.cpu().to(at::kDouble), qa.grad().cpu().to(at::kDouble), kb.grad().cpu().to(at::kDouble),
                vc.grad().cpu().to(at::kDouble)};
      };
      const auto want = run(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), dout.to(at::kDouble), false);
      auto cu = [](const at::Tensor& t) { return t.to(kernel_device(), at::kBFloat16); };
      const auto got = run(cu(q), cu(k), cu(v), cu(dout), false);
      const auto sdpa = run(cu(q), cu(k), cu(v), cu(dout), true);  // LibTorch's own bf16 attention
      for (int i = 0; i < 4; ++i) {
        const double e = (got[i] - want[i]).abs().max().item<double>();
        const double base = (sdpa[i] - want[i]).abs().max().item<double>();
        EXPECT_LE(e, 2 * base + 1e-3) << "output " << i << " d " << d << (causal ? " causal" : "") << " window "
                                      << window << (mask.documents.defined() ? " documents" : "") << " offset "
                                      << mask.offset << ": flash " << e
                                      << ", sdpa " << base;
      }
    }
  }
  }
  for (std::int64_t d : {100, 264}) {  // not a multiple of 8; over 256
    auto q = torch::randn({1, 2, 8, d}, torch::TensorOptions().device(kernel_device()).dtype(torch::kBFloat16));
    EXPECT_THROW(ops::flash_attention(q, q, q, true), InvalidArgument) << "head dim " << d;
  }
  auto f = torch::randn({1, 2, 8, 64}, kernel_device());
  EXPECT_THROW(ops::flash_attention(f, f, f, true), InvalidArgument);  // float32 on the kernels' device
}

// A case of the dropout and soft-capping tests: causal or not, a window at a query offset,
// the head dim, D 256's compact tiles, attention dropout.
struct MaskCase {
  bool causal;
  std::int64_t window, offset, d;
  bool compact = false;
  double dropout = 0.0;
  // wgmma's forward with mma.sync's backward: what AUTO runs where wgmma's backward cannot
  // (strides its tensor maps cannot describe, a GPU of less shared memory); the backward
  // must find the forward's dropout mask and log-sum-exp.
  bool mma_backward = false;
};

// Runs body(c) on each kernel this device runs for each case: causal, full, and a window of
// w at query offset nt / 4, at head dims 64, 128 and 256, then D 256 in the compact tiles of
// GPUs of 99 KB a block (mma.sync's), wgmma's forward with mma.sync's backward at D 128
// and 256, and `extra`. Each under DTRAIN_ATTENTION_KERNEL for its kernel, the compact ones
// under the smem cap, with a trace naming the case; each kernel's cases draw from
// torch_seed afresh. body runs the op through case_run.
template <typename Body>
void for_each_mask_case(std::int64_t nt, std::int64_t w, const std::vector<MaskCase>& extra, std::uint64_t torch_seed,
                        const Body& body) {
  for (auto kernel : attention_kernels()) {
    const bool mma = kernel == DTRAIN_ATTENTION_KERNEL_MMA;
    std::vector<MaskCase> cases;
    for (std::int64_t d : {64, 128, 256}) {
      cases.push_back({true, 0, 0, d});
      cases.push_back({false, 0, 0, d});
      cases.push_back({true, w, nt / 4, d});
    }
    if (mma) cases.push_back({true, 0, 0, 256, true});
    if (!mma) {
      cases.push_back({true, 0, 0, 128, false, 0.0, true});
      cases.push_back({true, w, nt / 4, 256, false, 0.0, true});
    }
    cases.insert(cases.end(), extra.begin(), extra.end());
    torch::manual_seed(torch_seed);
    for (const auto& c : cases) {
      env::ScopedOverride only(env::kAttentionKernel, mma ? "mma" : "wgmma");
      SCOPED_TRACE(std::string(mma ? "mma.sync" : c.mma_backward ? "wgmma forward, mma.sync backward" : "wgmma") + " d " +
                   std::to_string(c.d) + (c.causal ? " causal" : "") + " window " + std::to_string(c.window) +
                   " offset " + std::to_string(c.offset) + (c.compact ? " compact" : "") +
                   (c.dropout > 0 ? " dropout" : ""));
      std::optional<ScopedAttentionSmemCap> cap;
      if (c.compact) cap.emplace(101376);
      body(c);
    }
  }
}

// o and the leaves' gradients, float64 on the host.
std::vector<at::Tensor> output_and_grads(const at::Tensor& o, const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v) {
  return {o.cpu().to(at::kDouble), q.grad().cpu().to(at::kDouble), k.grad().cpu().to(at::kDouble),
          v.grad().cpu().to(at::kDouble)};
}

// forward(q, k, v) on fresh leaves, its backward for the upstream gradient g on the kernel
// the case asks for (mma_backward: DTRAIN_ATTENTION_KERNEL=mma for it), and
// output_and_grads.
template <typename Forward>
std::vector<at::Tensor> case_run(const MaskCase& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const Forward& forward) {
  auto qa = q.detach().requires_grad_(), kb = k.detach().requires_grad_(), vc = v.detach().requires_grad_();
  const at::Tensor o = forward(qa, kb, vc);
  {
    std::optional<env::ScopedOverride> only;
    if (c.mma_backward) only.emplace(env::kAttentionKernel, "mma");
    o.backward(g);
  }
  return output_and_grads(o, qa, kb, vc);
}

// Attention dropout on the kernels: for the same seed the op's output and gradients are
// the float64 reference path's (whose mask dtrain_attention_dropout_keeps gives; the unit
// tests check that against a mask written out), within twice the error of LibTorch's bf16
// attention without dropout, times 1 / (1 - p) (the kept probabilities' scale); a mask the
// kernel got wrong differs in a quarter of the probabilities. The cases of
// for_each_mask_case, GQA: mma.sync's one-warp and split backward and its compact tiles;
// wgmma both ways at 64, 128 and 256, and its forward with mma.sync's backward, which must
// find the forward's mask.
TEST(KERNEL_SUITE(Ops), FlashAttentionDropoutMatchesTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  const auto bf16 = torch::TensorOptions().device(kernel_device()).dtype(torch::kBFloat16);
  const double p = 0.25;
  const std::uint64_t seed = 77;
  const std::int64_t nb = 1, nh = 4, nt = kLargeCases ? 300 : 70, w = kLargeCases ? 100 : 23;
  for_each_mask_case(nt, w, {}, 12, [&](const MaskCase& c) {
    const std::int64_t nq = c.offset > 0 ? nt / 2 : nt;
    auto q = torch::randn({nb, nh, nq, c.d}), k = torch::randn({nb, 2, nt, c.d}), v = torch::randn({nb, 2, nt, c.d});
    auto dout = torch::randn({nb, nh, nq, c.d});
    auto run = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& cc, const at::Tensor& g,
                   double dropout, bool sdpa) {
      return case_run(c, a, b, cc, g, [&](const at::Tensor& qa, const at::Tensor& kb, const at::Tensor& vc) {
        return sdpa ? ops::attention(qa, kb, vc, c.causal, 0.0, ops::AttentionBackend::kSdpa, c.window, {}, c.offset)
                    : ops::flash_attention(qa, kb, vc, c.causal, 0.0, c.window, {}, c.offset, dropout, seed);
      });
    };
    auto dbl = [](const at::Tensor& t) { return t.to(at::kDouble); };
    auto dev = [&](const at::Tensor& t) { return t.to(bf16); };
    const auto want = run(dbl(q), dbl(k), dbl(v), dbl(dout), p, false);
    const auto plain = run(dbl(q), dbl(k), dbl(v), dbl(dout), 0.0, false);
    const auto got = run(dev(q), dev(k), dev(v), dev(dout), p, false);
    const auto sdpa = run(dev(q), dev(k), dev(v), dev(dout), 0.0, true);
    for (int i = 0; i < 4; ++i) {
      const double e = (got[i] - want[i]).abs().max().item<double>();
      const double base = (sdpa[i] - plain[i]).abs().max().item<double>() / (1 - p);
      EXPECT_LE(e, 2 * base + 1e-3) << "output " << i << ": flash " << e << ", sdpa without dropout " << base;
      EXPECT_GT((want[i] - plain[i]).abs().max().item<double>(), 5 * (2 * base + 1e-3))
          << "output " << i << ": dropout must change more than the tolerance";
    }
  });
}

// Logit soft-capping on the kernels: the op's output and gradients against the float64
// reference path with the same cap, within twice the error of soft-capped attention written
// in LibTorch's bf16 ops (matmul, tanh, the mask, softmax, matmul; autograd), and the cap
// must move the result by far more than that. The cases of for_each_mask_case, GQA, and
// one with dropout too.
TEST(KERNEL_SUITE(Ops), FlashAttentionSoftcapMatchesTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  const auto bf16 = torch::TensorOptions().device(kernel_device()).dtype(torch::kBFloat16);
  const double cap = 2.0;
  const std::uint64_t seed = 78;
  const std::int64_t nb = 1, nh = 4, nt = kLargeCases ? 300 : 70, w = kLargeCases ? 100 : 23;
  for_each_mask_case(nt, w, {{true, 0, 0, 64, false, 0.25}}, 13, [&](const MaskCase& c) {
    const std::int64_t nq = c.offset > 0 ? nt / 2 : nt;
    auto q = torch::randn({nb, nh, nq, c.d}), k = torch::randn({nb, 2, nt, c.d}), v = torch::randn({nb, 2, nt, c.d});
    auto dout = torch::randn({nb, nh, nq, c.d});
    auto run = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& cc, const at::Tensor& g,
                   double softcap, double dropout) {
      return case_run(c, a, b, cc, g, [&](const at::Tensor& qa, const at::Tensor& kb, const at::Tensor& vc) {
        return ops::flash_attention(qa, kb, vc, c.causal, 0.0, c.window, {}, c.offset, dropout, seed, softcap);
      });
    };
    auto naive = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& cc, const at::Tensor& g) {
      return case_run(c, a, b, cc, g, [&](const at::Tensor& qa, const at::Tensor& kb, const at::Tensor& vc) {
        auto s = at::matmul(qa, kb.repeat_interleave(nh / 2, 1).transpose(-2, -1)) / std::sqrt(double(c.d));
        s = (s / cap).tanh() * cap;
        if (c.causal) {
          const auto opts = torch::TensorOptions().device(a.device()).dtype(torch::kLong);
          auto rows = torch::arange(c.offset, c.offset + nq, opts).unsqueeze(1), cols = torch::arange(nt, opts);
          auto hidden = cols.unsqueeze(0) > rows;
          if (c.window > 0) hidden = hidden.logical_or(cols.unsqueeze(0) <= rows - c.window);
          s = s.masked_fill(hidden, -std::numeric_limits<double>::infinity());
        }
        return at::matmul(at::softmax(s, -1), vc.repeat_interleave(nh / 2, 1));
      });
    };
    auto dbl = [](const at::Tensor& t) { return t.to(at::kDouble); };
    auto dev = [&](const at::Tensor& t) { return t.to(bf16); };
    const auto want = run(dbl(q), dbl(k), dbl(v), dbl(dout), cap, c.dropout);
    const auto uncapped = run(dbl(q), dbl(k), dbl(v), dbl(dout), 0.0, c.dropout);
    const auto plain = run(dbl(q), dbl(k), dbl(v), dbl(dout), cap, 0.0);
    const auto got = run(dev(q), dev(k), dev(v), dev(dout), cap, c.dropout);
    const auto base_run = naive(dev(q), dev(k), dev(v), dev(dout));
    for (int i = 0; i < 4; ++i) {
      const double e = (got[i] - want[i]).abs().max().item<double>();
      const double base = (base_run[i] - plain[i]).abs().max().item<double>() / (1 - c.dropout);
      EXPECT_LE(e, 2 * base + 1e-3) << "output " << i << ": flash " << e << ", bf16 ops " << base;
      EXPECT_GT((want[i] - uncapped[i]).abs().max().item<double>(), 5 * (2 * base + 1e-3))
          << "output " << i << ": the cap must change more than the tolerance";
    }
  });
}

// Attention sinks on the kernels: the op's output and the gradients of q, k, v and the
// sinks (learnable, bf16 like a model's parameter) against the float64 reference path with
// the same sinks, within twice the error of LibTorch's bf16 ops over [scores, sink]
// (softmax in float32); the sinks change more than the tolerance. Causal at D 64, without
// causal in a window at D 128 with more queries than keys (rows that see no key), and
// causal at D 64 with soft-capping and dropout (the reference path's mask for the same
// seed; the tolerance from LibTorch's ops without dropout, times 1 / (1 - p)), on each
// kernel.
TEST(KERNEL_SUITE(Ops), FlashAttentionSinksMatchTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  const auto bf16 = torch::TensorOptions().device(kernel_device()).dtype(torch::kBFloat16);
  torch::manual_seed(21);
  struct Case {
    bool causal;
    std::int64_t window, nq, d;
    double softcap = 0.0, dropout = 0.0;
  };
  const std::int64_t nh = 4, nk = 70;
  const std::uint64_t seed = 91;
  for (auto kernel : attention_kernels()) {
    env::ScopedOverride only(env::kAttentionKernel, kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma" : "wgmma");
    for (const auto& c : {Case{true, 0, nk, 64}, Case{false, 23, 100, 128}, Case{true, 0, nk, 64, 2.0, 0.25}}) {
      SCOPED_TRACE(std::string(kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma.sync" : "wgmma") + " d " +
                   std::to_string(c.d) + (c.causal ? " causal" : " window " + std::to_string(c.window)) +
                   (c.dropout > 0 ? " softcap, dropout" : ""));
      auto q = torch::randn({1, nh, c.nq, c.d}), k = torch::randn({1, 2, nk, c.d}), v = torch::randn({1, 2, nk, c.d});
      auto dout = torch::randn({1, nh, c.nq, c.d});
      const auto sinks = torch::randn({nh}) * 2 + 2;
      // Output and the gradients of q, k, v, sinks, float64 on the host.
      auto run = [&](const at::TensorOptions& o, bool with_sinks, bool naive, double dropout) {
        auto qa = q.to(o).requires_grad_(), kb = k.to(o).requires_grad_(), vc = v.to(o).requires_grad_();
        auto sa = sinks.to(o).requires_grad_();
        at::Tensor out;
        if (naive) {
          auto s = at::matmul(qa, kb.repeat_interleave(nh / 2, 1).transpose(-2, -1)) / std::sqrt(double(c.d));
          if (c.softcap > 0) s = (s / c.softcap).tanh() * c.softcap;
          auto rows = torch::arange(c.nq, o.dtype(torch::kLong)).unsqueeze(1), cols = torch::arange(nk, o.dtype(torch::kLong));
          auto hidden = c.causal ? cols.unsqueeze(0) > rows
                                 : (cols.unsqueeze(0) - rows).abs() >= c.window;
          s = s.masked_fill(hidden, -std::numeric_limits<double>::infinity()).to(torch::kFloat);
          s = at::cat({s, sa.to(torch::kFloat).view({1, nh, 1, 1}).expand({1, nh, c.nq, 1})}, -1);
          out = at::matmul(at::softmax(s, -1).narrow(-1, 0, nk).to(o.dtype()), vc.repeat_interleave(nh / 2, 1));
        } else {
          out = ops::flash_attention(qa, kb, vc, c.causal, 0.0, c.window, {}, 0, dropout, seed, c.softcap,
                                     with_sinks ? sa : at::Tensor());
        }
        out.backward(dout.to(o));
        auto host = [](const at::Tensor& t) { return t.defined() ? t.cpu().to(at::kDouble) : torch::zeros({1}, torch::kDouble); };
        return std::vector<at::Tensor>{host(out), host(qa.grad()), host(kb.grad()), host(vc.grad()), host(sa.grad())};
      };
      const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
      const auto want = run(f64, true, false, c.dropout), none = run(f64, false, false, c.dropout);
      const auto got = run(bf16, true, false, c.dropout);
      const auto plain = run(f64, true, false, 0.0), base_run = run(bf16, true, true, 0.0);
      for (int i = 0; i < 5; ++i) {
        const double e = (got[i] - want[i]).abs().max().item<double>();
        const double base = (base_run[i] - plain[i]).abs().max().item<double>() / (1 - c.dropout);
        // The sinks' gradient is a bf16 [heads] (the parameter's dtype): its own rounding
        // (an ulp, 2^-7 of its largest, which the ops' may happen to miss) on top.
        const double ulp = i == 4 ? want[i].abs().max().item<double>() / 128 : 0.0;
        EXPECT_LE(e, 2 * base + ulp + 1e-3) << "output " << i << ": flash " << e << ", bf16 ops " << base;
        if (i < 4) {
          EXPECT_GT((want[i] - none[i]).abs().max().item<double>(), 5 * (2 * base + 1e-3))
              << "output " << i << ": the sinks must change more than the tolerance";
        }
      }
    }
  }
}

// Flash attention's two passes on blocks of keys, as ring attention (context parallelism,
// --cp-comm p2p) uses them: causal attention over 3 chunks of L tokens as a block per pair
// of chunks (query chunk c over key chunk c' <= c, at query offset (c - c') L: the
// diagonals, and whole blocks of earlier keys), merged by the blocks' log-sum-exp (a row
// that sees no key of a block adds nothing), and each block's backward run from the merged
// output and log-sum-exp, its gradients summed: output and gradients within twice the
// error of LibTorch's bf16 attention over the whole, against float64, on each kernel. Also
// with a window of L keys (the pair 2 chunks apart skipped, as the ring skips it) and
// packed documents (each block given the numbers of its tokens from its keys' first to its
// queries' last).
TEST(KERNEL_SUITE(Ops), FlashAttentionBlocksMergeToTheWhole) {
  KERNEL_DEVICE_OR_SKIP();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (auto kernel : attention_kernels()) {
    env::ScopedOverride only(env::kAttentionKernel, kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma" : "wgmma");
    SCOPED_TRACE(kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma.sync" : "wgmma");
    torch::manual_seed(12);
    const std::int64_t nb = kLargeCases ? 2 : 1, nh = 4, L = kLargeCases ? 150 : 35, d = 64, T = 3 * L;
    const auto docs = packed_documents(nb, T, kLargeCases ? std::vector<std::int64_t>{90, 1, 200, 40}
                                                         : std::vector<std::int64_t>{20, 1, 45, 12}).first;
    for (const bool masked : {false, true}) {
      SCOPED_TRACE(masked ? "window and documents" : "causal");
      const std::int64_t window = masked ? L : 0;
      const ops::Documents documents = masked ? ops::Documents(docs.to(kernel_device())) : ops::Documents();
      auto q = torch::randn({nb, nh, T, d}), k = torch::randn({nb, 2, T, d}), v = torch::randn({nb, 2, T, d});
      auto dout = torch::randn({nb, nh, T, d});
      struct Block {
        std::int64_t row, col;  // the query chunk's and the key chunk's first token
      };
      std::vector<Block> blocks;
      for (std::int64_t c = 0; c < 3; ++c) {
        for (std::int64_t c2 = 0; c2 <= c; ++c2) {
          if (window == 0 || (c - c2) * L - (L - 1) < window) blocks.push_back({c * L, c2 * L});
        }
      }
      auto block_docs = [&](const Block& b) {
        return masked ? documents.slice(b.col, b.row - b.col + L) : ops::Documents();
      };
      auto cu = [](const at::Tensor& t) { return t.to(kernel_device(), at::kBFloat16); };
      const auto qd = cu(q), kd = cu(k), vd = cu(v), dd = cu(dout);
      auto o = torch::zeros(q.sizes(), torch::kFloat);
      auto lse = torch::full({nb, nh, T}, -kInf, torch::kFloat);
      for (const auto& b : blocks) {
        const auto [ob, lb] = ops::flash_attention_forward(qd.narrow(2, b.row, L), kd.narrow(2, b.col, L),
                                                           vd.narrow(2, b.col, L), true, 0.0, window, block_docs(b),
                                                           b.row - b.col);
        auto rows_o = o.narrow(2, b.row, L), rows_lse = lse.narrow(2, b.row, L);
        const auto l = lb.cpu().to(at::kFloat).masked_fill(lb.cpu() == kInf, -kInf);
        const auto merged = at::logaddexp(rows_lse, l), base = merged.masked_fill(merged == -kInf, 0.0);
        rows_o.copy_(rows_o * (rows_lse - base).exp().unsqueeze(-1) +
                     ob.cpu().to(at::kFloat) * (l - base).exp().unsqueeze(-1));
        rows_lse.copy_(merged);
      }
      const auto od = cu(o), lsed = lse.to(kernel_device());
      auto dq = torch::zeros(q.sizes(), torch::kDouble), dk = torch::zeros(k.sizes(), torch::kDouble);
      auto dv = torch::zeros(v.sizes(), torch::kDouble);
      for (const auto& b : blocks) {
        const auto g = ops::flash_attention_backward(qd.narrow(2, b.row, L), kd.narrow(2, b.col, L),
                                                     vd.narrow(2, b.col, L), od.narrow(2, b.row, L),
                                                     lsed.narrow(2, b.row, L), dd.narrow(2, b.row, L), true, 0.0,
                                                     window, block_docs(b), b.row - b.col);
        dq.narrow(2, b.row, L).add_(g[0].cpu().to(at::kDouble));
        dk.narrow(2, b.col, L).add_(g[1].cpu().to(at::kDouble));
        dv.narrow(2, b.col, L).add_(g[2].cpu().to(at::kDouble));
      }
      auto whole = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& g, bool sdpa) {
        auto qa = a.detach().requires_grad_(), kb = b.detach().requires_grad_(), vc = c.detach().requires_grad_();
        const ops::Documents dm = masked ? ops::Documents(docs.to(a.device())) : ops::Documents();
        auto out = sdpa ? ops::attention(qa, kb, vc, true, 0.0, ops::AttentionBackend::kSdpa, window, dm)
                        : ops::flash_attention(qa, kb, vc, true, 0.0, window, dm);
        out.backward(g);
        return std::vector<at::Tensor>{out.cpu().to(at::kDouble), qa.grad().cpu().to(at::kDouble),
                                       kb.grad().cpu().to(at::kDouble), vc.grad().cpu().to(at::kDouble)};
      };
      const auto want = whole(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), dout.to(at::kDouble), false);
      const auto sdpa = whole(qd, kd, vd, dd, true);
      const std::vector<at::Tensor> got = {o.to(at::kBFloat16).to(at::kDouble), dq, dk, dv};
      for (int i = 0; i < 4; ++i) {
        const double e = (got[i] - want[i]).abs().max().item<double>();
        const double base = (sdpa[i] - want[i]).abs().max().item<double>();
        EXPECT_LE(e, 2 * base + 1e-3) << "output " << i << ": blocks " << e << ", sdpa " << base;
      }
    }
  }
  auto q = torch::randn({1, 2, 8, 16}, torch::kDouble);
  testing::expect_has(
      testing::error_message([&] { ops::flash_attention_backward(q, q, q, q, torch::zeros({1, 2, 7}), q, true); }),
      {"lse must be [batch, heads, seq_q] = [1, 2, 8]", "[1, 2, 7]"});
}

#ifdef DTRAIN_KERNELS_EMULATE
// On a device that gives a block less shared memory than a head dim's kernels need (the
// emulated device set to 80 KB: less than the 99 KB that D 256's compact tiles take; no
// sm_80 or later GPU gives so little), the head dim is an error naming it, the bytes and
// the head dims that fit, before anything runs; a forward alone is checked for its own
// kernel only. Head dim 128 still trains. (mma.sync: wgmma's GPUs give 227 KB.)
TEST(KERNEL_SUITE(Ops), FlashAttentionHeadDimsBeyondTheGpusSharedMemoryAreAnError) {
  const ScopedBlockSmemLimit limit(80 * 1024);
  env::ScopedOverride mma(env::kAttentionKernel, "mma");
  const auto options = torch::TensorOptions().device(kernel_device()).dtype(torch::kBFloat16);
  for (std::int64_t d : {256, 136}) {
    auto q = torch::randn({1, 2, 8, d}, options);
    const std::string message = testing::error_message([&] {
      auto qg = q.detach().requires_grad_();
      ops::flash_attention(qg, q, q, true);
    });
    testing::expect_has(message, {"head_dim " + std::to_string(d) + ": the ", "kernel needs ",
                                  "bytes of shared memory per block and this GPU gives a block 81920",
                                  "allowed here: head_dim up to 128", "--attention sdpa"});
    EXPECT_THROW(ops::flash_attention(q, q, q, true), InvalidArgument) << "the forward alone, d " << d;
  }
  auto q = torch::randn({1, 2, 8, 128}, options).requires_grad_();
  ops::flash_attention(q, q, q, true).sum().backward();
  EXPECT_TRUE(q.grad().isfinite().all().item<bool>());
  {  // 99 KB (compute capability 8.6, 8.9): D 256 trains in its compact tiles
    const ScopedBlockSmemLimit limit99(99 * 1024);
    auto q256 = torch::randn({1, 2, 8, 256}, options).requires_grad_();
    ops::flash_attention(q256, q256, q256, true).sum().backward();
    EXPECT_TRUE(q256.grad().isfinite().all().item<bool>());
  }
}
#endif

// Attention on q, k, v [B, H, S, D] as a function of the three (inputs requiring grad).
using AttentionFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;

// dtrain's op (`ours`) and LibTorch's FlashAttention-2 (`fa2`) against ours on float64 host
// tensors (the op's reference path), output and the three gradients for the upstream
// gradient dout: each within twice the error of sdpa with the same mask (`sdpa_mask`), all
// three in bf16 on the kernels' device.
void expect_op_and_fa2_match_the_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& dout, const AttentionFn& ours,
                                           const AttentionFn& sdpa_mask, const AttentionFn& fa2) {
  auto run = [&](const AttentionFn& f, bool reference) -> std::vector<at::Tensor> {
    auto in = [&](const at::Tensor& t) {
      return (reference ? t.to(at::kDouble) : t.to(kernel_device(), at::kBFloat16)).requires_grad_();
    };
    auto qa = in(q), kb = in(k), vc = in(v);
    auto o = f(qa, kb, vc);
    o.backward(reference ? dout.to(at::kDouble) : dout.to(kernel_device(), at::kBFloat16));
    return {o.cpu().to(at::kDouble), qa.grad().cpu().to(at::kDouble), kb.grad().cpu().to(at::kDouble),
            vc.grad().cpu().to(at::kDouble)};
  };
  const auto want = run(ours, true), got = run(ours, false), mask = run(sdpa_mask, false), lib = run(fa2, false);
  for (int i = 0; i < 4; ++i) {
    const double base = (mask[i] - want[i]).abs().max().item<double>();
    EXPECT_LE((lib[i] - want[i]).abs().max().item<double>(), 2 * base + 1e-3) << "FlashAttention-2, output " << i;
    EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 2 * base + 1e-3) << "dtrain, output " << i;
  }
}

// The window's convention is FlashAttention's window_size (W - 1, 0), or without causal
// (W - 1, W - 1): on CUDA, LibTorch's FlashAttention-2 run with it computes the function of
// the op's float64 reference path (within twice the error of sdpa with the window as a
// mask), output and gradients. A window of 8 keys makes one key more or less a large
// change.
TEST(KERNEL_SUITE(Ops), FlashAttentionWindowIsFlashAttention2sWindowSize) {
  KERNEL_DEVICE_OR_SKIP();
  if (!kernel_device().is_cuda()) GTEST_SKIP() << "LibTorch's FlashAttention-2 runs on CUDA only";
  torch::manual_seed(13);
  for (const auto& cw : std::vector<std::pair<bool, std::int64_t>>{{true, 8}, {true, 100}, {false, 8}, {false, 100}}) {
    const bool causal = cw.first;
    const std::int64_t w = cw.second;
    SCOPED_TRACE(std::string(causal ? "causal" : "both ways") + " window " + std::to_string(w));
    auto q = torch::randn({2, 4, 300, 64}), k = torch::randn({2, 4, 300, 64}), v = torch::randn({2, 4, 300, 64});
    expect_op_and_fa2_match_the_reference(
        q, k, v, torch::randn({2, 4, 300, 64}),
        [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          return ops::flash_attention(a, b, c, causal, 0.0, w);
        },
        [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          return ops::attention(a, b, c, causal, 0.0, ops::AttentionBackend::kSdpa, w);
        },
        [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          auto t = [](const at::Tensor& x) { return x.transpose(1, 2); };
          return std::get<0>(at::_flash_attention_forward(t(a), t(b), t(c), std::nullopt, std::nullopt, 300, 300, 0.0,
                                                          causal, false, std::nullopt, w - 1, causal ? 0 : w - 1))
              .transpose(1, 2);
        });
  }
}

// Packed documents are FlashAttention's varlen attention over the rows laid end to end
// (cu_seqlens at the documents' starts), causal and not: on CUDA, LibTorch's
// FlashAttention-2 run so computes the function of the op's float64 reference path (within
// twice the error of sdpa with the documents as a mask), output and gradients.
TEST(KERNEL_SUITE(Ops), FlashAttentionDocumentsAreFlashAttention2sVarlen) {
  KERNEL_DEVICE_OR_SKIP();
  if (!kernel_device().is_cuda()) GTEST_SKIP() << "LibTorch's FlashAttention-2 runs on CUDA only";
  torch::manual_seed(14);
  const std::int64_t B = 2, H = 4, T = 300, D = 64;
  const auto packed_docs = packed_documents(B, T, {1, 90, 7, 130, 64, 33});
  const at::Tensor &documents = packed_docs.first, &cu_seqlens = packed_docs.second;
  std::int64_t longest = 0;
  for (std::int64_t i = 1; i < cu_seqlens.size(0); ++i) {
    longest = std::max<std::int64_t>(longest, cu_seqlens[i].item<std::int64_t>() - cu_seqlens[i - 1].item<std::int64_t>());
  }
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    expect_op_and_fa2_match_the_reference(
        torch::randn({B, H, T, D}), torch::randn({B, H, T, D}), torch::randn({B, H, T, D}), torch::randn({B, H, T, D}),
        [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          return ops::flash_attention(a, b, c, causal, 0.0, 0, documents.to(a.device()));
        },
        [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          return ops::attention(a, b, c, causal, 0.0, ops::AttentionBackend::kSdpa, 0, documents.to(a.device()));
        },
        [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {  // [B T, H, D], the rows end to end
          auto packed = [&](const at::Tensor& x) { return x.transpose(1, 2).reshape({B * T, H, D}); };
          const auto cu = cu_seqlens.to(kernel_device());
          return std::get<0>(at::_flash_attention_forward(packed(a), packed(b), packed(c), cu, cu, longest, longest,
                                                          0.0, causal, false))
              .view({B, T, H, D})
              .transpose(1, 2);
        });
  }
}

// flash_attention_varlen is attention over each packed sequence alone, causal and not:
// output and gradients of the op on float64 host tensors (its reference path) are
// flash_attention's run sequence by sequence (1e-10), and in bf16 on the kernels within
// twice the error of sdpa run sequence by sequence (a sequence of one token, GQA 4/2); with
// attention sinks, each sequence's softmax takes them (the reference path). Bad inputs are
// named.
TEST(KERNEL_SUITE(Ops), FlashAttentionVarlenIsPerSequenceAttention) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(23);
  const std::vector<std::int64_t> lengths =
      kLargeCases ? std::vector<std::int64_t>{300, 1, 513, 90, 64} : std::vector<std::int64_t>{37, 1, 64, 90};
  const std::int64_t H = 4, Hkv = 2, D = 64;
  std::vector<std::int32_t> bounds = {0};
  for (auto n : lengths) bounds.push_back(bounds.back() + static_cast<std::int32_t>(n));
  const std::int64_t total = bounds.back();
  const auto cu = torch::tensor(bounds, torch::kInt);
  const auto q = torch::randn({total, H, D}), k = torch::randn({total, Hkv, D}), v = torch::randn({total, Hkv, D}),
             dout = torch::randn({total, H, D});
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    const AttentionFn varlen = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
      return ops::flash_attention_varlen(a, b, c, cu.to(a.device()), causal);
    };
    auto per_sequence = [&](ops::AttentionBackend backend) -> AttentionFn {
      return [&, backend](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
        std::vector<at::Tensor> outs;
        for (std::size_t i = 0; i + 1 < bounds.size(); ++i) {
          auto seq = [&](const at::Tensor& t) {  // [1, heads, length, D]
            return t.narrow(0, bounds[i], bounds[i + 1] - bounds[i]).unsqueeze(0).transpose(1, 2);
          };
          outs.push_back(ops::attention(seq(a), seq(b), seq(c), causal, 0.0, backend).transpose(1, 2).squeeze(0));
        }
        return at::cat(outs, 0);
      };
    };
    auto run = [&](const AttentionFn& f, bool reference) {
      auto in = [&](const at::Tensor& t) {
        return (reference ? t.to(at::kDouble) : t.to(kernel_device(), at::kBFloat16)).requires_grad_();
      };
      auto qa = in(q), kb = in(k), vc = in(v);
      const auto o = f(qa, kb, vc);
      o.backward(reference ? dout.to(at::kDouble) : dout.to(kernel_device(), at::kBFloat16));
      return output_and_grads(o, qa, kb, vc);
    };
    const auto want = run(varlen, true), each = run(per_sequence(ops::AttentionBackend::kFlash), true);
    const auto got = run(varlen, false), sdpa = run(per_sequence(ops::AttentionBackend::kSdpa), false);
    for (int i = 0; i < 4; ++i) {
      EXPECT_LT((want[i] - each[i]).abs().max().item<double>(), 1e-10) << "reference path, output " << i;
      const double base = (sdpa[i] - want[i]).abs().max().item<double>();
      EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 2 * base + 1e-3) << "kernel, output " << i;
    }
  }
  {  // Attention sinks join each sequence's softmax: the reference path's output and the
     // gradients, the sinks' among them, are per-sequence flash_attention's (1e-10).
    const auto sinks = torch::randn({H}, torch::kDouble) + 1;
    auto run_sinks = [&](bool packed) {
      auto qa = q.to(at::kDouble).requires_grad_(), kb = k.to(at::kDouble).requires_grad_(),
           vc = v.to(at::kDouble).requires_grad_(), sa = sinks.clone().requires_grad_();
      at::Tensor o;
      if (packed) {
        o = ops::flash_attention_varlen(qa, kb, vc, cu, true, 0.0, 0, 0.0, 0.0, sa);
      } else {
        std::vector<at::Tensor> outs;
        for (std::size_t i = 0; i + 1 < bounds.size(); ++i) {
          auto seq = [&](const at::Tensor& t) {
            return t.narrow(0, bounds[i], bounds[i + 1] - bounds[i]).unsqueeze(0).transpose(1, 2);
          };
          outs.push_back(ops::flash_attention(seq(qa), seq(kb), seq(vc), true, 0.0, 0, {}, 0, 0.0, std::nullopt, 0.0, sa)
                             .transpose(1, 2)
                             .squeeze(0));
        }
        o = at::cat(outs, 0);
      }
      o.backward(dout.to(at::kDouble));
      return std::vector<at::Tensor>{o.detach(), qa.grad(), kb.grad(), vc.grad(), sa.grad()};
    };
    const auto packed = run_sinks(true), each = run_sinks(false);
    for (int i = 0; i < 5; ++i) {
      EXPECT_LT((packed[i] - each[i]).abs().max().item<double>(), 1e-10) << "sinks, output " << i;
    }
  }
  const auto cud = cu.to(kernel_device());
  const auto qd = q.to(kernel_device(), at::kBFloat16), kd = k.to(kernel_device(), at::kBFloat16);
  testing::expect_has(testing::error_message([&] { ops::flash_attention_varlen(qd, kd, kd, cud, false, 0.0, -16); }),
                      {"window=-16", "allowed"});
  testing::expect_has(testing::error_message([&] { ops::flash_attention_varlen(qd, kd.narrow(0, 0, 5), kd, cud); }),
                      {"k (5 tokens)", std::to_string(total)});
  testing::expect_has(testing::error_message([&] { ops::flash_attention_varlen(qd, kd, kd, cud.to(at::kFloat)); }),
                      {"cu_seqlens must be int32 or int64", "Float"});
  testing::expect_has(testing::error_message([&] { ops::flash_attention_varlen(qd.unsqueeze(0), kd, kd, cud); }),
                      {"[total, heads, head_dim]"});
}

// Grouped-query attention on the sdpa backend is sdpa's own (enable_gqa): in bf16 on the
// kernels' device, causal, a backend other than math takes it (CUDA: cuDNN or
// FlashAttention-2; the host: sdpa's CPU flash kernel); the backend is printed for the GPU
// run's log. Output and gradients against the float64 reference path, within twice the
// error of sdpa over k and v repeated per query head (the call it replaced), causal and over
// packed documents (whatever backend takes the mask).
TEST(KERNEL_SUITE(Ops), SdpaGroupedQueryAttentionIsSdpasOwn) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(17);
  const std::int64_t nb = 2, nh = 8, nkv = 2, nt = kLargeCases ? 300 : 70;
  const auto docs = packed_documents(nb, nt, {50, 1, 33, 120});
  for (bool documents : {false, true}) {
    for (std::int64_t d : {64, 128}) {
      SCOPED_TRACE(std::string(documents ? "documents" : "causal") + ", head dim " + std::to_string(d));
      auto q = torch::randn({nb, nh, nt, d}), k = torch::randn({nb, nkv, nt, d}), v = torch::randn({nb, nkv, nt, d});
      auto dout = torch::randn({nb, nh, nt, d});
      auto cu = [](const at::Tensor& t) { return t.to(kernel_device(), at::kBFloat16); };
      const ops::Documents on_device(documents ? docs.first.to(kernel_device()) : at::Tensor());
      std::optional<at::Tensor> mask;
      if (documents) mask = on_device.sdpa_mask(0, at::kBFloat16, nt, nt, kernel_device());
      const auto choice = at::_fused_sdp_choice(cu(q), cu(k), cu(v), mask, 0.0, !documents, std::nullopt, true);
      std::printf("sdpa backend for GQA %lld/%lld, head dim %lld, %s: %lld (0 math, 1 flash, 2 efficient, 3 cudnn)\n",
                  static_cast<long long>(nh), static_cast<long long>(nkv), static_cast<long long>(d),
                  documents ? "documents" : "causal", static_cast<long long>(choice));
      if (!documents) {
        EXPECT_NE(choice, static_cast<std::int64_t>(at::SDPBackend::math));
      }
      using Fn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;
      auto run = [&](const Fn& f, bool reference) -> std::vector<at::Tensor> {
        auto in = [&](const at::Tensor& t) { return (reference ? t.to(at::kDouble) : cu(t)).requires_grad_(); };
        auto qa = in(q), kb = in(k), vc = in(v);
        auto o = f(qa, kb, vc);
        o.backward(reference ? dout.to(at::kDouble) : cu(dout));
        return {o.cpu().to(at::kDouble), qa.grad().cpu().to(at::kDouble), kb.grad().cpu().to(at::kDouble),
                vc.grad().cpu().to(at::kDouble)};
      };
      const auto want = run(
          [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
            return ops::flash_attention(a, b, c, true, 0.0, 0, documents ? docs.first : at::Tensor());
          },
          true);
      const auto got = run(
          [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
            return ops::attention(a, b, c, true, 0.0, ops::AttentionBackend::kSdpa, 0, on_device);
          },
          false);
      const auto repeated = run(
          [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
            const auto group = nh / nkv;
            return at::scaled_dot_product_attention(a, b.repeat_interleave(group, 1), c.repeat_interleave(group, 1),
                                                    mask, 0.0, !documents);
          },
          false);
      for (int i = 0; i < 4; ++i) {
        const double e = (got[i] - want[i]).abs().max().item<double>();
        const double base = (repeated[i] - want[i]).abs().max().item<double>();
        EXPECT_LE(e, 2 * base + 1e-3) << "output " << i << ": sdpa's GQA " << e << ", repeated " << base;
      }
    }
  }
}

TEST(KERNEL_SUITE(Ops), NormsMatchTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(12);
  const std::vector<std::int64_t> shape = kLargeCases ? std::vector<std::int64_t>{4, 129, 768}
                                                      : std::vector<std::int64_t>{2, 9, 96};
  const auto cols = shape.back();
  for (bool layer : {false, true}) {
    auto x = torch::randn(shape).to(at::kBFloat16), w = torch::randn({cols}), b = torch::randn({cols});
    auto dy = torch::randn(shape).to(at::kBFloat16);
    auto run = [&](const at::Device& device, bool exact) {
      auto in = [&](const at::Tensor& t) { return (exact ? t.to(at::kDouble) : dev(t)).to(device).requires_grad_(); };
      auto xx = in(x), ww = in(w), bb = in(b);
      auto y = layer ? ops::layer_norm(xx, ww, bb, 1e-5) : ops::rms_norm(xx, ww, 1e-5);
      y.backward(exact ? dy.to(at::kDouble) : dev(dy));
      return std::vector<at::Tensor>{y.cpu().to(at::kDouble), xx.grad().cpu().to(at::kDouble),
                                     ww.grad().cpu().to(at::kDouble),
                                     layer ? bb.grad().cpu().to(at::kDouble) : torch::zeros({1}, at::kDouble)};
    };
    const auto want = run(at::kCPU, true), got = run(kernel_device(), false);
    for (int i = 0; i < 4; ++i) {
      const double scale = want[i].abs().max().item<double>() + 1;
      EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), 1e-2 * scale) << (layer ? "layer " : "rms ") << i;
    }
  }
}

// SwiGLU and RoPE through autograd against their reference paths in float64: the op's
// params (the contiguous copies, the [B, T, H, D] output of rope, its inverse rotation in
// the backward, per-token angles) and the gradients it hands back.
TEST(KERNEL_SUITE(Ops), SwigluAndRopeMatchTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(13);
  auto close = [](const at::Tensor& got, const at::Tensor& want, const char* what) {
    const double scale = want.abs().max().item<double>() + 1e-3;
    EXPECT_LT((got.cpu().to(at::kDouble) - want).abs().max().item<double>(), 1e-2 * scale) << what;
  };
  for (int layout = 0; layout < 3; ++layout) {
    // contiguous (one row of every element); gate a transposed view (rows copied); gate
    // and up the two halves of one fused matrix (strided rows, no copy)
    SCOPED_TRACE(layout == 0 ? "swiglu, contiguous" : layout == 1 ? "swiglu, gate transposed" : "swiglu, halves");
    const std::vector<std::int64_t> shape = kLargeCases ? std::vector<std::int64_t>{4, 129, 2752}
                                                        : std::vector<std::int64_t>{2, 9, 40};
    const auto cols = shape[2];
    auto both = (torch::randn({shape[0], shape[1], 2 * cols}) * 3).to(at::kBFloat16);
    auto dy = torch::randn(shape).to(at::kBFloat16);
    auto run = [&](bool exact) {
      auto whole = (exact ? both.to(at::kDouble) : dev(both)).requires_grad_();
      at::Tensor gg, uu;
      if (layout == 2) {
        gg = whole.narrow(2, 0, cols), uu = whole.narrow(2, cols, cols);
      } else {
        gg = whole.narrow(2, 0, cols).contiguous(), uu = whole.narrow(2, cols, cols).contiguous();
        if (layout == 1) gg = gg.transpose(0, 1).contiguous().transpose(0, 1);
      }
      auto y = ops::swiglu(gg, uu);
      EXPECT_EQ(y.scalar_type(), exact ? at::kDouble : at::kBFloat16);
      EXPECT_EQ(y.sizes(), gg.sizes());
      y.backward(exact ? dy.to(at::kDouble) : dev(dy));
      return std::vector<at::Tensor>{y.cpu().to(at::kDouble), whole.grad().cpu().to(at::kDouble)};
    };
    const auto want = run(true), got = run(false);
    close(got[0], want[0], "swiglu y");
    close(got[1], want[1], "swiglu dgate, dup");
  }
  for (bool per_token : {false, true}) {
    SCOPED_TRACE(per_token ? "rope, per-token angles" : "rope, angle rows");
    const std::int64_t B = 2, H = kLargeCases ? 8 : 3, T = kLargeCases ? 257 : 11, D = 64;
    // q as the model makes it: [B, T, H, D] storage seen as [B, H, T, D]
    auto x = torch::randn({B, T, H, D}).to(at::kBFloat16).permute({0, 2, 1, 3});
    auto dy = torch::randn({B, H, T, D}).to(at::kBFloat16);
    auto angles = per_token ? torch::rand({B, 1, T, D / 2}) * 30 : torch::rand({T + 5, D / 2}) * 30;
    auto run = [&](bool exact) {
      auto to = [&](const at::Tensor& t) { return exact ? t.to(at::kDouble) : dev(t); };
      auto xx = to(x).requires_grad_();
      auto y = ops::rope(xx, to(angles.cos()), to(angles.sin()));
      EXPECT_EQ(y.sizes(), x.sizes());
      EXPECT_EQ(y.permute({0, 2, 1, 3}).is_contiguous(), true) << "stored as [B, T, H, D]";
      y.backward(to(dy));
      return std::vector<at::Tensor>{y.cpu().to(at::kDouble), xx.grad().cpu().to(at::kDouble)};
    };
    const auto want = run(true), got = run(false);
    close(got[0], want[0], "rope y");
    close(got[1], want[1], "rope dx");
  }
}

// linear_cross_entropy in bf16 (the loss kernel per chunk, its gradient in place) against
// its float64 reference path: loss and both gradients, chunks that do not divide the rows,
// ignored rows, an upstream gradient other than the announced one.
TEST(KERNEL_SUITE(Ops), LinearCrossEntropyMatchesTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(14);
  const std::int64_t N = kLargeCases ? 1000 : 45, d = 64, V = kLargeCases ? 5003 : 301;
  auto h = torch::randn({N, d}).to(at::kBFloat16), w = (torch::randn({V, d}) * 0.2).to(at::kBFloat16);
  auto t = torch::randint(0, V, {N}, torch::kLong);
  t.narrow(0, 3, 7).fill_(-100);
  auto run = [&](bool exact, std::int64_t chunk) {
    auto to = [&](const at::Tensor& x) { return (exact ? x.to(at::kDouble) : dev(x)).requires_grad_(); };
    auto hh = to(h), ww = to(w);
    ops::CrossEntropyOptions o;
    o.grad_scale = 0.5;
    auto loss = ops::linear_cross_entropy(hh, ww, exact ? t : dev(t), o, chunk);
    (loss * 0.25).backward();
    return std::vector<at::Tensor>{loss.detach().cpu().to(at::kDouble), hh.grad().cpu().to(at::kDouble),
                                   ww.grad().cpu().to(at::kDouble)};
  };
  const auto want = run(true, 0);
  for (std::int64_t chunk : {std::int64_t{16}, N}) {
    SCOPED_TRACE("chunk rows " + std::to_string(chunk));
    const auto got = run(false, chunk);
    for (int i = 0; i < 3; ++i) {
      const double scale = want[i].abs().max().item<double>() + 1e-6;
      EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), 2e-2 * scale) << "output " << i;
    }
  }
}

// The cross-entropy op writes the gradient in its forward for the upstream gradient it is
// told: told right (2), told wrong (the default 1: the backward rescales), in place, and
// graphs that backpropagate twice (2, then 3: the gradients add up to 5 times the unit
// one) and three times into a leaf's .grad.
TEST(KERNEL_SUITE(Ops), CrossEntropyMatchesTheReferencePath) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(13);
  // Rows of 50304 (and 1008) take the kernels' 16-byte accesses, 1003 one element each.
  const std::int64_t rows = kLargeCases ? 257 : 37;
  for (std::int64_t vocab : kLargeCases ? std::vector<std::int64_t>{50304} : std::vector<std::int64_t>{1003, 1008}) {
    auto logits = (torch::randn({rows, vocab}) * 2).to(at::kBFloat16);
    auto target = torch::randint(0, vocab, {rows}, torch::kLong);
    target[0] = -100;
    struct Case {
      const char* name;
      double told;
      bool in_place;
      std::vector<double> upstream;  // one backward each, the graph retained between
    };
    for (const Case& c : {Case{"told", 2, false, {2}}, Case{"untold", 1, false, {2}}, Case{"in place", 2, true, {2}},
                          Case{"twice", 2, true, {2, 3}}, Case{"thrice", 1, false, {3, 0.5, 2}}}) {
      SCOPED_TRACE(std::string(c.name) + " vocab " + std::to_string(vocab));
      auto run = [&](const at::Device& device, bool exact) {
        auto l = (exact ? logits.to(at::kDouble) : dev(logits)).to(device).requires_grad_();
        ops::CrossEntropyOptions o;
        o.grad_scale = c.told;
        o.in_place = c.in_place;
        auto loss = ops::cross_entropy(l, target.to(device), o);
        // Each backward's gradient as a hook sees it, and a copy taken right then: one
        // handed out stays as it was through the later backwards.
        std::vector<at::Tensor> seen, then;
        l.register_hook([&](const at::Tensor& g) { seen.push_back(g); });
        for (std::size_t i = 0; i < c.upstream.size(); ++i) {
          (loss * c.upstream[i]).backward({}, /*retain_graph=*/i + 1 < c.upstream.size());
          then.push_back(seen.back().clone());
        }
        for (std::size_t i = 0; i < seen.size(); ++i) EXPECT_TRUE(torch::equal(seen[i], then[i])) << i;
        return std::make_pair(loss.item<double>(), l.grad().cpu().to(at::kDouble));
      };
      const auto want = run(at::kCPU, true), got = run(kernel_device(), false);
      EXPECT_NEAR(got.first, want.first, 1e-4 * want.first);
      // Gradients up to (sum of upstream) / (rows - 1); a bfloat16 rounding of those is
      // 2^-9 of that. Allow eight (the forward's, the rescale's, each accumulation's into
      // the bfloat16 .grad); a wrong factor is off by a sixth of the largest at least.
      double total = 0;
      for (double u : c.upstream) total += u;
      EXPECT_LT((got.second - want.second).abs().max().item<double>(), 8 * total / (rows - 1) / 512);
      EXPECT_EQ(got.second[0].abs().sum().item<double>(), 0.0);
    }
  }
  auto logits = (torch::randn({rows, 1008}) * 2).to(at::kBFloat16);
  auto target = dev(torch::randint(0, 1008, {rows}, torch::kLong));
  ops::CrossEntropyOptions in_place;
  in_place.in_place = true;
  // Logits that are not a leaf (a matmul's output through reshapes, as in the model), in
  // place, three backwards through a retained graph: the matmul's gradients.
  {
    auto h = torch::randn({rows, 16}), w = torch::randn({1008, 16});
    auto grads = [&](const at::Device& device, at::ScalarType type) {
      auto hh = h.to(device, type, false, true).requires_grad_(), ww = w.to(device, type, false, true).requires_grad_();
      ops::CrossEntropyOptions o = in_place;
      o.grad_scale = 2;
      auto loss = ops::cross_entropy(at::matmul(hh, ww.t()).reshape({1, rows, 1008}).reshape({rows, 1008}),
                                     target.to(device), o);
      for (double u : {2.0, 2.0, 5.0}) (loss * u).backward({}, /*retain_graph=*/true);
      return std::make_pair(hh.grad().cpu().to(at::kDouble), ww.grad().cpu().to(at::kDouble));
    };
    const auto want = grads(at::kCPU, at::kDouble), got = grads(kernel_device(), at::kFloat);
    EXPECT_LT((got.first - want.first).abs().max().item<double>(), 1e-4);
    EXPECT_LT((got.second - want.second).abs().max().item<double>(), 1e-4);
  }
  // In place, the logits are gone: a graph that saved them fails in its backward instead
  // of reading the gradient.
  {
    auto l = dev(logits.to(at::kFloat)).requires_grad_();
    auto a = l * 1;
    auto side = a.sin().sum();  // saves a
    auto loss = ops::cross_entropy(a, target, in_place);
    EXPECT_THROW((loss + side).backward(), c10::Error);
  }
  // Without grad mode nothing is written, in place or not.
  {
    torch::NoGradGuard no_grad;
    auto kept = dev(logits).requires_grad_();
    ops::cross_entropy(kept, target, in_place);
    EXPECT_TRUE(torch::equal(kept.detach().cpu(), logits));
  }
  // Column-strided logits: the op's contiguous copy takes the gradient; the caller's stay.
  {
    auto l = dev(logits.to(at::kFloat)).t().contiguous().t().requires_grad_();
    const auto before = l.detach().clone();
    ops::cross_entropy(l, target, in_place).backward();
    EXPECT_TRUE(torch::equal(l.detach(), before));
    auto ref = logits.to(at::kDouble).requires_grad_();
    ops::cross_entropy(ref, target.cpu()).backward();
    EXPECT_LT((l.grad().cpu().to(at::kDouble) - ref.grad()).abs().max().item<double>(), 1e-6);
  }
}

// Shards of `per` columns of the first `vocab` columns of whole (float64, [rows, >= vocab]):
// each one's exact statistics [2, rows], the log-sum-exp over its ids and the target's
// logit where it holds the target, else 0.
std::vector<at::Tensor> shard_statistics(const at::Tensor& whole, const at::Tensor& target, std::int64_t per,
                                         std::int64_t shards, std::int64_t vocab) {
  std::vector<at::Tensor> out;
  for (std::int64_t r = 0; r < shards; ++r) {
    const auto cols = std::min(per, vocab - r * per);
    auto x = whole.detach().narrow(1, r * per, cols);
    const auto local = target - r * per, inside = (local >= 0) & (local < cols);
    out.push_back(torch::stack(
        {x.logsumexp(1), x.gather(1, local.clamp(0, cols - 1).unsqueeze(1)).squeeze(1).masked_fill(~inside, 0)}));
  }
  return out;
}

// Rank r's exchange (CrossEntropyOptions::combine): its own statistics among the others'
// exact ones, merged as the ranks' all-gather and reduction would.
std::function<at::Tensor(const at::Tensor&)> exchange_with(const std::vector<at::Tensor>& exact, std::int64_t r) {
  return [exact, r](const at::Tensor& mine) {
    EXPECT_EQ(mine.sizes(), exact[r].sizes());
    auto all = exact;
    all[r] = mine.cpu().to(at::kDouble);
    auto st = torch::stack(all);
    return torch::stack({st.select(1, 0).logsumexp(0), st.select(1, 1).sum(0)}).to(mine.options());
  };
}

// PaLM's z-loss (options.z_loss): each row's loss gains z lse^2, its gradient softmax
// 2 z lse, against LibTorch's cross-entropy plus that term in float64 with autograd: on
// the reference path (float64) and the kernel (bf16), whole and over a vocabulary split
// in 2 (the kernel's second call uses the whole vocabulary's lse), and through the fused
// linear cross-entropy; ignored rows add nothing. A z of 0.05 makes the term about a
// third of the loss; a negative or non-finite z is refused, naming the option.
TEST(KERNEL_SUITE(Ops), CrossEntropyZLossIsPalms) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(19);
  const std::int64_t rows = 29, vocab = 1008, half = vocab / 2;
  const double z = 0.05;
  auto logits = (torch::randn({rows, vocab}) * 2 + 1).to(at::kBFloat16);
  auto target = torch::randint(0, vocab, {rows}, torch::kLong);
  target[4] = -100;
  const auto valid = target != -100;
  auto whole = logits.to(at::kDouble).requires_grad_();
  const auto want = at::cross_entropy_loss(whole, target, {}, at::Reduction::Mean, -100) +
                    z * (whole.logsumexp(1).square() * valid).sum() / valid.sum();
  (want * 3).backward();
  auto check = [&](double loss, const at::Tensor& grad, bool exact, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_NEAR(loss, want.item<double>(), exact ? 1e-10 : 2e-3 * want.item<double>());
    // bf16 gradients up to 3 (1 + 2 z lse) / (rows - 1), 1 + 2 z lse below 3 here (lse
    // about 10): allow four roundings of 2^-9 of that.
    const double tol = exact ? 1e-12 : 4 * 3.0 * 3.0 / (rows - 1) / 512;
    EXPECT_LT((grad.cpu().to(at::kDouble) - whole.grad()).abs().max().item<double>(), tol);
    EXPECT_EQ(grad[4].abs().sum().item<double>(), 0.0) << "an ignored row";
  };
  for (bool exact : {true, false}) {
    const std::string path = exact ? "float64" : "bf16";
    auto input = [&](const at::Tensor& t) { return (exact ? t.to(at::kDouble) : dev(t)).requires_grad_(); };
    ops::CrossEntropyOptions o;
    o.z_loss = z;
    o.grad_scale = 3;
    {
      auto l = input(logits);
      auto loss = ops::cross_entropy(l, target.to(l.device()), o);
      (loss * 3).backward();
      check(loss.item<double>(), l.grad(), exact, path + " whole");
    }
    {  // two shards, each call with the other's exact statistics as its exchange
      const auto stats = shard_statistics(whole, target, half, 2, vocab);
      at::Tensor grad = torch::zeros({rows, vocab}, torch::kDouble);
      double loss = 0;
      for (std::int64_t r = 0; r < 2; ++r) {
        auto l = input(logits.narrow(1, r * half, half).contiguous());
        auto so = o;
        so.vocab_start = r * half;
        so.vocab_size = vocab;
        so.combine = exchange_with(stats, r);
        auto out = ops::cross_entropy(l, target.to(l.device()), so);
        (out * 3).backward();
        loss = out.item<double>();
        grad.narrow(1, r * half, half).copy_(l.grad().cpu().to(at::kDouble));
      }
      check(loss, grad, exact, path + " split in 2");
    }
    {  // the fused linear form: logits = h w^T of an exact factorisation (w the identity)
      auto h = input(logits);
      auto w = exact ? torch::eye(vocab, torch::kDouble) : dev(torch::eye(vocab).to(at::kBFloat16));
      auto loss = ops::linear_cross_entropy(h, w, target.to(h.device()), o, /*chunk_rows=*/8);
      (loss * 3).backward();
      check(loss.item<double>(), h.grad(), exact, path + " linear, chunks of 8 rows");
    }
  }
  for (double bad : {-1e-4, std::nan(""), std::numeric_limits<double>::infinity()}) {
    ops::CrossEntropyOptions o;
    o.z_loss = bad;
    testing::expect_has(testing::error_message([&] { ops::cross_entropy(logits.to(at::kFloat), target, o); }),
                        {"z_loss is ", "allowed: finite and >= 0"});
  }
}

// The op over a vocabulary split across 3 ranks (padded to a multiple of 3: the last
// shard's last columns are padding), each rank's call on its own: its combine adds the
// other shards' statistics, computed here in float64 from the same logits, as the ranks'
// exchange would. Loss and each shard's gradient against the unsplit op in float64;
// padding gets 0; an upstream gradient told and not, in place and not; the split on the
// reference path too (float64); a rank holding padding alone; a target past the
// vocabulary NaN on the kernel path and refused on the reference path; the split options
// refused without combine.
TEST(KERNEL_SUITE(Ops), CrossEntropySplitVocabularyIsTheWhole) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(17);
  const std::int64_t rows = kLargeCases ? 129 : 23, vocab = kLargeCases ? 50257 : 1001, tp = 3;
  const std::int64_t per = (vocab + tp - 1) / tp;
  auto logits = (torch::randn({rows, per * tp}) * 2).to(at::kBFloat16);
  auto target = torch::randint(0, vocab, {rows}, torch::kLong);
  target[1] = -100;
  target[2] = vocab - 1;  // the last id: the padded shard holds it
  auto whole = logits.narrow(1, 0, vocab).to(at::kDouble).requires_grad_();
  const double want = ops::cross_entropy(whole, target).item<double>();
  (ops::cross_entropy(whole, target) * 2).backward();
  // Each shard's exact statistics [2, rows]: lse over its ids, the target's logit or 0.
  const auto exact = shard_statistics(whole, target, per, tp, vocab);
  struct Case {
    bool exact;  // float64 on the host (the reference path), else bf16 on the kernels' device
    bool in_place;
    double told;
  };
  for (const Case& c : {Case{true, false, 2}, Case{false, false, 2}, Case{false, true, 2}, Case{false, true, 1}}) {
    const bool exact_run = c.exact;
    for (std::int64_t r = 0; r < tp; ++r) {
      SCOPED_TRACE(std::string(exact_run ? "float64" : "bf16") + (c.in_place ? " in place" : "") + " told " +
                   std::to_string(c.told) + " rank " + std::to_string(r));
      auto shard = logits.narrow(1, r * per, per).contiguous();
      auto l = (exact_run ? shard.to(at::kDouble) : dev(shard)).requires_grad_();
      ops::CrossEntropyOptions o;
      o.in_place = c.in_place;
      o.grad_scale = c.told;
      o.vocab_start = r * per;
      o.vocab_size = vocab;
      o.combine = exchange_with(exact, r);
      auto loss = ops::cross_entropy(l, target.to(l.device()), o);
      (loss * 2).backward();
      EXPECT_NEAR(loss.item<double>(), want, exact_run ? 1e-10 : 1e-3 * want);
      const auto cols = std::min(per, vocab - r * per);
      auto g = l.grad().cpu().to(at::kDouble);
      // bf16: gradients up to 2 / (rows - 1), a rounding 2^-9 of that; allow four.
      const double tol = exact_run ? 1e-12 : 4 * 2.0 / (rows - 1) / 512;
      EXPECT_LT((g.narrow(1, 0, cols) - whole.grad().narrow(1, r * per, cols)).abs().max().item<double>(), tol);
      if (cols < per) EXPECT_EQ(g.narrow(1, cols, per - cols).abs().sum().item<double>(), 0.0) << "padding";
      EXPECT_EQ(g[1].abs().sum().item<double>(), 0.0) << "an ignored row";
    }
  }
  // A rank holding padding alone (a vocabulary its split pads by more than a shard): it
  // gives -inf and 0, and gets a gradient of 0.
  for (bool exact_run : {true, false}) {
    SCOPED_TRACE(exact_run ? "padding alone, float64" : "padding alone, bf16");
    auto shard = logits.narrow(1, 0, per).contiguous();
    auto l = (exact_run ? shard.to(at::kDouble) : dev(shard)).requires_grad_();
    ops::CrossEntropyOptions o;
    o.vocab_start = per * tp;
    o.vocab_size = vocab;
    o.combine = [&](const at::Tensor& mine) {
      const auto m = mine.cpu().to(at::kDouble);
      EXPECT_TRUE(torch::equal(m[0], torch::full({rows}, -std::numeric_limits<double>::infinity(), at::kDouble)));
      EXPECT_EQ(m[1].abs().sum().item<double>(), 0.0);
      auto all = exact;
      all.push_back(m);
      auto stacked = torch::stack(all);
      return torch::stack({stacked.select(1, 0).logsumexp(0), stacked.select(1, 1).sum(0)}).to(mine.options());
    };
    auto loss = ops::cross_entropy(l, target.to(l.device()), o);
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), want, exact_run ? 1e-10 : 1e-3 * want);
    EXPECT_EQ(l.grad().abs().sum().item<double>(), 0.0);
  }
  ops::CrossEntropyOptions o;
  o.vocab_start = per;
  o.vocab_size = vocab;
  o.combine = [](const at::Tensor& mine) { return mine; };
  auto bad = target.clone();
  bad[0] = vocab;  // the padding column's id
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(std::isnan(ops::cross_entropy(dev(logits.narrow(1, per, per).contiguous()), dev(bad), o).item<double>()));
  }
  EXPECT_THROW(ops::cross_entropy(logits.narrow(1, per, per).to(at::kDouble), bad, o), InvalidArgument);
  o.combine = nullptr;
  EXPECT_THROW(ops::cross_entropy(dev(logits), dev(target), o), InvalidArgument);
}

// Fused AdamW over segments of 1, 1000 (with weight decay) and more elements, bfloat16
// gradients unscaled by 1/1024 and a bfloat16 model copy, for three steps, against
// LibTorch's AdamW in float64 on the same (unscaled) gradients. eps is of the gradients'
// size, so that a wrong unscaling shows (Adam's step is otherwise nearly scale-free).
TEST(KERNEL_SUITE(Ops), FusedAdamWMatchesLibTorchAdamW) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(13);
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 0.1, scale = 1.0 / 1024;
  std::vector<ops::AdamWSegment> segs;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<at::Tensor> ref_params;
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{1000}, kLargeCases ? std::int64_t{123457} : std::int64_t{20001}}) {
    const double decay = n == 1000 ? 0.1 : 0.0;
    auto p = torch::randn({n}), g = (torch::randn({n}) * (0.1 * 1024)).to(at::kBFloat16);
    segs.push_back({dev(p), dev(g), dev(torch::zeros({n})), dev(torch::zeros({n})),
                    dev(torch::zeros({n}, at::kBFloat16)), decay});
    auto rp = p.to(at::kDouble).requires_grad_();
    rp.mutable_grad() = g.to(at::kDouble) * scale;
    ref_params.push_back(rp);
    groups.emplace_back(std::vector<at::Tensor>{rp},
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(decay)));
  }
  torch::optim::AdamW ref(groups, torch::optim::AdamWOptions(lr));
  for (std::int64_t step = 1; step <= 3; ++step) {
    auto h = ops::adamw_hyper(lr, beta1, beta2, eps, step);
    h.grad_scale = scale;
    ops::fused_adamw(segs, h);
    ref.step();
  }
  kernel_sync();
  for (std::size_t i = 0; i < segs.size(); ++i) {
    EXPECT_LT(max_abs(segs[i].param, ref_params[i].detach()), 1e-6) << i;
    EXPECT_TRUE(torch::equal(segs[i].model_param.cpu(), segs[i].param.cpu().to(at::kBFloat16))) << i;
  }
}

// The tiny Llama the trainer tests run on the kernels: head dim 64, GQA 2/1.
models::GptConfig tiny_gqa_llama() {
  auto cfg = models::GptConfig::preset("tiny");
  cfg.family = "llama";
  cfg.d_model = 128;
  cfg.n_head = 2;
  cfg.n_kv_head = 1;
  return cfg;
}

// The tiny model in bf16 (a sliding window over part of its sequence) with every fused
// option against the unfused run: the model and trainer's use of the ops (the loss's
// upstream gradient announced, its gradient in place).
TEST(KERNEL_SUITE(Ops), TrainerWithFusedOpsTracksTheUnfusedRun) {
  KERNEL_DEVICE_OR_SKIP();
  testing::TestCorpus corpus("gpufused");
  auto cfg = tiny_gqa_llama();
  cfg.attention_window = kLargeCases ? 24 : 6;  // sdpa's mask against the kernels' window
  train::TrainOptions o;
  o.train_data = corpus.train();
  // The emulator switches fibers at every barrier of every row's block: few tokens there.
  o.steps = kLargeCases ? 30 : 6;
  o.warmup_steps = 2;
  o.seq_len = kLargeCases ? 64 : 16;
  o.global_batch = kLargeCases ? 8 : 2;
  o.micro_batch = o.global_batch / 2;  // two micro-batches: the loss's upstream gradient is 1/2
  o.precision = "bf16";
  o.progress = "off";
  auto ctx = ParallelContext::single_process(kernel_device().is_cuda() ? c10::Device(c10::kCUDA, 0) : kernel_device());
  train::Trainer plain(ctx, cfg, o);
  auto fcfg = cfg;
  fcfg.attention = ops::AttentionBackend::kFlash;
  fcfg.fused_norm = fcfg.fused_ce = fcfg.fused_swiglu = fcfg.fused_rope = true;
  auto fo = o;
  fo.adamw.fused = true;
  train::Trainer fused(ctx, fcfg, fo);
  const auto a = plain.run(), b = fused.run();
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i].loss, b[i].loss, 2e-2 * a[i].loss) << "step " << i + 1;
  if (kLargeCases) {
    EXPECT_LT(b.back().loss, b.front().loss - 0.5) << "the fused run must learn";
  }
}

// The op under LibTorch's deterministic algorithms (what TrainOptions::deterministic
// sets; torch's use_deterministic_algorithms) takes the kernels' deterministic backward:
// its gradients are bitwise the same whatever order the blocks run in. On the emulator the
// default backward's dq changes with the order here (16 key blocks a row, float16): the
// comparison can see it. The setting is put back.
TEST(KERNEL_SUITE(Ops), FlashAttentionBackwardIsDeterministicUnderLibTorchsSetting) {
  KERNEL_DEVICE_OR_SKIP();
  auto& context = at::globalContext();
  const bool was = context.deterministicAlgorithms(), was_warn = context.deterministicAlgorithmsWarnOnly();
  const auto f16 = torch::TensorOptions().device(kernel_device()).dtype(torch::kHalf);
  torch::manual_seed(21);
  const std::int64_t nq = kLargeCases ? 512 : 64, nk = kLargeCases ? 4096 : 1000;
  const auto q0 = torch::randn({1, 4, nq, 64}).to(f16), k0 = torch::randn({1, 2, nk, 64}).to(f16),
             v0 = torch::randn({1, 2, nk, 64}).to(f16), dout = torch::randn({1, 4, nq, 64}).to(f16);
  auto grads = [&](bool deterministic, std::uint64_t order) {
    context.setDeterministicAlgorithms(deterministic, false);
    const ScopedBlockOrder scoped(order);
    auto q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    ops::flash_attention(q, k, v, /*causal=*/false).backward(dout);
    return std::vector<at::Tensor>{q.grad(), k.grad(), v.grad()};
  };
  const auto a = grads(true, 1), b = grads(true, 2);
  const auto c = grads(false, 1), d = grads(false, 2);
  context.setDeterministicAlgorithms(was, was_warn);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "gradient " << i;
  if (kBlockOrderVaries) EXPECT_FALSE(at::equal(c[0], d[0])) << "the default dq must depend on the block order here";
}

// TrainOptions::deterministic: two runs of the fused tiny Llama on the kernels, flash
// attention among them, give the same losses and weights bit for bit (the emulator runs
// the second one's blocks in other orders). The setting is process-wide (LibTorch's
// deterministic algorithms): the test puts back what it found.
TEST(KERNEL_SUITE(Ops), DeterministicTrainerRepeatsBitForBit) {
  KERNEL_DEVICE_OR_SKIP();
  auto& context = at::globalContext();
  const bool was = context.deterministicAlgorithms(), was_warn = context.deterministicAlgorithmsWarnOnly();
  testing::TestCorpus corpus("gpudeterministic");
  auto cfg = tiny_gqa_llama();
  cfg.n_layer = 1;
  cfg.context = 256;
  cfg.attention = ops::AttentionBackend::kFlash;
  cfg.fused_norm = cfg.fused_ce = cfg.fused_swiglu = cfg.fused_rope = true;
  train::TrainOptions o;
  o.train_data = corpus.train();
  o.steps = kLargeCases ? 10 : 2;
  o.warmup_steps = 1;
  o.seq_len = kLargeCases ? 256 : 200;  // key blocks enough for the order of dq's sum to show
  o.global_batch = 1;
  o.precision = "bf16";
  o.progress = "off";
  o.adamw.fused = true;
  o.deterministic = true;
  auto ctx = ParallelContext::single_process(kernel_device().is_cuda() ? c10::Device(c10::kCUDA, 0) : kernel_device());
  auto run = [&](std::uint64_t order) {
    const ScopedBlockOrder scoped(order);
    train::Trainer t(ctx, cfg, o);
    EXPECT_TRUE(context.deterministicAlgorithms());
    auto metrics = t.run();
    return std::make_pair(metrics, t.full_parameters());
  };
  const auto [a, pa] = run(1);
  const auto [b, pb] = run(2);
  context.setDeterministicAlgorithms(was, was_warn);

  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].loss, b[i].loss) << "step " << i + 1;
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
  }
}

}  // namespace
}  // namespace dtrain
