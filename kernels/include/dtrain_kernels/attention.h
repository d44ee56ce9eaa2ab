/* Flash attention (FlashAttention-2's algorithm) for bfloat16 / float16 inputs with
 * float32 accumulation, head dims that are multiples of 8 up to 256 (the backward above
 * 128: mma.sync only), causal or not,
 * grouped-query attention (heads a multiple of kv_heads; query head h reads kv head
 * h / (heads / kv_heads)).
 * q, o: [batch, heads, seq_q, head_dim]; k, v: [batch, kv_heads, seq_k, head_dim], each
 * with its own batch/head/seq strides in elements (unit stride along head_dim; strides
 * multiples of 8 and pointers 16-byte aligned). Causal masking is top-left aligned as in
 * at::scaled_dot_product_attention: query i sees keys j <= i; with a sliding window of W
 * keys (window = W > 0), keys i - W < j <= i (Mistral's sliding window; FlashAttention's
 * window_size (W - 1, 0)), or without causal i - W < j < i + W (a local window both ways,
 * ModernBERT's; window_size (W - 1, W - 1)), and only the key tiles a block can see are
 * visited. A query offset O >= 0 (causal only) places the queries at tokens [O, O + seq_q)
 * of a sequence whose first seq_k tokens are the keys: query i sees keys j <= O + i (the
 * window: O + i - W < j), as a context-parallel rank's chunk of queries sees the keys
 * gathered up to it, or a block of keys that precedes it (ring attention); O = seq_k -
 * seq_q is FlashAttention's bottom-right causal alignment. Packed documents
 * (documents.start non-null): each (batch, token) of that sequence names its document
 * [start, end), and a query sees only keys of its own document (what FlashAttention's
 * varlen interface gives sequences packed back to back, without unpacking them): with
 * causal, those up to itself; without, the whole document, later keys too (query i being
 * token i, as there is no offset then); combined with a window, both apply.
 * Attention dropout (dropout_p > 0, either kernel): P V takes P Z / (1 - dropout_p), Z
 * the keep mask dtrain_attention_dropout_keeps gives each (batch, query head, query
 * token, key) under dropout_seed, which the backward recomputes (FlashAttention's dropout,
 * with a stateless hash for its Philox), so a forward and backward on different kernels
 * agree; the log-sum-exp is the undropped one.
 * Attention sinks (sinks non-null, forward only): one more logit per query head in each
 * row's softmax; the backward needs nothing more than the forward's o and log-sum-exp
 * (the sink has no value, so dS = P (dP - rowsum(dO o)) still holds), and the sinks'
 * gradient, -sum over rows of exp(sink - lse) rowsum(dO o), is the caller's to reduce (the
 * backward leaves rowsum(dO o) at its workspace's end).
 * The forward writes o and the log-sum-exp per query row (float32, [batch, heads, seq_q],
 * contiguous; +inf for a row that sees no key), by mma.sync or, on Hopper, by wgmma
 * (dtrain_attention_kernel). The backward recomputes the attention
 * tile by tile from q, k, v and the log-sum-exp (never an seq_q x seq_k matrix), with
 * a float32 workspace (dtrain_attention_bwd_workspace_bytes) for dq and row statistics;
 * deterministic (its params) makes its results reproducible bit for bit. */
#pragma once

#include "dtrain_kernels/attention_dropout.h"
#include "dtrain_kernels/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int64_t batch, head, seq; /* element strides */
} dtrain_attention_strides;

/* Which kernel runs (forward and backward alike): AUTO (0, what a zeroed params struct
 * asks for) takes WGMMA where it is available, else MMA; MMA is mma.sync (sm_80 and
 * later); WGMMA is Hopper's warpgroup MMA (a compute capability 9.0 device and a library
 * built for sm_90a). */
typedef enum {
  DTRAIN_ATTENTION_KERNEL_AUTO = 0,
  DTRAIN_ATTENTION_KERNEL_MMA = 1,
  DTRAIN_ATTENTION_KERNEL_WGMMA = 2,
} dtrain_attention_kernel;

/* Packed documents: int32 [batch, stride] each, a row per batch numbering the tokens of a
 * sequence whose tokens [0, seq_k) are the keys and [O, O + seq_q) the queries (O the query
 * offset). For token i of batch b, start[b, i] is the first token of its document and
 * end[b, i] one past its last: start[i] <= i < end[i]; a document is a run of tokens (start
 * and end equal along it). Zeroed: one document per sequence. The forward reads start (at
 * the queries' tokens), the backward end (at the keys'); without causal, each reads both. */
typedef struct {
  const int32_t* start;
  const int32_t* end;
  int64_t stride; /* tokens per row: 0 means seq_k; the rows must hold max(seq_k, O + seq_q) */
} dtrain_attention_documents;

