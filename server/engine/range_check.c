/*
 * The range checks of a forward's tensors (SPEC §6: every input value's magnitude below its
 * limit, which also refuses Inf and NaN), on their bit patterns: a magnitude is the pattern
 * without its sign, and magnitudes order as their patterns do. Each runs beside XXH3 on every
 * byte of q and kv, so it is written to be as fast: blocks of fixed length, whose maximum GCC
 * and clang vectorise at -O2 (a magnitude fits the signed type of its width, so the maximum is
 * one signed vector instruction), and on x86-64 a clone for AVX-512 and one for AVX2 beside the
 * baseline, the widest the CPU has picked once at load (dsv4-clones.h; tests/bench/NOTES.md, "The
 * range check at the CPU's vector width").
 */
#include "engine.h"

#include <string.h>

#include "dsv4-clones.h"
#include "dsv4-numerics.h"

#define VECTOR_CLONES DSV4_CLONES("arch=x86-64-v4", "avx2", "default")

enum { BLOCK = 512 };

VECTOR_CLONES int dsv4_bf16_any_at_least(const uint16_t *x, size_t n, uint16_t limit_bits) {
  unsigned bad = 0;
  size_t i = 0;
  for (; n - i >= BLOCK; i += BLOCK) {
    int16_t m = 0;
    for (size_t k = 0; k < BLOCK; k++) {
      const int16_t v = (int16_t)(x[i + k] & 0x7fffu);
      m = v > m ? v : m;
    }
    bad |= (unsigned)((uint16_t)m >= limit_bits);
  }
  for (; i < n; i++)
    bad |= (unsigned)((x[i] & 0x7fffu) >= limit_bits);
  return bad != 0;
}

VECTOR_CLONES int dsv4_f32_any_at_least(const float *x, size_t n, uint32_t limit_bits) {
  unsigned bad = 0;
  size_t i = 0;
  for (; n - i >= BLOCK; i += BLOCK) {
    int32_t m = 0;
    for (size_t k = 0; k < BLOCK; k++) {
      uint32_t u;
      memcpy(&u, x + i + k, 4);
      const int32_t v = (int32_t)(u & 0x7fffffffu);
      m = v > m ? v : m;
    }
    bad |= (unsigned)((uint32_t)m >= limit_bits);
  }
  for (; i < n; i++) {
    uint32_t u;
    memcpy(&u, x + i, 4);
    bad |= (unsigned)((u & 0x7fffffffu) >= limit_bits);
  }
  return bad != 0;
}

int dsv4_bf16_any_out_of_range(const uint16_t *x, size_t n) {
  return dsv4_bf16_any_at_least(x, n, DSV4_BF16_LIMIT_BITS);
}
