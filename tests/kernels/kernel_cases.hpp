// The kernels' test cases, compiled twice: against the CPU emulator of the same sources
// (test_kernels_emulated.cpp: DTRAIN_KERNELS_EMULATE, host tensors, runs everywhere) and
// against the compiled kernels on a GPU (test_kernels_gpu.cpp: CUDA tensors, skipped
// without a device). Fused AdamW, RMSNorm/LayerNorm, SwiGLU, RoPE, cross-entropy and flash attention
// forward and backward against float64 references on random inputs (never zeros), every
// output poisoned with NaN before the call, sizes that are not multiples of the tiles;
// attention within twice the error of a naive implementation in the same dtype.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "dtrain/core/env.hpp"
#include "dtrain_kernels/adamw.h"
#include "dtrain_kernels/attention.h"
#include "dtrain_kernels/cross_entropy.h"
#include "dtrain_kernels/norm.h"
#include "dtrain_kernels/rope.h"
#include "dtrain_kernels/swiglu.h"
#include "kernel_device.hpp"

namespace {

// ---- AdamW --------------------------------------------------------------------------------

struct AdamState {
  at::Tensor p, g, m, v, model;
  float wd;
};

// One AdamW step in float64 on host copies (LibTorch's AdamW formula).
AdamState adamw_reference(const AdamState& s, double lr, double b1, double b2, double eps, double bc1, double bc2,
                          double grad_scale) {
  auto p = s.p.cpu().to(at::kDouble), g = s.g.cpu().to(at::kDouble) * grad_scale;
  auto m = s.m.cpu().to(at::kDouble) * b1 + g * (1 - b1);
  auto v = s.v.cpu().to(at::kDouble) * b2 + g * g * (1 - b2);
  p = p * (1 - lr * s.wd) - (lr / bc1) * m / (v.sqrt() / std::sqrt(bc2) + eps);
  return {p, g, m, v, {}, s.wd};
}

std::vector<AdamState> adam_states(const std::vector<std::int64_t>& sizes, at::ScalarType grad_type, bool model) {
  std::vector<AdamState> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    // Every fifth segment starts one element into its buffers: not 16-byte aligned, so the
    // kernel takes it one element per access (the others 4).
    const std::int64_t off = i % 5 == 4 ? 1 : 0;
    auto place = [&](const at::Tensor& t) { return dev(torch::cat({t.narrow(0, 0, off), t})).narrow(0, off, t.numel()); };
    AdamState s;
    s.p = place(torch::randn({sizes[i]}));
    s.g = place(torch::randn({sizes[i]}).to(grad_type));
    s.m = place(torch::randn({sizes[i]}) * 0.1);
    s.v = place(torch::rand({sizes[i]}) * 0.01);
    if (model) s.model = poisoned({sizes[i] + off}, at::kBFloat16).narrow(0, off, sizes[i]);
    s.wd = i % 2 == 0 ? 0.1f : 0.f;
    out.push_back(s);
  }
  return out;
}

cudaError_t run_adamw(std::vector<AdamState>& states, const dtrain_adamw_params& p) {
  std::vector<dtrain_adamw_segment> segs;
  for (auto& s : states) {
    segs.push_back({s.p.data_ptr<float>(), s.g.data_ptr(), s.m.data_ptr<float>(), s.v.data_ptr<float>(),
                    s.model.defined() ? s.model.data_ptr() : nullptr, s.p.numel(), s.wd});
  }
  return dtrain_adamw(segs.data(), static_cast<int>(segs.size()), &p, nullptr);
}

dtrain_adamw_params adam_params(at::ScalarType grad_type, float grad_scale) {
  dtrain_adamw_params p{};
  p.lr = 1e-2f;
  p.beta1 = 0.9f;
  p.beta2 = 0.95f;
  p.eps = 1e-8f;
  p.bias_correction1 = 1 - std::pow(0.9f, 3);
  p.bias_correction2 = 1 - std::pow(0.95f, 3);
  p.grad_scale = grad_scale;
  p.grad_dtype = grad_type == at::kBFloat16 ? DTRAIN_KERNEL_BF16 : DTRAIN_KERNEL_F32;
  p.model_dtype = DTRAIN_KERNEL_BF16;
  return p;
}

TEST(KERNEL_SUITE(AdamW), ManySegmentsAndChunksMatchFloat64) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(1);
  // 70 segments (more than one launch holds) with one of 331 chunks (many per block of the
  // grid: the emulator's holds 8 blocks).
  std::vector<std::int64_t> sizes(70, 17);
  sizes[3] = 330 * 16384 + 5;
  sizes[7] = 1;
  sizes[9] = 2 * 16384 + 3;  // offset by one element (see adam_states), over three chunks
  sizes[66] = 5 * 16384;     // in the second launch
  for (auto grad_type : {at::kFloat, at::kBFloat16}) {
    auto states = adam_states(sizes, grad_type, grad_type == at::kBFloat16);
    std::vector<AdamState> before;
    for (const auto& s : states) before.push_back({s.p.clone(), s.g.clone(), s.m.clone(), s.v.clone(), {}, s.wd});
    const auto p = adam_params(grad_type, 0.5f);
    ASSERT_EQ(run_adamw(states, p), cudaSuccess);
    kernel_sync();
    for (std::size_t i = 0; i < states.size(); ++i) {
      const auto want =
          adamw_reference(before[i], p.lr, p.beta1, p.beta2, p.eps, p.bias_correction1, p.bias_correction2, 0.5);
      EXPECT_LT(max_abs(states[i].p, want.p), 1e-5) << "segment " << i;
      EXPECT_LT(max_abs(states[i].m, want.m), 1e-6) << "segment " << i;
      EXPECT_LT(max_abs(states[i].v, want.v), 1e-6) << "segment " << i;
      if (states[i].model.defined()) {
        EXPECT_TRUE(torch::equal(states[i].model.cpu(), states[i].p.cpu().to(at::kBFloat16))) << "segment " << i;
      }
    }
  }
}

TEST(KERNEL_SUITE(AdamW), NonFiniteGradientsAreFlaggedAndSkipStopsEverything) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(2);
  auto states = adam_states({1000, 33}, at::kFloat, false);
  states[1].g[5] = std::numeric_limits<float>::infinity();
  const auto before = states[1].p.cpu().clone();  // .cpu() of a host tensor is the tensor
  auto found = dev(torch::zeros({1}, torch::kInt)), skip = dev(torch::zeros({1}, torch::kInt));
  auto p = adam_params(at::kFloat, 1.f);
  p.found_inf = found.data_ptr<int>();
  p.skip = skip.data_ptr<int>();
  ASSERT_EQ(run_adamw(states, p), cudaSuccess);
  kernel_sync();
  EXPECT_EQ(found.item<int>(), 1);
  const auto after = states[1].p.cpu();
  EXPECT_EQ(after[5].item<float>(), before[5].item<float>()) << "a non-finite g leaves its element";
  EXPECT_NE(after[6].item<float>(), before[6].item<float>());
  skip.fill_(1);
  const auto frozen = states[0].p.cpu().clone();
  ASSERT_EQ(run_adamw(states, p), cudaSuccess);
  kernel_sync();
  EXPECT_TRUE(torch::equal(states[0].p.cpu(), frozen)) << "skip set: nothing is updated";
  p.bias_correction1 = 0;
  EXPECT_EQ(run_adamw(states, p), cudaErrorInvalidValue);
}

// ---- norms --------------------------------------------------------------------------------

TEST(KERNEL_SUITE(Norm), ForwardAndBackwardMatchFloat64) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(3);
  // Rows a multiple of 16 bytes take the kernels' 16-byte accesses, 1001 and 16383 one
  // element per access. The backward's instances: 96 and 1000 hold the weights and every
  // partial sum in registers, 2056 (4 accesses a thread) dbias' in shared memory, 1001 none.
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{37, 96}, {37, 1000}, {21, 2056}, {37, 1001}};
  if (kLargeCases) shapes.insert(shapes.end(), {{4099, 768}, {1000, 4096}, {70, 16384}, {300, 16383}});
  for (bool layer : {false, true}) {
    for (auto type : {at::kFloat, at::kBFloat16}) {
      for (const auto& [rows, cols] : shapes) {
        SCOPED_TRACE((layer ? "layer_norm " : "rms_norm ") + std::string(c10::toString(type)) + " " +
                     std::to_string(rows) + "x" + std::to_string(cols));
        auto x = (torch::randn({rows, cols}) * 2 + 0.5).to(type);
        auto w = torch::randn({cols}) * 0.5 + 1;
        auto b = torch::randn({cols});
        auto dy = torch::randn({rows, cols}).to(type);
        // float64 reference through autograd.
        auto xr = x.to(at::kDouble).requires_grad_();
        auto wr = w.to(at::kDouble).requires_grad_();
        auto br = b.to(at::kDouble).requires_grad_();
        auto yr = layer ? at::layer_norm(xr, {cols}, wr, br, 1e-5) : at::rms_norm(xr, {cols}, wr, 1e-5);
        yr.backward(dy.to(at::kDouble));

        auto xd = dev(x), wd = dev(w), bd = dev(b), dyd = dev(dy);
        auto y = poisoned({rows, cols}, type);
        auto mean = poisoned({rows}, at::kFloat), rstd = poisoned({rows}, at::kFloat);
        dtrain_norm_fwd_params f{};
        f.x = xd.data_ptr();
        f.weight = wd.data_ptr();
        f.bias = layer ? bd.data_ptr() : nullptr;
        f.y = y.data_ptr();
        f.mean = layer ? mean.data_ptr<float>() : nullptr;
        f.rstd = rstd.data_ptr<float>();
        f.rows = rows;
        f.cols = f.x_stride = f.y_stride = cols;
        f.eps = 1e-5f;
        f.layer_norm = layer;
        f.dtype = kernel_dtype(x);
        f.weight_dtype = DTRAIN_KERNEL_F32;
        ASSERT_EQ(dtrain_norm_fwd(&f, nullptr), cudaSuccess);
        kernel_sync();
        const double tol = type == at::kFloat ? 1e-4 : 0.05;
        EXPECT_LT(max_abs(y, yr), tol);

        auto dx = poisoned({rows, cols}, type), dw = poisoned({cols}, at::kFloat), db = poisoned({cols}, at::kFloat);
        dtrain_norm_bwd_params g{};
        g.dy = dyd.data_ptr();
        g.x = xd.data_ptr();
        g.weight = wd.data_ptr();
        g.mean = f.mean;
        g.rstd = f.rstd;
        g.dx = dx.data_ptr();
        g.dweight = dw.data_ptr();
        g.dbias = layer ? db.data_ptr() : nullptr;
        g.rows = rows;
        g.cols = g.dy_stride = g.x_stride = g.dx_stride = cols;
        g.layer_norm = layer;
        g.dtype = f.dtype;
        g.weight_dtype = DTRAIN_KERNEL_F32;
        auto ws = poisoned({static_cast<std::int64_t>(dtrain_norm_workspace_bytes(&g) / 4)}, at::kFloat);
        g.workspace = ws.data_ptr();
        ASSERT_EQ(dtrain_norm_bwd(&g, nullptr), cudaSuccess);
        kernel_sync();
        EXPECT_LT(max_abs(dx, xr.grad()), tol);
        // Sums over rows of float32 products of the same (rounded) inputs as the reference.
        const double wtol = 1e-4 + 2e-6 * static_cast<double>(rows);
        EXPECT_LT(max_abs(dw, wr.grad()), wtol);
        if (layer) {
          EXPECT_LT(max_abs(db, br.grad()), wtol);
          // dbias without dweight (a frozen weight): the same dx and dbias.
          auto dx2 = poisoned({rows, cols}, type), db2 = poisoned({cols}, at::kFloat);
          g.dx = dx2.data_ptr();
          g.dweight = nullptr;
          g.dbias = db2.data_ptr();
          ws.fill_(std::numeric_limits<float>::quiet_NaN());
          ASSERT_EQ(dtrain_norm_bwd(&g, nullptr), cudaSuccess);
          kernel_sync();
          EXPECT_TRUE(torch::equal(dx2.cpu(), dx.cpu()));
          EXPECT_TRUE(torch::equal(db2.cpu(), db.cpu()));
        }
      }
    }
  }
}

