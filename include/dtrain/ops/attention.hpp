// The attention op every model calls: [B, H, T, D] queries, [B, Hkv, T, D] keys/values
// (grouped-query attention when Hkv < H). Two backends: LibTorch's
// scaled_dot_product_attention ("sdpa"), and dtrain's flash attention ("flash": the CUDA
// kernel for bfloat16/float16 CUDA tensors with head dims that are multiples of 8 up to
// 256, a reference path computing the same function with ATen ops everywhere else).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::ops {

// Packed documents for attention, and the masks sdpa is given: a document number per token
// (integer [B, T]; a document is a run of equal numbers), with what the backends derive from
// them and from a sliding window (each token's document bounds; sdpa's mask) made on first
// use and shared by every copy, so that the layers of one forward make and keep them once.
// Converts from the numbers; undefined ones, or none (the default), mean no documents, and
// a window's mask alone is shared then. Not thread-safe.
class Documents {
 public:
  Documents();
  Documents(at::Tensor ids);  // NOLINT(google-explicit-constructor): wherever the numbers go
  const at::Tensor& ids() const { return ids_; }
  bool defined() const { return ids_.defined(); }
  // Each token's document [start, end): int32 [B, T] each, contiguous, on the ids' device.
  const std::pair<at::Tensor, at::Tensor>& bounds() const;
  // The keys each of seq_q queries sees among seq_k keys in causal attention with this
  // window (0: none), the queries being tokens [first_query, first_query + seq_q) of the
  // sequence whose first seq_k tokens are the keys, as sdpa's additive mask in `dtype` on
  // `device`: 0 where seen, -inf elsewhere, rows padded to 16 elements; [B, 1, seq_q,
  // seq_k] with documents (both within their T tokens, on the ids' device), else [seq_q,
  // seq_k]. causal = false (no offset): each query sees its whole document, within the
  // window both ways. The last four asked for are kept (a returned reference stays valid until four
  // others were made).
  const at::Tensor& sdpa_mask(std::int64_t window, at::ScalarType dtype, std::int64_t seq_q, std::int64_t seq_k,
                              c10::Device device, std::int64_t first_query = 0, bool causal = true) const;
  // The documents of tokens [first, first + tokens), as a Documents of their own (a
  // document cut by `first` starts there), made once per range and kept with these.
  const Documents& slice(std::int64_t first, std::int64_t tokens) const;

 private:
  struct Derived;
  at::Tensor ids_;
  std::shared_ptr<Derived> derived_;
};

enum class AttentionBackend { kSdpa, kFlash };

// "sdpa" | "flash"; InvalidArgument naming `option`, the value and the allowed ones.
AttentionBackend parse_attention_backend(const std::string& name, const char* option = "--attention");
const char* to_string(AttentionBackend backend);

// dropout_p: dropout on the attention probabilities, drawn from the default generator of
// q's device (flash: as flash_attention's). window, documents,
// query_offset: as flash_attention's (sdpa takes them as documents.sdpa_mask, made once
// for the calls that share `documents`). Grouped-query attention on sdpa: its own (enable_gqa) wherever a
// backend other than math takes the call, else k and v repeated per query head. softcap,
// sinks: flash only (as flash_attention's; sdpa has neither: InvalidArgument).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                     double dropout_p = 0.0, AttentionBackend backend = AttentionBackend::kSdpa,
                     std::int64_t window = 0, const Documents& documents = {}, std::int64_t query_offset = 0,
                     double softcap = 0.0, const at::Tensor& sinks = {});

