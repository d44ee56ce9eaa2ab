// Fused RMSNorm / LayerNorm backward (dtrain_kernels/norm.h). A block owns a strip of rows;
// per row it reduces the two sums dx needs, writes dx, and adds the row's dy * xhat (and
// dy) into its own columns' partial sums (in registers where they fit beside the weights,
// else in shared memory); the strip's partials go to the workspace, and a column kernel
// sums the strips into dweight (and dbias).
#include "norm/norm.cuh"

namespace dtrain_kernels {
namespace {

// What a backward instance holds in registers for the whole strip. A thread of at most
// kRowVecs accesses a row holds their weights: on the H200 that took the backward from 0.61
// to 0.81-0.83 (RMSNorm) and 0.52 to 0.71-0.75 (LayerNorm) of the copy bandwidth (loading
// the next row's x and dy ahead instead, into registers or into shared memory by cp.async,
// did no better). It holds the partial sums of its columns too where they fit: dweight's
// beside the weights, dbias' at half the accesses. A partial not held lives in shared
// memory, read and written per row: at 4096 bf16 columns that was 32 KB a row each, against
// 24 KB of x, dy and dx from DRAM. A bf16 thread of 4 accesses holds 16 + 16 registers of x
// and dy, 32 of weights and 32 of dweight's partials (ptxas: 128 registers and no spill in
// bf16 on sm_90a; a few bytes on sm_80 and in fp16); dbias' would make 160.
template <bool kLayerNorm, int kVecs>
struct BwdHeld {
  static constexpr bool kWeights = kVecs <= kRowVecs;
  static constexpr bool kDweight = kWeights;  // beside them
  static constexpr bool kDbias = kLayerNorm && kVecs <= kRowVecs / 2;
  // Rows of cols floats in shared memory: the partials not held.
  static constexpr int kSmemRows = (kDweight ? 0 : 1) + (kLayerNorm && !kDbias ? 1 : 0);
};

// The partial sums of a thread's columns (dweight's or dbias'), over its strip's rows: held
// (held[k]: access k) or in shared memory (smem[column]), where a thread owns the columns of
// its accesses as in registers, so no barrier guards them. `want` false: nothing is read or
// written in memory (held sums are added all the same, and never written).
template <bool kHeld, int V, int kVecs>
struct ColumnPartial {
  float* smem;
  bool want;
  float held[kHeld ? kVecs : 1][V] = {};
  __device__ __forceinline__ ColumnPartial(float* s, bool w, int nv) : smem(s), want(w) {
    if constexpr (!kHeld) {
      each_access<kVecs>(nv, [&](int, int j) {
        const float zero[V] = {};
        if (want) store_floats<V>(smem + j * V, zero);
      });
    }
  }
  // The V sums of access (k, j) to add into: held[k], or tmp loaded from shared memory,
  // which end() stores back.
  __device__ __forceinline__ float* begin(int k, int j, float (&tmp)[V]) {
    if constexpr (kHeld) return held[k];
    if (want) load_floats<V>(smem + j * V, tmp);
    return tmp;
  }
  __device__ __forceinline__ void end(int j, const float (&tmp)[V]) {
    if (!kHeld && want) store_floats<V>(smem + j * V, tmp);
  }
  // To out[cols] (the strip's row of the workspace).
  __device__ __forceinline__ void write(int nv, float* out) const {
    if (!want) return;
    each_access<kVecs>(nv, [&](int k, int j) {
      if constexpr (kHeld) {
        store_floats<V>(out + j * V, held[k]);
      } else {
        float a[V];
        load_floats<V>(smem + j * V, a);
        store_floats<V>(out + j * V, a);
      }
    });
  }
};

template <typename T, bool kLayerNorm, int V, int kVecs>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_kernel(dtrain_norm_bwd_params p, int64_t rows_per_strip,
                                                               float inv_cols) {
  using Held = BwdHeld<kLayerNorm, kVecs>;
  // fp16 x, dy and weights converted at each use (to_float_each_use), never held as float
  // copies across the block reduction between the two passes: ptxas (2026-12-07) then
  // spills in none of the 16-bit instances, where at 4 accesses a thread fp16 spilled 8
  // to 44 bytes (sm_90a) and bf16 LayerNorm 16 on sm_80. Not the weights of the float32
  // instances: at 8 accesses one spilled 28 bytes that way, none without.
  constexpr bool kEachUseWeights = sizeof(T) == 2;
  DTRAIN_DYNAMIC_SMEM(float, partial);  // [Held::kSmemRows][cols]: the partials not held
  __shared__ float2 scratch[32];
  const int64_t n = p.cols;
  const int nv = static_cast<int>(n / V);
  const bool want_w = p.dweight != nullptr, want_b = kLayerNorm && p.dbias != nullptr;
  ColumnPartial<Held::kDweight, V, kVecs> dw(partial, want_w, nv);
  ColumnPartial<Held::kDbias, V, kVecs> db(partial + (Held::kDweight ? 0 : n), want_b, nv);
  const int64_t first = blockIdx.x * rows_per_strip, last = imin(p.rows, first + rows_per_strip);
  using Row = RowShare<T, V, kVecs, true>;
  auto x_of = [&](int64_t r) { return Row(static_cast<const T*>(p.x) + r * p.x_stride, nv); };
  auto dy_of = [&](int64_t r) { return Row(static_cast<const T*>(p.dy) + r * p.dy_stride, nv); };
  float wheld[Held::kWeights ? kVecs : 1][V];
  if constexpr (Held::kWeights) {
    each_access<kVecs>(nv, [&](int k, int j) {
      load_weights<V, kEachUseWeights>(p.weight, p.weight_dtype, j, wheld[k]);
    });
  }
  auto weights = [&](int k, int j, float (&wv)[V]) {
    if constexpr (Held::kWeights) {
#pragma unroll
      for (int i = 0; i < V; ++i) wv[i] = wheld[k][i];
    } else {
      load_weights<V, kEachUseWeights>(p.weight, p.weight_dtype, j, wv);
    }
  };
  auto do_row = [&](int64_t row, const Row& x, const Row& dy) {
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
    const float mean = kLayerNorm ? p.mean[row] : 0.f, rstd = p.rstd[row];
    // g = dy * w, xhat = (x - mean) * rstd: dx = rstd (g - mean(g) - xhat mean(g xhat)),
    // without the mean(g) term for RMSNorm.
    float2 sums = make_float2(0.f, 0.f);  // (sum of g xhat, sum of g)
    each_access<kVecs>(nv, [&](int k, int j) {
      float wv[V];
      weights(k, j, wv);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float g = dy.at(k, j, i) * wv[i];
        sums.x += g * ((x.at(k, j, i) - mean) * rstd);
        sums.y += g;
      }
    });
    if (kLayerNorm) {
      sums = block_sum2(sums, scratch);
    } else {
      sums.x = block_sum(sums.x, reinterpret_cast<float*>(scratch));
    }
    const float mgx = sums.x * inv_cols, mg = kLayerNorm ? sums.y * inv_cols : 0.f;
    each_access<kVecs>(nv, [&](int k, int j) {
      float wv[V], tw[V] = {}, tb[V] = {};
      weights(k, j, wv);
      float* aw = dw.begin(k, j, tw);
      float* ab = db.begin(k, j, tb);
      Vec<T, V> out;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = dy.at(k, j, i);
        const float xhat = (x.at(k, j, i) - mean) * rstd;
        out.v[i] = from_float<T>(rstd * (d * wv[i] - mg - xhat * mgx));
        aw[i] += d * xhat;
        if (kLayerNorm) ab[i] += d;
      }
      store_vec<V>(dx + j * V, out);
      dw.end(j, tw);
      db.end(j, tb);
    });
  };
  for (int64_t row = first; row < last; ++row) do_row(row, x_of(row), dy_of(row));
  // The strip's partials: workspace [strips, cols] for dw, then [strips, cols] for db.
  float* out = static_cast<float*>(p.workspace);
  dw.write(nv, out + blockIdx.x * n);
  db.write(nv, out + (gridDim.x + blockIdx.x) * n);
}

