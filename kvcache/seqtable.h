#ifndef DSV4_KVCACHE_SEQTABLE_H
#define DSV4_KVCACHE_SEQTABLE_H

/*
 * The sequence table and SWA slot mapper (SPEC §4).
 *
 * A batch for one layer goes through plan -> (device work) -> commit:
 *  - dsv4_seqtable_plan validates every segment against the table (unknown/expired/existing
 * sequence, duplicate sequence, position continuity, replay detection) and then, all or nothing,
 * creates new sequences and allocates the blocks the batch writes. On any error nothing has
 * changed.
 *  - dsv4_seqtable_commit, called once the batch has completed on the device, advances the layer's
 *    positions, remembers each segment for replay detection and releases the blocks no served layer
 * can reach any more (SPEC §4 release rule).
 *  - dsv4_seqtable_fail, called instead when the device failed, drops every sequence of the batch.
 * Between plan and commit/fail no other batch may be planned, with two exceptions: while a prefill
 * runs in chunks (its plan open), one batch at a time may be planned, run and committed between two
 * chunks; and while a batch is in flight (an overlapped batch, its plan open), the next one may be
 * planned before the first is committed or failed (each plan in its own dsv4_plan_t, committed in
 * the order planned). Either way the second names none of the open plan's sequences (the executor
 * never lets a batch pass one that names the same sequence). Nothing else (delete, the expiry
 * sweep) runs with a plan open.
 *
 * Layers here are served-layer indices 0..n_layers-1; the server maps them to model layer numbers.
 * Thread affinity: the executor thread only.
 */

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

#define DSV4_SEQ_NAME_MAX 128

typedef struct dsv4_seqtable dsv4_seqtable_t;

typedef struct {
  uint32_t n_layers;        /* served layers */
  uint32_t block_size;      /* power of two, 16..256 */
  int64_t max_position;     /* positions must be < this */
  uint32_t max_sequences;   /* live sequences at most; 0 = no limit */
  int implicit_create;      /* accept unknown sequences without "new" */
  uint64_t idle_timeout_ns; /* sequences idle this long are deleted; 0 = never */
} dsv4_seqtable_config_t;

/* One segment of a batch as the gateway sent it. */
typedef struct {
  const char *name; /* not NUL-terminated */
  uint32_t name_len;
  int64_t start;
  uint32_t len;
  int is_new;
  uint64_t hash; /* XXH3 of the segment's q bytes then kv bytes, for replay detection */
} dsv4_seg_req_t;

/*
 * Where one segment's tokens go: block_table[bt_off + (pos / bs - first_lb)] holds position pos.
 * The map covers the segment's attention window too: every position from max(p0, start - 127) to
 * start + len - 1, so first_lb = max(p0, start - 127) / bs.
 */
typedef struct {
  int64_t first_lb;
  uint32_t bt_off;
  uint32_t bt_len;
  int64_t p0; /* the sequence's first position: attention never reads below it */
  /* On a layer of the compressed branch (SPEC §8.7): the sequence's state slot, and its entry
   * blocks: entry j is in c_block_table[c_bt_off + (j / bs - c_first_lb)], the whole table of the
   * sequence in the layer's pool (every entry it has emitted at any layer of that pool, and those
   * this batch emits). */
  uint32_t slot;
  int64_t c_first_lb;
  uint32_t c_bt_off;
  uint32_t c_bt_len;
} dsv4_seg_map_t;

/* Details of a refused plan, for the caller to report with the error code. */
typedef struct {
  uint32_t segment; /* index of the offending segment */
  int64_t expected; /* EPOSITION/EEXIST: the expected next position at this layer */
  uint32_t needed;  /* ENOSPC: blocks the batch needs */
  uint32_t free;    /* ENOSPC: free blocks */
  /* ENOSPC because of max_sequences rather than the pool: sequences_full = 1, and the batch would
   * create new_sequences while only free_sequences more may live (needed/free stay 0). */
  int sequences_full;
  uint32_t new_sequences;
  uint32_t free_sequences;
  const char *pool; /* ENOSPC of a block pool: "swa", "c4" or "c128" */
} dsv4_plan_error_t;

