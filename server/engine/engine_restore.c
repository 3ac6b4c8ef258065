#include "engine_restore.h"
#include "engine-internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "records.h"

int dsv4_engine_seq_state(dsv4_engine_t *e, const char *name, uint32_t len, dsv4_seq_state_t *out) {
  return dsv4_seqtable_state(e->st, name, len, out);
}

/* Where the restored sequence's blocks go: the logical blocks and the checks that need no table. */
typedef struct {
  int64_t first_lb;
  uint32_t n_blocks;
  int32_t *ids; /* [n_blocks] once taken from the pool */
} span_t;

/* Restore pass 1: the state is consistent, its records reach every window, the block size fits. */
static int plan_span(dsv4_engine_t *e, const dsv4_engine_restore_t *r, span_t *sp,
                     dsv4_engine_restore_result_t *out) {
  const dsv4_seqtable_config_t *cfg = dsv4_seqtable_config(e->st);
  const int64_t bs = e->p.block_size;
  dsv4_seq_state_t st = {r->p0, (dsv4_seq_layer_state_t *)r->layers};
  int64_t low, end = r->p0;
  if (dsv4_seqtable_state_low(cfg, &st, &low) != 0) {
    snprintf(out->why, sizeof(out->why),
             "inconsistent sequence state (p0, next and last segment of each layer)");
    return DSV4_EINVAL;
  }
  for (uint32_t i = 0; i < e->p.n_served; i++)
    end = r->layers[i].next > end ? r->layers[i].next : end;
  /* Attention reads max(p0, p - 127) .. p: every window position must come with the dump. */
  if (r->first < r->p0 || r->first > low) {
    snprintf(out->why, sizeof(out->why),
             "stored records start at %" PRId64 " but the windows reach back to %" PRId64
             " (p0 %" PRId64 ")",
             r->first, low, r->p0);
    return DSV4_EINVAL;
  }
  /* The stored range starts at max(p0, first position of the oldest held block) (SPEC §3.1): a
   * first block that began below the dump's first position would store positions it lacks. */
  if (r->first > r->p0 && r->first % bs != 0) {
    snprintf(out->why, sizeof(out->why),
             "the records start at position %" PRId64 ", which is not a multiple of this "
             "daemon's block_size %" PRId64 ": its first block would hold positions the dump "
             "does not have (restore into a daemon whose block_size divides %" PRId64 ")",
             r->first, bs, r->first);
    return DSV4_EGEOMETRY;
  }
  sp->first_lb = r->first / bs;
  sp->n_blocks = end > r->p0 ? (uint32_t)((end - 1) / bs + 1 - sp->first_lb) : 0;
  return 0;
}

/* Restore pass 2a: room in the compressed pools for c's entry blocks, counting what a replaced
 * sequence gives back (its entry blocks are never pinned). */
static int check_c_room(dsv4_engine_t *e, const char *name, uint32_t len, int replacing,
                        const dsv4_seq_centries_t *c, int *early,
                        dsv4_engine_restore_result_t *out) {
  dsv4_seq_centries_t old = {0};
  if (replacing && dsv4_seqtable_centries(e->st, name, len, &old) == DSV4_ENOMEM)
    return DSV4_ENOMEM;
  int rc = 0;
  for (int k = 0; k < 2 && !rc; k++) {
    uint32_t nfree = c->n[k] ? dsv4_pool_free_count(&e->cpool[k]) : 0;
    if (c->n[k] > (uint64_t)nfree + old.n[k]) {
      out->needed = c->n[k];
      out->free = nfree + old.n[k];
      snprintf(out->pool, sizeof(out->pool), "%s", k == 0 ? "c4" : "c128");
      rc = DSV4_ENOSPC;
    }
    *early |= c->n[k] > nfree;
  }
  dsv4_seq_centries_free(&old);
  return rc;
}

/* Restore pass 2: the name and the room, against the table and the pool. *early is set when the
 * pool has room only once the replaced sequence's blocks are back. */
