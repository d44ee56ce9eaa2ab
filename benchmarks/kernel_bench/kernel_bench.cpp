// kernel_bench: dtrain's ops against LibTorch's on the same device in the same run.
// Attention forward, forward+backward and backward TFLOP/s (4 B H S^2 D forward, 2.5x that
// for the backward, halved when causal; the backward's time is forward+backward's less the
// forward's) against at::scaled_dot_product_attention's flash and
// cuDNN backends (CUDA) or its default (CPU); fused AdamW GB/s against at::_fused_adamw_
// (CUDA) or torch::optim::AdamW (CPU) and against a device copy of the same bytes; RMSNorm,
// LayerNorm, SwiGLU, RoPE and cross-entropy GB/s (forward, backward) against at::rms_norm,
// at::layer_norm, silu(gate) * up, the rotation in ATen ops and at::cross_entropy_loss and
// the same copy. On CUDA the dtrain side is
// the kernels of kernels/; elsewhere it is their reference paths (a sanity run, not a
// performance claim). Prints a table and JSON lines (--json appends them to a file).
// --window W: sliding-window attention only, causal and not (both ways), against
// LibTorch's FlashAttention-2 with window_size (W - 1, 0), or (W - 1, W - 1) without causal
// (at::_flash_attention_forward), and sdpa with a boolean mask, FLOPs counting the visible
// (query, key) pairs.
// --documents L: attention over packed documents of L tokens, causal and not (the last one of a
// sequence shorter), against LibTorch's FlashAttention-2 varlen (at::_flash_attention_forward
// with cu_seqlens over the rows laid end to end; q, k, v are stored [B, S, H, D] for every
// side, so that its [B S, H, D] is a view) and sdpa with a boolean mask; FLOPs as above.
// --softcap C: logit soft-capping on dtrain's side only (LibTorch's backends have none), so
// the ratios against the table without it say what it costs.
// --sinks: learned attention sinks (a logit per head, with its gradient) on dtrain's side
// only (LibTorch's backends have none), likewise.
// --deterministic: every side under LibTorch's deterministic algorithms (dtrain's
// deterministic backward; LibTorch's flash backend its own; cuDNN refuses and shows "-"), so
// the ratios against the table without it say what bitwise reproducibility costs.
// --dropout P: attention dropout on every side (LibTorch's flash and cuDNN backends and
// FlashAttention-2 take it; dtrain's on its kernel, and on Hopper mma.sync's beside it).
// --only gqa: grouped-query attention on the sdpa backend (sdpa's own GQA) against sdpa over
// k and v repeated per query head (the call it replaced) and dtrain's flash attention:
// forward+backward time and peak memory (see gqa() below).
// --only ce_split: one rank's share of the tensor-parallel loss, dtrain's fused form against
// Megatron's, and with the head, the split linear form against the matmul then the fused
// loss (see ce_split() below).
// --only cp_chunks: one context-parallel rank's attention in the all-gather form, its two
// query chunks over the gathered keys at their offsets, on the flash kernel against sdpa
// with the explicit mask (see cp_chunks() below).
// --only linear_ce: the head and the loss in chunks of rows against the matmul then the
// loss (see linear_ce() below).
//
//   build/benchmarks/kernel_bench                          (CUDA when present)
//   build/benchmarks/kernel_bench --only attention --seq 1024,4096,16384 --json out.jsonl
//   build/benchmarks/kernel_bench --only attention --seq 4096,16384 --dims 128 --window 1024
//   build/benchmarks/kernel_bench --only attention --seq 16384 --dims 128 --documents 2048
//   build/benchmarks/kernel_bench --only attention --seq 4096 --dims 128 --dropout 0.1
//   build/benchmarks/kernel_bench --only gqa --seq 4096 --dims 128 [--kv-heads 4] [--documents 512]
//   build/benchmarks/kernel_bench --only ce_split [--tp 8]
//   build/benchmarks/kernel_bench --only cp_chunks --seq 16384 --dims 128 [--cp 4] [--window W] [--documents L]
//   build/benchmarks/kernel_bench --only linear_ce
//   DTRAIN_ATTENTION_KERNEL=mma build/benchmarks/kernel_bench --only attention --seq 4096 --dims 256 --smem-cap 101376
//     (D 256's compact tiles, those of GPUs of 99 KB a block, on a larger GPU)
#include <ATen/SDPBackend.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "common/bench_util.hpp"
#include "dtrain/dtrain.hpp"
#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/attention.h"
#endif

