/*
 * The compressed branch in the engine (SPEC §8): which served layers run it, the memory it owns
 * (the compressor rings of max_sequences state slots, the entry records and the index records of
 * each such layer, and the c4 and c128 entry block pools), and a batch's part (the range checks and
 * replay hashes of ckv, ikv, iq and iw are engine_check.c's): the RoPE rows of the entries it
 * emits, the compress launch (rows into the rings, emissions into the caches) and the indexer's
 * selection after the insert, and the union arguments of the attention. Compress runs before the
 * indexer and the attention of its batch (SPEC §8.4: a batch's emissions are visible to its later
 * tokens).
 *
 * The branch runs on a backend that has the compress and indexer ops; elsewhere a compressed layer
 * serves its SWA part only. On a backend whose memory is not host memory (no DSV4_BE_HOST_MEMORY)
 * the rings and caches are device buffers like the SWA cache, and the batch's part is staged as
 * engine.c stages the rest: the weights are uploaded once, and per batch the tensors, the
 * per-segment arrays and the entry table are uploaded into buffers reused from batch to batch
 * (single buffers suffice for the reason engine.c gives: a batch returns after the backend's
 * sync), the selection is downloaded when asked, and the forward digest reads the batch's entries
 * back through the backend's download. The launches read a view (dsv4__engine_c_view_t) of host
 * or device addresses, so one set of launch functions serves both.
 */
#include "engine-internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "dsv4-compress.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"

/* SPEC §8.8: |x| >= 2^59 in ckv and ikv, |x| >= 2^32 in iq and iw (bits of the bound). */
#define F32_LIMIT_2_59 0x5D000000u
#define F32_LIMIT_2_32 0x4F800000u
#define BF16_LIMIT_2_32 0x4F80u
#define INDEX_DIM 128u

static int pool_index(uint32_t ratio) {
  return ratio == 4 ? 0 : 1;
}

uint32_t dsv4_engine_layer_ratio(const dsv4_engine_t *e, uint32_t layer) {
  int idx = dsv4_engine_layer_index(e, layer);
  return idx < 0 || !e->c_ratio ? 0 : e->c_ratio[idx];
}

int dsv4_engine_runs_compressed(const dsv4_engine_t *e) {
  for (uint32_t i = 0; e->c_ratio && i < e->p.n_served; i++)
    if (e->c_ratio[i])
      return 1;
  return 0;
}

const uint32_t *dsv4_engine_c_ratios(const dsv4_engine_t *e) {
  return dsv4_engine_runs_compressed(e) ? e->c_ratio : NULL;
}

void dsv4_engine_cpool_counts(const dsv4_engine_t *e, uint32_t total[2], uint32_t free_[2]) {
  for (int k = 0; k < 2; k++) {
    total[k] = e->cpool[k].free_stack ? e->cpool[k].n_blocks : 0;
    free_[k] = e->cpool[k].free_stack ? dsv4_pool_free_count_relaxed(&e->cpool[k]) : 0;
  }
}

/* Copy one layer's weights into the engine's store, advancing *at. */
static void copy_weights(const dsv4_engine_compressor_t *src, uint32_t r, float **at,
                         dsv4_engine_compressor_t *dst) {
  size_t ape = (size_t)r * (r == 4 ? 2 : 1) * DSV4_HEAD_DIM;
  float *p = *at;
  memcpy(p, src->ape, ape * sizeof(float));
  dst->ape = p;
  p += ape;
  memcpy(p, src->norm, DSV4_HEAD_DIM * sizeof(float));
  dst->norm = p;
  p += DSV4_HEAD_DIM;
  if (r == 4) {
    memcpy(p, src->i_ape, 4 * 256 * sizeof(float));
    dst->i_ape = p;
    p += 4 * 256;
    memcpy(p, src->i_norm, INDEX_DIM * sizeof(float));
    dst->i_norm = p;
    p += INDEX_DIM;
  }
  *at = p;
}

/* ---- staging on a backend without host memory ---- */