typedef struct {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  void* workspace; /* dtrain_attention_fwd_workspace_bytes(params) bytes, 4-byte aligned: the
                      Hopper kernel's count of query blocks handed out (the call zeroes it,
                      on the stream) */
  dtrain_attention_strides q_stride, k_stride, v_stride, o_stride;
  int64_t batch, heads, kv_heads, seq_q, seq_k, head_dim;
  float scale; /* softmax scale, usually 1 / sqrt(head_dim) */
  int causal;
  dtrain_kernel_dtype dtype; /* BF16 or F16 */
  dtrain_attention_kernel kernel;
  int64_t window; /* 0: none; W > 0: query i sees keys O + i - W < j <= O + i (causal), i - W < j < i + W (not) */
  dtrain_attention_documents documents;
  int64_t query_offset; /* O: 0, or with causal the queries' first token in the keys' sequence */
  float dropout_p;       /* 0: none; in (0, 1): attention dropout */
  uint64_t dropout_seed; /* the keep mask's key (dtrain_attention_dropout_keeps) */
  float softcap; /* 0: none; c > 0: the softmax takes c tanh(s scale / c) for each score s
                    (Gemma 2's logit soft-capping; FlashAttention's softcap) */
  const float* sinks; /* null: none; else float32 [heads]: query head h's softmax has one more
                         logit, sinks[h], that no value goes with (an attention sink: gpt-oss's
                         learned sinks, Transformer Engine's softmax_offset; all zeros is the
                         off-by-one softmax). o and the log-sum-exp are over the keys and the
                         sink, so a row that sees no key gives o 0 and the log-sum-exp sinks[h]. */
} dtrain_attention_fwd_params;

typedef struct {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse;
  void* dq;
  void* dk;
  void* dv;
  void* workspace; /* dtrain_attention_bwd_workspace_bytes(params) bytes; on return its last
                      batch heads seq_q floats hold delta = rowsum(dout o), float32 [batch,
                      heads, seq_q] (what the attention sinks' gradient takes) */
  dtrain_attention_strides q_stride, k_stride, v_stride, o_stride, dout_stride, dq_stride, dk_stride, dv_stride;
  int64_t batch, heads, kv_heads, seq_q, seq_k, head_dim;
  float scale;
  int causal;
  dtrain_kernel_dtype dtype;
  dtrain_attention_kernel kernel;
  int64_t window; /* as the forward's */
  dtrain_attention_documents documents; /* as the forward's */
  int64_t query_offset;                 /* as the forward's */
  float dropout_p;                      /* as the forward's: the same p and seed give the same mask */
  uint64_t dropout_seed;
  float softcap; /* as the forward's */
  int deterministic; /* 0: dq summed over key blocks by atomics or bulk reductions, in whatever
                        order the blocks finish; nonzero: dq, dk and dv bitwise the same on
                        every run of the same inputs on the same GPU model (either kernel). The
                        key blocks then add dq into private float32 slices summed in a fixed
                        order (FlashAttention-2's deterministic backward): a workspace of up to
                        ceil(SMs / (batch kv_heads)) times dq's float32 size (at most 2 GiB of
                        them unless one is more), and the grid in launches of that many key
                        blocks per (batch, kv head) */
} dtrain_attention_bwd_params;


cudaError_t dtrain_attention_fwd(const dtrain_attention_fwd_params* params, cudaStream_t stream);
cudaError_t dtrain_attention_bwd(const dtrain_attention_bwd_params* params, cudaStream_t stream);
size_t dtrain_attention_fwd_workspace_bytes(const dtrain_attention_fwd_params* params);
size_t dtrain_attention_bwd_workspace_bytes(const dtrain_attention_bwd_params* params);
/* Whether the kernels take this head dim (multiples of 8 from 8 to 256). */
int dtrain_attention_supports_head_dim(int64_t head_dim);
/* Whether a forward / backward launch asking for this kernel takes this head dim: today
 * every kernel takes every head dim above in both passes (WGMMA's forward and backward up
 * to 256); a pass whose WGMMA stops short of one refuses it, and AUTO runs MMA there. */
int dtrain_attention_fwd_kernel_takes_head_dim(dtrain_attention_kernel kernel, int64_t head_dim);
int dtrain_attention_bwd_kernel_takes_head_dim(dtrain_attention_kernel kernel, int64_t head_dim);
/* Whether dtrain_attention_fwd / _bwd can run this kernel on the current device (the
 * emulated build: every kernel). Asking for one that cannot run is cudaErrorInvalidValue. */
int dtrain_attention_kernel_available(dtrain_attention_kernel kernel);
/* Shared memory per block, in bytes: what a block of the forward / backward kernel that a
 * launch asking for `kernel` at this head dim runs on the current device takes (0: none
 * runs), and the most the current device gives a block
 * (cudaDevAttrMaxSharedMemoryPerBlockOptin; 0 without a device). A launch whose kernel
 * needs more than that is cudaErrorInvalidValue, before anything runs. mma.sync's head
 * dim 256 (129-256) runs in smaller tiles where its default ones do not fit (99 KB a block:
 * compute capability 8.6, 8.9, 12.x), so every head dim runs on every sm_80 and later GPU.
 * AUTO runs mma.sync where wgmma's tiles would not fit (only under a cap, below). */
size_t dtrain_attention_fwd_smem_bytes(dtrain_attention_kernel kernel, int64_t head_dim);
size_t dtrain_attention_bwd_smem_bytes(dtrain_attention_kernel kernel, int64_t head_dim);
size_t dtrain_attention_device_smem_bytes(void);
/* Caps what the launchers take the device to give a block at `bytes` (0, the default: no
 * cap), process-wide; dtrain_attention_device_smem_bytes reports the capped number. For
 * tests and benchmarks: a GPU that gives more then runs, and so tests and times, the tiles
 * of GPUs that give less (D 256's compact tiles under 101376 bytes, 99 KB). */
void dtrain_attention_set_smem_cap(size_t bytes);

#ifdef __cplusplus
}
#endif
