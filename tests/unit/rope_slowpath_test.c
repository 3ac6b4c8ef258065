/*
 * White-box tests of the correct-rounding fallbacks in kernels/rope.c. The full built-in tables
 * send only a handful of evaluations past the fast double path and none past long double, so the
 * SHA-256 check alone cannot show that the later stages are right. This file compiles rope.c itself
 * to reach its static helpers and drives each stage directly.
 */
#include "../../kernels/rope.c"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include <cmocka.h>

static uint64_t rng_state = 0xd1b54a32d192ed03u;

static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* The double-double evaluation agrees with x87 long double to its precision, far beyond 2^-60. */
static void test_dd_accuracy(void **state) {
  (void)state;
  long double worst = 0.0L;
  for (int trial = 0; trial < 200000; trial++) {
    /* Positive floats from 2^-20 up to 2^40: angles of any position the daemon might be given. */
    uint32_t u = 0x35800000u + (uint32_t)(rng() % (0x53800000u - 0x35800000u));
    float x = u2f(u);
    dd_t c, s;
    dd_cos_sin(x, &c, &s);
    long double lc, ls;
    sincosl((long double)x, &ls, &lc);
    long double ec = fabsl(((long double)c.hi + (long double)c.lo) - lc) / fabsl(lc);
    long double es = fabsl(((long double)s.hi + (long double)s.lo) - ls) / fabsl(ls);
    if (ec > worst)
      worst = ec;
    if (es > worst)
      worst = es;
  }
  /* long double carries 64 bits; a wrong reduction or series would show up as far more than 2^-60.
   */
  assert_true(worst < 0x1p-60L);
  /* Exact points: cos 0 = 1, sin 0 = 0. */
  dd_t c, s;
  dd_cos_sin(0.0f, &c, &s);
  assert_true(c.hi == 1.0 && c.lo == 0.0);
  assert_true(s.hi == 0.0);
}

/* Rounding a double-double to fp32: hi decides, and lo breaks a tie when hi is exactly a midpoint.
 */
static void test_dd_to_float(void **state) {
  (void)state;
  double one_mid = 1.0 + 0x1p-24; /* midpoint of 1 and 1 + 2^-23 */
  assert_true(dd_to_float((dd_t){one_mid, 0x1p-80}) == 1.0f + 0x1p-23f);
  assert_true(dd_to_float((dd_t){one_mid, -0x1p-80}) == 1.0f);
  assert_true(dd_to_float((dd_t){one_mid, 0.0}) == 1.0f); /* an exact tie goes to even */
  double odd_mid = 1.0 + 3 * 0x1p-24; /* midpoint of 1 + 2^-23 (odd) and 1 + 2^-22 (even) */
  assert_true(dd_to_float((dd_t){odd_mid, -0x1p-80}) == 1.0f + 0x1p-23f);
  assert_true(dd_to_float((dd_t){odd_mid, 0x1p-80}) == 1.0f + 0x1p-22f);
  assert_true(dd_to_float((dd_t){-one_mid, -0x1p-80}) == -(1.0f + 0x1p-23f));
  assert_true(dd_to_float((dd_t){-one_mid, 0x1p-80}) == -1.0f);
  /* Below 1: the midpoint of 1 - 2^-24 and 1. */
  double below = 1.0 - 0x1p-25;
  assert_true(dd_to_float((dd_t){below, 0x1p-90}) == 1.0f);
  assert_true(dd_to_float((dd_t){below, -0x1p-90}) == 1.0f - 0x1p-24f);
}

/* The midpoint detectors fire near midpoints and stay quiet elsewhere. */
static void test_midpoint_detectors(void **state) {
  (void)state;
  double mid = 0.75 + 0x1p-25; /* between 0.75 and its successor float */
  assert_true(near_float_midpoint(mid, 16));
  assert_true(near_float_midpoint(nextafter(mid, 1.0), 16));
  assert_true(near_float_midpoint(-mid, 16));
  assert_false(near_float_midpoint(0.75, 16));
  assert_false(near_float_midpoint(mid + 0x1p-40, 16));
  long double lmid = 0.75L + 0x1p-25L;
  assert_true(near_float_midpoint_l(lmid + 0x1p-70L, (float)(lmid + 0x1p-70L), 64.0L));
  assert_false(near_float_midpoint_l(lmid + 0x1p-50L, (float)(lmid + 0x1p-50L), 64.0L));
  assert_false(near_float_midpoint_l(0.75L, 0.75f, 64.0L));
}

/*
 * Search for angles whose double cosine or sine lies near a float midpoint (about one evaluation in
 * 2^24), and check that the slow path and the double-double agree on each of them.
 */
static void test_slow_path_cases(void **state) {
  (void)state;
  int found = 0;
  for (uint32_t k = 0; k < (1u << 25) && found < 8; k++) {
    uint32_t u = 0x3c000000u + (uint32_t)(rng() % (0x4b000000u - 0x3c000000u));
    float x = u2f(u);
    double s, c;
    sincos((double)x, &s, &c);
    for (int w = 0; w < 2; w++) {
      double d = w ? s : c;
      if (fabs(d) < (double)FLT_MIN || !near_float_midpoint(d, 16))
        continue;
      found++;
      dd_t dc, ds;
      dd_cos_sin(x, &dc, &ds);
      float slow = round_slow(x, w);
      assert_true(slow == dd_to_float(w ? ds : dc));
      assert_true(round_fast(d, x, w) == slow);
    }
  }
  assert_true(found >= 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dd_accuracy),
      cmocka_unit_test(test_dd_to_float),
      cmocka_unit_test(test_midpoint_detectors),
      cmocka_unit_test(test_slow_path_cases),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