/* The staged copies: the tensors, the per-segment arrays with the entry table (CS_META, packed as
 * engine.c packs the slot mapper's arrays, one upload), and the selection. */
enum { CS_CKV, CS_IKV, CS_IQ, CS_IW, CS_META, CS_SEL, CS_COUNT };
enum { CM_SLOT, CM_FIRST_LB, CM_CBT_OFF, CM_CBT_LEN, CM_TABLE, CM_COUNT };
#define CMETA_ALIGN 16
#define CSTAGE_MIN_BYTES 256

struct dsv4__engine_cstage {
  dsv4_devbuf_t buf[CS_COUNT];
  dsv4_devbuf_t weights; /* c_w_store, uploaded once */
  uint8_t *meta;         /* host: CS_META's bytes, assembled before the upload */
  size_t meta_cap;
  uint8_t *span;           /* host copy of up to one block, for the forward digest */
  dsv4__engine_c_view_t v; /* the current chunk's copies, for its launches */
};

/* The packed arrays for nseg segments and bt table entries; returns the total bytes. */
static size_t cmeta_layout(size_t nseg, size_t bt, size_t off[CM_COUNT], size_t bytes[CM_COUNT]) {
  bytes[CM_SLOT] = nseg * sizeof(uint32_t);
  bytes[CM_FIRST_LB] = nseg * sizeof(int64_t);
  bytes[CM_CBT_OFF] = nseg * sizeof(uint32_t);
  bytes[CM_CBT_LEN] = nseg * sizeof(uint32_t);
  bytes[CM_TABLE] = bt * sizeof(int32_t);
  size_t total = 0;
  for (int i = 0; i < CM_COUNT; i++) {
    off[i] = total;
    total += (bytes[i] + CMETA_ALIGN - 1) & ~(size_t)(CMETA_ALIGN - 1);
  }
  return total;
}

static int cstage_create(dsv4_engine_t *e, size_t weight_floats) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  struct dsv4__engine_cstage *cs = calloc(1, sizeof(*cs));
  if (!cs)
    return DSV4_ENOMEM;
  e->cstage = cs;
  cs->span = malloc(e->stride);
  if (!cs->span)
    return DSV4_ENOMEM;
  size_t bytes = weight_floats * sizeof(float);
  int rc = ops->buf_alloc(e->be, bytes, &cs->weights);
  if (!rc)
    rc = ops->upload(e->be, &cs->weights, 0, e->c_w_store, bytes);
  if (!rc)
    rc = ops->sync(e->be);
  return rc;
}

static void cstage_destroy(dsv4_engine_t *e) {
  struct dsv4__engine_cstage *cs = e->cstage;
  if (!cs)
    return;
  for (int i = 0; i < CS_COUNT; i++)
    if (cs->buf[i].ptr)
      e->be->ops->buf_free(e->be, &cs->buf[i]);
  if (cs->weights.ptr)
    e->be->ops->buf_free(e->be, &cs->weights);
  free(cs->meta);
  free(cs->span);
  free(cs);
  e->cstage = NULL;
}

/* Make staged buffer i hold at least bytes (contents not kept), growing by doubling. */
static int cstage_reserve(dsv4_engine_t *e, int i, size_t bytes) {
  dsv4_devbuf_t *b = &e->cstage->buf[i];
  if (b->ptr && b->size >= bytes)
    return 0;
  size_t want = b->size * 2 > bytes ? b->size * 2 : bytes;
  if (want < CSTAGE_MIN_BYTES)
    want = CSTAGE_MIN_BYTES;
  if (b->ptr)
    e->be->ops->buf_free(e->be, b);
  return e->be->ops->buf_alloc(e->be, want, b);
}

/*
 * Reserve the staged buffers of a batch before it is planned, so that a device allocation that
 * fails refuses the batch with nothing changed. The entry table is known only after the plan; it
 * holds each segment's whole table in the layer's pool, and the segments name distinct sequences,
 * which share no block, so it has at most as many entries as the pool has blocks.
 */