typedef struct {
  uint32_t layer;
  uint32_t n_segments;
  int replay;           /* every segment is a replay: compute outputs, write nothing */
  dsv4_seg_map_t *segs; /* [n_segments] */
  int32_t *block_table; /* [bt_len] physical block ids */
  uint32_t bt_len;
  int32_t *c_block_table; /* [c_bt_len] entry block ids of the compressed branch's layers */
  uint32_t c_bt_len;
  dsv4_plan_error_t error;
  /* Private to the table. */
  void *priv;
  uint32_t priv_cap, segs_cap, bt_cap, c_bt_cap;
} dsv4_plan_t;

/* Snapshot of one sequence, for GET /v1/sequences/{seq} and the admin plane. */
typedef struct {
  int64_t p0;
  int64_t *next;       /* [n_layers] next position per layer */
  int64_t *last_start; /* [n_layers] first position of the last applied segment (p0 if none) */
  int64_t first_lb;    /* logical block of blocks[0] */
  int32_t *blocks;     /* [n_blocks_held] physical ids, -1 for a hole */
  uint32_t n_blocks_held;
  uint32_t holding_layer; /* the layer whose window keeps the oldest held block (lowest on ties) */
  uint64_t last_used_ns;
} dsv4_seq_info_t;

int dsv4_seqtable_create(const dsv4_seqtable_config_t *cfg, dsv4_pool_t *pool,
                         dsv4_seqtable_t **out);
void dsv4_seqtable_destroy(dsv4_seqtable_t *st);
/* The configuration the table was created with. */
const dsv4_seqtable_config_t *dsv4_seqtable_config(const dsv4_seqtable_t *st);

/*
 * Attach the compressed branch (SPEC §8.7) before the first plan: ratio[l] (copied) is 4 or 128
 * for a served layer whose branch runs, else 0; c4 and c128 are the entry block pools of those
 * ratios (NULL when no layer has it). Every live sequence then holds one of max_sequences state
 * slots (max_sequences must be non-zero), and its entry blocks in each pool, which are freed only
 * with the sequence. DSV4_EINVAL or DSV4_ENOMEM.
 */
int dsv4_seqtable_attach_compressed(dsv4_seqtable_t *st, const uint32_t *ratio, dsv4_pool_t *c4,
                                    dsv4_pool_t *c128);

void dsv4_plan_init(dsv4_plan_t *plan);
void dsv4_plan_free(dsv4_plan_t *plan);

/*
 * Validate and reserve one batch for layer. Returns 0, or DSV4_ELAYER (layer >= n_layers),
 * DSV4_EINVAL (no segment, bad name, len 0), DSV4_EPOSRANGE, DSV4_EDUPSEQ, DSV4_ENOSEQ,
 * DSV4_EEXPIRED, DSV4_EEXIST, DSV4_EPOSITION, DSV4_ENOSPC (pool, or max_sequences: see
 * dsv4_plan_error_t), DSV4_ENOMEM, with plan->error filled. On error the table and the pool are
 * unchanged. Checks run in this order: each segment alone and duplicates (first offending segment);
 * then, unless every segment is a replay, sequence state and continuity (first offending segment);
 * then capacity.
 */
int dsv4_seqtable_plan(dsv4_seqtable_t *st, uint32_t layer, const dsv4_seg_req_t *segs, uint32_t n,
                       uint64_t now_ns, dsv4_plan_t *plan);
void dsv4_seqtable_commit(dsv4_seqtable_t *st, dsv4_plan_t *plan, uint64_t now_ns);
void dsv4_seqtable_fail(dsv4_seqtable_t *st, dsv4_plan_t *plan);

/*
 * Delete a sequence and free all its blocks; *existed says whether it was live. Deleting an expired
 * name forgets it (it answers unknown afterwards). DSV4_EINVAL for an invalid name. Not between
 * plan and commit/fail (neither is expire).
 */
