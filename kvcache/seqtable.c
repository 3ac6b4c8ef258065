#include "seqtable.h"
#include "seqtable-internal.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"

/*
 * Every sequence holds one contiguous run of logical blocks [first_lb, first_lb + n_blocks):
 * positions are written contiguously from p0 at every layer, blocks are allocated in increasing
 * order, and the release rule (SPEC §4) frees a prefix, because max(p0, s_L - 127) only grows. So a
 * sequence never has holes, and first_lb + n_blocks (the allocation end) only grows.
 *
 * The name map is open addressing with linear probing and backward-shift deletion (no tombstone
 * markers in the probe sequence). It holds live sequences and, for one more idle period, the names
 * of expired ones (state SEQ_EXPIRED, no blocks), so that they answer EEXPIRED.
 */

static uint64_t name_hash(const char *name, uint32_t len) {
  /* FNV-1a, then a final mix so that the low bits used for the probe start depend on every byte. */
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint32_t i = 0; i < len; i++) {
    h ^= (uint8_t)name[i];
    h *= 0x100000001b3ull;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

int dsv4_seq_name_valid(const char *name, size_t len) {
  if (name == NULL || len < 1 || len > DSV4_SEQ_NAME_MAX || name[0] == '.')
    return 0;
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)name[i];
    int ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
             c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok)
      return 0;
  }
  return 1;
}

static void publish(dsv4_seqtable_t *st) {
  __atomic_store_n(&st->published_live, st->n_live, __ATOMIC_RELAXED);
}

/* ---- the name map ---- */

static seq_t *map_find(const dsv4_seqtable_t *st, const char *name, uint32_t len, uint64_t h) {
  uint32_t mask = st->cap - 1;
  for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
    seq_t *s = st->slots[i];
    if (s == NULL)
      return NULL;
    if (s->hash == h && s->name_len == len && memcmp(s->name, name, len) == 0)
      return s;
  }
}

static void map_place(seq_t **slots, uint32_t cap, seq_t *s) {
  uint32_t mask = cap - 1;
  uint32_t i = (uint32_t)s->hash & mask;
  while (slots[i] != NULL)
    i = (i + 1) & mask;
  slots[i] = s;
}

/* Make room for extra more entries at a load factor of at most one half. */
static int map_reserve(dsv4_seqtable_t *st, uint32_t extra) {
  uint64_t want = (uint64_t)st->n_entries + extra;
  if (want * 2 <= st->cap)
    return 0;
  uint64_t cap = st->cap;
  while (want * 2 > cap)
    cap *= 2;
  if (cap > MAP_MAX_SLOTS)
    return DSV4_ENOMEM;
  seq_t **slots = calloc((size_t)cap, sizeof(*slots));
  if (slots == NULL)
    return DSV4_ENOMEM;
  for (uint32_t i = 0; i < st->cap; i++)
    if (st->slots[i] != NULL)
      map_place(slots, (uint32_t)cap, st->slots[i]);
  free(st->slots);
  st->slots = slots;
  st->cap = (uint32_t)cap;
  return 0;
}

static void map_insert(dsv4_seqtable_t *st, seq_t *s) {
  assert((uint64_t)(st->n_entries + 1) * 2 <= st->cap);
  map_place(st->slots, st->cap, s);
  st->n_entries++;
  s->prev = NULL;
  s->next = st->all;
  if (st->all != NULL)
    st->all->prev = s;
  st->all = s;
}

/* Unlink s from the map and the list and free it (its blocks must already be returned). */
static void map_remove(dsv4_seqtable_t *st, seq_t *s) {
  uint32_t mask = st->cap - 1;
  uint32_t i = (uint32_t)s->hash & mask;
  while (st->slots[i] != s)
    i = (i + 1) & mask;
  /* Backward shift: pull later members of the cluster into the hole when their home allows it. */
  uint32_t hole = i;
  for (uint32_t j = (hole + 1) & mask; st->slots[j] != NULL; j = (j + 1) & mask) {
    uint32_t home = (uint32_t)st->slots[j]->hash & mask;
    if (((j - home) & mask) >= ((j - hole) & mask)) {
      st->slots[hole] = st->slots[j];
      hole = j;
    }
  }
  st->slots[hole] = NULL;
  st->n_entries--;
  if (s->prev != NULL)
    s->prev->next = s->next;
  else
    st->all = s->next;
  if (s->next != NULL)
    s->next->prev = s->prev;
  dsv4__st_c_free_arrays(s);
  free(s->blocks);
  free(s);
}

