/* Attention dropout's keep mask (dtrain_kernels/attention.h), one definition for the
 * kernels, the ops' reference path (which builds without CUDA too: this header needs
 * only stdint.h) and the tests: a stateless hash of (seed, query head, query, key), so
 * that the backward recomputes the forward's mask anywhere, in any tile order. */
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DTRAIN_ATTENTION_HD __host__ __device__
#else
#define DTRAIN_ATTENTION_HD
#endif

/* Attention dropout's threshold for dropout_p: an element is kept where its 16 hash bits
 * are at least this (drop probability threshold / 2^16, within 2^-16 of p; FlashAttention
 * draws 8 bits an element). */
static inline DTRAIN_ATTENTION_HD uint32_t dtrain_attention_dropout_threshold(float dropout_p) {
  return (uint32_t)((double)dropout_p * 65536.0);
}

/* The 64 hash bits of keys 4 quad .. 4 quad + 3 of (query head bh = b heads + h, query
 * token): SplitMix64's output function (a bijection of 64 bits) of seed plus the
 * coordinates times odd constants; a query token counts the query offset. Bits 16 j ..
 * 16 j + 15 are key 4 quad + j's draw: the kernels' threads hash once per four
 * probabilities, sharing a hash's draws with the lanes that hold its other keys. */
static inline DTRAIN_ATTENTION_HD uint64_t dtrain_attention_dropout_hash(uint64_t seed, int64_t bh, int64_t query,
                                                                        int64_t quad) {
  uint64_t z = seed + (uint64_t)bh * 0xD1B54A32D192ED03ull + (uint64_t)query * 0xAEF17502108EF2D9ull +
               (uint64_t)quad * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Whether draw j (0-3: key 4 quad + j) of hash z keeps its probability. */
static inline DTRAIN_ATTENTION_HD uint32_t dtrain_attention_dropout_keeps_in(uint64_t z, int j, uint32_t threshold) {
  return ((uint32_t)(z >> (16 * j)) & 0xFFFFu) >= threshold ? 1u : 0u;
}

/* Whether attention dropout keeps the probability of (query head bh, query token, key). */
static inline DTRAIN_ATTENTION_HD int dtrain_attention_dropout_keeps(uint64_t seed, int64_t bh, int64_t query,
                                                                    int64_t key, uint32_t threshold) {
  return (int)dtrain_attention_dropout_keeps_in(dtrain_attention_dropout_hash(seed, bh, query, key >> 2),
                                                (int)(key & 3), threshold);
}
