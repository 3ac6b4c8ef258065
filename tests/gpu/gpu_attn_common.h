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
  uint32_t *perm = gpu_perm(rng, p->n_blocks);
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

/*
 * The compressed entries of a union launch (SPEC §8.6, backend.h): a second pool of records in the
 * cache's format, written by inserts whose "positions" are the entry indices j (the records need
 * not come from a compressor: the attention only reads them), its segments' tables, and at ratio 4
 * each query token's selection. Only blocks holding an entry that some token reads are in the pool;
 * the others are -1 in the tables, which no valid launch reads.
 */
typedef struct {
  uint32_t ratio, n_blocks, bt_len;
  int64_t *seg_first_lb; /* [n_segs] */
  uint32_t *seg_bt_off, *seg_bt_len;
  int32_t *block_table; /* [bt_len] */
  uint32_t n_ent;       /* entries written, in increasing j per segment */
  int64_t *ent_j;
  int32_t *ent_seg;
  uint16_t *ent_kv; /* [n_ent, 512] */
  int32_t *sel;     /* ratio 4: [n_q, sel_stride], increasing, -1 padded; else NULL */
  uint32_t sel_stride;
} attn_entries_t;

/* Row t of a ratio-4 selection: k of the visible entries j_lo..j_hi - 1, chosen at random (every
 * subset of k as likely), in increasing order, then -1; each chosen entry marked in need. */
static inline void attn_entries_pick(uint64_t *rng, int32_t *row, uint32_t stride, int64_t j_lo,
                                     int64_t j_hi, uint32_t k, uint8_t *need) {
  uint32_t n = 0;
  for (int64_t j = j_lo; j < j_hi && n < k; j++)
    if (gpu_below(rng, (uint32_t)(j_hi - j)) < k - n) {
      row[n++] = (int32_t)j;
      need[j - j_lo] = 1;
    }
  for (; n < stride; n++)
    row[n] = -1;
}

/*
 * Entries for plan p at ratio 4 (a selection of at most topk per token: every visible entry when
 * there are at most topk, else topk of them; every short_every-th token, when short_every is not 0,
 * lists fewer than it could) or 128 (every visible entry, topk unused), with kv rows around 1.
 */