int dsv4_seqtable_delete(dsv4_seqtable_t *st, const char *name, uint32_t name_len, int *existed);
/*
 * Delete sequences idle past the timeout; forget expired names one period after they expired.
 * Returns the number of live sequences that expired.
 */
uint32_t dsv4_seqtable_expire(dsv4_seqtable_t *st, uint64_t now_ns);
/*
 * The same for the sequences a batch names only, so that a batch is told what a sweep at now_ns
 * would tell it however long ago the last sweep ran (the engine calls it before planning). O(n).
 * Also with a plan open, for a batch between its chunks (which names none of its sequences).
 */
uint32_t dsv4_seqtable_expire_named(dsv4_seqtable_t *st, const dsv4_seg_req_t *segs, uint32_t n,
                                    uint64_t now_ns);

/* Copy one sequence's state; DSV4_ENOSEQ / DSV4_EEXPIRED when not live. Free with _info_free. */
int dsv4_seqtable_info(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                       dsv4_seq_info_t *out);
void dsv4_seq_info_free(dsv4_seq_info_t *info);

/* Visit every live sequence (in no particular order); stop early when fn returns non-zero, which is
 * then returned. fn must not change the table. */
typedef int (*dsv4_seq_visit_fn)(const char *name, uint32_t name_len, const dsv4_seq_info_t *info,
                                 void *arg);
int dsv4_seqtable_foreach(const dsv4_seqtable_t *st, dsv4_seq_visit_fn fn, void *arg);

/* ---- restore (SPEC §6 PUT /admin/v1/sequences/{seq}): a sequence with given state ---------- */

/* One served layer's state as a batch leaves it: what continuity, replay detection and the release
 * rule of SPEC §4 read. */
typedef struct {
  int64_t next;       /* next position the layer writes (p0 before any segment) */
  int64_t last_start; /* first position of the last applied segment (p0 before any) */
  uint32_t last_len;  /* length of that segment; 0 before any */
  uint64_t last_hash; /* its replay hash (dsv4_seg_req_t.hash) */
} dsv4_seq_layer_state_t;

/* A sequence's state without its blocks. */
typedef struct {
  int64_t p0;
  dsv4_seq_layer_state_t *layers; /* [n_layers], the caller's memory */
} dsv4_seq_state_t;

/* Copy a live sequence's state into out (out->layers must hold n_layers entries); DSV4_ENOSEQ /
 * DSV4_EEXPIRED when it is not live. */
int dsv4_seqtable_state(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                        dsv4_seq_state_t *out);

/*
 * The first position of the window blocks of a state (SPEC §4 release rule): the lowest
 * max(p0, last_start - 127) over the layers. A table holding the state keeps every block from
 * low / block_size on. DSV4_EINVAL when the state is inconsistent: p0 outside 0..max_position, a
 * layer without a segment whose next or last_start is not p0, a segment that starts below p0 or
 * whose start + len is not next, or a next beyond max_position.
 */
int dsv4_seqtable_state_low(const dsv4_seqtable_config_t *cfg, const dsv4_seq_state_t *state,
                            int64_t *low);

/*
 * Insert a sequence with the given state and blocks: block ids blocks[0..n_blocks) hold logical
 * blocks first_lb .. first_lb + n_blocks - 1, already taken from the table's pool by the caller
 * (and already written). Apart from the plan path: it is how a sequence comes back from a dump.
 * The blocks must cover the state: p0 / bs <= first_lb <= low / bs (dsv4_seqtable_state_low), and
 * first_lb + n_blocks is the block after the highest next - 1 (n_blocks 0 when no layer was
 * written and first_lb = p0 / bs). The sequence is idle from now_ns.
 *
 * Returns 0 (the table owns the blocks), DSV4_EINVAL (bad name, inconsistent state or blocks),
 * DSV4_EEXIST (a live sequence of that name and replace 0), DSV4_ENOSPC (max_sequences reached,
 * err->sequences_full set), DSV4_ENOMEM. On error nothing changed and the caller still owns the
 * blocks. With replace, a live sequence of the name is dropped first (its blocks freed, deferred
 * while pinned); an expired name is replaced either way. Not between plan and commit/fail.
 */