static int cstage_reserve_batch(dsv4_engine_t *e, uint32_t r, const dsv4_forward_t *f) {
  struct dsv4__engine_cstage *cs = e->cstage;
  size_t n = f->n_tokens, ih = e->p.model->index_n_heads, off[CM_COUNT], bytes[CM_COUNT];
  size_t meta = cmeta_layout(f->n_segs, r == 4 ? e->p.c4_blocks : e->p.c128_blocks, off, bytes);
  if (meta > cs->meta_cap) {
    /* Zeroed: the padding between the arrays is uploaded too. */
    uint8_t *m = calloc(1, meta);
    if (!m)
      return DSV4_ENOMEM;
    free(cs->meta);
    cs->meta = m;
    cs->meta_cap = meta;
  }
  int rc = cstage_reserve(e, CS_META, meta);
  if (!rc)
    rc = cstage_reserve(e, CS_CKV, n * (r == 4 ? 2048 : 1024) * sizeof(float));
  if (r != 4 || rc)
    return rc;
  rc = cstage_reserve(e, CS_IKV, n * 512 * sizeof(float));
  if (!rc)
    rc = cstage_reserve(e, CS_IQ, n * ih * INDEX_DIM * sizeof(uint16_t));
  if (!rc)
    rc = cstage_reserve(e, CS_IW, n * ih * sizeof(float));
  if (!rc)
    rc = cstage_reserve(e, CS_SEL, n * e->p.model->index_topk * sizeof(int32_t));
  return rc;
}

/* Upload n bytes of host src into staged buffer i; returns its device address, or NULL when the
 * reservation was too small (never launch past a buffer) or the upload failed (*rc). */
static void *cstage_put(dsv4_engine_t *e, int i, const void *src, size_t n, int *rc) {
  dsv4_devbuf_t *b = &e->cstage->buf[i];
  if (*rc)
    return NULL;
  *rc = n > b->size ? DSV4_EINVAL : e->be->ops->upload(e->be, b, 0, src, n);
  return *rc ? NULL : b->ptr;
}

int dsv4__engine_c_stage_put(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f,
                             const int64_t *positions, const int32_t *tok_seg,
                             const int64_t *seg_p0) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  struct dsv4__engine_cstage *cs = e->cstage;
  if (!r || !cs)
    return 0;
  size_t n = f->n_tokens, ih = e->p.model->index_n_heads, off[CM_COUNT], bytes[CM_COUNT];
  size_t meta = cmeta_layout(f->n_segs, e->plan.c_bt_len, off, bytes);
  const void *src[CM_COUNT] = {e->seg_slot, e->seg_c_first_lb, e->seg_cbt_off, e->seg_cbt_len,
                               e->plan.c_block_table};
  if (meta > cs->meta_cap)
    return DSV4_EINVAL; /* cstage_reserve_batch's bound was wrong: never write past the buffer */
  for (int i = 0; i < CM_COUNT; i++)
    if (bytes[i])
      memcpy(cs->meta + off[i], src[i], bytes[i]);
  int rc = 0;
  const uint8_t *m = cstage_put(e, CS_META, cs->meta, meta, &rc);
  if (rc)
    return rc;
  dsv4__engine_c_view_t *v = &cs->v;
  *v = (dsv4__engine_c_view_t){0};
  v->positions = positions;
  v->tok_seg = tok_seg;
  v->seg_p0 = seg_p0;
  v->seg_slot = (const uint32_t *)(m + off[CM_SLOT]);
  v->seg_c_first_lb = (const int64_t *)(m + off[CM_FIRST_LB]);
  v->seg_cbt_off = (const uint32_t *)(m + off[CM_CBT_OFF]);
  v->seg_cbt_len = (const uint32_t *)(m + off[CM_CBT_LEN]);
  v->c_block_table = (const int32_t *)(m + off[CM_TABLE]);
  v->w_store = cs->weights.ptr;
  /* A replay writes nothing: the compressor does not run, and its rows need not travel. */
  if (!e->plan.replay)
    v->ckv = cstage_put(e, CS_CKV, f->ckv, n * (r == 4 ? 2048 : 1024) * sizeof(float), &rc);
  if (r != 4)
    return rc;
  if (!e->plan.replay)
    v->ikv = cstage_put(e, CS_IKV, f->ikv, n * 512 * sizeof(float), &rc);
  if (f->attn || f->topk) {
    v->iq = cstage_put(e, CS_IQ, f->iq, n * ih * INDEX_DIM * sizeof(uint16_t), &rc);
    v->iw = cstage_put(e, CS_IW, f->iw, n * ih * sizeof(float), &rc);
  }
  v->sel = cs->buf[CS_SEL].ptr;
  return rc;
}