#ifdef DSV4_TEST_BROKEN_SHARED_BLOCK
/*
 * Test-only breakage of SPEC §5.3 (tests/unit/inv_unique_slots.c): allocation hands out the top of
 * the free stack without popping it, so the next allocation gets the same id while its first
 * holder still uses it. The pool never sees such an id taken, so freeing it is dropped.
 */
static int broken_pool_alloc(dsv4_pool_t *p, uint32_t *id) {
  if (p->n_free == 0)
    return DSV4_ENOSPC;
  *id = p->free_stack[p->n_free - 1];
  return 0;
}

static void broken_pool_free(dsv4_pool_t *p, uint32_t id) {
  if (dsv4_pool_is_used(p, id))
    dsv4_pool_free(p, id);
}
#define dsv4_pool_alloc broken_pool_alloc
#define dsv4_pool_free broken_pool_free
#endif

static void free_blocks(dsv4_seqtable_t *st, seq_t *s) {
  for (uint32_t i = 0; i < s->n_blocks; i++)
    dsv4_pool_free(st->pool, (uint32_t)s->blocks[i]);
  s->first_lb += s->n_blocks;
  s->n_blocks = 0;
}

static void drop_live(dsv4_seqtable_t *st, seq_t *s) {
  assert(s->state == SEQ_LIVE);
  free_blocks(st, s);
  dsv4__st_c_release(st, s);
  st->n_live--;
  map_remove(st, s);
}

/* ---- create / destroy ---- */

int dsv4_seqtable_create(const dsv4_seqtable_config_t *cfg, dsv4_pool_t *pool,
                         dsv4_seqtable_t **out) {
  *out = NULL;
  uint32_t bs = cfg->block_size;
  if (cfg->n_layers == 0 || bs < DSV4_MIN_BLOCK_SIZE || bs > DSV4_MAX_BLOCK_SIZE ||
      (bs & (bs - 1)) != 0 || cfg->max_position <= 0 || pool == NULL)
    return DSV4_EINVAL;
  dsv4_seqtable_t *st = calloc(1, sizeof(*st));
  if (st == NULL)
    return DSV4_ENOMEM;
  st->cfg = *cfg;
  st->pool = pool;
  st->cap = MAP_MIN_SLOTS;
  st->slots = calloc(st->cap, sizeof(*st->slots));
  if (st->slots == NULL) {
    free(st);
    return DSV4_ENOMEM;
  }
  publish(st);
  *out = st;
  return 0;
}

void dsv4_seqtable_destroy(dsv4_seqtable_t *st) {
  if (st == NULL)
    return;
  while (st->all != NULL) {
    seq_t *s = st->all;
    if (s->state == SEQ_LIVE)
      drop_live(st, s);
    else
      map_remove(st, s);
  }
  free(st->slots);
  dsv4__st_c_destroy(st);
  free(st);
}

const dsv4_seqtable_config_t *dsv4_seqtable_config(const dsv4_seqtable_t *st) {
  return &st->cfg;
}

/* ---- plans ---- */

void dsv4_plan_init(dsv4_plan_t *plan) {
  memset(plan, 0, sizeof(*plan));
}

void dsv4_plan_free(dsv4_plan_t *plan) {
  free(plan->priv);
  free(plan->segs);
  free(plan->block_table);
  free(plan->c_block_table);
  memset(plan, 0, sizeof(*plan));
}

int dsv4__st_grow(void **p, uint32_t *cap, uint64_t want, size_t elem) {
  if (want <= *cap)
    return 0;
  if (want > UINT32_MAX / 2)
    return DSV4_ENOMEM;
  uint64_t n = *cap ? *cap : GROW_MIN;
  while (n < want)
    n *= 2;
  void *q = realloc(*p, (size_t)n * elem);
  if (q == NULL)
    return DSV4_ENOMEM;
  *p = q;
  *cap = (uint32_t)n;
  return 0;
}

static int ensure_blocks(seq_t *s, uint64_t want) {
  return dsv4__st_grow((void **)&s->blocks, &s->cap_blocks, want, sizeof(int32_t));
}

/* The first logical block a segment's map covers: its attention window reaches back to start - 127.
 */
static int64_t map_first_lb(int64_t p0, int64_t start, uint32_t bs) {
  int64_t lo = start - (DSV4_WINDOW - 1);
  if (lo < p0)
    lo = p0;
  return lo / bs;
}

static uint32_t pow2_at_least(uint64_t n) {
  uint32_t c = GROW_MIN;
  while (c < n)
    c *= 2;
  return c;
}

