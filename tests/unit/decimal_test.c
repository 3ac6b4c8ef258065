/*
 * Unit tests of kernels/decimal.h, the one decimal parser: what it takes (digits, leading zeros, up
 * to max), what it refuses (empty text, signs, spaces, other characters, more than 20 digits) and
 * which error says so, and that it never reads past the length it is given.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "decimal.h"
#include "dsv4-error.h"

/* Parse a whole NUL-terminated string. */
static int parse(const char *s, uint64_t max, uint64_t *out) {
  return dsv4_parse_decimal(s, strlen(s), max, out);
}

/* rc for s when it is refused, checking that *out was left alone. */
static int refused(const char *s, uint64_t max) {
  uint64_t v = 12345;
  int rc = parse(s, max, &v);
  assert_int_not_equal(rc, 0);
  assert_true(v == 12345);
  return rc;
}

static void test_digits(void **state) {
  (void)state;
  uint64_t v = 42;
  assert_int_equal(parse("0", 10, &v), 0);
  assert_true(v == 0);
  assert_int_equal(parse("7", 10, &v), 0);
  assert_true(v == 7);
  assert_int_equal(parse("1234567890", UINT64_MAX, &v), 0);
  assert_true(v == 1234567890u);
}

static void test_leading_zeros(void **state) {
  (void)state;
  uint64_t v = 42;
  assert_int_equal(parse("0010", 10, &v), 0);
  assert_true(v == 10);
  assert_int_equal(parse("000", 0, &v), 0);
  assert_true(v == 0);
  /* 20 digits is the limit whatever they hold; the 21st is refused even in front of a 1. */
  assert_int_equal(parse("00000000000000000001", 1, &v), 0);
  assert_true(v == 1);
  assert_int_equal(refused("000000000000000000001", UINT64_MAX), DSV4_EINVAL);
  assert_int_equal(refused("000000000000000000000", UINT64_MAX), DSV4_EINVAL);
}

static void test_max_value(void **state) {
  (void)state;
  uint64_t v = 0;
  assert_int_equal(parse("18446744073709551615", UINT64_MAX, &v), 0);
  assert_true(v == UINT64_MAX);
  assert_int_equal(parse("4294967295", UINT32_MAX, &v), 0);
  assert_true(v == UINT32_MAX);
  assert_int_equal(parse("65535", 65535, &v), 0);
  assert_true(v == 65535);
  assert_int_equal(parse("9223372036854775807", INT64_MAX, &v), 0);
  assert_true(v == (uint64_t)INT64_MAX);
  assert_int_equal(parse("0", 0, &v), 0);
  assert_true(v == 0);
}

static void test_overflow_by_one(void **state) {
  (void)state;
  assert_int_equal(refused("18446744073709551616", UINT64_MAX), DSV4_ERANGE);
  assert_int_equal(refused("4294967296", UINT32_MAX), DSV4_ERANGE);
  assert_int_equal(refused("65536", 65535), DSV4_ERANGE);
  assert_int_equal(refused("9223372036854775808", INT64_MAX), DSV4_ERANGE);
  assert_int_equal(refused("11", 10), DSV4_ERANGE);
  assert_int_equal(refused("99999999999999999999", UINT64_MAX), DSV4_ERANGE);
  /* A single digit above a max below 9, where max - digit would wrap. */
  assert_int_equal(refused("1", 0), DSV4_ERANGE);
  assert_int_equal(refused("9", 8), DSV4_ERANGE);
  assert_int_equal(refused("07", 5), DSV4_ERANGE);
}

static void test_empty(void **state) {
  (void)state;
  uint64_t v = 12345;
  assert_int_equal(refused("", 10), DSV4_EINVAL);
  assert_int_equal(dsv4_parse_decimal(NULL, 0, 10, &v), DSV4_EINVAL);
  assert_true(v == 12345);
}

static void test_sign(void **state) {
  (void)state;
  assert_int_equal(refused("-1", 10), DSV4_EINVAL);
  assert_int_equal(refused("+1", 10), DSV4_EINVAL);
  assert_int_equal(refused("-0", 10), DSV4_EINVAL);
  assert_int_equal(refused("1-", 10), DSV4_EINVAL);
}

static void test_whitespace(void **state) {
  (void)state;
  assert_int_equal(refused(" 1", 10), DSV4_EINVAL);
  assert_int_equal(refused("1 ", 10), DSV4_EINVAL);
  assert_int_equal(refused("1\n", 10), DSV4_EINVAL);
  assert_int_equal(refused("\t1", 10), DSV4_EINVAL);
  assert_int_equal(refused("1 2", 100), DSV4_EINVAL);
  assert_int_equal(refused(" ", 10), DSV4_EINVAL);
}

static void test_other_text(void **state) {
  (void)state;
  assert_int_equal(refused("0x10", UINT64_MAX), DSV4_EINVAL);
  assert_int_equal(refused("1e3", UINT64_MAX), DSV4_EINVAL);
  assert_int_equal(refused("1.0", UINT64_MAX), DSV4_EINVAL);
  assert_int_equal(refused("1,000", UINT64_MAX), DSV4_EINVAL);
  assert_int_equal(refused("\xd9\xa1", UINT64_MAX), DSV4_EINVAL); /* ARABIC-INDIC DIGIT ONE */
  /* Text that is not a number is EINVAL even where its digits alone would be above max. */
  assert_int_equal(refused("99x", 5), DSV4_EINVAL);
  uint64_t v = 12345;
  assert_int_equal(dsv4_parse_decimal("1\0", 2, 10, &v), DSV4_EINVAL);
  assert_true(v == 12345);
}

/* Only s[0..len) is read: the bytes sit at the end of a heap block, so AddressSanitizer would
 * catch a read of the byte after them, and a digit right after len is not taken. */
static void test_reads_only_len(void **state) {
  (void)state;
  char *s = malloc(3);
  assert_non_null(s);
  memcpy(s, "123", 3);
  uint64_t v = 0;
  assert_int_equal(dsv4_parse_decimal(s, 3, 1000, &v), 0);
  assert_true(v == 123);
  assert_int_equal(dsv4_parse_decimal(s, 2, 1000, &v), 0);
  assert_true(v == 12);
  free(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_digits),         cmocka_unit_test(test_leading_zeros),
      cmocka_unit_test(test_max_value),      cmocka_unit_test(test_overflow_by_one),
      cmocka_unit_test(test_empty),          cmocka_unit_test(test_sign),
      cmocka_unit_test(test_whitespace),     cmocka_unit_test(test_other_text),
      cmocka_unit_test(test_reads_only_len),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