int dsv4__engine_c_stage_get(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  if (r != 4 || !e->cstage || !f->topk)
    return 0;
  /* Read by the caller only, after the batch's sync: the copy may complete there. */
  const dsv4_backend_ops_t *ops = e->be->ops;
  int (*get)(dsv4_backend_t *, void *, const dsv4_devbuf_t *, size_t, size_t) =
      ops->download_async ? ops->download_async : ops->download;
  return get(e->be, f->topk, &e->cstage->buf[CS_SEL], 0,
             (size_t)f->n_tokens * e->p.model->index_topk * sizeof(int32_t));
}

/* Which served layers run the branch; returns the floats their weights need (0: none runs). */
static size_t choose_layers(dsv4_engine_t *e, int *need[2]) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  int can = ops->compress && ops->indexer;
  size_t floats = 0;
  for (uint32_t i = 0; i < e->p.n_served; i++) {
    uint32_t r = e->p.model->compress_ratios[e->p.served_layers[i]];
    const dsv4_engine_compressor_t *w = &e->p.compressors[i];
    if (!can || (r != 4 && r != 128) || !w->ape || !w->norm ||
        (r == 4 && (!w->i_ape || !w->i_norm)))
      continue;
    e->c_ratio[i] = r;
    *need[pool_index(r)] = 1;
    floats += (size_t)r * (r == 4 ? 2 : 1) * DSV4_HEAD_DIM + DSV4_HEAD_DIM +
              (r == 4 ? 4 * 256 + INDEX_DIM : 0);
  }
  return floats;
}

/* The rings and caches of one served layer of ratio r. */
static int alloc_layer(dsv4_engine_t *e, uint32_t i, uint32_t r, char *why, size_t why_len) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  uint32_t nb = r == 4 ? e->p.c4_blocks : e->p.c128_blocks;
  size_t ring = (size_t)e->p.max_sequences * DSV4_RING_FLOATS(r) * sizeof(float);
  size_t cache = (size_t)nb * e->stride;
  int rc = ops->buf_alloc(e->be, ring, &e->ring[i]);
  if (!rc)
    rc = ops->buf_alloc(e->be, cache, &e->c_cache[i]);
  if (!rc && r == 4)
    rc =
        ops->buf_alloc(e->be, (size_t)nb * DSV4_INDEX_BLOCK_BYTES(e->p.block_size), &e->i_cache[i]);
  if (rc)
    snprintf(why, why_len,
             "cannot allocate the compressed branch of layer %u (%zu bytes of rings for "
             "max_sequences %u, %zu bytes of entries for %u blocks): %s",
             e->p.served_layers[i], ring, e->p.max_sequences, cache, nb, dsv4_strerror(rc));
  return rc;
}

