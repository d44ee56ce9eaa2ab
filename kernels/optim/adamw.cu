// Fused multi-tensor AdamW (dtrain_kernels/adamw.h): the segments are cut into chunks of
// kChunk elements, and one launch covers every chunk of up to kMaxSegments segments, whose
// addresses travel in the kernel's parameter block (no device-side table, no allocation).
// The grid holds as many blocks as the GPU runs at once, each striding over the chunks, so
// a launch has one tail however many chunks it covers (a 124M-parameter flat shard: one
// launch). Segments whose pointers are aligned move 4 elements per access (16 bytes of
// float32).
#include "common.cuh"
#include "dtrain_kernels/adamw.h"

namespace dtrain_kernels {
namespace {

constexpr int kMaxSegments = 64;
constexpr int kThreads = 512;
constexpr int64_t kChunk = 16384;  // elements per block and step of the stride

struct Batch {
  float* param[kMaxSegments];
  const void* grad[kMaxSegments];
  float* exp_avg[kMaxSegments];
  float* exp_avg_sq[kMaxSegments];
  void* model[kMaxSegments];
  int64_t numel[kMaxSegments];
  int64_t first_chunk[kMaxSegments + 1];  // segment s: chunks [first_chunk[s], first_chunk[s + 1])
  float decay[kMaxSegments];              // 1 - lr * weight_decay
  unsigned char vec[kMaxSegments];        // every pointer of the segment allows 4-element accesses
  int segments;
};

struct Hyper {
  float beta1, beta2, eps, step_size, inv_sqrt_bc2, grad_scale;
  int* found_inf;
  const int* skip;
};

static_assert(sizeof(Batch) + sizeof(Hyper) <= 4096, "the kernel's parameter block (4 KB)");

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

// The aligned path loads one 16-byte access per array before its math: with two, ptxas
// held 100-108 registers in the chunk loop (64 now), one block of 512 threads per SM
// instead of two, for the same bytes in flight.
template <typename G, typename M>
__global__ void __launch_bounds__(kThreads) adamw_kernel(Batch batch, Hyper h) {
  if (h.skip != nullptr && *h.skip != 0) return;
  bool bad = false;
  int s = 0;
  for (int64_t c = blockIdx.x; c < batch.first_chunk[batch.segments]; c += gridDim.x) {
    while (c >= batch.first_chunk[s + 1]) ++s;  // a block's chunks only grow
    const int64_t begin = (c - batch.first_chunk[s]) * kChunk;
    const int64_t end = imin(batch.numel[s], begin + kChunk);
    if (batch.vec[s]) {  // chunks start at multiples of 4: only the segment's last few elements are single
      const int64_t vend = begin + (end - begin) / 4 * 4;
      bad |= update_range<4, 1, G, M>(batch, s, begin, vend, h);
      bad |= update_range<1, 1, G, M>(batch, s, vend, end, h);
    } else {
      bad |= update_range<1, 4, G, M>(batch, s, begin, end, h);
    }
  }
  if (bad && h.found_inf != nullptr) *h.found_inf = 1;
}

template <typename G, typename M>
cudaError_t launch_all(const dtrain_adamw_segment* segs, int n, const Hyper& h, float lr, cudaStream_t stream) {
  auto* kernel = adamw_kernel<G, M>;
  const Occupancy o = occupancy(kernel, kThreads, 0);
  const int64_t resident = int64_t{o.sms} * o.per_sm;
  Batch batch{};
  auto flush = [&]() -> cudaError_t {
    const int64_t chunks = batch.first_chunk[batch.segments];
    if (chunks == 0) return cudaSuccess;
    DTRAIN_LAUNCH(kernel, static_cast<unsigned>(imin(chunks, resident)), kThreads, 0, stream, batch, h);
    batch.segments = 0;
    return launched();
  };
  for (int i = 0; i < n; ++i) {
    const auto& sg = segs[i];
    if (sg.numel == 0) continue;
    if (batch.segments == kMaxSegments) {
      if (auto e = flush(); e != cudaSuccess) return e;
    }
    const int k = batch.segments++;
    batch.param[k] = sg.param;
    batch.grad[k] = sg.grad;
    batch.exp_avg[k] = sg.exp_avg;
    batch.exp_avg_sq[k] = sg.exp_avg_sq;
    batch.model[k] = sg.model_param;
    batch.numel[k] = sg.numel;
    batch.decay[k] = 1.f - lr * sg.weight_decay;
    batch.vec[k] = aligned(sg.param, 16) && aligned(sg.exp_avg, 16) && aligned(sg.exp_avg_sq, 16) &&
                   aligned(sg.grad, 4 * sizeof(G)) && aligned(sg.model_param, 4 * sizeof(M));
    batch.first_chunk[k + 1] = batch.first_chunk[k] + (sg.numel + kChunk - 1) / kChunk;
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
