// Fused multi-tensor AdamW (dtrain_kernels/adamw.h): the segments are cut into chunks, and
// one launch covers up to kMaxSegments segments and kMaxBlocks chunks whose addresses
// travel in the kernel's parameter block (no device-side table, no allocation).
#include "common.cuh"
#include "dtrain_kernels/adamw.h"

namespace dtrain_kernels {
namespace {

constexpr int kMaxSegments = 32;
constexpr int kMaxBlocks = 320;
constexpr int kThreads = 512;
constexpr int64_t kChunk = 16384;  // elements per block
constexpr int kIlp = 4;           // elements per thread and iteration

struct Batch {
  float* param[kMaxSegments];
  const void* grad[kMaxSegments];
  float* exp_avg[kMaxSegments];
  float* exp_avg_sq[kMaxSegments];
  void* model[kMaxSegments];
  int64_t numel[kMaxSegments];
  float decay[kMaxSegments];      // 1 - lr * weight_decay
  unsigned char segment[kMaxBlocks];
  int chunk[kMaxBlocks];
};

struct Hyper {
  float beta1, beta2, eps, step_size, inv_sqrt_bc2, grad_scale;
  int* found_inf;
  const int* skip;
};

template <typename G, typename M>
__global__ void __launch_bounds__(kThreads) adamw_kernel(Batch batch, Hyper h) {
  if (h.skip != nullptr && *h.skip != 0) return;
  const int s = batch.segment[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(batch.chunk[blockIdx.x]) * kChunk;
  const int64_t end = imin(batch.numel[s], begin + kChunk);
  float* __restrict__ p = batch.param[s];
  const G* __restrict__ g = static_cast<const G*>(batch.grad[s]);
  float* __restrict__ m = batch.exp_avg[s];
  float* __restrict__ v = batch.exp_avg_sq[s];
  M* __restrict__ out = static_cast<M*>(batch.model[s]);
  const float decay = batch.decay[s];
  bool bad = false;
  // kIlp independent elements per thread and iteration: loads issued before any math.
  for (int64_t base = begin + threadIdx.x; base < end; base += int64_t{kThreads} * kIlp) {
    float pr[kIlp], gr[kIlp], mr[kIlp], vr[kIlp];
#pragma unroll
    for (int i = 0; i < kIlp; ++i) {
      const int64_t e = base + int64_t{i} * kThreads;
      if (e < end) {
        pr[i] = p[e];
        gr[i] = to_float(g[e]);
        mr[i] = m[e];
        vr[i] = v[e];
      }
    }
#pragma unroll
    for (int i = 0; i < kIlp; ++i) {
      const int64_t e = base + int64_t{i} * kThreads;
      if (e >= end) continue;
      const float gi = gr[i] * h.grad_scale;
      if (!isfinite(gi)) {
        bad = true;
        continue;
      }
      const float mi = h.beta1 * mr[i] + (1.f - h.beta1) * gi;
      const float vi = h.beta2 * vr[i] + (1.f - h.beta2) * gi * gi;
      const float pi = pr[i] * decay - h.step_size * mi / (sqrtf(vi) * h.inv_sqrt_bc2 + h.eps);
      p[e] = pi;
      m[e] = mi;
      v[e] = vi;
      if (out != nullptr) out[e] = from_float<M>(pi);
    }
  }
  if (bad && h.found_inf != nullptr) *h.found_inf = 1;
}

template <typename G, typename M>
cudaError_t launch_all(const dtrain_adamw_segment* segs, int n, const Hyper& h, float lr, cudaStream_t stream) {
  Batch batch{};
  int nseg = 0, nblocks = 0;
  auto flush = [&]() -> cudaError_t {
    if (nblocks == 0) return cudaSuccess;
    auto* kernel = adamw_kernel<G, M>;
    DTRAIN_LAUNCH(kernel, nblocks, kThreads, 0, stream, batch, h);
    nseg = nblocks = 0;
    return launched();
  };
  for (int i = 0; i < n; ++i) {
    const auto& sg = segs[i];
    if (sg.numel == 0) continue;
    if (nseg == kMaxSegments) {
      if (auto e = flush(); e != cudaSuccess) return e;
    }
    batch.param[nseg] = sg.param;
    batch.grad[nseg] = sg.grad;
    batch.exp_avg[nseg] = sg.exp_avg;
    batch.exp_avg_sq[nseg] = sg.exp_avg_sq;
    batch.model[nseg] = sg.model_param;
    batch.numel[nseg] = sg.numel;
    batch.decay[nseg] = 1.f - lr * sg.weight_decay;
    const int64_t chunks = (sg.numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (nblocks == kMaxBlocks) {
        // The segment continues in the next launch: keep its entry as the first one.
        const int keep = nseg;
        if (auto e = flush(); e != cudaSuccess) return e;
        batch.param[0] = batch.param[keep];
        batch.grad[0] = batch.grad[keep];
        batch.exp_avg[0] = batch.exp_avg[keep];
        batch.exp_avg_sq[0] = batch.exp_avg_sq[keep];
        batch.model[0] = batch.model[keep];
        batch.numel[0] = batch.numel[keep];
        batch.decay[0] = batch.decay[keep];
      }
      batch.segment[nblocks] = static_cast<unsigned char>(nseg);
      batch.chunk[nblocks] = static_cast<int>(c);
      ++nblocks;
    }
    ++nseg;
  }
  return flush();
}

template <typename G>
cudaError_t launch_grad(const dtrain_adamw_segment* segs, int n, const dtrain_adamw_params& p, const Hyper& h,
                        cudaStream_t stream) {
  bool any_model = false;
  for (int i = 0; i < n; ++i) any_model |= segs[i].model_param != nullptr;
  if (!any_model) return launch_all<G, float>(segs, n, h, p.lr, stream);  // out stays null
  if (p.model_dtype == DTRAIN_KERNEL_BF16) return launch_all<G, __nv_bfloat16>(segs, n, h, p.lr, stream);
  if (p.model_dtype == DTRAIN_KERNEL_F16) return launch_all<G, __half>(segs, n, h, p.lr, stream);
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace dtrain_kernels

extern "C" cudaError_t dtrain_adamw(const dtrain_adamw_segment* segments, int n, const dtrain_adamw_params* params,
                                    cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr || n < 0 || (n > 0 && segments == nullptr)) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (!(p.bias_correction1 > 0.f) || !(p.bias_correction2 > 0.f) || !(p.eps > 0.f)) return cudaErrorInvalidValue;
  for (int i = 0; i < n; ++i) {
    const auto& s = segments[i];
    if (s.numel < 0 || (s.numel > 0 && (!s.param || !s.grad || !s.exp_avg || !s.exp_avg_sq))) {
      return cudaErrorInvalidValue;
    }
    if (s.numel / kChunk >= INT32_MAX) return cudaErrorInvalidValue;
  }
  Hyper h;
  h.beta1 = p.beta1;
  h.beta2 = p.beta2;
  h.eps = p.eps;
  h.step_size = p.lr / p.bias_correction1;
  h.inv_sqrt_bc2 = 1.f / sqrtf(p.bias_correction2);
  h.grad_scale = p.grad_scale;
  h.found_inf = p.found_inf;
  h.skip = p.skip;
  switch (p.grad_dtype) {
    case DTRAIN_KERNEL_F32: return launch_grad<float>(segments, n, p, h, stream);
    case DTRAIN_KERNEL_BF16: return launch_grad<__nv_bfloat16>(segments, n, p, h, stream);
    case DTRAIN_KERNEL_F16: return launch_grad<__half>(segments, n, p, h, stream);
  }
  return cudaErrorInvalidValue;
}
