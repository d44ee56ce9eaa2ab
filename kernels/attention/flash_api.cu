// The C entry points of flash attention (dtrain_kernels/attention.h): validation, then
// dispatch to the (kernel, dtype, head dim) instantiation.
#include <atomic>

#include "attention/flash.cuh"
#include "common.cuh"

namespace dtrain_kernels {
namespace {

bool strides_ok(const dtrain_attention_strides& s) {
  return s.batch % 8 == 0 && s.head % 8 == 0 && s.seq % 8 == 0 && s.batch >= 0 && s.head >= 0 && s.seq >= 0;
}

template <typename Params>
bool shape_ok(const Params& p) {
  return p.batch > 0 && p.heads > 0 && p.kv_heads > 0 && p.heads % p.kv_heads == 0 && p.seq_q > 0 && p.seq_k > 0 &&
         dtrain_attention_supports_head_dim(p.head_dim) && (p.dtype == DTRAIN_KERNEL_BF16 || p.dtype == DTRAIN_KERNEL_F16) &&
         p.batch <= 65535 && p.heads <= 65535 && (p.seq_q + 63) / 64 <= INT32_MAX && (p.seq_k + 63) / 64 <= INT32_MAX &&
         p.scale > 0.f && p.window >= 0 && (p.window == 0 || p.causal) && p.query_offset >= 0 &&
         (p.query_offset == 0 || p.causal) && p.query_offset <= INT32_MAX &&
         (p.documents.start == nullptr) == (p.documents.end == nullptr) &&
         (p.documents.start == nullptr ||
          (p.causal && p.documents.stride >= 0 && document_row_tokens(p) >= imax(p.seq_k, p.query_offset + p.seq_q)));
}

// Run<T, D>::run for the params' dtype and kernel head dim D (flash.cuh).
template <template <typename, int> class Run, int D, typename Params>
cudaError_t run_dim(const Params& p, cudaStream_t stream) {
  return p.dtype == DTRAIN_KERNEL_BF16 ? Run<__nv_bfloat16, D>::run(p, stream) : Run<__half, D>::run(p, stream);
}
template <template <typename, int> class Run, typename Params>
cudaError_t dispatch_mma(const Params& p, cudaStream_t stream) {
  switch (mma_kernel_dim(p.head_dim)) {
    case 32: return run_dim<Run, 32>(p, stream);
    case 64: return run_dim<Run, 64>(p, stream);
    case 96: return run_dim<Run, 96>(p, stream);
    case 128: return run_dim<Run, 128>(p, stream);
    default: return run_dim<Run, 256>(p, stream);
  }
}
template <template <typename, int> class Run, typename Params>
cudaError_t dispatch_wgmma(const Params& p, cudaStream_t stream) {
  return wgmma_kernel_dim(p.head_dim) == 64 ? run_dim<Run, 64>(p, stream) : run_dim<Run, 128>(p, stream);
}

template <typename T, int D>
struct Fwd {
  static cudaError_t run(const dtrain_attention_fwd_params& p, cudaStream_t s) { return run_flash_fwd<T, D>(p, s); }
};
template <typename T, int D>
struct FwdSm90 {
  static cudaError_t run(const dtrain_attention_fwd_params& p, cudaStream_t s) {
    return run_flash_fwd_sm90<T, D>(p, s);
  }
};

// The wgmma kernels are real code only in an sm_90a build (DTRAIN_KERNELS_SM90A) and run
// only on compute capability 9.0; the emulator runs them anywhere. The answer per device
// is cached: launches ask on every call.
bool wgmma_available() {
#if defined(DTRAIN_KERNELS_EMULATE)
  return true;
#elif defined(DTRAIN_KERNELS_SM90A)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // no device: leave no sticky error behind
    return false;
  }
  static std::atomic<signed char> cache[64];  // per device: 0 unknown, 1 yes, -1 no
  signed char known = device >= 0 && device < 64 ? cache[device].load(std::memory_order_relaxed) : 0;
  if (known == 0) {
    int major = 0, minor = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
    if (!ok) cudaGetLastError();
    known = ok && major == 9 && minor == 0 ? 1 : -1;
    if (device >= 0 && device < 64) cache[device].store(known, std::memory_order_relaxed);
  }
  return known > 0;
#else
  return false;
#endif
}

// What a launch asking for `kernel` runs here: 1 wgmma, 0 mma.sync, -1 nothing (a kernel
// this device or build cannot run, or no kernel at all).
int pick_kernel(dtrain_attention_kernel kernel) {
  switch (kernel) {
    case DTRAIN_ATTENTION_KERNEL_AUTO:
      return wgmma_available() ? 1 : 0;
    case DTRAIN_ATTENTION_KERNEL_MMA:
      return 0;
    case DTRAIN_ATTENTION_KERNEL_WGMMA:
      return wgmma_available() ? 1 : -1;
  }
  return -1;
}

// Runs the kernel a launch asking for p.kernel gets here. Head dims wgmma has no kernel
// for (above 128) send AUTO to mma.sync and make an explicit WGMMA fail. The wgmma kernels
// load through tensor maps; strides the driver cannot describe (cudaErrorNotSupported,
// before anything is launched) do the same.
template <template <typename, int> class Mma, template <typename, int> class Wgmma, typename Params>
cudaError_t run_picked(const Params& p, cudaStream_t stream) {
  const int kernel = pick_kernel(p.kernel);
  if (kernel < 0) return cudaErrorInvalidValue;
  if (kernel == 1 && p.head_dim > kMaxWgmmaHeadDim) {
    return p.kernel == DTRAIN_ATTENTION_KERNEL_AUTO ? dispatch_mma<Mma>(p, stream) : cudaErrorInvalidValue;
  }
  if (kernel == 0) return dispatch_mma<Mma>(p, stream);
  const cudaError_t e = dispatch_wgmma<Wgmma>(p, stream);
  if (e == cudaErrorNotSupported) {
    return p.kernel == DTRAIN_ATTENTION_KERNEL_AUTO ? dispatch_mma<Mma>(p, stream) : cudaErrorInvalidValue;
  }
  return e;
}

template <typename T, int D>
struct Bwd {
  static cudaError_t run(const dtrain_attention_bwd_params& p, cudaStream_t s) { return run_flash_bwd<T, D>(p, s); }
};
template <typename T, int D>
struct BwdSm90 {
  static cudaError_t run(const dtrain_attention_bwd_params& p, cudaStream_t s) {
    return run_flash_bwd_sm90<T, D>(p, s);
  }
};

}  // namespace
}  // namespace dtrain_kernels

