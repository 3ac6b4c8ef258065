#ifndef DSV4_TESTS_GPU_GPU_ATTN_COMMON_H
#define DSV4_TESTS_GPU_GPU_ATTN_COMMON_H

/*
 * Batches for the attention tests and benchmark (SPEC §7): sequences whose windows reach back into
 * earlier batches. Each segment of a plan has its sequence's p0 and a run of query positions; the
 * positions its queries see before that run (max(p0, first - 127) .. first - 1) form a history
 * batch, inserted first, as the daemon's earlier batches would have. Both batches share the
 * segments' block tables, which cover the logical blocks from the history's first position to the
 * last query, over distinct physical blocks scattered in a pool with spare blocks between them.
 *
 * attn_run drives any backend through its op table (buffers, uploads, map_slots, qkv_insert,
 * attention, downloads, sync), so the CPU reference and the CUDA backend take the same path.
 */

#include "gpu_common.h"

typedef struct {
  int64_t p0;    /* the sequence's first position */
  int64_t first; /* the first query position (>= p0) */
  uint32_t len;  /* query tokens */
} attn_seg_spec_t;

typedef struct {
  uint32_t n_segs, bs, n_blocks, bt_len;
  int64_t *seg_p0, *seg_first_lb; /* [n_segs] */
  uint32_t *seg_bt_off, *seg_bt_len;
  int32_t *block_table; /* [bt_len] */
  uint32_t n_hist, n_q;
  int64_t *hist_pos, *q_pos;
  int32_t *hist_seg, *q_seg;
} attn_plan_t;

static inline void attn_plan_make(uint64_t *rng, attn_plan_t *p, const attn_seg_spec_t *spec,
                                  uint32_t n_segs, uint32_t bs, uint32_t spare_blocks) {
  memset(p, 0, sizeof(*p));
  p->n_segs = n_segs;
  p->bs = bs;
  p->seg_p0 = gpu_host_alloc(sizeof(int64_t) * n_segs);
  p->seg_first_lb = gpu_host_alloc(sizeof(int64_t) * n_segs);
  p->seg_bt_off = gpu_host_alloc(sizeof(uint32_t) * n_segs);
  p->seg_bt_len = gpu_host_alloc(sizeof(uint32_t) * n_segs);
  size_t bt_cap = 0, hist_cap = 0, q_cap = 0;
  for (uint32_t g = 0; g < n_segs; g++) {
    int64_t h0 = spec[g].first - (DSV4_WINDOW - 1) > spec[g].p0 ? spec[g].first - (DSV4_WINDOW - 1)
                                                                : spec[g].p0;
    bt_cap += (size_t)((spec[g].first + spec[g].len - 1) / bs - h0 / bs + 1);
    hist_cap += (size_t)(spec[g].first - h0);
    q_cap += spec[g].len;
  }
  p->block_table = gpu_host_alloc(sizeof(int32_t) * bt_cap);
  p->hist_pos = gpu_host_alloc(sizeof(int64_t) * hist_cap);
  p->hist_seg = gpu_host_alloc(sizeof(int32_t) * hist_cap);
  p->q_pos = gpu_host_alloc(sizeof(int64_t) * q_cap);
  p->q_seg = gpu_host_alloc(sizeof(int32_t) * q_cap);
  for (uint32_t g = 0; g < n_segs; g++) {
    const attn_seg_spec_t *sp = &spec[g];
    int64_t h0 = sp->first - (DSV4_WINDOW - 1) > sp->p0 ? sp->first - (DSV4_WINDOW - 1) : sp->p0;
    int64_t last = sp->first + sp->len - 1;
    p->seg_p0[g] = sp->p0;
    p->seg_first_lb[g] = h0 / bs;
    p->seg_bt_off[g] = p->bt_len;
    p->seg_bt_len[g] = (uint32_t)(last / bs - h0 / bs + 1);
    p->bt_len += p->seg_bt_len[g];
    for (int64_t pos = h0; pos < sp->first; pos++) {
      p->hist_pos[p->n_hist] = pos;
      p->hist_seg[p->n_hist++] = (int32_t)g;
    }
    for (int64_t pos = sp->first; pos <= last; pos++) {
      p->q_pos[p->n_q] = pos;
      p->q_seg[p->n_q++] = (int32_t)g;
    }
  }
  /* Distinct block ids in a random order, with spare ids in between. */
  p->n_blocks = p->bt_len + spare_blocks;
  uint32_t *perm = gpu_host_alloc(sizeof(uint32_t) * p->n_blocks);
  for (uint32_t i = 0; i < p->n_blocks; i++)
    perm[i] = i;
  for (uint32_t i = p->n_blocks - 1; i > 0; i--) {
    uint32_t j = gpu_below(rng, i + 1), x = perm[i];
    perm[i] = perm[j];
    perm[j] = x;
  }
  for (uint32_t i = 0; i < p->bt_len; i++)
    p->block_table[i] = (int32_t)perm[i];
  free(perm);
}

