#ifndef DSV4_KVCACHE_SEQTABLE_INTERNAL_H
#define DSV4_KVCACHE_SEQTABLE_INTERNAL_H

/*
 * The sequence table's state, shared by seqtable.c (names, SWA blocks, plans) and
 * seqtable_compress.c (the compressed branch's state slots and entry blocks, SPEC §8.7).
 */

#include "seqtable.h"

enum { SEQ_LIVE = 0, SEQ_EXPIRED = 1 };

/* The name map starts with this many slots and doubles up to MAP_MAX_SLOTS, the largest power of
 * two its 32-bit slot indices take. */
#define MAP_MIN_SLOTS 64
#define MAP_MAX_SLOTS (1ull << 31)
/* The smallest capacity the growing arrays (a sequence's blocks, a plan's arrays and its duplicate
 * set) start from; they double from there. */
#define GROW_MIN 8

/* The compressed pools: c4 (ratio 4, with the index blocks) and c128. */
enum { CPOOL_C4 = 0, CPOOL_C128 = 1, CPOOL_COUNT = 2 };

typedef struct {
  int64_t next;       /* next position this layer writes */
  int64_t s;          /* first position of the last applied segment; p0 before any */
  uint32_t last_len;  /* 0 before any segment was applied */
  uint64_t last_hash; /* with s and last_len: the replay triple */
} layer_state_t;

/* A sequence's blocks of one compressed pool: entry j of any layer of the pool lives in logical
 * block j / bs, ids[j / bs - first_lb]. Never released while the sequence lives. */
typedef struct {
  int64_t first_lb;
  uint32_t n, cap;
  int32_t *ids;
} cblocks_t;

typedef struct seq {
  struct seq *prev, *next; /* every entry of the map, live or expired */
  uint64_t hash;
  int state;
  uint64_t last_used_ns; /* for an expired entry: when it expired */
  int64_t p0;
  int64_t first_lb;
  uint32_t n_blocks, cap_blocks;
  int32_t *blocks;
  uint32_t slot; /* the compressor state slot (live, with the compressed branch attached) */
  cblocks_t cb[CPOOL_COUNT];
  uint32_t name_len;
  char name[DSV4_SEQ_NAME_MAX];
  layer_state_t layers[];
} seq_t;

struct dsv4_seqtable {
  dsv4_seqtable_config_t cfg;
  dsv4_pool_t *pool;
  seq_t **slots;
  uint32_t cap; /* power of two */
  uint32_t n_entries;
  uint32_t n_live;
  uint32_t published_live;
  seq_t *all;
  /* Plans between plan and commit/fail: one, or two while a batch runs between the chunks of
   * another (dsv4_seqtable_plan). */
  int plan_active;
  /* The compressed branch (seqtable_compress.c), when attached. */
  uint32_t *ratio;                 /* [n_layers]: 4, 128 or 0 */
  dsv4_pool_t *cpool[CPOOL_COUNT]; /* NULL when no served layer has that ratio */
  uint32_t *free_slots;            /* stack of free state slots */
  uint32_t n_free_slots;
};

/* Per-segment plan state, kept in plan->priv between plan and commit/fail. */
typedef struct {
  seq_t *seq;
  seq_t *tomb; /* an expired entry of the same name */
  uint64_t name_hash;
  int64_t start;
  uint32_t len;
  uint64_t hash;
  uint8_t create;
  uint8_t replay;
  uint32_t need;  /* new blocks */
  uint32_t cneed; /* new blocks of the layer's compressed pool */
} plan_seg_t;

/* Grow *p (elements of elem bytes, capacity *cap) to hold want, doubling from GROW_MIN. */
int dsv4__st_grow(void **p, uint32_t *cap, uint64_t want, size_t elem);

/*
 * The compressed branch's steps of a plan, for a layer whose ratio is 4 or 128 (no-ops otherwise):
 * admit counts each segment's new entry blocks and checks the pool (DSV4_ENOSPC with error.pool
 * set); reserve grows every array apply fills (created sequences included); apply takes the state
 * slots of created sequences, allocates the blocks and writes each segment's entry table. Nothing
 * in apply can fail.
 */
int dsv4__st_c_admit(const dsv4_seqtable_t *st, uint32_t layer, uint32_t n, dsv4_plan_t *plan);
int dsv4__st_c_reserve(dsv4_seqtable_t *st, uint32_t layer, uint32_t n, dsv4_plan_t *plan);
void dsv4__st_c_apply(dsv4_seqtable_t *st, uint32_t layer, uint32_t n, dsv4_plan_t *plan);
/* A live sequence leaves: its entry blocks and its state slot return to their pools. */
void dsv4__st_c_release(dsv4_seqtable_t *st, seq_t *s);
/* The arrays of an entry (live or not) that is freed. */
void dsv4__st_c_free_arrays(seq_t *s);
void dsv4__st_c_destroy(dsv4_seqtable_t *st);
/*
 * The compressed branch's steps of dsv4_seqtable_insert_c: insert_ok checks c (first blocks where
 * the plan path puts them, ids used in their pools; no block without the branch); reserve_insert
 * sizes the new entry's arrays (before the first change); apply_insert takes a free state slot and
 * copies the blocks. Nothing in apply_insert can fail.
 */
/* Copy a live sequence's slot and entry blocks (dsv4_seqtable_centries). */
int dsv4__st_c_copy(const dsv4_seqtable_t *st, const seq_t *s, dsv4_seq_centries_t *out);
/* The slot a restore of a sequence writes (dsv4_seqtable_c_next_slot). */
int dsv4__st_c_next_slot(const dsv4_seqtable_t *st, const seq_t *live, uint32_t *slot, int *taken);
/* c->slot is free, or the slot of the sequence the insert replaces (NULL: none). */
int dsv4__st_c_slot_ok(const dsv4_seqtable_t *st, const dsv4_seq_centries_t *c,
                       const seq_t *replaced);
int dsv4__st_c_insert_ok(const dsv4_seqtable_t *st, int64_t p0, const dsv4_seq_centries_t *c);
int dsv4__st_c_reserve_insert(seq_t *s, const dsv4_seq_centries_t *c);
void dsv4__st_c_apply_insert(dsv4_seqtable_t *st, seq_t *s, int64_t p0,
                             const dsv4_seq_centries_t *c);

#endif /* DSV4_KVCACHE_SEQTABLE_INTERNAL_H */