static int check_room(dsv4_engine_t *e, const char *name, uint32_t len, int replace,
                      const span_t *sp, const dsv4_seq_centries_t *c, int *early,
                      dsv4_engine_restore_result_t *out) {
  const dsv4_seqtable_config_t *cfg = dsv4_seqtable_config(e->st);
  dsv4_seq_info_t info;
  uint32_t reclaim = 0;
  int rc = dsv4_seqtable_info(e->st, name, len, &info);
  int live = rc == 0;
  if (rc == DSV4_ENOMEM)
    return rc;
  rc = check_c_room(e, name, len, live && replace, c, early, out);
  if (rc)
    return rc;
  if (live) {
    /* A pinned block (a dump reads it) returns to the pool only at its unpin. */
    for (uint32_t b = 0; b < info.n_blocks_held; b++)
      reclaim += info.blocks[b] >= 0 && e->pool.pins[info.blocks[b]] == 0;
    dsv4_seq_info_free(&info);
    if (!replace)
      return DSV4_EEXIST;
  }
  if (!live && cfg->max_sequences && dsv4_seqtable_count(e->st) >= cfg->max_sequences) {
    out->sequences_full = 1;
    return DSV4_ENOSPC;
  }
  uint32_t nfree = dsv4_pool_free_count(&e->pool);
  if (sp->n_blocks > (uint64_t)nfree + reclaim) {
    out->needed = sp->n_blocks;
    out->free = nfree + reclaim;
    return DSV4_ENOSPC;
  }
  *early |= sp->n_blocks > nfree;
  out->replaced = live;
  return 0;
}

/* Bytes [off, off + n) of served layer idx's cache from src, whatever memory holds the cache. */
static int cache_write(dsv4_engine_t *e, uint32_t idx, uint64_t off, const void *src, size_t n) {
  const dsv4_devbuf_t *buf = &e->cache[idx];
  if (off > buf->size || n > buf->size - off)
    return DSV4_EINVAL;
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY) {
    memcpy((uint8_t *)buf->ptr + off, src, n);
    return 0;
  }
  return e->be->ops->upload(e->be, buf, off, src, n);
}

/*
 * Restore pass 3: each layer's records into the new blocks, a block's run at a time: its NoPE|RoPE
 * bytes and its scale entries are each one contiguous piece of the block, so a run costs two
 * writes. stage holds one block's run (bs records) on its way to device memory.
 */
static int write_records(dsv4_engine_t *e, const dsv4_engine_restore_t *r, const span_t *sp,
                         uint8_t *stage) {
  const uint32_t bs = e->p.block_size;
  uint8_t *data = stage, *scales = stage + (size_t)bs * DSV4_TOKEN_DATA_BYTES;
  for (uint32_t idx = 0; idx < e->p.n_served; idx++) {
    const int64_t end = r->layers[idx].next;
    for (int64_t pos = r->first; pos < end && r->records[idx];) {
      const uint8_t *rec = r->records[idx] + (size_t)(pos - r->first) * DSV4_RECORD_BYTES;
      uint32_t o = (uint32_t)(pos % bs), run = bs - o;
      if ((int64_t)run > end - pos)
        run = (uint32_t)(end - pos);
      uint64_t base = (uint64_t)sp->ids[pos / bs - sp->first_lb] * e->stride;
      dsv4_records_scatter(rec, DSV4_RECORD_BYTES, run, data, scales);
      int rc = cache_write(e, idx, base + DSV4_TOKEN_DATA_OFFSET(o), data,
                           (size_t)run * DSV4_TOKEN_DATA_BYTES);
      if (!rc)
        rc = cache_write(e, idx, base + DSV4_SCALE_OFFSET(bs, o), scales,
                         (size_t)run * DSV4_SCALE_BYTES);
      if (rc)
        return rc;
      pos += run;
    }
  }
  return 0;
}

static void give_back(dsv4_engine_t *e, span_t *sp, uint32_t n, dsv4_seq_centries_t *c) {
  for (uint32_t i = 0; i < n; i++)
    dsv4_pool_free(&e->pool, (uint32_t)sp->ids[i]);
  for (int k = 0; k < 2; k++)
    for (uint32_t i = 0; c->ids[k] && i < c->n[k]; i++)
      dsv4_pool_free(&e->cpool[k], (uint32_t)c->ids[k][i]);
}