// ---- SwiGLU and RoPE ------------------------------------------------------------------------

// The largest error a result in `type` may have against its float64 value, relative to the
// largest magnitude of the result: a rounding to the type (plus the exponential's few ulp
// in float32).
inline double pointwise_tol(at::ScalarType type) {
  return type == at::kFloat ? 1e-5 : type == at::kHalf ? 2e-3 : 1e-2;
}
inline void expect_close(const at::Tensor& got, const at::Tensor& want, at::ScalarType type, const char* what) {
  const double scale = want.abs().max().item<double>();
  EXPECT_LE(max_abs(got, want), pointwise_tol(type) * scale) << what;
}

// silu(gate) * up and both gradients against float64 autograd of the same rounded inputs:
// contiguous rows (16-byte accesses), 1001 columns and a pointer one element in (one element
// per access), and gate and up as the two halves of one [rows, 2 cols] matrix (strided rows).
TEST(KERNEL_SUITE(Swiglu), ForwardAndBackwardMatchFloat64) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(4);
  struct Shape {
    std::int64_t rows, cols;
    bool halves;  // gate and up side by side in one matrix
    std::int64_t offset;  // elements before every matrix's first
  };
  // 70001 rows (bf16 only: 4 s in the emulator): more than a grid's 65535 rows, so that
  // blocks take a second row.
  std::vector<Shape> shapes = {{37, 96, false, 0}, {37, 1001, false, 0}, {19, 96, true, 0}, {5, 200, false, 1},
                               {1, 3000, false, 0}, {70001, 8, false, 0}};
  if (kLargeCases) shapes.insert(shapes.end(), {{4099, 768, false, 0}, {1, (1 << 22) + 3, false, 0}, {333, 11008, true, 0}});
  for (auto type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto& sh : shapes) {
      if (sh.rows > 65535 && type != at::kBFloat16) continue;
      SCOPED_TRACE(std::string(c10::toString(type)) + " " + std::to_string(sh.rows) + "x" + std::to_string(sh.cols) +
                   (sh.halves ? " halves" : "") + (sh.offset ? " offset" : ""));
      const auto rows = sh.rows, cols = sh.cols, off = sh.offset;
      // Values over silu's whole range: its minimum near -1.28, saturation both ways.
      auto both = (torch::randn({rows, 2 * cols}) * 3).to(type);
      auto dy = torch::randn({rows, cols}).to(type);
      auto gr = both.narrow(1, 0, cols).to(at::kDouble).requires_grad_();
      auto ur = both.narrow(1, cols, cols).to(at::kDouble).requires_grad_();
      auto yr = gr * torch::sigmoid(gr) * ur;
      yr.backward(dy.to(at::kDouble));

      // Device matrices [rows, cols] of row stride `stride` starting `off` elements into a
      // buffer (poisoned where nothing is copied).
      auto place = [&](const at::Tensor& t, std::int64_t stride) {
        auto buf = poisoned({off + rows * stride}, type);
        auto m = buf.narrow(0, off, rows * stride).view({rows, stride}).narrow(1, 0, t.size(1));
        m.copy_(dev(t));
        return m;
      };
      at::Tensor g, u;
      if (sh.halves) {
        auto m = place(both, 2 * cols);
        g = m.narrow(1, 0, cols), u = m.narrow(1, cols, cols);
      } else {
        g = place(both.narrow(1, 0, cols), cols), u = place(both.narrow(1, cols, cols), cols);
      }
      auto y = place(poisoned({rows, cols}, type), cols), dyd = place(dy, cols);
      dtrain_swiglu_fwd_params f{};
      f.gate = g.data_ptr(), f.up = u.data_ptr(), f.y = y.data_ptr();
      f.rows = rows, f.cols = cols;
      f.gate_stride = g.stride(0), f.up_stride = u.stride(0), f.y_stride = y.stride(0);
      f.dtype = kernel_dtype(g);
      ASSERT_EQ(dtrain_swiglu_fwd(&f, nullptr), cudaSuccess);
      kernel_sync();
      expect_close(y, yr, type, "y");

      auto dg = place(poisoned({rows, cols}, type), cols), du = place(poisoned({rows, cols}, type), cols);
      dtrain_swiglu_bwd_params b{};
      b.dy = dyd.data_ptr(), b.gate = g.data_ptr(), b.up = u.data_ptr(), b.dgate = dg.data_ptr(), b.dup = du.data_ptr();
      b.rows = rows, b.cols = cols;
      b.dy_stride = dyd.stride(0), b.gate_stride = g.stride(0), b.up_stride = u.stride(0);
      b.dgate_stride = dg.stride(0), b.dup_stride = du.stride(0);
      b.dtype = f.dtype;
      ASSERT_EQ(dtrain_swiglu_bwd(&b, nullptr), cudaSuccess);
      kernel_sync();
      expect_close(dg, gr.grad(), type, "dgate");
      expect_close(du, ur.grad(), type, "dup");
    }
  }
  dtrain_swiglu_fwd_params f{};
  EXPECT_EQ(dtrain_swiglu_fwd(&f, nullptr), cudaErrorInvalidValue) << "no columns";
  auto t = dev(torch::ones({4, 8}));
  f.gate = f.up = f.y = t.data_ptr();
  f.rows = 4, f.cols = 8, f.gate_stride = f.up_stride = 8, f.y_stride = 4;
  f.dtype = DTRAIN_KERNEL_F32;
  EXPECT_EQ(dtrain_swiglu_fwd(&f, nullptr), cudaErrorInvalidValue) << "output rows overlapping";
}

// The rotation on [B, H, T, D] views of [B, T, H, D] storage (the model's q and k) and of
// contiguous [B, H, T, D], angles shared by the batch or each token's own, the inverse
// rotation, in place, head dims whose half is a multiple of 16 bytes and not, and a
// pointer one element in: against float64 of the same rounded inputs and float32 angles.
TEST(KERNEL_SUITE(Rope), RotationAndItsInverseMatchFloat64) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(5);
  struct Case {
    std::int64_t B, H, T, D;
    bool bthd, per_token, inverse, in_place;
    std::int64_t offset;
  };
  std::vector<Case> cases = {{2, 3, 17, 64, true, false, false, false, 0}, {2, 3, 17, 64, false, true, true, false, 0},
                             {1, 2, 9, 20, true, false, false, false, 0},  {2, 1, 5, 96, true, true, false, true, 0},
                             {1, 2, 7, 64, false, false, true, false, 1}};
  if (kLargeCases) cases.insert(cases.end(), {{4, 32, 1024, 128, true, false, false, false, 0}, {2, 8, 4099, 64, true, true, true, false, 0}});
  for (auto type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto& c : cases) {
      SCOPED_TRACE(std::string(c10::toString(type)) + " " + std::to_string(c.B) + "x" + std::to_string(c.H) + "x" +
                   std::to_string(c.T) + "x" + std::to_string(c.D) + (c.bthd ? " bthd" : "") +
                   (c.per_token ? " per-token" : "") + (c.inverse ? " inverse" : "") + (c.in_place ? " in place" : "") +
                   (c.offset ? " offset" : ""));
      const auto half = c.D / 2;
      auto x = (torch::randn({c.B, c.H, c.T, c.D}) * 2).to(type);
      // Angles as the model makes them (float32), rows for 3 more positions than T.
      auto angles = c.per_token ? torch::rand({c.B, 1, c.T, half}) * 50 : torch::rand({c.T + 3, half}) * 50;
      auto cs = angles.cos(), sn = angles.sin();
      auto cr = (c.per_token ? cs : cs.narrow(0, 0, c.T)).to(at::kDouble);
      auto sr = (c.per_token ? sn : sn.narrow(0, 0, c.T)).to(at::kDouble) * (c.inverse ? -1 : 1);
      auto xr = x.to(at::kDouble), x1 = xr.narrow(3, 0, half), x2 = xr.narrow(3, half, half);
      auto want = torch::cat({x1 * cr - x2 * sr, x1 * sr + x2 * cr}, 3);

      // x on the device in the case's layout, `offset` elements into its buffer.
      const auto n = x.numel();
      auto buf = poisoned({c.offset + n}, type);
      auto flat = buf.narrow(0, c.offset, n);
      auto xd = c.bthd ? flat.view({c.B, c.T, c.H, c.D}).permute({0, 2, 1, 3}) : flat.view({c.B, c.H, c.T, c.D});
      xd.copy_(dev(x));
      auto y = c.in_place ? xd : poisoned({c.B, c.T, c.H, c.D}, type).permute({0, 2, 1, 3});
      auto cd = dev(cs), sd = dev(sn);
      dtrain_rope_params p{};
      p.x = xd.data_ptr(), p.y = y.data_ptr();
      p.cos = cd.data_ptr<float>(), p.sin = sd.data_ptr<float>();
      p.batch = c.B, p.heads = c.H, p.seq = c.T, p.head_dim = c.D;
      for (int d = 0; d < 3; ++d) p.x_stride[d] = xd.stride(d), p.y_stride[d] = y.stride(d);
      p.angle_stride[0] = c.per_token ? cd.stride(0) : 0;
      p.angle_stride[1] = c.per_token ? cd.stride(2) : cd.stride(0);
      p.inverse = c.inverse;
      p.dtype = kernel_dtype(x);
      ASSERT_EQ(dtrain_rope(&p, nullptr), cudaSuccess);
      kernel_sync();
      expect_close(y, want, type, "y");
    }
  }
  dtrain_rope_params p{};
  p.batch = p.heads = p.seq = 1, p.head_dim = 7;
  EXPECT_EQ(dtrain_rope(&p, nullptr), cudaErrorInvalidValue) << "odd head dim";
}