// Sums the strips' partials per column: [strips, cols] -> [cols] (blockIdx.y 1: the bias
// block after). A block takes 32 columns; its 32 warps each sum a share of the strips in
// 128-byte rows, four loads in flight, then one warp adds the 32 sums (5 us for 512
// strips x 4096 columns on an H200).
constexpr int kSumWarps = 32;
template <typename W>
__global__ void __launch_bounds__(32 * kSumWarps)
    column_sum_kernel(const float* partial, int64_t nstrips, int64_t cols, W* dw, W* db) {
  __shared__ float sums[kSumWarps][32];
  W* out = blockIdx.y == 0 ? dw : db;
  if (out == nullptr) return;  // the same for the whole block
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = blockIdx.x * int64_t{32} + lane;
  const float* src = partial + blockIdx.y * nstrips * cols;
  float s = 0.f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t r = warp; r < nstrips; r += kSumWarps) s += src[r * cols + c];
  }
  sums[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || c >= cols) return;
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < kSumWarps; ++i) t += sums[i][lane];
  out[c] = from_float<W>(t);
}

// How a backward runs: the kernel instance, its block, shared memory and strips of rows.
// The workspace size comes from the same plan.
struct BwdPlan {
  void (*kernel)(dtrain_norm_bwd_params, int64_t, float);
  int threads;
  size_t smem;
  int64_t strips, rows_per_strip;
};

