// Attention: LibTorch's scaled_dot_product_attention (grouped-query attention by its
// enable_gqa where a fused backend takes it) or flash attention as an autograd Function
// over the CUDA kernel (kernels/attention) and a reference path that computes the same
// function with ATen ops in float32, chunked over query rows.
#include "dtrain/ops/attention.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/SDPBackend.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <list>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "dtrain/core/env.hpp"
#include "dtrain/core/error.hpp"
#include "ops/kernel_launch.hpp"

#include "dtrain_kernels/attention_dropout.h"

#ifdef DTRAIN_WITH_CUDA
#include "dtrain_kernels/attention.h"
#ifndef DTRAIN_OPS_EMULATED
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif
#endif

namespace dtrain::ops {

AttentionBackend parse_attention_backend(const std::string& name, const char* option) {
  if (name == "sdpa") return AttentionBackend::kSdpa;
  if (name == "flash") return AttentionBackend::kFlash;
  DTRAIN_CHECK_ARG(false, option, "=", name, " is not an attention backend; allowed: sdpa, flash");
  return AttentionBackend::kSdpa;
}

const char* to_string(AttentionBackend backend) { return backend == AttentionBackend::kFlash ? "flash" : "sdpa"; }

bool flash_kernel_supports_head_dim(std::int64_t head_dim) {
#ifdef DTRAIN_WITH_CUDA
  return dtrain_attention_supports_head_dim(head_dim) != 0;
#else
  (void)head_dim;
  return false;
#endif
}

namespace {

constexpr const char* kOp = "flash_attention";
constexpr std::int64_t kChunk = 256;  // query rows per step of the reference path

// Both backends' sliding-window rule, named after the op (`op`) that got it.
void check_window(const char* op, std::int64_t window) {
  DTRAIN_OP_CHECK(window >= 0, op, "window=", window, " is not allowed; allowed: 0 (none) or a number of keys >= 1");
}

// The dtype sdpa computes in: q's, or autocast's where autocast casts q (a float type other
// than float64 on a device with autocast on), as it does for every sdpa backend.
at::ScalarType sdpa_dtype(const at::Tensor& q) {
  const auto type = q.device().type();
  const auto dtype = q.scalar_type();
  if (!at::isFloatingType(dtype) || dtype == at::kDouble || !at::autocast::is_autocast_available(type) ||
      !at::autocast::is_autocast_enabled(type) ||
      c10::impl::tls_is_dispatch_key_excluded(at::autocast::get_autocast_dispatch_key_from_device_type(type))) {
    return dtype;
  }
  return at::autocast::get_autocast_dtype(type);
}

// Both backends' rule for a query offset: the queries are tokens [query_offset,
// query_offset + queries) of a sequence whose first tokens are the keys, causal only.
void check_query_offset(const char* op, bool causal, std::int64_t query_offset) {
  DTRAIN_OP_CHECK(query_offset >= 0 && (query_offset == 0 || causal), op, "query_offset=", query_offset,
                  causal ? "" : " without causal", " is not allowed; allowed: 0, or with causal an offset >= 0");
}

// Both backends' rule for packed documents: integer [batch, time] on q's device, numbering
// the tokens of a sequence whose first tokens are the keys and whose tokens [query_offset,
// query_offset + queries) are the queries (it may go on past both; without causal the
// offset is 0, a token being query and key alike).
void check_documents(const char* op, const at::Tensor& q, const at::Tensor& k, const Documents& docs,
                     std::int64_t query_offset) {
  if (!docs.defined()) return;
  const auto& documents = docs.ids();
  const auto need = std::max(k.size(2), query_offset + q.size(2));
  DTRAIN_OP_CHECK(documents.dim() == 2 && documents.size(0) == q.size(0) && documents.size(1) >= need, op,
                  "documents must be [batch, time] = [", q.size(0), ", >= ", need, "]; got ", documents.sizes());
  DTRAIN_OP_CHECK(at::isIntegralType(documents.scalar_type(), /*includeBool=*/false), op, "documents are ",
                  detail::dtype_name(documents), "; allowed: an integer dtype (a document number per token)");
  DTRAIN_OP_CHECK(documents.device() == q.device(), op, "documents are on ", documents.device(), ", q on ",
      q.device(), "; they must be on one device");
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, std::int64_t window,
                  std::int64_t query_offset) {
  check_window(kOp, window);
  DTRAIN_OP_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kOp,
                  "q, k, v must be [batch, heads, time, head_dim]; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  DTRAIN_OP_CHECK(k.sizes() == v.sizes(), kOp, "k ", k.sizes(), " and v ", v.sizes(), " must have the same shape");
  DTRAIN_OP_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), kOp, "q ", q.sizes(), " and k ", k.sizes(),
                  " must agree in batch and head_dim");
  DTRAIN_OP_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, kOp, q.size(1),
                  " query heads are not a multiple of ", k.size(1), " key/value heads");
  DTRAIN_OP_CHECK(q.size(2) >= 1 && k.size(2) >= 1, kOp, "empty sequence: q ", q.sizes(), ", k ", k.sizes());
  check_query_offset(kOp, causal, query_offset);
  DTRAIN_OP_CHECK(q.device() == k.device() && q.device() == v.device(), kOp, "q, k, v must be on one device; got ",
                  q.device(), ", ", k.device(), ", ", v.device());
  DTRAIN_OP_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kOp,
                  "q, k, v must have one dtype; got ", detail::dtype_name(q), ", ", detail::dtype_name(k), ", ",
                  detail::dtype_name(v));
}