// Flash attention with autograd: softmax(q k^T scale) v, causal masks top-left aligned as
// in sdpa (query i sees keys j <= i); scale <= 0 means 1 / sqrt(D). query_offset O (causal
// only): the queries are tokens [O, O + T_q) of a sequence whose first T_k tokens are the
// keys, so query i sees keys j <= O + i: a context-parallel rank's chunk of queries against
// the keys gathered up to it, or against a block of keys before it (O = T_k - T_q:
// bottom-right alignment). window W > 0 is a sliding window: query i sees keys
// O + i - W < j <= O + i, or without causal i - W < j < i + W (a local window both ways,
// FlashAttention's window_size (W - 1, W - 1)); a row that sees no key gives 0. documents (packed
// sequences): integer [B, >= max(T_k, O + T_q)], a document number per token of that
// sequence; a document is a run of equal numbers (one that recurs after another starts a
// new one), and a query sees only keys of its own (FlashAttention's varlen attention over
// sequences packed back to back, without unpacking; Megatron's reset attention mask):
// causal, those up to itself; not causal (bidirectional, as an encoder's packed
// sequences), all of them, query i being token i. The forward keeps the row log-sum-exp, the
// backward recomputes the probabilities from it (the kernel tile by tile; the reference
// path in chunks of query rows). InvalidArgument naming the input for mismatched shapes
// and devices, a negative window or offset, an offset without causal, documents of another
// shape, dtype or device, and on CUDA for a dtype other than
// bfloat16/float16 or an unsupported head dim. dropout_p in [0, 1): attention dropout on
// the probabilities that reach v (scaled by 1 / (1 - p)), its mask a hash of a seed drawn
// from the default generator of q's device (CUDA's Philox state, advanced; the CPU's) and
// of each (batch, head, query, key), recomputed by the backward; the kernel and the
// reference path give the same mask for the same seed (dropout_seed: that seed instead of
// a draw, for reproducing a mask). On CUDA either kernel takes it (the mask depends on
// the coordinates alone, so a forward and backward on different kernels agree).
// softcap > 0: logit soft-capping (Gemma 2; FlashAttention's softcap): the softmax takes
// softcap tanh(s scale / softcap) of each score s, before the mask; 0: none. sinks
// (attention sinks: gpt-oss's learned ones, Megatron's --softmax-type learnable; zeros are
// its off-by-one softmax): a floating [H], one finite logit per query head that joins every
// row's softmax with no value (the probabilities of the keys sum to less than 1; a row that
// sees no key gives 0), differentiable; undefined: none. Under
// LibTorch's deterministic algorithms (at::globalContext().deterministicAlgorithms(),
// torch's use_deterministic_algorithms; TrainOptions::deterministic sets them) the kernel's
// backward is its deterministic one: gradients bitwise the same on every run (slower, and
// a float32 workspace of up to SMs / (B Hkv) times dq's); the reference path always is.
at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                           double scale = 0.0, std::int64_t window = 0, const Documents& documents = {},
                           std::int64_t query_offset = 0, double dropout_p = 0.0,
                           std::optional<std::uint64_t> dropout_seed = std::nullopt, double softcap = 0.0,
                           const at::Tensor& sinks = {});

// Flash attention's two passes without autograd, for callers that split the keys into
// blocks and merge the blocks' results themselves (ring attention): the forward's output
// and row log-sum-exp (float32 on the kernel, the compute type on the reference path;
// [B, H, Sq]; +inf for a row that sees no key), and the backward's {dq, dk, dv} given the
// output and log-sum-exp the rows were normalised by (for one block of keys: the merged
// ones of all blocks, which makes its dq a share of the whole and its dk, dv whole). The
// kernel on CUDA (bfloat16/float16), the reference path elsewhere; window, documents,
// query_offset, softcap and the input checks as flash_attention's.
std::pair<at::Tensor, at::Tensor> flash_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, bool causal, double scale = 0.0,
                                                          std::int64_t window = 0, const Documents& documents = {},
                                                          std::int64_t query_offset = 0, double softcap = 0.0);
std::vector<at::Tensor> flash_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout,
                                                 bool causal, double scale = 0.0, std::int64_t window = 0,
                                                 const Documents& documents = {}, std::int64_t query_offset = 0,
                                                 double softcap = 0.0);

// Attention sinks for callers that merge blocks of keys themselves (ring attention, over
// flash_attention_forward/_backward, which take none): fold_sinks gives the merged output
// o [B, H, S, D] and log-sum-exp lse [B, H, S] with each head's sink (sinks [H]) as one
// more logit (a row that saw no key, lse +-inf: output 0, log-sum-exp the sink); the
// backward takes what it returns as its o and lse, and sinks_grad the sinks' gradient
// from them and dout, -sum over batch and rows of exp(sink - lse) rowsum(dout o), float32
// (float64 for a float64 lse) [H]. Neither is differentiable.
std::pair<at::Tensor, at::Tensor> fold_sinks(const at::Tensor& o, const at::Tensor& lse, const at::Tensor& sinks);
at::Tensor sinks_grad(const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout, const at::Tensor& sinks);

// FlashAttention's varlen interface for packed self-attention (flash_attn_varlen_func with
// cu_seqlens_q == cu_seqlens_k, as training on packed sequences calls it): q [total, H, D],
// k and v [total, Hkv, D], the sequences back to back; cu_seqlens (int32 or int64, 1-D, on
// q's device) their boundaries 0 = c_0 <= c_1 <= ... <= c_n = total; each token attends
// within its own sequence (tokens outside [c_0, c_n) form sequences of their own):
// causally, or with causal = false to the whole sequence. Returns [total, H, D]; autograd
// as flash_attention's, which computes it over one batch row of packed documents (the
// kernel's varlen form: no unpacking, no padding), so window, dropout_p and
// softcap and sinks are as there. InvalidArgument naming the input for other shapes or totals,
// and cu_seqlens of another dtype, rank or device.
at::Tensor flash_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, bool causal = true, double scale = 0.0,
                                  std::int64_t window = 0, double dropout_p = 0.0, double softcap = 0.0,
                                  const at::Tensor& sinks = {});

// Whether the CUDA kernel takes this head dim (multiples of 8 from 8 to 256); false in a
// build without CUDA. The reference path takes any.
bool flash_kernel_supports_head_dim(std::int64_t head_dim);
// What flash_kernel_supports_head_dim allows, for error messages.
constexpr const char* kFlashKernelHeadDims = "multiples of 8 from 8 to 256";

}  // namespace dtrain::ops