int dsv4__engine_c_setup(dsv4_engine_t *e, char *why, size_t why_len) {
  uint32_t n = e->p.n_served;
  int need4 = 0, need128 = 0, *need[2] = {&need4, &need128};
  e->c_ratio = calloc(n, sizeof(uint32_t));
  if (!e->c_ratio)
    return DSV4_ENOMEM;
  if (!e->p.compressors)
    return 0;
  size_t floats = choose_layers(e, need);
  if (!floats)
    return 0;
  if (e->p.max_sequences == 0 || (need4 && !e->p.c4_blocks) || (need128 && !e->p.c128_blocks)) {
    snprintf(why, why_len, "the compressed branch needs max_sequences, c4_blocks and c128_blocks");
    return DSV4_ECONFIG;
  }
  e->c_w = calloc(n, sizeof(*e->c_w));
  e->c_w_store = malloc(floats * sizeof(float));
  e->ring = calloc(n, sizeof(*e->ring));
  e->c_cache = calloc(n, sizeof(*e->c_cache));
  e->i_cache = calloc(n, sizeof(*e->i_cache));
  if (!e->c_w || !e->c_w_store || !e->ring || !e->c_cache || !e->i_cache)
    return DSV4_ENOMEM;
  float *at = e->c_w_store;
  int rc = 0;
  for (uint32_t i = 0; i < n && !rc; i++) {
    if (!e->c_ratio[i])
      continue;
    copy_weights(&e->p.compressors[i], e->c_ratio[i], &at, &e->c_w[i]);
    rc = alloc_layer(e, i, e->c_ratio[i], why, why_len);
  }
  e->p.compressors = NULL; /* copied: the caller's arrays need not outlive the engine */
  if (!rc && !(e->be->ops->caps & DSV4_BE_HOST_MEMORY)) {
    rc = cstage_create(e, floats);
    if (rc)
      snprintf(why, why_len, "cannot stage the compressed branch on %s: %s", e->be->ops->name,
               dsv4_strerror(rc));
  }
  if (!rc && need4)
    rc = dsv4_pool_init(&e->cpool[0], e->p.c4_blocks);
  if (!rc && need128)
    rc = dsv4_pool_init(&e->cpool[1], e->p.c128_blocks);
  if (!rc)
    rc = dsv4_seqtable_attach_compressed(e->st, e->c_ratio, need4 ? &e->cpool[0] : NULL,
                                         need128 ? &e->cpool[1] : NULL);
  return rc;
}

void dsv4__engine_c_destroy(dsv4_engine_t *e) {
  cstage_destroy(e);
  for (uint32_t i = 0; e->ring && i < e->p.n_served; i++) {
    dsv4_devbuf_t *bufs[3] = {&e->ring[i], &e->c_cache[i], &e->i_cache[i]};
    for (int k = 0; k < 3; k++)
      if (bufs[k]->ptr)
        e->be->ops->buf_free(e->be, bufs[k]);
  }
  for (int k = 0; k < 2; k++)
    if (e->cpool[k].free_stack)
      dsv4_pool_destroy(&e->cpool[k]);
  free(e->c_ratio);
  free(e->c_w);
  free(e->c_w_store);
  free(e->ring);
  free(e->c_cache);
  free(e->i_cache);
  free(e->seg_slot);
  free(e->seg_cbt_off);
  free(e->seg_cbt_len);
  free(e->seg_c_first_lb);
  free(e->sel);
}

/* Grow *p to n elements of elem bytes (contents not kept). */
static int grow(void **p, size_t *cap, size_t n, size_t elem) {
  if (n <= *cap)
    return 0;
  void *q = realloc(*p, n * elem);
  if (!q)
    return DSV4_ENOMEM;
  *p = q;
  *cap = n;
  return 0;
}