// Each token's document [start, end) from document numbers [B, T]: a document is a run of
// equal numbers. int32 [B, T] each, contiguous, on the numbers' device (the kernel's form).
std::pair<at::Tensor, at::Tensor> document_bounds(const at::Tensor& documents) {
  const auto T = documents.size(1);
  const auto pos = at::arange(T, documents.options().dtype(at::kLong)).expand(documents.sizes());
  auto first = at::ones(documents.sizes(), documents.options().dtype(at::kBool));
  auto last = first.clone();
  if (T > 1) {
    first.narrow(1, 1, T - 1).copy_(documents.narrow(1, 1, T - 1) != documents.narrow(1, 0, T - 1));
    last.narrow(1, 0, T - 1).copy_(first.narrow(1, 1, T - 1));
  }
  auto start = std::get<0>(at::where(first, pos, 0).cummax(1));
  auto end = std::get<0>(at::where(last, pos + 1, T).flip({1}).cummin(1)).flip({1});
  return {start.to(at::kInt).contiguous(), end.to(at::kInt).contiguous()};
}

// ---- reference path --------------------------------------------------------------------

// Whether query i may not see key j, for the queries at tokens [r0, r0 + n) of the keys'
// sequence and its first sk tokens as keys: [n, sk], or with documents (doc_start,
// doc_end: each token's document bounds, [B, >= max(r0 + n, sk)]) [B, 1, n, sk]
// (undefined without a mask). Without causal, documents and a window hide keys on both
// sides: those outside the query's document, and those W or more tokens away.
at::Tensor hidden_keys(std::int64_t r0, std::int64_t n, std::int64_t sk, bool causal, std::int64_t window,
                       const at::Tensor& doc_start, const at::Tensor& doc_end, const at::TensorOptions& options) {
  if (!causal && !doc_start.defined() && window == 0) return {};
  auto rows = at::arange(r0, r0 + n, options.dtype(at::kLong)).unsqueeze(1);
  auto cols = at::arange(sk, options.dtype(at::kLong)).unsqueeze(0);
  // The right side (causal: the diagonal), then the left: the window's, the document's.
  auto hidden = causal       ? cols > rows
                : window > 0 ? cols >= rows + window
                             : at::zeros({n, sk}, options.dtype(at::kBool));
  if (window > 0) hidden.logical_or_(cols <= rows - window);
  if (!doc_start.defined()) return hidden;
  hidden = hidden.logical_or(cols < doc_start.narrow(1, r0, n).unsqueeze(-1));
  if (!causal) hidden = hidden.logical_or(cols >= doc_end.narrow(1, r0, n).unsqueeze(-1));  // the document's right
  return hidden.unsqueeze(1);
}

// What hides keys from queries, as both paths take it: causal, the window, the query
// offset, and each token's document bounds (document_bounds; undefined without documents),
// which are not Tensor arguments of the Function, since it would track them as
// differentiable inputs.
struct Mask {
  bool causal = false;
  std::int64_t window = 0, query_offset = 0;
  at::Tensor doc_start, doc_end;
  // Attention dropout: probability (0: none) and the keep mask's seed
  // (dtrain_attention_dropout_keeps), drawn once per forward and kept for its backward.
  double dropout_p = 0.0;
  std::uint64_t dropout_seed = 0;
  // Logit soft-capping (0: none): the softmax takes softcap tanh(s scale / softcap).
  double softcap = 0.0;
  // Attention sinks (undefined: none): [H] on q's device, detached (their gradient is
  // FlashAttentionFn's, by sinks_grad).
  at::Tensor sinks;
};

// A seed for attention dropout from the default generator of `device` (under the model's
// RngTracker fork, its split stream; replayed by activation checkpointing as sdpa's
// dropout is): CUDA's Philox seed and offset (advanced past this call) mixed into one,
// else 64 bits of the CPU generator.
std::uint64_t draw_dropout_seed(const c10::Device& device) {
#if defined(DTRAIN_WITH_CUDA) && !defined(DTRAIN_OPS_EMULATED)
  if (device.is_cuda()) {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device.index()));
    std::lock_guard<std::mutex> lock(gen->mutex_);
    const auto [seed, offset] = gen->philox_engine_inputs(4);
    return seed ^ (offset * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull);
  }
#endif
  DTRAIN_CHECK_ARG(device.is_cpu(), "attention: flash attention's dropout has no generator on ", device,
                   "; allowed: CUDA or CPU tensors");
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->random64();
}

