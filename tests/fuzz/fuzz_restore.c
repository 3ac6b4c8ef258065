/*
 * libFuzzer driver for the dump reader of a restore (server/dump_format.c), the parser behind
 * PUT /admin/v1/sequences/{seq} and the snapshots read at start-up. Beyond "no crash, no leak": a
 * refusal always says why, and an accepted dump's records lie inside the buffer, run from the same
 * first position to each layer's next, and hash to its digests.
 *
 * Every input is read twice: by a daemon that runs no compressed branch, and by one whose layer 1
 * runs it at ratio 4 (SPEC §8.9), so that the reader of c_records, c_entries, i_records and the
 * ring sees the inputs that carry them (the seeds tests/fuzz/restore_corpus.py writes). An accepted
 * dump's compressed state must then be exactly that layer's entries, inside the buffer, plausible,
 * finite and hashing to what the digest helpers compute.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "dump_format.h"
#include "records.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The geometry the corpus's dumps were written for: layers 0 and 1, 8 heads from head 0; for the
 * second reading, layer 1 runs the compressed branch at ratio 4 (a ratio-128 ring is 512 KiB, too
 * long an input to fuzz). */
static const uint32_t served[2] = {0, 1};
static const uint32_t ratios[2] = {0, 4};

static int inside(const uint8_t *buf, size_t size, const void *p, size_t n) {
  const uint8_t *b = p;
  return b >= buf && n <= size && (size_t)(b - buf) <= size - n;
}

/* An accepted dump's compressed state: the layers that do not run the branch have none; the one
 * that does has entries floor(p0 / 4) .. floor(next / 4) - 1, inside the buffer, each record one
 * a batch can write, a finite ring, and the digests of records.h equal dsv4_dump_cdigests'. */
static void check_cstate(const uint8_t *buf, size_t size, const dsv4_dump_parsed_t *p,
                         const uint32_t *want) {
  for (int i = 0; i < 2; i++) {
    const dsv4_seq_cstate_t *cs = &p->cstate[i];
    uint32_t r = want ? want[i] : 0;
    if (cs->ratio != r)
      abort();
    if (!r)
      continue;
    int64_t j0 = p->p0 / r, j1 = p->layers[i].next / r;
    j1 = j1 < j0 ? j0 : j1;
    size_t t = (size_t)(j1 - j0);
    if (cs->j0 != j0 || cs->j1 != j1 || !cs->ring ||
        !inside(buf, size, cs->ring, DSV4_RING_FLOATS(r) * sizeof(float)) ||
        (t && (!inside(buf, size, cs->c_records, t * DSV4_RECORD_BYTES) ||
               !inside(buf, size, cs->i_records, t * DSV4_INDEX_RECORD_BYTES))))
      abort();
    for (size_t k = 0; k < DSV4_RING_FLOATS(r); k++) {
      float f;
      memcpy(&f, (const uint8_t *)cs->ring + 4 * k, 4);
      if (!isfinite(f))
        abort();
    }
    dsv4_records_digest_t *c, *x;
    if (dsv4_records_digest_create(&c))
      return;
    if (dsv4_records_digest_create(&x)) {
      dsv4_records_digest_destroy(c);
      return;
    }
    for (size_t k = 0; k < t; k++) {
      const uint8_t *rec = cs->c_records + k * DSV4_RECORD_BYTES;
      if (dsv4_record_implausible(rec))
        abort();
      dsv4_records_digest_add(c, j0 + (int64_t)k, rec);
      dsv4_records_digest_add_index(x, j0 + (int64_t)k,
                                    cs->i_records + k * DSV4_INDEX_RECORD_BYTES);
    }
    uint64_t dc, di, dr;
    dsv4_dump_cdigests(cs, &dc, &di, &dr);
    if (dc != dsv4_records_digest_value(c) || di != dsv4_records_digest_value(x))
      abort();
    dsv4_records_digest_destroy(c);
    dsv4_records_digest_destroy(x);
  }
}

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

/* One reading of buf by a daemon whose layers run the branch at ratio[i] (NULL: none does). */
static void read_as(const uint8_t *buf, size_t size, const uint32_t *ratio) {
  dsv4_dump_expect_t want = {served, 2, 8, 0, "0123456789abcdef", 1 << 20, ratio};
  dsv4_dump_parsed_t p;
  int rc = dsv4_dump_parse(buf, size, &want, &p);
  if (rc != 0 && p.why[0] == '\0')
    abort(); /* every refusal says why */
  if (rc == DSV4_EGEOMETRY && p.field[0] == '\0')
    abort(); /* and a geometry refusal names the field */
  if (rc == 0) {
    check_accepted(buf, size, &p);
    check_cstate(buf, size, &p, ratio);
  }
  dsv4_dump_parsed_free(&p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A private copy, so reads past the end are caught by ASan whatever libFuzzer's buffer is. */
  uint8_t *buf = malloc(size ? size : 1);
  if (!buf)
    return 0;
  memcpy(buf, data, size);
  read_as(buf, size, NULL);
  read_as(buf, size, ratios);
  free(buf);
  return 0;
}
