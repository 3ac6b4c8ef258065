/*
 * The sequence table's part of the compressed branch (SPEC §8.7): one compressor state slot per
 * live sequence, and per compressed pool the sequence's entry blocks, allocated all or nothing with
 * the batch's SWA blocks and freed only when the sequence leaves (DELETE, expiry, a failed batch).
 *
 * A layer of ratio r emits entry j at position r * j + r - 1, so the tokens start..start+len-1
 * emit the entries floor(start / r) .. floor((start + len) / r) - 1. Every layer of a pool shares
 * the pool's block ids: entry j lives in logical block j / bs at every layer, and the first layer
 * of the pool to reach a block allocates it.
 */
#include "seqtable-internal.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"

static int pool_of(uint32_t ratio) {
  return ratio == 4 ? CPOOL_C4 : ratio == 128 ? CPOOL_C128 : -1;
}

static const char *pool_name(int k) {
  return k == CPOOL_C4 ? "c4" : "c128";
}

int dsv4_seqtable_attach_compressed(dsv4_seqtable_t *st, const uint32_t *ratio, dsv4_pool_t *c4,
                                    dsv4_pool_t *c128) {
  uint32_t nl = st->cfg.n_layers, m = st->cfg.max_sequences;
  if (st->ratio || m == 0 || st->n_live != 0)
    return DSV4_EINVAL;
  for (uint32_t l = 0; l < nl; l++) {
    int k = pool_of(ratio[l]);
    if (ratio[l] != 0 && (k < 0 || (k == CPOOL_C4 ? c4 : c128) == NULL))
      return DSV4_EINVAL;
  }
  st->ratio = malloc(nl * sizeof(uint32_t));
  st->free_slots = malloc((size_t)m * sizeof(uint32_t));
  if (!st->ratio || !st->free_slots) {
    dsv4__st_c_destroy(st);
    return DSV4_ENOMEM;
  }
  memcpy(st->ratio, ratio, nl * sizeof(uint32_t));
  /* Slot 0 on top: the first sequence takes slot 0, which keeps tests and dumps readable. */
  for (uint32_t i = 0; i < m; i++)
    st->free_slots[i] = m - 1 - i;
  st->n_free_slots = m;
  st->cpool[CPOOL_C4] = c4;
  st->cpool[CPOOL_C128] = c128;
  return 0;
}

void dsv4__st_c_destroy(dsv4_seqtable_t *st) {
  free(st->ratio);
  free(st->free_slots);
  st->ratio = NULL;
  st->free_slots = NULL;
}

void dsv4__st_c_free_arrays(seq_t *s) {
  for (int k = 0; k < CPOOL_COUNT; k++) {
    free(s->cb[k].ids);
    s->cb[k].ids = NULL;
    s->cb[k].n = s->cb[k].cap = 0;
  }
}

void dsv4__st_c_release(dsv4_seqtable_t *st, seq_t *s) {
  if (!st->ratio)
    return;
  for (int k = 0; k < CPOOL_COUNT; k++) {
    for (uint32_t i = 0; i < s->cb[k].n; i++)
      dsv4_pool_free(st->cpool[k], (uint32_t)s->cb[k].ids[i]);
    s->cb[k].first_lb += s->cb[k].n;
    s->cb[k].n = 0;
  }
  assert(st->n_free_slots < st->cfg.max_sequences);
  st->free_slots[st->n_free_slots++] = s->slot;
}

/* The layer's pool, or -1 when the layer has no compressed branch. */
static int layer_pool(const dsv4_seqtable_t *st, uint32_t layer, uint32_t *ratio) {
  if (!st->ratio)
    return -1;
  *ratio = st->ratio[layer];
  return pool_of(*ratio);
}

/* The first logical entry block of a sequence starting at p0: its first visible entry's. */
static int64_t c_first_lb(int64_t p0, uint32_t r, uint32_t bs) {
  return p0 / r / bs;
}

/* Entry blocks a segment adds past what the sequence holds (its table ends at end_lb). */
static uint32_t c_need(int64_t start, uint32_t len, uint32_t r, uint32_t bs, int64_t end_lb) {
  int64_t lo = start / r, hi = (start + len) / r;
  if (hi <= lo)
    return 0;
  int64_t last_lb = (hi - 1) / bs;
  return last_lb >= end_lb ? (uint32_t)(last_lb - end_lb + 1) : 0;
}

