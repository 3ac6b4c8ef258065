#include "engine.h"
#include "engine-internal.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>
#if defined(__x86_64__)
/* libxxhash's run-time dispatch picks its AVX2/AVX-512 XXH3 loop (2.5x the SSE2 one here). */
#include <xxh_x86dispatch.h>
#endif

#include "dsv4-layout.h"
#include "dsv4-numerics.h"
#include "host_flush.h"
#include "pool.h"
#include "records.h"

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int make_rope(const dsv4_rope_params_t *rp, int64_t max_pos, dsv4_rope_table_t **out) {
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(rp, inv_freq);
  return dsv4_rope_table_create(inv_freq, max_pos, out);
}

/*
 * Device staging, for a backend whose memory the host cannot address (no DSV4_BE_HOST_MEMORY): the
 * batch's inputs are uploaded into device buffers, the launches are pointed at those, and the
 * outputs (q_out, except on the fused decode path, the slots, attn and lse) are downloaded into the
 * caller's host buffers.
 *
 * One buffer per argument, reused from batch to batch and grown on demand, except that the
 * positions and the slot mapper's five small arrays share one (ST_META): assembled on the host and
 * uploaded in one copy, they cost a batch one upload instead of six, and the producer reads one
 * allocation instead of six.
 *
 * Two sets (halves) of these buffers, the batches alternating between them. A batch that overlaps
 * (dsv4_engine_forward_begin on a DSV4_BE_OVERLAP backend) is submitted while the one before may
 * still run: its uploads may land while that batch's launches read their inputs, and its launches
 * may write before that batch's downloads read their outputs, so the two must not share a set.
 * Batch k + 2 begins only after batch k has ended (its downloads waited for), so two sets suffice.
 * A batch that does not overlap runs alone and syncs before it returns, so any set would do.
 *
 * In place where the backend maps host memory (backend.h, host_alias: the page-locked pool of
 * bodies and answers, a shared region): the insert reads q and kv where the caller holds them and
 * writes q_out into the caller's buffer, and those copies are skipped (stage_put, stage_out,
 * stage_get). Each batch's host buffers are its own, so the two sets' rule does not concern them.
 * The packed metadata too, in a batch that neither attends nor runs the compressed branch: each
 * half's host copy is registered with the backend (meta_reserve), and the producer and the insert
 * read it where the engine assembled it, one upload fewer on a decode's path (the half's rule
 * applies to it as to the device buffers). The slots: the producer writes them into the caller's
 * buffer.
 */
enum { ST_Q, ST_KV, ST_Q_OUT, ST_META, ST_SLOTS, ST_ATTN, ST_LSE, ST_COUNT };

/* The arrays packed in ST_META, in this order, each from a META_ALIGN-byte boundary. */
enum {
  M_POSITIONS,
  M_TOK_SEG,
  M_SEG_FIRST_LB,
  M_SEG_BT_OFF,
  M_SEG_BT_LEN,
  M_BLOCK_TABLE,
  M_SEG_P0,
  M_WIN,
  M_COUNT
};
#define META_ALIGN 16
/* The smallest staging buffer allocated: tiny batches do not each grow it by a few bytes. */
#define STAGE_MIN_BYTES 256

/* The sizes and offsets of the packed arrays for n tokens, nseg segments and bt table entries,
 * with the tokens' windows (dsv4_attn_win_t) when win; returns the total. */
static size_t meta_layout(size_t n, size_t nseg, size_t bt, int win, size_t bytes[M_COUNT],
                          size_t off[M_COUNT]) {
  bytes[M_POSITIONS] = n * sizeof(int64_t);
  bytes[M_TOK_SEG] = n * sizeof(int32_t);
  bytes[M_SEG_FIRST_LB] = nseg * sizeof(int64_t);
  bytes[M_SEG_BT_OFF] = nseg * sizeof(uint32_t);
  bytes[M_SEG_BT_LEN] = nseg * sizeof(uint32_t);
  bytes[M_BLOCK_TABLE] = bt * sizeof(int32_t);
  bytes[M_SEG_P0] = nseg * sizeof(int64_t);
  bytes[M_WIN] = win ? n * sizeof(dsv4_attn_win_t) : 0;
  size_t total = 0;
  for (int i = 0; i < M_COUNT; i++) {
    off[i] = total;
    total += (bytes[i] + META_ALIGN - 1) & ~(size_t)(META_ALIGN - 1);
  }
  return total;
}

typedef struct {
  dsv4_devbuf_t buf[ST_COUNT];
  uint8_t *meta; /* host: ST_META's bytes, assembled before the upload (or read in place) */
  size_t meta_cap;
  int meta_reg; /* meta is registered with the backend (meta_reserve) */
} stage_half_t;

struct dsv4__engine_stage {
  stage_half_t half[2];
  int cur;               /* the half of the batch being begun */
  dsv4_devbuf_t kv_norm; /* [n_served][512] fp32, uploaded once; size 0 for prenormed */
  dsv4_devbuf_t sinks;   /* [n_served][heads] fp32, uploaded once; size 0 without a checkpoint */
  uint8_t *span;         /* host copy of up to one block, for the forward digest */
  /* The batch being begun launched its q half before its validation (q_early_launch): its insert
   * then writes the KV rows only, and its q_out is in buf[ST_Q_OUT] of the current half. */
  int q_early;
  /* ... in launches of q_piece_tokens tokens (the last one as many or fewer), launch i followed
   * by the backend's mark i when there are more than one (stage_get_q). */
  uint32_t q_piece_tokens;
};

/* Free a half's host metadata, unregistered first. Its batch has ended (synced or waited for). */
static void meta_free(dsv4_engine_t *e, stage_half_t *h) {
  if (h->meta_reg)
    e->be->ops->host_unregister(e->be, h->meta);
  free(h->meta);
  h->meta = NULL;
  h->meta_cap = 0;
  h->meta_reg = 0;
}

/* A half's host metadata of at least bytes, zeroed: the padding between the arrays is read too and
 * never holds uninitialised memory (later batches leave their own bytes there). Whole pages,
 * registered where the backend maps host memory for its launches (host_alias), so that they read
 * it in place; without that it is uploaded as any input. Growth doubles. */
static int meta_reserve(dsv4_engine_t *e, stage_half_t *h, size_t bytes) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  const size_t page = 4096;
  if (bytes <= h->meta_cap)
    return 0;
  size_t want = h->meta_cap * 2 > bytes ? h->meta_cap * 2 : bytes;
  want = (want + page - 1) & ~(page - 1);
  uint8_t *m = aligned_alloc(page, want);
  if (!m)
    return DSV4_ENOMEM;
  memset(m, 0, want);
  meta_free(e, h);
  h->meta = m;
  h->meta_cap = want;
  h->meta_reg = ops->host_alias && ops->host_register && ops->host_unregister &&
                ops->host_register(e->be, m, want) == 0;
  return 0;
}

static void stage_destroy(dsv4_engine_t *e) {
  struct dsv4__engine_stage *s = e->stage;
  if (!s)
    return;
  for (int h = 0; h < 2; h++) {
    for (int i = 0; i < ST_COUNT; i++)
      if (s->half[h].buf[i].ptr)
        e->be->ops->buf_free(e->be, &s->half[h].buf[i]);
    meta_free(e, &s->half[h]);
  }
  if (s->kv_norm.ptr)
    e->be->ops->buf_free(e->be, &s->kv_norm);
  if (s->sinks.ptr)
    e->be->ops->buf_free(e->be, &s->sinks);
  free(s->span);
  free(s);
  e->stage = NULL;
}

static int stage_create(dsv4_engine_t *e) {
  struct dsv4__engine_stage *s = calloc(1, sizeof(*s));
  int rc = 0;
  if (!s)
    return DSV4_ENOMEM;
  e->stage = s;
  s->span = malloc(e->stride);
  if (!s->span)
    return DSV4_ENOMEM;
  if (e->kv_norm) {
    size_t bytes = (size_t)e->p.n_served * DSV4_HEAD_DIM * sizeof(float);
    rc = e->be->ops->buf_alloc(e->be, bytes, &s->kv_norm);
    if (!rc)
      rc = e->be->ops->upload(e->be, &s->kv_norm, 0, e->kv_norm, bytes);
    if (!rc)
      rc = e->be->ops->sync(e->be);
  }
  if (!rc && e->sinks) {
    size_t bytes = (size_t)e->p.n_served * e->p.heads * sizeof(float);
    rc = e->be->ops->buf_alloc(e->be, bytes, &s->sinks);
    if (!rc)
      rc = e->be->ops->upload(e->be, &s->sinks, 0, e->sinks, bytes);
    if (!rc)
      rc = e->be->ops->sync(e->be);
  }
  return rc;
}

/* The bytes of q (and of q_out) of n tokens: heads rows of 512 bf16 each. */
static size_t q_bytes_of(const dsv4_engine_t *e, size_t n) {
  return n * e->p.heads * DSV4_HEAD_DIM * sizeof(uint16_t);
}