/* Plan pass 0: room in plan->priv for n segment states and an empty duplicate-name set of dcap. */
static int plan_reserve_priv(dsv4_plan_t *plan, uint32_t n, uint32_t dcap) {
  size_t bytes = (size_t)n * sizeof(plan_seg_t) + (size_t)dcap * sizeof(uint32_t);
  if (bytes > UINT32_MAX)
    return DSV4_ENOMEM;
  if (bytes > plan->priv_cap) {
    void *q = realloc(plan->priv, bytes);
    if (q == NULL)
      return DSV4_ENOMEM;
    plan->priv = q;
    plan->priv_cap = (uint32_t)bytes;
  }
  uint32_t *dset = (uint32_t *)((plan_seg_t *)plan->priv + n);
  for (uint32_t i = 0; i < dcap; i++)
    dset[i] = UINT32_MAX;
  return 0;
}

/* Plan pass 1: the segment alone (name, length, range) and duplicates within the batch. */
static int plan_check_segments(const dsv4_seqtable_t *st, const dsv4_seg_req_t *segs, uint32_t n,
                               uint32_t dcap, dsv4_plan_t *plan) {
  plan_seg_t *ps = plan->priv;
  uint32_t *dset = (uint32_t *)(ps + n);
  for (uint32_t i = 0; i < n; i++) {
    const dsv4_seg_req_t *r = &segs[i];
    plan->error.segment = i;
    if (!dsv4_seq_name_valid(r->name, r->name_len) || r->len < 1)
      return DSV4_EINVAL;
    if (r->start < 0 || r->start >= st->cfg.max_position ||
        (int64_t)r->len > st->cfg.max_position - r->start)
      return DSV4_EPOSRANGE;
    memset(&ps[i], 0, sizeof(ps[i]));
    ps[i].name_hash = name_hash(r->name, r->name_len);
    ps[i].start = r->start;
    ps[i].len = r->len;
    ps[i].hash = r->hash;
    uint32_t j = (uint32_t)ps[i].name_hash & (dcap - 1);
    for (; dset[j] != UINT32_MAX; j = (j + 1) & (dcap - 1)) {
      const dsv4_seg_req_t *o = &segs[dset[j]];
      if (ps[dset[j]].name_hash == ps[i].name_hash && o->name_len == r->name_len &&
          memcmp(o->name, r->name, r->name_len) == 0)
        return DSV4_EDUPSEQ;
    }
    dset[j] = i;
  }
  return 0;
}

/* Plan pass 2: look the sequences up; 1 when the whole batch is a replay. */
static int plan_lookup(const dsv4_seqtable_t *st, uint32_t layer, const dsv4_seg_req_t *segs,
                       uint32_t n, plan_seg_t *ps) {
  int all_replay = 1;
  for (uint32_t i = 0; i < n; i++) {
    const dsv4_seg_req_t *r = &segs[i];
    seq_t *s = map_find(st, r->name, r->name_len, ps[i].name_hash);
    if (s != NULL && s->state == SEQ_EXPIRED) {
      ps[i].tomb = s;
      s = NULL;
    }
    ps[i].seq = s;
    if (s != NULL) {
      const layer_state_t *ls = &s->layers[layer];
      ps[i].replay = ls->last_len != 0 && ls->s == r->start && ls->last_len == r->len &&
                     ls->last_hash == r->hash;
    }
    all_replay &= ps[i].replay;
  }
  return all_replay;
}

/* Plan pass 3 (fresh batches): continuity, and the blocks and sequences needed against the free. */
static int plan_admit(const dsv4_seqtable_t *st, uint32_t layer, const dsv4_seg_req_t *segs,
                      uint32_t n, uint64_t now_ns, dsv4_plan_t *plan, uint32_t *new_seqs) {
  const uint32_t bs = st->cfg.block_size;
  plan_seg_t *ps = plan->priv;
  uint64_t needed = 0;
  for (uint32_t i = 0; i < n; i++) {
    const dsv4_seg_req_t *r = &segs[i];
    seq_t *s = ps[i].seq;
    plan->error.segment = i;
    int64_t last_lb = (r->start + r->len - 1) / bs;
    if (s != NULL) {
      /* A segment matching the replay triple in a mixed batch is not a replay: it fails here. */
      int64_t next = s->layers[layer].next;
      if (r->is_new || r->start != next) {
        plan->error.expected = next;
        return r->is_new ? DSV4_EEXIST : DSV4_EPOSITION;
      }
      int64_t end_lb = s->first_lb + s->n_blocks;
      ps[i].need = last_lb >= end_lb ? (uint32_t)(last_lb - end_lb + 1) : 0;
    } else {
      /* An expired name answers EEXPIRED for one period even under implicit_create: it is not
       * unknown, and creating it afresh at this segment's start would silently lose its window.
       * Only "new" recreates it. */
      const seq_t *t = ps[i].tomb;
      if (!r->is_new && t != NULL && now_ns >= t->last_used_ns &&
          now_ns - t->last_used_ns < st->cfg.idle_timeout_ns)
        return DSV4_EEXPIRED;
      if (!r->is_new && !st->cfg.implicit_create)
        return DSV4_ENOSEQ;
      ps[i].create = 1;
      ps[i].need = (uint32_t)(last_lb - r->start / bs + 1);
      (*new_seqs)++;
    }
    needed += ps[i].need;
  }
  plan->error.segment = 0;
  if (st->cfg.max_sequences != 0 && (uint64_t)st->n_live + *new_seqs > st->cfg.max_sequences) {
    plan->error.new_sequences = *new_seqs;
    plan->error.free_sequences = st->cfg.max_sequences - st->n_live;
    plan->error.sequences_full = 1;
    return DSV4_ENOSPC;
  }
  uint32_t nfree = dsv4_pool_free_count(st->pool);
  if (needed > nfree) {
    plan->error.needed = needed > UINT32_MAX ? UINT32_MAX : (uint32_t)needed;
    plan->error.free = nfree;
    plan->error.pool = "swa";
    return DSV4_ENOSPC;
  }
  return dsv4__st_c_admit(st, layer, n, plan);
}

