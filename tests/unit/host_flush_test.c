/*
 * Host memory out of the CPU caches (kernels/host_flush.c): the bytes of every range flushed are
 * unchanged, written just before or not, at any alignment and length (none, one byte, a line's
 * edge, several pages); a read-only mapping is flushed without a fault (a flush reads, never
 * writes); and the build takes the flushing path on x86-64 and the empty one elsewhere (whether a
 * line leaves the caches is seen only in the copies' speed: tests/gpu/host_cache_dma.py).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "host_flush.h"

#define BYTES ((size_t)3 << 20)

static uint8_t pattern(size_t i, unsigned round) {
  return (uint8_t)(i * 131u + round * 17u + (i >> 9));
}

static void test_bytes_unchanged(void **state) {
  (void)state;
  uint8_t *m = malloc(BYTES + 64);
  assert_non_null(m);
  const size_t starts[] = {0, 1, 63, 64, 65, 4095, 4096};
  const size_t lens[] = {0, 1, 62, 63, 64, 65, 4097, BYTES - 4096};
  unsigned round = 0;
  for (size_t s = 0; s < sizeof(starts) / sizeof(starts[0]); s++)
    for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++, round++) {
      for (size_t i = 0; i < BYTES + 64; i++)
        m[i] = pattern(i, round);
      dsv4_host_flush(m + starts[s], lens[l]);
      for (size_t i = 0; i < BYTES + 64; i++)
        if (m[i] != pattern(i, round))
          fail_msg("byte %zu changed by a flush of %zu bytes at %zu", i, lens[l], starts[s]);
    }
  free(m);
}

static void test_read_only(void **state) {
  (void)state;
  const size_t n = (size_t)1 << 20;
  uint8_t *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(m != MAP_FAILED);
  memset(m, 0x5c, n);
  assert_int_equal(mprotect(m, n, PROT_READ), 0);
  dsv4_host_flush(m + 5, n - 10);
  for (size_t i = 0; i < n; i++)
    assert_int_equal(m[i], 0x5c);
  munmap(m, n);
}

static void test_works_here(void **state) {
  (void)state;
#if defined(__x86_64__)
  assert_int_equal(dsv4_host_flush_works(), 1);
#else
  assert_int_equal(dsv4_host_flush_works(), 0);
#endif
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bytes_unchanged),
      cmocka_unit_test(test_read_only),
      cmocka_unit_test(test_works_here),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