/* The bytes of kv of n tokens: a row of 512 bf16 each. */
static size_t kv_bytes_of(size_t n) {
  return n * DSV4_HEAD_DIM * sizeof(uint16_t);
}

/* Make staging buffer i hold at least bytes; the old contents are not kept. Growth doubles, so a
 * daemon whose batches grow slowly reallocates only a few times. */
static int stage_reserve(dsv4_engine_t *e, int i, size_t bytes) {
  dsv4_devbuf_t *b = &e->stage->half[e->stage->cur].buf[i];
  size_t want;
  if (b->ptr && b->size >= bytes)
    return 0;
  want = b->size * 2 > bytes ? b->size * 2 : bytes;
  if (want < STAGE_MIN_BYTES)
    want = STAGE_MIN_BYTES;
  if (b->ptr)
    e->be->ops->buf_free(e->be, b);
  return e->be->ops->buf_alloc(e->be, want, b);
}

/*
 * Reserve every staging buffer of a batch before it is planned, so that a device allocation that
 * fails refuses the batch with nothing changed. The block table's size is known only after the
 * plan, so it is reserved for its bound: a segment maps the positions max(p0, start - 127) .. start
 * + len
 * - 1, at most (126 + len) / bs + 2 blocks.
 */
static int stage_reserve_batch(dsv4_engine_t *e, const dsv4_forward_t *f) {
  stage_half_t *st = &e->stage->half[e->stage->cur];
  size_t n = f->n_tokens, q_bytes = q_bytes_of(e, n);
  size_t bt = 0, bytes[M_COUNT], off[M_COUNT];
  for (uint32_t s = 0; s < f->n_segs; s++)
    bt += ((size_t)DSV4_WINDOW - 2 + f->segs[s].len) / e->p.block_size + 2;
  size_t meta = meta_layout(n, f->n_segs, bt, f->attn != NULL, bytes, off);
  int rc = meta_reserve(e, st, meta);
  if (!rc)
    rc = stage_reserve(e, ST_Q, q_bytes);
  if (!rc)
    rc = stage_reserve(e, ST_KV, kv_bytes_of(n));
  if (!rc)
    rc = stage_reserve(e, ST_Q_OUT, q_bytes);
  if (!rc)
    rc = stage_reserve(e, ST_META, meta);
  if (!rc)
    rc = stage_reserve(e, ST_SLOTS, n * sizeof(int64_t));
  if (!rc && f->attn)
    rc = stage_reserve(e, ST_ATTN, q_bytes);
  if (!rc && f->lse)
    rc = stage_reserve(e, ST_LSE, n * e->p.heads * sizeof(float));
  return rc;
}

/* The address at which the launches reach n bytes of host memory at p in place (backend.h,
 * host_alias), or NULL. */
static void *stage_alias(const dsv4_engine_t *e, const void *p, size_t n) {
  return e->be->ops->host_alias ? e->be->ops->host_alias(e->be, p, n) : NULL;
}

/* Whether a batch (or chunk) with q_bytes of q reads its q and kv and writes q_out in place where
 * the backend can (in_place_max_bytes). */
static int in_place_ok(const dsv4_engine_t *e, size_t q_bytes) {
  return !e->p.in_place_max_bytes || q_bytes <= e->p.in_place_max_bytes;
}

/* Host src as the launches' input: read in place where the backend aliases it and in_place says
 * so, else uploaded into staging buffer i; *dev receives the address the launches read. */
static int stage_put(dsv4_engine_t *e, int i, const void *src, size_t n, int in_place, void **dev) {
  dsv4_devbuf_t *b = &e->stage->half[e->stage->cur].buf[i];
  if (in_place && (*dev = stage_alias(e, src, n)) != NULL)
    return 0;
  if (n > b->size)
    return DSV4_EINVAL; /* stage_reserve_batch's bound was wrong: never launch past a buffer */
  *dev = b->ptr;
  return e->be->ops->upload(e->be, b, 0, src, n);
}

/*
 * SPEC §7's fused decode path: a batch of one-token segments that asks for attention but not for
 * q, on a backend that offers the path, inserts its KV rows only and lets the attention normalise
 * and rotate the raw q itself, so q_out never reaches device memory; every answered byte is the
 * unfused path's. A replay writes no KV rows and keeps the unfused path.
 */
static int fused_decode(const dsv4_engine_t *e, const dsv4_forward_t *f) {
  if (!(e->be->ops->caps & DSV4_BE_ATTN_FUSED_Q) || !f->attn || !f->q_unwanted || e->plan.replay)
    return 0;
  for (uint32_t s = 0; s < f->n_segs; s++)
    if (f->segs[s].len != 1)
      return 0;
  return 1;
}

/* The fused path's launches (fused_decode): the insert without q_out, the attention on raw q. */
static void fuse_args(dsv4_insert_args_t *ia, dsv4_attn_args_t *aa) {
  ia->q_out = NULL;
  aa->q = ia->q;
  aa->q_raw = 1;
  aa->eps = ia->eps;
}

/* Where the launches write output i (n bytes, for the caller's host dst): dst itself where the
 * backend aliases it, so that nothing is downloaded (stage_get skips it), else staging buffer i. */
static void *stage_out(dsv4_engine_t *e, int i, void *dst, size_t n) {
  void *a = dst ? stage_alias(e, dst, n) : NULL;
  return a ? a : e->stage->half[e->stage->cur].buf[i].ptr;
}

/* Download n bytes of staging buffer i into the caller's dst, completing by the next sync when the
 * backend can defer it (backend.h): dst is then not read before that sync. Nothing when the
 * launches wrote dst in place (dev, where they wrote, is not staging buffer i). */
static int stage_get(dsv4_engine_t *e, int i, const void *dev, void *dst, size_t n) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  if (dev != e->stage->half[e->stage->cur].buf[i].ptr)
    return 0;
  if (ops->download_async)
    return ops->download_async(e->be, dst, &e->stage->half[e->stage->cur].buf[i], 0, n);
  return ops->download(e->be, dst, &e->stage->half[e->stage->cur].buf[i], 0, n);
}

/* q_out's download (n bytes for the caller's dst from dev): after q_early_launch's launches in
 * pieces, each piece as soon as its own launch is done (marked downloads, backend.h), so that the
 * first pieces cross PCIe while the later ones are computed; else as stage_get. */
static int stage_get_q(dsv4_engine_t *e, const void *dev, void *dst, size_t n) {
  const struct dsv4__engine_stage *s = e->stage;
  const dsv4_devbuf_t *b = &s->half[s->cur].buf[ST_Q_OUT];
  const size_t piece = q_bytes_of(e, s->q_piece_tokens);
  if (!s->q_early || piece >= n || dev != b->ptr)
    return stage_get(e, ST_Q_OUT, dev, dst, n);
  int rc = 0;
  for (unsigned i = 0; i * piece < n && !rc; i++) {
    const size_t off = i * piece, len = n - off < piece ? n - off : piece;
    rc = e->be->ops->download_marked(e->be, i, (uint8_t *)dst + off, b, off, len);
  }
  return rc;
}

/* A phase of an overlapped batch (backend.h), or nothing for a batch that runs alone. */
static int stage_phase(dsv4_engine_t *e, const uint64_t *ticket, int phase, uint64_t *out) {
  return ticket ? e->be->ops->batch_phase(e->be, phase, out) : 0;
}

/* The batch's inputs into the current half: the packed metadata, q and kv; ma and ia are
 * re-pointed at the copies, and *m receives the device address of the packed metadata. fused: the
 * batch takes the fused decode path (fused_decode); meta_in_place: only the producer and the insert
 * read the packed metadata; win: the attention's arguments on the host's arrays when its windows
 * (backend.h, dsv4_attn_win_t) go at off[M_WIN], else NULL; *built: whether they were (not where
 * dsv4_attn_windows refuses them: the attention then walks the tables, and refuses there). */