// ---- cross-entropy -----------------------------------------------------------------------

TEST(KERNEL_SUITE(CrossEntropy), LossAndGradientsMatchFloat64WithIgnoredRows) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(4);
  // 5008 and 50304 take the kernels' 16-byte accesses, 5003 and 50257 one element per access.
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{20, 5003}, {20, 5008}};
  if (kLargeCases) shapes.insert(shapes.end(), {{517, 50304}, {64, 50257}});
  for (const auto& [rows, vocab] : shapes) {
    for (auto type : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(c10::toString(type)) + " " + std::to_string(rows) + "x" + std::to_string(vocab));
      auto logits = (torch::randn({rows, vocab}) * 3).to(type);
      auto target = torch::randint(0, vocab, {rows}, torch::kLong);
      target[3] = -100;
      target[11] = -100;
      auto ref = logits.to(at::kDouble).requires_grad_();
      auto loss_ref = at::cross_entropy_loss(ref, target, {}, at::Reduction::Mean, -100);
      (loss_ref * 0.5).backward();
      const double gtol = type == at::kFloat ? 1e-6 : 1e-4;

      // The gradient for an upstream gradient of 0.5, into its own buffer.
      auto ld = dev(logits), td = dev(target);
      const auto count = (target != -100).sum();
      auto countd = dev(count.reshape({1}));
      auto loss = poisoned({rows}, at::kFloat), lse = poisoned({rows}, at::kFloat);
      auto dlogits = poisoned({rows, vocab}, type);
      dtrain_cross_entropy_fwd_params f{};
      f.logits = ld.data_ptr();
      f.target = td.data_ptr<std::int64_t>();
      f.loss = loss.data_ptr<float>();
      f.lse = lse.data_ptr<float>();
      f.dlogits = dlogits.data_ptr();
      f.count = countd.data_ptr<std::int64_t>();
      f.grad_scale = 0.5f;
      f.rows = rows;
      f.vocab = f.logits_stride = f.dlogits_stride = vocab;
      f.ignore_index = -100;
      f.dtype = kernel_dtype(logits);
      ASSERT_EQ(dtrain_cross_entropy_fwd(&f, nullptr), cudaSuccess);
      kernel_sync();
      EXPECT_NEAR(loss.sum().item<double>() / count.item<double>(), loss_ref.item<double>(), 1e-4);
      EXPECT_EQ(loss[3].item<float>(), 0.f);
      EXPECT_LT(max_abs(lse, ref.detach().logsumexp(1)), 1e-4);
      EXPECT_LT(max_abs(dlogits, ref.grad()), gtol);
      EXPECT_EQ(dlogits[3].abs().sum().item<float>(), 0.f);
      EXPECT_TRUE(torch::equal(ld.cpu(), logits));  // read only

      // Loss only (no gradient, no lse): the same losses.
      auto loss_only = poisoned({rows}, at::kFloat);
      auto g = f;
      g.loss = loss_only.data_ptr<float>();
      g.lse = nullptr;
      g.dlogits = nullptr;
      g.count = nullptr;
      ASSERT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaSuccess);
      kernel_sync();
      EXPECT_TRUE(torch::equal(loss_only.cpu(), loss.cpu()));

      // In place: the gradient replaces the logits, the same values as in a buffer of its own.
      auto inplace = dev(logits);
      auto loss_in = poisoned({rows}, at::kFloat);
      g = f;
      g.logits = g.dlogits = inplace.data_ptr();
      g.loss = loss_in.data_ptr<float>();
      ASSERT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaSuccess);
      kernel_sync();
      EXPECT_TRUE(torch::equal(loss_in.cpu(), loss.cpu()));
      EXPECT_TRUE(torch::equal(inplace.cpu(), dlogits.cpu()));

      // The backward: in place, an upstream gradient within 1e-6 of the one written leaves
      // the gradient as it is and 1.5 (three times 0.5) rescales it; into rows of its own,
      // a copy (rows padded to vocab + 8) and a rescaled copy, the input left alone.
      auto written = dev(torch::full({1}, 0.5f));
      for (float up : {0.5f, 0.5f * (1 + 4e-7f), 1.5f}) {
        SCOPED_TRACE("upstream " + std::to_string(up));
        auto grad = dev(torch::full({1}, up));
        auto before = dlogits.clone();
        auto out = poisoned({rows, vocab + 8}, type);
        dtrain_cross_entropy_bwd_params b{dlogits.data_ptr(),       out.data_ptr(), grad.data_ptr<float>(),
                                          written.data_ptr<float>(), rows,           vocab,
                                          vocab,                     vocab + 8,      kernel_dtype(logits)};
        ASSERT_EQ(dtrain_cross_entropy_bwd(&b, nullptr), cudaSuccess);
        b.dlogits = b.out = inplace.data_ptr();
        b.out_stride = vocab;
        ASSERT_EQ(dtrain_cross_entropy_bwd(&b, nullptr), cudaSuccess);
        kernel_sync();
        EXPECT_TRUE(torch::equal(dlogits.cpu(), before.cpu()));
        const auto copy = out.narrow(1, 0, vocab);
        if (up != 1.5f) {
          EXPECT_TRUE(torch::equal(inplace.cpu(), before.cpu()));
          EXPECT_TRUE(torch::equal(copy.cpu(), before.cpu()));
        } else {
          // One more rounding in 16-bit dtypes, of values three times as large.
          EXPECT_LT(max_abs(inplace, ref.grad() * 3), 4 * gtol);
          EXPECT_TRUE(torch::equal(copy.cpu(), inplace.cpu()));
          EXPECT_EQ(inplace[3].abs().sum().item<float>(), 0.f);
        }
      }

      // Refused: an in-place gradient with another row stride, an upstream gradient of 0.
      g = f;
      g.dlogits = ld.data_ptr();
      g.dlogits_stride = vocab + 8;
      EXPECT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaErrorInvalidValue);
      g = f;
      g.grad_scale = 0.f;
      EXPECT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaErrorInvalidValue);
      for (float z : {-1e-4f, std::numeric_limits<float>::infinity(), std::nanf("")}) {  // a z-loss coefficient
        g = f;
        g.z_loss = z;
        EXPECT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaErrorInvalidValue) << z;
      }
      auto one = dev(torch::ones({1}));
      dtrain_cross_entropy_bwd_params b{ld.data_ptr(),         ld.data_ptr(), one.data_ptr<float>(),
                                        one.data_ptr<float>(), rows,          vocab,
                                        vocab,                 vocab + 8,     kernel_dtype(logits)};
      EXPECT_EQ(dtrain_cross_entropy_bwd(&b, nullptr), cudaErrorInvalidValue);
    }
  }
}

// A vocabulary split across ranks (as a tensor-parallel head's columns), each shard its
// own calls over a column slice of the logits: the statistics (lse over the shard, the
// target's logit where it holds it, else 0), combined here as the caller's exchange would,
// then the gradient for the whole vocabulary's log-sum-exp (given_lse), into a buffer of
// its own and in place. Splits aligned (16-byte accesses) and not, a shard holding no
// target, ignored rows; loss, lse and gradient against float64 over the whole vocabulary.
TEST(KERNEL_SUITE(CrossEntropy), SplitVocabularyMatchesTheWhole) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(5);
  struct Split {
    std::int64_t vocab;
    std::vector<std::int64_t> shards;
  };
  std::vector<Split> splits = {{5008, {2504, 2504}}, {5003, {1000, 2000, 2003}}, {4096, {64, 4032}}};
  if (kLargeCases) splits.push_back({50304, {12576, 12576, 12576, 12576}});
  for (const auto& sp : splits) {
    for (auto type : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(c10::toString(type)) + " vocab " + std::to_string(sp.vocab) + " in " +
                   std::to_string(sp.shards.size()));
      const std::int64_t rows = 19, vocab = sp.vocab;
      auto logits = (torch::randn({rows, vocab}) * 3).to(type);
      auto target = torch::randint(64, vocab, {rows}, torch::kLong);  // none in the first 64 columns
      target[2] = -100;
      target[7] = -100;
      auto ref = logits.to(at::kDouble).requires_grad_();
      const auto count = (target != -100).sum();
      auto loss_ref = at::cross_entropy_loss(ref, target, {}, at::Reduction::None, -100);
      (loss_ref.sum() / count * 0.25).backward();
      const double gtol = type == at::kFloat ? 1e-6 : 1e-4;
      auto ld = dev(logits), td = dev(target), countd = dev(count.reshape({1}));
      dtrain_cross_entropy_fwd_params f{};
      f.target = td.data_ptr<std::int64_t>();
      f.count = countd.data_ptr<std::int64_t>();
      f.grad_scale = 0.25f;
      f.rows = rows;
      f.logits_stride = f.dlogits_stride = vocab;
      f.ignore_index = -100;
      f.dtype = kernel_dtype(logits);
      // The statistics, shard by shard.
      std::vector<at::Tensor> lses, tls;
      std::int64_t start = 0;
      for (const auto cols : sp.shards) {
        auto lse = poisoned({rows}, at::kFloat), tl = poisoned({rows}, at::kFloat);
        auto g = f;
        g.logits = static_cast<char*>(ld.data_ptr()) + start * ld.element_size();
        g.lse = lse.data_ptr<float>();
        g.target_logit = tl.data_ptr<float>();
        g.vocab = cols;
        g.vocab_start = start;
        ASSERT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaSuccess);
        kernel_sync();
        auto slice = ref.detach().narrow(1, start, cols);
        EXPECT_LT(max_abs(lse, slice.logsumexp(1)), 1e-4);
        const auto local = target - start, inside = (local >= 0) & (local < cols);
        auto want = slice.gather(1, local.clamp(0, cols - 1).unsqueeze(1)).squeeze(1) * inside;
        EXPECT_TRUE(torch::equal(tl.cpu().to(at::kDouble), want));  // the logit itself, or 0
        lses.push_back(lse.cpu().to(at::kDouble));
        tls.push_back(tl.cpu().to(at::kDouble));
        start += cols;
      }
      const auto lse_all = torch::stack(lses).logsumexp(0), picked = torch::stack(tls).sum(0);
      const auto valid = target != -100;
      EXPECT_LT(max_abs((lse_all - picked) * valid, loss_ref.detach()), 1e-4);
      // The gradient, shard by shard, for the whole vocabulary's log-sum-exp.
      auto given = dev(lse_all.to(at::kFloat));
      auto dlogits = poisoned({rows, vocab}, type), inplace = dev(logits);
      start = 0;
      for (const auto cols : sp.shards) {
        auto g = f;
        g.logits = static_cast<char*>(ld.data_ptr()) + start * ld.element_size();
        g.dlogits = static_cast<char*>(dlogits.data_ptr()) + start * dlogits.element_size();
        g.given_lse = given.data_ptr<float>();
        g.vocab = cols;
        g.vocab_start = start;
        ASSERT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaSuccess);
        g.logits = g.dlogits = static_cast<char*>(inplace.data_ptr()) + start * inplace.element_size();
        ASSERT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaSuccess);
        start += cols;
      }
      kernel_sync();
      EXPECT_LT(max_abs(dlogits, ref.grad()), gtol);
      EXPECT_EQ(dlogits[2].abs().sum().item<float>(), 0.f);
      EXPECT_TRUE(torch::equal(inplace.cpu(), dlogits.cpu()));
      EXPECT_TRUE(torch::equal(ld.cpu(), logits));  // read only
      // Refused: a given log-sum-exp with no gradient to write, a negative vocab_start.
      auto g = f;
      g.logits = ld.data_ptr();
      g.vocab = vocab;
      g.given_lse = given.data_ptr<float>();
      EXPECT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaErrorInvalidValue);
      g.given_lse = nullptr;
      g.vocab_start = -1;
      EXPECT_EQ(dtrain_cross_entropy_fwd(&g, nullptr), cudaErrorInvalidValue);
    }
  }
}