int dsv4__engine_c_prepare(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  if (!r)
    return 0;
  if (f->n_segs > e->c_seg_cap) {
    size_t c1 = e->c_seg_cap, c2 = c1, c3 = c1, c4 = c1;
    if (grow((void **)&e->seg_slot, &c1, f->n_segs, sizeof(uint32_t)) ||
        grow((void **)&e->seg_cbt_off, &c2, f->n_segs, sizeof(uint32_t)) ||
        grow((void **)&e->seg_cbt_len, &c3, f->n_segs, sizeof(uint32_t)) ||
        grow((void **)&e->seg_c_first_lb, &c4, f->n_segs, sizeof(int64_t)))
      return DSV4_ENOMEM;
    e->c_seg_cap = f->n_segs;
  }
  if (r == 4 && !f->topk && (f->attn || f->lse) &&
      grow((void **)&e->sel, &e->sel_cap, (size_t)f->n_tokens * e->p.model->index_topk,
           sizeof(int32_t)))
    return DSV4_ENOMEM;
  /* The rows of the entries a segment can emit: positions r * floor(start / r) on. */
  for (uint32_t s = 0; s < f->n_segs; s++) {
    int64_t first = f->segs[s].start / r * r;
    int rc = dsv4_rope_table_ensure_range(e->rope[idx], first,
                                          f->segs[s].start + f->segs[s].len - first);
    if (rc)
      return rc;
  }
  return e->cstage ? cstage_reserve_batch(e, r, f) : 0;
}

void dsv4__engine_c_view(const dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f, uint32_t t0,
                         dsv4_forward_t *v) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  size_t ih = e->p.model->index_n_heads;
  if (!r)
    return;
  v->ckv = f->ckv + (size_t)t0 * (r == 4 ? 2048 : 1024);
  if (r != 4)
    return;
  v->ikv = f->ikv + (size_t)t0 * 512;
  v->iq = f->iq + (size_t)t0 * ih * INDEX_DIM;
  v->iw = f->iw + (size_t)t0 * ih;
  v->topk = f->topk ? f->topk + (size_t)t0 * e->p.model->index_topk : NULL;
}

void dsv4__engine_c_plan(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f) {
  if (!e->c_ratio || !e->c_ratio[idx])
    return;
  for (uint32_t s = 0; s < f->n_segs; s++) {
    const dsv4_seg_map_t *m = &e->plan.segs[s];
    e->seg_slot[s] = m->slot;
    e->seg_c_first_lb[s] = m->c_first_lb;
    e->seg_cbt_off[s] = m->c_bt_off;
    e->seg_cbt_len[s] = m->c_bt_len;
  }
}

/*
 * The addresses of a launch of tokens t0.. (f the batch or a chunk's view): on a staged backend the
 * copies dsv4__engine_c_stage_put made for this chunk; otherwise host memory, built into *host.
 */
static const dsv4__engine_c_view_t *launch_view(const dsv4_engine_t *e, const dsv4_forward_t *f,
                                                uint32_t t0, dsv4__engine_c_view_t *host) {
  if (e->cstage)
    return &e->cstage->v;
  *host = (dsv4__engine_c_view_t){
      .positions = e->positions + t0,
      .tok_seg = e->tok_seg + t0,
      .seg_p0 = e->seg_p0,
      .seg_slot = e->seg_slot,
      .seg_cbt_off = e->seg_cbt_off,
      .seg_cbt_len = e->seg_cbt_len,
      .seg_c_first_lb = e->seg_c_first_lb,
      .c_block_table = e->plan.c_block_table,
      .ckv = f->ckv,
      .ikv = f->ikv,
      .iw = f->iw,
      .iq = f->iq,
      .sel = f->topk ? f->topk : e->sel,
      .w_store = e->c_w_store,
  };
  return host;
}

/* A weight array of the host store, at the address a launch through view v reads it from. */
static const float *weights_at(const dsv4_engine_t *e, const dsv4__engine_c_view_t *v,
                               const float *host) {
  return host ? v->w_store + (host - e->c_w_store) : NULL;
}

