#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-error.h"
#include "pool.h"

static void test_init_rejects_bad_sizes(void **state) {
  (void)state;
  dsv4_pool_t p;
  assert_int_equal(dsv4_pool_init(&p, 0), DSV4_EINVAL);
  assert_int_equal(dsv4_pool_init(&p, 0x80000000u), DSV4_EINVAL);
}

static void test_exhaustion_and_counts(void **state) {
  (void)state;
  enum { N = 37 };
  dsv4_pool_t p;
  assert_int_equal(dsv4_pool_init(&p, N), 0);
  assert_int_equal(dsv4_pool_free_count(&p), N);
  assert_int_equal(dsv4_pool_free_count_relaxed(&p), N);
  int seen[N] = {0};
  for (uint32_t i = 0; i < N; i++) {
    uint32_t id = UINT32_MAX;
    assert_int_equal(dsv4_pool_alloc(&p, &id), 0);
    assert_true(id < N);
    assert_int_equal(seen[id], 0);
    seen[id] = 1;
    assert_true(dsv4_pool_is_used(&p, id));
    assert_int_equal(dsv4_pool_free_count(&p), N - 1 - i);
    assert_int_equal(dsv4_pool_free_count_relaxed(&p), N - 1 - i);
  }
  uint32_t id = 12345;
  assert_int_equal(dsv4_pool_alloc(&p, &id), DSV4_ENOSPC);
  assert_int_equal(id, 12345);
  assert_int_equal(dsv4_pool_free_count(&p), 0);
  assert_false(dsv4_pool_is_used(&p, N)); /* out of range is never used */

  /* Free a few in an arbitrary order: exactly those come back, each once. */
  uint32_t back[] = {5, 36, 0, 17};
  for (size_t i = 0; i < 4; i++) {
    dsv4_pool_free(&p, back[i]);
    assert_false(dsv4_pool_is_used(&p, back[i]));
  }
  assert_int_equal(dsv4_pool_free_count(&p), 4);
  assert_int_equal(dsv4_pool_free_count_relaxed(&p), 4);
  int again[N] = {0};
  for (size_t i = 0; i < 4; i++) {
    assert_int_equal(dsv4_pool_alloc(&p, &id), 0);
    again[id]++;
  }
  for (size_t i = 0; i < 4; i++)
    assert_int_equal(again[back[i]], 1);
  assert_int_equal(dsv4_pool_alloc(&p, &id), DSV4_ENOSPC);
  dsv4_pool_destroy(&p);
}

static void test_random_churn(void **state) {
  (void)state;
  enum { N = 1000 };
  dsv4_pool_t p;
  assert_int_equal(dsv4_pool_init(&p, N), 0);
  /* The model: which ids the test holds. */
  uint8_t held[N] = {0};
  uint32_t list[N];
  uint32_t n_held = 0;
  uint64_t x = 88172645463325252ull;
  for (int step = 0; step < 200000; step++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if ((x % 3) != 0 || n_held == 0) {
      uint32_t id;
      int rc = dsv4_pool_alloc(&p, &id);
      if (n_held == N) {
        assert_int_equal(rc, DSV4_ENOSPC);
        continue;
      }
      assert_int_equal(rc, 0);
      assert_int_equal(held[id], 0);
      held[id] = 1;
      list[n_held++] = id;
    } else {
      uint32_t k = (uint32_t)((x >> 20) % n_held);
      uint32_t id = list[k];
      list[k] = list[--n_held];
      held[id] = 0;
      dsv4_pool_free(&p, id);
    }
    assert_int_equal(dsv4_pool_free_count(&p), N - n_held);
  }
  for (uint32_t i = 0; i < N; i++)
    assert_int_equal(dsv4_pool_is_used(&p, i), held[i]);
  dsv4_pool_destroy(&p);
}

/* A pinned id freed by its owner stays unavailable until the last unpin, then comes back. */
static void test_pin_defers_free(void **state) {
  (void)state;
  dsv4_pool_t p;
  uint32_t a, b, c;
  assert_int_equal(dsv4_pool_init(&p, 2), 0);
  assert_int_equal(dsv4_pool_alloc(&p, &a), 0);
  assert_int_equal(dsv4_pool_pin(&p, a + 1), DSV4_EINVAL); /* not allocated */
  assert_int_equal(dsv4_pool_pin(&p, 7), DSV4_EINVAL);     /* out of range */
  assert_int_equal(dsv4_pool_pin(&p, a), 0);
  assert_int_equal(dsv4_pool_pin(&p, a), 0);
  dsv4_pool_free(&p, a);
  assert_int_equal(p.n_deferred, 1);
  assert_true(dsv4_pool_is_used(&p, a));
  assert_int_equal(dsv4_pool_free_count(&p), 1);
  assert_int_equal(dsv4_pool_pin(&p, a), DSV4_EINVAL); /* freed: no new pins */
  assert_int_equal(dsv4_pool_alloc(&p, &b), 0);
  assert_int_not_equal(b, a);
  assert_int_equal(dsv4_pool_alloc(&p, &c), DSV4_ENOSPC);
  dsv4_pool_unpin(&p, a);
  assert_int_equal(dsv4_pool_free_count(&p), 0);
  dsv4_pool_unpin(&p, a);
  assert_int_equal(p.n_deferred, 0);
  assert_false(dsv4_pool_is_used(&p, a));
  assert_int_equal(dsv4_pool_free_count(&p), 1);
  assert_int_equal(dsv4_pool_alloc(&p, &c), 0);
  assert_int_equal(c, a);
  /* Unpinning a live id changes nothing about its ownership. */
  assert_int_equal(dsv4_pool_pin(&p, b), 0);
  dsv4_pool_unpin(&p, b);
  assert_true(dsv4_pool_is_used(&p, b));
  assert_int_equal(dsv4_pool_free_count(&p), 0);
  for (int i = 0; i < DSV4_POOL_MAX_PINS; i++)
    assert_int_equal(dsv4_pool_pin(&p, b), 0);
  assert_int_equal(dsv4_pool_pin(&p, b), DSV4_ENOSPC);
  dsv4_pool_destroy(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_init_rejects_bad_sizes),
      cmocka_unit_test(test_exhaustion_and_counts),
      cmocka_unit_test(test_random_churn),
      cmocka_unit_test(test_pin_defers_free),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