static int stage_inputs(dsv4_engine_t *e, dsv4_forward_t *f, int fused, int meta_in_place,
                        const dsv4_attn_args_t *win, int *built, dsv4_map_args_t *ma,
                        dsv4_insert_args_t *ia, const uint8_t **m, size_t off[M_COUNT]) {
  stage_half_t *h = &e->stage->half[e->stage->cur];
  size_t n = f->n_tokens, q_bytes = q_bytes_of(e, n);
  void *d = NULL;
  /* The slot mapper's arrays and the positions, packed (see ST_META), in one upload. */
  size_t bytes[M_COUNT], meta = meta_layout(n, f->n_segs, e->plan.bt_len, win != NULL, bytes, off);
  const void *src[M_COUNT] = {ma->positions,  ma->tok_seg,     ma->seg_first_lb, ma->seg_bt_off,
                              ma->seg_bt_len, ma->block_table, e->seg_p0};
  if (meta > h->meta_cap)
    return DSV4_EINVAL; /* stage_reserve_batch's bound was wrong: never write past the buffer */
  /* The q half launched early reads the positions there already (q_early_launch). */
  for (int i = 0; i < M_COUNT; i++)
    if (bytes[i] && src[i] && !(i == M_POSITIONS && e->stage->q_early))
      memcpy(h->meta + off[i], src[i], bytes[i]);
  *built = win && dsv4_attn_windows(win, (dsv4_attn_win_t *)(h->meta + off[M_WIN])) == 0;
  /* Read in place by the producer and the insert (a few loads per thread, at once), but uploaded
   * when other launches read it too: the attention's CTAs walk the block tables and segments of
   * every token, which over PCIe made a 16-token decode with attention half again as slow
   * (tests/bench/NOTES.md, "The metadata and the slots in place"), and the compressed branch's
   * launches read the positions of every token. */
  int rc = stage_put(e, ST_META, h->meta, meta, meta_in_place, &d);
  if (rc)
    return rc;
  *m = d;
  ma->positions = ia->positions = (const int64_t *)(*m + off[M_POSITIONS]);
  ma->tok_seg = (const int32_t *)(*m + off[M_TOK_SEG]);
  ma->seg_first_lb = (const int64_t *)(*m + off[M_SEG_FIRST_LB]);
  ma->seg_bt_off = (const uint32_t *)(*m + off[M_SEG_BT_OFF]);
  ma->seg_bt_len = (const uint32_t *)(*m + off[M_SEG_BT_LEN]);
  ma->block_table = (const int32_t *)(*m + off[M_BLOCK_TABLE]);
  /* q and kv in place where the backend maps them (one read each, by the insert), except q on the
   * fused decode path: there every attention CTA of a token (its head groups and window splits)
   * reads its rows, which should not cross PCIe more than once. */
  const int place = in_place_ok(e, q_bytes);
  /* After the q half (q_early_launch) the insert writes the KV rows only and reads no q. */
  if (e->stage->q_early)
    d = h->buf[ST_Q].ptr;
  else
    rc = stage_put(e, ST_Q, f->q, q_bytes, !fused && place, &d);
  ia->q = d;
  if (!rc)
    rc = stage_put(e, ST_KV, f->kv, kv_bytes_of(n), place, &d);
  ia->kv = d;
  /* The slots in place too: the producer writes them where the caller reads them, the insert
   * reads them back from there (its KV rows only, beside their own reads over PCIe). */
  ma->slots = place ? stage_out(e, ST_SLOTS, f->slots, n * sizeof(int64_t)) : h->buf[ST_SLOTS].ptr;
  ia->slots = ma->slots;
  /* In place in the caller's buffer unless the attention reads it (over PCIe it would cost), or
   * the q half ran before the validation (q_early_launch: a refused batch writes nothing there). */
  ia->q_out = f->attn || e->stage->q_early || !place ? h->buf[ST_Q_OUT].ptr
                                                     : stage_out(e, ST_Q_OUT, f->q_out, q_bytes);
  return rc;
}

/* The batch's insert after its producer: the whole of it, or after q_early_launch its KV rows
 * only (none for a replay, which writes none), q_out staying where that launch wrote it. */
static int stage_insert(dsv4_engine_t *e, const dsv4_insert_args_t *ia) {
  if (!e->stage->q_early)
    return e->be->ops->qkv_insert(e->be, ia);
  if (!ia->write_kv)
    return 0;
  dsv4_insert_args_t kv = *ia;
  kv.q_out = NULL;
  return e->be->ops->qkv_insert(e->be, &kv);
}

/*
 * The device half of a batch (or of its chunk of tokens tok0..) on a staged backend: ma and ia
 * arrive pointing at host memory and are re-pointed at the staging buffers (the cache already lives
 * on the device). Order on the backend's queue: uploads, map_slots, qkv_insert, the compressed
 * branch's compress and indexer, attention, then the downloads, which complete by the sync.
 *
 * With ticket (an overlapped batch, on a DSV4_BE_OVERLAP backend) the same calls go in the
 * backend's batch phases and nothing is waited for: *ticket receives the batch's completion point,
 * and dsv4_engine_forward_end waits for it. A failure part way syncs, as a batch alone does, so
 * that nothing of the batch is still queued when the caller hears of it.
 */
static int stage_run(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f, uint32_t tok0,
                     dsv4_map_args_t *ma, dsv4_insert_args_t *ia, uint64_t *ticket) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  struct dsv4__engine_stage *s = e->stage;
  size_t n = f->n_tokens, q_bytes = q_bytes_of(e, n);
  uint64_t t0 = mono_ns(), t1, t2;
  size_t off[M_COUNT];
  const uint8_t *m = NULL;
  const int fused = fused_decode(e, f);
  const int meta_in_place = !f->attn && !(e->c_ratio && e->c_ratio[idx]) && in_place_ok(e, q_bytes);
  /* The windows for an SWA-only layer's attention (a union launch walks its tables anyway), from
   * its arguments on the host's arrays. */
  dsv4_attn_args_t aa;
  const int want_win = f->attn && !(e->c_ratio && e->c_ratio[idx]);
  if (want_win)
    dsv4__engine_attn_args(e, idx, f, ma, &aa);
  int win = 0;
  int rc = stage_phase(e, ticket, DSV4_BATCH_UPLOADS, NULL);
  if (!rc)
    rc = stage_inputs(e, f, fused, meta_in_place, want_win ? &aa : NULL, &win, ma, ia, &m, off);
  if (!rc) {
    ia->kv_norm_weight =
        e->kv_norm ? (const float *)s->kv_norm.ptr + (size_t)idx * DSV4_HEAD_DIM : NULL;
    dsv4__engine_attn_args(e, idx, f, ma, &aa);
    aa.q = ia->q_out;
    aa.seg_p0 = (const int64_t *)(m + off[M_SEG_P0]);
    aa.win = win ? (const dsv4_attn_win_t *)(m + off[M_WIN]) : NULL;
    aa.cache = e->cache[idx].ptr;
    aa.sink = e->sinks ? (const float *)s->sinks.ptr + (size_t)idx * e->p.heads : NULL;
    /* Staged, never in place: the attention kernels store 16-byte pieces scattered over the rows,
     * which cross PCIe at half the speed of a download (tests/bench/NOTES.md, "Launches that read
     * and write host memory in place"). */
    aa.out = s->half[s->cur].buf[ST_ATTN].ptr;
    aa.lse = f->lse ? s->half[s->cur].buf[ST_LSE].ptr : NULL;
    /* The compressed branch's inputs (engine_compress.c), and its part of the attention. */
    rc = dsv4__engine_c_stage_put(e, idx, f, ma->positions, ma->tok_seg, aa.seg_p0);
  }
  if (!rc)
    dsv4__engine_c_attn_args(e, idx, f, &aa);
  if (!rc && fused)
    fuse_args(ia, &aa);
  t1 = mono_ns();
  if (!rc)
    rc = stage_phase(e, ticket, DSV4_BATCH_LAUNCHES, NULL);
  if (!rc)
    rc = ops->map_slots(e->be, ma);
  if (!rc)
    rc = stage_insert(e, ia);
  /* SPEC §8.4: the batch's emissions before its indexer and its attention. */
  if (!rc)
    rc = dsv4__engine_c_compress(e, idx, f, tok0);
  if (!rc)
    rc = dsv4__engine_c_index(e, idx, f, tok0, f->attn != NULL);
  if (!rc && f->attn)
    rc = ops->attention(e->be, &aa);
  t2 = mono_ns();
  /* The outputs land by the batch's sync (or its batch_wait): nothing reads them before. */
  if (!rc)
    rc = stage_phase(e, ticket, DSV4_BATCH_DOWNLOADS, NULL);
  if (!rc && f->attn)
    rc = stage_get(e, ST_ATTN, aa.out, f->attn, q_bytes);
  if (!rc && f->lse)
    rc = stage_get(e, ST_LSE, aa.lse, f->lse, n * e->p.heads * sizeof(float));
  if (!rc && !fused)
    rc = stage_get_q(e, ia->q_out, f->q_out, q_bytes);
  if (!rc)
    rc = stage_get(e, ST_SLOTS, ia->slots, f->slots, n * sizeof(int64_t));
  if (!rc)
    rc = dsv4__engine_c_stage_get(e, idx, f);
  if (!rc)
    rc = stage_phase(e, ticket, DSV4_BATCH_SUBMITTED, ticket);
  /* Also after a failed submission: the copies already queued complete before it returns, so the
   * caller's buffers are never written after the batch has been answered. */
  if (rc || !ticket) {
    int sync_rc = ops->sync(e->be);
    if (!rc)
      rc = sync_rc;
  }
  s->q_early = 0; /* this batch's alone: the batches of a later yield hook begin without it */
  f->timing.staged = 1;
  f->timing.upload_ns += t1 - t0;
  f->timing.launch_ns += t2 - t1;
  f->timing.download_ns += mono_ns() - t2;
  return rc;
}

/*
 * The forward cache_digest on a staged backend: the records the batch wrote, read back through
 * dsv4__engine_cache_read. A run of tokens at consecutive offsets of one block (a segment's tokens
 * are) costs one read, from its first record to the end of its last scale entry, rather than two
 * small reads per token.
 */