// ---- flash attention ----------------------------------------------------------------------

struct AttnCase {
  std::int64_t batch, heads, kv_heads, seq_q, seq_k, dim;
  bool causal;
  at::ScalarType type;
  std::int64_t window = 0;  // a sliding window of this many keys (without causal, both ways); 0: none
  std::int64_t docs = 0;    // packed documents of random lengths from 1 to this; 0: none
  std::int64_t offset = 0;  // the queries' first token among the keys' (causal only)
  bool sinks = false;       // an attention sink per query head (random logits)
};

std::string name(const AttnCase& c) {
  return "b" + std::to_string(c.batch) + " h" + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " s" +
         std::to_string(c.seq_q) + "x" + std::to_string(c.seq_k) + " d" + std::to_string(c.dim) +
         (c.causal ? " causal " : " ") + (c.window > 0 ? "window " + std::to_string(c.window) + " " : "") +
         (c.docs > 0 ? "docs " + std::to_string(c.docs) + " " : "") +
         (c.offset > 0 ? "offset " + std::to_string(c.offset) + " " : "") + (c.sinks ? "sinks " : "") +
         c10::toString(c.type);
}

dtrain_attention_strides strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The forward's params for q, o [batch, heads, seq_q, dim], k, v [batch, kv_heads, seq_k,
// dim] and lse, in their own strides.
dtrain_attention_fwd_params fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o,
                                       at::Tensor& lse, bool causal, double scale, dtrain_attention_kernel kernel,
                                       std::int64_t window = 0, std::int64_t offset = 0) {
  dtrain_attention_fwd_params f{};
  f.q = q.data_ptr();
  f.k = k.data_ptr();
  f.v = v.data_ptr();
  f.o = o.data_ptr();
  f.lse = lse.data_ptr<float>();
  f.q_stride = strides(q);
  f.k_stride = strides(k);
  f.v_stride = strides(v);
  f.o_stride = strides(o);
  f.batch = q.size(0);
  f.heads = q.size(1);
  f.kv_heads = k.size(1);
  f.seq_q = q.size(2);
  f.seq_k = k.size(2);
  f.head_dim = q.size(3);
  f.scale = static_cast<float>(scale);
  f.causal = causal;
  f.window = window;
  f.query_offset = offset;
  f.dtype = kernel_dtype(q);
  f.kernel = kernel;
  return f;
}

// The backward's params for the forward f's inputs, its output o, the upstream gradient
// dout and the gradient buffers dq, dk, dv (all in their own strides); the workspace is
// filled in by the caller.
dtrain_attention_bwd_params bwd_params(const dtrain_attention_fwd_params& f, const at::Tensor& o,
                                       const at::Tensor& dout, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                                       dtrain_attention_kernel kernel) {
  dtrain_attention_bwd_params g{};
  g.kernel = kernel;
  g.q = f.q;
  g.k = f.k;
  g.v = f.v;
  g.o = o.data_ptr();
  g.dout = dout.data_ptr();
  g.lse = f.lse;
  g.dq = dq.data_ptr();
  g.dk = dk.data_ptr();
  g.dv = dv.data_ptr();
  g.q_stride = f.q_stride;
  g.k_stride = f.k_stride;
  g.v_stride = f.v_stride;
  g.o_stride = strides(o);
  g.dout_stride = strides(dout);
  g.dq_stride = strides(dq);
  g.dk_stride = strides(dk);
  g.dv_stride = strides(dv);
  g.batch = f.batch;
  g.heads = f.heads;
  g.kv_heads = f.kv_heads;
  g.seq_q = f.seq_q;
  g.seq_k = f.seq_k;
  g.head_dim = f.head_dim;
  g.scale = f.scale;
  g.causal = f.causal;
  g.window = f.window;
  g.documents = f.documents;
  g.query_offset = f.query_offset;
  g.dtype = f.dtype;
  return g;
}

// Runs the forward f with a fresh poisoned workspace (the call zeroes what it uses).
cudaError_t run_fwd(dtrain_attention_fwd_params& f) {
  auto ws = poisoned({static_cast<std::int64_t>(dtrain_attention_fwd_workspace_bytes(&f) / sizeof(float))}, at::kFloat);
  f.workspace = ws.data_ptr();
  const cudaError_t e = dtrain_attention_fwd(&f, nullptr);
  kernel_sync();
  f.workspace = nullptr;
  return e;
}

// Runs the backward g with a poisoned workspace of the size it asks for.
cudaError_t run_bwd(dtrain_attention_bwd_params& g) {
  auto ws = poisoned({static_cast<std::int64_t>(dtrain_attention_bwd_workspace_bytes(&g) / sizeof(float))}, at::kFloat);
  g.workspace = ws.data_ptr();
  const cudaError_t e = dtrain_attention_bwd(&g, nullptr);
  kernel_sync();
  return e;
}

// Either pass's launch (run: run_fwd or run_bwd) refuses params p with dropout outside
// [0, 1) (NaN too) or a negative or non-finite softcap.
template <typename Params, typename Run>
void expect_bad_dropout_and_softcap_refused(const Params& p, const Run& run) {
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  for (float bad : {-0.1f, 1.f, kNan}) {
    auto g = p;
    g.dropout_p = bad;
    EXPECT_EQ(run(g), cudaErrorInvalidValue) << "dropout " << bad;
  }
  for (float bad : {-1.f, kNan, kInf}) {
    auto g = p;
    g.softcap = bad;
    EXPECT_EQ(run(g), cudaErrorInvalidValue) << "softcap " << bad;
  }
}

// Which keys each query sees: [seq_q, seq_k], true where it sees the key (causal: keys j
// <= o + i, query i being token o + i of the keys' sequence, o the offset; a sliding
// window of w keys: o + i - w < j <= o + i, without causal i - w < j < i + w); with packed documents (doc_ids [batch,
// >= seq_k], a document number per token of the keys' sequence, which may go on past them),
// [batch, 1, seq_q, seq_k], and only keys of the query's own document (without causal,
// all of them).
at::Tensor visible(std::int64_t seq_q, std::int64_t seq_k, bool causal, std::int64_t window, const at::Device& device,
                   const at::Tensor& doc_ids = {}, std::int64_t offset = 0) {
  auto ones = torch::ones({seq_q, seq_k}, torch::TensorOptions().dtype(torch::kBool).device(device));
  auto mask = causal ? ones.tril(offset) : window > 0 ? ones.tril(window - 1) : ones;
  if (window > 0) mask = mask.logical_and(ones.triu(offset - (window - 1)));
  if (!doc_ids.defined()) return mask;
  const auto ids = doc_ids.to(device);
  return mask.logical_and(ids.narrow(1, offset, seq_q).unsqueeze(2).eq(ids.narrow(1, 0, seq_k).unsqueeze(1)))
      .unsqueeze(1);
}

// Document numbers [batch, seq] (int64, CPU) of packed documents whose lengths are drawn
// uniformly from 1 to max_len, each batch its own.
at::Tensor random_documents(std::int64_t batch, std::int64_t seq, std::int64_t max_len) {
  auto ids = torch::empty({batch, seq}, torch::kLong);
  auto a = ids.accessor<std::int64_t, 2>();
  for (std::int64_t b = 0; b < batch; ++b) {
    std::int64_t doc = 0;
    for (std::int64_t i = 0; i < seq; ++doc) {
      const std::int64_t len = torch::randint(1, max_len + 1, {1}).item<std::int64_t>();
      for (std::int64_t j = i; j < std::min(seq, i + len); ++j) a[b][j] = doc;
      i += len;
    }
  }
  return ids;
}

// The kernels' form of doc_ids: each token's document start and end, int32 [batch, seq],
// written out by scanning runs (the op derives them another way).
std::pair<at::Tensor, at::Tensor> document_bounds(const at::Tensor& doc_ids) {
  auto start = torch::empty(doc_ids.sizes(), torch::kInt), end = torch::empty(doc_ids.sizes(), torch::kInt);
  auto ids = doc_ids.accessor<std::int64_t, 2>();
  auto s = start.accessor<std::int32_t, 2>(), e = end.accessor<std::int32_t, 2>();
  const std::int64_t seq = doc_ids.size(1);
  for (std::int64_t b = 0; b < doc_ids.size(0); ++b) {
    for (std::int64_t i = 0; i < seq;) {
      std::int64_t j = i;
      while (j < seq && ids[b][j] == ids[b][i]) ++j;
      for (std::int64_t t = i; t < j; ++t) s[b][t] = static_cast<std::int32_t>(i), e[b][t] = static_cast<std::int32_t>(j);
      i = j;
    }
  }
  return {start, end};
}

