#ifndef DSV4_TESTS_UNIT_INV_COMMON_H
#define DSV4_TESTS_UNIT_INV_COMMON_H

/*
 * Shared pieces of the ordering-invariant tests (SPEC §5, tests/unit/inv_*.c): random inputs, RoPE
 * tables and the failure report. A violation prints one line starting "invariant violated: SPEC
 * 5.<n>"; the wrappers that run the deliberately broken builds (inv_expect_fail.cmake) look for
 * exactly that line, so a crash for any other reason never counts as the test catching the bug.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-layout.h"
#include "rope.h"

/* Prints one violation of SPEC §5.<n> to stderr. */
#define INV_REPORT(n, ...)                                                                         \
  do {                                                                                             \
    fprintf(stderr, "invariant violated: SPEC 5." #n ": " __VA_ARGS__);                            \
    fputc('\n', stderr);                                                                           \
  } while (0)

/* xorshift64*: deterministic, so a failure reproduces. */
static uint64_t inv_rng = 0x9E3779B97F4A7C15ull;

static inline uint64_t inv_rnd(void) {
  uint64_t x = inv_rng;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  inv_rng = x;
  return x * 0x2545F4914F6CDD1Dull;
}

static inline uint32_t inv_below(uint32_t n) {
  return (uint32_t)(inv_rnd() % n);
}

/*
 * bf16 values whose magnitudes spread over many octaves around a random centre, with zeros mixed
 * in, so that the rounding of every reduction matters. Magnitudes stay far below overflow.
 */
static inline void inv_fill_bf16(uint16_t *v, size_t n) {
  int centre = 127 + (int)inv_below(40) - 20;
  int spread = 1 + (int)inv_below(12);
  for (size_t i = 0; i < n; i++) {
    uint16_t sign = (uint16_t)(inv_rnd() & 1 ? 0x8000u : 0u);
    if (inv_below(32) == 0) {
      v[i] = sign;
      continue;
    }
    int e = centre + (int)inv_below((uint32_t)(2 * spread + 1)) - spread;
    v[i] = (uint16_t)(sign | ((uint32_t)e << 7) | inv_below(128));
  }
}

/* A kv_norm weight near 1 (fp32). */
static inline void inv_fill_weight(float *w) {
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    w[d] = 0.5f + (float)inv_below(1 << 20) * 0x1p-20f;
}

/* The plain (θ = 10000) table, rows materialised on demand. */
static inline dsv4_rope_table_t *inv_rope_plain(void) {
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *t = NULL;
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &t) != 0)
    return NULL;
  return t;
}

/*
 * Names the cache bytes i..last (offsets into a layer's cache of block size bs) for a report:
 * "cache block B offset O record bytes a..z [NoPE|RoPE|NoPE+RoPE]", "... scale bytes ..." or
 * "... padding bytes ...". The SPEC §5.1 tests of every backend word their reports this way.
 */
static inline void inv_describe_cache(char *where, size_t len, size_t i, size_t last, uint32_t bs) {
  size_t stride = DSV4_BLOCK_STRIDE(bs);
  size_t blk = i / stride, in = i % stride, in_last = last % stride;
  if (in < (size_t)DSV4_TOKEN_DATA_BYTES * bs) {
    size_t a = in % DSV4_TOKEN_DATA_BYTES, z = in_last % DSV4_TOKEN_DATA_BYTES;
    snprintf(where, len, "cache block %zu offset %zu record bytes %zu..%zu [%s]", blk,
             in / DSV4_TOKEN_DATA_BYTES, a, z,
             z < DSV4_NOPE_DIM    ? "NoPE"
             : a >= DSV4_NOPE_DIM ? "RoPE"
                                  : "NoPE+RoPE");
  } else if (in < (size_t)DSV4_RECORD_BYTES * bs)
    snprintf(where, len, "cache block %zu offset %zu scale bytes %zu..%zu", blk,
             (in - DSV4_TOKEN_DATA_BYTES * bs) / DSV4_SCALE_BYTES,
             (in - DSV4_TOKEN_DATA_BYTES * bs) % DSV4_SCALE_BYTES,
             (in_last - DSV4_TOKEN_DATA_BYTES * bs) % DSV4_SCALE_BYTES);
  else
    snprintf(where, len, "cache block %zu padding bytes %zu..%zu", blk, in, in_last);
}

/* Allocation that a test cannot continue without. */
static inline void *inv_alloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", n);
    abort();
  }
  return p;
}

#endif /* DSV4_TESTS_UNIT_INV_COMMON_H */
