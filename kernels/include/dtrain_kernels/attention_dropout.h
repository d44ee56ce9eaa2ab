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

/* The 64 hash bits of keys 2 pair and 2 pair + 1 of (query head bh = b heads + h, query
 * token): SplitMix64's output function (a bijection of 64 bits) of seed plus the
 * coordinates times odd constants; a query token counts the query offset. Bits 32-47 are
 * the even key's draw, 48-63 the odd one's: the forward, whose threads hold pairs of
 * adjacent keys, hashes once per pair. */
static inline DTRAIN_ATTENTION_HD uint64_t dtrain_attention_dropout_hash(uint64_t seed, int64_t bh, int64_t query,
                                                                        int64_t pair) {
  uint64_t z = seed + (uint64_t)bh * 0xD1B54A32D192ED03ull + (uint64_t)query * 0xAEF17502108EF2D9ull +
               (uint64_t)pair * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Whether a key's draw in hash z (dtrain_attention_dropout_hash of its pair) keeps it. */
static inline DTRAIN_ATTENTION_HD int dtrain_attention_dropout_keeps_in(uint64_t z, int64_t key, uint32_t threshold) {
  return ((uint32_t)(z >> (key & 1 ? 48 : 32)) & 0xFFFFu) >= threshold;
}

/* Whether attention dropout keeps the probability of (query head bh, query token, key). */
static inline DTRAIN_ATTENTION_HD int dtrain_attention_dropout_keeps(uint64_t seed, int64_t bh, int64_t query,
                                                                    int64_t key, uint32_t threshold) {
  return dtrain_attention_dropout_keeps_in(dtrain_attention_dropout_hash(seed, bh, query, key >> 1), key, threshold);
}