// The scaled scores q k^T scale of the keys each query sees (visible's), -inf elsewhere;
// kv heads repeated for GQA; [batch, heads, seq_q, seq_k].
at::Tensor masked_scores(const at::Tensor& q, const at::Tensor& k, bool causal, double scale, std::int64_t window,
                         const at::Tensor& doc_ids, std::int64_t offset) {
  auto s = at::matmul(q, k.repeat_interleave(q.size(1) / k.size(1), 1).transpose(-2, -1)) * scale;
  if (!causal && window == 0 && !doc_ids.defined()) return s;
  const auto vis = visible(q.size(2), k.size(2), causal, window, q.device(), doc_ids, offset);
  return s.masked_fill(vis.logical_not(), -std::numeric_limits<double>::infinity());
}

// masked_scores with each head's sink logit as one more column: [..., seq_k + 1].
at::Tensor with_sinks(const at::Tensor& s, const at::Tensor& sinks) {
  return at::cat({s, sinks.to(s.scalar_type()).view({1, -1, 1, 1}).expand({s.size(0), -1, s.size(2), 1})}, -1);
}

// softmax(q k^T scale) v in the inputs' arithmetic (a naive implementation for 16-bit
// inputs, softmax in float32; the reference for float64); kv heads repeated for GQA. A
// row that sees no key (a window past the keys' end) gives 0, as the kernels do. sinks
// (float [heads]): one more logit per head in each row's softmax, with no value.
at::Tensor attention_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                          std::int64_t window = 0, const at::Tensor& doc_ids = {}, std::int64_t offset = 0,
                          const at::Tensor& sinks = {}) {
  auto s = masked_scores(q, k, causal, scale, window, doc_ids, offset);
  auto sf = q.scalar_type() == at::kDouble ? s : s.to(at::kFloat);
  if (sinks.defined()) sf = with_sinks(sf, sinks);
  // Rows that see nothing (no key, no sink) keep finite scores (no NaN) and give 0.
  const auto none = (sf == -std::numeric_limits<double>::infinity()).all(-1, /*keepdim=*/true);
  auto probs = at::softmax(sf.masked_fill(none, 0.0), -1).masked_fill(none, 0.0);
  if (sinks.defined()) probs = probs.narrow(-1, 0, k.size(2));
  return at::matmul(probs.to(q.scalar_type()), v.repeat_interleave(q.size(1) / k.size(1), 1));
}

// One case: every forward kernel this device runs against the float64 reference and the
// naive 16-bit implementation (output and log-sum-exp), then every backward kernel (dq, dk,
// dv), each into fresh poisoned outputs; and the named refusals of invalid masks.
void expect_attention_case_within_twice_the_naive_error(const AttnCase& c) {
  SCOPED_TRACE(name(c));
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  // q laid out [batch, seq, heads, dim] and viewed [batch, heads, seq, dim]: strided.
  auto q = torch::randn({c.batch, c.seq_q, c.heads, c.dim}).to(c.type).transpose(1, 2);
  auto k = torch::randn({c.batch, c.kv_heads, c.seq_k, c.dim}).to(c.type);
  auto v = torch::randn({c.batch, c.kv_heads, c.seq_k, c.dim}).to(c.type);
  auto dout = torch::randn({c.batch, c.heads, c.seq_q, c.dim}).to(c.type);

  auto qr = q.to(at::kDouble).requires_grad_(), kr = k.to(at::kDouble).requires_grad_(),
       vr = v.to(at::kDouble).requires_grad_();
  at::Tensor doc_ids, doc_start, doc_end;
  if (c.docs > 0) {
    // With an offset, rows longer than the keys and the queries (documents.stride), as a
    // context-parallel rank's numbers over the whole sequence are.
    doc_ids = random_documents(c.batch, std::max(c.seq_k, c.offset + c.seq_q) + (c.offset > 0 ? 8 : 0), c.docs);
    std::tie(doc_start, doc_end) = document_bounds(doc_ids);
    doc_start = dev(doc_start), doc_end = dev(doc_end);
  }
  // Sinks of either sign, some large enough to outweigh every key a row sees.
  const auto sinks = c.sinks ? torch::randn({c.heads}) * 3 + 2 : at::Tensor();
  const auto sinks_d = c.sinks ? dev(sinks) : at::Tensor();
  auto want = attention_math(qr, kr, vr, c.causal, scale, c.window, doc_ids, c.offset, sinks);
  want.backward(dout.to(at::kDouble));
  // The naive 16-bit implementation, on the kernels' device (CPU matmuls in float16 are
  // not what a GPU user would compare against).
  auto qn = dev(q).detach().requires_grad_(), kn = dev(k).detach().requires_grad_(),
       vn = dev(v).detach().requires_grad_();
  auto naive = attention_math(qn, kn, vn, c.causal, scale, c.window, doc_ids, c.offset, sinks_d);
  naive.backward(dev(dout));

  auto qd = dev(q.transpose(1, 2).contiguous()).transpose(1, 2);  // keep the strided layout
  auto kd = dev(k), vd = dev(v), dod = dev(dout);
  at::Tensor o, lse;
  dtrain_attention_fwd_params f{};
  // Every forward kernel this device runs (mma.sync; wgmma on Hopper and in the
  // emulator; see attention_kernels), each into fresh poisoned outputs; the backward
  // takes the last one's.
  for (auto kernel : attention_kernels()) {
  if (!dtrain_attention_fwd_kernel_takes_head_dim(kernel, c.dim)) {
    // A kernel without this head dim (none today: the forward's wgmma goes up to 256, as
    // mma.sync): asked for by name, refused, and nothing written; AUTO runs mma.sync.
    auto o2 = poisoned({c.batch, c.heads, c.seq_q, c.dim}, c.type);
    auto lse2 = poisoned({c.batch, c.heads, c.seq_q}, at::kFloat);
    auto g = fwd_params(qd, kd, vd, o2, lse2, c.causal, scale, kernel, c.window, c.offset);
    g.documents = f.documents;
    EXPECT_EQ(run_fwd(g), cudaErrorInvalidValue) << "wgmma at head dim " << c.dim;
    EXPECT_TRUE(o2.isnan().all().item<bool>()) << "a refused forward wrote its output";
    kernel = DTRAIN_ATTENTION_KERNEL_AUTO;
  }
  SCOPED_TRACE(kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma.sync forward"
               : kernel == DTRAIN_ATTENTION_KERNEL_AUTO ? "auto forward" : "wgmma forward");
  o = poisoned({c.batch, c.heads, c.seq_q, c.dim}, c.type);
  lse = poisoned({c.batch, c.heads, c.seq_q}, at::kFloat);
  f = fwd_params(qd, kd, vd, o, lse, c.causal, scale, kernel, c.window, c.offset);
  if (c.sinks) f.sinks = sinks_d.data_ptr<float>();
  if (c.docs > 0) {
    f.documents = {doc_start.data_ptr<std::int32_t>(), doc_end.data_ptr<std::int32_t>(),
                   c.offset > 0 || c.seq_q > c.seq_k ? doc_start.size(1) : 0};
    auto g = f;  // documents number the keys' and the queries' tokens, need both bounds
    g.documents.end = nullptr;
    EXPECT_EQ(run_fwd(g), cudaErrorInvalidValue) << "document starts alone";
    g = f;
    g.documents.stride = std::max(f.seq_k, f.query_offset + f.seq_q) - 1;
    EXPECT_EQ(run_fwd(g), cudaErrorInvalidValue) << "document rows shorter than the keys and queries";
    if (f.documents.stride == 0) {
      g = f;
      g.seq_q = f.seq_k + 1;
      EXPECT_EQ(run_fwd(g), cudaErrorInvalidValue) << "rows of seq_k tokens, more queries";
    }
  }
  if (c.offset > 0) {  // an offset is causal only, and never negative
    auto g = f;
    g.causal = 0;
    g.window = 0;
    g.documents = {};
    EXPECT_EQ(run_fwd(g), cudaErrorInvalidValue) << "an offset without causal";
    g = f;
    g.query_offset = -1;
    EXPECT_EQ(run_fwd(g), cudaErrorInvalidValue) << "offset -1";
  }
  EXPECT_EQ(dtrain_attention_fwd(&f, nullptr), cudaErrorInvalidValue) << "no workspace";
  // Bad dropout or softcap (the ops' tests run both on each kernel).
  expect_bad_dropout_and_softcap_refused(f, [](dtrain_attention_fwd_params& g) { return run_fwd(g); });
  if (c.window > 0) {  // a window is never negative
    auto g = f;
    g.window = -1;
    EXPECT_EQ(run_fwd(g), cudaErrorInvalidValue) << "window -1";
  }
  ASSERT_EQ(run_fwd(f), cudaSuccess);
  EXPECT_FALSE(o.isnan().any().item<bool>());
  const double err = max_abs(o, want), naive_err = max_abs(naive, want);
  EXPECT_LE(err, 2 * naive_err + 1e-3) << "kernel " << err << ", naive " << naive_err;
  {  // The log-sum-exp of the scaled scores (and the sink) (without a window every row
     // sees key 0; with one, a row that sees no key has +inf, or its sink).
    auto s = masked_scores(q.to(at::kDouble), k.to(at::kDouble), c.causal, scale, c.window, doc_ids, c.offset);
    if (c.sinks) s = with_sinks(s, sinks);
    auto want_lse = s.logsumexp(-1);
    want_lse = want_lse.masked_fill(want_lse == -std::numeric_limits<double>::infinity(),
                                    std::numeric_limits<double>::infinity());
    const auto lse_d = lse.to(at::kDouble).cpu();
    EXPECT_TRUE(lse_d.isinf().equal(want_lse.isinf())) << "rows that see no key";
    const auto finite = want_lse.isfinite();
    EXPECT_LT(max_abs(lse_d.masked_select(finite), want_lse.masked_select(finite)), 1e-3);
  }
  }

  // Every backward kernel this device runs, each into fresh poisoned outputs.
  for (auto kernel : attention_kernels()) {
  auto dq = poisoned({c.batch, c.heads, c.seq_q, c.dim}, c.type);
  auto dk = poisoned(k.sizes(), c.type), dv = poisoned(v.sizes(), c.type);
  if (!dtrain_attention_bwd_kernel_takes_head_dim(kernel, c.dim)) {
    // A kernel without this head dim (none today: wgmma's backward goes up to 256, as
    // mma.sync): asked for by name, refused, and nothing written; AUTO runs mma.sync.
    auto g = bwd_params(f, o, dod, dq, dk, dv, kernel);
    EXPECT_EQ(run_bwd(g), cudaErrorInvalidValue) << "wgmma at head dim " << c.dim;
    EXPECT_TRUE(dq.isnan().all().item<bool>()) << "a refused backward wrote dq";
    kernel = DTRAIN_ATTENTION_KERNEL_AUTO;
  }
  SCOPED_TRACE(kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma.sync backward"
               : kernel == DTRAIN_ATTENTION_KERNEL_AUTO ? "auto backward" : "wgmma backward");
  auto g = bwd_params(f, o, dod, dq, dk, dv, kernel);
  // Bad dropout or softcap refused, nothing written.
  expect_bad_dropout_and_softcap_refused(g, [](dtrain_attention_bwd_params& w) { return run_bwd(w); });
  EXPECT_TRUE(dq.isnan().all().item<bool>()) << "a refused backward wrote dq";
  ASSERT_EQ(run_bwd(g), cudaSuccess);
  for (const auto& [what, got, ref, nv] : {std::make_tuple("dq", dq, qr.grad(), qn.grad()),
                                          std::make_tuple("dk", dk, kr.grad(), kn.grad()),
                                          std::make_tuple("dv", dv, vr.grad(), vn.grad())}) {
    EXPECT_FALSE(got.isnan().any().item<bool>()) << what;
    const double e = max_abs(got, ref), ne = max_abs(nv, ref);
    EXPECT_LE(e, 2 * ne + 1e-3) << what << ": kernel " << e << ", naive " << ne;
  }
  }
}