/* Room for c's entry block ids (before anything changes). */
static int c_arrays(dsv4_seq_centries_t *c) {
  for (int k = 0; k < 2; k++)
    if (!(c->ids[k] = malloc((c->n[k] ? c->n[k] : 1) * sizeof(int32_t)))) {
      dsv4_seq_centries_free(c);
      return DSV4_ENOMEM;
    }
  return 0;
}

/* Take every block the restore writes: the SWA blocks, and c's entry blocks from the compressed
 * pools. check_room counted them: a failure here means a corrupt pool. */
static void take_blocks(dsv4_engine_t *e, span_t *sp, dsv4_seq_centries_t *c) {
  uint32_t id;
  for (uint32_t i = 0; i < sp->n_blocks; i++) {
    if (dsv4_pool_alloc(&e->pool, &id) != 0)
      abort();
    sp->ids[i] = (int32_t)id;
  }
  for (int k = 0; k < 2; k++)
    for (uint32_t i = 0; i < c->n[k]; i++) {
      if (dsv4_pool_alloc(&e->cpool[k], &id) != 0)
        abort();
      c->ids[k][i] = (int32_t)id;
    }
}

int dsv4_engine_restore(dsv4_engine_t *e, const char *name, uint32_t len,
                        const dsv4_engine_restore_t *r, int replace, uint64_t now_ns,
                        dsv4_engine_restore_result_t *out) {
  span_t sp = {0, 0, NULL};
  dsv4_seq_centries_t c;
  int early = 0, existed = 0;
  memset(out, 0, sizeof(*out));
  if (!atomic_load(&e->healthy))
    return DSV4_EBACKEND;
  if (!dsv4_seq_name_valid(name, len))
    return DSV4_EINVAL;
  int rc = plan_span(e, r, &sp, out);
  if (!rc)
    rc = dsv4__engine_cstate_check(e, r, &c, out->why, sizeof(out->why));
  if (!rc)
    rc = check_room(e, name, len, replace, &sp, &c, &early, out);
  if (rc)
    return rc;
  uint8_t *stage = malloc((size_t)e->p.block_size * DSV4_RECORD_BYTES);
  sp.ids = malloc((sp.n_blocks ? sp.n_blocks : 1) * sizeof(int32_t));
  if (!stage || !sp.ids || c_arrays(&c)) {
    free(stage);
    free(sp.ids);
    return DSV4_ENOMEM;
  }
  /* check_room found room for a sequence: a slot is free, or the replaced one gives back its,
   * which must then go before its ring is overwritten. */
  int taken = 0;
  if (dsv4_engine_runs_compressed(e) &&
      dsv4_seqtable_c_next_slot(e->st, name, len, &c.slot, &taken) != 0)
    abort();
  early |= taken;
  /* A replace into a pool that has room only with the old blocks back lets them go first. */
  if (early) {
    dsv4_seqtable_delete(e->st, name, len, &existed);
    out->dropped = existed;
  }
  take_blocks(e, &sp, &c);
  rc = write_records(e, r, &sp, stage);
  if (!rc)
    rc = dsv4__engine_cstate_write(e, r, &c);
  if (!rc && !(e->be->ops->caps & DSV4_BE_HOST_MEMORY))
    rc = e->be->ops->sync(e->be);
  if (rc) {
    /* As for a batch (SPEC §4): a device that failed while writing is not used again. */
    if (rc != DSV4_EINVAL)
      atomic_store(&e->healthy, 0);
    give_back(e, &sp, sp.n_blocks, &c);
    rc = DSV4_EBACKEND;
  } else {
    dsv4_plan_error_t perr;
    dsv4_seq_state_t st = {r->p0, (dsv4_seq_layer_state_t *)r->layers};
    rc = dsv4_seqtable_insert_c(e->st, name, len, &st, sp.first_lb, sp.ids, sp.n_blocks,
                                e->c_ratio && dsv4_engine_runs_compressed(e) ? &c : NULL, replace,
                                now_ns, &perr);
    if (rc)
      give_back(e, &sp, sp.n_blocks, &c);
    else
      out->blocks = sp.n_blocks;
  }
  dsv4_seq_centries_free(&c);
  free(stage);
  free(sp.ids);
  return rc;
}