int dsv4__engine_c_compress(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f, uint32_t t0) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  if (!r || e->plan.replay)
    return 0;
  dsv4__engine_c_view_t v;
  const dsv4__engine_c_view_t *dv = launch_view(e, f, t0, &v);
  dsv4_compress_args_t ca = {
      .ratio = r,
      .n_tokens = f->n_tokens,
      .n_segments = f->n_segs,
      .positions = dv->positions,
      .tok_seg = dv->tok_seg,
      .seg_p0 = dv->seg_p0,
      .seg_slot = dv->seg_slot,
      .ckv = dv->ckv,
      .ikv = r == 4 ? dv->ikv : NULL,
      .ring = e->ring[idx].ptr,
      .n_slots = e->p.max_sequences,
      .ape = weights_at(e, dv, e->c_w[idx].ape),
      .norm_weight = weights_at(e, dv, e->c_w[idx].norm),
      .i_ape = weights_at(e, dv, e->c_w[idx].i_ape),
      .i_norm_weight = weights_at(e, dv, e->c_w[idx].i_norm),
      .eps = e->p.model->rms_norm_eps,
      .rope = e->rope[idx],
      .seg_c_first_lb = dv->seg_c_first_lb,
      .seg_cbt_off = dv->seg_cbt_off,
      .seg_cbt_len = dv->seg_cbt_len,
      .c_block_table = dv->c_block_table,
      .c_bt_entries = e->plan.c_bt_len,
      .c_cache = e->c_cache[idx].ptr,
      .i_cache = r == 4 ? e->i_cache[idx].ptr : NULL,
      .c_n_blocks = r == 4 ? e->p.c4_blocks : e->p.c128_blocks,
      .block_size = e->p.block_size,
      .stride = e->stride,
  };
  return e->be->ops->compress(e->be, &ca);
}

int dsv4__engine_c_index(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f, uint32_t t0,
                         int attend) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  const dsv4_model_t *m = e->p.model;
  if (r != 4 || !(attend || f->topk))
    return 0;
  dsv4__engine_c_view_t v;
  const dsv4__engine_c_view_t *dv = launch_view(e, f, t0, &v);
  dsv4_indexer_args_t xa = {
      .n_tokens = f->n_tokens,
      .n_segments = f->n_segs,
      .topk = m->index_topk,
      .n_heads = m->index_n_heads,
      /* (128 * n_heads)^-0.5 rounded once from double: 0x3C3504F3 for 64 heads (SPEC §8.5). */
      .w_scale = (float)(1.0 / sqrt((double)INDEX_DIM * m->index_n_heads)),
      .positions = dv->positions,
      .tok_seg = dv->tok_seg,
      .seg_p0 = dv->seg_p0,
      .iq = dv->iq,
      .iw = dv->iw,
      .rope = e->rope[idx],
      .seg_c_first_lb = dv->seg_c_first_lb,
      .seg_cbt_off = dv->seg_cbt_off,
      .seg_cbt_len = dv->seg_cbt_len,
      .c_block_table = dv->c_block_table,
      .c_bt_entries = e->plan.c_bt_len,
      .i_cache = e->i_cache[idx].ptr,
      .c_n_blocks = e->p.c4_blocks,
      .block_size = e->p.block_size,
      .sel = dv->sel,
      /* The batch's mode, also for a batch that asks for topk alone (SPEC §8.9). */
      .fast = f->attention == DSV4_ATTENTION_FAST,
  };
  return e->be->ops->indexer(e->be, &xa);
}

void dsv4__engine_c_attn_args(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f,
                              dsv4_attn_args_t *aa) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  if (!r)
    return;
  dsv4__engine_c_view_t v;
  /* The tables and the selection only: no chunk offset applies to them. */
  const dsv4__engine_c_view_t *dv = launch_view(e, f, 0, &v);
  aa->ratio = r;
  aa->c_cache = e->c_cache[idx].ptr;
  aa->c_n_blocks = r == 4 ? e->p.c4_blocks : e->p.c128_blocks;
  aa->seg_c_first_lb = dv->seg_c_first_lb;
  aa->seg_cbt_off = dv->seg_cbt_off;
  aa->seg_cbt_len = dv->seg_cbt_len;
  aa->c_block_table = dv->c_block_table;
  aa->c_bt_entries = e->plan.c_bt_len;
  aa->c_sel = r == 4 ? dv->sel : NULL;
  aa->c_sel_stride = r == 4 ? e->p.model->index_topk : 0;
}

