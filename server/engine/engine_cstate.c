/*
 * A sequence's compressed state (SPEC §8.7) for dumps and restores: its emitted entries, index
 * records and ring rows read out of, and written into, the buffers of the layers that run the
 * branch, through the backend's upload and download where the memory is not the host's.
 */
#include "engine-internal.h"
#include "engine_restore.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "records.h"

int dsv4__engine_buf_read(dsv4_engine_t *e, const dsv4_devbuf_t *buf, uint64_t off, size_t n,
                          void *dst) {
  if (off > buf->size || n > buf->size - off)
    return DSV4_EINVAL;
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY) {
    memcpy(dst, (const uint8_t *)buf->ptr + off, n);
    return 0;
  }
  return e->be->ops->download(e->be, dst, buf, off, n);
}

int dsv4__engine_buf_write(dsv4_engine_t *e, const dsv4_devbuf_t *buf, uint64_t off,
                           const void *src, size_t n) {
  if (off > buf->size || n > buf->size - off)
    return DSV4_EINVAL;
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY) {
    memcpy((uint8_t *)buf->ptr + off, src, n);
    return 0;
  }
  return e->be->ops->upload(e->be, buf, off, src, n);
}

/* The entry caches as a records.h source: layer is the served index. */
static int c_read(void *arg, uint32_t idx, uint64_t off, size_t n, void *dst) {
  dsv4_engine_t *e = arg;
  return dsv4__engine_buf_read(e, &e->c_cache[idx], off, n, dst);
}

/* Index records [j0, j1) of one layer into out (68 bytes each), block by block. */
static int read_index(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_centries_t *c, int64_t j0,
                      int64_t j1, uint8_t *out) {
  const uint32_t bs = e->p.block_size;
  uint8_t *blk = malloc(DSV4_INDEX_BLOCK_BYTES(bs));
  int rc = blk ? 0 : DSV4_ENOMEM;
  for (int64_t j = j0; j < j1 && !rc;) {
    int64_t k = j / bs - c->first_lb[0];
    if (k < 0 || k >= c->n[0]) {
      rc = DSV4_EINVAL;
      break;
    }
    rc = dsv4__engine_buf_read(e, &e->i_cache[idx],
                               (uint64_t)c->ids[0][k] * DSV4_INDEX_BLOCK_BYTES(bs),
                               DSV4_INDEX_BLOCK_BYTES(bs), blk);
    for (; !rc && j < j1 && j / bs - c->first_lb[0] == k; j++) {
      uint32_t o = (uint32_t)(j % bs);
      uint8_t *rec = out + (size_t)(j - j0) * DSV4_INDEX_RECORD_BYTES;
      memcpy(rec, blk + 64u * o, 64);
      memcpy(rec + 64, blk + 64u * bs + 4u * o, 4);
    }
  }
  free(blk);
  return rc;
}

static int read_layer(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_centries_t *c,
                      dsv4_engine_cstate_t *out) {
  const uint32_t r = out->ratio, k = r == 4 ? 0 : 1;
  size_t t = (size_t)(out->j1 - out->j0);
  uint8_t *rec = malloc(t ? t * DSV4_RECORD_BYTES : 1);
  uint8_t *ix = r == 4 ? malloc(t ? t * DSV4_INDEX_RECORD_BYTES : 1) : NULL;
  float *ring = malloc(DSV4_RING_FLOATS(r) * sizeof(float));
  out->c_records = rec;
  out->i_records = ix;
  out->ring = ring;
  if (!rec || (r == 4 && !ix) || !ring)
    return DSV4_ENOMEM;
  /* The entry table has the shape of an SWA block table: entry j is a record at j / bs. */
  dsv4_seq_info_t info = {
      .first_lb = c->first_lb[k], .blocks = c->ids[k], .n_blocks_held = c->n[k]};
  dsv4_layer_src_t src = {NULL, c_read, e, idx, e->p.block_size, e->stride};
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY)
    src.host = e->c_cache[idx].ptr;
  int rc = t ? dsv4_seq_records_read(&src, &info, out->j0, (uint32_t)t, rec, DSV4_RECORD_BYTES) : 0;
  if (!rc && r == 4)
    rc = read_index(e, idx, c, out->j0, out->j1, ix);
  if (!rc)
    rc = dsv4__engine_buf_read(e, &e->ring[idx],
                               (uint64_t)c->slot * DSV4_RING_FLOATS(r) * sizeof(float),
                               DSV4_RING_FLOATS(r) * sizeof(float), ring);
  return rc;
}

int dsv4_engine_read_cstate(dsv4_engine_t *e, const char *name, uint32_t len, uint32_t idx,
                            dsv4_engine_cstate_t *out) {
  memset(out, 0, sizeof(*out));
  uint32_t r = e->c_ratio && idx < e->p.n_served ? e->c_ratio[idx] : 0;
  if (!r)
    return 0;
  dsv4_seq_centries_t c;
  dsv4_seq_info_t info;
  int rc = dsv4_seqtable_centries(e->st, name, len, &c);
  if (rc)
    return rc;
  rc = dsv4_seqtable_info(e->st, name, len, &info);
  if (!rc) {
    out->ratio = r;
    out->j0 = info.p0 / r;
    out->j1 = info.next[idx] / r;
    if (out->j1 < out->j0)
      out->j1 = out->j0;
    dsv4_seq_info_free(&info);
    rc = read_layer(e, idx, &c, out);
  }
  dsv4_seq_centries_free(&c);
  if (rc)
    dsv4_engine_cstate_free(out);
  return rc;
}

