/*
 * The CUDA backend's host glue without the engine: zero-filled allocations, uploads and downloads
 * through the pinned two-half staging (pieces smaller than, equal to and larger than a half, many
 * small uploads that wrap both halves before one download), copies from and to registered host
 * memory (in place, and ranges that reach past a registered one), the device addresses of
 * registered memory (host_alias), and argument checks. Needs a CUDA device: without one it prints
 * "skipped" and exits 77.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "cpu_staged.h"
#include "dsv4-error.h"

#define MIB ((size_t)1 << 20)
/* One half of the staging buffer in cuda_backend.c. */
#define HALF (16 * MIB)

static uint8_t pattern(uint64_t seed, size_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  return (uint8_t)(x >> 56);
}

static dsv4_backend_t *open_cuda(void) {
  dsv4_backend_t *be = NULL;
  char why[256] = "";
  assert_int_equal(dsv4_backend_open("cuda", NULL, &be, why, sizeof(why)), 0);
  assert_string_equal(be->ops->name, "cuda");
  assert_int_equal(be->ops->caps & DSV4_BE_HOST_MEMORY, 0);
  return be;
}

static void test_zero_fill_and_round_trips(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cuda();
  const size_t size = 40 * MIB + 3;
  dsv4_devbuf_t buf = {0};
  uint8_t *host = malloc(size), *back = malloc(size), *zero = calloc(1, size);
  assert_non_null(host);
  assert_non_null(back);
  assert_non_null(zero);
  assert_int_equal(be->ops->buf_alloc(be, size, &buf), 0);
  assert_int_equal(buf.size, size);
  memset(back, 0xEE, size);
  assert_int_equal(be->ops->download(be, back, &buf, 0, size), 0);
  assert_memory_equal(back, zero, size);

  const size_t lens[] = {1, 255, 256, HALF - 1, HALF, HALF + 1, 2 * HALF + 7, size - 5};
  for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
    size_t n = lens[k], off = 5;
    for (size_t i = 0; i < n; i++)
      host[i] = pattern(k, i);
    assert_int_equal(be->ops->upload(be, &buf, off, host, n), 0);
    memset(back, 0xEE, n);
    assert_int_equal(be->ops->download(be, back, &buf, off, n), 0);
    assert_memory_equal(back, host, n);
  }
  assert_int_equal(be->ops->sync(be), 0);

  /* 40 uploads of 1 MiB queued back to back (both halves fill and are waited for), with the host
   * source overwritten after each call: every piece lands as it was when uploaded. A download of
   * zero bytes among them waits for nothing, so it must not hand the staging back to the uploads
   * while queued copies still read it. */
  for (size_t j = 0; j < 40; j++) {
    for (size_t i = 0; i < MIB; i++)
      host[i] = pattern(100 + j, i);
    assert_int_equal(be->ops->upload(be, &buf, j * MIB, host, MIB), 0);
    if (j == 5 || j == 20)
      assert_int_equal(be->ops->download(be, back, &buf, 0, 0), 0);
  }
  assert_int_equal(be->ops->download(be, back, &buf, 0, 40 * MIB), 0);
  for (size_t j = 0; j < 40; j++)
    for (size_t i = 0; i < MIB; i += 4093)
      assert_int_equal(back[j * MIB + i], pattern(100 + j, i));

  be->ops->buf_free(be, &buf);
  assert_null(buf.ptr);
  free(host);
  free(back);
  free(zero);
  dsv4_backend_close(be);
}

/*
 * Registered host memory (host_register): uploads read it in place and downloads write it in
 * place. Uploads from it queued back to back, each from its own piece, land as written once synced;
 * a download into it has its bytes when it returns; a range that starts inside the registered
 * memory and ends past it takes the staging and is right too; after host_unregister the same
 * memory is copied through the staging.
 */
