/*
 * The compressed branch of the Level Zero backend (SPEC §8.3-§8.6) against the CPU backend, byte
 * for byte: the compressor's records, index records and ring rows, the indexer's selection, and
 * attention over the union of the window and the compressed entries (attn and lse).
 *
 * A scenario is one layer (ratio 4 with its indexer, or ratio 128) and a few sequences, some
 * starting at p0 > 0, each with a state slot and its own SWA and entry blocks, driven through
 * several batches that mix prefills with many emissions and one-token steps of sequences at
 * different phases (an emission from ring rows only, from rows of the previous batch and of this
 * one). The caches and the rings start as the same random bytes on both sides, so a stray read or
 * write shows. Every batch runs on the CPU backend (map_slots, qkv_insert, compress, indexer,
 * attention) and then:
 *
 *   opencl modes: the kernels of dsv4_kernels.cl on PoCL, built from the same source and with the
 *   same options as the daemon's SPIR-V: the compressor's three launches on the device's own ring
 *   and caches, the indexer's two on its own index cache, and attention's three on the CPU's q_out
 *   and SWA cache with the device's entries and selection. Launches are split (emissions, ring
 *   tokens, attention rows) and the indexer runs in a few groups, so each group takes several
 *   tokens. After every batch the whole ring, entry cache and index cache, the selection, attn and
 *   lse must equal the CPU's.
 *   level-zero modes: the whole batch through the "level_zero" backend (over the test double of
 *   fake_ze.c, or a GPU): uploads, map_slots, qkv_insert, compress, indexer, attention, sync and
 *   downloads; q_out and the SWA cache must equal the CPU's as well.
 *
 * Usage: lz_compress_test <mode>
 *   compress          the opencl comparison of every scenario
 *   compress-fp64     the same with the double-precision divide and sqrt (DSV4_CL_RMS_FP64)
 *   compress-errors   each argument the CPU backend refuses sets its error bit in the check
 *                     launches, and then nothing is written: caches, rings, selection, attn, lse
 *   level-zero        every scenario through the backend, and its refusals: an emission's block
 *                     missing from its table (sync answers DSV4_EINVAL, nothing changes, the next
 *                     batch runs) and an emission's RoPE row not materialised (refused at once)
 *   level-zero-c128   the ratio-128 scenarios only (for the build without the compressor's and
 *                     attention's barriers, whose attention may run before the emissions)
 * Exit status: 0 pass, 1 fail, 77 skipped (no OpenCL platform or device, no fp64 for
 * compress-fp64, no Level Zero GPU for the level-zero modes).
 */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "backend.h"
#include "level_zero/lz_kernels.h"
#include "rope.h"
#ifdef DSV4_LZ_FAKE_ZE
#include "fake_ze.h"
#endif

#define MAX_SEQ 4
#define MAX_STEPS 6
#define N_SLOTS 6
#define INDEX_DIM 128

