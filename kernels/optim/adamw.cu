// Fused multi-tensor AdamW (dtrain_kernels/adamw.h): the segments are cut into chunks, and
// one launch covers up to kMaxSegments segments and kMaxBlocks chunks whose addresses
// travel in the kernel's parameter block (no device-side table, no allocation). Segments
// whose pointers are aligned move 4 elements per access (16 bytes of float32).
#include "common.cuh"
#include "dtrain_kernels/adamw.h"

namespace dtrain_kernels {
namespace {

constexpr int kMaxSegments = 32;
constexpr int kMaxBlocks = 320;  // with the segments, the parameter block stays within 4 KB
constexpr int kThreads = 512;
constexpr int64_t kChunk = 16384;  // elements per block

struct Batch {
  float* param[kMaxSegments];
  const void* grad[kMaxSegments];
  float* exp_avg[kMaxSegments];
  float* exp_avg_sq[kMaxSegments];
  void* model[kMaxSegments];
  int64_t numel[kMaxSegments];
  float decay[kMaxSegments];      // 1 - lr * weight_decay
  unsigned char vec[kMaxSegments];  // every pointer of the segment allows 4-element accesses
  unsigned char segment[kMaxBlocks];
  int chunk[kMaxBlocks];
};

struct Hyper {
  float beta1, beta2, eps, step_size, inv_sqrt_bc2, grad_scale;
  int* found_inf;
  const int* skip;
};

// One element: false, and p, m, v unchanged, when the scaled gradient is not finite.
__device__ __forceinline__ bool adamw_update(float& p, float g, float& m, float& v, float decay, const Hyper& h) {
  const float gs = g * h.grad_scale;
  if (!isfinite(gs)) return false;
  m = h.beta1 * m + (1.f - h.beta1) * gs;
  v = h.beta2 * v + (1.f - h.beta2) * gs * gs;
  p = p * decay - h.step_size * m / (sqrtf(v) * h.inv_sqrt_bc2 + h.eps);
  return true;
}

// Elements [begin, end) of segment s (begin and end - begin multiples of V), V per access
// and kIlp accesses per thread loaded before any math. True when a gradient was not finite.
template <int V, int kIlp, typename G, typename M>
__device__ __forceinline__ bool update_range(const Batch& batch, int s, int64_t begin, int64_t end, const Hyper& h) {
  constexpr int64_t kStep = int64_t{kThreads} * V;
  float* __restrict__ p = batch.param[s];
  const G* __restrict__ g = static_cast<const G*>(batch.grad[s]);
  float* __restrict__ m = batch.exp_avg[s];
  float* __restrict__ v = batch.exp_avg_sq[s];
  M* __restrict__ out = static_cast<M*>(batch.model[s]);
  const float decay = batch.decay[s];
  bool bad = false;
  for (int64_t base = begin + int64_t{threadIdx.x} * V; base < end; base += kStep * kIlp) {
    Vec<float, V> pr[kIlp], mr[kIlp], vr[kIlp];
    Vec<G, V> gr[kIlp];
#pragma unroll
    for (int i = 0; i < kIlp; ++i) {
      const int64_t e = base + i * kStep;
      if (e < end) {
        pr[i] = load_vec<V>(p + e);
        gr[i] = load_vec<V>(g + e);
        mr[i] = load_vec<V>(m + e);
        vr[i] = load_vec<V>(v + e);
      }
    }
#pragma unroll
    for (int i = 0; i < kIlp; ++i) {
      const int64_t e = base + i * kStep;
      if (e >= end) continue;
      Vec<M, V> model;
#pragma unroll
      for (int l = 0; l < V; ++l) {
        bad |= !adamw_update(pr[i].v[l], to_float(gr[i].v[l]), mr[i].v[l], vr[i].v[l], decay, h);
        model.v[l] = from_float<M>(pr[i].v[l]);
      }
      store_vec<V>(p + e, pr[i]);
      store_vec<V>(m + e, mr[i]);
      store_vec<V>(v + e, vr[i]);
      if (out != nullptr) store_vec<V>(out + e, model);
    }
  }
  return bad;
}

template <typename G, typename M>
__global__ void __launch_bounds__(kThreads) adamw_kernel(Batch batch, Hyper h) {
  if (h.skip != nullptr && *h.skip != 0) return;
  const int s = batch.segment[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(batch.chunk[blockIdx.x]) * kChunk;
  const int64_t end = imin(batch.numel[s], begin + kChunk);
  bool bad;
  if (batch.vec[s]) {  // chunks start at multiples of 4: only the segment's last few elements are single
    const int64_t vend = begin + (end - begin) / 4 * 4;
    bad = update_range<4, 2, G, M>(batch, s, begin, vend, h);
    bad |= update_range<1, 1, G, M>(batch, s, vend, end, h);
  } else {
    bad = update_range<1, 4, G, M>(batch, s, begin, end, h);
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
    batch.vec[nseg] = aligned(sg.param, 16) && aligned(sg.exp_avg, 16) && aligned(sg.exp_avg_sq, 16) &&
                      aligned(sg.grad, 4 * sizeof(G)) && aligned(sg.model_param, 4 * sizeof(M));
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
        batch.vec[0] = batch.vec[keep];
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