static void test_registered_memory(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cuda();
  const size_t size = 24 * MIB, page = 4096;
  dsv4_devbuf_t buf = {0};
  uint8_t *reg = aligned_alloc(page, size + page), *back = aligned_alloc(page, size);
  assert_non_null(reg);
  assert_non_null(back);
  assert_int_equal(be->ops->buf_alloc(be, size + page, &buf), 0);
  assert_int_equal(be->ops->host_register(be, reg, size), 0);
  assert_int_equal(be->ops->host_register(be, back, size), 0);
  for (size_t j = 0; j < 24; j++) {
    for (size_t i = 0; i < MIB; i++)
      reg[j * MIB + i] = pattern(200 + j, i);
    assert_int_equal(be->ops->upload(be, &buf, j * MIB, reg + j * MIB, MIB), 0);
  }
  assert_int_equal(be->ops->sync(be), 0);
  memset(back, 0xEE, size);
  assert_int_equal(be->ops->download(be, back, &buf, 0, size), 0);
  assert_memory_equal(back, reg, size);
  /* Inside, then straddling the end of the registered range (the last page is not registered). */
  for (size_t i = 0; i < size + page; i++)
    reg[i] = pattern(300, i);
  assert_int_equal(be->ops->upload(be, &buf, 0, reg + size - MIB, MIB + page), 0);
  memset(back, 0xEE, size);
  assert_int_equal(be->ops->download(be, back + 7, &buf, 0, MIB + page), 0);
  assert_memory_equal(back + 7, reg + size - MIB, MIB + page);
  be->ops->host_unregister(be, reg);
  be->ops->host_unregister(be, back);
  for (size_t i = 0; i < MIB; i++)
    reg[i] = pattern(400, i);
  assert_int_equal(be->ops->upload(be, &buf, 3, reg, MIB), 0);
  memset(reg, 0, MIB); /* the staging copied it: the device keeps the pattern */
  assert_int_equal(be->ops->download(be, back, &buf, 3, MIB), 0);
  for (size_t i = 0; i < MIB; i += 997)
    assert_int_equal(back[i], pattern(400, i));
  assert_int_equal(be->ops->sync(be), 0);
  be->ops->buf_free(be, &buf);
  free(reg);
  free(back);
  dsv4_backend_close(be);
}

/*
 * host_alias: registered memory at 16-byte boundaries has a device address, offsets carried over;
 * 8 bytes off, past the registered range, never registered, or after host_unregister it has none.
 * A copy from the address the device reads (a devbuf over it) gives the host's bytes.
 */
static void test_host_alias(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cuda();
  assert_non_null(be->ops->host_alias);
  const size_t size = 4 * MIB, page = 4096;
  uint8_t *reg = aligned_alloc(page, size + page), *other = aligned_alloc(page, page);
  assert_non_null(reg);
  assert_non_null(other);
  for (size_t i = 0; i < size; i++)
    reg[i] = pattern(500, i);
  assert_null(be->ops->host_alias(be, reg, MIB));
  assert_int_equal(be->ops->host_register(be, reg, size), 0);
  uint8_t *a = be->ops->host_alias(be, reg, size);
  assert_non_null(a);
  assert_ptr_equal(be->ops->host_alias(be, reg + 4096 + 16, MIB), a + 4096 + 16);
  assert_null(be->ops->host_alias(be, reg + 8, MIB));
  assert_null(be->ops->host_alias(be, reg + size - MIB, MIB + 16));
  assert_null(be->ops->host_alias(be, other, 64));
  assert_null(be->ops->host_alias(be, reg, 0));
  /* The device's view of the pages holds the host's bytes. */
  dsv4_devbuf_t view = {a + 64, MIB};
  uint8_t *back = malloc(MIB);
  assert_non_null(back);
  assert_int_equal(be->ops->download(be, back, &view, 0, MIB), 0);
  assert_memory_equal(back, reg + 64, MIB);
  assert_int_equal(be->ops->sync(be), 0);
  be->ops->host_unregister(be, reg);
  assert_null(be->ops->host_alias(be, reg, MIB));
  free(back);
  free(reg);
  free(other);
  dsv4_backend_close(be);
}

/*
 * download_async (the bytes are there at the next sync, into registered memory and into other
 * memory alike) and two overlapped batches through the phases: batch 2's uploads and downloads
 * queued while batch 1 is in flight, each batch's bytes back by its own batch_wait, and phases out
 * of order refused.
 */