__attribute__((noreturn, format(printf, 1, 2))) static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("lz_compress_test: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

/* ---- scenarios ---- */

typedef struct {
  uint32_t seq, len; /* len 0 ends a batch */
} part_t;

typedef struct {
  const char *name;
  uint32_t ratio, bs, heads;
  uint32_t ih, topk; /* index heads and index_topk (ratio 4) */
  uint32_t n_seq;
  int64_t p0[MAX_SEQ];
  uint32_t slot[MAX_SEQ];
  part_t steps[MAX_STEPS][MAX_SEQ + 1];
} scen_t;

static const scen_t scenarios[] = {
    {"ratio 4: prefills and steps, p0 > 0",
     4,
     16,
     8,
     16,
     12,
     4,
     {0, 37, 5, 0},
     {2, 0, 5, 1},
     {{{0, 300}, {1, 41}},
      {{2, 150}, {0, 1}, {1, 3}},
      {{3, 9}, {0, 7}, {1, 1}, {2, 1}},
      {{0, 130}, {3, 1}, {2, 2}}}},
    {"ratio 128: p0 > 0, entries across batches",
     128,
     64,
     8,
     0,
     0,
     3,
     {0, 200, 0},
     {0, 3, 1},
     {{{0, 300}, {1, 100}},
      {{1, 90}, {0, 90}, {2, 129}},
      {{2, 127}, {0, 1}, {1, 1}},
      {{0, 2}, {2, 1}}}},
    {"ratio 4: 64 index heads, lists of three chunks",
     4,
     64,
     4,
     64,
     200,
     2,
     {0, 2},
     {1, 0},
     {{{0, 810}, {1, 3}}, {{0, 1}, {1, 2}}, {{0, 5}}}},
    {"ratio 128: one-token steps up to an emission",
     128,
     16,
     8,
     0,
     0,
     2,
     {0, 1},
     {4, 2},
     {{{0, 126}, {1, 120}}, {{0, 1}, {1, 1}}, {{0, 1}, {1, 1}}, {{0, 1}, {1, 5}}, {{0, 140}}}},
};

/* ---- one layer: weights, tables, and the CPU backend's state ---- */

typedef struct {
  const scen_t *sc;
  uint32_t r, bs, coff, lb_max, clb_max, swa_blocks, c_blocks;
  int32_t *swa_map; /* [n_seq, lb_max]: the SWA block of logical block lb */
  int32_t *c_map;   /* [n_seq, clb_max]: the entry block of logical entry block lb */
  int64_t next[MAX_SEQ];
  float *ape, *norm, *i_ape, *i_norm, *kvw, *sink;
  dsv4_rope_table_t *rope;
  size_t swa_bytes, ring_bytes, c_bytes, i_bytes;
  uint8_t *swa, *c_cache, *i_cache; /* the CPU backend's */
  float *ring;
  uint8_t *swa0, *c0, *i0; /* the starting bytes, for the device */
  float *ring0;
} layer_t;

/* One batch: its tokens, its segments' tables and its inputs. */
typedef struct {
  uint32_t n, n_seg, n_bt, n_cbt;
  int64_t *pos, *p0, *first_lb, *c_first_lb;
  int32_t *tok_seg, *bt, *cbt;
  uint32_t *slot, *bt_off, *bt_len, *cbt_off, *cbt_len;
  uint16_t *q, *kv, *iq;
  float *ckv, *ikv, *iw;
} step_t;

/* A batch's outputs. */
typedef struct {
  uint16_t *q_out, *out;
  float *lse;
  int32_t *sel;
} outs_t;

static float rnd_range(float lo, float hi) {
  return lo + (hi - lo) * (float)(inv_rnd() >> 40) * 0x1p-24f;
}

static void fill_f32(float *v, size_t n, float lo, float hi) {
  for (size_t i = 0; i < n; i++)
    v[i] = rnd_range(lo, hi);
}

static void fill_bytes(void *p, size_t n) {
  uint8_t *b = p;
  for (size_t i = 0; i < n; i++)
    b[i] = (uint8_t)inv_rnd();
}

/* A shuffled 0..n-1. */
static int32_t *perm_ids(uint32_t n) {
  int32_t *p = inv_alloc(n * sizeof(int32_t));
  for (uint32_t i = 0; i < n; i++)
    p[i] = (int32_t)i;
  for (uint32_t i = n - 1; i > 0; i--) {
    uint32_t j = inv_below(i + 1);
    int32_t t = p[i];
    p[i] = p[j];
    p[j] = t;
  }
  return p;
}

static void layer_init(layer_t *L, const scen_t *sc, dsv4_rope_table_t *rope) {
  memset(L, 0, sizeof(*L));
  L->sc = sc;
  L->r = sc->ratio;
  L->bs = sc->bs;
  L->coff = L->r == 4 ? 2 : 1;
  L->rope = rope;
  int64_t end[MAX_SEQ], most = 0;
  for (uint32_t s = 0; s < sc->n_seq; s++)
    end[s] = L->next[s] = sc->p0[s];
  for (int k = 0; k < MAX_STEPS; k++)
    for (int i = 0; i <= MAX_SEQ && sc->steps[k][i].len; i++)
      end[sc->steps[k][i].seq] += sc->steps[k][i].len;
  for (uint32_t s = 0; s < sc->n_seq; s++)
    most = end[s] > most ? end[s] : most;
  L->lb_max = (uint32_t)(most / L->bs + 2);
  L->clb_max = (uint32_t)(most / L->r / L->bs + 2);
  L->swa_blocks = sc->n_seq * L->lb_max + 3;
  L->c_blocks = sc->n_seq * L->clb_max + 3;
  /* Every sequence's blocks, scattered over the pools (the spare ids are never mapped). */
  L->swa_map = perm_ids(L->swa_blocks);
  L->c_map = perm_ids(L->c_blocks);
  size_t w = (size_t)L->coff * DSV4_HEAD_DIM;
  L->ape = inv_alloc((size_t)L->r * w * sizeof(float));
  L->norm = inv_alloc(DSV4_HEAD_DIM * sizeof(float));
  L->i_ape = inv_alloc(4 * 256 * sizeof(float));
  L->i_norm = inv_alloc(INDEX_DIM * sizeof(float));
  L->kvw = inv_alloc(DSV4_HEAD_DIM * sizeof(float));
  L->sink = inv_alloc(DSV4_MAX_HEADS * sizeof(float));
  fill_f32(L->ape, (size_t)L->r * w, -0.5f, 0.5f);
  fill_f32(L->i_ape, 4 * 256, -0.5f, 0.5f);
  inv_fill_weight(L->norm);
  inv_fill_weight(L->kvw);
  for (int d = 0; d < INDEX_DIM; d++)
    L->i_norm[d] = L->norm[d] * 0.75f;
  fill_f32(L->sink, DSV4_MAX_HEADS, -2.0f, 6.0f);
  L->swa_bytes = (size_t)L->swa_blocks * DSV4_BLOCK_STRIDE(L->bs);
  L->c_bytes = (size_t)L->c_blocks * DSV4_BLOCK_STRIDE(L->bs);
  L->i_bytes = (size_t)L->c_blocks * DSV4_INDEX_BLOCK_BYTES(L->bs);
  L->ring_bytes = (size_t)N_SLOTS * DSV4_RING_FLOATS(L->r) * sizeof(float);
  uint8_t **bufs[] = {&L->swa,  &L->c_cache, &L->i_cache, (uint8_t **)&L->ring,
                      &L->swa0, &L->c0,      &L->i0,      (uint8_t **)&L->ring0};
  size_t sizes[] = {L->swa_bytes, L->c_bytes, L->i_bytes, L->ring_bytes};
  for (int i = 0; i < 4; i++) {
    *bufs[i] = inv_alloc(sizes[i]);
    *bufs[4 + i] = inv_alloc(sizes[i]);
    /* Random bytes, the same on both sides: nothing reads them unless it reads the wrong place. */
    fill_bytes(*bufs[i], sizes[i]);
    memcpy(*bufs[4 + i], *bufs[i], sizes[i]);
  }
}

static void layer_free(layer_t *L) {
  void *all[] = {L->swa_map, L->c_map, L->ape, L->norm,    L->i_ape,   L->i_norm,
                 L->kvw,     L->sink,  L->swa, L->c_cache, L->i_cache, L->ring,
                 L->swa0,    L->c0,    L->i0,  L->ring0};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    free(all[i]);
}

/* The batch k of the scenario, from each sequence's next position; the positions advance. */
static void step_make(layer_t *L, int k, step_t *st) {
  const scen_t *sc = L->sc;
  memset(st, 0, sizeof(*st));
  while (st->n_seg <= MAX_SEQ && sc->steps[k][st->n_seg].len)
    st->n += sc->steps[k][st->n_seg++].len;
  uint32_t n = st->n, ns = st->n_seg;
  st->pos = inv_alloc(n * sizeof(int64_t));
  st->tok_seg = inv_alloc(n * sizeof(int32_t));
  st->p0 = inv_alloc(ns * sizeof(int64_t));
  st->first_lb = inv_alloc(ns * sizeof(int64_t));
  st->c_first_lb = inv_alloc(ns * sizeof(int64_t));
  uint32_t **u32[] = {&st->slot, &st->bt_off, &st->bt_len, &st->cbt_off, &st->cbt_len};
  for (int i = 0; i < 5; i++)
    *u32[i] = inv_alloc(ns * sizeof(uint32_t));
  st->bt = inv_alloc((size_t)ns * L->lb_max * sizeof(int32_t));
  st->cbt = inv_alloc((size_t)ns * L->clb_max * sizeof(int32_t));
  for (uint32_t g = 0, t = 0; g < ns; g++) {
    uint32_t s = sc->steps[k][g].seq, len = sc->steps[k][g].len;
    int64_t start = L->next[s], p0 = sc->p0[s];
    for (uint32_t i = 0; i < len; i++, t++) {
      st->pos[t] = start + i;
      st->tok_seg[t] = (int32_t)g;
    }
    L->next[s] += len;
    st->p0[g] = p0;
    st->slot[g] = sc->slot[s];
    /* The window's blocks through the last token's, and the entry blocks of every visible entry
     * and of this batch's emissions. */
    int64_t lo = start - (DSV4_WINDOW - 1) > p0 ? start - (DSV4_WINDOW - 1) : p0;
    st->first_lb[g] = lo / L->bs;
    st->bt_off[g] = st->n_bt;
    for (int64_t lb = lo / L->bs; lb <= (start + len - 1) / L->bs; lb++)
      st->bt[st->n_bt++] = L->swa_map[s * L->lb_max + lb];
    st->bt_len[g] = st->n_bt - st->bt_off[g];
    st->c_first_lb[g] = p0 / L->r / L->bs;
    st->cbt_off[g] = st->n_cbt;
    for (int64_t lb = p0 / L->r / L->bs; lb <= (start + len) / L->r / L->bs; lb++)
      st->cbt[st->n_cbt++] = L->c_map[s * L->clb_max + lb];
    st->cbt_len[g] = st->n_cbt - st->cbt_off[g];
  }
  uint32_t ih = sc->ih ? sc->ih : 1;
  st->q = inv_alloc((size_t)n * sc->heads * DSV4_HEAD_DIM * 2);
  st->kv = inv_alloc((size_t)n * DSV4_HEAD_DIM * 2);
  st->iq = inv_alloc((size_t)n * ih * INDEX_DIM * 2);
  st->ckv = inv_alloc((size_t)n * 2 * L->coff * DSV4_HEAD_DIM * sizeof(float));
  st->ikv = inv_alloc((size_t)n * 512 * sizeof(float));
  st->iw = inv_alloc((size_t)n * ih * sizeof(float));
  inv_fill_bf16(st->q, (size_t)n * sc->heads * DSV4_HEAD_DIM);
  inv_fill_bf16(st->kv, (size_t)n * DSV4_HEAD_DIM);
  inv_fill_bf16(st->iq, (size_t)n * ih * INDEX_DIM);
  /* kv then gate of each row; the gates spread the pooling weights over several octaves. */
  size_t w = (size_t)L->coff * DSV4_HEAD_DIM;
  for (uint32_t t = 0; t < n; t++) {
    fill_f32(st->ckv + t * 2 * w, w, -3.0f, 3.0f);
    fill_f32(st->ckv + t * 2 * w + w, w, -6.0f, 6.0f);
    fill_f32(st->ikv + t * 512, 256, -3.0f, 3.0f);
    fill_f32(st->ikv + t * 512 + 256, 256, -6.0f, 6.0f);
  }
  fill_f32(st->iw, (size_t)n * ih, -1.0f, 1.0f);
  /* Ties for the selection (SPEC §8.5: the lower entry wins): a token whose weights are all zero
   * scores every entry +0, and one whose weights are all negative scores +0 exactly the entries
   * no head's dot product finds positive, above every other. */
  for (uint32_t t = 0; t < n; t++)
    for (uint32_t h = 0; h < ih && t % 5 >= 3; h++)
      st->iw[(size_t)t * ih + h] = t % 5 == 3 ? 0.0f : -fabsf(st->iw[(size_t)t * ih + h]);
  /* The rows the engine materialises: every position, and each entry's first position. */
  if (dsv4_rope_table_ensure(L->rope, st->pos, n) != 0)
    die("rope rows");
  for (uint32_t g = 0; g < ns; g++) {
    int64_t end = L->next[sc->steps[k][g].seq];
    int64_t first = (end - sc->steps[k][g].len) / L->r * L->r;
    if (dsv4_rope_table_ensure_range(L->rope, first, end - first) != 0)
      die("rope rows");
  }
}

static void step_free(step_t *st) {
  void *all[] = {st->pos,    st->tok_seg, st->p0,      st->first_lb, st->c_first_lb, st->slot,
                 st->bt_off, st->bt_len,  st->cbt_off, st->cbt_len,  st->bt,         st->cbt,
                 st->q,      st->kv,      st->iq,      st->ckv,      st->ikv,        st->iw};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    free(all[i]);
}

/* Bytes an output starts as, so that a launch that writes nothing shows. */
#define JUNK 0x5A

static void outs_alloc(outs_t *o, const layer_t *L, const step_t *st) {
  size_t qb = (size_t)st->n * L->sc->heads * DSV4_HEAD_DIM * 2;
  o->q_out = inv_alloc(qb);
  o->out = inv_alloc(qb);
  o->lse = inv_alloc((size_t)st->n * L->sc->heads * sizeof(float));
  o->sel = inv_alloc((size_t)st->n * (L->sc->topk ? L->sc->topk : 1) * sizeof(int32_t));
  memset(o->q_out, JUNK, qb);
  memset(o->out, JUNK, qb);
  memset(o->lse, JUNK, (size_t)st->n * L->sc->heads * sizeof(float));
  memset(o->sel, JUNK, (size_t)st->n * (L->sc->topk ? L->sc->topk : 1) * sizeof(int32_t));
}

static void outs_free(outs_t *o) {
  free(o->q_out);
  free(o->out);
  free(o->lse);
  free(o->sel);
}

/* ---- the backend ops of one batch, from a view of the arrays (host or device addresses) ---- */

typedef struct {
  const int64_t *pos, *p0, *first_lb, *c_first_lb;
  const int32_t *tok_seg, *bt, *cbt;
  const uint32_t *slot, *bt_off, *bt_len, *cbt_off, *cbt_len;
  const uint16_t *q, *kv, *iq;
  const float *ckv, *ikv, *iw, *ape, *norm, *i_ape, *i_norm, *kvw, *sink;
  uint8_t *swa, *c_cache, *i_cache;
  float *ring;
  int64_t *slots;
  uint16_t *q_out, *out;
  float *lse;
  int32_t *sel;
} view_t;

typedef struct {
  dsv4_map_args_t m;
  dsv4_insert_args_t i;
  dsv4_compress_args_t c;
  dsv4_indexer_args_t x;
  dsv4_attn_args_t a;
} ops_args_t;

static void ops_args(const layer_t *L, const step_t *st, const view_t *v, ops_args_t *o) {
  const scen_t *sc = L->sc;
  uint64_t stride = DSV4_BLOCK_STRIDE(L->bs);
  o->m = (dsv4_map_args_t){.n_tokens = st->n,
                           .n_segments = st->n_seg,
                           .block_size = L->bs,
                           .n_blocks = L->swa_blocks,
                           .positions = v->pos,
                           .tok_seg = v->tok_seg,
                           .seg_first_lb = v->first_lb,
                           .seg_bt_off = v->bt_off,
                           .seg_bt_len = v->bt_len,
                           .block_table = v->bt,
                           .slots = v->slots,
                           .bt_entries = st->n_bt};
  o->i = (dsv4_insert_args_t){.n_tokens = st->n,
                              .heads = sc->heads,
                              .q = v->q,
                              .kv = v->kv,
                              .positions = v->pos,
                              .slots = v->slots,
                              .rope = L->rope,
                              .kv_norm_weight = v->kvw,
                              .eps = 1e-6f,
                              .write_kv = 1,
                              .q_out = v->q_out,
                              .cache = v->swa,
                              .block_size = L->bs,
                              .n_blocks = L->swa_blocks,
                              .stride = stride};
  int four = L->r == 4;
  o->c = (dsv4_compress_args_t){.ratio = L->r,
                                .n_tokens = st->n,
                                .n_segments = st->n_seg,
                                .positions = v->pos,
                                .tok_seg = v->tok_seg,
                                .seg_p0 = v->p0,
                                .seg_slot = v->slot,
                                .ckv = v->ckv,
                                .ikv = four ? v->ikv : NULL,
                                .ring = v->ring,
                                .n_slots = N_SLOTS,
                                .ape = v->ape,
                                .norm_weight = v->norm,
                                .i_ape = four ? v->i_ape : NULL,
                                .i_norm_weight = four ? v->i_norm : NULL,
                                .eps = 1e-6f,
                                .rope = L->rope,
                                .seg_c_first_lb = v->c_first_lb,
                                .seg_cbt_off = v->cbt_off,
                                .seg_cbt_len = v->cbt_len,
                                .c_block_table = v->cbt,
                                .c_bt_entries = st->n_cbt,
                                .c_cache = v->c_cache,
                                .i_cache = four ? v->i_cache : NULL,
                                .c_n_blocks = L->c_blocks,
                                .block_size = L->bs,
                                .stride = stride};
  o->x = (dsv4_indexer_args_t){.n_tokens = st->n,
                               .n_segments = st->n_seg,
                               .topk = sc->topk,
                               .n_heads = sc->ih,
                               .w_scale = (float)(1.0 / sqrt((double)INDEX_DIM * sc->ih)),
                               .positions = v->pos,
                               .tok_seg = v->tok_seg,
                               .seg_p0 = v->p0,
                               .iq = v->iq,
                               .iw = v->iw,
                               .rope = L->rope,
                               .seg_c_first_lb = v->c_first_lb,
                               .seg_cbt_off = v->cbt_off,
                               .seg_cbt_len = v->cbt_len,
                               .c_block_table = v->cbt,
                               .c_bt_entries = st->n_cbt,
                               .i_cache = v->i_cache,
                               .c_n_blocks = L->c_blocks,
                               .block_size = L->bs,
                               .sel = v->sel};
  o->a = (dsv4_attn_args_t){.n_tokens = st->n,
                            .n_segments = st->n_seg,
                            .heads = sc->heads,
                            .q = v->q_out,
                            .positions = v->pos,
                            .tok_seg = v->tok_seg,
                            .seg_p0 = v->p0,
                            .seg_first_lb = v->first_lb,
                            .seg_bt_off = v->bt_off,
                            .seg_bt_len = v->bt_len,
                            .block_table = v->bt,
                            .bt_entries = st->n_bt,
                            .cache = v->swa,
                            .block_size = L->bs,
                            .n_blocks = L->swa_blocks,
                            .stride = stride,
                            .sink = v->sink,
                            .rope = L->rope,
                            .out = v->out,
                            .lse = v->lse,
                            .ratio = L->r,
                            .c_cache = v->c_cache,
                            .c_n_blocks = L->c_blocks,
                            .seg_c_first_lb = v->c_first_lb,
                            .seg_cbt_off = v->cbt_off,
                            .seg_cbt_len = v->cbt_len,
                            .c_block_table = v->cbt,
                            .c_bt_entries = st->n_cbt,
                            .c_sel = four ? v->sel : NULL,
                            .c_sel_stride = four ? sc->topk : 0};
}

/* The batch as the engine runs it: map_slots, qkv_insert, compress, indexer (ratio 4),
 * attention, then sync (only when every launch was accepted). The first refusal's code, or sync's.
 */
static int run_ops(dsv4_backend_t *be, const layer_t *L, const step_t *st, const view_t *v,
                   int *which) {
  ops_args_t o;
  ops_args(L, st, v, &o);
  int rc = be->ops->map_slots(be, &o.m);
  *which = 0;
  if (!rc && ++*which)
    rc = be->ops->qkv_insert(be, &o.i);
  if (!rc && ++*which)
    rc = be->ops->compress(be, &o.c);
  if (!rc && ++*which && L->r == 4)
    rc = be->ops->indexer(be, &o.x);
  if (!rc && ++*which)
    rc = be->ops->attention(be, &o.a);
  if (!rc && ++*which)
    rc = be->ops->sync(be);
  return rc;
}

/* The reference: the CPU backend on host memory (its state in L). */
static void run_cpu(dsv4_backend_t *cpu, layer_t *L, const step_t *st, outs_t *o) {
  int64_t *slots = inv_alloc(st->n * sizeof(int64_t));
  view_t v = {st->pos, st->p0,     st->first_lb, st->c_first_lb, st->tok_seg, st->bt,
              st->cbt, st->slot,   st->bt_off,   st->bt_len,     st->cbt_off, st->cbt_len,
              st->q,   st->kv,     st->iq,       st->ckv,        st->ikv,     st->iw,
              L->ape,  L->norm,    L->i_ape,     L->i_norm,      L->kvw,      L->sink,
              L->swa,  L->c_cache, L->i_cache,   L->ring,        slots,       o->q_out,
              o->out,  o->lse,     o->sel};
  int which, rc = run_ops(cpu, L, st, &v, &which);
  if (rc)
    die("[%s] the cpu backend refused a batch (launch %d): %s", L->sc->name, which,
        dsv4_strerror(rc));
  free(slots);
}

/* Differing bytes of one output or state, reporting the first. */
static size_t diff(const void *got, const void *want, size_t n, const char *what, const char *name,
                   int step) {
  const uint8_t *g = got, *w = want;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++)
    if (g[i] != w[i] && bad++ == 0)
      first = i;
  if (bad)
    fprintf(stderr,
            "MISMATCH [%s] batch %d: %s differs from the CPU backend in %zu of %zu bytes, first at "
            "byte %zu (got 0x%02x, cpu 0x%02x)\n",
            name, step, what, bad, n, first, g[first], w[first]);
  return bad;
}