/* Plan pass 4: every piece of memory reserved before the first change (ENOMEM leaves nothing). */
static int plan_reserve(dsv4_seqtable_t *st, uint32_t n, uint32_t new_seqs, dsv4_plan_t *plan) {
  const uint32_t bs = st->cfg.block_size;
  plan_seg_t *ps = plan->priv;
  uint64_t bt_total = 0;
  for (uint32_t i = 0; i < n; i++) {
    int64_t p0 = ps[i].seq != NULL ? ps[i].seq->p0 : ps[i].start;
    int64_t last_lb = (ps[i].start + ps[i].len - 1) / bs;
    bt_total += (uint64_t)(last_lb - map_first_lb(p0, ps[i].start, bs) + 1);
  }
  int rc = dsv4__st_grow((void **)&plan->segs, &plan->segs_cap, n, sizeof(dsv4_seg_map_t));
  if (rc == 0)
    rc = dsv4__st_grow((void **)&plan->block_table, &plan->bt_cap, bt_total, sizeof(int32_t));
  if (rc == 0)
    rc = map_reserve(st, new_seqs);
  for (uint32_t i = 0; i < n && rc == 0; i++) {
    if (ps[i].create) {
      size_t sz = sizeof(seq_t) + (size_t)st->cfg.n_layers * sizeof(layer_state_t);
      seq_t *s = calloc(1, sz);
      if (s == NULL) {
        rc = DSV4_ENOMEM;
        break;
      }
      ps[i].seq = s;
      s->p0 = ps[i].start;
      s->first_lb = ps[i].start / bs;
      rc = ensure_blocks(s, ps[i].need);
    } else if (ps[i].need != 0) {
      rc = ensure_blocks(ps[i].seq, (uint64_t)ps[i].seq->n_blocks + ps[i].need);
    }
  }
  if (rc == 0)
    rc = dsv4__st_c_reserve(st, plan->layer, n, plan);
  if (rc != 0) {
    for (uint32_t i = 0; i < n; i++) {
      if (ps[i].create && ps[i].seq != NULL) {
        dsv4__st_c_free_arrays(ps[i].seq);
        free(ps[i].seq->blocks);
        free(ps[i].seq);
      }
      ps[i].seq = NULL;
    }
  }
  return rc;
}

/* Plan pass 5, apply: a created sequence enters the map, in place of an expired entry of its name.
 */
static void plan_enter(dsv4_seqtable_t *st, const dsv4_seg_req_t *r, plan_seg_t *p,
                       uint64_t now_ns) {
  seq_t *s = p->seq;
  if (p->tomb != NULL)
    map_remove(st, p->tomb);
  p->tomb = NULL;
  memcpy(s->name, r->name, r->name_len);
  s->name_len = r->name_len;
  s->hash = p->name_hash;
  s->state = SEQ_LIVE;
  s->last_used_ns = now_ns;
  for (uint32_t l = 0; l < st->cfg.n_layers; l++) {
    s->layers[l].next = s->p0;
    s->layers[l].s = s->p0;
  }
  map_insert(st, s);
  st->n_live++;
}

/* Plan pass 5, apply: new sequences, new blocks and each window's block table; returns its length.
 */