// Dropout's factor for the probabilities of query rows [r0, r0 + n) (before the query
// offset) against Sk keys: 1 / (1 - p) where the kernels keep one, 0 where they drop it,
// [B, H, n, Sk] in `options` (the hash runs on the host).
at::Tensor dropout_factor(std::int64_t B, std::int64_t H, std::int64_t r0, std::int64_t n, std::int64_t Sk,
                          const Mask& m, const at::TensorOptions& options) {
  const auto threshold = dtrain_attention_dropout_threshold(static_cast<float>(m.dropout_p));
  auto keep = at::empty({B, H, n, Sk}, at::TensorOptions().dtype(at::kByte));
  std::uint8_t* out = keep.data_ptr<std::uint8_t>();
  const std::int64_t first = m.query_offset + r0;
  at::parallel_for(0, B * H * n, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const std::int64_t bh = i / n, query = first + i % n;
      for (std::int64_t quad = 0; quad * 4 < Sk; ++quad) {  // one hash per 4 keys, as the kernels
        const std::uint64_t z = dtrain_attention_dropout_hash(m.dropout_seed, bh, query, quad);
        for (int j = 0; j < 4 && quad * 4 + j < Sk; ++j) {
          out[i * Sk + quad * 4 + j] = static_cast<std::uint8_t>(dtrain_attention_dropout_keeps_in(z, j, threshold));
        }
      }
    }
  });
  return keep.to(options) * (1.0 / (1.0 - m.dropout_p));
}

// Scores of query rows [r0, r0 + n) against every key, scaled, soft-capped and masked:
// [B, H, n, Sk]. capped: where given, tanh(s scale / softcap) (unmasked), the derivative's.
at::Tensor scores(const at::Tensor& qf, const at::Tensor& kf, std::int64_t r0, std::int64_t n, const Mask& m,
                  double scale, at::Tensor* capped = nullptr) {
  auto s = at::matmul(qf.narrow(2, r0, n), kf.transpose(-2, -1)) * scale;
  if (m.softcap > 0) {
    auto t = (s / m.softcap).tanh();
    s = t * m.softcap;
    if (capped != nullptr) *capped = t;
  }
  const auto hidden =
      hidden_keys(m.query_offset + r0, n, kf.size(2), m.causal, m.window, m.doc_start, m.doc_end, s.options());
  return hidden.defined() ? s.masked_fill(hidden, -std::numeric_limits<double>::infinity()) : s;
}

std::pair<at::Tensor, at::Tensor> reference_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const Mask& mask, double scale) {
  detail::NoAutocast no_autocast;
  const auto ct = detail::compute_type(q);
  const auto group = q.size(1) / k.size(1);
  auto qf = q.to(ct), kf = k.to(ct).repeat_interleave(group, 1), vf = v.to(ct).repeat_interleave(group, 1);
  auto o = at::empty(q.sizes(), qf.options());
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, qf.options());
  for (std::int64_t r0 = 0; r0 < q.size(2); r0 += kChunk) {
    const auto n = std::min(kChunk, q.size(2) - r0);
    auto s = scores(qf, kf, r0, n, mask, scale);
    // A row that sees no key: log-sum-exp +inf (as the kernel's), so its probabilities are
    // 0; with sinks, each head's sink is one more logit (such a row's is the sink's).
    auto l = s.logsumexp(-1, /*keepdim=*/true);
    if (mask.sinks.defined()) {
      l = at::logaddexp(l, mask.sinks.to(ct).view({1, -1, 1, 1}).expand_as(l));
    } else {
      l.masked_fill_(l == -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity());
    }
    auto probs = (s - l).exp();
    if (mask.dropout_p > 0) {
      probs = probs * dropout_factor(q.size(0), q.size(1), r0, n, k.size(2), mask, probs.options());
    }
    o.narrow(2, r0, n).copy_(at::matmul(probs, vf));
    lse.narrow(2, r0, n).copy_(l.squeeze(-1));
  }
  return {o.to(q.scalar_type()), lse};
}

std::vector<at::Tensor> reference_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout,
                                           const Mask& mask, double scale) {
  detail::NoAutocast no_autocast;
  const auto ct = detail::compute_type(q);
  const auto B = q.size(0), H = q.size(1), Hkv = k.size(1), Sk = k.size(2), D = q.size(3), group = H / Hkv;
  auto qf = q.to(ct), kf = k.to(ct).repeat_interleave(group, 1), vf = v.to(ct).repeat_interleave(group, 1);
  auto dof = dout.to(ct);
  auto delta = (dof * o.to(ct)).sum(-1, /*keepdim=*/true);  // rowsum(dO o) [B, H, Sq, 1]
  auto lsef = lse.to(ct).unsqueeze(-1);
  auto dq = at::empty(q.sizes(), qf.options());
  auto dk = at::zeros({B, H, Sk, D}, qf.options()), dv = at::zeros({B, H, Sk, D}, qf.options());
  for (std::int64_t r0 = 0; r0 < q.size(2); r0 += kChunk) {
    const auto n = std::min(kChunk, q.size(2) - r0);
    at::Tensor t;  // with soft-capping: tanh of the scaled scores over the cap
    auto p = (scores(qf, kf, r0, n, mask, scale, &t) - lsef.narrow(2, r0, n)).exp();
    auto d = dof.narrow(2, r0, n);
    // Under dropout P V took P Z / (1 - p): dV and dP go through the same factor, and delta
    // = rowsum(dO O) is rowsum(P dP) all the same.
    at::Tensor z;
    if (mask.dropout_p > 0) z = dropout_factor(B, H, r0, n, Sk, mask, p.options());
    dv += at::matmul((z.defined() ? p * z : p).transpose(-2, -1), d);
    auto dp = at::matmul(d, vf.transpose(-2, -1));
    if (z.defined()) dp = dp * z;
    auto ds = p * (dp - delta.narrow(2, r0, n));
    if (t.defined()) ds = ds * (1 - t.square());  // through softcap tanh(u / softcap)
    dq.narrow(2, r0, n).copy_(at::matmul(ds, kf) * scale);
    dk += at::matmul(ds.transpose(-2, -1), qf.narrow(2, r0, n)) * scale;
  }
  // Grouped-query attention: a kv head's gradient sums its query heads'.
  dk = dk.view({B, Hkv, group, Sk, D}).sum(2);
  dv = dv.view({B, Hkv, group, Sk, D}).sum(2);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), delta.squeeze(-1)};
}

