// Context parallelism: the sequence split across the cp ranks, each holding two of its
// 2 x cp equal chunks (rank r: chunks r and 2 cp - 1 - r, so that every rank has the same
// share of causal attention's work), and attention over the whole sequence from there,
// in one of two forms (CpComm): keys and values all-gathered across cp, their gradients
// reduce-scattered back (Llama 3's), or heads exchanged for positions by all-to-all
// (DeepSpeed-Ulysses). Everything else in a transformer is per token. The all-gather form
// uses tp's sequence functions over the cp group (counted in tp::comm_stats()).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "dtrain/comm/communicator.hpp"
#include "dtrain/ops/attention.hpp"
#include "dtrain/parallel/context.hpp"

namespace dtrain::cp {

// Raises InvalidArgument naming `option` when a sequence of seq_len tokens cannot be split
// into 2 x cp equal chunks (seq_len % (2 cp) != 0).
void check_sequence(std::int64_t seq_len, int cp, const std::string& option = "--seq-len");

// The positions in the whole sequence of the seq_len / cp tokens that rank `rank` of `cp`
// holds, in the order it holds them: int64 [seq_len / cp], on `device`.
at::Tensor local_positions(std::int64_t seq_len, int cp, int rank, c10::Device device = c10::kCPU);

// This rank's tokens of a whole sequence laid along `dim` (no communication).
at::Tensor take_local(const at::Tensor& x, std::int64_t dim, int cp, int rank);

// The whole sequence along `dim` from every rank's take_local slice, in sequence order: an
// all-gather across `cp`, whose gradient is summed over the ranks and handed back
// (reduce-scatter). The identity at cp = 1.
at::Tensor gather_sequence(const at::Tensor& x, std::int64_t dim, const CommPtr& cp);

// Causal attention of this rank's queries over the whole sequence: q [B, H, T / cp, D],
// k and v [B, Hkv, T / cp, D] in take_local order; returns [B, H, T / cp, D] in that order.
// window, documents ([B, T], the whole sequence's), softcap (logit soft-capping) and sinks
// (attention sinks [H], this rank's heads'; both flash only) as ops::attention's. At cp = 1:
// ops::attention.
// - kAllGather: keys and values gathered in one all-gather; each of the two local chunks
//   of queries attends to the keys up to its own end (ops::attention with the chunk's
//   query offset), on either backend (sdpa with an explicit mask; flash in its kernel).
// - kAllToAll: one all-to-all gives each rank H / cp query heads (and their key/value
//   heads; repeated per query head when cp does not divide Hkv) over the whole sequence,
//   ordinary causal attention on `backend` runs there, and a second all-to-all returns the
//   output's positions. InvalidArgument when cp does not divide H.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp,
                     CpComm method, ops::AttentionBackend backend, double dropout_p, std::int64_t window,
                     const ops::Documents& documents, double softcap = 0.0, const at::Tensor& sinks = {});

}  // namespace dtrain::cp