static void test_async_and_batch_phases(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cuda();
  assert_true(be->ops->caps & DSV4_BE_OVERLAP);
  assert_non_null(be->ops->download_async);
  const size_t n = 3 * MIB + 17;
  dsv4_devbuf_t buf[2] = {{0}, {0}};
  uint8_t *reg = malloc(4 * n), *heap = malloc(n);
  assert_non_null(reg);
  assert_non_null(heap);
  assert_int_equal(be->ops->host_register(be, reg, 4 * n), 0);
  for (int b = 0; b < 2; b++)
    assert_int_equal(be->ops->buf_alloc(be, n, &buf[b]), 0);
  /* Outside a batch: into registered memory and into the heap, complete by the sync. */
  for (size_t i = 0; i < n; i++)
    reg[i] = pattern(7, i);
  assert_int_equal(be->ops->upload(be, &buf[0], 0, reg, n), 0);
  assert_int_equal(be->ops->download_async(be, reg + n, &buf[0], 0, n), 0);
  assert_int_equal(be->ops->download_async(be, heap, &buf[0], 0, n), 0);
  assert_int_equal(be->ops->sync(be), 0);
  assert_memory_equal(reg + n, reg, n);
  assert_memory_equal(heap, reg, n);
  /* Two batches in flight: sources reg[0, n) and reg[n, 2n), answers into reg[2n, 3n), [3n, 4n). */
  uint64_t t[2] = {0, 0};
  assert_int_equal(be->ops->batch_phase(be, DSV4_BATCH_LAUNCHES, NULL), DSV4_EINVAL);
  for (int b = 0; b < 2; b++) {
    for (size_t i = 0; i < n; i++)
      reg[(size_t)b * n + i] = pattern(20 + (uint64_t)b, i);
    memset(reg + (size_t)(2 + b) * n, 0xEE, n);
    assert_int_equal(be->ops->batch_phase(be, DSV4_BATCH_UPLOADS, NULL), 0);
    assert_int_equal(be->ops->upload(be, &buf[b], 0, reg + (size_t)b * n, n), 0);
    assert_int_equal(be->ops->batch_phase(be, DSV4_BATCH_LAUNCHES, NULL), 0);
    assert_int_equal(be->ops->batch_phase(be, DSV4_BATCH_DOWNLOADS, NULL), 0);
    assert_int_equal(be->ops->download_async(be, reg + (size_t)(2 + b) * n, &buf[b], 0, n), 0);
    assert_int_equal(be->ops->batch_phase(be, DSV4_BATCH_SUBMITTED, &t[b]), 0);
  }
  assert_true(t[1] == t[0] + 1);
  for (int b = 0; b < 2; b++) {
    assert_int_equal(be->ops->batch_wait(be, t[b]), 0);
    assert_memory_equal(reg + (size_t)(2 + b) * n, reg + (size_t)b * n, n);
  }
  assert_int_equal(be->ops->sync(be), 0);
  for (int b = 0; b < 2; b++)
    be->ops->buf_free(be, &buf[b]);
  be->ops->host_unregister(be, reg);
  free(reg);
  free(heap);
  dsv4_backend_close(be);
}

static void test_argument_checks(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cuda();
  dsv4_devbuf_t buf = {0};
  uint8_t b[16] = {0};
  assert_int_equal(be->ops->buf_alloc(be, 16, &buf), 0);
  assert_int_equal(be->ops->upload(be, &buf, 8, b, 9), DSV4_EINVAL);
  assert_int_equal(be->ops->upload(be, &buf, 17, b, 0), DSV4_EINVAL);
  assert_int_equal(be->ops->download(be, b, &buf, 1, 16), DSV4_EINVAL);
  assert_int_equal(be->ops->upload(be, NULL, 0, b, 1), DSV4_EINVAL);
  assert_int_equal(be->ops->upload(be, &buf, 0, NULL, 1), DSV4_EINVAL);
  assert_int_equal(be->ops->upload(be, &buf, 16, b, 0), 0);
  assert_int_equal(be->ops->qkv_insert(be, NULL), DSV4_EINVAL);
  /* A launch of zero tokens needs no pointers (backend.h), as on the CPU backend. */
  dsv4_insert_args_t none = {.n_tokens = 0, .heads = 8};
  assert_int_equal(be->ops->qkv_insert(be, &none), 0);
  assert_int_equal(be->ops->sync(be), 0);
  be->ops->buf_free(be, &buf);
  dsv4_backend_close(be);
}

int main(void) {
  if (dsv4_test_backend_absent("cuda"))
    return 77;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_zero_fill_and_round_trips),
      cmocka_unit_test(test_registered_memory),
      cmocka_unit_test(test_host_alias),
      cmocka_unit_test(test_async_and_batch_phases),
      cmocka_unit_test(test_argument_checks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