// The attention sinks' gradient from the backward's delta = rowsum(dO o) [B, H, Sq] and the
// log-sum-exp (with the sinks): -sum over batch and rows of exp(sink - lse) delta, the
// sink's probability times the gradient of its logit; float32 (float64 for float64 lse) [H].
at::Tensor sinks_grad_of(const at::Tensor& delta, const at::Tensor& lse, const at::Tensor& sinks) {
  const auto ct = lse.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto weight = (sinks.to(ct).view({1, -1, 1}) - lse.to(ct)).exp();
  return -(weight * delta.to(ct)).sum(at::IntArrayRef{0, 2});
}

// ---- CUDA kernel -------------------------------------------------------------------------

#ifdef DTRAIN_WITH_CUDA
// The kernel reads rows with 16-byte loads: unit stride along head_dim, other strides in
// multiples of 8 elements, 16-byte aligned data; anything else is copied to contiguous.
at::Tensor kernel_layout(const at::Tensor& t) {
  const bool ok = t.stride(3) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
                  reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.contiguous();
}

dtrain_attention_strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

void check_kernel_inputs(const at::Tensor& q) {
  DTRAIN_OP_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, kOp, "q is ",
                  detail::dtype_name(q),
                  " on CUDA; the kernel takes bfloat16 or float16 (train with --precision bf16|fp16, or use "
                  "--attention sdpa)");
  DTRAIN_OP_CHECK(flash_kernel_supports_head_dim(q.size(3)), kOp, "head_dim ", q.size(3),
                  " is not supported by the kernel; allowed: ", kFlashKernelHeadDims, " (or use --attention sdpa)");
}

// The kernel DTRAIN_ATTENTION_KERNEL asks for; one this build and device cannot run, or
// that has no kernel for this head dim in a pass that will run (none today: every kernel
// takes every supported head dim in both passes), is an error naming the variable. A
// forward that will have a backward checks both, so that a training step fails before it
// runs anything.
dtrain_attention_kernel chosen_kernel(std::int64_t head_dim, bool forward, bool backward) {
  const std::string name = env::attention_kernel();
  const auto kernel = name == "mma"     ? DTRAIN_ATTENTION_KERNEL_MMA
                      : name == "wgmma" ? DTRAIN_ATTENTION_KERNEL_WGMMA
                                        : DTRAIN_ATTENTION_KERNEL_AUTO;
  DTRAIN_OP_CHECK(dtrain_attention_kernel_available(kernel), kOp, env::kAttentionKernel, "=", name,
                  " cannot run here (wgmma needs a compute capability 9.0 GPU and a library built for sm_90a); "
                  "allowed here: auto, mma");
  DTRAIN_OP_CHECK(!forward || dtrain_attention_fwd_kernel_takes_head_dim(kernel, head_dim), kOp,
                  env::kAttentionKernel, "=", name, " has no forward kernel for head_dim ", head_dim,
                  "; allowed: auto, mma");
  DTRAIN_OP_CHECK(!backward || dtrain_attention_bwd_kernel_takes_head_dim(kernel, head_dim), kOp,
                  env::kAttentionKernel, "=", name, " has no backward kernel for head_dim ", head_dim,
                  "; allowed: auto, mma (auto's backward runs mma.sync there)");
  return kernel;
}

// Whether this device gives a block the shared memory of the kernels a launch at head_dim
// runs, in the passes that will run (every head dim fits every sm_80 and later GPU: D 256
// runs in smaller tiles on those of 99 KB a block). An error names the head dim, the bytes
// needed and given, and the head dims that fit.
void check_shared_memory(dtrain_attention_kernel kernel, std::int64_t head_dim, bool forward, bool backward) {
  const std::size_t have = dtrain_attention_device_smem_bytes();
  auto need = [&](std::int64_t d) {  // (forward, backward) per block; 0 for a pass that will not run
    return std::make_pair(forward ? dtrain_attention_fwd_smem_bytes(kernel, d) : 0,
                          backward ? dtrain_attention_bwd_smem_bytes(kernel, d) : 0);
  };
  const auto [fwd, bwd] = need(head_dim);
  if (fwd <= have && bwd <= have) return;
  std::int64_t largest = 0;
  for (std::int64_t d = 8; d < head_dim; d += 8) {
    const auto [f, b] = need(d);
    if (f <= have && b <= have) largest = d;
  }
  DTRAIN_OP_CHECK(false, kOp, "head_dim ", head_dim, ": the ", fwd > have ? "forward" : "backward", " kernel needs ",
                  fwd > have ? fwd : bwd, " bytes of shared memory per block and this GPU gives a block ", have,
                  "; allowed here: head_dim up to ", largest, " (or use --attention sdpa)");
}