static inline void attn_plan_free(attn_plan_t *p) {
  free(p->seg_p0);
  free(p->seg_first_lb);
  free(p->seg_bt_off);
  free(p->seg_bt_len);
  free(p->block_table);
  free(p->hist_pos);
  free(p->hist_seg);
  free(p->q_pos);
  free(p->q_seg);
}

/* The attention launch's view of the segments: the plan's own arrays unless a test replaces them
 * (after both inserts) to make a window leave its table. */
typedef struct {
  const int64_t *seg_first_lb;
  const uint32_t *seg_bt_off, *seg_bt_len;
  const int32_t *block_table;
  uint32_t bt_len;
} attn_table_t;

static inline attn_table_t attn_plan_table(const attn_plan_t *p) {
  attn_table_t t = {p->seg_first_lb, p->seg_bt_off, p->seg_bt_len, p->block_table, p->bt_len};
  return t;
}

typedef struct {
  uint32_t heads;
  const uint16_t *q_hist, *kv_hist; /* [n_hist, heads, 512], [n_hist, 512] */
  const uint16_t *q_q, *kv_q;       /* [n_q, heads, 512], [n_q, 512] */
  const float *sink;                /* [heads], or NULL for no sink */
  int want_lse;
  dsv4_rope_table_t *rope; /* rows of every position materialised */
  int fast;                /* fast mode (SPEC §7) */
  int cache_fill;          /* the byte every cache slot holds before the inserts (0 by default) */
  /* The fused decode path (SPEC §7, DSV4_BE_ATTN_FUSED_Q): the query batch's insert writes the KV
   * rows only and the attention reads the raw q, normalising it itself. */
  int fused;
} attn_inputs_t;

/* Random inputs for a plan: queries and kv rows of bf16 around 1 (spread octaves each way). */
static inline void attn_inputs_fill(uint64_t *rng, const attn_plan_t *p, attn_inputs_t *in,
                                    uint32_t heads, int spread) {
  uint16_t *qh = gpu_host_alloc((size_t)p->n_hist * heads * DSV4_HEAD_DIM * 2);
  uint16_t *kh = gpu_host_alloc((size_t)p->n_hist * DSV4_HEAD_DIM * 2);
  uint16_t *qq = gpu_host_alloc((size_t)p->n_q * heads * DSV4_HEAD_DIM * 2);
  uint16_t *kq = gpu_host_alloc((size_t)p->n_q * DSV4_HEAD_DIM * 2);
  gpu_fill_bf16(rng, qh, (size_t)p->n_hist * heads * DSV4_HEAD_DIM, 127, spread);
  gpu_fill_bf16(rng, kh, (size_t)p->n_hist * DSV4_HEAD_DIM, 127, spread);
  gpu_fill_bf16(rng, qq, (size_t)p->n_q * heads * DSV4_HEAD_DIM, 127, spread);
  gpu_fill_bf16(rng, kq, (size_t)p->n_q * DSV4_HEAD_DIM, 127, spread);
  in->heads = heads;
  in->q_hist = qh;
  in->kv_hist = kh;
  in->q_q = qq;
  in->kv_q = kq;
}

static inline void attn_inputs_free(attn_inputs_t *in) {
  free((void *)in->q_hist);
  free((void *)in->kv_hist);
  free((void *)in->q_q);
  free((void *)in->kv_q);
}

/* A buffer of the backend holding n bytes of src (zero-filled when src is NULL). */
static inline dsv4_devbuf_t attn_put(dsv4_backend_t *be, const void *src, size_t n) {
  dsv4_devbuf_t b = {0};
  CKD(be->ops->buf_alloc(be, n ? n : 16, &b));
  if (src && n)
    CKD(be->ops->upload(be, &b, 0, src, n));
  return b;
}

/* The RMSNorm epsilon of every insert (and of the fused path's attention). */
#define ATTN_EPS 1e-6f

/* One batch (map_slots then qkv_insert) of n tokens on the backend's buffers; q_out NULL: the KV
 * rows only (the fused decode path's insert). */
