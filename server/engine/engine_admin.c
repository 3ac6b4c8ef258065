#include "engine_admin.h"
#include "engine-internal.h"

#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"

void dsv4_engine_counts(dsv4_engine_t *e, dsv4_engine_counts_t *out) {
  out->block_size = e->p.block_size;
  out->stride = e->stride;
  out->kv_blocks = e->p.kv_blocks;
  out->blocks_free = dsv4_pool_free_count(&e->pool);
  out->blocks_pinned_released = e->pool.n_deferred;
  out->sequences = dsv4_seqtable_count(e->st);
}

uint32_t dsv4_engine_block_size(const dsv4_engine_t *e) {
  return e->p.block_size;
}

int dsv4_engine_foreach_seq(dsv4_engine_t *e, dsv4_seq_visit_fn fn, void *arg) {
  return dsv4_seqtable_foreach(e->st, fn, arg);
}

static int layer_read(void *arg, uint32_t idx, uint64_t off, size_t n, void *dst) {
  return dsv4__engine_cache_read(arg, idx, off, n, dst);
}

/* Served layer idx's cache as a records.h source, or DSV4_EINVAL when idx is not served. */
static int layer_src(dsv4_engine_t *e, uint32_t idx, dsv4_layer_src_t *src) {
  if (idx >= e->p.n_served)
    return DSV4_EINVAL;
  *src = (dsv4_layer_src_t){NULL, layer_read, e, idx, e->p.block_size, e->stride};
  /* Host memory: each record's two pieces straight into place, one copy (a dump is bound by how
   * often its bytes are copied). Device memory: downloads. */
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY)
    src->host = e->cache[idx].ptr;
  return 0;
}

int dsv4_engine_read_records(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                             int64_t pos, uint32_t n, uint8_t *out) {
  dsv4_layer_src_t src;
  int rc = layer_src(e, idx, &src);
  return rc ? rc : dsv4_seq_records_read(&src, info, pos, n, out, DSV4_RECORD_BYTES);
}

int dsv4_engine_digest_records(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                               int64_t pos, uint32_t n, dsv4_records_digest_t *d) {
  dsv4_layer_src_t src;
  int rc = layer_src(e, idx, &src);
  return rc ? rc : dsv4_records_digest_add_seq(d, &src, info, pos, n);
}

typedef struct {
  dsv4_engine_t *e;
  const dsv4_engine_digest_job_t *jobs;
  int *rc;
} multi_t;

static void digest_items(void *arg, size_t first, size_t last) {
  multi_t *m = arg;
  for (size_t i = first; i < last; i++) {
    const dsv4_engine_digest_job_t *j = &m->jobs[i];
    m->rc[i] = dsv4_engine_digest_records(m->e, j->idx, j->info, j->pos, j->n, j->d);
  }
}

int dsv4_engine_digest_records_multi(dsv4_engine_t *e, const dsv4_engine_digest_job_t *jobs,
                                     uint32_t count) {
  int rcs[64];
  int *rc = count <= 64 ? rcs : malloc(count * sizeof(int));
  multi_t m = {e, jobs, rc};
  int out = 0;
  if (!rc)
    return DSV4_ENOMEM;
  /* The host threads only when reading the cache is a memcpy: a device backend's download is a
   * backend call, which host_parallel's work must not make. */
  if ((e->be->ops->caps & DSV4_BE_HOST_MEMORY) && e->be->ops->host_parallel && count > 1)
    e->be->ops->host_parallel(e->be, digest_items, &m, count);
  else
    digest_items(&m, 0, count);
  for (uint32_t i = 0; i < count && !out; i++)
    out = rc[i];
  if (rc != rcs)
    free(rc);
  return out;
}

int dsv4_engine_seq_digest(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                           uint64_t *digest, int64_t *first, int64_t *end) {
  dsv4_layer_src_t src;
  int rc = layer_src(e, idx, &src);
  return rc ? rc : dsv4_seq_digest(&src, info, idx, digest, first, end);
}

