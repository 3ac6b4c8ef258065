#ifndef DSV4_SERVER_ENGINE_INTERNAL_H
#define DSV4_SERVER_ENGINE_INTERNAL_H

/*
 * The engine's state, shared by engine.c (the forward path) and the engine's other files (admin
 * reads of the cache). Executor thread only, like the engine itself.
 */

#include <stdatomic.h>

#include "engine.h"
#include "engine_restore.h"
#include "pool.h"
#include "records.h"

/*
 * The per-batch scratch of the forward path that a batch still reads after its plan. A batch run in
 * chunks swaps these fields of the engine with a spare set around its yield hook, so that the
 * batches run between its chunks get scratch of their own and leave its positions, segment arrays
 * and plan alone. A new per-batch array that a batch reads after its plan belongs in this set too.
 */
typedef struct {
  int64_t *positions;
  int32_t *tok_seg;
  uint32_t tok_cap;
  int64_t *seg_first_lb;
  uint32_t *seg_bt_off, *seg_bt_len;
  int64_t *seg_p0;
  uint32_t seg_cap;
  dsv4_plan_t plan;
  /* The compressed branch's (engine_compress.c). */
  uint32_t *seg_slot, *seg_cbt_off, *seg_cbt_len;
  int64_t *seg_c_first_lb;
  uint32_t c_seg_cap;
  int32_t *sel;
  size_t sel_cap;
} dsv4__engine_scratch_t;

/* The addresses the compressed branch's launches of one chunk of a batch read and write, on a
 * staged backend (engine_compress.c): device copies. */
typedef struct {
  const int64_t *positions;
  const int32_t *tok_seg;
  const int64_t *seg_p0;
  const uint32_t *seg_slot, *seg_cbt_off, *seg_cbt_len;
  const int64_t *seg_c_first_lb;
  const int32_t *c_block_table;
  const float *ckv, *ikv, *iw;
  const uint16_t *iq;
  int32_t *sel;         /* the indexer's selection */
  const float *w_store; /* the device copy of c_w_store */
} dsv4__engine_c_view_t;

/* A batch in flight (dsv4_engine_forward_begin on a DSV4_BE_OVERLAP backend): its backend ticket
 * and when its submission ended (the commit's time). */
typedef struct {
  dsv4_forward_t *f;
  uint64_t ticket;
  uint64_t submitted_ns;
  int half; /* the staging half it uses */
} dsv4__engine_flight_t;

struct dsv4_engine {
  dsv4_backend_t *be;
  dsv4_engine_params_t p;
  uint64_t stride;
  int32_t *layer_index;     /* [model->n_layers_total]: served index or -1 */
  dsv4_devbuf_t *cache;     /* [n_served] */
  dsv4_rope_table_t **rope; /* [n_served], pointing at plain or compress */
  dsv4_rope_table_t *rope_plain;
  dsv4_rope_table_t *rope_compress;
  float *kv_norm; /* [n_served][512] copy, or NULL */
  float *sinks;   /* [n_served][heads] attention sinks, or NULL (no checkpoint) */
  dsv4_pool_t pool;
  dsv4_seqtable_t *st;
  dsv4_plan_t plan;
  dsv4_records_digest_t *digest;
  /* Per-batch scratch, grown on demand. */
  int64_t *positions;
  int32_t *tok_seg;
  uint32_t tok_cap;
  int64_t *seg_first_lb;
  uint32_t *seg_bt_off, *seg_bt_len;
  int64_t *seg_p0;
  uint32_t seg_cap;
  /* Device copies of the batch's inputs and outputs for a backend without DSV4_BE_HOST_MEMORY
   * (engine.c), or NULL when jobs point straight at host memory. */
  struct dsv4__engine_stage *stage;
  /* The spare scratch: the set a chunked batch parks its own in while it yields (engine.c), and
   * where the older of two batches in flight keeps its own. */
  dsv4__engine_scratch_t spare;
  /* The batches in flight: fly[0] with its scratch in the engine's fields, fly[1] (the older, when
   * two are) with its scratch in spare; f NULL = none. */
  dsv4__engine_flight_t fly[2];
  atomic_int healthy;
  /* A decode batch began since the last chunked batch did (forward_chunks): its ranges are then
   * prefill_chunk_tokens, not prefill_chunk_tokens_alone. The thread that holds the engine (the
   * executor's, or the loop's for a lone client's decode) reads and writes it. */
  int decode_seen;
  /* The compressed branch (engine_compress.c). */
  uint32_t *c_ratio;             /* [n_served]: 4 or 128 where the branch runs, else 0 */
  dsv4_engine_compressor_t *c_w; /* [n_served] copies of the weights (NULL members: none) */
  float *c_w_store;              /* the floats c_w points into */
  dsv4_devbuf_t *ring;           /* [n_served] compressor rings (max_sequences slots) */
  dsv4_devbuf_t *c_cache;        /* [n_served] entry records */
  dsv4_devbuf_t *i_cache;        /* [n_served] index records (ratio 4) */
  dsv4_pool_t cpool[2];          /* c4, c128 entry block ids */
  /* Per batch (swapped with the spare set, like the fields of dsv4__engine_scratch_t). */
  uint32_t *seg_slot, *seg_cbt_off, *seg_cbt_len;
  int64_t *seg_c_first_lb;
  uint32_t c_seg_cap;
  int32_t *sel; /* [tokens, index_topk] the selection when the caller asked none */
  size_t sel_cap;
  /* On a backend without DSV4_BE_HOST_MEMORY: the branch's staged copies (engine_compress.c). */
  struct dsv4__engine_cstage *cstage;
};

