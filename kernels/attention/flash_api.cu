// The C entry points of flash attention (dtrain_kernels/attention.h): validation, then
// dispatch to the (kernel, dtype, head dim) instantiation.
#include <atomic>
#include <type_traits>

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
         p.scale > 0.f && p.window >= 0 && p.query_offset >= 0 &&
         (p.query_offset == 0 || p.causal) && p.query_offset <= INT32_MAX &&
         p.dropout_p >= 0.f && p.dropout_p < 1.f &&  // NaN fails both
         p.softcap >= 0.f && p.softcap <= 3.4e38f &&   // NaN and inf fail
         (p.documents.start == nullptr) == (p.documents.end == nullptr) &&
         (p.documents.start == nullptr ||
          (p.documents.stride >= 0 && document_row_tokens(p) >= imax(p.seq_k, p.query_offset + p.seq_q)));
}

// What one (pass, kernel) is, per dtype T and kernel head dim D: run (its launcher) and
// smem (a block's dynamic shared memory).
template <typename T, int D>
struct Fwd {
  static cudaError_t run(const dtrain_attention_fwd_params& p, cudaStream_t s) { return run_flash_fwd<T, D>(p, s); }
  static size_t smem() { return flash_fwd_smem_bytes<T, D>(); }
};
template <typename T, int D>
struct FwdSm90 {
  static cudaError_t run(const dtrain_attention_fwd_params& p, cudaStream_t s) {
    return run_flash_fwd_sm90<T, D>(p, s);
  }
  static size_t smem() { return flash_fwd_sm90_smem_bytes<T, D>(); }
};
template <typename T, int D>
struct Bwd {
  static cudaError_t run(const dtrain_attention_bwd_params& p, cudaStream_t s) { return run_flash_bwd<T, D>(p, s); }
  static size_t smem() { return flash_bwd_smem_bytes<T, D>(); }
};
template <typename T, int D>
struct BwdSm90 {
  static cudaError_t run(const dtrain_attention_bwd_params& p, cudaStream_t s) {
    return run_flash_bwd_sm90<T, D>(p, s);
  }
  static size_t smem() { return flash_bwd_sm90_smem_bytes<T, D>(); }
};

// The largest head dim a pass has a wgmma kernel for.
template <typename Params>
constexpr int64_t kMaxWgmmaDim =
    std::is_same<Params, dtrain_attention_fwd_params>::value ? kMaxWgmmaFwdHeadDim : kMaxWgmmaBwdHeadDim;

// f(Run<T, D>{}) for the dtype and the kernel head dim D that holds head_dim: mma.sync's
// (with_mma_dim) or wgmma's up to kMax (with_wgmma_dim; above it nothing is instantiated,
// and the answer is fallback()).
template <template <typename, int> class Run, int D, typename F>
auto with_dtype(dtrain_kernel_dtype dtype, F&& f) {
  return dtype == DTRAIN_KERNEL_BF16 ? f(Run<__nv_bfloat16, D>{}) : f(Run<__half, D>{});
}
template <template <typename, int> class Run, typename F>
auto with_mma_dim(int64_t head_dim, dtrain_kernel_dtype dtype, F&& f) {
  switch (mma_kernel_dim(head_dim)) {
    case 32: return with_dtype<Run, 32>(dtype, f);
    case 64: return with_dtype<Run, 64>(dtype, f);
    case 96: return with_dtype<Run, 96>(dtype, f);
    case 128: return with_dtype<Run, 128>(dtype, f);
    default: return with_dtype<Run, 256>(dtype, f);
  }
}
template <template <typename, int> class Run, int64_t kMax, typename Fallback, typename F>
auto with_wgmma_dim(int64_t head_dim, dtrain_kernel_dtype dtype, Fallback fallback, F&& f) {
  switch (wgmma_kernel_dim(head_dim)) {
    case 64: return with_dtype<Run, 64>(dtype, f);
    case 128: return with_dtype<Run, 128>(dtype, f);
    default:
      if constexpr (kMax >= 256) {
        return with_dtype<Run, 256>(dtype, f);
      } else {
        return fallback();
      }
  }
}

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

// What a launch of this pass asking for `kernel` at this head dim runs here: 1 wgmma, 0
// mma.sync, -1 nothing. Head dims wgmma has no kernel for in this pass (none today) send
// AUTO to mma.sync and an explicit WGMMA to nothing.
template <typename Params>
int pick_kernel(dtrain_attention_kernel kernel, int64_t head_dim) {
  const int k = pick_kernel(kernel);
  if (k == 1 && head_dim > kMaxWgmmaDim<Params>) return kernel == DTRAIN_ATTENTION_KERNEL_AUTO ? 0 : -1;
  return k;
}

// Whether a launch of this pass asking for `kernel` takes this head dim, on any device:
// every kernel the supported ones, wgmma up to its largest for the pass.
template <typename Params>
int takes_head_dim(dtrain_attention_kernel kernel, int64_t head_dim) {
  const bool fits = kernel != DTRAIN_ATTENTION_KERNEL_WGMMA || head_dim <= kMaxWgmmaDim<Params>;
  return dtrain_attention_supports_head_dim(head_dim) && fits ? 1 : 0;
}

// dtrain_attention_set_smem_cap's (0: none).
std::atomic<size_t> smem_cap{0};

