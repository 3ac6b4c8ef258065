/*
 * libFuzzer driver for the dump reader of a restore (server/dump_format.c), the parser behind
 * PUT /admin/v1/sequences/{seq} and the snapshots read at start-up. Beyond "no crash, no leak": a
 * refusal always says why, and an accepted dump's records lie inside the buffer, run from the same
 * first position to each layer's next, and hash to its digests.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "dump_format.h"
#include "records.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The geometry the corpus's dumps were written for: layers 0 and 1, 8 heads from head 0. */
static const uint32_t served[2] = {0, 1};

static void check_accepted(const uint8_t *buf, size_t size, const dsv4_dump_parsed_t *p) {
  dsv4_records_digest_t *d;
  if (dsv4_records_digest_create(&d))
    return;
  for (int i = 0; i < 2; i++) {
    const dsv4_seq_layer_state_t *ls = &p->layers[i];
    int64_t n = p->records[i] ? ls->next - p->first : 0;
    if (n < 0 || p->first < p->p0 || (p->records[i] && ls->last_len == 0))
      abort();
    if (p->records[i] &&
        (p->records[i] < buf || p->records[i] + n * DSV4_RECORD_BYTES > buf + size))
      abort();
    dsv4_records_digest_reset(d);
    for (int64_t k = 0; k < n; k++)
      dsv4_records_digest_add(d, p->first + k, p->records[i] + k * DSV4_RECORD_BYTES);
    if (dsv4_records_digest_value(d) != p->digest[i])
      abort();
  }
  dsv4_records_digest_destroy(d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A private copy, so reads past the end are caught by ASan whatever libFuzzer's buffer is. */
  uint8_t *buf = malloc(size ? size : 1);
  if (!buf)
    return 0;
  memcpy(buf, data, size);
  dsv4_dump_expect_t want = {served, 2, 8, 0, "0123456789abcdef", 1 << 20, NULL};
  dsv4_dump_parsed_t p;
  int rc = dsv4_dump_parse(buf, size, &want, &p);
  if (rc != 0 && p.why[0] == '\0')
    abort(); /* every refusal says why */
  if (rc == DSV4_EGEOMETRY && p.field[0] == '\0')
    abort(); /* and a geometry refusal names the field */
  if (rc == 0)
    check_accepted(buf, size, &p);
  dsv4_dump_parsed_free(&p);
  free(buf);
  return 0;
}
