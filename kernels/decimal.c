#include "decimal.h"

#include "dsv4-error.h"

int dsv4_parse_decimal(const char *s, size_t len, uint64_t max, uint64_t *out) {
  if (len == 0 || len > DSV4_DECIMAL_MAX_DIGITS)
    return DSV4_EINVAL;
  for (size_t i = 0; i < len; i++)
    if (s[i] < '0' || s[i] > '9')
      return DSV4_EINVAL;
  /* Text is checked in full first, so that "12x" is not a number whatever max is. */
  uint64_t v = 0;
  for (size_t i = 0; i < len; i++) {
    uint64_t d = (uint64_t)(s[i] - '0');
    /* v * 10 + d > max, written so that nothing wraps (d > max only when max < 9). */
    if (d > max || v > (max - d) / 10)
      return DSV4_ERANGE;
    v = v * 10 + d;
  }
  *out = v;
  return 0;
}
