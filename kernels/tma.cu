// Tensor maps for the bulk tensor copies (tma.cuh): cuTensorMapEncodeTiled through the
// runtime's driver entry point (no link against libcuda), or the emulator's encoding.
#include <cudaTypedefs.h>

#include <mutex>

#include "common.cuh"
#include "tma.cuh"

namespace dtrain_kernels {

cudaError_t make_tensor_map_4d(CUtensorMap* map, const void* base, bool bf16, const uint64_t (&dims)[4],
                               const int64_t (&strides)[3], uint32_t box0, uint32_t box1) {
  // A dimension of size 1 is never stepped along: any legal stride describes it.
  uint64_t bytes[3];
  for (int i = 0; i < 3; ++i) {
    const int64_t s = dims[i + 1] == 1 && strides[i] <= 0 ? 8 : strides[i];
    if (s <= 0 || s % 8 != 0) return cudaErrorNotSupported;
    bytes[i] = static_cast<uint64_t>(s) * 2;
  }
#ifdef DTRAIN_KERNELS_EMULATE
  ::dtrain_emu::TensorMap m{};
  m.base = base;
  m.rank = 4;
  m.elem_bytes = 2;
  m.swizzle = 128;
  for (int i = 0; i < 4; ++i) m.dims[i] = dims[i];
  m.strides[0] = 2;
  for (int i = 0; i < 3; ++i) m.strides[i + 1] = bytes[i];
  m.box[0] = box0;
  m.box[1] = box1;
  m.box[2] = m.box[3] = 1;
  (void)bf16;
  ::dtrain_emu::encode_tensor_map(map, m);
  return cudaSuccess;
#else
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) ==
            cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    } else {
      cudaGetLastError();  // leave no sticky error behind
    }
  });
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint32_t box[4] = {box0, box1, 1, 1}, element_strides[4] = {1, 1, 1, 1};
  const CUresult r =
      encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, const_cast<void*>(base),
             dims, bytes, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
#endif
}

}  // namespace dtrain_kernels