template <typename T, int V>
void pick_bwd(const dtrain_norm_bwd_params& p, BwdPlan& plan) {
  const int64_t nv = p.cols / V;
  with_vecs<V>(nv, [&](auto vecs) {
    constexpr int kVecs = decltype(vecs)::value;
    plan.kernel = p.layer_norm ? norm_bwd_kernel<T, true, V, kVecs> : norm_bwd_kernel<T, false, V, kVecs>;
    plan.threads = row_threads((nv + kVecs - 1) / kVecs);
    plan.smem = sizeof(float) * static_cast<size_t>(p.cols) *
                (p.layer_norm ? BwdHeld<true, kVecs>::kSmemRows : BwdHeld<false, kVecs>::kSmemRows);
    return cudaSuccess;
  });
}

template <typename T>
BwdPlan plan_bwd(const dtrain_norm_bwd_params& p) {
  BwdPlan plan{};
  const bool vec = p.cols % vec16<T>() == 0 && rows_aligned<T>(p.x, p.x_stride) &&
                   rows_aligned<T>(p.dy, p.dy_stride) && rows_aligned<T>(p.dx, p.dx_stride) && aligned(p.weight, 16);
  if (vec) {
    pick_bwd<T, vec16<T>()>(p, plan);
  } else {
    pick_bwd<T, 1>(p, plan);
  }
  // One strip per block the GPU holds at once, and at least kMinStripRows rows each.
  const Occupancy o = occupancy(plan.kernel, plan.threads, plan.smem);
  const int64_t want = std::max<int64_t>(
      1, std::min<int64_t>(int64_t{o.per_sm} * o.sms, (p.rows + kMinStripRows - 1) / kMinStripRows));
  plan.rows_per_strip = (p.rows + want - 1) / want;
  plan.strips = (p.rows + plan.rows_per_strip - 1) / plan.rows_per_strip;
  return plan;
}

template <typename T>
cudaError_t bwd(const dtrain_norm_bwd_params& p, cudaStream_t stream) {
  const BwdPlan plan = plan_bwd<T>(p);
  cudaError_t e =
      cudaFuncSetAttribute(plan.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem));
  if (e != cudaSuccess) return e;
  // 1 / cols as an argument (a constant-bank operand): computed in the kernel and held, it
  // spilled in the bf16 LayerNorm instance.
  DTRAIN_LAUNCH(plan.kernel, static_cast<unsigned>(plan.strips), plan.threads, plan.smem, stream, p,
                plan.rows_per_strip, 1.f / static_cast<float>(p.cols));
  if ((e = launched()) != cudaSuccess) return e;
  if (p.dweight == nullptr && p.dbias == nullptr) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((p.cols + 31) / 32), p.layer_norm && p.dbias != nullptr ? 2 : 1);
  return dispatch_dtype(p.weight_dtype, [&](auto w) {
    using W = decltype(w);
    auto* sum = column_sum_kernel<W>;
    DTRAIN_LAUNCH(sum, grid, 32 * kSumWarps, 0, stream, static_cast<const float*>(p.workspace), plan.strips, p.cols,
                  static_cast<W*>(p.dweight), static_cast<W*>(p.dbias));
    return launched();
  });
}

cudaError_t check_bwd(const dtrain_norm_bwd_params* params) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const auto& p = *params;
  if (p.rows < 0 || p.cols <= 0 || p.cols > kMaxCols || p.rows > INT32_MAX) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (!p.dy || !p.x || !p.dx || !p.rstd || (p.layer_norm && !p.mean)) return cudaErrorInvalidValue;
  if ((p.dweight != nullptr || p.dbias != nullptr) && (p.workspace == nullptr || !aligned(p.workspace, 16))) {
    return cudaErrorInvalidValue;
  }
  if (p.dweight != nullptr && p.weight == nullptr) return cudaErrorInvalidValue;
  if (!p.layer_norm && p.dbias != nullptr) return cudaErrorInvalidValue;
  if (!known_dtype(p.weight_dtype)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace
}  // namespace dtrain_kernels

extern "C" size_t dtrain_norm_workspace_bytes(const dtrain_norm_bwd_params* params) {
  using namespace dtrain_kernels;
  if (params == nullptr || params->rows <= 0 || params->cols <= 0 || params->cols > kMaxCols) return 0;
  int64_t strips = 0;
  dispatch_dtype(params->dtype, [&](auto t) {
    strips = plan_bwd<decltype(t)>(*params).strips;
    return cudaSuccess;
  });
  return sizeof(float) * 2 * static_cast<size_t>(strips) * static_cast<size_t>(params->cols);
}

extern "C" cudaError_t dtrain_norm_bwd(const dtrain_norm_bwd_params* params, cudaStream_t stream) {
  using namespace dtrain_kernels;
  if (cudaError_t e = check_bwd(params); e != cudaSuccess || params->rows == 0) return e;
  const auto& p = *params;
  return dispatch_dtype(p.dtype, [&](auto t) { return bwd<decltype(t)>(p, stream); });
}