static int stage_digest(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f) {
  const uint32_t bs = e->p.block_size;
  uint8_t *span = e->stage->span, rec[DSV4_RECORD_BYTES];
  dsv4_records_digest_reset(e->digest);
  for (uint32_t t = 0, k; t < f->n_tokens; t += k) {
    int64_t slot = f->slots[t];
    if (slot < 0)
      return DSV4_EINVAL; /* every token of a batch that ran has a slot */
    uint64_t block = (uint64_t)slot / bs;
    uint32_t o0 = (uint32_t)((uint64_t)slot % bs);
    for (k = 1; t + k < f->n_tokens && o0 + k < bs && f->slots[t + k] == slot + k; k++) {
    }
    uint64_t lo = DSV4_TOKEN_DATA_OFFSET(o0);
    uint64_t hi = DSV4_SCALE_OFFSET(bs, o0 + k - 1) + DSV4_SCALE_BYTES;
    int rc = dsv4__engine_cache_read(e, idx, block * e->stride + lo, hi - lo, span);
    if (rc)
      return rc;
    for (uint32_t j = 0; j < k; j++) {
      dsv4_records_gather(span + DSV4_TOKEN_DATA_OFFSET(o0 + j) - lo,
                          span + DSV4_SCALE_OFFSET(bs, o0 + j) - lo, 1, rec, DSV4_RECORD_BYTES);
      dsv4_records_digest_add(e->digest, e->positions[t + j], rec);
    }
  }
  return 0;
}

int dsv4_engine_create(const dsv4_engine_params_t *p, dsv4_engine_t **out, char *why,
                       size_t why_len) {
  dsv4_engine_t *e = calloc(1, sizeof(*e));
  const dsv4_model_t *m = p->model;
  dsv4_backend_options_t bo = {.threads = p->threads};
  int rc;
  if (!e)
    return DSV4_ENOMEM;
  e->p = *p;
  e->stride = DSV4_BLOCK_STRIDE(p->block_size);
  dsv4_plan_init(&e->plan);
  rc = dsv4_backend_open(p->backend, &bo, &e->be, why, why_len);
  if (rc)
    goto fail;
  e->layer_index = malloc(sizeof(int32_t) * m->n_layers_total);
  e->cache = calloc(p->n_served, sizeof(*e->cache));
  e->rope = calloc(p->n_served, sizeof(*e->rope));
  if (!e->layer_index || !e->cache || !e->rope) {
    rc = DSV4_ENOMEM;
    goto fail;
  }
  for (uint32_t l = 0; l < m->n_layers_total; l++)
    e->layer_index[l] = -1;
  rc = make_rope(&m->rope_plain, m->max_position_embeddings, &e->rope_plain);
  if (!rc)
    rc = make_rope(&m->rope_compress, m->max_position_embeddings, &e->rope_compress);
  if (rc) {
    snprintf(why, why_len, "cannot create RoPE tables: %s", dsv4_strerror(rc));
    goto fail;
  }
  for (uint32_t i = 0; i < p->n_served; i++) {
    uint32_t layer = p->served_layers[i];
    size_t bytes = (size_t)p->kv_blocks * e->stride;
    e->layer_index[layer] = (int32_t)i;
    e->rope[i] =
        dsv4_model_layer_rope(m, layer) == &m->rope_plain ? e->rope_plain : e->rope_compress;
    rc = e->be->ops->buf_alloc(e->be, bytes, &e->cache[i]);
    if (rc) {
      snprintf(why, why_len, "cannot allocate %zu bytes of cache for layer %u: %s", bytes, layer,
               dsv4_strerror(rc));
      goto fail;
    }
  }
  if (p->kv_norm_weights) {
    size_t n = (size_t)p->n_served * DSV4_HEAD_DIM;
    e->kv_norm = malloc(n * sizeof(float));
    if (!e->kv_norm) {
      rc = DSV4_ENOMEM;
      goto fail;
    }
    memcpy(e->kv_norm, p->kv_norm_weights, n * sizeof(float));
  }
  rc = dsv4__engine_attn_setup(e, why, why_len);
  if (rc)
    goto fail;
  if (!(e->be->ops->caps & DSV4_BE_HOST_MEMORY)) {
    rc = stage_create(e);
    if (rc) {
      snprintf(why, why_len, "cannot set up device staging on %s: %s", e->be->ops->name,
               dsv4_strerror(rc));
      goto fail;
    }
  }
  rc = dsv4_records_digest_create(&e->digest);
  if (rc)
    goto fail;
  rc = dsv4_pool_init(&e->pool, p->kv_blocks);
  if (!rc) {
    dsv4_seqtable_config_t sc = {
        .n_layers = p->n_served,
        .block_size = p->block_size,
        .max_position = m->max_position_embeddings,
        .max_sequences = p->max_sequences,
        .implicit_create = p->implicit_create,
        .idle_timeout_ns = p->idle_timeout_ns,
    };
    rc = dsv4_seqtable_create(&sc, &e->pool, &e->st);
  }
  if (rc) {
    snprintf(why, why_len, "cannot create the sequence table: %s", dsv4_strerror(rc));
    goto fail;
  }
  {
    char cwhy[256] = "";
    rc = dsv4__engine_c_setup(e, cwhy, sizeof(cwhy));
    if (rc) {
      snprintf(why, why_len, "%s", cwhy[0] ? cwhy : "cannot set up the compressed branch");
      goto fail;
    }
  }
  atomic_store(&e->healthy, 1);
  *out = e;
  return 0;
fail:
  dsv4_engine_destroy(e);
  return rc;
}

void dsv4_engine_destroy(dsv4_engine_t *e) {
  if (!e)
    return;
  stage_destroy(e);
  if (e->st)
    dsv4_seqtable_destroy(e->st);
  dsv4__engine_c_destroy(e);
  if (e->pool.free_stack)
    dsv4_pool_destroy(&e->pool);
  if (e->cache && e->be)
    for (uint32_t i = 0; i < e->p.n_served; i++)
      if (e->cache[i].ptr)
        e->be->ops->buf_free(e->be, &e->cache[i]);
  dsv4_backend_close(e->be);
  dsv4_rope_table_destroy(e->rope_plain);
  dsv4_rope_table_destroy(e->rope_compress);
  dsv4_plan_free(&e->plan);
  if (e->digest)
    dsv4_records_digest_destroy(e->digest);
  free(e->layer_index);
  free(e->cache);
  free(e->rope);
  free(e->kv_norm);
  free(e->positions);
  free(e->tok_seg);
  free(e->seg_first_lb);
  free(e->seg_bt_off);
  free(e->seg_bt_len);
  free(e->seg_p0);
  free(e->spare.positions);
  free(e->spare.tok_seg);
  free(e->spare.seg_first_lb);
  free(e->spare.seg_bt_off);
  free(e->spare.seg_bt_len);
  free(e->spare.seg_p0);
  dsv4_plan_free(&e->spare.plan);
  free(e->spare.seg_slot);
  free(e->spare.seg_cbt_off);
  free(e->spare.seg_cbt_len);
  free(e->spare.seg_c_first_lb);
  free(e->spare.sel);
  free(e->sinks);
  free(e);
}

/* Grow *p to hold n elements of size elem (contents kept); DSV4_ENOMEM leaves *p as it was. */
static int grow_array(void **p, size_t elem, size_t n) {
  void *q = realloc(*p, elem * n);
  if (!q)
    return DSV4_ENOMEM;
  *p = q;
  return 0;
}

static int grow_scratch(dsv4_engine_t *e, uint32_t n_tokens, uint32_t n_segs) {
  if (n_tokens > e->tok_cap) {
    if (grow_array((void **)&e->positions, sizeof(int64_t), n_tokens) ||
        grow_array((void **)&e->tok_seg, sizeof(int32_t), n_tokens))
      return DSV4_ENOMEM;
    e->tok_cap = n_tokens;
  }
  if (n_segs > e->seg_cap) {
    if (grow_array((void **)&e->seg_first_lb, sizeof(int64_t), n_segs) ||
        grow_array((void **)&e->seg_bt_off, sizeof(uint32_t), n_segs) ||
        grow_array((void **)&e->seg_bt_len, sizeof(uint32_t), n_segs) ||
        grow_array((void **)&e->seg_p0, sizeof(int64_t), n_segs))
      return DSV4_ENOMEM;
    e->seg_cap = n_segs;
  }
  return 0;
}

/* The per-segment range check and hash, spread over the backend's host threads. */
typedef struct {
  dsv4_forward_t *f;
  uint32_t ratio; /* the layer's compressed branch, or 0 */
  atomic_int bad;
  _Atomic(const char *) bad_tensor; /* a compressed tensor out of range (any one of them) */
} validate_job_t;

static void collect_dropped(dsv4_forward_t *f) {
  f->dropped = calloc(f->n_segs, sizeof(char *));
  f->n_dropped = 0;
  if (!f->dropped)
    return;
  for (uint32_t s = 0; s < f->n_segs; s++) {
    char *name = malloc(f->segs[s].name_len + 1);
    if (!name)
      continue;
    memcpy(name, f->segs[s].name, f->segs[s].name_len);
    name[f->segs[s].name_len] = '\0';
    f->dropped[f->n_dropped++] = name;
  }
}