static uint32_t plan_apply(dsv4_seqtable_t *st, const dsv4_seg_req_t *segs, uint32_t n,
                           uint64_t now_ns, dsv4_plan_t *plan) {
  /* Nothing here can fail: pass 3 counted the free blocks and pass 4 reserved the memory. */
  const uint32_t bs = st->cfg.block_size;
  plan_seg_t *ps = plan->priv;
  uint32_t off = 0;
  for (uint32_t i = 0; i < n; i++) {
    const dsv4_seg_req_t *r = &segs[i];
    seq_t *s = ps[i].seq;
    if (ps[i].create)
      plan_enter(st, r, &ps[i], now_ns);
    for (uint32_t k = 0; k < ps[i].need; k++) {
      uint32_t id;
      /* Pass 3 counted the free blocks, so this cannot fail; if it did, the pool is corrupt and
       * going on would hand one block to two sequences, in any build. */
      if (dsv4_pool_alloc(st->pool, &id) != 0)
        abort();
      s->blocks[s->n_blocks++] = (int32_t)id;
    }
    int64_t flb = map_first_lb(s->p0, r->start, bs);
    int64_t last_lb = (r->start + r->len - 1) / bs;
    assert(flb >= s->first_lb && last_lb < s->first_lb + s->n_blocks);
    dsv4_seg_map_t *m = &plan->segs[i];
    m->first_lb = flb;
    m->p0 = s->p0;
    m->bt_off = off;
    m->bt_len = (uint32_t)(last_lb - flb + 1);
    for (uint32_t k = 0; k < m->bt_len; k++)
      plan->block_table[off + k] = s->blocks[flb - s->first_lb + k];
    off += m->bt_len;
  }
  return off;
}

int dsv4_seqtable_plan(dsv4_seqtable_t *st, uint32_t layer, const dsv4_seg_req_t *segs, uint32_t n,
                       uint64_t now_ns, dsv4_plan_t *plan) {
  assert(st->plan_active < 2);
  plan->layer = layer;
  plan->n_segments = 0;
  plan->replay = 0;
  plan->bt_len = 0;
  memset(&plan->error, 0, sizeof(plan->error));
  if (layer >= st->cfg.n_layers)
    return DSV4_ELAYER;
  if (n == 0 || n > UINT32_MAX / 4)
    return DSV4_EINVAL;

  /* priv holds the per-segment state, then an index set (open addressing) for duplicate names. */
  uint32_t dcap = pow2_at_least((uint64_t)n * 2);
  int rc = plan_reserve_priv(plan, n, dcap);
  if (rc == 0)
    rc = plan_check_segments(st, segs, n, dcap, plan);
  if (rc != 0)
    return rc;
  int all_replay = plan_lookup(st, layer, segs, n, plan->priv);
  uint32_t new_seqs = 0;
  if (!all_replay && (rc = plan_admit(st, layer, segs, n, now_ns, plan, &new_seqs)) != 0)
    return rc;
  if ((rc = plan_reserve(st, n, new_seqs, plan)) != 0)
    return rc;
  plan->bt_len = plan_apply(st, segs, n, now_ns, plan);
  dsv4__st_c_apply(st, layer, n, plan);
  plan->n_segments = n;
  plan->replay = all_replay;
  st->plan_active++;
  publish(st);
  return 0;
}

/* Free the prefix of blocks that no served layer can reach (SPEC §4 release rule). */
static void release(dsv4_seqtable_t *st, seq_t *s) {
  int64_t low = INT64_MAX;
  for (uint32_t l = 0; l < st->cfg.n_layers; l++) {
    int64_t v = s->layers[l].s - (DSV4_WINDOW - 1);
    if (v < s->p0)
      v = s->p0;
    if (v < low)
      low = v;
  }
  /* Block b is released when low > (b+1)*bs - 1, that is for every b < low / bs. */
  int64_t keep = low / st->cfg.block_size;
  if (keep <= s->first_lb || s->n_blocks == 0)
    return;
  uint32_t k = (uint32_t)(keep - s->first_lb);
  if (k > s->n_blocks)
    k = s->n_blocks;
  for (uint32_t i = 0; i < k; i++)
    dsv4_pool_free(st->pool, (uint32_t)s->blocks[i]);
  memmove(s->blocks, s->blocks + k, (size_t)(s->n_blocks - k) * sizeof(int32_t));
  s->n_blocks -= k;
  s->first_lb += k;
}

void dsv4_seqtable_commit(dsv4_seqtable_t *st, dsv4_plan_t *plan, uint64_t now_ns) {
  assert(st->plan_active);
  plan_seg_t *ps = plan->priv;
  for (uint32_t i = 0; i < plan->n_segments; i++) {
    seq_t *s = ps[i].seq;
    s->last_used_ns = now_ns;
    if (plan->replay)
      continue;
    layer_state_t *ls = &s->layers[plan->layer];
    ls->next = ps[i].start + ps[i].len;
    ls->s = ps[i].start;
    ls->last_len = ps[i].len;
    ls->last_hash = ps[i].hash;
    release(st, s);
  }
  st->plan_active--;
}