/* The outputs of a batch and the states after it, against the CPU's; q_out and the SWA cache only
 * when the device computed them (whole). */
static size_t compare(const layer_t *L, const step_t *st, const outs_t *got, const outs_t *want,
                      const uint8_t *swa, const uint8_t *c_cache, const uint8_t *i_cache,
                      const float *ring, int whole, int step) {
  const char *name = L->sc->name;
  size_t qb = (size_t)st->n * L->sc->heads * DSV4_HEAD_DIM * 2;
  size_t bad = diff(c_cache, L->c_cache, L->c_bytes, "c_cache (the entries)", name, step);
  bad += diff(ring, L->ring, L->ring_bytes, "ring", name, step);
  if (L->r == 4) {
    bad += diff(i_cache, L->i_cache, L->i_bytes, "i_cache (the index records)", name, step);
    bad += diff(got->sel, want->sel, (size_t)st->n * L->sc->topk * 4, "sel", name, step);
  }
  bad += diff(got->out, want->out, qb, "attn", name, step);
  bad += diff(got->lse, want->lse, (size_t)st->n * L->sc->heads * 4, "lse", name, step);
  if (whole) {
    bad += diff(got->q_out, want->q_out, qb, "q_out", name, step);
    bad += diff(swa, L->swa, L->swa_bytes, "swa cache", name, step);
  }
  return bad;
}

/* One line per batch: what it exercised (emissions, tokens that score, the longest candidate
 * list) and the verdict. */
static void step_report(const layer_t *L, const step_t *st, int k, size_t bad) {
  uint32_t emits = 0, scoring = 0;
  int64_t longest = 0;
  for (uint32_t t = 0; t < st->n; t++) {
    int64_t p = st->pos[t], p0 = st->p0[st->tok_seg[t]];
    int64_t visible = (p + 1) / L->r - p0 / L->r;
    int64_t window = p - (p - (DSV4_WINDOW - 1) > p0 ? p - (DSV4_WINDOW - 1) : p0) + 1;
    emits += (p + 1) % L->r == 0;
    scoring += L->r == 4 && visible > L->sc->topk;
    if (L->r == 4 && visible > L->sc->topk)
      visible = L->sc->topk;
    longest = window + visible > longest ? window + visible : longest;
  }
  printf("%-48s batch %d: %3u tokens, %u segments, %3u emissions, %3u scoring, longest list %3lld: "
         "%s\n",
         L->sc->name, k, st->n, st->n_seg, emits, scoring, (long long)longest,
         bad ? "DIFFERENT from the cpu backend" : "byte-identical to the cpu backend");
}

/* ---- the OpenCL side ---- */

typedef struct {
  cl_device_id dev;
  cl_context ctx;
  cl_command_queue queue;
  cl_program prog;
  cl_kernel c_check, c_emit, c_ring, i_check, i_select, a_check, a_c_check, attn;
} clrt_t;

static void check_cl(cl_int err, const char *what) {
  if (err != CL_SUCCESS)
    die("%s failed (OpenCL error %d)", what, (int)err);
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f)
    die("cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = inv_alloc((size_t)n + 1);
  if (n < 0 || fread(s, 1, (size_t)n, f) != (size_t)n)
    die("cannot read %s", path);
  s[n] = '\0';
  fclose(f);
  *len = (size_t)n;
  return s;
}