namespace {

struct Options {
  std::string device = "auto", json, only = "all";
  std::vector<std::int64_t> seq;  // default: 1k, 4k, 16k on CUDA; 256, 512 on CPU
  std::vector<std::int64_t> dims = {64, 128};
  std::int64_t tokens = 0;        // attention: batch x seq (0: 16384 on CUDA, 1024 on CPU)
  std::int64_t hidden = 2048;     // attention: heads x head_dim
  std::int64_t window = 0;        // attention: a causal sliding window (0: none)
  std::int64_t documents = 0;     // attention: packed documents of this many tokens (0: none)
  std::int64_t kv_heads = 0;      // gqa: key/value heads (0: a quarter of the heads)
  int tp = 8;                     // ce_split: the vocabulary split across this many ranks
  int cp = 4;                     // cp_chunks: the context-parallel degree
  int iters = 0, rounds = 3;      // iters 0: 20 on CUDA, 3 on CPU
  std::size_t smem_cap = 0;       // attention: dtrain_attention_set_smem_cap (0: none)
  double dropout = 0;             // attention: dropout probability on every side
  double softcap = 0;             // attention: dtrain's logit soft-capping (LibTorch has none)
  bool deterministic = false;     // attention: LibTorch's deterministic algorithms on every side
  bool sinks = false;             // attention: dtrain's learned attention sinks (LibTorch has none)
};

bool cuda(const c10::Device& d) { return d.is_cuda(); }

void sync(const c10::Device& d) {
  if (cuda(d)) torch::cuda::synchronize();
}

// Median over rounds of the mean time of `iters` calls, in ms.
double time_ms(const c10::Device& d, int iters, int rounds, const std::function<void()>& f) {
  f();  // warm-up (and kernel selection)
  sync(d);
  std::vector<double> v;
  for (int r = 0; r < rounds; ++r) {
    sync(d);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    sync(d);
    v.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  return dtrain::bench::median(v);
}

// A timing that may not exist (a backend LibTorch does not offer for this shape).
std::optional<double> try_time(const c10::Device& d, int iters, int rounds, const std::function<void()>& f) {
  try {
    return time_ms(d, iters, rounds, f);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

using Out = dtrain::bench::JsonLines;

nlohmann::json opt(const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }
// A table cell: the value, -1 when unknown.
double cell(std::optional<double> x) { return x ? *x : -1.0; }
// a / b; 0 when either is unknown or b is not positive.
double ratio_of(std::optional<double> a, std::optional<double> b) { return a && b && *b > 0 ? *a / *b : 0.0; }

// The dtype of the time-and-memory comparisons (gqa, cp_chunks, ce_split): bfloat16 on
// CUDA; float32 on the CPU, whose live tensors are then tracked for the peaks.
at::ScalarType measured_dtype(const c10::Device& dev) {
  if (!cuda(dev)) dtrain::train::enable_cpu_memory_tracking();
  return cuda(dev) ? torch::kBFloat16 : torch::kFloat;
}

// ---- attention -------------------------------------------------------------------------

// What dtrain's op runs for a pass at head dim d when DTRAIN_ATTENTION_KERNEL is `kernel`:
// wgmma, mma (mma.sync) or reference (off CUDA), so that a row says which kernels its
// figures are of (on Hopper, wgmma both ways at every head dim today).
std::string pass_kernel(const c10::Device& dev, const std::string& kernel, std::int64_t d, bool backward) {
#ifdef DTRAIN_WITH_CUDA
  if (!cuda(dev)) return "reference";
  if (kernel == "mma" || !dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_WGMMA)) return "mma";
  const bool takes = backward ? dtrain_attention_bwd_kernel_takes_head_dim(DTRAIN_ATTENTION_KERNEL_WGMMA, d)
                              : dtrain_attention_fwd_kernel_takes_head_dim(DTRAIN_ATTENTION_KERNEL_WGMMA, d);
  return takes ? "wgmma" : "mma";
#else
  (void)kernel, (void)d, (void)backward;
  return cuda(dev) ? "mma" : "reference";
#endif
}

void attention(const Options& o, const c10::Device& dev, int iters, Out& out) {
  const auto dtype = cuda(dev) ? torch::kBFloat16 : torch::kFloat;
  std::printf("# attention (%s, %s): TFLOP/s, fwd, fwd+bwd and bwd (fwd+bwd time less fwd time); ratio = dtrain / "
              "best LibTorch backend\n",
              cuda(dev) ? "cuda" : "cpu", c10::toString(dtype));
  // dtrain's op runs the kernel DTRAIN_ATTENTION_KERNEL names (auto: wgmma on Hopper); where
  // that is wgmma, mma_f and mma_fb time the mma.sync kernels beside it.
  const std::string kernel = dtrain::env::attention_kernel();
  bool both = false;
#ifdef DTRAIN_WITH_CUDA
  both = cuda(dev) && kernel == "auto" && dtrain_attention_kernel_available(DTRAIN_ATTENTION_KERNEL_WGMMA);
#endif
  std::printf("# dtrain_f, dtrain_fb: %s=%s%s\n", dtrain::env::kAttentionKernel, kernel.c_str(),
              both ? " (wgmma here; above head dim 128 its backward is mma.sync's); mma_f, mma_fb: mma.sync" : "");
  if (o.smem_cap > 0) {
    std::printf("# dtrain's kernels take a block to get at most %zu bytes of shared memory (--smem-cap): the tiles "
                "of GPUs that give that much\n",
                o.smem_cap);
  }
  const std::int64_t w = o.window, L = o.documents;
  const double dp = o.dropout;
  if (dp > 0) std::printf("# dropout %g on every side\n", dp);
  if (o.deterministic) {
    std::printf("# LibTorch's deterministic algorithms on every side (dtrain: its deterministic backward)\n");
  }
  if (o.softcap > 0) {
    std::printf("# logit soft-capping %g on dtrain's side only (LibTorch's backends have none): the ratios say what "
                "it costs\n",
                o.softcap);
  }
  if (o.sinks) {
    std::printf("# learned attention sinks on dtrain's side only (LibTorch's backends have none): the ratios say what "
                "they cost\n");
  }
  if (L > 0) {
    std::printf("# documents of %lld tokens (causal and not: bidirectional within a document): flash_* = LibTorch's "
                "FlashAttention-2 varlen, cudnn_* = sdpa with a boolean mask (flash_*: CUDA only)\n",
                static_cast<long long>(L));
  }
  if (w > 0) {
    std::printf("# window %lld (causal: back; not: both ways): flash_* = LibTorch's FlashAttention-2 with "
                "window_size (%lld, 0 or %lld), cudnn_* = sdpa with a boolean mask (flash_*: CUDA only)\n",
                static_cast<long long>(w), static_cast<long long>(w - 1), static_cast<long long>(w - 1));
  }
  // The JSON names of the two baselines.
  const std::string base1 = L > 0 ? "fa2_varlen" : w > 0 ? "fa2_window" : "sdpa_flash",
                    base2 = w > 0 || L > 0 ? "sdpa_mask" : "sdpa_cudnn";
  std::printf("%6s %4s %6s %4s %5s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %8s %8s %8s\n", "seq", "dim",
              "causal", "B", "H", "dtrain_f", "mma_f", "flash_f", "cudnn_f", "dtrain_fb", "mma_fb", "flash_fb",
              "cudnn_fb", "dtrain_b", "mma_b", "flash_b", "cudnn_b", "ratio_f", "ratio_fb", "ratio_b");
  std::vector<std::int64_t> seqs = o.seq;
  if (seqs.empty()) seqs = cuda(dev) ? std::vector<std::int64_t>{1024, 4096, 16384} : std::vector<std::int64_t>{256, 512};
  const std::int64_t tokens = o.tokens > 0 ? o.tokens : (cuda(dev) ? 16384 : 1024);
  for (auto s : seqs) {
    for (auto d : o.dims) {
      for (bool causal : {true, false}) {
        const auto b = std::max<std::int64_t>(1, tokens / s), h = std::max<std::int64_t>(1, o.hidden / d);
        auto opts = torch::TensorOptions().device(dev).dtype(dtype);
        // The leaves, [B, H, S, D] (with documents stored [B, S, H, D]), and q, k, v as
        // [B, H, S, D] views of them.
        const bool bshd = L > 0;
        std::vector<at::Tensor> leaves;
        for (int i = 0; i < 3; ++i) {
          leaves.push_back((bshd ? torch::randn({b, s, h, d}, opts) : torch::randn({b, h, s, d}, opts)).requires_grad_());
        }
        auto as_bhsd = [&](const at::Tensor& t) { return bshd ? t.transpose(1, 2) : t; };
        auto q = as_bhsd(leaves[0]), k = as_bhsd(leaves[1]), v = as_bhsd(leaves[2]);
        auto dout = torch::randn({b, h, s, d}, opts);
        // (query, key) pairs: S^2, halved when causal (as FlashAttention counts), or with a
        // window or documents those they let through.
        auto causal_pairs = [](std::int64_t n) { return n * (n + 1) / 2.0; };
        auto doc_pairs = [&](std::int64_t n) { return causal ? causal_pairs(n) : double(n) * n; };
        auto window_pairs = [&] {  // each row's keys within w back (and, not causal, ahead)
          double n = 0;
          for (std::int64_t i = 0; i < s; ++i) {
            n += double(std::min(i, w - 1) + 1 + (causal ? 0 : std::min(s - 1 - i, w - 1)));
          }
          return n;
        };
        const double pairs = L > 0   ? double(s / L) * doc_pairs(L) + doc_pairs(s % L)
                             : w > 0 ? window_pairs()
                                     : double(s) * s / (causal ? 2 : 1);
        const double fwd_flops = 4.0 * b * h * d * pairs;
        auto fwd = [&](const std::function<at::Tensor()>& f) {
          return [&, f] {
            torch::NoGradGuard no_grad;
            f();
          };
        };
        auto fwdbwd = [&](const std::function<at::Tensor()>& f) {
          return [&, f] {
            for (auto& t : leaves) t.mutable_grad().reset();
            f().backward(dout);
          };
        };
        // Packed documents: a document number per token, and FlashAttention's cu_seqlens over
        // the b rows end to end (int32 starts of every document, then b s).
        at::Tensor doc_ids, cu_seqlens;
        if (L > 0) {
          auto i = torch::arange(s, torch::TensorOptions().device(dev).dtype(torch::kLong));
          doc_ids = i.div(L, "floor").expand({b, s}).contiguous();
          std::vector<std::int32_t> cu;
          for (std::int64_t r = 0; r < b; ++r) {
            for (std::int64_t t = 0; t < s; t += L) cu.push_back(static_cast<std::int32_t>(r * s + t));
          }
          cu.push_back(static_cast<std::int32_t>(b * s));
          cu_seqlens = torch::tensor(cu, torch::kInt).to(dev);
        }
        const auto sinks = o.sinks ? torch::randn({h}, torch::TensorOptions().device(dev)).requires_grad_()
                                   : at::Tensor();
        auto ours = [&] {
          return dtrain::ops::flash_attention(q, k, v, causal, 0.0, w, doc_ids, 0, dp, std::nullopt, o.softcap,
                                              sinks);
        };
        std::function<at::Tensor()> flash, cudnn;
        at::Tensor seen;  // with a window or documents: the keys each query sees, [s, s]
        if (L > 0) {
          auto i = torch::arange(s, torch::TensorOptions().device(dev).dtype(torch::kLong));
          seen = i.div(L, "floor").unsqueeze(0) == i.div(L, "floor").unsqueeze(1);
          if (causal) seen = seen.logical_and(i.unsqueeze(0) <= i.unsqueeze(1));
          cudnn = [&] { return at::scaled_dot_product_attention(q, k, v, seen, dp, false); };
          if (cuda(dev)) {
            flash = [&] {
              auto packed = [&](const at::Tensor& x) { return x.view({b * s, h, d}); };
              const std::int64_t longest = std::min(L, s);
              return std::get<0>(at::_flash_attention_forward(packed(leaves[0]), packed(leaves[1]), packed(leaves[2]),
                                                              cu_seqlens, cu_seqlens, longest, longest, dp, causal,
                                                              false))
                  .view({b, s, h, d})
                  .transpose(1, 2);
            };
          }
        } else if (w > 0) {
          auto i = torch::arange(s, torch::TensorOptions().device(dev).dtype(torch::kLong));
          seen = (i.unsqueeze(0) > i.unsqueeze(1) - w).logical_and(causal ? i.unsqueeze(0) <= i.unsqueeze(1)
                                                                          : i.unsqueeze(0) < i.unsqueeze(1) + w);
          cudnn = [&] { return at::scaled_dot_product_attention(q, k, v, seen, dp, false); };
          if (cuda(dev)) {
            flash = [&] {
              auto t = [](const at::Tensor& x) { return x.transpose(1, 2); };  // [B, S, H, D]
              return std::get<0>(at::_flash_attention_forward(t(q), t(k), t(v), std::nullopt, std::nullopt, s, s, dp,
                                                              causal, false, std::nullopt, w - 1, causal ? 0 : w - 1))
                  .transpose(1, 2);
            };
          }
        } else if (cuda(dev)) {
          flash = [&] { return std::get<0>(at::_scaled_dot_product_flash_attention(q, k, v, dp, causal)); };
          cudnn = [&] { return std::get<0>(at::_scaled_dot_product_cudnn_attention(q, k, v, {}, true, dp, causal)); };
        } else {
          flash = [&] { return at::scaled_dot_product_attention(q, k, v, {}, dp, causal); };  // CPU default
        }
        const int it = std::max(1, s >= 16384 ? iters / 4 : iters);
        // TFLOP/s of one implementation: forward, forward+backward, and the backward alone
        // (the difference of the two times; unknown when it is not positive).
        struct Rates {
          std::optional<double> f, fb, b;
        };
        auto rates = [&](const std::function<at::Tensor()>& f) {
          const auto f_ms = try_time(dev, it, o.rounds, fwd(f)), fb_ms = try_time(dev, it, o.rounds, fwdbwd(f));
          auto tf = [](std::optional<double> ms, double flops) -> std::optional<double> {
            if (!ms || *ms <= 0) return std::nullopt;
            return flops / (*ms * 1e-3) / 1e12;
          };
          return Rates{tf(f_ms, fwd_flops), tf(fb_ms, 3.5 * fwd_flops),
                       f_ms && fb_ms ? tf(*fb_ms - *f_ms, 2.5 * fwd_flops) : std::nullopt};
        };
        const Rates r_ours = rates(ours);
        Rates r_mma;
        if (both) {
          dtrain::env::ScopedOverride mma(dtrain::env::kAttentionKernel, "mma");
          r_mma = rates(ours);
        }
        const Rates r_flash = rates(flash), r_cudnn = cudnn ? rates(cudnn) : Rates{};
        // dtrain over the better LibTorch backend (0 when either side is unknown).
        auto ratio = [](std::optional<double> ours, std::optional<double> a, std::optional<double> b) {
          const double best = std::max(a.value_or(0), b.value_or(0));
          return ours && best > 0 ? *ours / best : 0.0;
        };
        const double rf = ratio(r_ours.f, r_flash.f, r_cudnn.f), rfb = ratio(r_ours.fb, r_flash.fb, r_cudnn.fb),
                     rb = ratio(r_ours.b, r_flash.b, r_cudnn.b);
        std::printf(
            "%6lld %4lld %6d %4lld %5lld %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %8.2f "
            "%8.2f %8.2f\n",
            static_cast<long long>(s), static_cast<long long>(d), causal ? 1 : 0, static_cast<long long>(b),
            static_cast<long long>(h), cell(r_ours.f), cell(r_mma.f), cell(r_flash.f), cell(r_cudnn.f), cell(r_ours.fb),
            cell(r_mma.fb), cell(r_flash.fb), cell(r_cudnn.fb), cell(r_ours.b), cell(r_mma.b), cell(r_flash.b),
            cell(r_cudnn.b), rf, rfb, rb);
        out.line({{"bench", "kernel"}, {"op", "attention"}, {"device", cuda(dev) ? "cuda" : "cpu"},
                  {"dtype", c10::toString(dtype)}, {"seq", s}, {"head_dim", d}, {"causal", causal}, {"window", w},
                  {"documents", L}, {"smem_cap", o.smem_cap}, {"dropout", dp}, {"softcap", o.softcap}, {"sinks", o.sinks},
                  {"deterministic", o.deterministic},
                  {"batch", b}, {"heads", h}, {"kernel", kernel},
                  {"fwd_kernel", pass_kernel(dev, kernel, d, false)},
                  {"bwd_kernel", pass_kernel(dev, kernel, d, true)},
                  {"fwd_tflops", opt(r_ours.f)},
                  {"fwd_tflops_mma", opt(r_mma.f)}, {"fwd_tflops_" + base1, opt(r_flash.f)},
                  {"fwd_tflops_" + base2, opt(r_cudnn.f)}, {"fwdbwd_tflops", opt(r_ours.fb)},
                  {"fwdbwd_tflops_mma", opt(r_mma.fb)}, {"fwdbwd_tflops_" + base1, opt(r_flash.fb)},
                  {"fwdbwd_tflops_" + base2, opt(r_cudnn.fb)}, {"bwd_tflops", opt(r_ours.b)},
                  {"bwd_tflops_mma", opt(r_mma.b)}, {"bwd_tflops_" + base1, opt(r_flash.b)},
                  {"bwd_tflops_" + base2, opt(r_cudnn.b)}, {"fwd_ratio", rf}, {"fwdbwd_ratio", rfb},
                  {"bwd_ratio", rb}});
      }
    }
  }
}

// ---- grouped-query attention on the sdpa backend -----------------------------------------

const char* sdpa_backend_name(std::int64_t choice) {
  switch (static_cast<at::SDPBackend>(choice)) {
    case at::SDPBackend::math: return "math";
    case at::SDPBackend::flash_attention: return "flash";
    case at::SDPBackend::efficient_attention: return "efficient";
    case at::SDPBackend::cudnn_attention: return "cudnn";
    default: return "other";
  }
}

// Forward+backward ms (median of rounds), and the peak of tensor memory above the start of
// one more call in MiB (nullopt where the device keeps no such count, or the call throws).
// Each call starts with the leaves' gradients cleared.
using Measured = std::pair<std::optional<double>, std::optional<double>>;
Measured time_and_peak(const c10::Device& dev, int iters, int rounds, const std::vector<at::Tensor*>& leaves,
                       const std::function<void()>& fwdbwd) {
  auto step = [&] {
    for (auto* t : leaves) t->mutable_grad().reset();
    fwdbwd();
  };
  const auto ms = try_time(dev, iters, rounds, step);
  if (!ms) return {std::nullopt, std::nullopt};
  for (auto* t : leaves) t->mutable_grad().reset();
  dtrain::train::synchronize(dev);
  const double base = dtrain::train::memory_stats(dev).current_mib;
  if (!dtrain::train::reset_peak_memory(dev)) return {ms, std::nullopt};
  step();
  dtrain::train::synchronize(dev);
  return {ms, dtrain::train::memory_stats(dev).peak_mib - base};
}

// Forward + backward of grouped-query attention as the sdpa backend runs it (sdpa's own
// GQA, enable_gqa, where a fused backend takes it) against the call it replaced (sdpa over
// k and v repeated per query head), and dtrain's flash attention (CUDA): time, and the peak
// of tensor memory above the start (what the graph saves, the copies among it). Causal, or
// over packed documents with --documents.
void gqa(const Options& o, const c10::Device& dev, int iters, Out& out) {
  const auto dtype = measured_dtype(dev);
  std::printf("# grouped-query attention, sdpa backend (%s, %s): fwd+bwd ms and peak MiB above the start; dtrain = "
              "ops::attention (sdpa's enable_gqa where a fused backend takes it), repeat = sdpa over k, v repeated, "
              "flash = dtrain's kernel (CUDA); speedup and memory = repeat / dtrain\n",
              cuda(dev) ? "cuda" : "cpu", c10::toString(dtype));
  std::printf("%6s %4s %4s %5s %4s %5s %-9s %-9s %9s %9s %9s %9s %9s %9s %8s %8s\n", "seq", "dim", "B", "H", "Hkv",
              "docs", "backend", "(repeat)", "dtrain_ms", "repeat_ms", "flash_ms", "dtrain_MiB", "repeat_MiB",
              "flash_MiB", "speedup", "memory");
  std::vector<std::int64_t> seqs = o.seq;
  if (seqs.empty()) seqs = cuda(dev) ? std::vector<std::int64_t>{4096} : std::vector<std::int64_t>{512};
  const std::int64_t tokens = o.tokens > 0 ? o.tokens : (cuda(dev) ? 16384 : 1024);
  for (auto s : seqs) {
    for (auto d : o.dims) {
      const auto b = std::max<std::int64_t>(1, tokens / s), h = std::max<std::int64_t>(1, o.hidden / d);
      const auto hkv = o.kv_heads > 0 ? o.kv_heads : std::max<std::int64_t>(1, h / 4);
      DTRAIN_CHECK_ARG(h % hkv == 0, "--kv-heads ", hkv, " does not divide the ", h, " heads of --hidden ", o.hidden,
                       " at head dim ", d, "; allowed: a divisor of the heads");
      auto opts = torch::TensorOptions().device(dev).dtype(dtype);
      auto q = torch::randn({b, h, s, d}, opts).requires_grad_();
      auto k = torch::randn({b, hkv, s, d}, opts).requires_grad_();
      auto v = torch::randn({b, hkv, s, d}, opts).requires_grad_();
      auto dout = torch::randn({b, h, s, d}, opts);
      dtrain::ops::Documents docs;
      if (o.documents > 0) {
        docs = torch::arange(s, opts.dtype(torch::kLong)).div(o.documents, "floor").expand({b, s}).contiguous();
      }
      const bool documents = docs.defined();
      std::optional<at::Tensor> mask;
      if (documents) mask = docs.sdpa_mask(0, dtype, s, s, dev);
      const std::int64_t group = h / hkv;
      auto ours = [&] {
        return dtrain::ops::attention(q, k, v, true, 0.0, dtrain::ops::AttentionBackend::kSdpa, 0, docs);
      };
      auto repeat = [&] {
        return at::scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask,
                                                0.0, !documents);
      };
      auto flash = [&] { return dtrain::ops::flash_attention(q, k, v, true, 0.0, 0, docs); };
      auto measure = [&](const std::function<at::Tensor()>& f) {
        return time_and_peak(dev, iters, o.rounds, {&q, &k, &v}, [&] { f().backward(dout); });
      };
      const auto [ours_ms, ours_mib] = measure(ours);
      const auto [rep_ms, rep_mib] = measure(repeat);
      std::optional<double> flash_ms, flash_mib;
      if (cuda(dev)) std::tie(flash_ms, flash_mib) = measure(flash);
      const auto choice = at::_fused_sdp_choice(q, k, v, mask, 0.0, !documents, std::nullopt, true);
      const auto choice_repeat =
          at::_fused_sdp_choice(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask, 0.0, !documents);
      const double speedup = ratio_of(rep_ms, ours_ms), memory = ratio_of(rep_mib, ours_mib);
      std::printf("%6lld %4lld %4lld %5lld %4lld %5lld %-9s %-9s %9.3f %9.3f %9.3f %9.1f %9.1f %9.1f %8.2f %8.2f\n",
                  static_cast<long long>(s), static_cast<long long>(d), static_cast<long long>(b),
                  static_cast<long long>(h), static_cast<long long>(hkv), static_cast<long long>(o.documents),
                  sdpa_backend_name(choice), sdpa_backend_name(choice_repeat), cell(ours_ms), cell(rep_ms),
                  cell(flash_ms), cell(ours_mib), cell(rep_mib), cell(flash_mib), speedup, memory);
      out.line({{"bench", "kernel"}, {"op", "attention_gqa"}, {"device", cuda(dev) ? "cuda" : "cpu"},
                {"dtype", c10::toString(dtype)}, {"seq", s}, {"head_dim", d}, {"batch", b}, {"heads", h},
                {"kv_heads", hkv}, {"documents", o.documents}, {"causal", true},
                {"sdpa_backend", sdpa_backend_name(choice)}, {"sdpa_backend_repeat", sdpa_backend_name(choice_repeat)},
                {"fwdbwd_ms", opt(ours_ms)}, {"fwdbwd_ms_repeat", opt(rep_ms)}, {"fwdbwd_ms_flash", opt(flash_ms)},
                {"peak_mib", opt(ours_mib)}, {"peak_mib_repeat", opt(rep_mib)}, {"peak_mib_flash", opt(flash_mib)},
                {"speedup", speedup}, {"memory_ratio", memory}});
    }
  }
}

// One context-parallel rank's attention in the all-gather form (--cp-comm all_gather): the
// sequence of --seq tokens cut into 2 cp chunks, rank 0 holding chunks 0 and 2 cp - 1, each
// of its query chunks attending to the gathered keys up to its own end at its offset
// (ops::attention with query_offset, the calls cp::attention makes), causal, with the
// --window and --documents given: forward+backward ms and peak tensor memory above the
// start of dtrain's flash kernel (the offset in the kernel) against the sdpa backend (an
// explicit additive mask per chunk, made once per forward and saved for the backward, as
// the model's layers share it). The speedup and memory ratio are sdpa / flash. On the CPU
// flash is its reference path: a run of the code, not a figure.
void cp_chunks(const Options& o, const c10::Device& dev, int iters, Out& out) {
  const auto dtype = measured_dtype(dev);
  std::printf("# context-parallel chunks (all_gather form, rank 0 of cp %d; %s, %s): fwd+bwd ms and peak MiB above the "
              "start; flash = dtrain's kernel with the query offset, sdpa = sdpa with the chunks' masks; speedup and "
              "memory = sdpa / flash\n",
              o.cp, cuda(dev) ? "cuda" : "cpu", c10::toString(dtype));
  std::printf("%6s %4s %3s %4s %5s %6s %5s %9s %9s %9s %9s %8s %8s\n", "seq", "dim", "cp", "B", "H", "window", "docs",
              "flash_ms", "sdpa_ms", "flash_MiB", "sdpa_MiB", "speedup", "memory");
  std::vector<std::int64_t> seqs = o.seq;
  if (seqs.empty()) seqs = cuda(dev) ? std::vector<std::int64_t>{16384} : std::vector<std::int64_t>{512};
  const std::int64_t tokens = o.tokens > 0 ? o.tokens : (cuda(dev) ? 16384 : 1024);
  for (auto s : seqs) {
    DTRAIN_CHECK_ARG(s % (2 * o.cp) == 0, "--seq ", s, " cannot be cut into 2 x --cp ", o.cp, " chunks; allowed: a ",
                     "multiple of ", 2 * o.cp);
    for (auto d : o.dims) {
      const auto b = std::max<std::int64_t>(1, tokens / s), h = std::max<std::int64_t>(1, o.hidden / d);
      const std::int64_t L = s / (2 * o.cp), chunks[2] = {0, 2 * o.cp - 1};
      auto opts = torch::TensorOptions().device(dev).dtype(dtype);
      auto q = torch::randn({b, h, 2 * L, d}, opts).requires_grad_();  // the rank's queries
      auto k = torch::randn({b, h, s, d}, opts).requires_grad_();      // the gathered keys, values
      auto v = torch::randn({b, h, s, d}, opts).requires_grad_();
      auto dout = torch::randn({b, h, 2 * L, d}, opts);
      dtrain::ops::Documents docs;
      if (o.documents > 0) {
        docs = torch::arange(s, opts.dtype(torch::kLong)).div(o.documents, "floor").expand({b, s}).contiguous();
      }
      auto chunks_of = [&](dtrain::ops::AttentionBackend backend) {
        // A fresh Documents per forward, as the model makes one per micro-batch: sdpa's
        // masks are made in every timed call.
        const dtrain::ops::Documents fresh = docs.defined() ? dtrain::ops::Documents(docs.ids()) : dtrain::ops::Documents();
        std::vector<at::Tensor> outs;
        for (int c = 0; c < 2; ++c) {
          const auto seen = (chunks[c] + 1) * L;
          outs.push_back(dtrain::ops::attention(q.narrow(2, c * L, L), k.narrow(2, 0, seen), v.narrow(2, 0, seen),
                                                true, 0.0, backend, o.window, fresh, chunks[c] * L));
        }
        return at::cat(outs, 2);
      };
      auto measure = [&](dtrain::ops::AttentionBackend backend) {
        return time_and_peak(dev, iters, o.rounds, {&q, &k, &v}, [&] { chunks_of(backend).backward(dout); });
      };
      const auto [flash_ms, flash_mib] = measure(dtrain::ops::AttentionBackend::kFlash);
      const auto [sdpa_ms, sdpa_mib] = measure(dtrain::ops::AttentionBackend::kSdpa);
      const double speedup = ratio_of(sdpa_ms, flash_ms), memory = ratio_of(sdpa_mib, flash_mib);
      std::printf("%6lld %4lld %3d %4lld %5lld %6lld %5lld %9.3f %9.3f %9.1f %9.1f %8.2f %8.2f\n",
                  static_cast<long long>(s), static_cast<long long>(d), o.cp, static_cast<long long>(b),
                  static_cast<long long>(h), static_cast<long long>(o.window), static_cast<long long>(o.documents),
                  cell(flash_ms), cell(sdpa_ms), cell(flash_mib), cell(sdpa_mib), speedup, memory);
      out.line({{"bench", "kernel"}, {"op", "attention_cp_chunks"}, {"device", cuda(dev) ? "cuda" : "cpu"},
                {"dtype", c10::toString(dtype)}, {"seq", s}, {"head_dim", d}, {"cp", o.cp}, {"batch", b},
                {"heads", h}, {"window", o.window}, {"documents", o.documents}, {"fwdbwd_ms_flash", opt(flash_ms)},
                {"fwdbwd_ms_sdpa", opt(sdpa_ms)}, {"peak_mib_flash", opt(flash_mib)}, {"peak_mib_sdpa", opt(sdpa_mib)},
                {"speedup", speedup}, {"memory_ratio", memory}});
    }
  }
}

// One rank's share of a vocabulary split across --tp ranks (a tensor-parallel head's
// loss): forward+backward ms and peak tensor memory above the start of dtrain's fused form
// (tp::fused_vocab_parallel_cross_entropy, in place as the model runs it) against
// Megatron's form (tp::vocab_parallel_cross_entropy: float32 copies, the softmax saved)
// and the unsplit one-call op over the same columns (what splitting costs). Both split
// forms run over a one-rank communicator: their collectives become copies, so the figure
// is the per-rank work without the network. Then the same with the head's rows of this rank:
// the split linear form (--fused-linear-ce at tp > 1) against the matmul and the fused form.
void ce_split(const Options& o, const c10::Device& dev, int iters, Out& out) {
  const auto dtype = measured_dtype(dev);
  const std::int64_t rows = cuda(dev) ? 8192 : 512, vocab = cuda(dev) ? 50304 : 8192;
  const std::int64_t cols = dtrain::tp::padded_vocab_size(vocab, o.tp) / o.tp;
  auto self = dtrain::make_self_communicator("tp", 0);
  auto opts = torch::TensorOptions().device(dev).dtype(dtype);
  auto logits = torch::randn({rows, cols}, opts).requires_grad_();
  const auto fresh = logits.detach().clone();
  auto target = torch::randint(0, cols, {rows}, opts.dtype(torch::kLong));
  dtrain::ops::CrossEntropyOptions in_place;
  in_place.in_place = true;
  // The logits are refilled before each call: the in-place forms leave their gradient there.
  auto run = [&](const std::function<at::Tensor()>& loss) {
    return time_and_peak(dev, iters, o.rounds, {&logits}, [&] {
      {
        torch::NoGradGuard no_grad;
        logits.copy_(fresh);
      }
      loss().backward();
    });
  };
  const auto [ours_ms, ours_mib] =
      run([&] { return dtrain::tp::fused_vocab_parallel_cross_entropy(logits, target, cols, self, in_place); });
  const auto [meg_ms, meg_mib] = run([&] { return dtrain::tp::vocab_parallel_cross_entropy(logits, target, cols, self); });
  const auto [one_ms, one_mib] = run([&] { return dtrain::ops::cross_entropy(logits, target, in_place); });
  std::printf("# vocabulary-parallel cross-entropy, one rank's share (%s, %s): %lld rows x %lld of %lld columns (tp "
              "%d); fwd+bwd ms and peak MiB above the start; dtrain = fused split form, megatron = "
              "tp::vocab_parallel_cross_entropy, one_call = ops::cross_entropy unsplit (each time includes one copy "
              "refilling the logits, which the in-place forms overwrite); speedup and memory = megatron / dtrain\n",
              cuda(dev) ? "cuda" : "cpu", c10::toString(dtype), static_cast<long long>(rows),
              static_cast<long long>(cols), static_cast<long long>(vocab), o.tp);
  std::printf("%9s %11s %11s %10s %12s %12s %8s %8s\n", "dtrain_ms", "megatron_ms", "one_call_ms", "dtrain_MiB",
              "megatron_MiB", "one_call_MiB", "speedup", "memory");
  std::printf("%9.3f %11.3f %11.3f %10.1f %12.1f %12.1f %8.2f %8.2f\n", cell(ours_ms), cell(meg_ms), cell(one_ms),
              cell(ours_mib), cell(meg_mib), cell(one_mib), ratio_of(meg_ms, ours_ms), ratio_of(meg_mib, ours_mib));
  out.line({{"bench", "kernel"}, {"op", "cross_entropy_split"}, {"device", cuda(dev) ? "cuda" : "cpu"},
            {"dtype", c10::toString(dtype)}, {"rows", rows}, {"cols", cols}, {"vocab", vocab}, {"tp", o.tp},
            {"fwdbwd_ms", opt(ours_ms)}, {"fwdbwd_ms_megatron", opt(meg_ms)}, {"fwdbwd_ms_one_call", opt(one_ms)},
            {"peak_mib", opt(ours_mib)}, {"peak_mib_megatron", opt(meg_mib)}, {"peak_mib_one_call", opt(one_mib)},
            {"speedup", ratio_of(meg_ms, ours_ms)}, {"memory_ratio", ratio_of(meg_mib, ours_mib)}});

  // The head too (hidden 2048 on CUDA, 256 on the CPU; this rank's rows of it): the split
  // linear form (chunks of rows, an exchange per chunk) against the matmul then the fused
  // split loss in place.
  const std::int64_t hidden = cuda(dev) ? 2048 : 256;
  auto h = torch::randn({rows, hidden}, opts).requires_grad_();
  auto w = (torch::randn({cols, hidden}, opts) * 0.02).requires_grad_();
  auto run_head = [&](const std::function<at::Tensor()>& loss) {
    return time_and_peak(dev, iters, o.rounds, {&h, &w}, [&] { loss().backward(); });
  };
  const auto [lin_ms, lin_mib] = run_head(
      [&] { return dtrain::tp::fused_vocab_parallel_linear_cross_entropy(h, w, target, cols, self); });
  const auto [head_ms, head_mib] = run_head([&] {
    return dtrain::tp::fused_vocab_parallel_cross_entropy(at::matmul(h, w.t()), target, cols, self, in_place);
  });
  std::printf("# with the head, hidden %lld: linear_ce = tp::fused_vocab_parallel_linear_cross_entropy, fused_ce = "
              "matmul + the fused split loss in place; speedup and memory = fused_ce / linear_ce\n",
              static_cast<long long>(hidden));
  std::printf("%12s %11s %13s %12s %8s %8s\n", "linear_ce_ms", "fused_ce_ms", "linear_ce_MiB", "fused_ce_MiB",
              "speedup", "memory");
  std::printf("%12.3f %11.3f %13.1f %12.1f %8.2f %8.2f\n", cell(lin_ms), cell(head_ms), cell(lin_mib),
              cell(head_mib), ratio_of(head_ms, lin_ms), ratio_of(head_mib, lin_mib));
  out.line({{"bench", "kernel"}, {"op", "linear_cross_entropy_split"}, {"device", cuda(dev) ? "cuda" : "cpu"},
            {"dtype", c10::toString(dtype)}, {"rows", rows}, {"hidden", hidden}, {"cols", cols}, {"vocab", vocab},
            {"tp", o.tp}, {"fwdbwd_ms", opt(lin_ms)}, {"fwdbwd_ms_fused_ce", opt(head_ms)}, {"peak_mib", opt(lin_mib)},
            {"peak_mib_fused_ce", opt(head_mib)}, {"speedup", ratio_of(head_ms, lin_ms)},
            {"memory_ratio", ratio_of(head_mib, lin_mib)}});
}

// The head and the loss of a Llama-3-sized vocabulary (CUDA: 8192 tokens, hidden 2048,
// 128256 ids, bf16; CPU: 1024, 256, 8192, float32): forward+backward ms and peak tensor
// memory above the start of ops::linear_cross_entropy (chunks of rows, never all the
// logits) against the head's matmul then ops::cross_entropy in place (--fused-ce) and then
// LibTorch's cross-entropy.
void linear_ce(const Options& o, const c10::Device& dev, int iters, Out& out) {
  const auto dtype = measured_dtype(dev);
  const std::int64_t rows = cuda(dev) ? 8192 : 1024, hidden = cuda(dev) ? 2048 : 256, vocab = cuda(dev) ? 128256 : 8192;
  auto opts = torch::TensorOptions().device(dev).dtype(dtype);
  auto h = torch::randn({rows, hidden}, opts).requires_grad_();
  auto w = (torch::randn({vocab, hidden}, opts) * 0.02).requires_grad_();
  auto target = torch::randint(0, vocab, {rows}, opts.dtype(torch::kLong));
  dtrain::ops::CrossEntropyOptions in_place;
  in_place.in_place = true;
  auto run = [&](const std::function<at::Tensor()>& loss) {
    return time_and_peak(dev, iters, o.rounds, {&h, &w}, [&] { loss().backward(); });
  };
  const auto [ours_ms, ours_mib] = run([&] { return dtrain::ops::linear_cross_entropy(h, w, target); });
  const auto [fused_ms, fused_mib] =
      run([&] { return dtrain::ops::cross_entropy(at::matmul(h, w.t()), target, in_place); });
  const auto [plain_ms, plain_mib] = run([&] { return at::cross_entropy_loss(at::matmul(h, w.t()), target); });
  std::printf("# head + loss (%s, %s): %lld rows x hidden %lld x vocab %lld; fwd+bwd ms and peak MiB above the start; "
              "linear_ce = ops::linear_cross_entropy, fused_ce = matmul + ops::cross_entropy in place, aten = matmul "
              "+ at::cross_entropy_loss; speedup and memory = fused_ce / linear_ce\n",
              cuda(dev) ? "cuda" : "cpu", c10::toString(dtype), static_cast<long long>(rows),
              static_cast<long long>(hidden), static_cast<long long>(vocab));
  std::printf("%12s %11s %9s %13s %12s %10s %8s %8s\n", "linear_ce_ms", "fused_ce_ms", "aten_ms", "linear_ce_MiB",
              "fused_ce_MiB", "aten_MiB", "speedup", "memory");
  std::printf("%12.3f %11.3f %9.3f %13.1f %12.1f %10.1f %8.2f %8.2f\n", cell(ours_ms), cell(fused_ms), cell(plain_ms),
              cell(ours_mib), cell(fused_mib), cell(plain_mib), ratio_of(fused_ms, ours_ms),
              ratio_of(fused_mib, ours_mib));
  out.line({{"bench", "kernel"}, {"op", "linear_cross_entropy"}, {"device", cuda(dev) ? "cuda" : "cpu"},
            {"dtype", c10::toString(dtype)}, {"rows", rows}, {"hidden", hidden}, {"vocab", vocab},
            {"fwdbwd_ms", opt(ours_ms)}, {"fwdbwd_ms_fused_ce", opt(fused_ms)}, {"fwdbwd_ms_aten", opt(plain_ms)},
            {"peak_mib", opt(ours_mib)}, {"peak_mib_fused_ce", opt(fused_mib)}, {"peak_mib_aten", opt(plain_mib)},
            {"speedup", ratio_of(fused_ms, ours_ms)}, {"memory_ratio", ratio_of(fused_mib, ours_mib)}});
}

// ---- memory-bound ops --------------------------------------------------------------------

// GB/s of a device copy moving `bytes` (read + write) in all.
double copy_gbps(const c10::Device& dev, int iters, int rounds, double bytes) {
  auto src = torch::empty({static_cast<std::int64_t>(bytes / 2)}, torch::TensorOptions().device(dev).dtype(torch::kByte));
  auto dst = torch::empty_like(src);
  const double ms = time_ms(dev, iters, rounds, [&] { dst.copy_(src); });
  return bytes / (ms * 1e-3) / 1e9;
}

void row(Out& out, const c10::Device& dev, const std::string& op, const std::string& pass, double bytes,
         double ours_ms, std::optional<double> base_ms, const std::string& base_name, double copy) {
  const double ours = bytes / (ours_ms * 1e-3) / 1e9;
  const double base = base_ms ? bytes / (*base_ms * 1e-3) / 1e9 : -1;
  std::printf("%-14s %-5s %10.1f %10.1f %-22s %8.2f %8.2f\n", op.c_str(), pass.c_str(), ours, base,
              base_name.c_str(), base > 0 ? ours / base : 0.0, ours / copy);
  out.line({{"bench", "kernel"}, {"op", op}, {"pass", pass}, {"device", cuda(dev) ? "cuda" : "cpu"},
            {"bytes", bytes}, {"gbps", ours}, {"baseline", base_name}, {"baseline_gbps", base > 0 ? nlohmann::json(base) : nlohmann::json(nullptr)},
            {"ratio", base > 0 ? ours / base : 0.0}, {"copy_gbps", copy}, {"fraction_of_copy", ours / copy}});
}

void memory_bound(const Options& o, const c10::Device& dev, int iters, Out& out) {
  const auto act = cuda(dev) ? torch::kBFloat16 : torch::kFloat;
  auto opts = torch::TensorOptions().device(dev);
  std::printf("# memory-bound ops (%s): GB/s of the bytes each must move; ratio = dtrain / baseline; "
              "copy = fraction of a device copy of the same bytes\n", cuda(dev) ? "cuda" : "cpu");
  std::printf("%-14s %-5s %10s %10s %-22s %8s %8s\n", "op", "pass", "dtrain", "baseline", "(baseline)", "ratio", "copy");
  const bool all = o.only == "all";
  // Backward alone: the forward once (at the first call, so that a baseline that throws
  // does so inside try_time), then the backward with the graph retained.
  auto bwd_of = [](const std::function<at::Tensor()>& f, std::vector<at::Tensor> inputs, const at::Tensor& dy) {
    auto y = std::make_shared<at::Tensor>();
    return [f, y, inputs, dy] {
      if (!y->defined()) *y = f();
      torch::autograd::grad({*y}, inputs, {dy}, /*retain_graph=*/true);
    };
  };
  auto no_grad = [](const std::function<at::Tensor()>& f) {
    return [f] {
      torch::NoGradGuard guard;
      f();
    };
  };
  if (all || o.only == "adamw") {
    // AdamW over 100 tensors: p, m, v read and written, g read (float32): 28 bytes/element.
    const std::int64_t total = cuda(dev) ? (64 << 20) : (4 << 20);
    std::vector<at::Tensor> p, g, m, v, steps;
    for (int i = 0; i < 100; ++i) {
      const auto n = total / 100 + (i % 7) * 1031;
      p.push_back(torch::randn({n}, opts));
      g.push_back(torch::randn({n}, opts));
      m.push_back(torch::zeros({n}, opts));
      v.push_back(torch::zeros({n}, opts));
      steps.push_back(torch::ones({}, opts));
    }
    double n_all = 0;
    for (const auto& t : p) n_all += static_cast<double>(t.numel());
    const double bytes = 28 * n_all;
    std::vector<dtrain::ops::AdamWSegment> segs;
    for (std::size_t i = 0; i < p.size(); ++i) segs.push_back({p[i], g[i], m[i], v[i], {}, 0.1});
    dtrain::ops::AdamWHyper h;
    h.lr = 1e-4, h.beta2 = 0.95, h.bias_correction1 = 0.1, h.bias_correction2 = 0.05;
    const double ours = time_ms(dev, iters, o.rounds, [&] { dtrain::ops::fused_adamw(segs, h); });
    std::optional<double> base;
    std::string base_name;
    if (cuda(dev)) {
      base_name = "at::_fused_adamw_";
      base = try_time(dev, iters, o.rounds, [&] {
        at::_fused_adamw_(p, g, m, v, {}, steps, 1e-4, 0.9, 0.95, 0.1, 1e-8, false, false);
      });
    } else {
      base_name = "torch::optim::AdamW";
      std::vector<at::Tensor> params;
      for (std::size_t i = 0; i < p.size(); ++i) {
        params.push_back(p[i].clone().requires_grad_());
        params.back().mutable_grad() = g[i];
      }
      torch::optim::AdamW adam(params, torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95}).weight_decay(0.1));
      base = time_ms(dev, iters, o.rounds, [&] { adam.step(); });
    }
    row(out, dev, "adamw", "step", bytes, ours, base, base_name, copy_gbps(dev, iters, o.rounds, bytes));
  }
  if (all || o.only == "norm") {
    const std::int64_t rows = cuda(dev) ? 16384 : 2048, cols = cuda(dev) ? 4096 : 1024;
    auto x = torch::randn({rows, cols}, opts.dtype(act)).requires_grad_();
    auto w = torch::randn({cols}, opts).requires_grad_(), b = torch::randn({cols}, opts).requires_grad_();
    // LibTorch's own convention for its baseline: weights in the activations' dtype (CUDA's
    // at::layer_norm refuses float32 weights with bf16 input; at::rms_norm then takes a
    // slower composite path). dtrain's ops take the float32 master weights as they are.
    auto wt = w.detach().to(act).requires_grad_(), bt = b.detach().to(act).requires_grad_();
    auto dy = torch::randn({rows, cols}, opts.dtype(act));
    const double elt = static_cast<double>(rows * cols) * static_cast<double>(x.element_size());
    const double copy = copy_gbps(dev, iters, o.rounds, 2 * elt);
    for (bool layer : {false, true}) {
      const std::string name = layer ? "layer_norm" : "rms_norm";
      auto ours = [&] { return layer ? dtrain::ops::layer_norm(x, w, b, 1e-5) : dtrain::ops::rms_norm(x, w, 1e-5); };
      auto theirs = [&] { return layer ? at::layer_norm(x, {cols}, wt, bt, 1e-5) : at::rms_norm(x, {cols}, wt, 1e-5); };
      row(out, dev, name, "fwd", 2 * elt, time_ms(dev, iters, o.rounds, no_grad(ours)),
          try_time(dev, iters, o.rounds, no_grad(theirs)), "at::" + name, copy);
      row(out, dev, name, "bwd", 3 * elt, time_ms(dev, iters, o.rounds, bwd_of(ours, {x, w}, dy)),
          try_time(dev, iters, o.rounds, bwd_of(theirs, {x, wt}, dy)), "at::" + name,
          copy_gbps(dev, iters, o.rounds, 3 * elt));
    }
  }
  if (all || o.only == "swiglu") {
    // Llama-3 8B's MLP width over 8192 tokens. Bytes: gate and up read, y written (fwd);
    // dy, gate and up read, both gradients written (bwd). LibTorch's silu then multiply
    // moves 5 tensors forward and more backward, and saves silu(gate) as well.
    const std::int64_t rows = cuda(dev) ? 8192 : 1024, cols = cuda(dev) ? 14336 : 2048;
    auto g = torch::randn({rows, cols}, opts.dtype(act)).requires_grad_();
    auto u = torch::randn({rows, cols}, opts.dtype(act)).requires_grad_();
    auto dy = torch::randn({rows, cols}, opts.dtype(act));
    const double elt = static_cast<double>(rows * cols) * static_cast<double>(g.element_size());
    auto ours = [&] { return dtrain::ops::swiglu(g, u); };
    auto theirs = [&] { return torch::silu(g) * u; };
    row(out, dev, "swiglu", "fwd", 3 * elt, time_ms(dev, iters, o.rounds, no_grad(ours)),
        try_time(dev, iters, o.rounds, no_grad(theirs)), "silu(gate) * up", copy_gbps(dev, iters, o.rounds, 3 * elt));
    row(out, dev, "swiglu", "bwd", 5 * elt, time_ms(dev, iters, o.rounds, bwd_of(ours, {g, u}, dy)),
        try_time(dev, iters, o.rounds, bwd_of(theirs, {g, u}, dy)), "silu(gate) * up",
        copy_gbps(dev, iters, o.rounds, 5 * elt));
  }
  if (all || o.only == "rope") {
    // q of a Llama-3 8B layer (32 heads of 128) over 4 x 4096 tokens, as the model holds it:
    // [B, H, T, D] over [B, T, H, D] storage. Bytes: x read and y written, and the float32
    // angles read once. The baseline is the rotation in LibTorch's ops as the model wrote it
    // (angles cast to x's dtype, the halves' products, a cat).
    const std::int64_t B = cuda(dev) ? 4 : 2, T = cuda(dev) ? 4096 : 512, H = cuda(dev) ? 32 : 8, D = 128;
    auto x = torch::randn({B, T, H, D}, opts.dtype(act)).permute({0, 2, 1, 3}).requires_grad_();
    auto angles = torch::rand({T, D / 2}, opts) * 100;
    auto cs = angles.cos(), sn = angles.sin();
    auto dy = torch::randn({B, H, T, D}, opts.dtype(act));
    const double elt = static_cast<double>(x.numel()) * static_cast<double>(x.element_size());
    const double bytes = 2 * elt + 2.0 * static_cast<double>(cs.numel()) * 4;
    auto ours = [&] { return dtrain::ops::rope(x, cs, sn); };
    auto theirs = [&] {
      auto c = cs.to(act), s = sn.to(act);
      auto x1 = x.narrow(3, 0, D / 2), x2 = x.narrow(3, D / 2, D / 2);
      return torch::cat({x1 * c - x2 * s, x1 * s + x2 * c}, 3);
    };
    const double copy = copy_gbps(dev, iters, o.rounds, bytes);
    row(out, dev, "rope", "fwd", bytes, time_ms(dev, iters, o.rounds, no_grad(ours)),
        try_time(dev, iters, o.rounds, no_grad(theirs)), "ATen rotation", copy);
    row(out, dev, "rope", "bwd", bytes, time_ms(dev, iters, o.rounds, bwd_of(ours, {x}, dy)),
        try_time(dev, iters, o.rounds, bwd_of(theirs, {x}, dy)), "ATen rotation", copy);
  }
  if (all || o.only == "ce") {
    const std::int64_t rows = cuda(dev) ? 8192 : 512, vocab = cuda(dev) ? 50304 : 8192;
    auto logits = torch::randn({rows, vocab}, opts.dtype(act)).requires_grad_();
    auto target = torch::randint(0, vocab, {rows}, opts.dtype(torch::kLong));
    const double elt = static_cast<double>(rows * vocab) * static_cast<double>(logits.element_size());
    auto ours = [&] { return dtrain::ops::cross_entropy(logits, target); };
    auto theirs = [&] { return at::cross_entropy_loss(logits, target); };
    auto fwdbwd = [&](const std::function<at::Tensor()>& f) {
      return [&, f] { torch::autograd::grad({f()}, {logits}); };
    };
    row(out, dev, "cross_entropy", "fwd", elt, time_ms(dev, iters, o.rounds, no_grad(ours)),
        try_time(dev, iters, o.rounds, no_grad(theirs)), "at::cross_entropy_loss", copy_gbps(dev, iters, o.rounds, 2 * elt));
    // Forward + backward: the least they can move is the logits read once and the gradient
    // written once (ours reads each row a second time, from L2 when it is still there).
    row(out, dev, "cross_entropy", "fwdbwd", 2 * elt, time_ms(dev, iters, o.rounds, fwdbwd(ours)),
        try_time(dev, iters, o.rounds, fwdbwd(theirs)), "at::cross_entropy_loss",
        copy_gbps(dev, iters, o.rounds, 2 * elt));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"kernel_bench: dtrain's attention, AdamW, norm, SwiGLU, RoPE and cross-entropy ops against LibTorch's"};
  app.add_option("--device", o.device, "auto (cuda when available), cuda or cpu")->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  app.add_option("--only", o.only,
                 "all (attention and the memory-bound ops), attention, gqa, adamw, norm, swiglu, rope, ce, ce_split, "
                 "cp_chunks or linear_ce")
      ->check(CLI::IsMember({"all", "attention", "gqa", "adamw", "norm", "swiglu", "rope", "ce", "ce_split", "cp_chunks",
                             "linear_ce"}));
  app.add_option("--seq", o.seq, "attention sequence lengths")->delimiter(',');
  app.add_option("--dims", o.dims, "attention head dims (multiples of 8 up to 256; default 64,128)")->delimiter(',');
  app.add_option("--tokens", o.tokens, "attention: batch x seq (0: 16384 on CUDA, 1024 on CPU)");
  app.add_option("--hidden", o.hidden, "attention: heads x head_dim");
  app.add_option("--window", o.window, "attention: sliding windows of this many keys only, causal and not (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--documents", o.documents,
                 "attention: attention over packed documents of this many tokens only, causal and not (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--kv-heads", o.kv_heads, "gqa: key/value heads (0: a quarter of the heads)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--tp", o.tp, "ce_split: the vocabulary split across this many tensor-parallel ranks")
      ->check(CLI::PositiveNumber);
  app.add_option("--cp", o.cp, "cp_chunks: the context-parallel degree (each sequence in 2 x cp chunks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--smem-cap", o.smem_cap,
                 "attention: dtrain's kernels take a block to get at most this many bytes of shared memory, as on "
                 "a smaller GPU (101376: the 99 KB of compute capability 8.6 and 8.9; 0: the device's)");
  app.add_option("--softcap", o.softcap, "attention: dtrain's logit soft-capping (Gemma 2: 50; LibTorch has none)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--sinks", o.sinks, "attention: dtrain's learned attention sinks, one logit per head (LibTorch has none)");
  app.add_flag("--deterministic", o.deterministic,
               "attention: LibTorch's deterministic algorithms on every side (dtrain's deterministic backward)");
  app.add_option("--dropout", o.dropout, "attention: dropout probability on every side (0: none)")
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--iters", o.iters, "calls per timing (0: 20 on CUDA, 3 on CPU)");
  app.add_option("--rounds", o.rounds, "timings per case (the median is reported)");
  app.add_option("--json", o.json, "also append the JSON lines to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    const bool has_cuda = torch::cuda::is_available();
    DTRAIN_CHECK_ARG(o.device != "cuda" || has_cuda, "--device cuda: no CUDA device is visible");
    DTRAIN_CHECK_ARG(o.window == 0 || o.documents == 0, "--window ", o.window, " with --documents ", o.documents,
                     ": one at a time; allowed: either, or neither");
    const c10::Device dev = (o.device == "cuda" || (o.device == "auto" && has_cuda)) ? c10::Device(c10::kCUDA, 0)
                                                                                       : c10::Device(c10::kCPU);
    const int iters = o.iters > 0 ? o.iters : (cuda(dev) ? 20 : 3);
    if (o.deterministic) dtrain::train::use_deterministic_algorithms();
#ifdef DTRAIN_WITH_CUDA
    dtrain_attention_set_smem_cap(o.smem_cap);
#else
    DTRAIN_CHECK_ARG(o.smem_cap == 0, "--smem-cap ", o.smem_cap, " caps the CUDA kernels, and this build has none; "
                     "allowed: 0");
#endif
    torch::manual_seed(0);
    Out out(o.json);
    if (o.only == "all" || o.only == "attention") attention(o, dev, iters, out);
    if (o.only == "gqa") gqa(o, dev, iters, out);
    if (o.only == "ce_split") ce_split(o, dev, iters, out);
    if (o.only == "cp_chunks") cp_chunks(o, dev, iters, out);
    if (o.only == "linear_ce") linear_ce(o, dev, iters, out);
    for (const char* op : {"all", "adamw", "norm", "swiglu", "rope", "ce"}) {
      if (o.only == op) memory_bound(o, dev, iters, out);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernel_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