/* Forward pass 1: segments inside the batch and the model; each token's position and segment. */
static int forward_positions(dsv4_engine_t *e, const dsv4_forward_t *f) {
  uint32_t n = f->n_tokens, t = 0;
  for (uint32_t s = 0; s < f->n_segs; s++) {
    const dsv4_seg_req_t *sg = &f->segs[s];
    /* Written so that neither t + len (32 bits) nor start + len (64 bits) can wrap. */
    if (sg->start < 0 || sg->len < 1 || sg->len > n - t)
      return DSV4_EINVAL;
    if (sg->start > e->p.model->max_position_embeddings - (int64_t)sg->len)
      return DSV4_EPOSRANGE;
    for (uint32_t i = 0; i < sg->len; i++) {
      e->positions[t + i] = sg->start + i;
      e->tok_seg[t + i] = (int32_t)s;
    }
    t += sg->len;
  }
  return t != n ? DSV4_EINVAL : 0;
}

static void batch_yield(dsv4_engine_t *e, dsv4_forward_t *f);

/* A validation slice: the bytes of a segment's tensors one round checks and hashes between two
 * yields. */
#define VALIDATE_SLICE ((size_t)2 << 20)

typedef struct {
  validate_job_t *v;
  dsv4_check_t *c;
  const void *data[DSV4_CHECK_TENSORS]; /* the batch's tensors, in the check's order */
  size_t slice;                         /* bytes a segment takes in one round */
} sliced_job_t;

/* Each unfinished segment's next slice of its tensors' rows, and its digest once all are in: a
 * segment that fits one slice is done in the first round. */
static void validate_slices(void *arg, size_t first, size_t last) {
  sliced_job_t *j = arg;
  validate_job_t *v = j->v;
  for (size_t s = first; s < last; s++) {
    if (dsv4__check_seg_finished(j->c, (uint32_t)s))
      continue;
    const char *bad = NULL;
    size_t budget = j->slice;
    if (dsv4__check_seg_feed(j->c, (uint32_t)s, j->data, &budget, &v->f->segs[s].hash, &bad)) {
      atomic_store_explicit(&v->bad, 1, memory_order_relaxed);
      if (bad)
        atomic_store_explicit(&v->bad_tensor, bad, memory_order_relaxed);
    }
  }
}

/*
 * The range checks and hashes of every segment, spread over the backend's host threads, resumed
 * from f->check where the batch's arrival began them (engine_check.c). A batch that runs in chunks
 * (a prefill) takes them in rounds of one slice per segment (VALIDATE_SLICE), the batch's yield
 * hook between two rounds: a decode that arrives while a long segment is checked waits for one
 * slice, not the whole batch. Nothing of this batch is applied before its validation and plan are
 * done, so the batches the hook runs see none of it. Any other batch takes one round.
 */
static int validate_segments(dsv4_engine_t *e, dsv4_forward_t *f, validate_job_t *v,
                             int in_slices) {
  const dsv4_check_shape_t sh = {e->p.heads, v->ratio, e->p.model->index_n_heads};
  dsv4_check_t *own, *c = dsv4__check_take(f->check, &sh, f, &own);
  const char *tensor;
  if (!c)
    return DSV4_ENOMEM;
  if (dsv4__check_bad(c, &tensor)) {
    atomic_store(&v->bad, 1);
    atomic_store(&v->bad_tensor, tensor);
  }
  sliced_job_t j = {
      v, c, {f->q, f->kv, f->ckv, f->ikv, f->iq, f->iw}, in_slices ? VALIDATE_SLICE : SIZE_MAX};
  /* One segment (a prefill's usual shape) runs on this thread: no pool hand-off per round; nor do
   * digests alone, where the batch's arrival checked every row. */
  const int here = f->n_segs == 1 || !e->be->ops->host_parallel || dsv4__check_all_fed(c);
  for (int round = 0;; round++) {
    int left = 0;
    for (uint32_t s = 0; s < f->n_segs && !left; s++)
      left = !dsv4__check_seg_finished(c, s);
    if (!left || atomic_load(&v->bad))
      break;
    if (round) {
      batch_yield(e, f);
    }
    if (here)
      validate_slices(&j, 0, f->n_segs);
    else
      e->be->ops->host_parallel(e->be, validate_slices, &j, f->n_segs);
  }
  dsv4_check_free(own);
  return 0;
}

/* The q half goes ahead of the validation from this many bytes of q on (4 one-token segments of 64
 * heads; at one, 64 KiB, the validation takes less than a launch). */
#define Q_EARLY_MIN_BYTES ((size_t)256 << 10)
/* The q half's pieces where the backend marks launches (q_piece_bytes 0): 32 tokens of 64 heads,
 * so a 64-token decode goes in two (on the H200 a call p50 1.31-1.45 x the PCIe floor plus device
 * time against 1.43-1.51 x whole, and 1.39-1.50 x in 1 MiB pieces: tests/bench/NOTES.md, "q's
 * half in pieces"). */
#ifndef DSV4_Q_PIECE_BYTES
#define DSV4_Q_PIECE_BYTES ((size_t)2 << 20)
#endif

/* Whether a batch runs in chunks (forward_chunks): a prefill that may yield, over the chunk size.
 */
static int in_chunks(const dsv4_engine_t *e, const dsv4_forward_t *f) {
  return f->yield && e->p.prefill_chunk_tokens && f->n_tokens > e->p.prefill_chunk_tokens;
}

/*
 * Whether f's q half (Q norm and RoPE into staging, no cache byte) may run while the host checks
 * and hashes the batch: a staged backend that maps host memory (host_alias: the one it was
 * measured on, although q_early_launch uploads what it may not read in place) and inserts KV rows
 * apart (DSV4_BE_ATTN_FUSED_Q), a batch without attention or compressed branch (their launches read
 * the metadata uploaded, not in place), not in chunks, and enough q to be worth a launch. A batch
 * in flight beside it is no obstacle: the q half writes the other staging half, queued after that
 * batch's launches, and a refusal's sync (forward_refused) waits for both, as backend.h allows.
 */
static int q_early_wanted(const dsv4_engine_t *e, int idx, const dsv4_forward_t *f) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  const size_t q_bytes = q_bytes_of(e, f->n_tokens);
  if (!e->stage || !(ops->caps & DSV4_BE_ATTN_FUSED_Q) || !ops->host_alias || f->attn || f->lse)
    return 0;
  if (q_bytes < Q_EARLY_MIN_BYTES || (e->c_ratio && e->c_ratio[idx]))
    return 0;
  return !in_chunks(e, f);
}

/* The tokens of each of the q half's launches over n tokens, of row_bytes of q each: pieces of
 * about q_piece_bytes (at most DSV4_MARKS of them) on a backend with marks, else all n at once. */
static uint32_t q_piece_tokens(const dsv4_engine_t *e, size_t n, size_t row_bytes) {
  const size_t want = e->p.q_piece_bytes ? e->p.q_piece_bytes : DSV4_Q_PIECE_BYTES;
  size_t t = want / row_bytes ? want / row_bytes : 1;
  if (!e->be->ops->mark || !e->be->ops->download_marked || t >= n)
    return (uint32_t)n;
  if ((n + t - 1) / t > DSV4_MARKS)
    t = (n + DSV4_MARKS - 1) / DSV4_MARKS;
  return (uint32_t)t;
}

/* The q half's launches: ia's tokens in pieces of per, each followed by its mark when there are
 * several (the backend then downloads a piece once its launch is done, stage_get_q). With up (q's
 * host bytes), each piece's q is uploaded into qbuf, where ia->q points, right before its launch,
 * so that the next piece crosses PCIe while the downloads take the pieces before. */
static int q_early_pieces(dsv4_engine_t *e, const dsv4_insert_args_t *ia, uint32_t per,
                          const uint16_t *up, const dsv4_devbuf_t *qbuf) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  const size_t row_elems = (size_t)ia->heads * DSV4_HEAD_DIM;
  const uint32_t pieces = (ia->n_tokens + per - 1) / per;
  int rc = 0;
  for (uint32_t i = 0; i < pieces && !rc; i++) {
    dsv4_insert_args_t p = *ia;
    const uint32_t t0 = i * per;
    p.n_tokens = ia->n_tokens - t0 < per ? ia->n_tokens - t0 : per;
    p.q = ia->q + t0 * row_elems;
    p.positions = ia->positions + t0;
    p.q_out = ia->q_out + t0 * row_elems;
    const size_t elems = p.n_tokens * row_elems;
    if (up)
      rc = ops->upload(e->be, qbuf, t0 * row_elems * sizeof(uint16_t), up + t0 * row_elems,
                       elems * sizeof(uint16_t));
#ifdef DSV4_TEST_BROKEN_MARK_EARLY
    /* Test-only breakage (tests/unit/inv_q_pieces.c): each mark before its piece's launch, so the
     * piece's download may copy q_out before that launch wrote it. */
    if (!rc && pieces > 1)
      rc = ops->mark(e->be, i);
    if (!rc)
      rc = ops->qkv_insert(e->be, &p);
#else
    if (!rc)
      rc = ops->qkv_insert(e->be, &p);
    if (!rc && pieces > 1)
      rc = ops->mark(e->be, i);
#endif
  }
  if (!rc)
    e->stage->q_piece_tokens = per;
  return rc;
}