void dsv4_seqtable_fail(dsv4_seqtable_t *st, dsv4_plan_t *plan) {
  assert(st->plan_active);
  plan_seg_t *ps = plan->priv;
  for (uint32_t i = 0; i < plan->n_segments; i++) {
    drop_live(st, ps[i].seq);
    ps[i].seq = NULL;
  }
  st->plan_active--;
  publish(st);
}

/* ---- delete, expiry, queries ---- */

int dsv4_seqtable_delete(dsv4_seqtable_t *st, const char *name, uint32_t name_len, int *existed) {
  assert(!st->plan_active);
  *existed = 0;
  if (!dsv4_seq_name_valid(name, name_len))
    return DSV4_EINVAL;
  seq_t *s = map_find(st, name, name_len, name_hash(name, name_len));
  if (s == NULL)
    return 0;
  if (s->state == SEQ_LIVE) {
    *existed = 1;
    drop_live(st, s);
    publish(st);
  } else {
    /* The gateway has said it is done with the name: it need not answer "expired" any more. */
    map_remove(st, s);
  }
  return 0;
}

/*
 * One sequence against the clock: a live one idle past the timeout is deleted and its name answers
 * expired for one period, counted from the moment it expired (last use + timeout), not from when a
 * sweep noticed; an expired name is forgotten after that period. Returns 1 when a live sequence
 * expired, 2 when a name was forgotten (s is then freed), else 0.
 */
static int expire_one(dsv4_seqtable_t *st, seq_t *s, uint64_t now_ns) {
  uint64_t t = st->cfg.idle_timeout_ns;
  if (now_ns < s->last_used_ns || now_ns - s->last_used_ns < t)
    return 0;
  if (s->state == SEQ_LIVE) {
    free_blocks(st, s);
    dsv4__st_c_release(st, s);
    s->state = SEQ_EXPIRED;
    s->last_used_ns += t;
    free(s->blocks);
    s->blocks = NULL;
    s->cap_blocks = 0;
    st->n_live--;
    /* Idle past two periods already: the name's own period is over too. */
    if (now_ns - s->last_used_ns >= t) {
      map_remove(st, s);
      return 2;
    }
    return 1;
  }
  map_remove(st, s);
  return 2;
}

uint32_t dsv4_seqtable_expire(dsv4_seqtable_t *st, uint64_t now_ns) {
  assert(!st->plan_active);
  if (st->cfg.idle_timeout_ns == 0)
    return 0;
  uint32_t n = 0;
  for (seq_t *s = st->all, *nx; s != NULL; s = nx) {
    nx = s->next;
    int live = s->state == SEQ_LIVE;
    int r = expire_one(st, s, now_ns);
    n += live && r != 0;
  }
  publish(st);
  return n;
}

uint32_t dsv4_seqtable_expire_named(dsv4_seqtable_t *st, const dsv4_seg_req_t *segs, uint32_t n,
                                    uint64_t now_ns) {
  /* With a plan open only for a batch between another's chunks, which names none of its
   * sequences. */
  assert(st->plan_active < 2);
  if (st->cfg.idle_timeout_ns == 0)
    return 0;
  uint32_t live = 0, changed = 0;
  for (uint32_t i = 0; i < n; i++) {
    const dsv4_seg_req_t *r = &segs[i];
    if (!dsv4_seq_name_valid(r->name, r->name_len))
      continue; /* the plan refuses it */
    seq_t *s = map_find(st, r->name, r->name_len, name_hash(r->name, r->name_len));
    if (s == NULL)
      continue;
    int was_live = s->state == SEQ_LIVE;
    int x = expire_one(st, s, now_ns);
    live += was_live && x != 0;
    changed |= x != 0;
  }
  if (changed)
    publish(st);
  return live;
}

static int fill_info(const dsv4_seqtable_t *st, const seq_t *s, dsv4_seq_info_t *out) {
  uint32_t nl = st->cfg.n_layers;
  memset(out, 0, sizeof(*out));
  out->next = malloc(nl * sizeof(int64_t));
  out->last_start = malloc(nl * sizeof(int64_t));
  out->blocks = malloc((s->n_blocks ? s->n_blocks : 1) * sizeof(int32_t));
  if (out->next == NULL || out->last_start == NULL || out->blocks == NULL) {
    dsv4_seq_info_free(out);
    return DSV4_ENOMEM;
  }
  out->p0 = s->p0;
  out->first_lb = s->first_lb;
  out->n_blocks_held = s->n_blocks;
  memcpy(out->blocks, s->blocks, s->n_blocks * sizeof(int32_t));
  out->last_used_ns = s->last_used_ns;
  int64_t low = INT64_MAX;
  for (uint32_t l = 0; l < nl; l++) {
    out->next[l] = s->layers[l].next;
    out->last_start[l] = s->layers[l].s;
    int64_t v = s->layers[l].s - (DSV4_WINDOW - 1);
    if (v < s->p0)
      v = s->p0;
    if (v < low) {
      low = v;
      out->holding_layer = l;
    }
  }
  return 0;
}

