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

/* Attention dropout's threshold for dropout_p: an element is kept where its 32 hash bits
 * are at least this (drop probability threshold / 2^32, within 2^-32 of p). */
static inline DTRAIN_ATTENTION_HD uint32_t dtrain_attention_dropout_threshold(float dropout_p) {
  return (uint32_t)((double)dropout_p * 4294967296.0);
}

/* Whether attention dropout keeps the probability of (query head bh = b heads + h, query
 * token, key) under seed: SplitMix64's output function (a bijection of 64 bits) of seed
 * plus the coordinates times odd constants; a query token counts the query offset. */
static inline DTRAIN_ATTENTION_HD int dtrain_attention_dropout_keeps(uint64_t seed, int64_t bh, int64_t query,
                                                                    int64_t key, uint32_t threshold) {
  uint64_t z = seed + (uint64_t)bh * 0xD1B54A32D192ED03ull + (uint64_t)query * 0xAEF17502108EF2D9ull +
               (uint64_t)key * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (uint32_t)(z >> 32) >= threshold;
}
