/* JSON-lines logs: the line format, the level filter, the listening line, whole lines from threads.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dsv4-error.h"
#include "log.h"

static char path[64];
static int fd = -1;

static int setup(void **state) {
  (void)state;
  snprintf(path, sizeof(path), "/tmp/dsv4-log-test-%d.log", (int)getpid());
  fd = open(path, O_CREAT | O_TRUNC | O_RDWR | O_APPEND, 0600);
  assert_true(fd >= 0);
  dsv4_log_set_fd(fd);
  dsv4_log_set_level(DSV4_LOG_INFO);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  dsv4_log_set_fd(2);
  close(fd);
  unlink(path);
  return 0;
}

/* Everything written so far, NUL-terminated (free it). */
static char *slurp(size_t *len) {
  off_t n = lseek(fd, 0, SEEK_END);
  char *b = malloc((size_t)n + 1);
  assert_int_equal(pread(fd, b, (size_t)n, 0), n);
  b[n] = 0;
  *len = (size_t)n;
  return b;
}

static void test_line_format(void **state) {
  (void)state;
  dsv4_logp(DSV4_LOG_WARN, "slow batch", "{s:i, s:s, s:s}", "tokens", 12, "msg", "ignored", "seq",
            "a\"b\n");
  size_t n;
  char *t = slurp(&n);
  assert_true(n > 0);
  assert_int_equal(t[n - 1], '\n');
  assert_null(memchr(t, '\n', n - 1)); /* exactly one line */
  /* ts, level, msg lead; the fields follow; a field cannot replace msg. */
  assert_memory_equal(t, "{\"ts\":\"", 7);
  const char *ts = t + 7;
  /* 2025-01-02T03:04:05.678Z */
  assert_true(strlen(ts) > 24);
  for (int i = 0; i < 24; i++) {
    const char *shape = "dddd-dd-ddTdd:dd:dd.dddZ";
    if (shape[i] == 'd')
      assert_true(ts[i] >= '0' && ts[i] <= '9');
    else
      assert_int_equal(ts[i], shape[i]);
  }
  assert_memory_equal(ts + 24, "\",\"level\":\"warn\",\"msg\":\"slow batch\",", 36);
  json_error_t err;
  json_t *doc = json_loadb(t, n, 0, &err);
  assert_non_null(doc);
  assert_int_equal(json_integer_value(json_object_get(doc, "tokens")), 12);
  assert_string_equal(json_string_value(json_object_get(doc, "seq")), "a\"b\n");
  assert_string_equal(json_string_value(json_object_get(doc, "msg")), "slow batch");
  json_decref(doc);
  free(t);
}

/* A field that is not UTF-8 (a path from the command line) keeps the line's other fields; its
 * bytes outside ASCII show as '?' and the line says so. */
static void test_not_utf8_field(void **state) {
  (void)state;
  dsv4_logp(DSV4_LOG_ERROR, "cannot use admin_token_file", "{s:s,s:s,s:I,s:b}", "path",
            "/etc/t\xff\xfe.token", "why", "is empty", "n", (json_int_t)7, "ok", 0);
  size_t n;
  char *t = slurp(&n);
  json_error_t err;
  json_t *doc = json_loadb(t, n, 0, &err);
  assert_non_null(doc);
  assert_string_equal(json_string_value(json_object_get(doc, "msg")),
                      "cannot use admin_token_file");
  assert_string_equal(json_string_value(json_object_get(doc, "path")), "/etc/t??.token");
  assert_string_equal(json_string_value(json_object_get(doc, "why")), "is empty");
  assert_int_equal(json_integer_value(json_object_get(doc, "n")), 7);
  assert_true(json_is_false(json_object_get(doc, "ok")));
  assert_non_null(json_object_get(doc, "log_note"));
  assert_null(json_object_get(doc, "log_error"));
  json_decref(doc);
  free(t);
}

static void test_ts_format(void **state) {
  (void)state;
  char b[40];
  dsv4_log_format_ts(b, sizeof(b), 0);
  assert_string_equal(b, "1970-01-01T00:00:00.000Z");
  /* 2024-02-29T23:59:59.999Z: a leap day, milliseconds truncated, never rounded up. */
  dsv4_log_format_ts(b, sizeof(b), 1709251199999999999LL);
  assert_string_equal(b, "2024-02-29T23:59:59.999Z");
}

static void test_level_filter(void **state) {
  (void)state;
  int lv;
  assert_int_equal(dsv4_log_parse_level("warn", &lv), 0);
  assert_int_equal(lv, DSV4_LOG_WARN);
  assert_int_equal(dsv4_log_parse_level("verbose", &lv), DSV4_EINVAL);
  dsv4_log_set_level(DSV4_LOG_WARN);
  assert_false(dsv4_log_enabled(DSV4_LOG_INFO));
  dsv4_logp(DSV4_LOG_INFO, "dropped", NULL);
  dsv4_log(DSV4_LOG_DEBUG, "dropped", json_pack("{s:i}", "x", 1));
  size_t n;
  char *t = slurp(&n);
  assert_int_equal(n, 0);
  free(t);
  /* The listening line is written whatever the level. */
  dsv4_log_listening("data", "127.0.0.1", 8400);
  t = slurp(&n);
  json_error_t err;
  json_t *doc = json_loadb(t, n, 0, &err);
  assert_non_null(doc);
  assert_string_equal(json_string_value(json_object_get(doc, "msg")), "listening");
  assert_string_equal(json_string_value(json_object_get(doc, "listener")), "data");
  assert_string_equal(json_string_value(json_object_get(doc, "host")), "127.0.0.1");
  assert_int_equal(json_integer_value(json_object_get(doc, "port")), 8400);
  json_decref(doc);
  free(t);
  dsv4_logp(DSV4_LOG_ERROR, "kept", NULL);
  t = slurp(&n);
  assert_non_null(strstr(t, "\"level\":\"error\",\"msg\":\"kept\"}\n"));
  free(t);
}

static void *writer(void *arg) {
  char big[3000];
  memset(big, 'a' + (int)(uintptr_t)arg, sizeof(big) - 1);
  big[sizeof(big) - 1] = 0;
  for (int i = 0; i < 500; i++)
    dsv4_logp(DSV4_LOG_INFO, "line", "{s:i, s:i, s:s}", "t", (int)(uintptr_t)arg, "i", i, "pad",
              big);
  return NULL;
}

static void test_threads_whole_lines(void **state) {
  (void)state;
  pthread_t th[4];
  for (uintptr_t i = 0; i < 4; i++)
    assert_int_equal(pthread_create(&th[i], NULL, writer, (void *)i), 0);
  for (int i = 0; i < 4; i++)
    pthread_join(th[i], NULL);
  size_t n;
  char *t = slurp(&n);
  int count[4] = {0};
  char *save = NULL;
  for (char *line = strtok_r(t, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    json_error_t err;
    json_t *doc = json_loads(line, 0, &err);
    assert_non_null(doc);
    int k = (int)json_integer_value(json_object_get(doc, "t"));
    assert_true(k >= 0 && k < 4);
    assert_int_equal(json_integer_value(json_object_get(doc, "i")), count[k]);
    count[k]++;
    json_decref(doc);
  }
  for (int i = 0; i < 4; i++)
    assert_int_equal(count[i], 500);
  free(t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_line_format, setup, teardown),
      cmocka_unit_test_setup_teardown(test_not_utf8_field, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ts_format, setup, teardown),
      cmocka_unit_test_setup_teardown(test_level_filter, setup, teardown),
      cmocka_unit_test_setup_teardown(test_threads_whole_lines, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
