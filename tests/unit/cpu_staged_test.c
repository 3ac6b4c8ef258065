/*
 * The staged test backend's own promise (tests/support/cpu_staged.h): host memory a launch reads
 * in place (host_alias) must stay as it was until the batch's sync, as on a device, which may read
 * it at any moment until then; a caller that changes it earlier stops the test (abort), so the
 * engine's tests on this backend catch such a caller. Checked in a child process.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpu_staged.h"

/* One producer launch whose inputs all lie in a registered region and are read in place; when
 * change, one of its positions is rewritten before the sync. Returns the sync's answer. */
static int launch_then_sync(int change) {
  dsv4_backend_options_t opt = {.threads = 1};
  dsv4_backend_t *be = NULL;
  char why[256];
  if (dsv4_test_cpu_staged_open(&opt, &be, why, sizeof(why)))
    return -100;
  const size_t size = 1 << 16;
  uint8_t *region = aligned_alloc(4096, size);
  dsv4_devbuf_t slots;
  if (!region || be->ops->host_register(be, region, size) || be->ops->buf_alloc(be, 64, &slots))
    return -101;
  memset(region, 0, size);
  int64_t *pos = (int64_t *)(void *)region, *first_lb = pos + 8;
  int32_t *tok_seg = (int32_t *)(void *)(region + 256), *table = tok_seg + 16;
  uint32_t *bt_off = (uint32_t *)(void *)(region + 512), *bt_len = bt_off + 4;
  for (int t = 0; t < 4; t++)
    pos[t] = t;
  bt_len[0] = 1;
  table[0] = 3;
  uint8_t *dev = be->ops->host_alias(be, region, size);
  if (!dev)
    return -102;
  dsv4_map_args_t a = {
      .n_tokens = 4,
      .n_segments = 1,
      .block_size = 64,
      .n_blocks = 8,
      .positions = (const int64_t *)(void *)(dev + ((uint8_t *)pos - region)),
      .tok_seg = (const int32_t *)(void *)(dev + ((uint8_t *)tok_seg - region)),
      .seg_first_lb = (const int64_t *)(void *)(dev + ((uint8_t *)first_lb - region)),
      .seg_bt_off = (const uint32_t *)(void *)(dev + ((uint8_t *)bt_off - region)),
      .seg_bt_len = (const uint32_t *)(void *)(dev + ((uint8_t *)bt_len - region)),
      .block_table = (const int32_t *)(void *)(dev + ((uint8_t *)table - region)),
      .slots = slots.ptr,
      .bt_entries = 1,
  };
  int rc = be->ops->map_slots(be, &a);
  if (rc)
    return -103;
  if (change)
    pos[2] = 7;
  rc = be->ops->sync(be);
  be->ops->host_unregister(be, region);
  dsv4_backend_close(be);
  free(region);
  return rc;
}

/* The child's end: its exit code, or 1000 + the signal that ended it. */
static int in_child(int change) {
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0)
    _exit(launch_then_sync(change) == 0 ? 0 : 1);
  int st = 0;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  return WIFSIGNALED(st) ? 1000 + WTERMSIG(st) : WEXITSTATUS(st);
}

static void test_reads_in_place_kept(void **state) {
  (void)state;
  assert_int_equal(in_child(0), 0);
}

static void test_reads_in_place_changed_stop(void **state) {
  (void)state;
  assert_int_equal(in_child(1), 1000 + SIGABRT);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reads_in_place_kept),
      cmocka_unit_test(test_reads_in_place_changed_stop),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