TEST(KERNEL_SUITE(FlashAttention), ForwardAndBackwardWithinTwiceTheNaiveError) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(5);
  std::vector<AttnCase> cases = {
      {2, 4, 2, 100, 100, 64, true, at::kBFloat16},  {2, 4, 2, 100, 100, 64, false, at::kBFloat16},
      {1, 2, 1, 70, 130, 64, false, at::kHalf},      {1, 2, 2, 130, 70, 64, true, at::kHalf},
      {1, 2, 1, 80, 80, 128, true, at::kBFloat16},   {1, 1, 1, 65, 65, 128, false, at::kHalf},
      {1, 2, 1, 150, 200, 128, true, at::kBFloat16},
      // Three and more key tiles of 128 (the wgmma forward's double buffers wrap around).
      {1, 2, 1, 40, 400, 64, false, at::kBFloat16},  {1, 1, 1, 300, 300, 128, true, at::kHalf},
      // Causal grids of several (batch, head) pairs and tiles in tile_order's sections (the
      // emulator's are small: 64 KiB of operands), and keys no query sees (zero dk, dv).
      {2, 2, 1, 150, 260, 64, true, at::kHalf},
      // The other head dims: 32 and 96 have mma.sync kernels of their own (wgmma runs them
      // in its 64 and 128); 8, 40, 80 and 120 run in the next kernel up, zero-padded.
      {1, 2, 2, 65, 65, 32, false, at::kHalf},       {1, 2, 1, 70, 90, 96, true, at::kBFloat16},
      {1, 2, 1, 100, 100, 80, true, at::kHalf},      {1, 1, 1, 40, 150, 40, false, at::kBFloat16},
      {1, 2, 1, 33, 33, 8, true, at::kBFloat16},     {1, 1, 1, 50, 70, 120, true, at::kHalf},
      // More query blocks than the persistent wgmma forward has blocks (the emulator's 4
      // SMs x 2), causal and not: each block takes several, from the counter.
      {2, 4, 2, 200, 200, 64, true, at::kBFloat16},  {1, 4, 2, 260, 130, 128, false, at::kHalf},
      // Sliding windows: narrower than a key tile (blocks skip their first tiles and mask
      // both edges), of one key, of exactly a tile, at head dim 32 where the last query that
      // sees a backward block's last key starts a query tile (130 = 2 tiles + 2), and past
      // the keys' end (rows 109 and on see no key: log-sum-exp +inf, output and dq 0).
      {1, 2, 1, 300, 300, 64, true, at::kBFloat16, 100}, {1, 2, 2, 260, 260, 128, true, at::kHalf, 1},
      {2, 4, 2, 200, 200, 64, true, at::kBFloat16, 64},  {1, 2, 1, 250, 250, 32, true, at::kHalf, 130},
      {1, 2, 1, 300, 60, 128, true, at::kBFloat16, 50},
      // Packed documents: shorter than a tile (blocks mask their documents' edges and skip
      // nothing), longer than one (the forward starts at the first row's document's tile,
      // the backward stops at the last key's document's end), of one token each (a row sees
      // itself alone), with a window, over 2 batches of their own splits.
      {2, 4, 2, 300, 300, 64, true, at::kBFloat16, 0, 40},  {1, 2, 1, 260, 260, 128, true, at::kHalf, 0, 150},
      {1, 2, 1, 130, 130, 96, true, at::kHalf, 0, 1},        {2, 2, 2, 200, 200, 32, true, at::kBFloat16, 30, 90},
      // Packed documents without causal (a query sees its whole document): shorter than a
      // tile (both edges masked on every side), longer than one (the forward stops at its
      // last row's document's end, the backward starts at its first key's document's start),
      // of one token each, more keys than queries (the later keys' documents hold queries
      // only up to 99: their dk, dv partly 0), more queries than keys (rows whose
      // document starts past the keys see none: log-sum-exp +inf, output 0), GQA, 2
      // batches of their own splits.
      {2, 2, 1, 200, 200, 64, false, at::kBFloat16, 0, 40}, {1, 2, 1, 260, 260, 128, false, at::kHalf, 0, 150},
      {1, 2, 1, 130, 130, 32, false, at::kHalf, 0, 1},       {1, 4, 2, 100, 230, 96, false, at::kBFloat16, 0, 70},
      {1, 2, 2, 230, 100, 128, false, at::kHalf, 0, 60},
      // Windows without causal (i - W < j < i + W): narrower than a tile (blocks skip tiles
      // on both sides), of one key (a row sees itself), wider than two tiles at D 32, with
      // documents (the nearer bound of each side), more queries than keys (rows W and more
      // past the keys see none).
      {1, 2, 1, 300, 300, 64, false, at::kBFloat16, 50}, {1, 2, 2, 150, 150, 128, false, at::kHalf, 1},
      {1, 2, 1, 250, 250, 32, false, at::kHalf, 130},    {2, 2, 1, 200, 200, 96, false, at::kBFloat16, 30, 90},
      {1, 2, 1, 230, 100, 128, false, at::kBFloat16, 40},
      // Query offsets (a context-parallel chunk of queries among the gathered keys): the
      // queries end with the keys (bottom-right alignment; the diagonal crosses tiles at
      // another phase), end before them (later keys no query sees: zero dk, dv), start past
      // several key tiles; with a window (blocks skip the tiles before it), with documents
      // (queries read theirs at their own tokens), GQA. And queries past the keys' end (a
      // ring attention block of earlier keys): every key seen; with a window that leaves
      // the last rows none (log-sum-exp +inf); with documents over the rows that hold both
      // (queries 100-159 over keys 0-119: the later ones see a key only through a document
      // that began among the keys).
      {1, 4, 2, 70, 200, 64, true, at::kBFloat16, 0, 0, 130},  {2, 2, 1, 130, 300, 128, true, at::kHalf, 0, 0, 100},
      {1, 2, 2, 100, 400, 32, true, at::kHalf, 0, 0, 290},     {1, 2, 1, 150, 330, 64, true, at::kBFloat16, 50, 0, 170},
      {2, 4, 2, 90, 260, 128, true, at::kBFloat16, 0, 40, 150}, {1, 2, 1, 60, 250, 96, true, at::kHalf, 30, 25, 190},
      {1, 2, 1, 100, 200, 64, true, at::kBFloat16, 0, 0, 300}, {1, 2, 1, 130, 150, 128, true, at::kHalf, 120, 0, 200},
      {1, 4, 2, 60, 120, 64, true, at::kBFloat16, 0, 30, 100},
      // Head dims above 128: D 256 kernels (mma.sync's backward: a block of 8 warps, two
      // per 16 keys; wgmma's forward: key tiles of 64, so several per block here; wgmma's
      // backward: blocks of 64 keys, its two consumers on half the columns each, query
      // tiles wrapping round its two stages); 136 and 200 zero-padded into them; GQA, a
      // window, documents, an offset.
      {1, 2, 1, 100, 100, 256, true, at::kBFloat16},  {1, 2, 2, 70, 130, 256, false, at::kHalf},
      {1, 4, 2, 150, 150, 200, true, at::kHalf, 70},  {1, 2, 1, 90, 90, 136, false, at::kBFloat16},
      {1, 2, 1, 130, 130, 256, true, at::kBFloat16, 0, 40},  {1, 2, 1, 150, 150, 256, false, at::kHalf, 0, 50},
      {1, 2, 2, 70, 200, 256, true, at::kHalf, 0, 0, 130},
      // Attention sinks (one more logit per head, no value): causal and not, GQA, rows past
      // the window's reach that see the sink alone (output 0, log-sum-exp the sink), with
      // documents, with an offset at D 256.
      {1, 2, 1, 100, 100, 64, true, at::kBFloat16, 0, 0, 0, true},
      {1, 4, 2, 70, 130, 128, false, at::kHalf, 0, 0, 0, true},
      {1, 2, 1, 150, 60, 64, true, at::kBFloat16, 50, 0, 0, true},
      {1, 2, 2, 130, 130, 32, true, at::kHalf, 0, 40, 0, true},
      {1, 2, 1, 70, 200, 256, true, at::kHalf, 0, 0, 130, true},
  };
  if (kLargeCases) {
    cases.insert(cases.end(), {{2, 8, 2, 1000, 1000, 128, true, at::kBFloat16},
                               {1, 6, 6, 777, 777, 64, false, at::kBFloat16},
                               {1, 4, 1, 2049, 2049, 128, true, at::kHalf},
                               {3, 2, 2, 1, 257, 64, false, at::kBFloat16},
                               {1, 4, 2, 1000, 1000, 96, true, at::kBFloat16},
                               {2, 4, 4, 513, 513, 80, false, at::kHalf},
                               {1, 8, 8, 777, 777, 32, true, at::kBFloat16},
                               // More query blocks (512) than an H200 has SMs (132).
                               {4, 16, 4, 1024, 1024, 128, true, at::kBFloat16},
                               {1, 4, 2, 2049, 2049, 128, true, at::kBFloat16, 512},
                               {1, 4, 4, 1000, 1000, 64, true, at::kHalf, 300},
                               {2, 8, 2, 2049, 2049, 128, true, at::kBFloat16, 0, 700},
                               {1, 4, 4, 1000, 1000, 64, true, at::kHalf, 200, 100},
                               {2, 8, 2, 512, 2048, 128, true, at::kBFloat16, 0, 0, 1536},
                               {1, 4, 2, 700, 2049, 128, true, at::kHalf, 300, 200, 1000},
                               {2, 8, 4, 1000, 1000, 256, true, at::kBFloat16},
                               {1, 4, 4, 777, 777, 256, false, at::kHalf},
                               {1, 4, 2, 1030, 1030, 192, true, at::kBFloat16, 300, 200}});
  }
  for (const auto& c : cases) expect_attention_case_within_twice_the_naive_error(c);
}