/* The block id holding entry j of segment s (the plan allocated every entry the batch emits). */
static int32_t entry_block(const dsv4_engine_t *e, uint32_t s, int64_t j) {
  int64_t k = j / e->p.block_size - e->seg_c_first_lb[s];
  return e->plan.c_block_table[e->seg_cbt_off[s] + k];
}

/* n bytes at off of buf: in place on host memory, else downloaded into the staging span. */
static int c_read(dsv4_engine_t *e, const dsv4_devbuf_t *buf, uint64_t off, size_t n,
                  const uint8_t **out) {
  if (off > buf->size || n > buf->size - off)
    return DSV4_EINVAL;
  if (!e->cstage) {
    *out = (const uint8_t *)buf->ptr + off;
    return 0;
  }
  *out = e->cstage->span;
  return e->be->ops->download(e->be, e->cstage->span, buf, off, n);
}

/* Entries j0..j1 (one block b, consecutive offsets) into the digest: their 584-byte records, or
 * with index set their 68-byte index records. One read covers the run, from its first value to its
 * last scale or code. */
static int digest_run(dsv4_engine_t *e, uint32_t idx, int index, int64_t b, int64_t j0,
                      int64_t j1) {
  const uint32_t bs = e->p.block_size, o0 = (uint32_t)(j0 % bs), o1 = (uint32_t)(j1 % bs);
  const uint8_t *span;
  uint8_t rec[DSV4_RECORD_BYTES];
  uint64_t lo, hi;
  if (!index) {
    lo = DSV4_TOKEN_DATA_OFFSET(o0);
    hi = DSV4_SCALE_OFFSET(bs, o1) + DSV4_SCALE_BYTES;
  } else {
    lo = (uint64_t)DSV4_INDEX_VALUE_BYTES * o0;
    hi = (uint64_t)DSV4_INDEX_VALUE_BYTES * bs + 4u * (o1 + 1u);
  }
  const dsv4_devbuf_t *buf = index ? &e->i_cache[idx] : &e->c_cache[idx];
  uint64_t base = index ? (uint64_t)b * DSV4_INDEX_BLOCK_BYTES(bs) : (uint64_t)b * e->stride;
  int rc = c_read(e, buf, base + lo, hi - lo, &span);
  if (rc)
    return rc;
  for (uint32_t o = o0; o <= o1; o++) {
    if (!index) {
      dsv4_records_gather(span + DSV4_TOKEN_DATA_OFFSET(o) - lo,
                          span + DSV4_SCALE_OFFSET(bs, o) - lo, 1, rec, DSV4_RECORD_BYTES);
      dsv4_records_digest_add(e->digest, j0 + (o - o0), rec);
      continue;
    }
    memcpy(rec, span + (uint64_t)DSV4_INDEX_VALUE_BYTES * o - lo, DSV4_INDEX_VALUE_BYTES);
    memcpy(rec + DSV4_INDEX_VALUE_BYTES, span + (uint64_t)DSV4_INDEX_VALUE_BYTES * bs + 4u * o - lo,
           4);
    dsv4_records_digest_add_index(e->digest, j0 + (o - o0), rec);
  }
  return 0;
}

int dsv4__engine_c_digest(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0, bs = e->p.block_size;
  if (!r)
    return 0;
  /* SPEC §8.7: the SWA records (already added), then the batch's entries in j order, then their
   * index records; a segment's entries in one block are one read. */
  for (int pass = 0; pass < (r == 4 ? 2 : 1); pass++)
    for (uint32_t s = 0; s < f->n_segs; s++) {
      int64_t lo = f->segs[s].start / r, hi = (f->segs[s].start + f->segs[s].len) / r;
      for (int64_t j0 = lo, j1; j0 < hi; j0 = j1 + 1) {
        j1 = (j0 / bs + 1) * bs - 1 < hi - 1 ? (j0 / bs + 1) * bs - 1 : hi - 1;
        int rc = digest_run(e, idx, pass, entry_block(e, s, j0), j0, j1);
        if (rc)
          return rc;
      }
    }
  return 0;
}