int dsv4__st_c_admit(const dsv4_seqtable_t *st, uint32_t layer, uint32_t n, dsv4_plan_t *plan) {
  uint32_t r = 0, bs = st->cfg.block_size;
  int k = layer_pool(st, layer, &r);
  if (k < 0)
    return 0;
  plan_seg_t *ps = plan->priv;
  uint64_t needed = 0;
  for (uint32_t i = 0; i < n; i++) {
    const seq_t *s = ps[i].seq;
    int64_t end_lb = s ? s->cb[k].first_lb + s->cb[k].n : c_first_lb(ps[i].start, r, bs);
    ps[i].cneed = c_need(ps[i].start, ps[i].len, r, bs, end_lb);
    needed += ps[i].cneed;
  }
  uint32_t nfree = dsv4_pool_free_count(st->cpool[k]);
  if (needed > nfree) {
    plan->error.needed = needed > UINT32_MAX ? UINT32_MAX : (uint32_t)needed;
    plan->error.free = nfree;
    plan->error.pool = pool_name(k);
    return DSV4_ENOSPC;
  }
  return 0;
}

int dsv4__st_c_reserve(dsv4_seqtable_t *st, uint32_t layer, uint32_t n, dsv4_plan_t *plan) {
  uint32_t r = 0;
  int k = layer_pool(st, layer, &r);
  if (k < 0)
    return 0;
  plan_seg_t *ps = plan->priv;
  uint64_t total = 0;
  for (uint32_t i = 0; i < n; i++) {
    seq_t *s = ps[i].seq;
    uint64_t want = (uint64_t)s->cb[k].n + ps[i].cneed;
    int rc = dsv4__st_grow((void **)&s->cb[k].ids, &s->cb[k].cap, want ? want : 1, sizeof(int32_t));
    if (rc)
      return rc;
    total += want;
  }
  return dsv4__st_grow((void **)&plan->c_block_table, &plan->c_bt_cap, total ? total : 1,
                       sizeof(int32_t));
}

void dsv4__st_c_apply(dsv4_seqtable_t *st, uint32_t layer, uint32_t n, dsv4_plan_t *plan) {
  uint32_t r = 0, bs = st->cfg.block_size, off = 0;
  int k = layer_pool(st, layer, &r);
  plan_seg_t *ps = plan->priv;
  plan->c_bt_len = 0;
  if (!st->ratio)
    return;
  /* A sequence takes its slot when it is created, at whichever layer. */
  for (uint32_t i = 0; i < n; i++) {
    seq_t *s = ps[i].seq;
    if (!ps[i].create)
      continue;
    /* plan_admit held creations to max_sequences live sequences, one slot each. */
    if (st->n_free_slots == 0)
      abort();
    s->slot = st->free_slots[--st->n_free_slots];
    for (int p = 0; p < CPOOL_COUNT; p++)
      s->cb[p].first_lb = c_first_lb(s->p0, p == CPOOL_C4 ? 4 : 128, bs);
  }
  for (uint32_t i = 0; i < n; i++) {
    seq_t *s = ps[i].seq;
    plan->segs[i].slot = s->slot;
    if (k < 0)
      continue;
    cblocks_t *cb = &s->cb[k];
    for (uint32_t b = 0; b < ps[i].cneed; b++) {
      uint32_t id;
      /* dsv4__st_c_admit counted the free blocks: a failure here is a corrupt pool. */
      if (dsv4_pool_alloc(st->cpool[k], &id) != 0)
        abort();
      cb->ids[cb->n++] = (int32_t)id;
    }
    dsv4_seg_map_t *m = &plan->segs[i];
    m->c_first_lb = cb->first_lb;
    m->c_bt_off = off;
    m->c_bt_len = cb->n;
    memcpy(plan->c_block_table + off, cb->ids, (size_t)cb->n * sizeof(int32_t));
    off += cb->n;
  }
  plan->c_bt_len = off;
}

/* ---- apart from the plan path: dumps and restores ----------------------------------------- */

int dsv4__st_c_next_slot(const dsv4_seqtable_t *st, const seq_t *live, uint32_t *slot, int *taken) {
  *taken = 0;
  if (!st->ratio)
    return DSV4_EINVAL;
  if (st->n_free_slots > 0) {
    *slot = st->free_slots[st->n_free_slots - 1];
    return 0;
  }
  if (!live)
    return DSV4_ENOSPC;
  *slot = live->slot;
  *taken = 1;
  return 0;
}