void dsv4_engine_cstate_free(dsv4_engine_cstate_t *c) {
  free((void *)c->c_records);
  free((void *)c->i_records);
  free((void *)c->ring);
  memset(c, 0, sizeof(*c));
}

/* ---- restore ----------------------------------------------------------------------------------
 */

int dsv4__engine_cstate_check(const dsv4_engine_t *e, const dsv4_engine_restore_t *r,
                              dsv4_seq_centries_t *c, char *why, size_t why_len) {
  const uint32_t bs = e->p.block_size;
  memset(c, 0, sizeof(*c));
  for (int k = 0; k < 2; k++)
    c->first_lb[k] = r->p0 / (k == 0 ? 4 : 128) / bs;
  for (uint32_t idx = 0; idx < e->p.n_served; idx++) {
    uint32_t want = e->c_ratio ? e->c_ratio[idx] : 0;
    const dsv4_engine_cstate_t *cs = r->cstate ? &r->cstate[idx] : NULL;
    uint32_t got = cs ? cs->ratio : 0;
    if (got != want) {
      snprintf(
          why, why_len, "layer %u: the dump has %s compressed state, this daemon runs %s there",
          e->p.served_layers[idx], got ? "its" : "no", want ? "the compressed branch" : "none");
      return DSV4_EINVAL;
    }
    if (!want)
      continue;
    int64_t j0 = r->p0 / want, j1 = r->layers[idx].next / want;
    if (j1 < j0)
      j1 = j0;
    if (cs->j0 != j0 || cs->j1 != j1 || !cs->ring || (j1 > j0 && !cs->c_records) ||
        (want == 4 && j1 > j0 && !cs->i_records)) {
      snprintf(why, why_len, "layer %u: the compressed entries are not those of p0 and next",
               e->p.served_layers[idx]);
      return DSV4_EINVAL;
    }
    int k = want == 4 ? 0 : 1;
    uint32_t n = j1 > j0 ? (uint32_t)((j1 - 1) / bs + 1 - c->first_lb[k]) : 0;
    if (n > c->n[k])
      c->n[k] = n;
  }
  return 0;
}

/* One layer's entries, index records and ring into the blocks and the slot of c. */
static int write_layer(dsv4_engine_t *e, uint32_t idx, const dsv4_engine_cstate_t *cs,
                       const dsv4_seq_centries_t *c, uint8_t *stage) {
  const uint32_t bs = e->p.block_size, r = cs->ratio, k = r == 4 ? 0 : 1;
  uint8_t *data = stage, *scales = stage + (size_t)bs * DSV4_TOKEN_DATA_BYTES;
  int rc = 0;
  for (int64_t j = cs->j0; j < cs->j1 && !rc;) {
    uint32_t o = (uint32_t)(j % bs), run = bs - o;
    if ((int64_t)run > cs->j1 - j)
      run = (uint32_t)(cs->j1 - j);
    uint64_t id = (uint64_t)c->ids[k][j / bs - c->first_lb[k]];
    const uint8_t *rec = cs->c_records + (size_t)(j - cs->j0) * DSV4_RECORD_BYTES;
    dsv4_records_scatter(rec, DSV4_RECORD_BYTES, run, data, scales);
    rc = dsv4__engine_buf_write(e, &e->c_cache[idx], id * e->stride + DSV4_TOKEN_DATA_OFFSET(o),
                                data, (size_t)run * DSV4_TOKEN_DATA_BYTES);
    if (!rc)
      rc = dsv4__engine_buf_write(e, &e->c_cache[idx], id * e->stride + DSV4_SCALE_OFFSET(bs, o),
                                  scales, (size_t)run * DSV4_SCALE_BYTES);
    for (uint32_t i = 0; r == 4 && !rc && i < run; i++) {
      const uint8_t *x = cs->i_records + (size_t)(j + i - cs->j0) * DSV4_INDEX_RECORD_BYTES;
      uint64_t base = id * DSV4_INDEX_BLOCK_BYTES(bs);
      rc = dsv4__engine_buf_write(e, &e->i_cache[idx], base + 64u * (o + i), x, 64);
      if (!rc)
        rc = dsv4__engine_buf_write(e, &e->i_cache[idx], base + 64u * bs + 4u * (o + i), x + 64, 4);
    }
    j += run;
  }
  if (!rc)
    rc = dsv4__engine_buf_write(e, &e->ring[idx],
                                (uint64_t)c->slot * DSV4_RING_FLOATS(r) * sizeof(float), cs->ring,
                                DSV4_RING_FLOATS(r) * sizeof(float));
  return rc;
}

int dsv4__engine_cstate_write(dsv4_engine_t *e, const dsv4_engine_restore_t *r,
                              const dsv4_seq_centries_t *c) {
  if (!r->cstate)
    return 0;
  uint8_t *stage = malloc((size_t)e->p.block_size * DSV4_RECORD_BYTES);
  int rc = stage ? 0 : DSV4_ENOMEM;
  for (uint32_t idx = 0; idx < e->p.n_served && !rc; idx++)
    if (r->cstate[idx].ratio)
      rc = write_layer(e, idx, &r->cstate[idx], c, stage);
  free(stage);
  return rc;
}