static cl_kernel kernel(clrt_t *rt, const char *name) {
  cl_int err;
  cl_kernel k = clCreateKernel(rt->prog, name, &err);
  check_cl(err, name);
  return k;
}

/* 0, or 77 when there is no OpenCL device (or no fp64 when it is needed). */
static int clrt_open(clrt_t *rt, const char *defines, int need_fp64) {
  cl_platform_id plats[8];
  cl_uint n_plats = 0, n_dev = 0;
  if (clGetPlatformIDs(8, plats, &n_plats) != CL_SUCCESS || n_plats == 0) {
    printf("skipped: no OpenCL platform\n");
    return 77;
  }
  for (cl_uint i = 0; i < n_plats && n_dev == 0; i++)
    if (clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, 1, &rt->dev, &n_dev) != CL_SUCCESS)
      n_dev = 0;
  if (n_dev == 0) {
    printf("skipped: no OpenCL device\n");
    return 77;
  }
  cl_device_fp_config fp64 = 0;
  (void)clGetDeviceInfo(rt->dev, CL_DEVICE_DOUBLE_FP_CONFIG, sizeof(fp64), &fp64, NULL);
  if (need_fp64 && !fp64) {
    printf("skipped: the OpenCL device has no fp64\n");
    return 77;
  }
  cl_int err;
  rt->ctx = clCreateContext(NULL, 1, &rt->dev, NULL, NULL, &err);
  check_cl(err, "clCreateContext");
  rt->queue = clCreateCommandQueue(rt->ctx, rt->dev, 0, &err); /* in order */
  check_cl(err, "clCreateCommandQueue");
  size_t len;
  char *src = read_file(DSV4_LZ_CL_SOURCE, &len);
  const char *srcs[] = {src};
  rt->prog = clCreateProgramWithSource(rt->ctx, 1, srcs, &len, &err);
  check_cl(err, "clCreateProgramWithSource");
  char opts[1024];
  snprintf(opts, sizeof(opts), "-cl-std=CL1.2 -cl-fp32-correctly-rounded-divide-sqrt -I%s %s",
           DSV4_LZ_KERNELS_DIR, defines);
  if (clBuildProgram(rt->prog, 1, &rt->dev, opts, NULL, NULL) != CL_SUCCESS) {
    static char log[1 << 16];
    clGetProgramBuildInfo(rt->prog, rt->dev, CL_PROGRAM_BUILD_LOG, sizeof(log), log, NULL);
    die("clBuildProgram (%s) failed:\n%s", opts, log);
  }
  printf("built %s with: %s\n", DSV4_LZ_CL_SOURCE, opts);
  free(src);
  rt->c_check = kernel(rt, DSV4_LZ_COMP_CHECK_KERNEL);
  rt->c_emit = kernel(rt, DSV4_LZ_COMP_EMIT_KERNEL);
  rt->c_ring = kernel(rt, DSV4_LZ_COMP_RING_KERNEL);
  rt->i_check = kernel(rt, DSV4_LZ_INDEX_CHECK_KERNEL);
  rt->i_select = kernel(rt, DSV4_LZ_INDEX_KERNEL);
  rt->a_check = kernel(rt, DSV4_LZ_ATTN_CHECK_KERNEL);
  rt->a_c_check = kernel(rt, DSV4_LZ_ATTN_C_CHECK_KERNEL);
  rt->attn = kernel(rt, DSV4_LZ_ATTN_KERNEL);
  return 0;
}

static void clrt_close(clrt_t *rt) {
  cl_kernel all[] = {rt->c_check,  rt->c_emit,  rt->c_ring,    rt->i_check,
                     rt->i_select, rt->a_check, rt->a_c_check, rt->attn};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    clReleaseKernel(all[i]);
  clReleaseProgram(rt->prog);
  clReleaseCommandQueue(rt->queue);
  clReleaseContext(rt->ctx);
}

static cl_mem buf_from(clrt_t *rt, const void *host, size_t n) {
  cl_int err;
  cl_mem m = clCreateBuffer(rt->ctx, CL_MEM_READ_WRITE | (host ? CL_MEM_COPY_HOST_PTR : 0),
                            n ? n : 1, n ? (void *)host : NULL, &err);
  check_cl(err, "clCreateBuffer");
  return m;
}

static cl_mem buf_zero(clrt_t *rt, size_t n) {
  void *z = calloc(1, n ? n : 1);
  if (!z)
    die("out of memory");
  cl_mem m = buf_from(rt, z, n ? n : 1);
  free(z);
  return m;
}

static void read_buf(clrt_t *rt, cl_mem m, void *dst, size_t n) {
  check_cl(clEnqueueReadBuffer(rt->queue, m, CL_TRUE, 0, n, dst, 0, NULL, NULL), "read");
}

/* Kernel arguments as (size, value) pairs, in the order of lz_kernels.h. */
typedef struct {
  size_t size;
  const void *value;
} karg_t;

/* clang-format off */
#define KU32(v) {sizeof(cl_uint), &(cl_uint){(v)}}
#define KU64(v) {sizeof(cl_ulong), &(cl_ulong){(v)}}
#define KI64(v) {sizeof(cl_long), &(cl_long){(v)}}
#define KF32(v) {sizeof(cl_float), &(cl_float){(v)}}
#define KMEM(m) {sizeof(cl_mem), &(m)}
/* clang-format on */

static void set_args(cl_kernel k, cl_uint first, const karg_t *a, cl_uint n) {
  for (cl_uint i = 0; i < n; i++) {
    cl_int err = clSetKernelArg(k, first + i, a[i].size, a[i].value);
    if (err != CL_SUCCESS)
      die("clSetKernelArg %u failed (%d)", first + i, (int)err);
  }
}

static void launch(clrt_t *rt, cl_kernel k, size_t groups, size_t local) {
  size_t global = groups * local;
  check_cl(clEnqueueNDRangeKernel(rt->queue, k, 1, NULL, &global, &local, 0, NULL, NULL), "launch");
  /* SPEC §5.2: each launch after the one before (the queue is in order; the barrier says so). */
  check_cl(clEnqueueBarrierWithWaitList(rt->queue, 0, NULL, NULL), "barrier");
}

/* The device's state of a layer: the ring and caches it keeps from batch to batch. */
typedef struct {
  cl_mem ring, c_cache, i_cache, ape, norm, i_ape, i_norm, sink;
} cl_layer_t;

/* The device copies of one batch's arrays. */
typedef struct {
  cl_mem pos, tok_seg, p0, slot, first_lb, bt_off, bt_len, bt, c_first_lb, cbt_off, cbt_len, cbt;
  cl_mem ckv, ikv, iq, iw, q_out, swa, rope_rows, emit_tok, emit_rope, seen, err, sel, out, lse;
  uint32_t n_emit;
} cl_step_t;

static void cl_step_make(clrt_t *rt, const layer_t *L, const step_t *st, const uint16_t *q_out,
                         const int32_t *sel_in, cl_step_t *d) {
  uint32_t n = st->n, ns = st->n_seg, ih = L->sc->ih ? L->sc->ih : 1;
  d->pos = buf_from(rt, st->pos, n * 8);
  d->tok_seg = buf_from(rt, st->tok_seg, n * 4);
  d->p0 = buf_from(rt, st->p0, ns * 8);
  d->slot = buf_from(rt, st->slot, ns * 4);
  d->first_lb = buf_from(rt, st->first_lb, ns * 8);
  d->bt_off = buf_from(rt, st->bt_off, ns * 4);
  d->bt_len = buf_from(rt, st->bt_len, ns * 4);
  d->bt = buf_from(rt, st->bt, st->n_bt * 4);
  d->c_first_lb = buf_from(rt, st->c_first_lb, ns * 8);
  d->cbt_off = buf_from(rt, st->cbt_off, ns * 4);
  d->cbt_len = buf_from(rt, st->cbt_len, ns * 4);
  d->cbt = buf_from(rt, st->cbt, st->n_cbt * 4);
  d->ckv = buf_from(rt, st->ckv, (size_t)n * 2 * L->coff * DSV4_HEAD_DIM * 4);
  d->ikv = buf_from(rt, st->ikv, (size_t)n * 512 * 4);
  d->iq = buf_from(rt, st->iq, (size_t)n * ih * INDEX_DIM * 2);
  d->iw = buf_from(rt, st->iw, (size_t)n * ih * 4);
  /* Attention reads the CPU's q_out and SWA cache (the insert is lz_kernels_test's). */
  d->q_out = buf_from(rt, q_out, (size_t)n * L->sc->heads * DSV4_HEAD_DIM * 2);
  d->swa = buf_from(rt, L->swa, L->swa_bytes);
  /* The host's part, as the glue does it: each token's RoPE row, and the emissions with the rows
   * of their entries' first positions. */
  float *rows = inv_alloc((size_t)n * DSV4_ROPE_ROW_FLOATS * 4);
  float *erows = inv_alloc((size_t)n * DSV4_ROPE_ROW_FLOATS * 4);
  uint32_t *etok = inv_alloc(n * 4);
  d->n_emit = 0;
  for (uint32_t t = 0; t < n; t++) {
    memcpy(rows + t * DSV4_ROPE_ROW_FLOATS, dsv4_rope_table_row(L->rope, st->pos[t]),
           DSV4_ROPE_ROW_FLOATS * 4);
    if ((st->pos[t] + 1) % L->r)
      continue;
    memcpy(erows + d->n_emit * DSV4_ROPE_ROW_FLOATS,
           dsv4_rope_table_row(L->rope, st->pos[t] / L->r * L->r), DSV4_ROPE_ROW_FLOATS * 4);
    etok[d->n_emit++] = t;
  }
  d->rope_rows = buf_from(rt, rows, (size_t)n * DSV4_ROPE_ROW_FLOATS * 4);
  d->emit_rope =
      buf_from(rt, erows, (size_t)(d->n_emit ? d->n_emit : 1) * DSV4_ROPE_ROW_FLOATS * 4);
  d->emit_tok = buf_from(rt, etok, (d->n_emit ? d->n_emit : 1) * 4);
  free(rows);
  free(erows);
  free(etok);
  d->seen = buf_zero(rt, ((size_t)ns + N_SLOTS) * 4);
  d->err = buf_zero(rt, 4);
  size_t qb = (size_t)n * L->sc->heads * DSV4_HEAD_DIM * 2;
  uint8_t *junk = inv_alloc(qb);
  memset(junk, JUNK, qb);
  d->out = buf_from(rt, junk, qb);
  d->lse = buf_from(rt, junk, (size_t)n * L->sc->heads * 4);
  d->sel = buf_from(rt, sel_in ? (const void *)sel_in : junk,
                    (size_t)n * (L->sc->topk ? L->sc->topk : 1) * 4);
  free(junk);
}