int dsv4_seqtable_insert(dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                         const dsv4_seq_state_t *state, int64_t first_lb, const int32_t *blocks,
                         uint32_t n_blocks, int replace, uint64_t now_ns, dsv4_plan_error_t *err);

/*
 * A sequence's compressed state at one served layer (SPEC §8.7, §8.9): the entries it emitted, j in
 * [j0, j1) = [floor(p0 / ratio), floor(next / ratio)), as 584-byte records and at ratio 4 their
 * 68-byte index records, and its state slot's ring (DSV4_RING_FLOATS(ratio) floats as stored).
 * ratio 0: the layer does not run the branch and nothing else is set.
 */
typedef struct {
  uint32_t ratio;
  int64_t j0, j1;
  const uint8_t *c_records; /* [(j1 - j0) * 584] */
  const uint8_t *i_records; /* ratio 4: [(j1 - j0) * 68]; else NULL */
  const float *ring;        /* [DSV4_RING_FLOATS(ratio)] */
} dsv4_seq_cstate_t;

/*
 * A sequence's compressed-branch holdings (SPEC §8.7): its state slot and, per compressed pool (0:
 * c4, 1: c128), its entry blocks: entry j of a layer of the pool lives in ids[k][j / bs -
 * first_lb[k]].
 */
typedef struct {
  uint32_t slot;
  int64_t first_lb[2];
  uint32_t n[2];
  int32_t *ids[2];
} dsv4_seq_centries_t;

/* A live sequence's holdings (ids malloc'd: dsv4_seq_centries_free), for a dump. DSV4_ENOSEQ,
 * DSV4_EEXPIRED, DSV4_EINVAL (the branch is not attached) or DSV4_ENOMEM. */
int dsv4_seqtable_centries(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                           dsv4_seq_centries_t *out);
void dsv4_seq_centries_free(dsv4_seq_centries_t *c);

/* The state slot a restore of name writes its rings into (then passes as c->slot): the next free
 * one, or when none is free the slot of the live sequence of that name, which a replace gives
 * back (*taken = 1: the caller must drop that sequence before writing). DSV4_EINVAL without the
 * branch, DSV4_ENOSPC when no slot can be had. */
int dsv4_seqtable_c_next_slot(const dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                              uint32_t *slot, int *taken);

/*
 * dsv4_seqtable_insert for a table with the compressed branch attached: c names the state slot
 * (free, or the replaced sequence's) and the entry blocks the caller took from each compressed pool
 * (and wrote), whose first_lb must be the one the plan path gives a sequence starting at p0 (p0 /
 * ratio / bs). c may be NULL (no entry blocks; the next free slot). Without the branch, c must be
 * NULL or hold no block. Same returns; on error nothing changed and the caller still owns every
 * block.
 */
int dsv4_seqtable_insert_c(dsv4_seqtable_t *st, const char *name, uint32_t name_len,
                           const dsv4_seq_state_t *state, int64_t first_lb, const int32_t *blocks,
                           uint32_t n_blocks, const dsv4_seq_centries_t *c, int replace,
                           uint64_t now_ns, dsv4_plan_error_t *err);

uint32_t dsv4_seqtable_count(const dsv4_seqtable_t *st);
/* Any thread: the last published live-sequence count. */
uint32_t dsv4_seqtable_count_relaxed(const dsv4_seqtable_t *st);

/* 1 when name is a valid sequence name: 1..128 bytes of [A-Za-z0-9._:-], not starting with '.'. */
int dsv4_seq_name_valid(const char *name, size_t len);

#endif /* DSV4_KVCACHE_SEQTABLE_H */