int dsv4_engine_pool_digest(dsv4_engine_t *e, uint32_t idx, uint32_t layer, uint64_t *pool,
                            uint64_t *block_digests, uint8_t *used) {
  dsv4_layer_src_t src;
  int rc = layer_src(e, idx, &src);
  return rc ? rc : dsv4_pool_digest(&e->pool, layer, &src, pool, block_digests, used);
}

/* The entry caches as a records.h source (arg: the engine, idx: the served index). */
static int entry_read(void *arg, uint32_t idx, uint64_t off, size_t n, void *dst) {
  dsv4_engine_t *e = arg;
  return dsv4__engine_buf_read(e, &e->c_cache[idx], off, n, dst);
}

/* Entry j's records out of the entry blocks c holds; j is emitted, so its block is held. */
static int read_entry(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_centries_t *c, int64_t j,
                      dsv4_engine_entry_t *out) {
  const uint32_t bs = e->p.block_size, k = out->ratio == 4 ? 0 : 1;
  int64_t lb = j / bs - c->first_lb[k];
  if (lb < 0 || lb >= c->n[k] || c->ids[k][lb] < 0)
    return DSV4_EINVAL;
  out->block = c->ids[k][lb];
  out->offset = (uint32_t)(j % bs);
  /* The entry table has the shape of an SWA block table (entry j at j / bs), so the record is
   * read the way the token inspector reads a position's. */
  dsv4_seq_info_t table = {
      .first_lb = c->first_lb[k], .blocks = c->ids[k], .n_blocks_held = c->n[k]};
  dsv4_layer_src_t src = {NULL, entry_read, e, idx, bs, e->stride};
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY)
    src.host = e->c_cache[idx].ptr;
  int rc = dsv4_seq_records_read(&src, &table, j, 1, out->record, DSV4_RECORD_BYTES);
  if (rc || out->ratio != 4)
    return rc;
  uint64_t base = (uint64_t)out->block * DSV4_INDEX_BLOCK_BYTES(bs);
  rc = dsv4__engine_buf_read(e, &e->i_cache[idx], base + 64u * out->offset, 64, out->index);
  return rc ? rc
            : dsv4__engine_buf_read(e, &e->i_cache[idx], base + 64u * bs + 4u * out->offset, 4,
                                    out->index + 64);
}

int dsv4_engine_read_entry(dsv4_engine_t *e, const char *name, uint32_t len, uint32_t idx,
                           const dsv4_seq_info_t *info, int64_t j, dsv4_engine_entry_t *out) {
  memset(out, 0, sizeof(*out));
  out->ratio = e->c_ratio && idx < e->p.n_served ? e->c_ratio[idx] : 0;
  if (!out->ratio)
    return DSV4_EINVAL;
  out->j0 = info->p0 / out->ratio;
  out->j1 = info->next[idx] / out->ratio;
  if (out->j1 < out->j0)
    out->j1 = out->j0;
  if (j < out->j0 || j >= out->j1)
    return DSV4_ENOTEMITTED;
  dsv4_seq_centries_t c;
  int rc = dsv4_seqtable_centries(e->st, name, len, &c);
  if (rc)
    return rc;
  rc = read_entry(e, idx, &c, j, out);
  dsv4_seq_centries_free(&c);
  return rc;
}

int dsv4_engine_pin(dsv4_engine_t *e, const dsv4_seq_info_t *info) {
  for (uint32_t i = 0; i < info->n_blocks_held; i++) {
    if (info->blocks[i] < 0)
      continue;
    int rc = dsv4_pool_pin(&e->pool, (uint32_t)info->blocks[i]);
    if (rc) {
      while (i-- > 0)
        if (info->blocks[i] >= 0)
          dsv4_pool_unpin(&e->pool, (uint32_t)info->blocks[i]);
      return rc;
    }
  }
  return 0;
}

void dsv4_engine_unpin(dsv4_engine_t *e, const dsv4_seq_info_t *info) {
  for (uint32_t i = 0; i < info->n_blocks_held; i++)
    if (info->blocks[i] >= 0)
      dsv4_pool_unpin(&e->pool, (uint32_t)info->blocks[i]);
}