static void cl_step_free(cl_step_t *d) {
  cl_mem all[] = {d->pos,       d->tok_seg,  d->p0,         d->slot,    d->first_lb, d->bt_off,
                  d->bt_len,    d->bt,       d->c_first_lb, d->cbt_off, d->cbt_len,  d->cbt,
                  d->ckv,       d->ikv,      d->iq,         d->iw,      d->q_out,    d->swa,
                  d->rope_rows, d->emit_tok, d->emit_rope,  d->seen,    d->err,      d->sel,
                  d->out,       d->lse};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    clReleaseMemObject(all[i]);
}

/* Work-groups per launch of the split launches: odd sizes, so that e0 and t0 are exercised. */
#define SPLIT 5

/* The compressor: check, emissions (in launches of SPLIT groups), ring rows (likewise). */
static void cl_compress(clrt_t *rt, const layer_t *L, const step_t *st, cl_layer_t *c,
                        cl_step_t *d) {
  uint32_t n = st->n, ns = st->n_seg;
  const karg_t check[] = {
      KU32(n),
      KU32(ns),
      KU32(L->r),
      KU32(L->bs),
      KU32(N_SLOTS),
      KU32(L->c_blocks),
      KU32(st->n_cbt),
      KI64(dsv4_rope_table_positions(L->rope)),
      KMEM(d->pos),
      KMEM(d->tok_seg),
      KMEM(d->p0),
      KMEM(d->slot),
      KMEM(d->c_first_lb),
      KMEM(d->cbt_off),
      KMEM(d->cbt_len),
      KMEM(d->cbt),
      KMEM(d->seen),
      KMEM(d->err),
  };
  set_args(rt->c_check, 0, check, DSV4_LZ_COMP_CHECK_NARGS);
  uint32_t items = n > ns ? n : ns;
  launch(rt, rt->c_check, (items + DSV4_LZ_MAP_GROUP_SIZE - 1) / DSV4_LZ_MAP_GROUP_SIZE,
         DSV4_LZ_MAP_GROUP_SIZE);
  const karg_t emit[] = {
      KU32(d->n_emit),     KMEM(d->emit_tok), KMEM(d->emit_rope), KU32(L->r),
      KMEM(d->pos),        KMEM(d->tok_seg),  KMEM(d->p0),        KMEM(d->slot),
      KMEM(d->ckv),        KMEM(d->ikv),      KMEM(c->ring),      KMEM(c->ape),
      KMEM(c->norm),       KMEM(c->i_ape),    KMEM(c->i_norm),    KF32(1e-6f),
      KMEM(d->c_first_lb), KMEM(d->cbt_off),  KMEM(d->cbt),       KU32(L->c_blocks),
      KMEM(c->c_cache),    KMEM(c->i_cache),  KU32(L->bs),        KU64(DSV4_BLOCK_STRIDE(L->bs)),
      KMEM(d->err),
  };
  set_args(rt->c_emit, 1, emit, DSV4_LZ_COMP_EMIT_NARGS - 1);
  for (uint32_t e0 = 0; e0 < d->n_emit; e0 += SPLIT) {
    set_args(rt->c_emit, 0, (karg_t[]){KU32(e0)}, 1);
    launch(rt, rt->c_emit, d->n_emit - e0 < SPLIT ? d->n_emit - e0 : SPLIT, DSV4_LZ_GROUP_SIZE);
  }
  const karg_t ring[] = {
      KU32(n),      KU32(L->r),    KMEM(d->pos), KMEM(d->tok_seg), KMEM(d->slot), KMEM(d->ckv),
      KMEM(d->ikv), KMEM(c->ring), KMEM(c->ape), KMEM(c->i_ape),   KMEM(d->err),
  };
  set_args(rt->c_ring, 1, ring, DSV4_LZ_COMP_RING_NARGS - 1);
  for (uint32_t t0 = 0; t0 < n; t0 += SPLIT * 7) {
    set_args(rt->c_ring, 0, (karg_t[]){KU32(t0)}, 1);
    launch(rt, rt->c_ring, n - t0 < SPLIT * 7 ? n - t0 : SPLIT * 7, DSV4_LZ_GROUP_SIZE);
  }
}

/* The indexer: check, then the selection in a few groups that take several tokens each. */
static void cl_indexer(clrt_t *rt, const layer_t *L, const step_t *st, cl_layer_t *c,
                       cl_step_t *d) {
  const scen_t *sc = L->sc;
  uint32_t n = st->n, ns = st->n_seg;
  const karg_t check[] = {
      KU32(n),
      KU32(ns),
      KU32(sc->topk),
      KU32(L->bs),
      KU32(L->c_blocks),
      KU32(st->n_cbt),
      KI64(dsv4_rope_table_positions(L->rope)),
      KMEM(d->pos),
      KMEM(d->tok_seg),
      KMEM(d->p0),
      KMEM(d->c_first_lb),
      KMEM(d->cbt_off),
      KMEM(d->cbt_len),
      KMEM(d->cbt),
      KMEM(d->err),
  };
  set_args(rt->i_check, 0, check, DSV4_LZ_INDEX_CHECK_NARGS);
  uint32_t items = n > ns ? n : ns;
  launch(rt, rt->i_check, (items + DSV4_LZ_MAP_GROUP_SIZE - 1) / DSV4_LZ_MAP_GROUP_SIZE,
         DSV4_LZ_MAP_GROUP_SIZE);
  uint64_t keys = 1;
  for (uint32_t t = 0; t < n; t++)
    keys = (uint64_t)(st->pos[t] + 1) / 4 > keys ? (uint64_t)(st->pos[t] + 1) / 4 : keys;
  uint32_t g = n < 7 ? n : 7;
  cl_mem kbuf = buf_zero(rt, (size_t)g * keys * 4);
  cl_mem qbuf = buf_zero(rt, (size_t)g * DSV4_LZ_QHAT_FLOATS(sc->ih) * 4);
  const karg_t sel[] = {
      KU32(n),
      KU32(sc->topk),
      KU32(sc->ih),
      KF32((float)(1.0 / sqrt(128.0 * sc->ih))),
      KMEM(d->pos),
      KMEM(d->tok_seg),
      KMEM(d->p0),
      KMEM(d->iq),
      KMEM(d->iw),
      KMEM(d->rope_rows),
      KMEM(d->c_first_lb),
      KMEM(d->cbt_off),
      KMEM(d->cbt),
      KMEM(c->i_cache),
      KU32(L->bs),
      KMEM(d->sel),
      KMEM(kbuf),
      KU64(keys),
      KMEM(qbuf),
      KMEM(d->err),
  };
  set_args(rt->i_select, 0, sel, DSV4_LZ_INDEX_NARGS);
  launch(rt, rt->i_select, g, DSV4_LZ_GROUP_SIZE);
  check_cl(clFinish(rt->queue), "clFinish");
  clReleaseMemObject(kbuf);
  clReleaseMemObject(qbuf);
}

/* Attention: the SWA check, the compressed candidates' check, the rows (in launches of a few
 * groups). */
static void cl_attention(clrt_t *rt, const layer_t *L, const step_t *st, cl_layer_t *c,
                         cl_step_t *d) {
  const scen_t *sc = L->sc;
  uint32_t n = st->n, ns = st->n_seg, sel_stride = L->r == 4 ? sc->topk : 0;
  const karg_t check[] = {
      KU32(n),          KU32(ns),       KU32(L->bs),       KU32(L->swa_blocks), KMEM(d->pos),
      KMEM(d->tok_seg), KMEM(d->p0),    KMEM(d->first_lb), KMEM(d->bt_off),     KMEM(d->bt_len),
      KMEM(d->bt),      KU32(st->n_bt), KMEM(d->err),
  };
  set_args(rt->a_check, 0, check, DSV4_LZ_ATTN_CHECK_NARGS);
  size_t groups = ((n > ns ? n : ns) + DSV4_LZ_MAP_GROUP_SIZE - 1) / DSV4_LZ_MAP_GROUP_SIZE;
  launch(rt, rt->a_check, groups, DSV4_LZ_MAP_GROUP_SIZE);
  const karg_t c_check[] = {
      KU32(n),          KU32(ns),         KU32(L->r),       KU32(L->bs),  KU32(L->c_blocks),
      KU32(st->n_cbt),  KMEM(d->pos),     KMEM(d->tok_seg), KMEM(d->p0),  KMEM(d->c_first_lb),
      KMEM(d->cbt_off), KMEM(d->cbt_len), KMEM(d->cbt),     KMEM(d->sel), KU32(sel_stride),
      KMEM(d->err),
  };
  set_args(rt->a_c_check, 0, c_check, DSV4_LZ_ATTN_C_CHECK_NARGS);
  launch(rt, rt->a_c_check, groups, DSV4_LZ_MAP_GROUP_SIZE);
  uint32_t rows = n * sc->heads;
  const karg_t attn[] = {
      KU32(rows),          KU32(sc->heads),  KMEM(d->q_out),
      KMEM(d->pos),        KMEM(d->tok_seg), KMEM(d->p0),
      KMEM(d->first_lb),   KMEM(d->bt_off),  KMEM(d->bt),
      KMEM(d->swa),        KU32(L->bs),      KU64(DSV4_BLOCK_STRIDE(L->bs)),
      KMEM(c->sink),       KU32(1),          KMEM(d->rope_rows),
      KMEM(d->out),        KMEM(d->lse),     KU32(1),
      KMEM(d->err),        KU32(L->r),       KMEM(c->c_cache),
      KMEM(d->c_first_lb), KMEM(d->cbt_off), KMEM(d->cbt),
      KMEM(d->sel),        KU32(sel_stride),
  };
  set_args(rt->attn, 1, attn, DSV4_LZ_ATTN_NARGS - 1);
  uint32_t per = DSV4_LZ_ROWS_PER_GROUP * 11;
  for (uint32_t row0 = 0; row0 < rows; row0 += per) {
    uint32_t chunk = rows - row0 < per ? rows - row0 : per;
    set_args(rt->attn, 0, (karg_t[]){KU32(row0)}, 1);
    launch(rt, rt->attn, (chunk + DSV4_LZ_ROWS_PER_GROUP - 1) / DSV4_LZ_ROWS_PER_GROUP,
           DSV4_LZ_GROUP_SIZE);
  }
}