/*
 * The q half of f's insert, launched before its range check, hashes and plan: q_out into the
 * current half's staging (so a refused batch writes nothing the caller sees). q and the positions
 * (from the half's packed metadata, where stage_inputs leaves them) are read in place where the
 * backend maps them and, for q, the batch's size allows (in_place_ok); else the positions are
 * uploaded into the half's slots buffer (the producer writes the slots there only after these
 * launches, in queue order), and q into its q buffer piece by piece, by the copy engines, which on
 * some hosts move a prefill's q over PCIe 1.6 × as fast as the launch's own reads
 * (tests/bench/NOTES.md, "In place against the copy engines on four H100 hosts"). Sets
 * e->stage->q_early when launched; a launch or upload that fails is waited for and the batch runs
 * whole.
 */
static void q_early_launch(dsv4_engine_t *e, int idx, dsv4_forward_t *f) {
  stage_half_t *h = &e->stage->half[e->stage->cur];
  const size_t n = f->n_tokens, row_bytes = q_bytes_of(e, 1), q_bytes = q_bytes_of(e, n);
  memcpy(h->meta, e->positions, n * sizeof(int64_t)); /* M_POSITIONS: offset 0 of any layout */
  const uint16_t *q = in_place_ok(e, q_bytes) ? stage_alias(e, f->q, q_bytes) : NULL;
  const int64_t *pos = h->meta_reg ? stage_alias(e, h->meta, n * sizeof(int64_t)) : NULL;
  const uint16_t *up = q ? NULL : f->q;
  const uint64_t t0 = mono_ns();
  if (!pos) {
    if (e->be->ops->upload(e->be, &h->buf[ST_SLOTS], 0, h->meta, n * sizeof(int64_t))) {
      (void)e->be->ops->sync(e->be);
      return;
    }
    pos = h->buf[ST_SLOTS].ptr;
  }
  if (!q)
    q = h->buf[ST_Q].ptr;
  dsv4_insert_args_t ia = {
      .n_tokens = (uint32_t)n,
      .heads = e->p.heads,
      .q = q,
      .kv = q, /* not read without write_kv */
      .positions = pos,
      .slots = h->buf[ST_SLOTS].ptr, /* not read without write_kv */
      .rope = e->rope[idx],
      .eps = e->p.model->rms_norm_eps,
      .write_kv = 0,
      .q_out = h->buf[ST_Q_OUT].ptr,
      .block_size = e->p.block_size,
      .n_blocks = e->p.kv_blocks,
      .stride = e->stride,
  };
  if (q_early_pieces(e, &ia, q_piece_tokens(e, n, row_bytes), up, &h->buf[ST_Q]) == 0)
    e->stage->q_early = 1;
  else
    (void)e->be->ops->sync(e->be);
  f->timing.launch_ns += mono_ns() - t0;
}

/* A batch refused after its q half was launched: the device is done with its inputs before the
 * caller hears of it. A device that fails here leaves the refusal as it is (nothing of the batch
 * was applied) and fails the batches after it (DSV4_EBACKEND). */
static int forward_refused(dsv4_engine_t *e, int rc) {
  if (e->stage && e->stage->q_early) {
    e->stage->q_early = 0;
    if (e->be->ops->sync(e->be))
      atomic_store(&e->healthy, 0);
  }
  return rc;
}

/* The host inputs of a batch flushed from the CPU caches, in pieces of FLUSH_PIECE. */
#define FLUSH_PIECE ((size_t)1 << 20)

typedef struct {
  const uint8_t *q, *kv;
  size_t q_bytes, kv_bytes;
} flush_job_t;

static size_t flush_pieces_of(size_t bytes) {
  return (bytes + FLUSH_PIECE - 1) / FLUSH_PIECE;
}

static void flush_pieces(void *arg, size_t first, size_t last) {
  const flush_job_t *j = arg;
  const size_t q_pieces = flush_pieces_of(j->q_bytes);
  for (size_t i = first; i < last; i++) {
    const uint8_t *p = i < q_pieces ? j->q : j->kv;
    const size_t n = i < q_pieces ? j->q_bytes : j->kv_bytes;
    const size_t off = (i < q_pieces ? i : i - q_pieces) * FLUSH_PIECE;
    dsv4_host_flush(p + off, n - off < FLUSH_PIECE ? n - off : FLUSH_PIECE);
  }
}

/* Whether batch f has its q and kv flushed from the CPU caches before the device copies them or
 * reads them in place (cache_flush_bytes; flush_inputs). */
static int flush_wanted(const dsv4_engine_t *e, const dsv4_forward_t *f) {
  const size_t q_bytes = q_bytes_of(e, f->n_tokens);
  return e->stage && e->p.cache_flush_bytes && q_bytes > e->p.cache_flush_bytes &&
         e->be->ops->host_parallel && dsv4_host_flush_works();
}

/*
 * The q (with_q) and kv (with_kv) of batch or chunk f out of the CPU caches, on the host threads;
 * the bytes are unchanged. Where: before a q half (q_early_launch), which reads q before the
 * validation, the lines being those the socket's reads and the checks on arrival left in one core,
 * then kv after the validation; after the validation, which has just read both on every host
 * thread, for a batch in one launch; before each chunk's kernels for a batch in chunks, so that
 * no flush runs longer than a chunk's between two yields.
 */
static void flush_inputs(dsv4_engine_t *e, dsv4_forward_t *f, int with_q, int with_kv) {
  const size_t n = f->n_tokens;
  flush_job_t j = {(const uint8_t *)f->q, (const uint8_t *)f->kv, with_q ? q_bytes_of(e, n) : 0,
                   with_kv ? kv_bytes_of(n) : 0};
  const size_t pieces = flush_pieces_of(j.q_bytes) + flush_pieces_of(j.kv_bytes);
  if (pieces)
    e->be->ops->host_parallel(e->be, flush_pieces, &j, pieces);
  f->timing.flushed_bytes += j.q_bytes + j.kv_bytes;
}

/* Forward pass 2, validation: bounds, value range, replay hashes, RoPE rows and staging room. */
static int forward_validate(dsv4_engine_t *e, int idx, dsv4_forward_t *f) {
  /* Validation comes first, so that a refused batch changes nothing. */
  int rc = grow_scratch(e, f->n_tokens, f->n_segs);
  if (!rc)
    rc = forward_positions(e, f);
  if (rc)
    return rc;
  const int early = q_early_wanted(e, idx, f), flush = flush_wanted(e, f);
  const int chunked = in_chunks(e, f);
  if (early) {
    rc = dsv4_rope_table_ensure(e->rope[idx], e->positions, f->n_tokens);
    if (!rc)
      rc = stage_reserve_batch(e, f);
    if (rc)
      return rc;
    if (flush)
      flush_inputs(e, f, 1, 0);
    q_early_launch(e, idx, f);
  }
  validate_job_t v = {.f = f, .ratio = e->c_ratio[idx]};
  atomic_init(&v.bad, 0);
  atomic_init(&v.bad_tensor, NULL);
  rc = validate_segments(e, f, &v, chunked);
  if (rc)
    return rc;
  if (atomic_load(&v.bad)) {
    f->bad_tensor = atomic_load(&v.bad_tensor);
    return DSV4_ERANGE;
  }
  if (flush && !chunked)
    flush_inputs(e, f, !early, 1);
  if (!early)
    rc = dsv4_rope_table_ensure(e->rope[idx], e->positions, f->n_tokens);
  if (!rc)
    rc = dsv4__engine_c_prepare(e, (uint32_t)idx, f);
  if (!rc && e->stage && !early)
    rc = stage_reserve_batch(e, f);
  return rc;
}

/* Forward pass 3, the plan: the batch's blocks, as the slot mapper's per-segment arrays. */
static int forward_plan(dsv4_engine_t *e, int idx, dsv4_forward_t *f, uint64_t now_ns) {
  /* Idle expiry is a matter of time, not of this batch: the sequences it names are brought up to
   * date first, whether or not the batch is then refused. */
  dsv4_seqtable_expire_named(e->st, f->segs, f->n_segs, now_ns);
  int rc = dsv4_seqtable_plan(e->st, (uint32_t)idx, f->segs, f->n_segs, now_ns, &e->plan);
  if (rc) {
    f->error = e->plan.error;
    return rc == DSV4_ENOSPC && f->error.sequences_full ? DSV4_ESEQLIMIT : rc;
  }
  for (uint32_t s = 0; s < f->n_segs; s++) {
    e->seg_first_lb[s] = e->plan.segs[s].first_lb;
    e->seg_bt_off[s] = e->plan.segs[s].bt_off;
    e->seg_bt_len[s] = e->plan.segs[s].bt_len;
    e->seg_p0[s] = e->plan.segs[s].p0;
  }
  dsv4__engine_c_plan(e, (uint32_t)idx, f);
  return 0;
}