static inline void attn_entries_make(uint64_t *rng, const attn_plan_t *p, attn_entries_t *e,
                                     uint32_t ratio, uint32_t topk, uint32_t short_every,
                                     int spread) {
  memset(e, 0, sizeof(*e));
  e->ratio = ratio;
  const uint32_t bs = p->bs, ns = p->n_segs;
  int64_t *j_hi = gpu_host_alloc(sizeof(int64_t) * ns);
  size_t *need_off = gpu_host_alloc(sizeof(size_t) * (ns + 1));
  need_off[0] = 0;
  for (uint32_t g = 0; g < ns; g++) {
    j_hi[g] = p->seg_p0[g] / ratio;
    for (uint32_t t = 0; t < p->n_q; t++)
      if ((uint32_t)p->q_seg[t] == g && (p->q_pos[t] + 1) / ratio > j_hi[g])
        j_hi[g] = (p->q_pos[t] + 1) / ratio;
    need_off[g + 1] = need_off[g] + (size_t)(j_hi[g] - p->seg_p0[g] / ratio);
  }
  uint8_t *need = calloc(need_off[ns] ? need_off[ns] : 1, 1);
  if (ratio == 4) {
    e->sel_stride = topk;
    e->sel = gpu_host_alloc(sizeof(int32_t) * p->n_q * topk);
  }
  for (uint32_t t = 0; t < p->n_q; t++) {
    const uint32_t g = (uint32_t)p->q_seg[t];
    const int64_t lo = p->seg_p0[g] / ratio, hi = (p->q_pos[t] + 1) / ratio;
    const uint32_t vis = hi > lo ? (uint32_t)(hi - lo) : 0;
    if (ratio != 4) {
      memset(need + need_off[g], 1, vis);
      continue;
    }
    uint32_t k = vis < topk ? vis : topk;
    if (short_every && t % short_every == short_every - 1 && k)
      k = gpu_below(rng, k);
    attn_entries_pick(rng, e->sel + (size_t)t * topk, topk, lo, hi, k, need + need_off[g]);
  }
  /* Tables over every logical block of the visible entries; blocks nobody reads stay -1. */
  e->seg_first_lb = gpu_host_alloc(sizeof(int64_t) * ns);
  e->seg_bt_off = gpu_host_alloc(sizeof(uint32_t) * ns);
  e->seg_bt_len = gpu_host_alloc(sizeof(uint32_t) * ns);
  size_t bt_cap = 1, ent_cap = 1;
  for (uint32_t g = 0; g < ns; g++) {
    const int64_t lo = p->seg_p0[g] / ratio;
    bt_cap += j_hi[g] > lo ? (size_t)((j_hi[g] - 1) / bs - lo / bs + 1) : 0;
    for (size_t i = need_off[g]; i < need_off[g + 1]; i++)
      ent_cap += need[i];
  }
  e->block_table = gpu_host_alloc(sizeof(int32_t) * bt_cap);
  e->ent_j = gpu_host_alloc(sizeof(int64_t) * ent_cap);
  e->ent_seg = gpu_host_alloc(sizeof(int32_t) * ent_cap);
  for (uint32_t g = 0; g < ns; g++) {
    const int64_t lo = p->seg_p0[g] / ratio;
    e->seg_first_lb[g] = lo / bs;
    e->seg_bt_off[g] = e->bt_len;
    e->seg_bt_len[g] = j_hi[g] > lo ? (uint32_t)((j_hi[g] - 1) / bs - lo / bs + 1) : 0;
    for (uint32_t b = 0; b < e->seg_bt_len[g]; b++)
      e->block_table[e->bt_len + b] = -1;
    for (int64_t j = lo; j < j_hi[g]; j++) {
      if (!need[need_off[g] + (size_t)(j - lo)])
        continue;
      int32_t *blk = &e->block_table[e->bt_len + (uint32_t)(j / bs - lo / bs)];
      if (*blk < 0)
        *blk = (int32_t)e->n_blocks++; /* numbered in order here, scattered below */
      e->ent_j[e->n_ent] = j;
      e->ent_seg[e->n_ent++] = (int32_t)g;
    }
    e->bt_len += e->seg_bt_len[g];
  }
  /* Scatter the blocks used over a pool with spare blocks between them. */
  const uint32_t used = e->n_blocks;
  e->n_blocks = used + used / 4 + 3;
  uint32_t *perm = gpu_perm(rng, e->n_blocks);
  for (uint32_t i = 0; i < e->bt_len; i++)
    if (e->block_table[i] >= 0)
      e->block_table[i] = (int32_t)perm[e->block_table[i]];
  e->ent_kv = gpu_host_alloc((size_t)(e->n_ent ? e->n_ent : 1) * DSV4_HEAD_DIM * 2);
  gpu_fill_bf16(rng, e->ent_kv, (size_t)e->n_ent * DSV4_HEAD_DIM, 127, spread);
  free(perm);
  free(need);
  free(need_off);
  free(j_hi);
}

static inline void attn_entries_free(attn_entries_t *e) {
  free(e->seg_first_lb);
  free(e->seg_bt_off);
  free(e->seg_bt_len);
  free(e->block_table);
  free(e->ent_j);
  free(e->ent_seg);
  free(e->ent_kv);
  free(e->sel);
}

typedef struct {
  uint32_t heads;
  const uint16_t *q_hist, *kv_hist; /* [n_hist, heads, 512], [n_hist, 512] */
  const uint16_t *q_q, *kv_q;       /* [n_q, heads, 512], [n_q, 512] */
  const float *sink;                /* [heads], or NULL for no sink */
  int want_lse;
  dsv4_rope_table_t *rope;   /* rows of every position materialised */
  int fast;                  /* fast mode (SPEC §7) */
  int cache_fill;            /* the byte every cache slot holds before the inserts (0 by default) */
  const attn_entries_t *ent; /* the compressed entries of a union launch, or NULL */
  /* The fused decode path (SPEC §7, DSV4_BE_ATTN_FUSED_Q): the query batch's insert writes the KV
   * rows only and the attention reads the raw q, normalising it itself. */
  int fused;
  /* A launch over these segments' tables queued before the measured one, on the same buffers and
   * in the same batch (no sync between), or NULL: a table that makes it invalid sets the device's
   * error word, and the measured launch must then write nothing either (cuda-kernels.h). */
  const attn_table_t *earlier;
  /* The engine's windows with the launch (backend.h, dsv4_attn_args_t.win), or ATTN_WIN_NONE:
   * ATTN_WIN_BUILT, dsv4_attn_windows' of the launch's own tables; ATTN_WIN_BAD_BLOCK, the same
   * with the last window block of token win_bad_token past the pool; ATTN_WIN_PLAN, those of the
   * plan's tables while the launch is handed others. */
  int win;
  uint32_t win_bad_token;
} attn_inputs_t;