extern "C" int dtrain_attention_supports_head_dim(int64_t head_dim) {
  return head_dim >= 8 && head_dim <= dtrain_kernels::kMaxHeadDim && head_dim % 8 == 0;
}

extern "C" int dtrain_attention_kernel_available(dtrain_attention_kernel kernel) {
  return dtrain_kernels::pick_kernel(kernel) >= 0 ? 1 : 0;
}

extern "C" int dtrain_attention_kernel_takes_head_dim(dtrain_attention_kernel kernel, int64_t head_dim) {
  const bool wgmma_only = kernel == DTRAIN_ATTENTION_KERNEL_WGMMA;
  return dtrain_attention_supports_head_dim(head_dim) && (!wgmma_only || head_dim <= dtrain_kernels::kMaxWgmmaHeadDim)
             ? 1
             : 0;
}

extern "C" cudaError_t dtrain_attention_fwd(const dtrain_attention_fwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (!shape_ok(p) || !p.q || !p.k || !p.v || !p.o || !p.lse || !p.workspace || !aligned(p.workspace, 4)) {
    return cudaErrorInvalidValue;
  }
  if (!strides_ok(p.q_stride) || !strides_ok(p.k_stride) || !strides_ok(p.v_stride) || !strides_ok(p.o_stride)) {
    return cudaErrorInvalidValue;
  }
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.v, 16) || !aligned(p.o, 4)) return cudaErrorInvalidValue;
  return run_picked<Fwd, FwdSm90>(p, stream);
}

extern "C" size_t dtrain_attention_fwd_workspace_bytes(const dtrain_attention_fwd_params* params) {
  return params == nullptr ? 0 : 16;  // one int, in 16 bytes
}

extern "C" size_t dtrain_attention_bwd_workspace_bytes(const dtrain_attention_bwd_params* params) {
  if (params == nullptr || params->batch <= 0 || params->heads <= 0 || params->seq_q <= 0) return 0;
  return sizeof(float) * dtrain_kernels::flash_bwd_workspace_floats(*params);
}

extern "C" cudaError_t dtrain_attention_bwd(const dtrain_attention_bwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (!shape_ok(p) || !p.q || !p.k || !p.v || !p.o || !p.dout || !p.lse || !p.dq || !p.dk || !p.dv ||
      !p.workspace) {
    return cudaErrorInvalidValue;
  }
  for (const auto* s : {&p.q_stride, &p.k_stride, &p.v_stride, &p.o_stride, &p.dout_stride, &p.dq_stride,
                        &p.dk_stride, &p.dv_stride}) {
    if (!strides_ok(*s)) return cudaErrorInvalidValue;
  }
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.v, 16) || !aligned(p.dout, 16) || !aligned(p.o, 2) ||
      !aligned(p.dq, 2) || !aligned(p.dk, 4) || !aligned(p.dv, 4) || !aligned(p.workspace, 4)) {
    return cudaErrorInvalidValue;
  }
  return run_picked<Bwd, BwdSm90>(p, stream);
}