TEST(KERNEL_SUITE(FlashAttention), RefusesWhatItDoesNotTake) {
  dtrain_attention_fwd_params f{};
  EXPECT_EQ(dtrain_attention_fwd(&f, nullptr), cudaErrorInvalidValue);
  for (std::int64_t d : {8, 32, 40, 64, 80, 96, 120, 128, 136, 200, 256}) {
    EXPECT_EQ(dtrain_attention_supports_head_dim(d), 1) << d;
    for (auto kernel : {DTRAIN_ATTENTION_KERNEL_AUTO, DTRAIN_ATTENTION_KERNEL_MMA}) {
      EXPECT_EQ(dtrain_attention_fwd_kernel_takes_head_dim(kernel, d), 1) << d;
      EXPECT_EQ(dtrain_attention_bwd_kernel_takes_head_dim(kernel, d), 1) << d;
    }
    EXPECT_EQ(dtrain_attention_fwd_kernel_takes_head_dim(DTRAIN_ATTENTION_KERNEL_WGMMA, d), 1) << d;
    EXPECT_EQ(dtrain_attention_bwd_kernel_takes_head_dim(DTRAIN_ATTENTION_KERNEL_WGMMA, d), 1) << d;
  }
  for (std::int64_t d : {0, 4, 12, 100, 260, 264, 512}) {
    EXPECT_EQ(dtrain_attention_supports_head_dim(d), 0) << d;
    for (auto kernel : {DTRAIN_ATTENTION_KERNEL_AUTO, DTRAIN_ATTENTION_KERNEL_MMA, DTRAIN_ATTENTION_KERNEL_WGMMA}) {
      EXPECT_EQ(dtrain_attention_fwd_kernel_takes_head_dim(kernel, d), 0) << d;
      EXPECT_EQ(dtrain_attention_bwd_kernel_takes_head_dim(kernel, d), 0) << d;
    }
  }
  EXPECT_EQ(dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_AUTO), 1);
  EXPECT_EQ(dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_MMA), 1);
  EXPECT_EQ(dtrain_attention_kernel_available(static_cast<dtrain_attention_kernel>(7)), 0);
}

// The kernels' shared memory per block against what GPUs give a block: every mma.sync
// kernel fits an A100's 163 KB, and on devices that give a block less than the D 256
// kernels' default tiles need (132 KB forward, 151 KB backward: compute capability 8.6,
// 8.9 and 12.x give 99 KB) those run in compact tiles that fit 99 KB, so every head dim
// runs on every sm_80 and later GPU. Each head dim reports the tiles its launch takes on
// this device (136 runs in 256's). wgmma's all fit Hopper's 227 KB. Where a block gets
// less than even the compact tiles need (the emulator's device set to 64 KB), a launch of
// them is refused with nothing written, and the head dims that fit still run.
TEST(KERNEL_SUITE(FlashAttention), SharedMemoryPerBlockFitsTheDevice) {
  KERNEL_DEVICE_OR_SKIP();
  constexpr std::size_t kA100 = 163 * 1024, kSm89 = 99 * 1024, kHopper = 227 * 1024;
  const std::size_t have = dtrain_attention_device_smem_bytes();
  EXPECT_GT(have, 0u);
  for (std::int64_t d = 8; d <= 256; d += 8) {
    const std::size_t fwd = dtrain_attention_fwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, d),
                      bwd = dtrain_attention_bwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, d);
    EXPECT_GT(fwd, 0u) << d;
    EXPECT_GT(bwd, 0u) << d;
    EXPECT_LE(std::max(fwd, bwd), std::min(kA100, have)) << d;
    if (have >= kA100) EXPECT_EQ(std::max(fwd, bwd) <= kSm89, d <= 128) << d << ": " << fwd << ", " << bwd;
    if (dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_WGMMA)) {
      // Both wgmma passes take every head dim, and AUTO runs them where they fit.
      for (auto smem : {dtrain_attention_fwd_smem_bytes, dtrain_attention_bwd_smem_bytes}) {
        const std::size_t wgmma = smem(DTRAIN_ATTENTION_KERNEL_WGMMA, d);
        EXPECT_GT(wgmma, 0u) << d;
        EXPECT_LE(wgmma, kHopper) << d;
        if (have >= kHopper) EXPECT_EQ(smem(DTRAIN_ATTENTION_KERNEL_AUTO, d), wgmma) << d;
      }
    }
  }
  EXPECT_EQ(dtrain_attention_fwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, 136),
            dtrain_attention_fwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, 256));
  EXPECT_EQ(dtrain_attention_fwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, 100), 0u);  // no kernel
#ifdef DTRAIN_KERNELS_EMULATE
  {  // 99 KB: D 256 in its compact tiles, which fit (forward exactly: 101376 bytes)
    const ScopedBlockSmemLimit limit(kSm89);
    EXPECT_EQ(dtrain_attention_device_smem_bytes(), kSm89);
    for (std::int64_t d : {136, 256}) {
      EXPECT_EQ(dtrain_attention_fwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, d), kSm89) << d;
      EXPECT_LE(dtrain_attention_bwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, d), 72 * 1024) << d;
    }
  }
  constexpr std::size_t kSmall = 64 * 1024;
  const ScopedBlockSmemLimit limit(kSmall);
  EXPECT_EQ(dtrain_attention_device_smem_bytes(), kSmall);
  torch::manual_seed(13);
  for (std::int64_t d : {96, 256}) {
    SCOPED_TRACE("head dim " + std::to_string(d));
    auto q = dev(torch::randn({1, 2, 40, d}).to(at::kBFloat16)), k = dev(torch::randn({1, 2, 40, d}).to(at::kBFloat16));
    auto o = poisoned({1, 2, 40, d}, at::kBFloat16), lse = poisoned({1, 2, 40}, at::kFloat);
    auto f = fwd_params(q, k, k, o, lse, true, 0.125, DTRAIN_ATTENTION_KERNEL_MMA);
    EXPECT_EQ(run_fwd(f), d <= 128 ? cudaSuccess : cudaErrorInvalidValue);
    EXPECT_EQ(o.isnan().all().item<bool>(), d > 128) << "a refused forward wrote its output";
    if (d <= 128) {
      auto dq = poisoned({1, 2, 40, d}, at::kBFloat16), dk = poisoned({1, 2, 40, d}, at::kBFloat16),
           dv = poisoned({1, 2, 40, d}, at::kBFloat16);
      auto g = bwd_params(f, o, q, dq, dk, dv, DTRAIN_ATTENTION_KERNEL_MMA);
      EXPECT_EQ(run_bwd(g), cudaSuccess);
      EXPECT_FALSE(dq.isnan().any().item<bool>());
    } else {  // the backward on the forward's inputs as its own: refused too, nothing written
      auto dq = poisoned({1, 2, 40, d}, at::kBFloat16), dk = poisoned({1, 2, 40, d}, at::kBFloat16),
           dv = poisoned({1, 2, 40, d}, at::kBFloat16);
      auto g = bwd_params(f, q, q, dq, dk, dv, DTRAIN_ATTENTION_KERNEL_MMA);
      EXPECT_EQ(run_bwd(g), cudaErrorInvalidValue);
      EXPECT_TRUE(dq.isnan().all().item<bool>() && dk.isnan().all().item<bool>());
    }
  }
#endif
}

// Head dims above 128 where a block gets 99 KB (the launchers capped so, on any device;
// on a GPU that gives 99 KB the main test runs them anyway): mma.sync's compact tiles
// (forward: key tiles of 32; backward: blocks of 4 warps, 32 keys by 32 queries), against
// the reference as in ForwardAndBackwardWithinTwiceTheNaiveError. Several key and query
// tiles, tails, GQA, non-causal, a window, documents (causal and not), an offset, zero-padded head dims.
// AUTO under the cap runs mma.sync where wgmma's tiles do not fit. And the cap itself: a
// smaller one refuses them, nothing written.
TEST(KERNEL_SUITE(FlashAttention), HeadDim256RunsInCompactTilesWhereABlockGets99Kb) {
  KERNEL_DEVICE_OR_SKIP();
  constexpr std::size_t kSm89 = 99 * 1024;
  const ScopedAttentionSmemCap cap(kSm89);
  ASSERT_EQ(dtrain_attention_device_smem_bytes(), kSm89);
  ASSERT_EQ(dtrain_attention_fwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, 256), kSm89);
  ASSERT_LE(dtrain_attention_bwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_MMA, 256), 72 * 1024);
  dtrain::env::ScopedOverride mma(dtrain::env::kAttentionKernel, "mma");  // wgmma's GPUs give 227 KB
  torch::manual_seed(17);
  for (const AttnCase& c : std::vector<AttnCase>{{1, 2, 1, 100, 100, 256, true, at::kBFloat16},
                                                 {1, 4, 2, 70, 130, 256, false, at::kHalf},
                                                 {1, 4, 2, 150, 150, 200, true, at::kHalf, 70},
                                                 {1, 2, 1, 90, 90, 136, false, at::kBFloat16},
                                                 {1, 2, 1, 130, 130, 256, true, at::kBFloat16, 0, 40},
                                                 {1, 2, 1, 150, 150, 256, false, at::kHalf, 0, 50},
                                                 {1, 2, 2, 70, 200, 256, true, at::kHalf, 0, 0, 130}}) {
    expect_attention_case_within_twice_the_naive_error(c);
  }
  {  // AUTO under the cap: mma.sync wherever wgmma's tiles (Hopper's, 227 KB) do not fit
    for (std::int64_t d : {64, 128, 256}) {
      const std::size_t fwd = dtrain_attention_fwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_AUTO, d),
                        bwd = dtrain_attention_bwd_smem_bytes(DTRAIN_ATTENTION_KERNEL_AUTO, d);
      EXPECT_GT(fwd, 0u) << d;
      EXPECT_GT(bwd, 0u) << d;
      EXPECT_LE(std::max(fwd, bwd), kSm89) << d;
    }
    auto q = dev(torch::randn({1, 2, 40, 256}).to(at::kBFloat16));
    auto o = poisoned({1, 2, 40, 256}, at::kBFloat16), lse = poisoned({1, 2, 40}, at::kFloat);
    auto f = fwd_params(q, q, q, o, lse, true, 0.0625, DTRAIN_ATTENTION_KERNEL_AUTO);
    EXPECT_EQ(run_fwd(f), cudaSuccess);
    EXPECT_FALSE(o.isnan().any().item<bool>());
  }
  const ScopedAttentionSmemCap smaller(kSm89 - 1);
  EXPECT_EQ(dtrain_attention_device_smem_bytes(), kSm89 - 1);
  auto q = dev(torch::randn({1, 2, 40, 256}).to(at::kBFloat16));
  auto o = poisoned({1, 2, 40, 256}, at::kBFloat16), lse = poisoned({1, 2, 40}, at::kFloat);
  auto f = fwd_params(q, q, q, o, lse, true, 0.0625, DTRAIN_ATTENTION_KERNEL_MMA);
  EXPECT_EQ(run_fwd(f), cudaErrorInvalidValue);
  EXPECT_TRUE(o.isnan().all().item<bool>()) << "a refused forward wrote its output";
}

