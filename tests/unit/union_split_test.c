/*
 * Unit tests of kernels/cuda/attention-split.h, the host's side of fast mode's split attention
 * (SPEC §7): a launch splits only while its CTAs fill less than half the device, never into more
 * CTAs than the device holds at once (one per SM) nor more than DSV4_UNION_MAX_SPLITS splits, the
 * choice depends on the shape alone, a window launch's count is a power of two; the heads a union
 * CTA takes; and the partial states' size.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "attention-split.h"

/* The H200's SMs, the device the figures of tests/bench/NOTES.md come from. */
#define H200_SMS 132

static void test_h200_shapes(void **state) {
  (void)state;
  /* One decode token, 64 heads in 4 CTAs of 16; 16 tokens in 64 CTAs; 64 tokens in 128. */
  assert_int_equal(dsv4__union_splits(4, H200_SMS), 32);
  assert_int_equal(dsv4__union_splits(8, H200_SMS), 16);
  assert_int_equal(dsv4__union_splits(64, H200_SMS), 2);
  assert_int_equal(dsv4__union_splits(128, H200_SMS), 1);
  assert_int_equal(dsv4__union_splits(16, H200_SMS), 8);
  assert_int_equal(dsv4__union_splits(17, H200_SMS), 7);
  assert_int_equal(dsv4__union_splits(44, H200_SMS), 3);
  assert_int_equal(dsv4__union_splits(65, H200_SMS), 2);
  assert_int_equal(dsv4__union_splits(66, H200_SMS), 1);
  assert_int_equal(dsv4__union_splits(1u << 20, H200_SMS), 1);
}

/* Over every device of up to 256 SMs and every launch of up to 600 CTAs: 1 exactly when the CTAs
 * fill half the device; otherwise 2..DSV4_UNION_MAX_SPLITS splits whose CTAs all fit at once. */
static void test_every_shape(void **state) {
  (void)state;
  for (int sms = 1; sms <= 256; sms++)
    for (uint64_t ctas = 1; ctas <= 600; ctas++) {
      const uint32_t k = dsv4__union_splits(ctas, sms);
      if (2 * ctas >= (uint64_t)sms) {
        assert_int_equal(k, 1);
        continue;
      }
      assert_in_range(k, 2, DSV4_UNION_MAX_SPLITS);
      assert_true(ctas * k <= (uint64_t)sms);
      /* As many as fit, up to the cap. */
      assert_true(k == DSV4_UNION_MAX_SPLITS || ctas * (k + 1) > (uint64_t)sms);
    }
}

/* The union CTA's heads (dsv4__union_choose_mt) for V4-Flash's 64 heads on 132 SMs: 16-head CTAs
 * for a few decode tokens, 32 while they fit one wave, 64 on warpgroup MMAs (where the device runs
 * them) from the token whose 32-head CTAs need a second wave; without them, 32 at most. */
/* (ties go to the larger CTA: 67 tokens without warpgroup MMAs take 2 waves of 32-head CTAs, as
 * costly as 3 of 16-head ones) */