static void cl_layer_make(clrt_t *rt, const layer_t *L, cl_layer_t *c) {
  c->ring = buf_from(rt, L->ring0, L->ring_bytes);
  c->c_cache = buf_from(rt, L->c0, L->c_bytes);
  c->i_cache = buf_from(rt, L->i0, L->i_bytes);
  c->ape = buf_from(rt, L->ape, (size_t)L->r * L->coff * DSV4_HEAD_DIM * 4);
  c->norm = buf_from(rt, L->norm, DSV4_HEAD_DIM * 4);
  c->i_ape = buf_from(rt, L->i_ape, 4 * 256 * 4);
  c->i_norm = buf_from(rt, L->i_norm, INDEX_DIM * 4);
  c->sink = buf_from(rt, L->sink, DSV4_MAX_HEADS * 4);
}

static void cl_layer_free(cl_layer_t *c) {
  cl_mem all[] = {c->ring, c->c_cache, c->i_cache, c->ape, c->norm, c->i_ape, c->i_norm, c->sink};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    clReleaseMemObject(all[i]);
}

/* The device's state and outputs after a batch, read back. */
typedef struct {
  uint8_t *c_cache, *i_cache;
  float *ring;
  uint32_t err;
} cl_state_t;

/* A batch on the kernels: the compressor, the indexer (ratio 4) and attention over q_out (the
 * insert's) and the layer's SWA cache; or, given sel_in, attention alone over that selection. */
static void cl_run(clrt_t *rt, const layer_t *L, const step_t *st, const uint16_t *q_out,
                   const int32_t *sel_in, cl_layer_t *c, outs_t *got, cl_state_t *s) {
  cl_step_t d;
  cl_step_make(rt, L, st, q_out, sel_in, &d);
  if (!sel_in)
    cl_compress(rt, L, st, c, &d);
  if (!sel_in && L->r == 4)
    cl_indexer(rt, L, st, c, &d);
  cl_attention(rt, L, st, c, &d);
  size_t qb = (size_t)st->n * L->sc->heads * DSV4_HEAD_DIM * 2;
  read_buf(rt, d.out, got->out, qb);
  read_buf(rt, d.lse, got->lse, (size_t)st->n * L->sc->heads * 4);
  read_buf(rt, d.sel, got->sel, (size_t)st->n * (L->sc->topk ? L->sc->topk : 1) * 4);
  read_buf(rt, d.err, &s->err, 4);
  read_buf(rt, c->ring, s->ring, L->ring_bytes);
  read_buf(rt, c->c_cache, s->c_cache, L->c_bytes);
  read_buf(rt, c->i_cache, s->i_cache, L->i_bytes);
  cl_step_free(&d);
}

static int opencl_main(const char *defines, int fp64) {
  clrt_t rt;
  memset(&rt, 0, sizeof(rt));
  int rc = clrt_open(&rt, defines, fp64);
  if (rc)
    return rc;
  dsv4_backend_options_t opt = {.threads = 2};
  dsv4_backend_t *cpu = NULL;
  char why[256];
  if (dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)) != 0)
    die("cannot open the cpu backend: %s", why);
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *yarn = NULL;
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &yarn) != 0)
    die("rope table");
  size_t bad = 0, batches = 0;
  for (size_t si = 0; si < sizeof(scenarios) / sizeof(scenarios[0]) && !bad; si++) {
    layer_t L;
    layer_init(&L, &scenarios[si], yarn);
    cl_layer_t c;
    cl_layer_make(&rt, &L, &c);
    cl_state_t s = {inv_alloc(L.c_bytes), inv_alloc(L.i_bytes), inv_alloc(L.ring_bytes), 0};
    for (int k = 0; k < MAX_STEPS && L.sc->steps[k][0].len && !bad; k++, batches++) {
      step_t st;
      step_make(&L, k, &st);
      outs_t want, got;
      outs_alloc(&want, &L, &st);
      outs_alloc(&got, &L, &st);
      run_cpu(cpu, &L, &st, &want);
      cl_run(&rt, &L, &st, want.q_out, NULL, &c, &got, &s);
      if (s.err)
        die("[%s] batch %d: the kernels set error bits 0x%x on a valid batch", L.sc->name, k,
            s.err);
      bad += compare(&L, &st, &got, &want, NULL, s.c_cache, s.i_cache, s.ring, 0, k);
      step_report(&L, &st, k, bad);
      outs_free(&want);
      outs_free(&got);
      step_free(&st);
    }
    free(s.c_cache);
    free(s.i_cache);
    free(s.ring);
    cl_layer_free(&c);
    layer_free(&L);
  }
  dsv4_backend_close(cpu);
  dsv4_rope_table_destroy(yarn);
  clrt_close(&rt);
  if (bad) {
    fprintf(stderr, "FAIL: %zu bytes differ from the cpu backend\n", bad);
    return 1;
  }
  printf("PASS: %zu batches byte-identical to the cpu backend\n", batches);
  return 0;
}

/* ---- refusals (SPEC §8.8: a refused launch changes nothing) ---- */

/* History (batch 0), then batch 1 broken one way. At ratio 4 sequence 0's batch 1 emits into its
 * second entry block and scores over both (topk 4). */
static const scen_t err_scen[] = {
    {"errors, ratio 4", 4, 16, 4, 4, 4, 2, {0, 6}, {1, 3}, {{{0, 90}, {1, 30}}, {{0, 6}, {1, 5}}}},
    {"errors, ratio 128", 128, 16, 4, 0, 0, 1, {0}, {2}, {{{0, 200}}, {{0, 3}}}},
};

enum { SEL_NONE, SEL_VALID, SEL_HIDDEN, SEL_ORDER }; /* attention alone over a given selection */

typedef struct {
  const char *what;
  int scen, sel;
  uint32_t bit; /* 0: the valid batch, which must write */
  /* 1: refused after the compressor, whose launch was valid and stands (as on the CPU backend,
   * whose compress op accepts what only its indexer or attention refuses). */
  int late;
} err_case_t;

static const err_case_t err_cases[] = {
    {"the valid batch", 0, SEL_NONE, 0, 0},
    {"a segment index out of range", 0, SEL_NONE, DSV4_LZ_ERR_SEGMENT, 0},
    {"a position before its sequence's p0", 0, SEL_NONE, DSV4_LZ_ERR_POSITION, 0},
    {"a gap between a segment's positions", 0, SEL_NONE, DSV4_LZ_ERR_POSITION, 0},
    {"a segment in two runs", 0, SEL_NONE, DSV4_LZ_ERR_SEGMENT, 0},
    {"two segments on one state slot", 0, SEL_NONE, DSV4_LZ_ERR_STATE, 0},
    {"a state slot beyond the pool", 0, SEL_NONE, DSV4_LZ_ERR_STATE, 0},
    {"an emission's block entry of -1", 0, SEL_NONE, DSV4_LZ_ERR_MISSING, 0},
    {"an emission's block id beyond the pool", 0, SEL_NONE, DSV4_LZ_ERR_BLOCK, 0},
    {"an entry table past its length", 0, SEL_NONE, DSV4_LZ_ERR_TABLE, 0},
    {"a scored entry's block entry of -1", 0, SEL_NONE, DSV4_LZ_ERR_MISSING, 1},
    {"the valid batch, attention over a given selection", 0, SEL_VALID, 0, 0},
    {"a selected entry that is not visible", 0, SEL_HIDDEN, DSV4_LZ_ERR_ENTRY, 0},
    {"a selection not in increasing order", 0, SEL_ORDER, DSV4_LZ_ERR_ENTRY, 0},
    {"a selected entry's block entry of -1", 0, SEL_VALID, DSV4_LZ_ERR_MISSING, 0},
    {"the valid batch at ratio 128", 1, SEL_NONE, 0, 0},
    {"a visible entry's block entry of -1 at ratio 128", 1, SEL_NONE, DSV4_LZ_ERR_MISSING, 1},
};

/* Breaks batch 1 (2 segments at ratio 4: tokens 0..5 of sequence 0 at 90..95, 6..10 of sequence
 * 1 at 36..40) the way case i says. */