// Fills the params' shape, mask and kernel; `with_backward`: a forward whose backward will
// run (its kernel is checked too).
template <typename Params>
void fill_shape(Params& p, const at::Tensor& q, const at::Tensor& k, const Mask& mask, double scale,
                bool with_backward) {
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.kv_heads = k.size(1);
  p.seq_q = q.size(2);
  p.seq_k = k.size(2);
  p.head_dim = q.size(3);
  p.scale = static_cast<float>(scale);
  p.causal = mask.causal ? 1 : 0;
  p.window = mask.window;
  p.query_offset = mask.query_offset;
  if (mask.doc_start.defined()) {  // contiguous [B, T >= max(seq_k, query_offset + seq_q)]
    p.documents = {mask.doc_start.data_ptr<std::int32_t>(), mask.doc_end.data_ptr<std::int32_t>(),
                   mask.doc_start.size(1)};
  }
  p.dropout_p = static_cast<float>(mask.dropout_p);
  p.dropout_seed = mask.dropout_seed;
  p.softcap = static_cast<float>(mask.softcap);
  p.dtype = detail::kernel_dtype(q, kOp, "q");
  constexpr bool kForward = std::is_same<Params, dtrain_attention_fwd_params>::value;
  p.kernel = chosen_kernel(p.head_dim, kForward, !kForward || with_backward);
  check_shared_memory(p.kernel, p.head_dim, kForward, !kForward || with_backward);
}

// with_backward: a backward will follow (its kernel is checked before anything runs).
std::pair<at::Tensor, at::Tensor> kernel_forward(at::Tensor q, at::Tensor k, at::Tensor v, const Mask& mask,
                                                 double scale, bool with_backward) {
  check_kernel_inputs(q);
  q = kernel_layout(q), k = kernel_layout(k), v = kernel_layout(v);
  const detail::DeviceGuard guard(q.device());
  // o laid out [B, T, H, D]: the model's transpose back to [B, T, H * D] is free.
  auto o = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  dtrain_attention_fwd_params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.o_stride = strides_of(o);
  fill_shape(p, q, k, mask, scale, with_backward);
  const auto sinks = mask.sinks.defined() ? mask.sinks.to(at::kFloat).contiguous() : at::Tensor();
  if (sinks.defined()) p.sinks = sinks.data_ptr<float>();
  auto workspace = at::empty({static_cast<std::int64_t>(dtrain_attention_fwd_workspace_bytes(&p) / sizeof(int))},
                             q.options().dtype(at::kInt));
  p.workspace = workspace.data_ptr();
  DTRAIN_CUDA_CHECK(dtrain_attention_fwd(&p, detail::current_stream(q)));
  return {o, lse};
}

std::vector<at::Tensor> kernel_backward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor o, const at::Tensor& lse,
                                        at::Tensor dout, const Mask& mask, double scale) {
  q = kernel_layout(q), k = kernel_layout(k), v = kernel_layout(v), o = kernel_layout(o), dout = kernel_layout(dout);
  const detail::DeviceGuard guard(q.device());
  auto dq = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
  auto dk = at::empty(k.sizes(), k.options()), dv = at::empty(v.sizes(), v.options());
  dtrain_attention_bwd_params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.o_stride = strides_of(o);
  p.dout_stride = strides_of(dout);
  p.dq_stride = strides_of(dq);
  p.dk_stride = strides_of(dk);
  p.dv_stride = strides_of(dv);
  fill_shape(p, q, k, mask, scale, /*with_backward=*/true);
  p.deterministic = at::globalContext().deterministicAlgorithms() ? 1 : 0;
  auto workspace = at::empty({static_cast<std::int64_t>(dtrain_attention_bwd_workspace_bytes(&p) / sizeof(float))},
                             q.options().dtype(at::kFloat));
  p.workspace = workspace.data_ptr();
  DTRAIN_CUDA_CHECK(dtrain_attention_bwd(&p, detail::current_stream(q)));
  const auto rows = p.batch * p.heads * p.seq_q;  // delta, at the workspace's end
  return {dq, dk, dv, workspace.narrow(0, workspace.numel() - rows, rows).view({p.batch, p.heads, p.seq_q})};
}
#endif

// The two passes on the kernel where it runs, else on the reference path; the backward's
// {dq, dk, dv, delta = rowsum(dO o) [B, H, Sq]}.
std::pair<at::Tensor, at::Tensor> forward_pass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const Mask& mask, double scale, bool with_backward) {
#ifdef DTRAIN_WITH_CUDA
  if (detail::on_kernel_device(q)) return kernel_forward(q, k, v, mask, scale, with_backward);
#endif
  (void)with_backward;
  return reference_forward(q, k, v, mask, scale);
}

std::vector<at::Tensor> backward_pass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout,
                                      const Mask& mask, double scale) {
#ifdef DTRAIN_WITH_CUDA
  if (detail::on_kernel_device(q)) return kernel_backward(q, k, v, o, lse, dout, mask, scale);
#endif
  return reference_backward(q, k, v, o, lse, dout, mask, scale);
}

