/*
 * The server's one table from error codes to HTTP answers (server/errors.c): every code of
 * kernels/dsv4-error.h has a row of its own, the rows are the SPEC §6 table, and a value outside
 * the codes is a 500 "internal_error".
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-error.h"
#include "errors.h"

static const int all_codes[] = {
#define CODE(name, val, msg) DSV4_##name,
    DSV4_ERRNO_MAP(CODE)
#undef CODE
};
#define N_CODES (sizeof(all_codes) / sizeof(all_codes[0]))

static void test_every_code_has_a_row(void **state) {
  (void)state;
  for (size_t i = 0; i < N_CODES; i++) {
    dsv4_http_error_t h = dsv4_http_error(all_codes[i]);
    assert_true(h.status >= 400 && h.status <= 599);
    assert_non_null(h.code);
    assert_string_not_equal(h.code, "internal_error");
    assert_string_not_equal(dsv4_strerror(all_codes[i]), "unknown error");
    /* JSON codes are lowercase words joined by '_'. */
    for (const char *c = h.code; *c; c++)
      assert_true((*c >= 'a' && *c <= 'z') || *c == '_');
    /* Each code answers with a JSON code of its own, so a client can tell them apart. */
    for (size_t k = 0; k < i; k++)
      assert_string_not_equal(h.code, dsv4_http_error(all_codes[k]).code);
  }
}

static void expect(int err, int status, const char *code) {
  dsv4_http_error_t h = dsv4_http_error(err);
  assert_int_equal(h.status, status);
  assert_string_equal(h.code, code);
}

static void test_spec_table(void **state) {
  (void)state;
  expect(DSV4_EINVAL, 400, "bad_request");
  expect(DSV4_ERANGE, 400, "value_out_of_range");
  expect(DSV4_EPOSRANGE, 400, "position_out_of_range");
  expect(DSV4_ELAYER, 400, "unknown_layer");
  expect(DSV4_EDUPSEQ, 400, "duplicate_sequence");
  expect(DSV4_EUNAUTH, 401, "unauthorized");
  expect(DSV4_EFORBID, 403, "forbidden");
  expect(DSV4_ENOSEQ, 404, "unknown_sequence");
  expect(DSV4_EPOSITION, 409, "position_mismatch");
  expect(DSV4_EEXIST, 409, "sequence_exists");
  expect(DSV4_EEXPIRED, 410, "sequence_expired");
  expect(DSV4_ETOOBIG, 413, "payload_too_large");
  expect(DSV4_EHDRBIG, 431, "headers_too_large");
  expect(DSV4_ENOSPC, 503, "kv_pool_exhausted");
  expect(DSV4_EQUEUE, 503, "queue_full");
  expect(DSV4_EDRAIN, 503, "draining");
  expect(DSV4_EDEADLINE, 504, "deadline_exceeded");
  expect(DSV4_EBACKEND, 500, "backend_error");
  /* The admin plane's own (README "Admin API"). */
  expect(DSV4_EDUMPBUSY, 429, "dump_in_progress");
  expect(DSV4_ENOTWRITTEN, 404, "position_not_written");
  expect(DSV4_ERELEASED, 410, "position_released");
  expect(DSV4_ENOTEMITTED, 404, "entry_not_emitted");
  /* The data plane's connection limit. */
  expect(DSV4_ECONNLIMIT, 503, "too_many_connections");
  expect(DSV4_ESEQLIMIT, 503, "sequence_limit");
  /* A restore's refusals of a dump (SPEC §6 PUT /admin/v1/sequences/{seq}). */
  expect(DSV4_EDIGEST, 400, "digest_mismatch");
  expect(DSV4_EGEOMETRY, 409, "geometry_mismatch");
}

static void test_outside_the_table(void **state) {
  (void)state;
  const int others[] = {0, 1, -64, -1000, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof(others) / sizeof(others[0]); i++) {
    expect(others[i], 500, "internal_error");
    assert_string_equal(dsv4_strerror(others[i]), "unknown error");
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_code_has_a_row),
      cmocka_unit_test(test_spec_table),
      cmocka_unit_test(test_outside_the_table),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
