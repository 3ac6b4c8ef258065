#include "engine_admin.h"
#include "engine-internal.h"

#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#endif

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

/* dsv4_engine_read_records with record i at out + i * out_stride. */
static int read_strided(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info, int64_t pos,
                        uint32_t n, uint8_t *out, size_t out_stride) {
  const uint32_t bs = e->p.block_size;
  uint8_t *data = NULL;
  int rc = 0;
  if (idx >= e->p.n_served)
    return DSV4_EINVAL;
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY) {
    /* Host memory: each record's two pieces straight into place, one copy (a dump is bound by
     * how often its bytes are copied). */
    for (uint32_t i = 0; i < n && !rc; i++) {
      int64_t slot = dsv4_seq_slot(info, bs, pos + i);
      if (slot < 0)
        return DSV4_EINVAL;
      uint64_t base = (uint64_t)(slot / bs) * e->stride;
      uint32_t o = (uint32_t)(slot % bs);
      uint8_t *rec = out + (size_t)i * out_stride;
      rc = dsv4__engine_cache_read(e, idx, base + DSV4_TOKEN_DATA_OFFSET(o), DSV4_TOKEN_DATA_BYTES,
                                   rec);
      if (!rc)
        rc = dsv4__engine_cache_read(e, idx, base + DSV4_SCALE_OFFSET(bs, o), DSV4_SCALE_BYTES,
                                     rec + DSV4_TOKEN_DATA_BYTES);
    }
    return rc;
  }
  /* Device memory: one download of each block's run of NoPE|RoPE bytes and one of its scales. */
  while (n > 0) {
    int64_t slot = dsv4_seq_slot(info, bs, pos);
    if (slot < 0) {
      rc = DSV4_EINVAL;
      break;
    }
    uint64_t block = (uint64_t)(slot / bs);
    uint32_t o = (uint32_t)(slot % bs);
    uint32_t run = bs - o < n ? bs - o : n;
    uint64_t base = block * e->stride;
    uint8_t scales[DSV4_MAX_BLOCK_SIZE * DSV4_SCALE_BYTES];
    if (!data) {
      data = malloc((size_t)bs * DSV4_TOKEN_DATA_BYTES);
      if (!data)
        return DSV4_ENOMEM;
    }
    /* The run's NoPE|RoPE bytes are contiguous in the block, and so are its scale bytes. */
    rc = dsv4__engine_cache_read(e, idx, base + DSV4_TOKEN_DATA_OFFSET(o),
                                 (size_t)run * DSV4_TOKEN_DATA_BYTES, data);
    if (!rc)
      rc = dsv4__engine_cache_read(e, idx, base + DSV4_SCALE_OFFSET(bs, o),
                                   (size_t)run * DSV4_SCALE_BYTES, scales);
    if (rc)
      break;
    for (uint32_t i = 0; i < run; i++) {
      uint8_t *rec = out + (size_t)i * out_stride;
      memcpy(rec, data + (size_t)i * DSV4_TOKEN_DATA_BYTES, DSV4_TOKEN_DATA_BYTES);
      memcpy(rec + DSV4_TOKEN_DATA_BYTES, scales + (size_t)i * DSV4_SCALE_BYTES, DSV4_SCALE_BYTES);
    }
    out += (size_t)run * out_stride;
    pos += run;
    n -= run;
  }
  free(data);
  return rc;
}

int dsv4_engine_read_records(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                             int64_t pos, uint32_t n, uint8_t *out) {
  return read_strided(e, idx, info, pos, n, out, DSV4_RECORD_BYTES);
}

struct dsv4_engine_digest {
  XXH3_state_t state;
};

int dsv4_engine_digest_create(dsv4_engine_digest_t **out) {
  *out = malloc(sizeof(**out));
  if (!*out)
    return DSV4_ENOMEM;
  XXH3_64bits_reset(&(*out)->state);
  return 0;
}

void dsv4_engine_digest_destroy(dsv4_engine_digest_t *d) {
  free(d);
}

void dsv4_engine_digest_reset(dsv4_engine_digest_t *d) {
  XXH3_64bits_reset(&d->state);
}

uint64_t dsv4_engine_digest_value(const dsv4_engine_digest_t *d) {
  return XXH3_64bits_digest(&d->state);
}

static void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

/* Entries hashed at a time: [LE64 position || record] x 16 is 9.25 KiB, copied and hashed in L1. */
#define DIGEST_GROUP 16u
#define ENTRY_BYTES (8u + DSV4_RECORD_BYTES)

int dsv4_engine_digest_records(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                               int64_t pos, uint32_t n, dsv4_engine_digest_t *d) {
  uint8_t group[DIGEST_GROUP * ENTRY_BYTES];
  for (uint32_t g = 0; g < n; g += DIGEST_GROUP) {
    uint32_t k = n - g < DIGEST_GROUP ? n - g : DIGEST_GROUP;
    /* The records land in their entries, so the group is one update of the §3.1 byte string. */
    int rc = read_strided(e, idx, info, pos + g, k, group + 8, ENTRY_BYTES);
    if (rc)
      return rc;
    for (uint32_t j = 0; j < k; j++)
      put_le64(group + (size_t)j * ENTRY_BYTES, (uint64_t)(pos + g + j));
    XXH3_64bits_update(&d->state, group, (size_t)k * ENTRY_BYTES);
  }
  return 0;
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
  int64_t f, t;
  dsv4_engine_digest_t d;
  int rc;
  if (idx >= e->p.n_served)
    return DSV4_EINVAL;
  dsv4_seq_stored_range(info, e->p.block_size, idx, &f, &t);
  if (first)
    *first = f;
  if (end)
    *end = t;
  XXH3_64bits_reset(&d.state);
  rc = dsv4_engine_digest_records(e, idx, info, f, (uint32_t)(t - f), &d);
  if (!rc)
    *digest = dsv4_engine_digest_value(&d);
  return rc;
}

static void put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

int dsv4_engine_pool_digest(dsv4_engine_t *e, uint32_t idx, uint32_t layer, uint64_t *pool,
                            uint64_t *block_digests, uint8_t *used) {
  uint8_t *buf;
  uint64_t acc = 0;
  int rc = 0;
  if (idx >= e->p.n_served)
    return DSV4_EINVAL;
  buf = malloc(8 + e->stride);
  if (!buf)
    return DSV4_ENOMEM;
  /* The block's bytes land after an 8-byte slot for LE32 layer || LE32 block, so the pool term
   * is one hash over the buffer and the block digest one over its tail. */
  for (uint32_t b = 0; b < e->p.kv_blocks && !rc; b++) {
    if (!dsv4_pool_is_used(&e->pool, b))
      continue;
    rc = dsv4__engine_cache_read(e, idx, (uint64_t)b * e->stride, e->stride, buf + 8);
    if (rc)
      break;
    put_le32(buf, layer);
    put_le32(buf + 4, b);
    acc ^= XXH3_64bits(buf, 8 + e->stride);
    if (block_digests)
      block_digests[b] = XXH3_64bits(buf + 8, e->stride);
    if (used)
      used[b] = 1;
  }
  free(buf);
  if (!rc)
    *pool = acc;
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