enum { ATTN_WIN_NONE, ATTN_WIN_BUILT, ATTN_WIN_BAD_BLOCK, ATTN_WIN_PLAN };

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

/* True when every one of the n bytes at a still holds the canary (a refused launch wrote none). */
static inline int attn_untouched(const void *a, size_t n) {
  const uint8_t *b = a;
  for (size_t i = 0; i < n; i++)
    if (b[i] != ATTN_CANARY)
      return 0;
  return 1;
}

/* What attn_run leaves behind when asked: host copies of the query batch's q_out and of the cache
 * after both inserts (n_q * heads * 1024 and n_blocks * stride bytes, malloc'd; q_out NULL on the
 * fused path, which writes none), and of a union launch's entry pool (the entries' n_blocks *
 * stride bytes; NULL without entries). */
typedef struct {
  uint16_t *q_out;
  uint8_t *cache;
  uint8_t *c_cache;
} attn_keep_t;

/* The entries of in->ent on be: their tables (etab 0..3), the selection (etab 4) and the entry pool
 * c_cache, written by one insert of heads 1 (the queries are not used); the launch's compressed
 * fields into aa. */
static inline void attn_put_entries(dsv4_backend_t *be, const attn_plan_t *p,
                                    const attn_inputs_t *in, dsv4_devbuf_t etab[5],
                                    dsv4_devbuf_t *c_cache, dsv4_attn_args_t *aa) {
  const attn_entries_t *e = in->ent;
  etab[0] = attn_put(be, e->seg_first_lb, sizeof(int64_t) * p->n_segs);
  etab[1] = attn_put(be, e->seg_bt_off, sizeof(uint32_t) * p->n_segs);
  etab[2] = attn_put(be, e->seg_bt_len, sizeof(uint32_t) * p->n_segs);
  etab[3] = attn_put(be, e->block_table, sizeof(int32_t) * e->bt_len);
  etab[4] = attn_put(be, e->sel, e->sel ? sizeof(int32_t) * p->n_q * e->sel_stride : 0);
  size_t bytes = (size_t)e->n_blocks * DSV4_BLOCK_STRIDE(p->bs);
  uint8_t *fill = NULL;
  if (in->cache_fill) {
    fill = gpu_host_alloc(bytes);
    memset(fill, in->cache_fill, bytes);
  }
  *c_cache = attn_put(be, fill, bytes);
  free(fill);
  attn_plan_t ep = *p;
  ep.n_blocks = e->n_blocks;
  ep.bt_len = e->bt_len;
  uint16_t *q = calloc((size_t)(e->n_ent ? e->n_ent : 1) * DSV4_HEAD_DIM, 2);
  dsv4_devbuf_t q_out = {0};
  if (e->n_ent)
    CKD(dsv4_rope_table_ensure(in->rope, e->ent_j, e->n_ent));
  CKD(attn_insert(be, &ep, 1, in->rope, e->n_ent, e->ent_j, e->ent_seg, q, e->ent_kv, etab, c_cache,
                  &q_out));
  be->ops->buf_free(be, &q_out);
  free(q);
  aa->ratio = e->ratio;
  aa->c_cache = c_cache->ptr;
  aa->c_n_blocks = e->n_blocks;
  aa->seg_c_first_lb = etab[0].ptr;
  aa->seg_cbt_off = etab[1].ptr;
  aa->seg_cbt_len = etab[2].ptr;
  aa->c_block_table = etab[3].ptr;
  aa->c_bt_entries = e->bt_len;
  aa->c_sel = e->sel ? etab[4].ptr : NULL;
  aa->c_sel_stride = e->sel_stride;
}

/* The launch aa again over table t instead of its own segments' tables (their buffers into tb,
 * freed by the caller): in->earlier's launch. */