// sinks: [H] (a Tensor input, so that autograd gives it its gradient), or empty for none
// (an undefined Tensor cannot be an input).
class FlashAttentionFn : public torch::autograd::Function<FlashAttentionFn> {
 public:
  // with_backward: decided outside, where grad mode is the caller's.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& sinks, Mask mask, double scale,
                            bool with_backward) {
    if (sinks.numel() > 0) mask.sinks = sinks.detach();
    const auto [o, lse] = forward_pass(q, k, v, mask, scale, with_backward);
    ctx->save_for_backward({q, k, v, o, lse, mask.sinks});
    ctx->saved_data["doc_start"] = mask.doc_start;
    ctx->saved_data["doc_end"] = mask.doc_end;
    ctx->saved_data["causal"] = mask.causal;
    ctx->saved_data["window"] = mask.window;
    ctx->saved_data["query_offset"] = mask.query_offset;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = mask.dropout_p;
    std::int64_t seed = 0;  // the seed's bits in an int IValue
    std::memcpy(&seed, &mask.dropout_seed, sizeof(seed));
    ctx->saved_data["dropout_seed"] = seed;
    ctx->saved_data["softcap"] = mask.softcap;
    return o;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    Mask mask;
    mask.causal = ctx->saved_data["causal"].toBool();
    mask.window = ctx->saved_data["window"].toInt();
    mask.query_offset = ctx->saved_data["query_offset"].toInt();
    mask.doc_start = ctx->saved_data["doc_start"].toTensor();
    mask.doc_end = ctx->saved_data["doc_end"].toTensor();
    mask.dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const std::int64_t seed = ctx->saved_data["dropout_seed"].toInt();
    std::memcpy(&mask.dropout_seed, &seed, sizeof(seed));
    mask.softcap = ctx->saved_data["softcap"].toDouble();
    mask.sinks = saved[5];
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto g = backward_pass(saved[0], saved[1], saved[2], saved[3], saved[4], grads[0], mask, scale);
    at::Tensor dsinks;
    if (mask.sinks.defined() && ctx->needs_input_grad(3)) dsinks = sinks_grad_of(g[3], saved[4], mask.sinks);
    return {g[0], g[1], g[2], dsinks, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

struct Documents::Derived {
  struct Mask {
    at::Tensor mask;
    std::int64_t window, first_query, seq_q, seq_k;
    at::ScalarType dtype;
    c10::Device device;
    bool causal;
  };
  // A context-parallel rank's layers ask for two masks in turn (one per chunk of queries),
  // so a few are kept; a list, so that a kept mask stays where it is.
  static constexpr std::size_t kMasks = 4;
  std::pair<at::Tensor, at::Tensor> bounds;
  std::list<Mask> masks;
  // Ring attention asks for the ranges of its blocks in every layer: all are kept (a
  // list, so that a returned reference stays valid).
  struct Slice {
    std::int64_t first, tokens;
    Documents documents;
  };
  std::list<Slice> slices;
};

Documents::Documents() : derived_(std::make_shared<Derived>()) {}

Documents::Documents(at::Tensor ids) : ids_(std::move(ids)), derived_(std::make_shared<Derived>()) {}

const std::pair<at::Tensor, at::Tensor>& Documents::bounds() const {
  DTRAIN_CHECK(defined(), "internal: document bounds without documents");
  if (!derived_->bounds.first.defined()) derived_->bounds = document_bounds(ids_);
  return derived_->bounds;
}

const at::Tensor& Documents::sdpa_mask(std::int64_t window, at::ScalarType dtype, std::int64_t seq_q,
                                       std::int64_t seq_k, c10::Device device, std::int64_t first_query,
                                       bool causal) const {
  DTRAIN_CHECK(defined() || window > 0 || first_query > 0,
               "internal: an sdpa mask without documents, a window or a query offset");
  DTRAIN_CHECK(causal || first_query == 0, "internal: an sdpa mask without causal at a query offset");
  DTRAIN_CHECK(first_query >= 0 && (!defined() || (first_query + seq_q <= ids_.size(1) &&
                                                    seq_k <= ids_.size(1) && device == ids_.device())),
               "internal: a document mask for other sequences than the documents'");
  auto& d = *derived_;
  for (const auto& m : d.masks) {
    if (m.window == window && m.dtype == dtype && m.first_query == first_query && m.seq_q == seq_q &&
        m.seq_k == seq_k && m.device == device && m.causal == causal) {
      return m.mask;
    }
  }
  // Rows padded to 16 elements, as the memory-efficient backend wants its bias (else it
  // pads a copy in every call).
  const auto padded = (seq_k + 15) / 16 * 16;
  const auto options = at::TensorOptions().device(device);
  at::Tensor mask;
  if (defined()) {
    mask = at::zeros({ids_.size(0), 1, seq_q, padded}, options.dtype(dtype)).narrow(3, 0, seq_k);
  } else {
    mask = at::zeros({seq_q, padded}, options.dtype(dtype)).narrow(1, 0, seq_k);
  }
  mask.masked_fill_(hidden_keys(first_query, seq_q, seq_k, causal, window, defined() ? bounds().first : at::Tensor(),
                                defined() ? bounds().second : at::Tensor(), options),
                    -std::numeric_limits<double>::infinity());
  if (d.masks.size() == Derived::kMasks) d.masks.pop_front();
  d.masks.push_back({std::move(mask), window, first_query, seq_q, seq_k, dtype, device, causal});
  return d.masks.back().mask;
}

const Documents& Documents::slice(std::int64_t first, std::int64_t tokens) const {
  DTRAIN_CHECK(defined() && first >= 0 && tokens >= 1 && first + tokens <= ids_.size(1),
               "internal: a slice of documents past their tokens");
  for (const auto& s : derived_->slices) {
    if (s.first == first && s.tokens == tokens) return s.documents;
  }
  derived_->slices.push_back({first, tokens, Documents(ids_.narrow(1, first, tokens))});
  return derived_->slices.back().documents;
}

namespace {

// Attention sinks: a floating [H] tensor on q's device, H q's heads (undefined: none).
void check_sinks(const char* op, const at::Tensor& q, const at::Tensor& sinks) {
  if (!sinks.defined()) return;
  DTRAIN_OP_CHECK(sinks.dim() == 1 && sinks.size(0) == q.size(1), op, "sinks must be [heads] = [", q.size(1),
                  "] (one logit per query head); got ", sinks.sizes());
  DTRAIN_OP_CHECK(at::isFloatingType(sinks.scalar_type()), op, "sinks are ", detail::dtype_name(sinks),
                  "; allowed: a floating dtype");
  DTRAIN_OP_CHECK(sinks.device() == q.device(), op, "sinks are on ", sinks.device(), ", q on ", q.device(),
                  "; they must be on one device");
}

// The Function's sinks input: sinks, or an empty tensor for none.
at::Tensor sinks_input(const at::Tensor& sinks, const at::Tensor& q) {
  return sinks.defined() ? sinks : at::empty({0}, q.options().dtype(at::kFloat));
}

// flash_attention's checks, then what its passes take.
Mask checked_mask(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, std::int64_t window,
                  const Documents& documents, std::int64_t query_offset, double softcap) {
  check_inputs(q, k, v, causal, window, query_offset);
  check_documents(kOp, q, k, documents, query_offset);
  DTRAIN_OP_CHECK(softcap >= 0 && softcap <= std::numeric_limits<float>::max(), kOp, "softcap=", softcap,
                  " is out of range; allowed: 0 (none) or a finite cap > 0 (Gemma 2: 50)");
  Mask mask;
  mask.causal = causal, mask.window = window, mask.query_offset = query_offset, mask.softcap = softcap;
  if (documents.defined()) std::tie(mask.doc_start, mask.doc_end) = documents.bounds();
  return mask;
}

double scale_or_default(double scale, const at::Tensor& q) {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

// The shape checks fold_sinks and sinks_grad share: o [B, H, S, D], lse [B, H, S], sinks [H].
void check_sink_shapes(const char* op, const at::Tensor& o, const at::Tensor& lse, const at::Tensor& sinks) {
  DTRAIN_OP_CHECK(o.dim() == 4 && lse.dim() == 3 && lse.sizes() == o.sizes().slice(0, 3), op, "o must be [batch, ",
                  "heads, seq, head_dim] and lse [batch, heads, seq]; got o ", o.sizes(), ", lse ", lse.sizes());
  check_sinks(op, o, sinks);
  DTRAIN_OP_CHECK(sinks.defined(), op, "sinks are undefined");
}

}  // namespace

std::pair<at::Tensor, at::Tensor> fold_sinks(const at::Tensor& o, const at::Tensor& lse, const at::Tensor& sinks) {
  check_sink_shapes("fold_sinks", o, lse, sinks);
  const auto folded = at::logaddexp(lse, sinks.to(lse.scalar_type()).view({1, -1, 1}).expand_as(lse));
  // A row that saw no key (lse -inf or +inf, output 0) stays 0.
  const auto keep = (lse - folded).exp().masked_fill(lse.isinf(), 0.0);
  return {(o * keep.unsqueeze(-1).to(o.scalar_type())), folded};
}

at::Tensor sinks_grad(const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout, const at::Tensor& sinks) {
  check_sink_shapes("sinks_grad", o, lse, sinks);
  const auto ct = lse.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return sinks_grad_of((dout.to(ct) * o.to(ct)).sum(-1), lse, sinks);
}

at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                           double scale, std::int64_t window, const Documents& documents, std::int64_t query_offset,
                           double dropout_p, std::optional<std::uint64_t> dropout_seed, double softcap,
                           const at::Tensor& sinks) {
  Mask mask = checked_mask(q, k, v, causal, window, documents, query_offset, softcap);
  check_sinks(kOp, q, sinks);
  DTRAIN_OP_CHECK(dropout_p >= 0 && dropout_p < 1, kOp, "dropout_p=", dropout_p,
                  " is out of range; allowed: [0, 1)");
  if (dropout_p > 0) {
    mask.dropout_p = dropout_p;
    mask.dropout_seed = dropout_seed ? *dropout_seed : draw_dropout_seed(q.device());
  }
  const bool with_backward = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() ||
                                                            v.requires_grad() || (sinks.defined() && sinks.requires_grad()));
  return FlashAttentionFn::apply(q, k, v, sinks_input(sinks, q), mask, scale_or_default(scale, q), with_backward);
}

at::Tensor flash_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, bool causal, double scale, std::int64_t window,
                                  double dropout_p, double softcap, const at::Tensor& sinks) {
  DTRAIN_OP_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, kOp, "varlen: q, k and v must be [total, heads, "
                  "head_dim]; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  DTRAIN_OP_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), kOp, "varlen: k (", k.size(0), " tokens) and v (",
                  v.size(0), ") must hold q's ", q.size(0), " tokens (packed self-attention: one cu_seqlens for both)");
  DTRAIN_OP_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2 &&
                      (cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong) &&
                      cu_seqlens.device() == q.device(),
                  kOp, "varlen: cu_seqlens must be int32 or int64 [sequences + 1] on q's device ", q.device(), "; got ",
                  cu_seqlens.scalar_type(), " ", cu_seqlens.sizes(), " on ", cu_seqlens.device());
  // Token t's sequence: the number of boundaries c_1.. at or before it (a document number).
  const auto tokens = at::arange(q.size(0), cu_seqlens.options());
  const auto ids = at::searchsorted(cu_seqlens, tokens, /*out_int32=*/false, /*right=*/true).unsqueeze(0);
  auto bhsd = [](const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); };  // [1, heads, total, D]
  const auto o = flash_attention(bhsd(q), bhsd(k), bhsd(v), causal, scale, window, Documents(ids), 0,
                                 dropout_p, std::nullopt, softcap, sinks);
  return o.transpose(1, 2).squeeze(0);
}