static inline int attn_insert(dsv4_backend_t *be, const attn_plan_t *p, uint32_t heads,
                              dsv4_rope_table_t *rope, uint32_t n, const int64_t *pos,
                              const int32_t *seg, const uint16_t *q, const uint16_t *kv,
                              const dsv4_devbuf_t tab[4], dsv4_devbuf_t *cache,
                              dsv4_devbuf_t *q_out) {
  size_t q_bytes = (size_t)n * heads * DSV4_HEAD_DIM * 2;
  dsv4_devbuf_t dpos = attn_put(be, pos, sizeof(int64_t) * n);
  dsv4_devbuf_t dseg = attn_put(be, seg, sizeof(int32_t) * n);
  dsv4_devbuf_t dq = attn_put(be, q, q_bytes);
  dsv4_devbuf_t dkv = attn_put(be, kv, (size_t)n * DSV4_HEAD_DIM * 2);
  dsv4_devbuf_t dslots = attn_put(be, NULL, sizeof(int64_t) * n);
  if (q_out)
    *q_out = attn_put(be, NULL, q_bytes);
  dsv4_map_args_t ma = {.n_tokens = n,
                        .n_segments = p->n_segs,
                        .block_size = p->bs,
                        .n_blocks = p->n_blocks,
                        .positions = dpos.ptr,
                        .tok_seg = dseg.ptr,
                        .seg_first_lb = tab[0].ptr,
                        .seg_bt_off = tab[1].ptr,
                        .seg_bt_len = tab[2].ptr,
                        .block_table = tab[3].ptr,
                        .slots = dslots.ptr,
                        .bt_entries = p->bt_len};
  dsv4_insert_args_t ia = {.n_tokens = n,
                           .heads = heads,
                           .q = dq.ptr,
                           .kv = dkv.ptr,
                           .positions = dpos.ptr,
                           .slots = dslots.ptr,
                           .rope = rope,
                           .eps = ATTN_EPS,
                           .write_kv = 1,
                           .q_out = q_out ? q_out->ptr : NULL,
                           .cache = cache->ptr,
                           .block_size = p->bs,
                           .n_blocks = p->n_blocks,
                           .stride = DSV4_BLOCK_STRIDE(p->bs)};
  int rc = n ? be->ops->map_slots(be, &ma) : 0;
  if (!rc && n)
    rc = be->ops->qkv_insert(be, &ia);
  if (!rc)
    rc = be->ops->sync(be);
  be->ops->buf_free(be, &dpos);
  be->ops->buf_free(be, &dseg);
  be->ops->buf_free(be, &dq);
  be->ops->buf_free(be, &dkv);
  be->ops->buf_free(be, &dslots);
  return rc;
}

/* Bytes a launch must overwrite start as this pattern, so that a value never written shows. */
#define ATTN_CANARY 0xA5

/* What attn_run leaves behind when asked: host copies of the query batch's q_out and of the cache
 * after both inserts (n_q * heads * 1024 and n_blocks * stride bytes, malloc'd; q_out NULL on the
 * fused path, which writes none). */
typedef struct {
  uint16_t *q_out;
  uint8_t *cache;
} attn_keep_t;

/*
 * The plan on backend be: the history batch, the query batch, then attention over the query batch
 * (with the segments of tab, or the plan's own when tab is NULL), out [n_q, heads, 512] and, with
 * want_lse, lse [n_q, heads] downloaded whether or not the launch failed; keep, when not NULL,
 * receives the inserts' q_out and cache. Returns the attention launch's result, or its sync's.
 */