static void test_union_heads(void **state) {
  (void)state;
  static const struct {
    uint32_t tokens;
    int wg, mt;
  } cases[] = {
      {1, 1, 1},   {16, 1, 1},  {33, 1, 1},  {34, 1, 2},  {64, 1, 2},  {66, 1, 2},  {67, 1, 4},
      {128, 1, 4}, {132, 1, 4}, {133, 1, 4}, {200, 1, 4}, {256, 1, 4}, {1, 0, 1},   {33, 0, 1},
      {34, 0, 2},  {66, 0, 2},  {67, 0, 2},  {99, 0, 2},  {128, 0, 2}, {256, 0, 2},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    if (dsv4__union_choose_mt(cases[i].tokens, 64, H200_SMS, cases[i].wg) != cases[i].mt)
      fail_msg("%u tokens of 64 heads%s: %d m-tiles, not %d", cases[i].tokens,
               cases[i].wg ? " (warpgroup MMAs)" : "",
               dsv4__union_choose_mt(cases[i].tokens, 64, H200_SMS, cases[i].wg), cases[i].mt);
  /* 32 heads or fewer: never more than 32 a CTA, whatever wg says (the launcher passes 0). */
  for (uint32_t heads = 1; heads <= 32; heads++)
    for (uint32_t n = 1; n <= 600; n += 7)
      assert_true(dsv4__union_choose_mt(n, heads, H200_SMS, 0) <= 2);
  /* A wider CTA is taken only when it costs fewer waves' worth: never more waves than 16-head
   * CTAs times 1.75 (64 heads against 16: 3.5 / 2). */
  for (uint32_t n = 1; n <= 600; n++) {
    const int mt = dsv4__union_choose_mt(n, 64, H200_SMS, 1);
    const uint64_t waves = ((uint64_t)n * (4 / mt) + H200_SMS - 1) / H200_SMS;
    const uint64_t waves16 = ((uint64_t)n * 4 + H200_SMS - 1) / H200_SMS;
    assert_true(mt == 1 || mt == 2 || mt == 4);
    assert_true(waves * (mt == 4 ? 35u : mt == 2 ? 30u : 20u) <= waves16 * 20u);
  }
  assert_int_equal(dsv4__union_choose_mt(5, 0, 0, 1), 1); /* degenerate shapes: one m-tile */
}

/* The window's splits: the union's count rounded down to a power of two, so that each split takes
 * 128 / n candidates, whole tiles of 16. */
static void test_window_splits(void **state) {
  (void)state;
  assert_int_equal(dsv4__window_splits(4, H200_SMS), 8);
  assert_int_equal(dsv4__window_splits(64, H200_SMS), 2);
  assert_int_equal(dsv4__window_splits(44, H200_SMS), 2);
  assert_int_equal(dsv4__window_splits(22, H200_SMS), 4);
  assert_int_equal(dsv4__window_splits(17, H200_SMS), 4);
  assert_int_equal(dsv4__window_splits(66, H200_SMS), 1);
  assert_int_equal(dsv4__window_splits(0, H200_SMS), 1);
  for (int sms = 1; sms <= 256; sms++)
    for (uint64_t ctas = 1; ctas <= 600; ctas++) {
      const uint32_t k = dsv4__window_splits(ctas, sms), u = dsv4__union_splits(ctas, sms);
      assert_true(k == 1 || k == 2 || k == 4 || k == 8);
      const uint32_t cap = u < 8 ? u : 8;
      assert_true(k <= cap && 2 * k > cap);
      assert_int_equal(128 % k, 0);
    }
}

/* The union's spans: whole tiles of 16, every candidate in exactly one split, split 0 never empty,
 * no split past the 32nd candidate of its share. */
static void test_union_spans(void **state) {
  (void)state;
  assert_int_equal(dsv4__union_split_span(640, 1), 640);
  assert_int_equal(dsv4__union_split_span(640, 32), 32);
  assert_int_equal(dsv4__union_split_span(640, 8), 80);
  assert_int_equal(dsv4__union_split_span(1, 8), 16);
  for (uint32_t nsplit = 2; nsplit <= DSV4_UNION_MAX_SPLITS; nsplit++)
    for (uint32_t nc = 1; nc <= 2000; nc++) {
      const uint32_t span = dsv4__union_split_span(nc, nsplit);
      assert_int_equal(span % 16, 0);
      assert_true((uint64_t)span * nsplit >= nc);
      assert_true(span < (nc + nsplit - 1) / nsplit + 16);
    }
}

static void test_degenerate(void **state) {
  (void)state;
  assert_int_equal(dsv4__union_splits(0, H200_SMS), 1);
  assert_int_equal(dsv4__union_splits(4, 0), 1);
  assert_int_equal(dsv4__union_splits(4, -1), 1);
  assert_int_equal(dsv4__union_splits(UINT64_MAX / 2, H200_SMS), 1);
}

static void test_part_floats(void **state) {
  (void)state;
  assert_true(dsv4__union_part_floats(1, 64, 1) == 0);
  assert_true(dsv4__union_part_floats(64, 128, 1) == 0);
  assert_true(dsv4__union_part_floats(1, 64, 8) == 64u * 8u * 514u);
  assert_true(dsv4__union_part_floats(16, 64, 2) == 16u * 64u * 2u * 514u);
  /* 64-bit all the way: past 2^32 floats. */
  assert_true(dsv4__union_part_floats(1u << 20, 128, 8) == (uint64_t)(1u << 20) * 128u * 8u * 514u);
  assert_true(DSV4_UNION_PART_FLOATS == 512 + 2);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_h200_shapes),   cmocka_unit_test(test_every_shape),
      cmocka_unit_test(test_window_splits), cmocka_unit_test(test_union_heads),
      cmocka_unit_test(test_union_spans),   cmocka_unit_test(test_degenerate),
      cmocka_unit_test(test_part_floats),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
