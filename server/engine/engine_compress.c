/*
 * The compressed branch in the engine (SPEC §8): which served layers run it, the memory it owns
 * (the compressor rings of max_sequences state slots, the entry records and the index records of
 * each such layer, and the c4 and c128 entry block pools), and a batch's part: the range check and
 * replay hash of ckv, ikv, iq and iw, the RoPE rows of the entries it emits, the compress launch
 * (rows into the rings, emissions into the caches) and the indexer's selection after the insert,
 * and the union arguments of the attention. Compress runs before the indexer and the attention of
 * its batch (SPEC §8.4: a batch's emissions are visible to its later tokens).
 *
 * The branch runs on a backend whose memory is host memory and which has the compress and indexer
 * ops (the CPU backend); elsewhere a compressed layer serves its SWA part only.
 */
#include "engine-internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"

/* SPEC §8.8: |x| >= 2^59 in ckv and ikv, |x| >= 2^32 in iq and iw (bits of the bound). */
#define F32_LIMIT_2_59 0x5D000000u
#define F32_LIMIT_2_32 0x4F800000u
#define BF16_LIMIT_2_32 0x4F80u
#define INDEX_DIM 128u

static int f32_any_at_least(const float *x, size_t n, uint32_t limit_bits) {
  unsigned bad = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &x[i], 4);
    bad |= (unsigned)((u & 0x7fffffffu) >= limit_bits);
  }
  return bad != 0;
}

static int bf16_any_at_least(const uint16_t *x, size_t n, uint16_t limit_bits) {
  unsigned bad = 0;
  for (size_t i = 0; i < n; i++)
    bad |= (unsigned)((x[i] & 0x7fffu) >= limit_bits);
  return bad != 0;
}

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

/* Which served layers run the branch; returns the floats their weights need (0: none runs). */
static size_t choose_layers(dsv4_engine_t *e, int *need[2]) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  int can = ops->compress && ops->indexer && (ops->caps & DSV4_BE_HOST_MEMORY);
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

