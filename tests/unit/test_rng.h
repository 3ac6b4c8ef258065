#ifndef DSV4_TESTS_UNIT_TEST_RNG_H
#define DSV4_TESTS_UNIT_TEST_RNG_H
/*
 * The unit tests' random inputs: xorshift64 from a fixed seed (TEST_RNG_SEED, defined by the test
 * before it includes this file, so each test keeps its own sequence), so that a failure reproduces.
 */
#include <stdint.h>

#ifndef TEST_RNG_SEED
#define TEST_RNG_SEED 0x9E3779B97F4A7C15ull
#endif

static uint64_t rng_state = TEST_RNG_SEED;

static inline uint64_t rng(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

/* A uniform value in [-1, 1). */
static inline float rnd_unit(void) {
  return (float)((double)(rng() >> 11) * 0x1p-52 - 1.0);
}

#endif /* DSV4_TESTS_UNIT_TEST_RNG_H */