/* Forward pass 4, the kernels: slot map, then norm/RoPE/insert, then attention when asked, on the
 * backend or its staging. f is the batch, or a view of tokens t0 .. t0 + f->n_tokens - 1 of it.
 * With ticket (staged only) the batch is left in flight (stage_run). */
static int forward_kernels(dsv4_engine_t *e, int idx, dsv4_forward_t *f, uint32_t t0,
                           uint64_t *ticket) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  uint32_t n = f->n_tokens;
  dsv4_map_args_t ma = {
      .n_tokens = n,
      .n_segments = f->n_segs,
      .block_size = e->p.block_size,
      .n_blocks = e->p.kv_blocks,
      .positions = e->positions + t0,
      .tok_seg = e->tok_seg + t0,
      .seg_first_lb = e->seg_first_lb,
      .seg_bt_off = e->seg_bt_off,
      .seg_bt_len = e->seg_bt_len,
      .block_table = e->plan.block_table,
      .slots = f->slots,
      .bt_entries = e->plan.bt_len,
  };
  dsv4_insert_args_t ia = {
      .n_tokens = n,
      .heads = e->p.heads,
      .q = f->q,
      .kv = f->kv,
      .positions = e->positions + t0,
      .slots = f->slots,
      .rope = e->rope[idx],
      .kv_norm_weight = e->kv_norm ? e->kv_norm + (size_t)idx * DSV4_HEAD_DIM : NULL,
      .eps = e->p.model->rms_norm_eps,
      .write_kv = !e->plan.replay,
      .q_out = f->q_out,
      .cache = e->cache[idx].ptr,
      .block_size = e->p.block_size,
      .n_blocks = e->p.kv_blocks,
      .stride = e->stride,
  };
  if (e->stage)
    return stage_run(e, (uint32_t)idx, f, t0, &ma, &ia, ticket);
  dsv4_attn_args_t aa;
  dsv4__engine_attn_args(e, (uint32_t)idx, f, &ma, &aa);
  dsv4__engine_c_attn_args(e, (uint32_t)idx, f, &aa);
  if (fused_decode(e, f))
    fuse_args(&ia, &aa);
  int rc = ops->map_slots(e->be, &ma);
  if (!rc)
    rc = ops->qkv_insert(e->be, &ia);
#ifndef DSV4_TEST_BROKEN_EMIT_LATE
  /* SPEC §8.4: the batch's emissions before its indexer and its attention. */
  if (!rc)
    rc = dsv4__engine_c_compress(e, (uint32_t)idx, f, t0);
  if (!rc)
    rc = dsv4__engine_c_index(e, (uint32_t)idx, f, t0, f->attn != NULL);
  if (!rc && f->attn)
    rc = ops->attention(e->be, &aa);
#else
  /* Test-only breakage of SPEC §5.2 for the compressed branch (tests/unit/inv_emit_first.c): the
   * indexer and the attention read the entry caches before the compressor has stored the batch's
   * entries. */
  if (!rc)
    rc = dsv4__engine_c_index(e, (uint32_t)idx, f, t0, f->attn != NULL);
  if (!rc && f->attn)
    rc = ops->attention(e->be, &aa);
  if (!rc)
    rc = dsv4__engine_c_compress(e, (uint32_t)idx, f, t0);
#endif
  if (!rc)
    rc = ops->sync(e->be);
  return rc;
}

/* Swap the engine's per-batch scratch with the spare set (dsv4__engine_scratch_t). */
static void scratch_swap(dsv4_engine_t *e) {
  dsv4__engine_scratch_t *s = &e->spare, t = *s;
  s->positions = e->positions;
  s->tok_seg = e->tok_seg;
  s->tok_cap = e->tok_cap;
  s->seg_first_lb = e->seg_first_lb;
  s->seg_bt_off = e->seg_bt_off;
  s->seg_bt_len = e->seg_bt_len;
  s->seg_p0 = e->seg_p0;
  s->seg_cap = e->seg_cap;
  s->plan = e->plan;
  s->seg_slot = e->seg_slot;
  s->seg_cbt_off = e->seg_cbt_off;
  s->seg_cbt_len = e->seg_cbt_len;
  s->seg_c_first_lb = e->seg_c_first_lb;
  s->c_seg_cap = e->c_seg_cap;
  s->sel = e->sel;
  s->sel_cap = e->sel_cap;
  e->seg_slot = t.seg_slot;
  e->seg_cbt_off = t.seg_cbt_off;
  e->seg_cbt_len = t.seg_cbt_len;
  e->seg_c_first_lb = t.seg_c_first_lb;
  e->c_seg_cap = t.c_seg_cap;
  e->sel = t.sel;
  e->sel_cap = t.sel_cap;
  e->positions = t.positions;
  e->tok_seg = t.tok_seg;
  e->tok_cap = t.tok_cap;
  e->seg_first_lb = t.seg_first_lb;
  e->seg_bt_off = t.seg_bt_off;
  e->seg_bt_len = t.seg_bt_len;
  e->seg_p0 = t.seg_p0;
  e->seg_cap = t.seg_cap;
  e->plan = t.plan;
}

/* The batch's yield hook, on the spare scratch (the batches it runs use this engine's), its time
 * counted apart from the batch's own stages. */
static void batch_yield(dsv4_engine_t *e, dsv4_forward_t *f) {
  uint64_t y0 = mono_ns();
  /* The batches run in the hook alternate the staging halves too; this one keeps its own, which
   * stage_reserve_batch sized for it (each of its chunks syncs before the hook runs). */
  const int half = e->stage ? e->stage->cur : 0;
  scratch_swap(e);
  f->yield(f->yield_arg);
  scratch_swap(e);
  if (e->stage)
    e->stage->cur = half;
  f->timing.yield_ns += mono_ns() - y0;
}

/*
 * Forward pass 4 of a batch with a yield hook and more than prefill_chunk_tokens tokens: the
 * kernels of each token range in turn, the hook between two. A token at position p reads the
 * records of positions p - 127 .. p only, which its own range or an earlier one wrote, so every
 * output and every cache byte is the one launch's, whatever the ranges. The plan (blocks, block
 * tables) stays the whole batch's. The ranges are prefill_chunk_tokens_alone long while no decode
 * has begun since the last chunked batch did (this one's hook included), else prefill_chunk_tokens.
 */
static int forward_chunks(dsv4_engine_t *e, int idx, dsv4_forward_t *f) {
  const uint32_t chunk = e->p.prefill_chunk_tokens, n = f->n_tokens;
  const size_t q_row = (size_t)e->p.heads * DSV4_HEAD_DIM;
  if (!in_chunks(e, f)) {
    f->chunks = 1;
    return forward_kernels(e, idx, f, 0, NULL);
  }
  const uint32_t alone =
      e->p.prefill_chunk_tokens_alone > chunk ? e->p.prefill_chunk_tokens_alone : chunk;
  const int flush = flush_wanted(e, f);
  int seen = e->decode_seen;
  e->decode_seen = 0;
  for (uint32_t t0 = 0, size; t0 < n; t0 += size) {
    if (t0) {
      batch_yield(e, f);
      /* A batch between the chunks found the device failed: this one cannot finish either. */
      if (!atomic_load(&e->healthy))
        return DSV4_EBACKEND;
    }
    seen |= e->decode_seen;
    size = seen ? chunk : alone;
    dsv4_forward_t v = *f;
    v.n_tokens = n - t0 < size ? n - t0 : size;
    v.q = f->q + t0 * q_row;
    v.kv = f->kv + (size_t)t0 * DSV4_HEAD_DIM;
    v.q_out = f->q_out + t0 * q_row;
    v.slots = f->slots + t0;
    v.attn = f->attn ? f->attn + t0 * q_row : NULL;
    v.lse = f->lse ? f->lse + (size_t)t0 * e->p.heads : NULL;
    dsv4__engine_c_view(e, (uint32_t)idx, f, t0, &v);
    if (flush)
      flush_inputs(e, &v, 1, 1);
    int rc = forward_kernels(e, idx, &v, t0, NULL);
    f->timing = v.timing;
    f->chunks++;
    if (rc)
      return rc;
  }
  return 0;
}

/* Forward pass 5, SPEC §3.1: the digest of the records the batch wrote, in token order. */
static int forward_digest(dsv4_engine_t *e, int idx, dsv4_forward_t *f) {
  int rc = 0;
  if (e->stage) {
    rc = stage_digest(e, (uint32_t)idx, f);
  } else {
    dsv4_records_digest_reset(e->digest);
    for (uint32_t t = 0; t < f->n_tokens; t++)
      dsv4_records_digest_add_slot(e->digest, e->positions[t], e->cache[idx].ptr, e->p.block_size,
                                   e->stride, f->slots[t]);
  }
  if (!rc)
    rc = dsv4__engine_c_digest(e, (uint32_t)idx, f);
  f->digest = dsv4_records_digest_value(e->digest);
  return rc;
}