int dsv4__engine_c_check_hash(const dsv4_engine_t *e, uint32_t ratio, const dsv4_forward_t *f,
                              uint32_t tok_off, uint32_t len, void *xxh3_state, const char **bad) {
  if (!ratio)
    return 0;
  XXH3_state_t *st = xxh3_state;
  size_t t0 = tok_off, ih = e->p.model->index_n_heads;
  size_t w = ratio == 4 ? 2048 : 1024;
  *bad = "ckv";
  if (f32_any_at_least(f->ckv + t0 * w, len * w, F32_LIMIT_2_59))
    return DSV4_ERANGE;
  XXH3_64bits_update(st, f->ckv + t0 * w, len * w * sizeof(float));
  if (ratio != 4)
    return 0;
  *bad = "ikv";
  if (f32_any_at_least(f->ikv + t0 * 512, len * 512, F32_LIMIT_2_59))
    return DSV4_ERANGE;
  XXH3_64bits_update(st, f->ikv + t0 * 512, len * 512 * sizeof(float));
  *bad = "iq";
  if (bf16_any_at_least(f->iq + t0 * ih * INDEX_DIM, len * ih * INDEX_DIM, BF16_LIMIT_2_32))
    return DSV4_ERANGE;
  XXH3_64bits_update(st, f->iq + t0 * ih * INDEX_DIM, len * ih * INDEX_DIM * sizeof(uint16_t));
  *bad = "iw";
  if (f32_any_at_least(f->iw + t0 * ih, len * ih, F32_LIMIT_2_32))
    return DSV4_ERANGE;
  XXH3_64bits_update(st, f->iw + t0 * ih, len * ih * sizeof(float));
  *bad = NULL;
  return 0;
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
  return 0;
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

int dsv4__engine_c_compress(dsv4_engine_t *e, uint32_t idx, dsv4_forward_t *f, uint32_t t0) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  if (!r || e->plan.replay)
    return 0;
  dsv4_compress_args_t ca = {
      .ratio = r,
      .n_tokens = f->n_tokens,
      .n_segments = f->n_segs,
      .positions = e->positions + t0,
      .tok_seg = e->tok_seg + t0,
      .seg_p0 = e->seg_p0,
      .seg_slot = e->seg_slot,
      .ckv = f->ckv,
      .ikv = r == 4 ? f->ikv : NULL,
      .ring = e->ring[idx].ptr,
      .n_slots = e->p.max_sequences,
      .ape = e->c_w[idx].ape,
      .norm_weight = e->c_w[idx].norm,
      .i_ape = e->c_w[idx].i_ape,
      .i_norm_weight = e->c_w[idx].i_norm,
      .eps = e->p.model->rms_norm_eps,
      .rope = e->rope[idx],
      .seg_c_first_lb = e->seg_c_first_lb,
      .seg_cbt_off = e->seg_cbt_off,
      .seg_cbt_len = e->seg_cbt_len,
      .c_block_table = e->plan.c_block_table,
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
  dsv4_indexer_args_t xa = {
      .n_tokens = f->n_tokens,
      .n_segments = f->n_segs,
      .topk = m->index_topk,
      .n_heads = m->index_n_heads,
      /* (128 * n_heads)^-0.5 rounded once from double: 0x3C3504F3 for 64 heads (SPEC §8.5). */
      .w_scale = (float)(1.0 / sqrt((double)INDEX_DIM * m->index_n_heads)),
      .positions = e->positions + t0,
      .tok_seg = e->tok_seg + t0,
      .seg_p0 = e->seg_p0,
      .iq = f->iq,
      .iw = f->iw,
      .rope = e->rope[idx],
      .seg_c_first_lb = e->seg_c_first_lb,
      .seg_cbt_off = e->seg_cbt_off,
      .seg_cbt_len = e->seg_cbt_len,
      .c_block_table = e->plan.c_block_table,
      .c_bt_entries = e->plan.c_bt_len,
      .i_cache = e->i_cache[idx].ptr,
      .c_n_blocks = e->p.c4_blocks,
      .block_size = e->p.block_size,
      .sel = f->topk ? f->topk : e->sel,
  };
  return e->be->ops->indexer(e->be, &xa);
}

void dsv4__engine_c_attn_args(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f,
                              dsv4_attn_args_t *aa) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0;
  if (!r)
    return;
  aa->ratio = r;
  aa->c_cache = e->c_cache[idx].ptr;
  aa->c_n_blocks = r == 4 ? e->p.c4_blocks : e->p.c128_blocks;
  aa->seg_c_first_lb = e->seg_c_first_lb;
  aa->seg_cbt_off = e->seg_cbt_off;
  aa->seg_cbt_len = e->seg_cbt_len;
  aa->c_block_table = e->plan.c_block_table;
  aa->c_bt_entries = e->plan.c_bt_len;
  aa->c_sel = r == 4 ? (f->topk ? f->topk : e->sel) : NULL;
  aa->c_sel_stride = r == 4 ? e->p.model->index_topk : 0;
}

/* The block id holding entry j of segment s (the plan allocated every entry the batch emits). */
static int32_t entry_block(const dsv4_engine_t *e, uint32_t s, int64_t j) {
  int64_t k = j / e->p.block_size - e->seg_c_first_lb[s];
  return e->plan.c_block_table[e->seg_cbt_off[s] + k];
}

void dsv4__engine_c_digest(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f) {
  uint32_t r = e->c_ratio ? e->c_ratio[idx] : 0, bs = e->p.block_size;
  if (!r)
    return;
  /* SPEC §8.7: the SWA records (already added), then the batch's entries in j order, then their
   * index records. */
  for (int pass = 0; pass < (r == 4 ? 2 : 1); pass++)
    for (uint32_t s = 0; s < f->n_segs; s++) {
      int64_t lo = f->segs[s].start / r, hi = (f->segs[s].start + f->segs[s].len) / r;
      for (int64_t j = lo; j < hi; j++) {
        int64_t b = entry_block(e, s, j);
        uint32_t o = (uint32_t)(j % bs);
        if (pass == 0) {
          dsv4_records_digest_add_slot(e->digest, j, e->c_cache[idx].ptr, bs, e->stride,
                                       b * bs + o);
          continue;
        }
        const uint8_t *blk =
            (const uint8_t *)e->i_cache[idx].ptr + (size_t)b * DSV4_INDEX_BLOCK_BYTES(bs);
        uint8_t rec[DSV4_INDEX_RECORD_BYTES];
        memcpy(rec, blk + 64u * o, 64);
        memcpy(rec + 64, blk + 64u * bs + 4u * o, 4);
        dsv4_records_digest_add_index(e->digest, j, rec);
      }
    }
}