static inline int attn_launch_over(dsv4_backend_t *be, const attn_plan_t *p,
                                   const dsv4_attn_args_t *aa, const attn_table_t *t,
                                   dsv4_devbuf_t tb[4]) {
  tb[0] = attn_put(be, t->seg_first_lb, sizeof(int64_t) * p->n_segs);
  tb[1] = attn_put(be, t->seg_bt_off, sizeof(uint32_t) * p->n_segs);
  tb[2] = attn_put(be, t->seg_bt_len, sizeof(uint32_t) * p->n_segs);
  tb[3] = attn_put(be, t->block_table, sizeof(int32_t) * t->bt_len);
  dsv4_attn_args_t ea = *aa;
  ea.win = NULL; /* the windows are the measured launch's: this one walks its own tables */
  ea.seg_first_lb = tb[0].ptr;
  ea.seg_bt_off = tb[1].ptr;
  ea.seg_bt_len = tb[2].ptr;
  ea.block_table = tb[3].ptr;
  ea.bt_entries = t->bt_len;
  return be->ops->attention(be, &ea);
}

/* The windows of launch aa, whose tables are tab (in->win, dsv4_attn_win_t), on backend be. */
static inline dsv4_devbuf_t attn_put_windows(dsv4_backend_t *be, const attn_plan_t *p,
                                             const attn_inputs_t *in, const attn_table_t *tab,
                                             dsv4_attn_args_t *aa) {
  dsv4_attn_args_t ha = *aa; /* the same launch on the host's copies of its arrays */
  ha.positions = p->q_pos;
  ha.tok_seg = p->q_seg;
  ha.seg_p0 = p->seg_p0;
  ha.seg_first_lb = tab->seg_first_lb;
  ha.seg_bt_off = tab->seg_bt_off;
  ha.seg_bt_len = tab->seg_bt_len;
  ha.block_table = tab->block_table;
  dsv4_attn_win_t *w = gpu_host_alloc(sizeof(*w) * p->n_q);
  CKD(dsv4_attn_windows(&ha, w));
  if (in->win == ATTN_WIN_BAD_BLOCK) {
    dsv4_attn_win_t *b = &w[in->win_bad_token];
    const int64_t last = (b->lo + b->n - 1) / p->bs - b->lo / p->bs;
    b->blk[last] = (int32_t)p->n_blocks;
  }
  dsv4_devbuf_t d = attn_put(be, w, sizeof(*w) * p->n_q);
  free(w);
  aa->win = d.ptr;
  return d;
}

/*
 * The plan on backend be: the history batch, the query batch, then attention over the query batch
 * (with the segments of tab, or the plan's own when tab is NULL; after in->earlier's launch when
 * there is one), out [n_q, heads, 512] and, with want_lse, lse [n_q, heads] downloaded whether or
 * not the launch failed; keep, when not NULL, receives the inserts' q_out and cache. With in->ent
 * the launch is a union launch over those entries (attn_put_entries). Returns the attention
 * launch's result (or the earlier one's when it fails), or its sync's.
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
  dsv4_devbuf_t etab[5] = {{0}}, c_cache = {0}, dwin = {0};
  if (in->ent)
    attn_put_entries(be, p, in, etab, &c_cache, &aa);
  if (in->win != ATTN_WIN_NONE)
    dwin = attn_put_windows(be, p, in, in->win == ATTN_WIN_PLAN ? &own : tab, &aa);
  dsv4_devbuf_t early[4] = {{0}};
  int rc = in->earlier ? attn_launch_over(be, p, &aa, in->earlier, early) : 0;
  if (!rc)
    rc = be->ops->attention(be, &aa);
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
    keep->c_cache = in->ent ? gpu_host_alloc(c_cache.size) : NULL;
    if (in->ent)
      CKD(be->ops->download(be, keep->c_cache, &c_cache, 0, c_cache.size));
  }
  CKD(be->ops->sync(be));
  dsv4_devbuf_t *bufs[] = {&seg[0],  &seg[1],  &seg[2],   &seg[3],   &aseg[0],  &aseg[1],  &aseg[2],
                           &aseg[3], &cache,   &q_hist,   &q_out,    &dpos,     &dseg,     &dp0,
                           &dsink,   &dout,    &dlse,     &etab[0],  &etab[1],  &etab[2],  &etab[3],
                           &etab[4], &c_cache, &early[0], &early[1], &early[2], &early[3], &dwin};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    be->ops->buf_free(be, bufs[i]);
  return rc;
}

#endif /* DSV4_TESTS_GPU_GPU_ATTN_COMMON_H */