int dsv4_engine_can_overlap(const dsv4_engine_t *e, const dsv4_forward_t *f) {
  int idx = dsv4_engine_layer_index(e, f->layer);
  if (!e->stage || !(e->be->ops->caps & DSV4_BE_OVERLAP) || idx < 0)
    return 0;
  /* The digest reads the cache right after the batch, and the compressed branch's staging is one
   * set: such batches run alone. So does a batch that runs in chunks (it yields between them). */
  if (f->want_digest || (e->c_ratio && e->c_ratio[idx]))
    return 0;
  return !in_chunks(e, f);
}

/* SPEC §4: never serve from a partly written state. Drop the batch's sequences (plan is where its
 * scratch is) and, unless the batch was only refused by the device's checks, stop serving. */
static int forward_failed(dsv4_engine_t *e, dsv4_forward_t *f, dsv4_plan_t *plan, int rc) {
  collect_dropped(f);
  dsv4_seqtable_fail(e->st, plan);
  if (rc != DSV4_EINVAL)
    atomic_store(&e->healthy, 0);
  return DSV4_EBACKEND;
}

/* The batch in flight whose scratch is the engine's own moves to the spare set, so that the next
 * batch may plan; 0, or DSV4_EINVAL when two are in flight already. */
static int flight_park(dsv4_engine_t *e) {
  if (!e->fly[0].f)
    return 0;
  if (e->fly[1].f)
    return DSV4_EINVAL;
  scratch_swap(e);
  e->fly[1] = e->fly[0];
  memset(&e->fly[0], 0, sizeof(e->fly[0]));
  return 0;
}

int dsv4_engine_forward_begin(dsv4_engine_t *e, dsv4_forward_t *f) {
  int idx = dsv4_engine_layer_index(e, f->layer);
  uint64_t t0 = mono_ns(), t1, t2, t3;
  int rc;

  memset(&f->timing, 0, sizeof(f->timing));
  f->replayed = 0;
  f->chunks = 0;
  f->in_flight = 0;
  if (dsv4_forward_is_decode(f))
    e->decode_seen = 1; /* the next chunked prefill's ranges are short (forward_chunks) */
  /* DEFAULT resolved once, for the attention and the indexer alike (written back, engine.h). */
  f->attention = dsv4_engine_attention_mode(e, f->layer, f->attention);
  if (idx < 0)
    return DSV4_ELAYER;
  const int overlap = dsv4_engine_can_overlap(e, f);
  if ((e->fly[0].f || e->fly[1].f) && !overlap)
    return DSV4_EINVAL; /* the caller ends the batches in flight first */
  if (!atomic_load(&e->healthy))
    return DSV4_EBACKEND;
  rc = flight_park(e);
  if (rc)
    return rc;
#ifndef DSV4_TEST_BROKEN_ONE_STAGING_HALF
  /* The half the batch in flight (parked in fly[1]) does not use, else the other one. */
  if (e->stage)
    e->stage->cur = e->fly[1].f ? !e->fly[1].half : !e->stage->cur;
#else
    /* Test-only breakage (tests/unit/inv_overlap.c): every batch stages through one half, so an
     * overlapped batch overwrites the buffers of the batch in flight before its downloads ran. */
#endif

  if (e->stage)
    e->stage->q_early = 0;
  rc = forward_validate(e, idx, f);
  if (rc)
    return forward_refused(e, rc);
  t1 = mono_ns();
  /* A chunked batch's validation may have yielded: that time was other batches'. The q half's
   * launch (q_early_launch) counts as a launch. */
  const uint64_t yield_validate = f->timing.yield_ns;
  f->timing.validate_ns = t1 - t0 - yield_validate - f->timing.launch_ns;
  rc = forward_plan(e, idx, f, t1);
  if (rc)
    return forward_refused(e, rc);
  t2 = mono_ns();
  f->timing.plan_ns = t2 - t1;
  uint64_t ticket = 0;
  if (overlap) {
    f->chunks = 1;
    rc = forward_kernels(e, idx, f, 0, &ticket);
  } else {
    rc = forward_chunks(e, idx, f);
  }
  t3 = mono_ns();
  f->timing.kernel_ns = t3 - t2 - (f->timing.yield_ns - yield_validate);
  if (!rc && overlap) {
    e->fly[0] = (dsv4__engine_flight_t){f, ticket, t3, e->stage->cur};
    f->in_flight = 1;
    return 0;
  }
  if (!rc && f->want_digest) {
    rc = forward_digest(e, idx, f);
    f->timing.digest_ns = mono_ns() - t3;
  }
  if (rc)
    return forward_failed(e, f, &e->plan, rc);
  f->replayed = e->plan.replay;
  dsv4_seqtable_commit(e->st, &e->plan, t3);
  return 0;
}

int dsv4_engine_forward_end(dsv4_engine_t *e, dsv4_forward_t *f) {
  int k = e->fly[1].f == f ? 1 : 0;
  if (!f->in_flight || e->fly[k].f != f)
    return DSV4_EINVAL;
  /* The older batch first: the backend's tickets are waited for in submission order. */
  if (k == 0 && e->fly[1].f)
    return DSV4_EINVAL;
  dsv4_plan_t *plan = k ? &e->spare.plan : &e->plan;
  uint64_t w0 = mono_ns();
  int rc = e->be->ops->batch_wait(e->be, e->fly[k].ticket);
  uint64_t w1 = mono_ns();
  f->timing.download_ns += w1 - w0;
  f->timing.kernel_ns += w1 - w0;
  f->in_flight = 0;
  const uint64_t done_ns = e->fly[k].submitted_ns;
  memset(&e->fly[k], 0, sizeof(e->fly[k]));
  /* A batch that failed after this one was submitted may have left the device broken. */
  if (!rc && !atomic_load(&e->healthy))
    rc = DSV4_EBACKEND;
  if (rc)
    return forward_failed(e, f, plan, rc);
  f->replayed = plan->replay;
  dsv4_seqtable_commit(e->st, plan, done_ns);
  return 0;
}

int dsv4_engine_in_flight(const dsv4_engine_t *e) {
  return (e->fly[0].f != NULL) + (e->fly[1].f != NULL);
}

int dsv4_engine_forward(dsv4_engine_t *e, dsv4_forward_t *f) {
  int rc = dsv4_engine_forward_begin(e, f);
  return !rc && f->in_flight ? dsv4_engine_forward_end(e, f) : rc;
}

void dsv4_forward_release(dsv4_forward_t *f) {
  for (uint32_t i = 0; i < f->n_dropped; i++)
    free(f->dropped[i]);
  free(f->dropped);
  f->dropped = NULL;
  f->n_dropped = 0;
}

int dsv4_engine_delete(dsv4_engine_t *e, const char *name, uint32_t len, int *existed) {
  return dsv4_seqtable_delete(e->st, name, len, existed);
}

uint32_t dsv4_engine_expire(dsv4_engine_t *e, uint64_t now_ns) {
  return dsv4_seqtable_expire(e->st, now_ns);
}

int dsv4_engine_seq_info(dsv4_engine_t *e, const char *name, uint32_t len, dsv4_seq_info_t *out) {
  return dsv4_seqtable_info(e->st, name, len, out);
}

int dsv4_engine_layer_index(const dsv4_engine_t *e, uint32_t layer) {
  if (layer >= e->p.model->n_layers_total)
    return -1;
  return e->layer_index[layer];
}

const char *dsv4_engine_backend_name(const dsv4_engine_t *e) {
  return e->be->ops->name;
}

int dsv4_engine_healthy(const dsv4_engine_t *e) {
  return atomic_load(&((dsv4_engine_t *)e)->healthy);
}

uint32_t dsv4_engine_blocks_total(const dsv4_engine_t *e) {
  return e->p.kv_blocks;
}

uint32_t dsv4_engine_blocks_free(const dsv4_engine_t *e) {
  return dsv4_pool_free_count_relaxed(&e->pool);
}

uint32_t dsv4_engine_sequences(const dsv4_engine_t *e) {
  return dsv4_seqtable_count_relaxed(e->st);
}

uint64_t dsv4_engine_cache_bytes(const dsv4_engine_t *e) {
  return (uint64_t)e->p.n_served * e->p.kv_blocks * e->stride;
}

int dsv4__engine_cache_read(dsv4_engine_t *e, uint32_t idx, uint64_t off, size_t n, void *dst) {
  const dsv4_devbuf_t *buf = &e->cache[idx];
  if (off > buf->size || n > buf->size - off)
    return DSV4_EINVAL;
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY) {
    memcpy(dst, (const uint8_t *)buf->ptr + off, n);
    return 0;
  }
  return e->be->ops->download(e->be, dst, buf, off, n);
}

int dsv4_engine_host_register(dsv4_engine_t *e, void *p, size_t n) {
  return e->be->ops->host_register ? e->be->ops->host_register(e->be, p, n) : 0;
}

int dsv4_engine_can_host_register(const dsv4_engine_t *e) {
  return e->be->ops->host_register != NULL && e->be->ops->host_unregister != NULL;
}

void dsv4_engine_host_unregister(dsv4_engine_t *e, void *p) {
  if (e->be->ops->host_unregister)
    e->be->ops->host_unregister(e->be, p);
}