std::pair<at::Tensor, at::Tensor> flash_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, bool causal, double scale,
                                                          std::int64_t window, const Documents& documents,
                                                          std::int64_t query_offset, double softcap) {
  const Mask mask = checked_mask(q, k, v, causal, window, documents, query_offset, softcap);
  // Its callers (ring attention) run the backward themselves, often from inside a
  // Function's forward where grad mode is off: inputs that require grad will have one.
  const bool with_backward = q.requires_grad() || k.requires_grad() || v.requires_grad();
  return forward_pass(q, k, v, mask, scale_or_default(scale, q), with_backward);
}

std::vector<at::Tensor> flash_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout,
                                                 bool causal, double scale, std::int64_t window,
                                                 const Documents& documents, std::int64_t query_offset,
                                                 double softcap) {
  const Mask mask = checked_mask(q, k, v, causal, window, documents, query_offset, softcap);
  DTRAIN_OP_CHECK(o.sizes() == q.sizes() && dout.sizes() == q.sizes(), kOp, "o ", o.sizes(), " and dout ",
                  dout.sizes(), " must have q's shape ", q.sizes());
  DTRAIN_OP_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
                  kOp, "lse must be [batch, heads, seq_q] = [", q.size(0), ", ", q.size(1), ", ", q.size(2), "]; got ",
                  lse.sizes());
  auto g = backward_pass(q, k, v, o, lse.contiguous(), dout, mask, scale_or_default(scale, q));
  g.pop_back();  // delta
  return g;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                     double dropout_p, AttentionBackend backend, std::int64_t window, const Documents& documents,
                     std::int64_t query_offset, double softcap, const at::Tensor& sinks) {
  if (backend == AttentionBackend::kFlash) {
    return flash_attention(q, k, v, causal, 0.0, window, documents, query_offset, dropout_p, std::nullopt, softcap,
                           sinks);
  }
  DTRAIN_CHECK_ARG(softcap == 0, "attention: softcap=", softcap, " needs the flash backend (sdpa has no logit "
                   "soft-capping); allowed with sdpa: 0");
  DTRAIN_CHECK_ARG(!sinks.defined(), "attention: sinks need the flash backend (sdpa has no attention sinks); "
                   "allowed with sdpa: none");
  check_window("attention", window);
  DTRAIN_CHECK_ARG(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                   "attention: q, k, v must be [batch, heads, time, head_dim]; got ", q.sizes(),
                   ", ", k.sizes(), ", ", v.sizes());
  const auto h = q.size(1), hkv = k.size(1);
  DTRAIN_CHECK_ARG(hkv >= 1 && h % hkv == 0, "attention: ", h, " query heads are not a multiple of ",
                   hkv, " key/value heads");
  check_query_offset("attention", causal, query_offset);
  check_documents("attention", q, k, documents, query_offset);
  // An explicit mask of the keys each query sees (sdpa has no window, no documents and no
  // query offset), made once for all the calls that share `documents`, additive in the
  // dtype sdpa computes in, so that sdpa uses it (and saves it for the backward) as it is:
  // one per forward, where a boolean mask became such a bias, saved, in every layer.
  const auto dtype = sdpa_dtype(q);
  std::optional<at::Tensor> mask;
  if (documents.defined() || window > 0 || query_offset > 0) {
    mask = documents.sdpa_mask(window, dtype, q.size(2), k.size(2), q.device(), query_offset, causal);
  }
  const bool is_causal = causal && !mask.has_value();
  if (hkv == h) return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal);
  // Grouped-query attention: sdpa's own (no copy of k and v per query head, none saved for
  // the backward) wherever a backend other than math takes it; else k and v repeated, as
  // math would repeat them, so that a backend without GQA (the memory-efficient one in
  // some LibTorch versions) may still take the call. The choice is asked of q, k, v in the
  // dtype sdpa computes in: cast here as autocast would cast them inside sdpa.
  const auto qc = q.to(dtype), kc = k.to(dtype), vc = v.to(dtype);
  const auto choice = at::_fused_sdp_choice(qc, kc, vc, mask, dropout_p, is_causal, std::nullopt, /*enable_gqa=*/true);
  if (choice != static_cast<std::int64_t>(at::SDPBackend::math)) {
    return at::scaled_dot_product_attention(qc, kc, vc, mask, dropout_p, is_causal, std::nullopt, /*enable_gqa=*/true);
  }
  return at::scaled_dot_product_attention(qc, kc.repeat_interleave(h / hkv, 1), vc.repeat_interleave(h / hkv, 1),
                                          mask, dropout_p, is_causal);
}

}  // namespace dtrain::ops