int dsv4__st_c_copy(const dsv4_seqtable_t *st, const seq_t *s, dsv4_seq_centries_t *out) {
  if (!st->ratio)
    return DSV4_EINVAL;
  out->slot = s->slot;
  for (int k = 0; k < CPOOL_COUNT; k++) {
    out->first_lb[k] = s->cb[k].first_lb;
    out->n[k] = s->cb[k].n;
    out->ids[k] = malloc((s->cb[k].n ? s->cb[k].n : 1) * sizeof(int32_t));
    if (!out->ids[k]) {
      dsv4_seq_centries_free(out);
      return DSV4_ENOMEM;
    }
    if (s->cb[k].n)
      memcpy(out->ids[k], s->cb[k].ids, s->cb[k].n * sizeof(int32_t));
  }
  return 0;
}

void dsv4_seq_centries_free(dsv4_seq_centries_t *c) {
  for (int k = 0; k < CPOOL_COUNT; k++) {
    free(c->ids[k]);
    c->ids[k] = NULL;
    c->n[k] = 0;
  }
}

int dsv4__st_c_insert_ok(const dsv4_seqtable_t *st, int64_t p0, const dsv4_seq_centries_t *c) {
  for (int k = 0; c && k < CPOOL_COUNT; k++) {
    if (c->n[k] == 0)
      continue;
    /* Blocks only where a pool exists, and where the plan path would have put them. */
    if (!st->ratio || !st->cpool[k] ||
        c->first_lb[k] != c_first_lb(p0, k == CPOOL_C4 ? 4 : 128, st->cfg.block_size))
      return 0;
    for (uint32_t i = 0; i < c->n[k]; i++)
      if (c->ids[k][i] < 0 || !dsv4_pool_is_used(st->cpool[k], (uint32_t)c->ids[k][i]))
        return 0;
  }
  return 1;
}

int dsv4__st_c_reserve_insert(seq_t *s, const dsv4_seq_centries_t *c) {
  for (int k = 0; c && k < CPOOL_COUNT; k++) {
    int rc = dsv4__st_grow((void **)&s->cb[k].ids, &s->cb[k].cap, c->n[k] ? c->n[k] : 1,
                           sizeof(int32_t));
    if (rc)
      return rc;
  }
  return 0;
}

int dsv4__st_c_slot_ok(const dsv4_seqtable_t *st, const dsv4_seq_centries_t *c,
                       const seq_t *replaced) {
  if (!st->ratio || !c)
    return 1;
  if (replaced && replaced->slot == c->slot)
    return 1;
  for (uint32_t i = 0; i < st->n_free_slots; i++)
    if (st->free_slots[i] == c->slot)
      return 1;
  return 0;
}

/* Take slot from the free stack (dsv4__st_c_slot_ok found it there, or it was just given back). */
static void take_slot(dsv4_seqtable_t *st, uint32_t slot) {
  for (uint32_t i = st->n_free_slots; i-- > 0;)
    if (st->free_slots[i] == slot) {
      memmove(st->free_slots + i, st->free_slots + i + 1,
              (st->n_free_slots - i - 1) * sizeof(uint32_t));
      st->n_free_slots--;
      return;
    }
  abort();
}

void dsv4__st_c_apply_insert(dsv4_seqtable_t *st, seq_t *s, int64_t p0,
                             const dsv4_seq_centries_t *c) {
  if (!st->ratio)
    return;
  /* The insert checked max_sequences live sequences (each holds a slot) after any drop. */
  if (st->n_free_slots == 0)
    abort();
  if (c) {
    take_slot(st, c->slot);
    s->slot = c->slot;
  } else {
    s->slot = st->free_slots[--st->n_free_slots];
  }
  for (int k = 0; k < CPOOL_COUNT; k++) {
    s->cb[k].first_lb = c_first_lb(p0, k == CPOOL_C4 ? 4 : 128, st->cfg.block_size);
    s->cb[k].n = c ? c->n[k] : 0;
    if (s->cb[k].n)
      memcpy(s->cb[k].ids, c->ids[k], s->cb[k].n * sizeof(int32_t));
  }
}