/*
 * Copy n bytes at offset off of served layer idx's cache into dst, whatever memory the backend
 * keeps the cache in. Executor thread only, between batches.
 */
/* Attention (engine_attn.c): copy the sinks at create; the launch arguments of a batch whose
 * map_slots arguments are ma (host or device addresses alike; q, out and lse are then re-pointed by
 * a staged backend). */
int dsv4__engine_attn_setup(dsv4_engine_t *e, char *why, size_t why_len);
void dsv4__engine_attn_args(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f,
                            const dsv4_map_args_t *ma, dsv4_attn_args_t *aa);

/*
 * A batch's range checks and replay hashes (engine_check.c), as the validation runs them. take: the
 * batch's state, given (f->check) when it was begun for these segments and this shape and never
 * taken before, else a new one kept in *own for the caller to free (NULL: no memory). bad: 1 when
 * the arrival met a value out of range, its tensor's name in *tensor. seg_feed: segment s's next
 * values, at most *budget bytes (data: the batch's tensors in the check's order); once all of its
 * rows are in, or on a value out of range (1, its tensor's name in *bad), the segment is finished,
 * and when all went in its digest is in *digest. Segments may be fed on several threads at once.
 */
dsv4_check_t *dsv4__check_take(dsv4_check_t *given, const dsv4_check_shape_t *sh,
                               const dsv4_forward_t *f, dsv4_check_t **own);
int dsv4__check_bad(const dsv4_check_t *c, const char **tensor);
int dsv4__check_all_fed(const dsv4_check_t *c); /* every segment's rows are in */
int dsv4__check_seg_finished(const dsv4_check_t *c, uint32_t s);
int dsv4__check_seg_feed(dsv4_check_t *c, uint32_t s, const void *const *data, size_t *budget,
                         uint64_t *digest, const char **bad);

/*
 * The compressed branch (engine_compress.c): set-up and teardown; per batch (its tensors' range
 * checks and replay hashes are engine_check.c's), the RoPE rows its emissions use, the plan's
 * per-segment arrays, the compress and indexer launches after the insert, the union arguments of
 * the attention, and the forward digest's entries.
 */
int dsv4__engine_c_setup(dsv4_engine_t *e, char *why, size_t why_len);
void dsv4__engine_c_destroy(dsv4_engine_t *e);
int dsv4__engine_c_prepare(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f);
void dsv4__engine_c_plan(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f);
/* The view of tokens t0.. of a batch run in chunks: the branch's tensors of v (a copy of f whose
 * other fields are already the view's) point at those tokens. */
void dsv4__engine_c_view(const dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f, uint32_t t0,
                         dsv4_forward_t *v);
/* The launches of tokens t0 .. t0 + f->n_tokens - 1 of the batch (f is the batch or a view of those
 * tokens, its tensors pointing at them). */
int dsv4__engine_c_compress(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f, uint32_t t0);
int dsv4__engine_c_index(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f, uint32_t t0,
                         int attend);
void dsv4__engine_c_attn_args(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f,
                              dsv4_attn_args_t *aa);
int dsv4__engine_c_digest(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f);
/*
 * On a staged backend (engine.c's stage_run), for each chunk of a batch before its launches:
 * upload the branch's inputs of the chunk f (its tensors, the per-segment arrays and the entry
 * table) and point the branch's next launches at the copies, given the device addresses of the
 * chunk's positions and segments and of the p0 that engine.c uploaded; after the launches,
 * download the chunk's selection into f->topk when it was asked. Both do nothing on a layer
 * without the branch.
 */
int dsv4__engine_c_stage_put(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f,
                             const int64_t *positions, const int32_t *tok_seg,
                             const int64_t *seg_p0);
int dsv4__engine_c_stage_get(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f);

int dsv4__engine_cache_read(dsv4_engine_t *e, uint32_t idx, uint64_t off, size_t n, void *dst);
/*
 * A restore's compressed state (engine_cstate.c): check that r->cstate is the state of exactly the
 * layers that run the branch, for r's p0 and next, and set c's first blocks and the blocks each
 * pool needs (c->n; no id yet); then write it into c's blocks and slot.
 */
int dsv4__engine_cstate_check(const dsv4_engine_t *e, const dsv4_engine_restore_t *r,
                              dsv4_seq_centries_t *c, char *why, size_t why_len);
int dsv4__engine_cstate_write(dsv4_engine_t *e, const dsv4_engine_restore_t *r,
                              const dsv4_seq_centries_t *c);
/* Bytes [off, off + n) of any engine buffer, whatever memory holds it (engine_cstate.c). */
int dsv4__engine_buf_read(dsv4_engine_t *e, const dsv4_devbuf_t *buf, uint64_t off, size_t n,
                          void *dst);
int dsv4__engine_buf_write(dsv4_engine_t *e, const dsv4_devbuf_t *buf, uint64_t off,
                           const void *src, size_t n);

#endif /* DSV4_SERVER_ENGINE_INTERNAL_H */
