/*
 * libFuzzer driver for the admin plane's query-string and path-number parser (admin_query.c). The
 * first byte picks the keys the route allows; the rest is the query. An accepted query must hold
 * only allowed keys with values the routes rely on (layer numbers in range, lo <= hi, a valid
 * NUL-terminated sequence name); a refused one must say why, with the same answer however short
 * the message buffer; decimals must be digits only and fit.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admin_query.h"
#include "decimal.h"
#include "dsv4-error.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
  do {                                                                                             \
    if (!(c)) {                                                                                    \
      fprintf(stderr, "fuzz_admin_query: %s:%d: %s\n", __FILE__, __LINE__, #c);                    \
      abort();                                                                                     \
    }                                                                                              \
  } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  unsigned allowed = data[0] & (DSV4_AQ_LAYER | DSV4_AQ_LAYERS | DSV4_AQ_SEQ);
  char *q = malloc(size);
  if (!q)
    return 0;
  memcpy(q, data + 1, size - 1);
  q[size - 1] = '\0'; /* the HTTP layer hands a NUL-terminated query; an inner NUL ends it */

  dsv4_admin_query_t a, b;
  char msg[160], small[8];
  int rc = dsv4_admin_query_parse(q, allowed, &a, msg, sizeof(msg));
  int rc2 = dsv4_admin_query_parse(q, allowed, &b, small, sizeof(small));
  CHECK(rc == 0 || rc == DSV4_EINVAL);
  CHECK(rc == rc2);
  if (rc == 0) {
    CHECK((a.have & ~allowed) == 0);
    if (a.have & DSV4_AQ_LAYER)
      CHECK(a.layer <= DSV4_AQ_MAX_LAYER);
    if (a.have & DSV4_AQ_LAYERS)
      CHECK(a.lo <= a.hi && a.hi <= DSV4_AQ_MAX_LAYER);
    if (a.have & DSV4_AQ_SEQ) {
      CHECK(a.seq_len == strlen(a.seq));
      CHECK(dsv4_seq_name_valid(a.seq, a.seq_len));
    } else {
      CHECK(a.seq_len == 0);
    }
    CHECK(memcmp(&a, &b, sizeof(a)) == 0);
  } else {
    CHECK(msg[0] != '\0' && strlen(msg) < sizeof(msg));
    CHECK(strlen(small) < sizeof(small));
    CHECK(strncmp(msg, small, strlen(small)) == 0);
  }

  uint64_t v = UINT64_MAX;
  size_t len = strlen(q);
  if (dsv4_parse_decimal(q, len, DSV4_AQ_MAX_POSITION, &v) == 0) {
    CHECK(len >= 1 && len <= DSV4_DECIMAL_MAX_DIGITS && v <= DSV4_AQ_MAX_POSITION);
    for (size_t i = 0; i < len; i++)
      CHECK(q[i] >= '0' && q[i] <= '9');
    char back[24];
    snprintf(back, sizeof(back), "%llu", (unsigned long long)v);
    size_t z = 0;
    while (z + 1 < len && q[z] == '0')
      z++;
    CHECK(strcmp(back, q + z) == 0);
  }
  free(q);
  return 0;
}