static void err_break(const layer_t *L, step_t *st, size_t i) {
  switch (i) {
  case 1:
    st->tok_seg[2] = (int32_t)st->n_seg;
    break;
  case 2:
    st->p0[1] = st->pos[6] + 1;
    break;
  case 3:
    st->pos[3] += 1;
    break;
  case 4: { /* token 5 of sequence 0 moves behind sequence 1's tokens */
    int64_t p = st->pos[5];
    for (uint32_t t = 5; t + 1 < st->n; t++) {
      st->pos[t] = st->pos[t + 1];
      st->tok_seg[t] = st->tok_seg[t + 1];
    }
    st->pos[st->n - 1] = p;
    st->tok_seg[st->n - 1] = 0;
    break;
  }
  case 5:
    st->slot[1] = st->slot[0];
    break;
  case 6:
    st->slot[0] = N_SLOTS;
    break;
  case 7:
  case 8: /* entries 22 and 23 live in sequence 0's second entry block */
    st->cbt[st->cbt_off[0] + 1] = i == 7 ? -1 : (int32_t)L->c_blocks;
    break;
  case 9:
    st->n_cbt = st->cbt_off[1] + st->cbt_len[1] - 1;
    break;
  case 10: /* entries 0..15: scored by every token of sequence 0, emitted by none */
  case 14:
  case 16:
    st->cbt[st->cbt_off[0]] = -1;
    break;
  }
}

/* A selection for attention alone: each token's first visible entries (broken as sel says). */
static int32_t *err_selection(const layer_t *L, const step_t *st, int sel) {
  uint32_t k = L->sc->topk;
  int32_t *out = inv_alloc((size_t)st->n * k * sizeof(int32_t));
  for (uint32_t t = 0; t < st->n; t++) {
    int64_t jlo = st->p0[st->tok_seg[t]] / 4, jhi = (st->pos[t] + 1) / 4;
    for (uint32_t i = 0; i < k; i++)
      out[t * k + i] = jlo + i < jhi ? (int32_t)(jlo + i) : -1;
  }
  if (sel == SEL_HIDDEN)
    out[1] = (int32_t)((st->pos[0] + 1) / 4);
  else if (sel == SEL_ORDER)
    out[1] = out[0];
  return out;
}

/* Every byte of n at p is JUNK: nothing was written there. */
static int untouched(const void *p, size_t n) {
  const uint8_t *u = p;
  for (size_t i = 0; i < n; i++)
    if (u[i] != JUNK)
      return 0;
  return 1;
}

static int errors_case(clrt_t *rt, dsv4_rope_table_t *rope, size_t i) {
  const err_case_t *ec = &err_cases[i];
  layer_t L;
  layer_init(&L, &err_scen[ec->scen], rope);
  cl_layer_t c;
  cl_layer_make(rt, &L, &c);
  cl_state_t s = {inv_alloc(L.c_bytes), inv_alloc(L.i_bytes), inv_alloc(L.ring_bytes), 0};
  uint16_t *q = inv_alloc((size_t)400 * L.sc->heads * DSV4_HEAD_DIM * 2);
  inv_fill_bf16(q, (size_t)400 * L.sc->heads * DSV4_HEAD_DIM);
  step_t st;
  outs_t got;
  step_make(&L, 0, &st);
  outs_alloc(&got, &L, &st);
  cl_run(rt, &L, &st, q, NULL, &c, &got, &s);
  if (s.err)
    die("errors: the history of \"%s\" set error bits 0x%x", ec->what, s.err);
  outs_free(&got);
  step_free(&st);
  /* The state before the broken batch, against which nothing may change. */
  uint8_t *before[3] = {inv_alloc(L.c_bytes), inv_alloc(L.i_bytes), inv_alloc(L.ring_bytes)};
  memcpy(before[0], s.c_cache, L.c_bytes);
  memcpy(before[1], s.i_cache, L.i_bytes);
  memcpy(before[2], s.ring, L.ring_bytes);
  step_make(&L, 1, &st);
  err_break(&L, &st, i);
  int32_t *sel = ec->sel != SEL_NONE ? err_selection(&L, &st, ec->sel) : NULL;
  outs_alloc(&got, &L, &st);
  cl_run(rt, &L, &st, q, sel, &c, &got, &s);
  size_t qb = (size_t)st.n * L.sc->heads * DSV4_HEAD_DIM * 2, lb = (size_t)st.n * L.sc->heads * 4;
  int same = !memcmp(before[0], s.c_cache, L.c_bytes) && !memcmp(before[1], s.i_cache, L.i_bytes) &&
             !memcmp(before[2], s.ring, L.ring_bytes);
  int quiet =
      untouched(got.out, qb) && untouched(got.lse, lb) &&
      (L.r != 4 || ec->sel != SEL_NONE || untouched(got.sel, (size_t)st.n * L.sc->topk * 4));
  int fail = ec->bit ? !(s.err & ec->bit) || (!same && !ec->late) || !quiet
                     : s.err || untouched(got.out, qb) || (ec->sel == SEL_NONE && same);
  printf("errors: %-50s error word 0x%02x, state %s, outputs %s%s\n", ec->what, s.err,
         same ? "unchanged" : "changed", quiet ? "untouched" : "written", fail ? ": WRONG" : "");
  for (int k = 0; k < 3; k++)
    free(before[k]);
  free(sel);
  free(q);
  outs_free(&got);
  step_free(&st);
  free(s.c_cache);
  free(s.i_cache);
  free(s.ring);
  cl_layer_free(&c);
  layer_free(&L);
  return fail;
}

static int errors_main(void) {
  clrt_t rt;
  memset(&rt, 0, sizeof(rt));
  int rc = clrt_open(&rt, "", 0);
  if (rc)
    return rc;
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *yarn = NULL;
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &yarn) != 0)
    die("rope table");
  int failed = 0;
  for (size_t i = 0; i < sizeof(err_cases) / sizeof(err_cases[0]); i++)
    failed += errors_case(&rt, yarn, i);
  dsv4_rope_table_destroy(yarn);
  clrt_close(&rt);
  if (failed) {
    fprintf(stderr, "FAIL: %d cases\n", failed);
    return 1;
  }
  printf("PASS: compress-errors\n");
  return 0;
}

/* ---- through the level_zero backend ---- */

/* The device's buffers of a layer (its caches, ring and weights), kept from batch to batch. */
typedef struct {
  dsv4_devbuf_t swa, ring, c_cache, i_cache, ape, norm, i_ape, i_norm, kvw, sink;
} lz_layer_t;

static void dev_put(dsv4_backend_t *be, dsv4_devbuf_t *b, const void *src, size_t n) {
  if (be->ops->buf_alloc(be, n, b) != 0)
    die("level_zero buf_alloc(%zu)", n);
  if (src && be->ops->upload(be, b, 0, src, n) != 0)
    die("level_zero upload");
}

static void dev_get(dsv4_backend_t *be, void *dst, dsv4_devbuf_t *b, size_t n) {
  if (be->ops->download(be, dst, b, 0, n) != 0)
    die("level_zero download");
}

static void lz_layer_make(dsv4_backend_t *be, const layer_t *L, lz_layer_t *d) {
  dev_put(be, &d->swa, L->swa0, L->swa_bytes);
  dev_put(be, &d->ring, L->ring0, L->ring_bytes);
  dev_put(be, &d->c_cache, L->c0, L->c_bytes);
  dev_put(be, &d->i_cache, L->i0, L->i_bytes);
  dev_put(be, &d->ape, L->ape, (size_t)L->r * L->coff * DSV4_HEAD_DIM * 4);
  dev_put(be, &d->norm, L->norm, DSV4_HEAD_DIM * 4);
  dev_put(be, &d->i_ape, L->i_ape, 4 * 256 * 4);
  dev_put(be, &d->i_norm, L->i_norm, INDEX_DIM * 4);
  dev_put(be, &d->kvw, L->kvw, DSV4_HEAD_DIM * 4);
  dev_put(be, &d->sink, L->sink, DSV4_MAX_HEADS * 4);
}

static void lz_layer_free(dsv4_backend_t *be, lz_layer_t *d) {
  dsv4_devbuf_t *all[] = {&d->swa,  &d->ring,  &d->c_cache, &d->i_cache, &d->ape,
                          &d->norm, &d->i_ape, &d->i_norm,  &d->kvw,     &d->sink};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    be->ops->buf_free(be, all[i]);
}

/* The device's state and outputs after a batch. */
typedef struct {
  uint8_t *swa, *c_cache, *i_cache;
  float *ring;
} lz_state_t;

/*
 * One batch through the backend, as the engine runs it (run_ops), from fresh device copies of its
 * arrays; cbt, when not NULL, replaces the entry tables. The outputs start as JUNK. Returns the
 * first refusal's code (which launch in *which), and reads back the outputs and the state.
 */