int dsv4_seqtable_info(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                       dsv4_seq_info_t *out) {
  memset(out, 0, sizeof(*out));
  if (!dsv4_seq_name_valid(name, name_len))
    return DSV4_ENOSEQ;
  const seq_t *s = map_find(st, name, name_len, name_hash(name, name_len));
  if (s == NULL)
    return DSV4_ENOSEQ;
  if (s->state != SEQ_LIVE)
    return DSV4_EEXPIRED;
  return fill_info(st, s, out);
}

int dsv4_seqtable_centries(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                           dsv4_seq_centries_t *out) {
  memset(out, 0, sizeof(*out));
  if (!dsv4_seq_name_valid(name, name_len))
    return DSV4_ENOSEQ;
  const seq_t *s = map_find(st, name, name_len, name_hash(name, name_len));
  if (s == NULL)
    return DSV4_ENOSEQ;
  if (s->state != SEQ_LIVE)
    return DSV4_EEXPIRED;
  return dsv4__st_c_copy(st, s, out);
}

int dsv4_seqtable_c_next_slot(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                              uint32_t *slot, int *taken) {
  const seq_t *s = dsv4_seq_name_valid(name, name_len)
                       ? map_find(st, name, name_len, name_hash(name, name_len))
                       : NULL;
  return dsv4__st_c_next_slot(st, s && s->state == SEQ_LIVE ? s : NULL, slot, taken);
}

void dsv4_seq_info_free(dsv4_seq_info_t *info) {
  free(info->next);
  free(info->last_start);
  free(info->blocks);
  info->next = NULL;
  info->last_start = NULL;
  info->blocks = NULL;
  info->n_blocks_held = 0;
}

int dsv4_seqtable_foreach(const dsv4_seqtable_t *st, dsv4_seq_visit_fn fn, void *arg) {
  for (const seq_t *s = st->all; s != NULL; s = s->next) {
    if (s->state != SEQ_LIVE)
      continue;
    dsv4_seq_info_t info;
    int rc = fill_info(st, s, &info);
    if (rc != 0)
      return rc;
    rc = fn(s->name, s->name_len, &info, arg);
    dsv4_seq_info_free(&info);
    if (rc != 0)
      return rc;
  }
  return 0;
}

uint32_t dsv4_seqtable_count(const dsv4_seqtable_t *st) {
  return st->n_live;
}

uint32_t dsv4_seqtable_count_relaxed(const dsv4_seqtable_t *st) {
  return __atomic_load_n(&st->published_live, __ATOMIC_RELAXED);
}

/* ---- restore: a sequence with given state ---- */

int dsv4_seqtable_state(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                        dsv4_seq_state_t *out) {
  if (!dsv4_seq_name_valid(name, name_len))
    return DSV4_ENOSEQ;
  const seq_t *s = map_find(st, name, name_len, name_hash(name, name_len));
  if (s == NULL)
    return DSV4_ENOSEQ;
  if (s->state != SEQ_LIVE)
    return DSV4_EEXPIRED;
  out->p0 = s->p0;
  for (uint32_t l = 0; l < st->cfg.n_layers; l++) {
    const layer_state_t *ls = &s->layers[l];
    out->layers[l] = (dsv4_seq_layer_state_t){ls->next, ls->s, ls->last_len, ls->last_hash};
  }
  return 0;
}

int dsv4_seqtable_state_low(const dsv4_seqtable_config_t *cfg, const dsv4_seq_state_t *state,
                            int64_t *low) {
  const int64_t p0 = state->p0;
  if (p0 < 0 || p0 >= cfg->max_position)
    return DSV4_EINVAL;
  int64_t lo = INT64_MAX;
  for (uint32_t l = 0; l < cfg->n_layers; l++) {
    const dsv4_seq_layer_state_t *ls = &state->layers[l];
    if (ls->last_len == 0) {
      if (ls->next != p0 || ls->last_start != p0)
        return DSV4_EINVAL;
    } else if (ls->last_start < p0 || ls->last_start >= cfg->max_position ||
               (int64_t)ls->last_len > cfg->max_position - ls->last_start ||
               ls->next != ls->last_start + ls->last_len) {
      return DSV4_EINVAL;
    }
    /* The same bound release() applies after a commit. */
    int64_t v = ls->last_start - (DSV4_WINDOW - 1);
    if (v < p0)
      v = p0;
    if (v < lo)
      lo = v;
  }
  *low = lo;
  return 0;
}