static inline int attn_run(dsv4_backend_t *be, const attn_plan_t *p, const attn_inputs_t *in,
                           const attn_table_t *tab, uint16_t *out, float *lse, attn_keep_t *keep) {
  const uint32_t heads = in->heads;
  size_t out_bytes = (size_t)p->n_q * heads * DSV4_HEAD_DIM * 2;
  size_t lse_bytes = (size_t)p->n_q * heads * sizeof(float);
  dsv4_devbuf_t seg[4] = {attn_put(be, p->seg_first_lb, sizeof(int64_t) * p->n_segs),
                          attn_put(be, p->seg_bt_off, sizeof(uint32_t) * p->n_segs),
                          attn_put(be, p->seg_bt_len, sizeof(uint32_t) * p->n_segs),
                          attn_put(be, p->block_table, sizeof(int32_t) * p->bt_len)};
  size_t cache_bytes = (size_t)p->n_blocks * DSV4_BLOCK_STRIDE(p->bs);
  uint8_t *fill = NULL;
  if (in->cache_fill) {
    fill = gpu_host_alloc(cache_bytes);
    memset(fill, in->cache_fill, cache_bytes);
  }
  dsv4_devbuf_t cache = attn_put(be, fill, cache_bytes);
  free(fill);
  dsv4_devbuf_t q_hist = {0}, q_out = {0};
  CKD(attn_insert(be, p, heads, in->rope, p->n_hist, p->hist_pos, p->hist_seg, in->q_hist,
                  in->kv_hist, seg, &cache, &q_hist));
  CKD(attn_insert(be, p, heads, in->rope, p->n_q, p->q_pos, p->q_seg, in->q_q, in->kv_q, seg,
                  &cache, in->fused ? NULL : &q_out));
  /* The fused path's attention reads the raw q of the query batch. */
  if (in->fused)
    q_out = attn_put(be, in->q_q, out_bytes);
  attn_table_t own = attn_plan_table(p);
  if (!tab)
    tab = &own;
  dsv4_devbuf_t aseg[4] = {attn_put(be, tab->seg_first_lb, sizeof(int64_t) * p->n_segs),
                           attn_put(be, tab->seg_bt_off, sizeof(uint32_t) * p->n_segs),
                           attn_put(be, tab->seg_bt_len, sizeof(uint32_t) * p->n_segs),
                           attn_put(be, tab->block_table, sizeof(int32_t) * tab->bt_len)};
  dsv4_devbuf_t dpos = attn_put(be, p->q_pos, sizeof(int64_t) * p->n_q);
  dsv4_devbuf_t dseg = attn_put(be, p->q_seg, sizeof(int32_t) * p->n_q);
  dsv4_devbuf_t dp0 = attn_put(be, p->seg_p0, sizeof(int64_t) * p->n_segs);
  dsv4_devbuf_t dsink = attn_put(be, in->sink, in->sink ? sizeof(float) * heads : 0);
  memset(out, ATTN_CANARY, out_bytes);
  dsv4_devbuf_t dout = attn_put(be, out, out_bytes), dlse = {0};
  if (in->want_lse) {
    memset(lse, ATTN_CANARY, lse_bytes);
    dlse = attn_put(be, lse, lse_bytes);
  }
  dsv4_attn_args_t aa = {.n_tokens = p->n_q,
                         .n_segments = p->n_segs,
                         .heads = heads,
                         .q = q_out.ptr,
                         .positions = dpos.ptr,
                         .tok_seg = dseg.ptr,
                         .seg_p0 = dp0.ptr,
                         .seg_first_lb = aseg[0].ptr,
                         .seg_bt_off = aseg[1].ptr,
                         .seg_bt_len = aseg[2].ptr,
                         .block_table = aseg[3].ptr,
                         .bt_entries = tab->bt_len,
                         .cache = cache.ptr,
                         .block_size = p->bs,
                         .n_blocks = p->n_blocks,
                         .stride = DSV4_BLOCK_STRIDE(p->bs),
                         .sink = in->sink ? dsink.ptr : NULL,
                         .rope = in->rope,
                         .out = dout.ptr,
                         .lse = in->want_lse ? dlse.ptr : NULL,
                         .fast = in->fast,
                         .q_raw = in->fused,
                         .eps = ATTN_EPS};
  int rc = be->ops->attention(be, &aa);
  int sync_rc = be->ops->sync(be);
  if (!rc)
    rc = sync_rc;
  CKD(be->ops->download(be, out, &dout, 0, out_bytes));
  if (in->want_lse)
    CKD(be->ops->download(be, lse, &dlse, 0, lse_bytes));
  if (keep) {
    keep->q_out = in->fused ? NULL : gpu_host_alloc(out_bytes);
    keep->cache = gpu_host_alloc(cache.size);
    if (!in->fused)
      CKD(be->ops->download(be, keep->q_out, &q_out, 0, out_bytes));
    CKD(be->ops->download(be, keep->cache, &cache, 0, cache.size));
  }
  CKD(be->ops->sync(be));
  dsv4_devbuf_t *bufs[] = {&seg[0],  &seg[1],  &seg[2], &seg[3], &aseg[0], &aseg[1],
                           &aseg[2], &aseg[3], &cache,  &q_hist, &q_out,   &dpos,
                           &dseg,    &dp0,     &dsink,  &dout,   &dlse};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    be->ops->buf_free(be, bufs[i]);
  return rc;
}

#endif /* DSV4_TESTS_GPU_GPU_ATTN_COMMON_H */