// A block's dynamic shared memory in the mma.sync (0) or wgmma (1) kernel at this head dim
// (0 bytes: none).
template <template <typename, int> class Mma, template <typename, int> class Wgmma, typename Params>
size_t kernel_smem(int kernel, int64_t head_dim) {
  auto smem = [](auto run) { return decltype(run)::smem(); };
  if (kernel == 0) return with_mma_dim<Mma>(head_dim, DTRAIN_KERNEL_BF16, smem);
  return with_wgmma_dim<Wgmma, kMaxWgmmaDim<Params>>(head_dim, DTRAIN_KERNEL_BF16, [] { return size_t{0}; }, smem);
}

// pick_kernel, where AUTO also goes to mma.sync when wgmma's block would not get its shared
// memory (under dtrain_attention_set_smem_cap: a GPU of less, emulated); -1 for no kernel.
template <template <typename, int> class Mma, template <typename, int> class Wgmma, typename Params>
int fitted_kernel(dtrain_attention_kernel kernel, int64_t head_dim) {
  if (!dtrain_attention_supports_head_dim(head_dim)) return -1;
  const int k = pick_kernel<Params>(kernel, head_dim);
  if (k == 1 && kernel == DTRAIN_ATTENTION_KERNEL_AUTO &&
      kernel_smem<Mma, Wgmma, Params>(1, head_dim) > device_block_smem()) {
    return 0;
  }
  return k;
}

// A block's dynamic shared memory in the kernel that fitted_kernel names (0: none).
template <template <typename, int> class Mma, template <typename, int> class Wgmma, typename Params>
size_t picked_smem(dtrain_attention_kernel kernel, int64_t head_dim) {
  const int k = fitted_kernel<Mma, Wgmma, Params>(kernel, head_dim);
  return k < 0 ? 0 : kernel_smem<Mma, Wgmma, Params>(k, head_dim);
}
// Runs the kernel a launch asking for p.kernel gets here (fitted_kernel); one whose block
// needs more shared memory than the device gives is refused before anything runs. The
// wgmma kernels load through tensor maps; strides the driver cannot describe
// (cudaErrorNotSupported, before anything is launched) send AUTO to mma.sync and make an
// explicit WGMMA fail.
template <template <typename, int> class Mma, template <typename, int> class Wgmma, typename Params>
cudaError_t run_picked(const Params& p, cudaStream_t stream) {
  const int kernel = fitted_kernel<Mma, Wgmma, Params>(p.kernel, p.head_dim);
  if (kernel < 0 || kernel_smem<Mma, Wgmma, Params>(kernel, p.head_dim) > device_block_smem()) {
    return cudaErrorInvalidValue;
  }
  auto run = [&](auto r) { return decltype(r)::run(p, stream); };
  if (kernel == 0) return with_mma_dim<Mma>(p.head_dim, p.dtype, run);
  const cudaError_t e = with_wgmma_dim<Wgmma, kMaxWgmmaDim<Params>>(
      p.head_dim, p.dtype, [] { return cudaErrorInvalidValue; }, run);
  if (e == cudaErrorNotSupported) {
    return p.kernel == DTRAIN_ATTENTION_KERNEL_AUTO ? with_mma_dim<Mma>(p.head_dim, p.dtype, run)
                                                       : cudaErrorInvalidValue;
  }
  return e;
}

}  // namespace

namespace {
// An attribute of the current device; 0 without one (and no sticky error left behind).
int current_device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return value;
}
}  // namespace

size_t device_block_smem() {
  const auto bytes = static_cast<size_t>(current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
  const size_t cap = smem_cap.load(std::memory_order_relaxed);
  return cap > 0 ? std::min(cap, bytes) : bytes;
}

int device_sms() { return std::max(1, current_device_attribute(cudaDevAttrMultiProcessorCount)); }

}  // namespace dtrain_kernels

extern "C" int dtrain_attention_supports_head_dim(int64_t head_dim) {
  return head_dim >= 8 && head_dim <= dtrain_kernels::kMaxHeadDim && head_dim % 8 == 0;
}

extern "C" int dtrain_attention_kernel_available(dtrain_attention_kernel kernel) {
  return dtrain_kernels::pick_kernel(kernel) >= 0 ? 1 : 0;
}

extern "C" int dtrain_attention_fwd_kernel_takes_head_dim(dtrain_attention_kernel kernel, int64_t head_dim) {
  return dtrain_kernels::takes_head_dim<dtrain_attention_fwd_params>(kernel, head_dim);
}

extern "C" int dtrain_attention_bwd_kernel_takes_head_dim(dtrain_attention_kernel kernel, int64_t head_dim) {
  return dtrain_kernels::takes_head_dim<dtrain_attention_bwd_params>(kernel, head_dim);
}

extern "C" size_t dtrain_attention_fwd_smem_bytes(dtrain_attention_kernel kernel, int64_t head_dim) {
  using namespace dtrain_kernels;
  return picked_smem<Fwd, FwdSm90, dtrain_attention_fwd_params>(kernel, head_dim);
}

extern "C" size_t dtrain_attention_bwd_smem_bytes(dtrain_attention_kernel kernel, int64_t head_dim) {
  using namespace dtrain_kernels;
  return picked_smem<Bwd, BwdSm90, dtrain_attention_bwd_params>(kernel, head_dim);
}

extern "C" size_t dtrain_attention_device_smem_bytes(void) { return dtrain_kernels::device_block_smem(); }

extern "C" void dtrain_attention_set_smem_cap(size_t bytes) {
  dtrain_kernels::smem_cap.store(bytes, std::memory_order_relaxed);
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