/* Whether blocks [first_lb, first_lb + n_blocks) are the ones a table holding state keeps. */
static int insert_blocks_fit(const dsv4_seqtable_config_t *cfg, const dsv4_seq_state_t *state,
                             int64_t low, int64_t first_lb, uint32_t n_blocks) {
  const int64_t bs = cfg->block_size;
  int64_t end = state->p0;
  for (uint32_t l = 0; l < cfg->n_layers; l++)
    if (state->layers[l].next > end)
      end = state->layers[l].next;
  if (first_lb < state->p0 / bs || first_lb > low / bs)
    return 0;
  /* Nothing written: no block, as before a sequence's first batch. */
  if (end == state->p0)
    return n_blocks == 0 && first_lb == state->p0 / bs;
  return first_lb + (int64_t)n_blocks == (end - 1) / bs + 1;
}

int dsv4_seqtable_insert(dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                         const dsv4_seq_state_t *state, int64_t first_lb, const int32_t *blocks,
                         uint32_t n_blocks, int replace, uint64_t now_ns, dsv4_plan_error_t *err) {
  return dsv4_seqtable_insert_c(st, name, name_len, state, first_lb, blocks, n_blocks, NULL,
                                replace, now_ns, err);
}

int dsv4_seqtable_insert_c(dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                           const dsv4_seq_state_t *state, int64_t first_lb, const int32_t *blocks,
                           uint32_t n_blocks, const dsv4_seq_centries_t *c, int replace,
                           uint64_t now_ns, dsv4_plan_error_t *err) {
  assert(!st->plan_active);
  int64_t low;
  memset(err, 0, sizeof(*err));
  if (!dsv4_seq_name_valid(name, name_len) || dsv4_seqtable_state_low(&st->cfg, state, &low) != 0 ||
      !insert_blocks_fit(&st->cfg, state, low, first_lb, n_blocks))
    return DSV4_EINVAL;
  for (uint32_t i = 0; i < n_blocks; i++)
    if (blocks[i] < 0 || !dsv4_pool_is_used(st->pool, (uint32_t)blocks[i]))
      return DSV4_EINVAL;
  if (!dsv4__st_c_insert_ok(st, state->p0, c))
    return DSV4_EINVAL;
  uint64_t h = name_hash(name, name_len);
  seq_t *old = map_find(st, name, name_len, h);
  int live = old != NULL && old->state == SEQ_LIVE;
  if (live && !replace)
    return DSV4_EEXIST;
  if (!live && st->cfg.max_sequences != 0 && st->n_live >= st->cfg.max_sequences) {
    err->sequences_full = 1;
    err->new_sequences = 1;
    return DSV4_ENOSPC;
  }
  if (!dsv4__st_c_slot_ok(st, c, live ? old : NULL))
    return DSV4_EINVAL;
  /* Every allocation before the first change, so that ENOMEM leaves the table as it was. */
  seq_t *s = calloc(1, sizeof(seq_t) + (size_t)st->cfg.n_layers * sizeof(layer_state_t));
  if (s == NULL || ensure_blocks(s, n_blocks ? n_blocks : 1) != 0 || map_reserve(st, 1) != 0 ||
      dsv4__st_c_reserve_insert(s, c) != 0) {
    if (s != NULL) {
      free(s->blocks);
      dsv4__st_c_free_arrays(s);
    }
    free(s);
    return DSV4_ENOMEM;
  }
  if (live)
    drop_live(st, old);
  else if (old != NULL)
    map_remove(st, old);
  /* After the drop, which gave back the replaced sequence's slot. */
  dsv4__st_c_apply_insert(st, s, state->p0, c);
  memcpy(s->name, name, name_len);
  s->name_len = name_len;
  s->hash = h;
  s->state = SEQ_LIVE;
  s->last_used_ns = now_ns;
  s->p0 = state->p0;
  s->first_lb = first_lb;
  s->n_blocks = n_blocks;
  if (n_blocks)
    memcpy(s->blocks, blocks, (size_t)n_blocks * sizeof(int32_t));
  for (uint32_t l = 0; l < st->cfg.n_layers; l++) {
    const dsv4_seq_layer_state_t *ls = &state->layers[l];
    s->layers[l] = (layer_state_t){ls->next, ls->last_start, ls->last_len, ls->last_hash};
  }
  map_insert(st, s);
  st->n_live++;
  publish(st);
  return 0;
}