// The deterministic backward (params.deterministic), on every kernel: dq, dk, dv and the
// float32 dq buffers in its workspace bitwise the same on every run, whatever order the
// blocks run in (the emulator draws a new one for each launch of each run; a GPU's
// scheduler varies it by itself), and within twice the naive error, as the default
// backward. The workspaces compare as bits (poisoned NaN where nothing is written); on the
// emulator, the default backward's do change with the order, so the comparison sees an
// order-dependent sum.
TEST(KERNEL_SUITE(FlashAttention), DeterministicBackwardRepeatsBitForBit) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(13);
  std::vector<AttnCase> cases = {
      // One (batch, kv head) pair: on the emulator's 4 SMs 4 slices, launches of 4 key
      // blocks and a last of fewer; not causal, so that every key block adds to every row.
      {1, 2, 1, 100, 450, 64, false, at::kBFloat16},
      // Pairs enough for one slice: a launch per key block.
      {2, 4, 2, 150, 300, 128, true, at::kHalf},
      // D 256 (mma.sync's split kernel, wgmma's split columns) with a window and documents,
      // and head dim 96 with documents and an offset.
      {1, 2, 1, 130, 260, 256, true, at::kBFloat16, 70, 40},
      {1, 4, 2, 120, 200, 96, true, at::kHalf, 0, 30, 80},
      // Documents and a window without causal: key blocks start at their first key's
      // first query.
      {1, 2, 2, 160, 160, 128, false, at::kHalf, 40, 50},
  };
  if (kLargeCases) {
    cases.insert(cases.end(), {{1, 4, 1, 4096, 4096, 128, true, at::kBFloat16},
                               {2, 16, 4, 2048, 2048, 128, true, at::kBFloat16},
                               {1, 8, 8, 1000, 1000, 64, false, at::kHalf},
                               {1, 4, 2, 1030, 1030, 256, true, at::kBFloat16, 300, 200}});
  }
  bool default_varies = false;
  for (const auto& c : cases) {
    SCOPED_TRACE(name(c));
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
    auto q = torch::randn({c.batch, c.heads, c.seq_q, c.dim}).to(c.type);
    auto k = torch::randn({c.batch, c.kv_heads, c.seq_k, c.dim}).to(c.type);
    auto v = torch::randn({c.batch, c.kv_heads, c.seq_k, c.dim}).to(c.type);
    auto dout = torch::randn({c.batch, c.heads, c.seq_q, c.dim}).to(c.type);
    at::Tensor doc_ids, doc_start, doc_end;
    if (c.docs > 0) {
      doc_ids = random_documents(c.batch, std::max(c.seq_k, c.offset + c.seq_q), c.docs);
      std::tie(doc_start, doc_end) = document_bounds(doc_ids);
      doc_start = dev(doc_start), doc_end = dev(doc_end);
    }
    auto qr = q.to(at::kDouble).requires_grad_(), kr = k.to(at::kDouble).requires_grad_(),
         vr = v.to(at::kDouble).requires_grad_();
    attention_math(qr, kr, vr, c.causal, scale, c.window, doc_ids, c.offset).backward(dout.to(at::kDouble));
    auto qn = dev(q).requires_grad_(), kn = dev(k).requires_grad_(), vn = dev(v).requires_grad_();
    attention_math(qn, kn, vn, c.causal, scale, c.window, doc_ids, c.offset).backward(dev(dout));

    auto qd = dev(q), kd = dev(k), vd = dev(v), dod = dev(dout);
    auto o = poisoned({c.batch, c.heads, c.seq_q, c.dim}, c.type);
    auto lse = poisoned({c.batch, c.heads, c.seq_q}, at::kFloat);
    auto f = fwd_params(qd, kd, vd, o, lse, c.causal, scale, DTRAIN_ATTENTION_KERNEL_AUTO, c.window, c.offset);
    if (c.docs > 0) f.documents = {doc_start.data_ptr<std::int32_t>(), doc_end.data_ptr<std::int32_t>(), 0};
    ASSERT_EQ(run_fwd(f), cudaSuccess);
    for (auto kernel : attention_kernels()) {
      SCOPED_TRACE(kernel == DTRAIN_ATTENTION_KERNEL_MMA ? "mma.sync" : "wgmma");
      struct Run {
        at::Tensor dq, dk, dv, ws;
      };
      auto run = [&](bool deterministic, std::uint64_t order) {
        Run r{poisoned(q.sizes(), c.type), poisoned(k.sizes(), c.type), poisoned(v.sizes(), c.type), {}};
        auto g = bwd_params(f, o, dod, r.dq, r.dk, r.dv, kernel);
        g.deterministic = deterministic ? 1 : 0;
        r.ws = poisoned({static_cast<std::int64_t>(dtrain_attention_bwd_workspace_bytes(&g) / sizeof(float))},
                        at::kFloat);
        g.workspace = r.ws.data_ptr();
        const ScopedBlockOrder scoped(order);
        EXPECT_EQ(dtrain_attention_bwd(&g, nullptr), cudaSuccess);
        kernel_sync();
        return r;
      };
      auto same_bits = [](const at::Tensor& a, const at::Tensor& b) {
        return a.sizes() == b.sizes() && at::equal(a.cpu().view(at::kInt), b.cpu().view(at::kInt));
      };
      const Run first = run(true, 1);
      for (const auto& [what, got, ref, nv] : {std::make_tuple("dq", first.dq, qr.grad(), qn.grad()),
                                              std::make_tuple("dk", first.dk, kr.grad(), kn.grad()),
                                              std::make_tuple("dv", first.dv, vr.grad(), vn.grad())}) {
        EXPECT_FALSE(got.isnan().any().item<bool>()) << what;
        const double e = max_abs(got, ref), ne = max_abs(nv, ref);
        EXPECT_LE(e, 2 * ne + 1e-3) << what << ": kernel " << e << ", naive " << ne;
      }
      for (std::uint64_t order : {2, 3}) {
        const Run again = run(true, order);
        EXPECT_TRUE(at::equal(again.dq, first.dq) && at::equal(again.dk, first.dk) && at::equal(again.dv, first.dv))
            << "block order " << order;
        EXPECT_TRUE(same_bits(again.ws, first.ws)) << "the float32 dq buffers, block order " << order;
      }
      if (kBlockOrderVaries && !default_varies) default_varies = !same_bits(run(false, 1).ws, run(false, 2).ws);
    }
  }
  if (kBlockOrderVaries) EXPECT_TRUE(default_varies) << "no case's default backward depends on the block order";
}

// The wgmma kernels load through tensor maps, which cannot step a kv head of stride 0 (a
// broadcast view): AUTO then runs mma.sync, forward and backward, and an explicit WGMMA
// refuses.
TEST(KERNEL_SUITE(FlashAttention), StridesTensorMapsCannotDescribeFallBackToMma) {
  KERNEL_DEVICE_OR_SKIP();
  torch::manual_seed(9);
  const std::int64_t b = 1, h = 2, s = 70, d = 64;
  auto q = dev(torch::randn({b, h, s, d}).to(at::kBFloat16));
  auto k1 = dev(torch::randn({b, 1, s, d}).to(at::kBFloat16)), v1 = dev(torch::randn({b, 1, s, d}).to(at::kBFloat16));
  auto k = k1.expand({b, h, s, d}), v = v1.expand({b, h, s, d});  // head stride 0
  auto dout = dev(torch::randn({b, h, s, d}).to(at::kBFloat16));
  struct Result {
    cudaError_t fwd = cudaSuccess, bwd = cudaSuccess;
    at::Tensor o, dq, dk, dv;
  };
  auto run = [&](dtrain_attention_kernel kernel, const at::Tensor& kk, const at::Tensor& vv) {
    Result r;
    r.o = poisoned({b, h, s, d}, at::kBFloat16);
    auto lse = poisoned({b, h, s}, at::kFloat);
    dtrain_attention_fwd_params f = fwd_params(q, kk, vv, r.o, lse, true, 0.125, kernel);
    r.fwd = run_fwd(f);
    if (r.fwd != cudaSuccess) {  // the backward's own refusal, on the reference's outputs
      r.o = attention_math(q, kk, vv, true, 0.125);
      lse.fill_(0);
    }
    r.dq = poisoned({b, h, s, d}, at::kBFloat16);
    r.dk = poisoned({b, h, s, d}, at::kBFloat16);
    r.dv = poisoned({b, h, s, d}, at::kBFloat16);
    auto g = bwd_params(f, r.o, dout, r.dq, r.dk, r.dv, kernel);
    r.bwd = run_bwd(g);
    return r;
  };
  const Result a = run(DTRAIN_ATTENTION_KERNEL_AUTO, k, v);
  const Result m = run(DTRAIN_ATTENTION_KERNEL_MMA, k.contiguous(), v.contiguous());
  ASSERT_EQ(a.fwd, cudaSuccess);
  ASSERT_EQ(a.bwd, cudaSuccess);
  ASSERT_EQ(m.fwd, cudaSuccess);
  ASSERT_EQ(m.bwd, cudaSuccess);
  EXPECT_TRUE(at::equal(a.o, m.o));
  // dq sums over keys with float atomics in the mma.sync backward: equal up to their order.
  for (const auto& [x, y] : {std::make_pair(a.dq, m.dq), std::make_pair(a.dk, m.dk), std::make_pair(a.dv, m.dv)}) {
    EXPECT_TRUE(at::allclose(x.cpu().to(at::kFloat), y.cpu().to(at::kFloat), 1e-2, 1e-3));
  }
  if (dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_WGMMA)) {
    const Result w = run(DTRAIN_ATTENTION_KERNEL_WGMMA, k, v);
    EXPECT_EQ(w.fwd, cudaErrorInvalidValue);
    EXPECT_EQ(w.bwd, cudaErrorInvalidValue);
  }
}

}  // namespace