static int lz_run(dsv4_backend_t *be, const layer_t *L, const step_t *st, const int32_t *cbt,
                  lz_layer_t *d, outs_t *got, lz_state_t *s, int *which) {
  uint32_t n = st->n, ns = st->n_seg, ih = L->sc->ih ? L->sc->ih : 1,
           k = L->sc->topk ? L->sc->topk : 1;
  size_t qb = (size_t)n * L->sc->heads * DSV4_HEAD_DIM * 2, lb = (size_t)n * L->sc->heads * 4;
  enum {
    POS,
    SEG,
    P0,
    SLOT,
    FLB,
    OFF,
    LEN,
    BT,
    CFLB,
    COFF,
    CLEN,
    CBT,
    Q,
    KV,
    IQ,
    CKV,
    IKV,
    IW,
    SLOTS,
    QOUT,
    OUT,
    LSE,
    SEL,
    N_BUF
  };
  const struct {
    const void *src;
    size_t size;
  } in[N_BUF] = {
      [POS] = {st->pos, n * 8},
      [SEG] = {st->tok_seg, n * 4},
      [P0] = {st->p0, ns * 8},
      [SLOT] = {st->slot, ns * 4},
      [FLB] = {st->first_lb, ns * 8},
      [OFF] = {st->bt_off, ns * 4},
      [LEN] = {st->bt_len, ns * 4},
      [BT] = {st->bt, st->n_bt * 4},
      [CFLB] = {st->c_first_lb, ns * 8},
      [COFF] = {st->cbt_off, ns * 4},
      [CLEN] = {st->cbt_len, ns * 4},
      [CBT] = {cbt ? cbt : st->cbt, st->n_cbt * 4},
      [Q] = {st->q, qb},
      [KV] = {st->kv, (size_t)n * DSV4_HEAD_DIM * 2},
      [IQ] = {st->iq, (size_t)n * ih * INDEX_DIM * 2},
      [CKV] = {st->ckv, (size_t)n * 2 * L->coff * DSV4_HEAD_DIM * 4},
      [IKV] = {st->ikv, (size_t)n * 512 * 4},
      [IW] = {st->iw, (size_t)n * ih * 4},
      [SLOTS] = {NULL, n * 8},
      [QOUT] = {got->q_out, qb},
      [OUT] = {got->out, qb},
      [LSE] = {got->lse, lb},
      [SEL] = {got->sel, (size_t)n * k * 4},
  };
  dsv4_devbuf_t b[N_BUF];
  memset(b, 0, sizeof(b));
  for (int i = 0; i < N_BUF; i++)
    dev_put(be, &b[i], in[i].src, in[i].size);
  view_t v = {b[POS].ptr, b[P0].ptr,      b[FLB].ptr,     b[CFLB].ptr,   b[SEG].ptr,   b[BT].ptr,
              b[CBT].ptr, b[SLOT].ptr,    b[OFF].ptr,     b[LEN].ptr,    b[COFF].ptr,  b[CLEN].ptr,
              b[Q].ptr,   b[KV].ptr,      b[IQ].ptr,      b[CKV].ptr,    b[IKV].ptr,   b[IW].ptr,
              d->ape.ptr, d->norm.ptr,    d->i_ape.ptr,   d->i_norm.ptr, d->kvw.ptr,   d->sink.ptr,
              d->swa.ptr, d->c_cache.ptr, d->i_cache.ptr, d->ring.ptr,   b[SLOTS].ptr, b[QOUT].ptr,
              b[OUT].ptr, b[LSE].ptr,     b[SEL].ptr};
  int rc = run_ops(be, L, st, &v, which);
  dev_get(be, got->q_out, &b[QOUT], qb);
  dev_get(be, got->out, &b[OUT], qb);
  dev_get(be, got->lse, &b[LSE], lb);
  dev_get(be, got->sel, &b[SEL], (size_t)n * k * 4);
  dev_get(be, s->swa, &d->swa, L->swa_bytes);
  dev_get(be, s->ring, &d->ring, L->ring_bytes);
  dev_get(be, s->c_cache, &d->c_cache, L->c_bytes);
  dev_get(be, s->i_cache, &d->i_cache, L->i_bytes);
  for (int i = 0; i < N_BUF; i++)
    be->ops->buf_free(be, &b[i]);
  return rc;
}

/* The batch with its first emission's entry block taken out of its table: every launch is
 * accepted, sync answers DSV4_EINVAL, and the entries, index records, ring and outputs keep
 * their bytes (the state is the CPU's before the batch). */
static size_t lz_refused(dsv4_backend_t *be, const layer_t *L, const step_t *st, lz_layer_t *d,
                         lz_state_t *s) {
  uint32_t t = 0;
  while (t < st->n && (st->pos[t] + 1) % L->r)
    t++;
  if (t == st->n)
    return 0;
  uint32_t g = (uint32_t)st->tok_seg[t];
  int32_t *cbt = inv_alloc(st->n_cbt * sizeof(int32_t));
  memcpy(cbt, st->cbt, st->n_cbt * sizeof(int32_t));
  cbt[st->cbt_off[g] + (st->pos[t] / L->r / L->bs - st->c_first_lb[g])] = -1;
  outs_t got;
  outs_alloc(&got, L, st);
  int which, rc = lz_run(be, L, st, cbt, d, &got, s, &which);
  size_t qb = (size_t)st->n * L->sc->heads * DSV4_HEAD_DIM * 2;
  size_t bad = rc != DSV4_EINVAL || which != 5;
  if (bad)
    fprintf(stderr, "REFUSAL [%s]: launch %d answered %d, expected the sync (5) and DSV4_EINVAL\n",
            L->sc->name, which, rc);
  bad += diff(s->c_cache, L->c_cache, L->c_bytes, "c_cache after a refusal", L->sc->name, -1);
  bad += diff(s->ring, L->ring, L->ring_bytes, "ring after a refusal", L->sc->name, -1);
  bad += diff(s->i_cache, L->i_cache, L->i_bytes, "i_cache after a refusal", L->sc->name, -1);
  bad += !untouched(got.out, qb) ||
         !untouched(got.sel, (size_t)st->n * (L->sc->topk ? L->sc->topk : 1) * 4);
  printf("%-48s refused: an emission's block missing: sync %s, entries, ring and outputs %s\n",
         L->sc->name, dsv4_strerror(rc), bad ? "CHANGED" : "unchanged");
  outs_free(&got);
  free(cbt);
  return bad;
}

/* The no-driver skip, or the backend (over the test double, or a GPU). */
static int lz_open(dsv4_backend_t **lz) {
  char why[512];
  int rc = dsv4_backend_open("level_zero", NULL, lz, why, sizeof(why));
#ifdef DSV4_LZ_FAKE_ZE
  cl_uint n_plats = 0;
  if (rc && (clGetPlatformIDs(0, NULL, &n_plats) != CL_SUCCESS || n_plats == 0)) {
    printf("skipped: no OpenCL platform for the Level Zero test double\n");
    return 77;
  }
#else
  if (rc && (!strncmp(why, "zeInit found no driver", 22) || !strncmp(why, "no driver", 9) ||
             !strncmp(why, "no GPU among", 12))) {
    printf("skipped: no Level Zero GPU: %s\n", why);
    return 77;
  }
#endif
  if (rc)
    die("the level_zero backend did not open: %s", why);
  if (!(*lz)->ops->compress || !(*lz)->ops->indexer)
    die("the level_zero backend has no compressed branch");
  return 0;
}

static size_t lz_scenario(dsv4_backend_t *lz, dsv4_backend_t *cpu, const scen_t *sc,
                          dsv4_rope_table_t *yarn, int refusals, size_t *batches) {
  layer_t L;
  layer_init(&L, sc, yarn);
  lz_layer_t d;
  lz_layer_make(lz, &L, &d);
  lz_state_t s = {inv_alloc(L.swa_bytes), inv_alloc(L.c_bytes), inv_alloc(L.i_bytes),
                  inv_alloc(L.ring_bytes)};
  size_t bad = 0;
  for (int k = 0; k < MAX_STEPS && sc->steps[k][0].len && !bad; k++, (*batches)++) {
    step_t st;
    step_make(&L, k, &st);
    if (refusals && k == 1)
      bad += lz_refused(lz, &L, &st, &d, &s);
    outs_t want, got;
    outs_alloc(&want, &L, &st);
    outs_alloc(&got, &L, &st);
    run_cpu(cpu, &L, &st, &want);
    int which, rc = lz_run(lz, &L, &st, NULL, &d, &got, &s, &which);
    if (rc)
      die("[%s] batch %d: level_zero refused it (launch %d): %s", sc->name, k, which,
          dsv4_strerror(rc));
    bad += compare(&L, &st, &got, &want, s.swa, s.c_cache, s.i_cache, s.ring, 1, k);
    step_report(&L, &st, k, bad);
    outs_free(&want);
    outs_free(&got);
    step_free(&st);
  }
  free(s.swa);
  free(s.c_cache);
  free(s.i_cache);
  free(s.ring);
  lz_layer_free(lz, &d);
  layer_free(&L);
  return bad;
}

/* The modes level-zero (every scenario, and the refusals) and level-zero-c128. */
static int level_zero_main(int only128) {
  dsv4_backend_t *lz = NULL, *cpu = NULL;
  int rc = lz_open(&lz);
  if (rc)
    return rc;
  dsv4_backend_options_t opt = {.threads = 2};
  char why[256];
  if (dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)) != 0)
    die("cannot open the cpu backend: %s", why);
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *yarn = NULL;
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &yarn) != 0)
    die("rope table");
  size_t bad = 0, batches = 0;
  for (size_t si = 0; si < sizeof(scenarios) / sizeof(scenarios[0]) && !bad; si++)
    if (!only128 || scenarios[si].ratio == 128)
      bad += lz_scenario(lz, cpu, &scenarios[si], yarn, !only128, &batches);
  dsv4_backend_close(cpu);
  dsv4_backend_close(lz);
  dsv4_rope_table_destroy(yarn);
#ifdef DSV4_LZ_FAKE_ZE
  if (fake_ze_live_allocations() != 0)
    die("%zu Level Zero allocations still alive after the backend was closed",
        fake_ze_live_allocations());
#endif
  if (bad) {
    fprintf(stderr, "FAIL: %zu bytes differ from the cpu backend\n", bad);
    return 1;
  }
  printf("PASS: %zu batches through the level_zero backend byte-identical to the cpu backend\n",
         batches);
  return 0;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "compress";
  if (!strcmp(mode, "compress"))
    return opencl_main("", 0);
  if (!strcmp(mode, "compress-fp64"))
    return opencl_main("-DDSV4_CL_RMS_FP64", 1);
  if (!strcmp(mode, "compress-errors"))
    return errors_main();
  if (!strcmp(mode, "level-zero") || !strcmp(mode, "level-zero-c128"))
    return level_zero_main(!strcmp(mode, "level-zero-c128"));
  die("unknown mode %s (compress, compress-fp64, compress-errors, level-zero, level-zero-c128)",
      mode);
}
