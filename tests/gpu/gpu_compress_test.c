/*
 * SPEC §8 on the GPU: the CUDA backend's compressed branch (compress, the indexer's selection and
 * attention over the union of the window and the compressed entries, exact mode) gives the CPU
 * backend's bytes. Both backends are opened by name and driven through their op tables with the
 * same batches: per batch map_slots, qkv_insert, compress, the indexer (ratio 4) and the union
 * attention; topk, attn and lse are compared after every batch, and at the end every byte of the
 * rings, the entry cache, the index cache and the SWA cache.
 *
 * Each case serves several sequences of one layer, some with p0 > 0, through a schedule of batches:
 * prefills in chunks that split windows, segments of different sequences in one batch, decode
 * steps across emissions. Ratio 4 with topk 512 and more visible entries (scored), topk 8 (scored
 * almost everywhere) and ratio 128 with entries across several blocks; block sizes 16 and 64;
 * 8 to 64 heads. Every sequence owns a run of scattered physical blocks in each pool.
 *
 * Then the refusals (backend.h): a compress whose emission has no entry block, an indexer whose
 * scoring token meets an entry block outside its table, an attention whose selection is not
 * increasing: the CPU and CUDA backends both answer DSV4_EINVAL and the CUDA backend writes no
 * byte (its caches and outputs stay as they were); the next launch is right again.
 *
 * Then the indexer's score paths on constructed records (indexer_paths): the per-entry kernel, the
 * tensor-core kernel in the daemon's choice of modes, held to its partial mode and held to its
 * scalar product, over queries of ordinary, huge, tiny and zero magnitude and records with block
 * spans, zero blocks, +-6 everywhere, odd codes and codes that put E at and next to both edges of
 * the tensor cores' window (dsv4-compress.h): every path's keys equal bit for bit, every
 * selection the CPU backend's, and warps in every mode of the tensor-core kernel.
 *
 * Mismatches name the case, the batch, the token (position, sequence), the head and dim or entry,
 * the bytes on both sides and how many differ, so one run on a device is enough to diagnose.
 *
 * Usage: gpu_compress_test [quick]   (quick: the small cases only)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-compress.h"
#include "gpu_attn_common.h"

#define MAX_POS DSV4_MAX_POSITION_DEFAULT
#define MAX_SEQ 4
#define MAX_SEGS 4
#define IH 64 /* index heads */
#define SLOTS 6

/* One batch of a schedule: segments (sequence, tokens), at most MAX_SEGS. */
typedef struct {
  uint32_t n;
  uint32_t seq[MAX_SEGS];
  uint32_t len[MAX_SEGS];
} bspec_t;

typedef struct {
  const char *name;
  uint32_t ratio, bs, heads, topk;
  uint32_t n_seq;
  int64_t p0[MAX_SEQ];
  const bspec_t *sched;
  uint32_t n_batches;
} case_t;

/* The state of one backend: its buffers and the sequences' tables (the same on both). */
typedef struct {
  dsv4_backend_t *be;
  dsv4_devbuf_t cache, ring, c_cache, i_cache, weights, sinks;
  dsv4_devbuf_t bt, c_bt; /* every sequence's SWA and entry blocks, concatenated */
} world_t;

/* The tables and weights of a case (host). */
typedef struct {
  const case_t *k;
  uint32_t n_blocks, c_n_blocks, bt_len, c_bt_len;
  int32_t *bt, *c_bt;
  uint32_t bt_off[MAX_SEQ], bt_n[MAX_SEQ], c_off[MAX_SEQ], c_n[MAX_SEQ];
  int64_t c_first_lb[MAX_SEQ], next[MAX_SEQ];
  float *w; /* ape | norm | i_ape | i_norm */
  size_t ape_n, w_n;
  float *sinks;
  dsv4_rope_table_t *rope;
} setup_t;

typedef struct {
  dsv4_backend_t *cpu, *cuda;
  dsv4_rope_table_t *rope;
  uint64_t rng;
  int failures;
} ctx_t;

static float frand(uint64_t *rng, float scale) {
  return ((float)gpu_below(rng, 1u << 20) / (float)(1u << 19) - 1.0f) * scale;
}

/* Positions every sequence reaches in the schedule. */
static void seq_ends(const case_t *k, int64_t *end) {
  for (uint32_t s = 0; s < k->n_seq; s++)
    end[s] = k->p0[s];
  for (uint32_t b = 0; b < k->n_batches; b++)
    for (uint32_t i = 0; i < k->sched[b].n; i++)
      end[k->sched[b].seq[i]] += k->sched[b].len[i];
}

static void setup_make(ctx_t *c, const case_t *k, setup_t *su) {
  memset(su, 0, sizeof(*su));
  su->k = k;
  su->rope = c->rope;
  int64_t end[MAX_SEQ];
  seq_ends(k, end);
  for (uint32_t s = 0; s < k->n_seq; s++) {
    /* SWA blocks from logical block 0 (no release in a test), entry blocks from p0's entry. */
    su->bt_off[s] = su->bt_len;
    su->bt_n[s] = (uint32_t)((end[s] - 1) / k->bs + 1);
    su->bt_len += su->bt_n[s];
    su->c_first_lb[s] = k->p0[s] / k->ratio / k->bs;
    su->c_off[s] = su->c_bt_len;
    su->c_n[s] = (uint32_t)(end[s] / k->ratio / k->bs - su->c_first_lb[s] + 1);
    su->c_bt_len += su->c_n[s];
    su->next[s] = k->p0[s];
  }
  su->n_blocks = su->bt_len + 3;
  su->c_n_blocks = su->c_bt_len + 3;
  uint32_t *p = gpu_perm(&c->rng, su->n_blocks), *q = gpu_perm(&c->rng, su->c_n_blocks);
  su->bt = gpu_host_alloc(sizeof(int32_t) * su->bt_len);
  su->c_bt = gpu_host_alloc(sizeof(int32_t) * su->c_bt_len);
  for (uint32_t i = 0; i < su->bt_len; i++)
    su->bt[i] = (int32_t)p[i];
  for (uint32_t i = 0; i < su->c_bt_len; i++)
    su->c_bt[i] = (int32_t)q[i];
  free(p);
  free(q);
  const uint32_t coff = k->ratio == 4 ? 2 : 1;
  su->ape_n = (size_t)k->ratio * coff * 512;
  su->w_n = su->ape_n + 512 + (k->ratio == 4 ? 4 * 256 + 128 : 0);
  su->w = gpu_host_alloc(sizeof(float) * su->w_n);
  for (size_t i = 0; i < su->w_n; i++)
    su->w[i] = frand(&c->rng, 0.5f);
  for (size_t i = 0; i < 512; i++) /* the norm weights: around 1 */
    su->w[su->ape_n + i] = 1.0f + frand(&c->rng, 0.25f);
  for (size_t i = 0; k->ratio == 4 && i < 128; i++)
    su->w[su->ape_n + 512 + 1024 + i] = 1.0f + frand(&c->rng, 0.25f);
  su->sinks = gpu_host_alloc(sizeof(float) * k->heads);
  for (uint32_t h = 0; h < k->heads; h++)
    su->sinks[h] = frand(&c->rng, 2.0f);
  for (uint32_t s = 0; s < k->n_seq; s++)
    CKD(dsv4_rope_table_ensure_range(c->rope, 0, end[s] + 1));
}

static void setup_free(setup_t *su) {
  free(su->bt);
  free(su->c_bt);
  free(su->w);
  free(su->sinks);
}

static void world_open(world_t *w, dsv4_backend_t *be, const setup_t *su) {
  const case_t *k = su->k;
  memset(w, 0, sizeof(*w));
  w->be = be;
  w->cache = attn_put(be, NULL, (size_t)su->n_blocks * DSV4_BLOCK_STRIDE(k->bs));
  w->ring = attn_put(be, NULL, (size_t)SLOTS * DSV4_RING_FLOATS(k->ratio) * sizeof(float));
  w->c_cache = attn_put(be, NULL, (size_t)su->c_n_blocks * DSV4_BLOCK_STRIDE(k->bs));
  w->i_cache = attn_put(be, NULL, (size_t)su->c_n_blocks * DSV4_INDEX_BLOCK_BYTES(k->bs));
  w->weights = attn_put(be, su->w, sizeof(float) * su->w_n);
  w->sinks = attn_put(be, su->sinks, sizeof(float) * k->heads);
  w->bt = attn_put(be, su->bt, sizeof(int32_t) * su->bt_len);
  w->c_bt = attn_put(be, su->c_bt, sizeof(int32_t) * su->c_bt_len);
}

static void world_close(world_t *w) {
  dsv4_devbuf_t *b[] = {&w->cache,   &w->ring,  &w->c_cache, &w->i_cache,
                        &w->weights, &w->sinks, &w->bt,      &w->c_bt};
  for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
    w->be->ops->buf_free(w->be, b[i]);
}

/* One batch's host arrays and inputs (the same for both backends). */
typedef struct {
  uint32_t n, nseg;
  int64_t *pos, *seg_p0, *seg_first_lb, *seg_c_first_lb;
  int32_t *tok_seg;
  uint32_t *seg_bt_off, *seg_bt_len, *seg_slot, *seg_cbt_off, *seg_cbt_len;
  uint32_t seg_seq[MAX_SEGS];
  uint16_t *q, *kv, *iq;
  float *ckv, *ikv, *iw;
} binput_t;

static void binput_make(ctx_t *c, setup_t *su, const bspec_t *bs, binput_t *in) {
  const case_t *k = su->k;
  memset(in, 0, sizeof(*in));
  in->nseg = bs->n;
  for (uint32_t i = 0; i < bs->n; i++)
    in->n += bs->len[i];
  const size_t n = in->n, ns = in->nseg, w = k->ratio == 4 ? 2048 : 1024;
  in->pos = gpu_host_alloc(8 * n);
  in->tok_seg = gpu_host_alloc(4 * n);
  in->seg_p0 = gpu_host_alloc(8 * ns);
  in->seg_first_lb = gpu_host_alloc(8 * ns);
  in->seg_c_first_lb = gpu_host_alloc(8 * ns);
  in->seg_bt_off = gpu_host_alloc(4 * ns);
  in->seg_bt_len = gpu_host_alloc(4 * ns);
  in->seg_slot = gpu_host_alloc(4 * ns);
  in->seg_cbt_off = gpu_host_alloc(4 * ns);
  in->seg_cbt_len = gpu_host_alloc(4 * ns);
  uint32_t t = 0;
  for (uint32_t i = 0; i < bs->n; i++) {
    uint32_t s = bs->seq[i];
    in->seg_seq[i] = s;
    in->seg_p0[i] = k->p0[s];
    in->seg_first_lb[i] = 0;
    in->seg_bt_off[i] = su->bt_off[s];
    in->seg_bt_len[i] = su->bt_n[s];
    in->seg_slot[i] = s + 1; /* slot 0 stays unused */
    in->seg_c_first_lb[i] = su->c_first_lb[s];
    in->seg_cbt_off[i] = su->c_off[s];
    in->seg_cbt_len[i] = su->c_n[s];
    for (uint32_t j = 0; j < bs->len[i]; j++, t++) {
      in->pos[t] = su->next[s] + j;
      in->tok_seg[t] = (int32_t)i;
    }
    su->next[s] += bs->len[i];
  }
  in->q = gpu_host_alloc(2 * n * k->heads * 512);
  in->kv = gpu_host_alloc(2 * n * 512);
  in->iq = gpu_host_alloc(2 * n * IH * 128);
  in->ckv = gpu_host_alloc(4 * n * w);
  in->ikv = gpu_host_alloc(4 * n * 512);
  in->iw = gpu_host_alloc(4 * n * IH);
  gpu_fill_bf16(&c->rng, in->q, n * k->heads * 512, 127, 2);
  gpu_fill_bf16(&c->rng, in->kv, n * 512, 127, 2);
  gpu_fill_bf16(&c->rng, in->iq, n * IH * 128, 127, 2);
  for (size_t i = 0; i < n * w; i++)
    in->ckv[i] = frand(&c->rng, 2.0f);
  for (size_t i = 0; i < n * 512; i++)
    in->ikv[i] = frand(&c->rng, 2.0f);
  for (size_t i = 0; i < n * IH; i++)
    in->iw[i] = frand(&c->rng, 1.0f);
}

static void binput_free(binput_t *in) {
  void *p[] = {in->pos,        in->tok_seg,    in->seg_p0,   in->seg_first_lb, in->seg_c_first_lb,
               in->seg_bt_off, in->seg_bt_len, in->seg_slot, in->seg_cbt_off,  in->seg_cbt_len,
               in->q,          in->kv,         in->iq,       in->ckv,          in->ikv,
               in->iw};
  for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
    free(p[i]);
}

/* What a batch answers, and how a launch may be broken for the refusals. */
typedef struct {
  uint16_t *attn;
  float *lse;
  int32_t *sel;
  int rc_compress, rc_index, rc_attn;
} bout_t;

enum { BREAK_NONE, BREAK_COMPRESS_BLOCK, BREAK_INDEX_BLOCK, BREAK_SEL_ORDER, BREAK_ATTN_BLOCK };

/*
 * The batch on world w: map_slots, qkv_insert, compress, indexer, attention, sync; outputs
 * downloaded. A break makes one launch refuse and the batch stop there: entry c_bt[brk_idx] of
 * the entry table becomes brk_val for compress (COMPRESS_BLOCK), the indexer after an unbroken
 * compress (INDEX_BLOCK) or the attention alone (ATTN_BLOCK); SEL_ORDER runs the attention alone
 * with the selection the caller left in out->sel.
 */
static void run_batch(world_t *w, const setup_t *su, const binput_t *in, bout_t *out, int brk,
                      uint32_t brk_idx, int32_t brk_val) {
  dsv4_backend_t *be = w->be;
  const case_t *k = su->k;
  const size_t n = in->n, ns = in->nseg, wd = k->ratio == 4 ? 2048 : 1024;
  dsv4_devbuf_t b[17];
  b[0] = attn_put(be, in->pos, 8 * n);
  b[1] = attn_put(be, in->tok_seg, 4 * n);
  b[2] = attn_put(be, in->seg_p0, 8 * ns);
  b[3] = attn_put(be, in->seg_first_lb, 8 * ns);
  b[4] = attn_put(be, in->seg_bt_off, 4 * ns);
  b[5] = attn_put(be, in->seg_bt_len, 4 * ns);
  b[6] = attn_put(be, in->seg_slot, 4 * ns);
  b[7] = attn_put(be, in->seg_c_first_lb, 8 * ns);
  b[8] = attn_put(be, in->seg_cbt_off, 4 * ns);
  b[9] = attn_put(be, in->seg_cbt_len, 4 * ns);
  b[10] = attn_put(be, in->q, 2 * n * k->heads * 512);
  b[11] = attn_put(be, in->kv, 2 * n * 512);
  b[12] = attn_put(be, NULL, 8 * n);                  /* slots */
  b[13] = attn_put(be, NULL, 2 * n * k->heads * 512); /* q_out */
  b[14] = attn_put(be, in->ckv, 4 * n * wd);
  b[15] = attn_put(be, in->ikv, 4 * n * 512);
  b[16] = attn_put(be, NULL, 2 * n * IH * 128 + 4 * n * IH + 4 * n * k->topk); /* iq|iw|sel */
  uint8_t *x = b[16].ptr;
  CKD(be->ops->upload(be, &b[16], 0, in->iq, 2 * n * IH * 128));
  CKD(be->ops->upload(be, &b[16], 2 * n * IH * 128, in->iw, 4 * n * IH));
  const size_t sel_off = 2 * n * IH * 128 + 4 * n * IH;
  const size_t out_bytes = 2 * n * k->heads * 512, lse_bytes = 4 * n * k->heads;
  memset(out->attn, ATTN_CANARY, out_bytes);
  memset(out->lse, ATTN_CANARY, lse_bytes);
  if (brk != BREAK_SEL_ORDER)
    memset(out->sel, ATTN_CANARY, 4 * n * k->topk);
  CKD(be->ops->upload(be, &b[16], sel_off, out->sel, 4 * n * k->topk));
  dsv4_devbuf_t dout = attn_put(be, out->attn, out_bytes), dlse = attn_put(be, out->lse, lse_bytes);
  /* The entry table, broken for a refusal. */
  int32_t *cbt = gpu_host_alloc(sizeof(int32_t) * su->c_bt_len);
  memcpy(cbt, su->c_bt, sizeof(int32_t) * su->c_bt_len);
  if (brk != BREAK_NONE && brk != BREAK_SEL_ORDER)
    cbt[brk_idx] = brk_val;
  dsv4_devbuf_t dcbt = brk ? attn_put(be, cbt, sizeof(int32_t) * su->c_bt_len) : w->c_bt;
  const float *wd_ = w->weights.ptr;
  dsv4_map_args_t ma = {.n_tokens = (uint32_t)n,
                        .n_segments = (uint32_t)ns,
                        .block_size = k->bs,
                        .n_blocks = su->n_blocks,
                        .positions = b[0].ptr,
                        .tok_seg = b[1].ptr,
                        .seg_first_lb = b[3].ptr,
                        .seg_bt_off = b[4].ptr,
                        .seg_bt_len = b[5].ptr,
                        .block_table = w->bt.ptr,
                        .slots = b[12].ptr,
                        .bt_entries = su->bt_len};
  dsv4_insert_args_t ia = {.n_tokens = (uint32_t)n,
                           .heads = k->heads,
                           .q = b[10].ptr,
                           .kv = b[11].ptr,
                           .positions = b[0].ptr,
                           .slots = b[12].ptr,
                           .rope = su->rope,
                           .eps = 1e-6f,
                           .write_kv = 1,
                           .q_out = b[13].ptr,
                           .cache = w->cache.ptr,
                           .block_size = k->bs,
                           .n_blocks = su->n_blocks,
                           .stride = DSV4_BLOCK_STRIDE(k->bs)};
  dsv4_compress_args_t ca = {.ratio = k->ratio,
                             .n_tokens = (uint32_t)n,
                             .n_segments = (uint32_t)ns,
                             .positions = b[0].ptr,
                             .tok_seg = b[1].ptr,
                             .seg_p0 = b[2].ptr,
                             .seg_slot = b[6].ptr,
                             .ckv = b[14].ptr,
                             .ikv = k->ratio == 4 ? b[15].ptr : NULL,
                             .ring = w->ring.ptr,
                             .n_slots = SLOTS,
                             .ape = wd_,
                             .norm_weight = wd_ + su->ape_n,
                             .i_ape = k->ratio == 4 ? wd_ + su->ape_n + 512 : NULL,
                             .i_norm_weight = k->ratio == 4 ? wd_ + su->ape_n + 512 + 1024 : NULL,
                             .eps = 1e-6f,
                             .rope = su->rope,
                             .seg_c_first_lb = b[7].ptr,
                             .seg_cbt_off = b[8].ptr,
                             .seg_cbt_len = b[9].ptr,
                             .c_block_table = dcbt.ptr,
                             .c_bt_entries = su->c_bt_len,
                             .c_cache = w->c_cache.ptr,
                             .i_cache = k->ratio == 4 ? w->i_cache.ptr : NULL,
                             .c_n_blocks = su->c_n_blocks,
                             .block_size = k->bs,
                             .stride = DSV4_BLOCK_STRIDE(k->bs)};
  dsv4_indexer_args_t xa = {.n_tokens = (uint32_t)n,
                            .n_segments = (uint32_t)ns,
                            .topk = k->topk,
                            .n_heads = IH,
                            .w_scale = dsv4_u2f(DSV4_INDEX_W_SCALE_BITS),
                            .positions = b[0].ptr,
                            .tok_seg = b[1].ptr,
                            .seg_p0 = b[2].ptr,
                            .iq = (const uint16_t *)x,
                            .iw = (const float *)(x + 2 * n * IH * 128),
                            .rope = su->rope,
                            .seg_c_first_lb = b[7].ptr,
                            .seg_cbt_off = b[8].ptr,
                            .seg_cbt_len = b[9].ptr,
                            .c_block_table = dcbt.ptr,
                            .c_bt_entries = su->c_bt_len,
                            .i_cache = w->i_cache.ptr,
                            .c_n_blocks = su->c_n_blocks,
                            .block_size = k->bs,
                            .sel = (int32_t *)(x + sel_off)};
  dsv4_attn_args_t aa = {.n_tokens = (uint32_t)n,
                         .n_segments = (uint32_t)ns,
                         .heads = k->heads,
                         .q = b[13].ptr,
                         .positions = b[0].ptr,
                         .tok_seg = b[1].ptr,
                         .seg_p0 = b[2].ptr,
                         .seg_first_lb = b[3].ptr,
                         .seg_bt_off = b[4].ptr,
                         .seg_bt_len = b[5].ptr,
                         .block_table = w->bt.ptr,
                         .bt_entries = su->bt_len,
                         .cache = w->cache.ptr,
                         .block_size = k->bs,
                         .n_blocks = su->n_blocks,
                         .stride = DSV4_BLOCK_STRIDE(k->bs),
                         .sink = w->sinks.ptr,
                         .rope = su->rope,
                         .out = dout.ptr,
                         .lse = dlse.ptr,
                         .ratio = k->ratio,
                         .c_cache = w->c_cache.ptr,
                         .c_n_blocks = su->c_n_blocks,
                         .seg_c_first_lb = b[7].ptr,
                         .seg_cbt_off = b[8].ptr,
                         .seg_cbt_len = b[9].ptr,
                         .c_block_table = dcbt.ptr,
                         .c_bt_entries = su->c_bt_len,
                         .c_sel = k->ratio == 4 ? xa.sel : NULL,
                         .c_sel_stride = k->ratio == 4 ? k->topk : 0};
  out->rc_compress = out->rc_index = out->rc_attn = 0;
  const int alone = brk == BREAK_SEL_ORDER || brk == BREAK_ATTN_BLOCK;
  CKD(be->ops->map_slots(be, &ma));
  CKD(be->ops->qkv_insert(be, &ia));
  if (!alone) {
    out->rc_compress = be->ops->compress(be, &ca);
    if (!out->rc_compress)
      out->rc_compress = be->ops->sync(be);
  }
  if (!out->rc_compress && k->ratio == 4 && !alone) {
    out->rc_index = be->ops->indexer(be, &xa);
    if (!out->rc_index)
      out->rc_index = be->ops->sync(be);
  }
  if (!out->rc_compress && !out->rc_index && brk != BREAK_COMPRESS_BLOCK &&
      brk != BREAK_INDEX_BLOCK) {
    out->rc_attn = be->ops->attention(be, &aa);
    if (!out->rc_attn)
      out->rc_attn = be->ops->sync(be);
  }
  CKD(be->ops->sync(be));
  CKD(be->ops->download(be, out->attn, &dout, 0, out_bytes));
  CKD(be->ops->download(be, out->lse, &dlse, 0, lse_bytes));
  CKD(be->ops->download(be, out->sel, &b[16], sel_off, 4 * n * k->topk));
  CKD(be->ops->sync(be));
  for (int i = 0; i < 17; i++)
    be->ops->buf_free(be, &b[i]);
  be->ops->buf_free(be, &dout);
  be->ops->buf_free(be, &dlse);
  if (brk)
    be->ops->buf_free(be, &dcbt);
  free(cbt);
}

/* ---- comparisons that say where ---- */

static int cmp_sel(const char *what, const binput_t *in, const int32_t *got, const int32_t *ref,
                   uint32_t topk) {
  size_t diff = 0, first = 0;
  for (size_t i = 0; i < (size_t)in->n * topk; i++)
    if (got[i] != ref[i] && diff++ == 0)
      first = i;
  if (!diff)
    return 0;
  size_t t = first / topk, kk = first % topk;
  fprintf(stderr,
          "FAIL %s: topk differs first at token %zu (position %lld, segment %d) entry %zu: %d, "
          "expected %d (%zu of %zu values differ)\n",
          what, t, (long long)in->pos[t], in->tok_seg[t], kk, got[first], ref[first], diff,
          (size_t)in->n * topk);
  return 1;
}

static int cmp_attn(const char *what, const binput_t *in, uint32_t heads, const uint16_t *out,
                    const uint16_t *ref, const float *lse, const float *ref_lse) {
  size_t n = (size_t)in->n * heads * 512, diff = 0, first = 0, ldiff = 0, lfirst = 0;
  for (size_t i = 0; i < n; i++)
    if (out[i] != ref[i] && diff++ == 0)
      first = i;
  for (size_t i = 0; i < (size_t)in->n * heads; i++)
    if (memcmp(&lse[i], &ref_lse[i], 4) && ldiff++ == 0)
      lfirst = i;
  if (diff) {
    size_t t = first / 512 / heads;
    fprintf(stderr,
            "FAIL %s: attn differs first at token %zu (position %lld, segment %d) head %zu dim "
            "%zu: %04x, expected %04x (%zu of %zu values differ)\n",
            what, t, (long long)in->pos[t], in->tok_seg[t], first / 512 % heads, first % 512,
            out[first], ref[first], diff, n);
  }
  if (ldiff) {
    uint32_t a, b;
    memcpy(&a, &lse[lfirst], 4);
    memcpy(&b, &ref_lse[lfirst], 4);
    size_t t = lfirst / heads;
    fprintf(stderr,
            "FAIL %s: lse differs first at token %zu (position %lld) head %zu: %08x (%.9g), "
            "expected %08x (%.9g) (%zu of %zu differ)\n",
            what, t, (long long)in->pos[t], lfirst % heads, a, (double)lse[lfirst], b,
            (double)ref_lse[lfirst], ldiff, (size_t)in->n * heads);
  }
  return diff || ldiff;
}

/* Every byte of buffer b of both worlds; the first difference located in its layout. */
static int cmp_buf(const char *what, const char *buf, const setup_t *su, world_t *a, world_t *b,
                   const dsv4_devbuf_t *ba, const dsv4_devbuf_t *bb) {
  uint8_t *x = gpu_host_alloc(ba->size), *y = gpu_host_alloc(bb->size);
  CKD(a->be->ops->download(a->be, x, ba, 0, ba->size));
  CKD(b->be->ops->download(b->be, y, bb, 0, bb->size));
  CKD(a->be->ops->sync(a->be));
  CKD(b->be->ops->sync(b->be));
  long long f = gpu_first_diff(y, x, ba->size);
  if (f >= 0) {
    size_t diff = 0;
    for (size_t i = 0; i < ba->size; i++)
      diff += x[i] != y[i];
    const uint32_t bs = su->k->bs;
    const uint64_t stride = DSV4_BLOCK_STRIDE(bs), ib = DSV4_INDEX_BLOCK_BYTES(bs);
    char where[160] = "";
    if (!strcmp(buf, "rings")) {
      uint64_t fl = (uint64_t)f / 4, per = DSV4_RING_FLOATS(su->k->ratio);
      snprintf(where, sizeof(where), "slot %llu float %llu", (unsigned long long)(fl / per),
               (unsigned long long)(fl % per));
    } else if (!strcmp(buf, "index cache")) {
      uint64_t o = (uint64_t)f % ib;
      snprintf(where, sizeof(where), "block %llu, %s of offset %llu", (unsigned long long)(f / ib),
               o < 64u * bs ? "values" : "codes",
               (unsigned long long)(o < 64u * bs ? o / 64 : (o - 64u * bs) / 4));
    } else {
      uint64_t o = (uint64_t)f % stride;
      snprintf(where, sizeof(where), "block %llu, %s of offset %llu",
               (unsigned long long)(f / stride),
               o >= 584u * bs   ? "padding"
               : o >= 576u * bs ? "scales"
               : o % 576 < 448  ? "NoPE"
                                : "RoPE",
               (unsigned long long)(o >= 576u * bs ? (o - 576u * bs) / 8 : o / 576));
    }
    fprintf(stderr,
            "FAIL %s: %s differs first at byte %lld (%s): %02x, expected %02x (%zu of %zu "
            "bytes differ)\n",
            what, buf, f, where, y[f], x[f], diff, ba->size);
  }
  free(x);
  free(y);
  return f >= 0;
}

static int cmp_state(const char *what, const setup_t *su, world_t *a, world_t *b) {
  int bad = cmp_buf(what, "rings", su, a, b, &a->ring, &b->ring);
  bad |= cmp_buf(what, "entry cache", su, a, b, &a->c_cache, &b->c_cache);
  if (su->k->ratio == 4)
    bad |= cmp_buf(what, "index cache", su, a, b, &a->i_cache, &b->i_cache);
  bad |= cmp_buf(what, "SWA cache", su, a, b, &a->cache, &b->cache);
  return bad;
}

static void bout_alloc(bout_t *o, const case_t *k, uint32_t n) {
  o->attn = gpu_host_alloc(2 * (size_t)n * k->heads * 512);
  o->lse = gpu_host_alloc(4 * (size_t)n * k->heads);
  o->sel = gpu_host_alloc(4 * (size_t)n * k->topk);
}

static void bout_free(bout_t *o) {
  free(o->attn);
  free(o->lse);
  free(o->sel);
}

/*
 * One refusal after a case's schedule, over positions sequence 0 already has (so that every block
 * and RoPE row exists): a compress of its last `ratio` positions with the block of the entry they
 * emit missing; or its last position alone, scored by the indexer with its first entry block
 * outside the pool, attended with a selection that repeats an entry, or (ratio 128) attended with
 * its first entry block missing (the last two without compress or indexer, which would write). Both
 * backends answer DSV4_EINVAL; the CUDA backend writes none of the launch's outputs, and the rings
 * and caches still equal the CPU's.
 */
static void refusal(ctx_t *c, setup_t *su, world_t *wc, world_t *wg, int brk) {
  static const char *const names[] = {
      "", "a compress whose emission has no entry block",
      "an indexer whose scoring token meets an entry block outside the pool",
      "an attention whose selection repeats an entry",
      "an attention whose first entry block is missing"};
  const case_t *k = su->k;
  const int64_t end = su->next[0];
  const uint32_t len = brk == BREAK_COMPRESS_BLOCK ? k->ratio : 1;
  const bspec_t one = {1, {0}, {len}};
  su->next[0] = end - len;
  binput_t in;
  binput_make(c, su, &one, &in);
  su->next[0] = end;
  uint32_t idx = su->c_off[0];
  int32_t val = brk == BREAK_INDEX_BLOCK ? (int32_t)su->c_n_blocks : -1;
  for (uint32_t t = 0; brk == BREAK_COMPRESS_BLOCK && t < in.n; t++)
    if ((in.pos[t] + 1) % k->ratio == 0)
      idx = su->c_off[0] + (uint32_t)(in.pos[t] / k->ratio / k->bs - su->c_first_lb[0]);
  bout_t rc, rg;
  bout_alloc(&rc, k, in.n);
  bout_alloc(&rg, k, in.n);
  if (brk == BREAK_SEL_ORDER) {
    /* The token's first visible entries, increasing, but with the second made equal to the first
     * (the token sees more than two). */
    const int64_t j_lo = k->p0[0] / k->ratio, j_hi = (in.pos[0] + 1) / k->ratio;
    for (uint32_t q = 0; q < k->topk; q++)
      rc.sel[q] = q < j_hi - j_lo ? (int32_t)(j_lo + q) : -1;
    rc.sel[1] = rc.sel[0];
    memcpy(rg.sel, rc.sel, 4 * (size_t)k->topk);
  }
  run_batch(wc, su, &in, &rc, brk, idx, val);
  run_batch(wg, su, &in, &rg, brk, idx, val);
  int rcpu = rc.rc_compress ? rc.rc_compress : rc.rc_index ? rc.rc_index : rc.rc_attn;
  int rgpu = rg.rc_compress ? rg.rc_compress : rg.rc_index ? rg.rc_index : rg.rc_attn;
  char what[200];
  snprintf(what, sizeof(what), "refusal (%s, %s)", k->name, names[brk]);
  int bad = 0;
  if (rcpu != DSV4_EINVAL || rgpu != DSV4_EINVAL) {
    fprintf(stderr, "FAIL %s: CPU answered %s, CUDA %s; expected %s from both\n", what,
            dsv4_strerror(rcpu), dsv4_strerror(rgpu), dsv4_strerror(DSV4_EINVAL));
    bad = 1;
  }
  if (brk == BREAK_INDEX_BLOCK && !attn_untouched(rg.sel, 4 * (size_t)in.n * k->topk)) {
    fprintf(stderr, "FAIL %s: the CUDA backend wrote topk\n", what);
    bad = 1;
  }
  if (!attn_untouched(rg.attn, 2 * (size_t)in.n * k->heads * 512) ||
      !attn_untouched(rg.lse, 4 * (size_t)in.n * k->heads)) {
    fprintf(stderr, "FAIL %s: the CUDA backend wrote attn or lse\n", what);
    bad = 1;
  }
  bad |= cmp_state(what, su, wc, wg);
  printf("%s %s: DSV4_EINVAL, nothing written\n", bad ? "FAIL" : "ok  ", what);
  c->failures += bad;
  bout_free(&rc);
  bout_free(&rg);
  binput_free(&in);
}

/* The schedule on both backends, compared batch by batch and at the end; then, on the first case
 * of each kind, the refusals. */
static void run_case(ctx_t *c, const case_t *k, int refusals) {
  setup_t su;
  setup_make(c, k, &su);
  world_t wc, wg;
  world_open(&wc, c->cpu, &su);
  world_open(&wg, c->cuda, &su);
  int bad = 0;
  uint32_t tokens = 0;
  for (uint32_t bi = 0; bi < k->n_batches && !bad; bi++) {
    binput_t in;
    binput_make(c, &su, &k->sched[bi], &in);
    tokens += in.n;
    bout_t rc, rg;
    bout_alloc(&rc, k, in.n);
    bout_alloc(&rg, k, in.n);
    run_batch(&wc, &su, &in, &rc, BREAK_NONE, 0, 0);
    run_batch(&wg, &su, &in, &rg, BREAK_NONE, 0, 0);
    char what[160];
    snprintf(what, sizeof(what), "%s, batch %u (%u tokens in %u segments)", k->name, bi, in.n,
             in.nseg);
    if (rc.rc_compress || rc.rc_index || rc.rc_attn || rg.rc_compress || rg.rc_index ||
        rg.rc_attn) {
      fprintf(stderr, "FAIL %s: compress/indexer/attention answered CPU %d/%d/%d, CUDA %d/%d/%d\n",
              what, rc.rc_compress, rc.rc_index, rc.rc_attn, rg.rc_compress, rg.rc_index,
              rg.rc_attn);
      bad = 1;
    }
    if (!bad && k->ratio == 4)
      bad |= cmp_sel(what, &in, rg.sel, rc.sel, k->topk);
    if (!bad)
      bad |= cmp_attn(what, &in, k->heads, rg.attn, rc.attn, rg.lse, rc.lse);
    bout_free(&rc);
    bout_free(&rg);
    binput_free(&in);
  }
  if (!bad)
    bad = cmp_state(k->name, &su, &wc, &wg);
  printf("%s %s: %u batches, %u tokens: topk, attn, lse, rings and caches%s\n",
         bad ? "FAIL" : "ok  ", k->name, k->n_batches, tokens,
         bad ? " differ" : " byte-identical to the CPU backend");
  fflush(stdout);
  c->failures += bad;
  for (int brk = BREAK_COMPRESS_BLOCK; !bad && refusals && brk <= BREAK_ATTN_BLOCK; brk++)
    if (brk == BREAK_COMPRESS_BLOCK || (k->ratio == 4) == (brk != BREAK_ATTN_BLOCK))
      refusal(c, &su, &wc, &wg, brk);
  world_close(&wc);
  world_close(&wg);
  setup_free(&su);
}

/* ---- the indexer's score paths on constructed records ---- */

#define IX_MAX_POS 16384
#define IX_BS 64
#define IX_TOPK 64
#define IX_TOKENS 26
#define IX_RUN 48 /* consecutive entries of one kind */
#define IX_KINDS 7

static const char *const ix_kind_names[IX_KINDS] = {
    "realistic codes", "block spans of 9", "E at the top of the window", "E at its bottom",
    "blocks of zeros", "+-6 everywhere",   "codes 0, 1, 253, 254"};

/*
 * Two sequences (2600 and 300 entries) and 26 decode-like tokens at their ends, every one scoring
 * (topk 64). The queries: heads 0..15 of ordinary magnitude, 16..31 near the largest the daemon
 * admits (q codes up to about 182), 32..47 tiny (codes about 24), 48..55 zero, 56..63 ordinary. The
 * records come in runs of IX_RUN entries of one kind, so that the warps of 32 entries meet every
 * mode of the tensor-core kernel and the window's edges (set from the queries' own codes).
 */
typedef struct {
  int64_t pos[IX_TOKENS], seg_p0[2], c_first_lb[2];
  int32_t tok_seg[IX_TOKENS], *c_bt;
  uint32_t cbt_off[2], cbt_len[2], c_bt_len, c_n_blocks;
  uint32_t n_ent[2];
  uint8_t *icache;
  size_t icache_bytes;
  uint16_t *iq;
  float *iw;
  uint32_t qsum[IX_TOKENS][IH]; /* the heads' dsv4_index_mx_summary, from the host's quantiser */
  int qlo, qhi;                 /* the smallest and largest nonzero q code of any head */
} ix_t;

/* Entry j of segment s in the index cache: its 64 value bytes at *vals, its 4 codes at *codes. */
static void ix_entry(const ix_t *x, uint32_t s, uint32_t j, uint8_t **vals, uint8_t **codes) {
  uint8_t *blk =
      x->icache + (size_t)x->c_bt[x->cbt_off[s] + j / IX_BS] * DSV4_INDEX_BLOCK_BYTES(IX_BS);
  *vals = blk + 64 * (j % IX_BS);
  *codes = blk + 64 * IX_BS + 4 * (j % IX_BS);
}

/* iq of every token (head groups as above), iw > 0 (no score is NaN), the queries' summaries. */
static void ix_queries(ctx_t *c, ix_t *x) {
  static const int centre[8] = {127, 127, 180, 180, 24, 24, 0, 127};
  x->qlo = 255;
  x->qhi = 0;
  for (uint32_t t = 0; t < IX_TOKENS; t++)
    for (uint32_t h = 0; h < IH; h++) {
      uint16_t *row = x->iq + ((size_t)t * IH + h) * 128;
      if (centre[h / 8])
        gpu_fill_bf16(&c->rng, row, 128, centre[h / 8], 2);
      else
        memset(row, 0, 256);
      x->iw[t * IH + h] = 0.25f + (float)gpu_below(&c->rng, 1024) / 1024.0f;
      float v[128];
      uint8_t vals[64], codes[4];
      for (int d = 0; d < 128; d++)
        v[d] = dsv4_bf16_to_f32(row[d]);
      dsv4_index_rope(v, dsv4_rope_table_row(c->rope, x->pos[t]));
      dsv4_hadamard128(v);
      dsv4_mxfp4_quant128(v, vals, codes);
      x->qsum[t][h] = dsv4_index_mx_summary(vals, codes);
      for (int b = 0; b < 4; b++) {
        const int q = (int)((x->qsum[t][h] >> (8 * b)) & 255u);
        if (q && q != (int)DSV4_INDEX_MX_INVALID) {
          x->qlo = q < x->qlo ? q : x->qlo;
          x->qhi = q > x->qhi ? q : x->qhi;
        }
      }
    }
}

/* The record of one entry of the given kind in run `run`; ku and kl: the k codes where E_b meets
 * the window's top (118) and bottom (-124) against the queries' extreme codes. */
static void ix_record(ctx_t *c, uint8_t *v, uint8_t *codes, int run, int kind, int ku, int kl) {
  static const uint8_t spans[4] = {118, 121, 124, 127}, odd[4] = {0, 1, 253, 254};
  static const uint8_t zero_codes[5] = {0, 1, 127, 253, 254};
  for (int i = 0; i < 64; i++)
    v[i] = (uint8_t)gpu_rnd(&c->rng);
  /* A run's edge codes step across the window's edge from one run of the kind to the next. */
  const int base = 125 + (int)gpu_below(&c->rng, 3), u = ku - 3 + (run / IX_KINDS) % 7,
            l = kl - 3 + (run / IX_KINDS) % 7, rot = (int)gpu_below(&c->rng, 4);
  for (int b = 0; b < 4; b++) {
    int code = base + (int)gpu_below(&c->rng, 2);
    if (kind == 1)
      code = spans[(b + rot) & 3];
    else if (kind == 2)
      code = u - (int)gpu_below(&c->rng, 2);
    else if (kind == 3)
      code = l + (int)gpu_below(&c->rng, 2);
    codes[b] = (uint8_t)code;
  }
  if (kind == 4)
    for (int b = 0; b < 4; b++)
      if (gpu_below(&c->rng, 2)) {
        for (int i = 16 * b; i < 16 * b + 16; i++)
          v[i] &= 0x88; /* signed zeros */
        codes[b] = zero_codes[gpu_below(&c->rng, 5)];
      }
  if (kind == 5)
    for (int i = 0; i < 64; i++)
      v[i] = (uint8_t)(0x77 | (v[i] & 0x88));
  if (kind == 6)
    codes[rot] = odd[gpu_below(&c->rng, 4)];
}

/* The sequences, their tokens and tables, and every visible entry's record. */
static void ix_make(ctx_t *c, ix_t *x) {
  memset(x, 0, sizeof(*x));
  x->n_ent[0] = 2600;
  x->n_ent[1] = 300;
  for (uint32_t t = 0; t < IX_TOKENS; t++) {
    const uint32_t s = t < 20 ? 0 : 1, last = 4 * x->n_ent[s] - 1;
    x->tok_seg[t] = (int32_t)s;
    x->pos[t] = (int64_t)last - (s ? 25 - t : 19 - t);
  }
  CKD(dsv4_rope_table_ensure(c->rope, x->pos, IX_TOKENS));
  for (uint32_t s = 0; s < 2; s++) {
    x->cbt_off[s] = x->c_bt_len;
    x->cbt_len[s] = (x->n_ent[s] + IX_BS - 1) / IX_BS;
    x->c_bt_len += x->cbt_len[s];
  }
  x->c_n_blocks = x->c_bt_len + 5;
  uint32_t *perm = gpu_perm(&c->rng, x->c_n_blocks);
  x->c_bt = gpu_host_alloc(4 * x->c_bt_len);
  for (uint32_t i = 0; i < x->c_bt_len; i++)
    x->c_bt[i] = (int32_t)perm[i];
  free(perm);
  x->iq = gpu_host_alloc(2 * (size_t)IX_TOKENS * IH * 128);
  x->iw = gpu_host_alloc(4 * (size_t)IX_TOKENS * IH);
  ix_queries(c, x);
  const int ku = 372 - x->qhi, kl = 130 - x->qlo;
  x->icache_bytes = (size_t)x->c_n_blocks * DSV4_INDEX_BLOCK_BYTES(IX_BS);
  x->icache = gpu_host_alloc(x->icache_bytes);
  memset(x->icache, 0, x->icache_bytes);
  for (uint32_t s = 0; s < 2; s++)
    for (uint32_t j = 0; j < x->n_ent[s]; j++) {
      uint8_t *vals, *codes;
      ix_entry(x, s, j, &vals, &codes);
      const int run = (int)(j / IX_RUN);
      ix_record(c, vals, codes, run, (run + (int)s) % IX_KINDS, ku, kl);
    }
}

static void ix_free(ix_t *x) {
  free(x->c_bt);
  free(x->icache);
  free(x->iq);
  free(x->iw);
}

/* The indexer's arguments over the arrays of a, b, ... (host or device addresses alike). */
static dsv4_indexer_args_t ix_args(ctx_t *c, const ix_t *x, void *const *a) {
  return (dsv4_indexer_args_t){.n_tokens = IX_TOKENS,
                               .n_segments = 2,
                               .topk = IX_TOPK,
                               .n_heads = IH,
                               .w_scale = dsv4_u2f(DSV4_INDEX_W_SCALE_BITS),
                               .positions = a[0],
                               .tok_seg = a[1],
                               .seg_p0 = a[2],
                               .iq = a[3],
                               .iw = a[4],
                               .rope = c->rope,
                               .seg_c_first_lb = a[5],
                               .seg_cbt_off = a[6],
                               .seg_cbt_len = a[7],
                               .c_block_table = a[8],
                               .c_bt_entries = x->c_bt_len,
                               .i_cache = a[9],
                               .c_n_blocks = x->c_n_blocks,
                               .block_size = IX_BS,
                               .sel = a[10]};
}

#define IX_ARRAYS 11

static void ix_sources(const ix_t *x, const void *src[IX_ARRAYS], size_t len[IX_ARRAYS]) {
  const void *s[IX_ARRAYS] = {x->pos,     x->tok_seg, x->seg_p0, x->iq,     x->iw, x->c_first_lb,
                              x->cbt_off, x->cbt_len, x->c_bt,   x->icache, NULL};
  const size_t l[IX_ARRAYS] = {8 * IX_TOKENS,
                               4 * IX_TOKENS,
                               16,
                               2 * IX_TOKENS * IH * 128,
                               4 * IX_TOKENS * IH,
                               16,
                               8,
                               8,
                               4 * x->c_bt_len,
                               x->icache_bytes,
                               4 * IX_TOKENS * IX_TOPK};
  memcpy(src, s, sizeof(s));
  memcpy(len, l, sizeof(l));
}

/* The CPU backend's selection. */
static void ix_cpu(ctx_t *c, const ix_t *x, int32_t *sel) {
  const void *src[IX_ARRAYS];
  size_t len[IX_ARRAYS];
  ix_sources(x, src, len);
  dsv4_devbuf_t b[IX_ARRAYS];
  void *a[IX_ARRAYS];
  for (int i = 0; i < IX_ARRAYS; i++) {
    b[i] = attn_put(c->cpu, src[i], len[i]);
    a[i] = b[i].ptr;
  }
  const dsv4_indexer_args_t xa = ix_args(c, x, a);
  CKD(c->cpu->ops->indexer(c->cpu, &xa));
  CKD(c->cpu->ops->sync(c->cpu));
  CKD(c->cpu->ops->download(c->cpu, sel, &b[10], 0, len[10]));
  CKD(c->cpu->ops->sync(c->cpu));
  for (int i = 0; i < IX_ARRAYS; i++)
    c->cpu->ops->buf_free(c->cpu, &b[i]);
}

/* dsv4__cuda_indexer on path `path`: the selection and every token's keys (slot t: token t). */
static void ix_cuda(ctx_t *c, const ix_t *x, int path, int32_t *sel, uint32_t *keys,
                    uint64_t keys_len) {
  const void *src[IX_ARRAYS];
  size_t len[IX_ARRAYS];
  ix_sources(x, src, len);
  void *a[IX_ARRAYS];
  for (int i = 0; i < IX_ARRAYS; i++) {
    a[i] = gpu_dev_alloc(len[i]);
    if (src[i])
      CK(cudaMemcpy(a[i], src[i], len[i], cudaMemcpyHostToDevice));
  }
  CK(cudaMemset(a[10], ATTN_CANARY, len[10]));
  float *mirror = gpu_dev_alloc((size_t)IX_MAX_POS * DSV4_ROPE_ROW_FLOATS * sizeof(float));
  gpu_rope_upload(c->rope, mirror, IX_MAX_POS, x->pos, IX_TOKENS);
  uint32_t *dkeys = gpu_dev_alloc(4 * keys_len), *err = gpu_dev_alloc(4), herr = 0;
  CK(cudaMemset(dkeys, 0, 4 * keys_len));
  CK(cudaMemset(err, 0, 4));
  const dsv4_indexer_args_t xa = ix_args(c, x, a);
  dsv4__cuda_indexer_set_path(path);
  CKD(dsv4__cuda_indexer(&xa, mirror, IX_MAX_POS, dkeys, keys_len, err, 0, 0));
  dsv4__cuda_indexer_set_path(DSV4_CUDA_INDEXER_AUTO);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(&herr, err, 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(sel, a[10], len[10], cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(keys, dkeys, 4 * keys_len, cudaMemcpyDeviceToHost));
  if (herr) {
    fprintf(stderr, "FAIL indexer paths: path %d set the error word (%u)\n", path, herr);
    exit(1);
  }
  for (int i = 0; i < IX_ARRAYS; i++)
    CK(cudaFree(a[i]));
  CK(cudaFree(mirror));
  CK(cudaFree(dkeys));
  CK(cudaFree(err));
}
/* The per-block minima of the nonzero summary bytes, maxima and largest span of n summaries. */
static void ix_stats(const uint32_t *sum, uint32_t n, uint32_t *lo, uint32_t *hi, uint32_t *span) {
  *lo = 0xFFFFFFFFu;
  *hi = *span = 0;
  for (uint32_t i = 0; i < n; i++) {
    for (int b = 0; b < 4; b++) {
      const uint32_t q = (sum[i] >> (8 * b)) & 255u, l = (*lo >> (8 * b)) & 255u,
                     h = (*hi >> (8 * b)) & 255u;
      if (q && q < l)
        *lo = (*lo & ~(255u << (8 * b))) | (q << (8 * b));
      if (q > h)
        *hi = (*hi & ~(255u << (8 * b))) | (q << (8 * b));
    }
    const uint32_t sp = dsv4_index_mx_span(sum[i]);
    *span = sp > *span ? sp : *span;
  }
}

/* How many warps of the tensor-core kernel take each mode here: the launch's splits (indexer.cu)
 * and rounds of 256 entries, 32 a warp (indexer_mma.cu), from the summaries. */
static void ix_census(const ix_t *x, uint32_t sms, uint32_t count[3]) {
  const uint32_t ctas = IX_TOKENS < sms ? IX_TOKENS : sms;
  const uint32_t splits = sms / ctas ? sms / ctas : 1;
  for (uint32_t t = 0; t < IX_TOKENS; t++) {
    const uint32_t s = (uint32_t)x->tok_seg[t], n = (uint32_t)((x->pos[t] + 1) / 4);
    const uint32_t per = (n + splits - 1) / splits;
    uint32_t qlo, qhi, qspan, ksum[32];
    ix_stats(x->qsum[t], IH, &qlo, &qhi, &qspan);
    for (uint32_t y = 0; y < splits; y++) {
      const uint32_t i0 = y * per, i1 = i0 + per < n ? i0 + per : n;
      for (uint32_t r0 = i0; r0 < i1; r0 += 32) {
        const uint32_t rows = i1 - r0 < 32 ? i1 - r0 : 32;
        for (uint32_t r = 0; r < rows; r++) {
          uint8_t *vals, *codes;
          ix_entry(x, s, r0 + r, &vals, &codes);
          ksum[r] = dsv4_index_mx_summary(vals, codes);
        }
        uint32_t klo, khi, kspan;
        ix_stats(ksum, rows, &klo, &khi, &kspan);
        count[dsv4_index_mx_mode(qlo, qhi, qspan, klo, khi, kspan)]++;
      }
    }
  }
}

/* The first key of token t that differs between a and b over its visible entries, or -1. */
static long long ix_key_diff(const ix_t *x, const uint32_t *a, const uint32_t *b, uint64_t per_cta,
                             uint32_t *token) {
  for (uint32_t t = 0; t < IX_TOKENS; t++) {
    const uint64_t n = (uint64_t)(x->pos[t] + 1) / 4;
    for (uint64_t i = 0; i < n; i++)
      if (a[t * per_cta + i] != b[t * per_cta + i]) {
        *token = t;
        return (long long)i;
      }
  }
  return -1;
}

/*
 * Every score path of the CUDA indexer (dsv4__cuda_indexer_set_path) on the same constructed
 * inputs: the per-entry kernel, the daemon's choice (the tensor-core kernel on compute capability
 * 9.0 and newer), and the tensor-core kernel held to its partial mode and to its scalar product.
 * Every path's keys must equal the per-entry kernel's bit for bit and every selection the CPU
 * backend's; where the tensor-core kernel runs, the data must send warps to each of its modes.
 */
static void indexer_paths(ctx_t *c) {
  static const int paths[4] = {DSV4_CUDA_INDEXER_THREADS, DSV4_CUDA_INDEXER_AUTO,
                               DSV4_CUDA_INDEXER_MMA_PARTIAL, DSV4_CUDA_INDEXER_MMA_SCALAR};
  static const char *const names[4] = {"per-entry kernel", "daemon's choice",
                                       "tensor cores, partial mode at most",
                                       "tensor cores, scalar product only"};
  ix_t x;
  ix_make(c, &x);
  const size_t sel_n = (size_t)IX_TOKENS * IX_TOPK;
  const uint64_t per_cta = dsv4__cuda_indexer_keys_per_cta(IX_MAX_POS);
  const uint64_t keys_len = (uint64_t)dsv4__cuda_indexer_ctas(IX_TOKENS) * per_cta;
  int32_t *ref = gpu_host_alloc(4 * sel_n), *sel = gpu_host_alloc(4 * sel_n);
  uint32_t *keys[4];
  ix_cpu(c, &x, ref);
  int bad = 0;
  for (int i = 0; i < 4; i++) {
    keys[i] = gpu_host_alloc(4 * keys_len);
    ix_cuda(c, &x, paths[i], sel, keys[i], keys_len);
    long long f = gpu_first_diff(sel, ref, 4 * sel_n);
    if (f >= 0) {
      const size_t k = (size_t)f / 4;
      fprintf(stderr,
              "FAIL indexer paths, %s: topk differs first at token %zu entry %zu: %d, "
              "expected %d\n",
              names[i], k / IX_TOPK, k % IX_TOPK, sel[k], ref[k]);
      bad = 1;
    }
    uint32_t t = 0;
    f = i ? ix_key_diff(&x, keys[i], keys[0], per_cta, &t) : -1;
    if (f >= 0) {
      const uint32_t kind = (uint32_t)((f / IX_RUN + (uint32_t)x.tok_seg[t]) % IX_KINDS);
      fprintf(stderr,
              "FAIL indexer paths, %s: the key of token %u entry %lld (%s) is %08x, the "
              "per-entry kernel's %08x\n",
              names[i], t, f, ix_kind_names[kind], keys[i][t * per_cta + (uint64_t)f],
              keys[0][t * per_cta + (uint64_t)f]);
      bad = 1;
    }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int mma = dsv4__cuda_indexer_mma(IH);
  uint32_t count[3] = {0, 0, 0};
  ix_census(&x, (uint32_t)sms, count);
  if (mma && (!count[0] || !count[1] || !count[2])) {
    fprintf(stderr,
            "FAIL indexer paths: the data sends %u, %u, %u warps to the scalar, partial and "
            "fused modes; every mode must run\n",
            count[0], count[1], count[2]);
    bad = 1;
  }
  printf("%s indexer paths: %d tokens, q codes %d..%d, warps in scalar/partial/fused mode %u/%u/%u "
         "(%s): keys of every path %s\n",
         bad ? "FAIL" : "ok  ", IX_TOKENS, x.qlo, x.qhi, count[0], count[1], count[2],
         mma ? "tensor-core kernel" : "per-entry kernel everywhere",
         bad ? "or selections differ" : "equal, selections the CPU's");
  fflush(stdout);
  c->failures += bad;
  for (int i = 0; i < 4; i++)
    free(keys[i]);
  free(ref);
  free(sel);
  ix_free(&x);
}

/* The score a key (dsv4_index_score_key) orders. */
static float ix_key_score(uint32_t k) {
  return dsv4_u2f((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/*
 * The exact scores of token t's visible entries (from their per-entry keys) and, per entry, how
 * far fast mode's may be from them: both sum the same 64 terms w_h max(d_hj, 0) (d is exact mode's
 * in both) in fixed orders, so each is within gamma_64 * sum |term| of the true sum (about 64 ulps
 * of that sum), their difference within twice that. bound[i] < 0: a term is not finite, and the
 * keys must then be equal.
 */
static void ix_fast_bounds(ctx_t *c, const ix_t *x, uint32_t t, const float *khat, uint32_t n,
                           float *bound) {
  float qhat[IH][128], w[IH];
  for (uint32_t h = 0; h < IH; h++) {
    dsv4_index_query(x->iq + ((size_t)t * IH + h) * 128, dsv4_rope_table_row(c->rope, x->pos[t]),
                     qhat[h]);
    w[h] = x->iw[t * IH + h] * dsv4_u2f(DSV4_INDEX_W_SCALE_BITS);
  }
  for (uint32_t j = 0; j < n; j++) {
    double sum = 0.0;
    for (uint32_t h = 0; h < IH; h++) {
      const float d = dsv4_dot128(qhat[h], khat + (size_t)j * 128);
      sum += fabs((double)w[h] * (d > 0.0f ? (double)d : 0.0));
    }
    bound[j] = isfinite(sum) ? (float)(2.0 * 64.0 * 0x1p-24 * 1.01 * sum) : -1.0f;
  }
}

/* The dequantised index records of segment s's entries 0..n-1. */
static float *ix_khat(const ix_t *x, uint32_t s) {
  float *k = gpu_host_alloc(sizeof(float) * 128 * x->n_ent[s]);
  for (uint32_t j = 0; j < x->n_ent[s]; j++) {
    uint8_t *vals, *codes;
    ix_entry(x, s, j, &vals, &codes);
    dsv4_mxfp4_dequant128(vals, codes, k + (size_t)j * 128);
  }
  return k;
}

/* Token t's fast keys against the exact ones within their bounds; its fast selection against the
 * CPU's: an entry only one of them took must be a near-tie, the exact scores of a swapped pair
 * within their two bounds. Returns the failures; *swaps counts the swapped entries. */
static int ix_fast_token(const ix_t *x, uint32_t t, const uint32_t *kf, const uint32_t *ke,
                         const float *bound, const int32_t *sf, const int32_t *se,
                         uint32_t *swaps) {
  const uint32_t n = (uint32_t)((x->pos[t] + 1) / 4);
  for (uint32_t j = 0; j < n; j++) {
    if (kf[j] == ke[j])
      continue;
    const float diff = fabsf(ix_key_score(kf[j]) - ix_key_score(ke[j]));
    if (!(bound[j] >= 0.0f && diff <= bound[j])) {
      fprintf(stderr,
              "FAIL indexer fast mode: token %u entry %u scores %.9g, exact mode %.9g (bound "
              "%.3g)\n",
              t, j, ix_key_score(kf[j]), ix_key_score(ke[j]), bound[j]);
      return 1;
    }
  }
  for (uint32_t a = 0; a < IX_TOPK; a++) {
    const int32_t jf = sf[t * IX_TOPK + a];
    int found = 0;
    for (uint32_t b = 0; b < IX_TOPK && !found; b++)
      found = se[t * IX_TOPK + b] == jf;
    if (found)
      continue;
    (*swaps)++;
    for (uint32_t b = 0; b < IX_TOPK; b++) {
      const int32_t je = se[t * IX_TOPK + b];
      int taken = 0;
      for (uint32_t k = 0; k < IX_TOPK && !taken; k++)
        taken = sf[t * IX_TOPK + k] == je;
      if (taken || jf < 0 || je < 0)
        continue;
      if (ix_key_score(ke[je]) - ix_key_score(ke[jf]) > bound[je] + bound[jf]) {
        fprintf(stderr,
                "FAIL indexer fast mode: token %u took entry %d (exact score %.9g) over %d "
                "(%.9g): not a near-tie\n",
                t, jf, ix_key_score(ke[jf]), je, ix_key_score(ke[je]));
        return 1;
      }
    }
  }
  return 0;
}

/*
 * The tensor-core kernel's fast mode (DSV4_CUDA_INDEXER_MMA_FAST, SPEC §8.9) on the inputs of
 * indexer_paths: the same keys on a second run, every score within its bound of exact mode's, and
 * a selection that differs from the CPU's only at near-ties. Where the kernel does not run
 * (dsv4__cuda_indexer_mma: no compute capability 9.0, or too little shared memory), the launch is
 * exact mode's and must give its keys.
 */
static void indexer_fast(ctx_t *c) {
  ix_t x;
  ix_make(c, &x);
  const size_t sel_n = (size_t)IX_TOKENS * IX_TOPK;
  const uint64_t per_cta = dsv4__cuda_indexer_keys_per_cta(IX_MAX_POS);
  const uint64_t keys_len = (uint64_t)dsv4__cuda_indexer_ctas(IX_TOKENS) * per_cta;
  int32_t *se = gpu_host_alloc(4 * sel_n), *sf = gpu_host_alloc(4 * sel_n),
          *sf2 = gpu_host_alloc(4 * sel_n);
  uint32_t *ke = gpu_host_alloc(4 * keys_len), *kf = gpu_host_alloc(4 * keys_len),
           *kf2 = gpu_host_alloc(4 * keys_len);
  ix_cpu(c, &x, se);
  ix_cuda(c, &x, DSV4_CUDA_INDEXER_THREADS, sf, ke, keys_len);
  ix_cuda(c, &x, DSV4_CUDA_INDEXER_MMA_FAST, sf, kf, keys_len);
  ix_cuda(c, &x, DSV4_CUDA_INDEXER_MMA_FAST, sf2, kf2, keys_len);
  const int mma = dsv4__cuda_indexer_mma(IH);
  int bad = 0;
  if (memcmp(sf, sf2, 4 * sel_n) || memcmp(kf, kf2, 4 * keys_len)) {
    fprintf(stderr, "FAIL indexer fast mode: two runs differ\n");
    bad = 1;
  }
  uint32_t swaps = 0, moved = 0;
  float *khat[2] = {ix_khat(&x, 0), ix_khat(&x, 1)}, *bound = gpu_host_alloc(4 * 2600);
  for (uint32_t t = 0; t < IX_TOKENS && !bad; t++) {
    const uint32_t n = (uint32_t)((x.pos[t] + 1) / 4);
    const uint32_t *kft = kf + t * per_cta, *ket = ke + t * per_cta;
    for (uint32_t j = 0; j < n; j++)
      moved += kft[j] != ket[j];
    if (!mma) {
      bad = memcmp(kft, ket, 4 * (size_t)n) || memcmp(sf, se, 4 * sel_n);
      if (bad)
        fprintf(stderr, "FAIL indexer fast mode: exact mode's launch differs from it\n");
      continue;
    }
    ix_fast_bounds(c, &x, t, khat[x.tok_seg[t]], n, bound);
    bad = ix_fast_token(&x, t, kft, ket, bound, sf, se, &swaps);
  }
  if (mma && !bad && !moved) {
    fprintf(stderr, "FAIL indexer fast mode: every score equals exact mode's; the fast kernel "
                    "did not run\n");
    bad = 1;
  }
  printf("%s indexer fast mode: %u of the scores differ from exact mode's, each within its "
         "bound; %u selected entries differ from the CPU's, each a near-tie; two runs alike\n",
         bad ? "FAIL" : "ok  ", moved, swaps);
  fflush(stdout);
  c->failures += bad;
  free(khat[0]);
  free(khat[1]);
  free(bound);
  free(se);
  free(sf);
  free(sf2);
  free(ke);
  free(kf);
  free(kf2);
  ix_free(&x);
}

/*
 * The tensor-core kernels on the same inputs: where the device runs the warpgroup-MMA kernel
 * (sm90a/indexer_wgmma.cu), its keys and selection in both modes, each with the partial and scalar
 * caps too (the daemon's path, MMA_PARTIAL, MMA_SCALAR, and the same in fast mode), are those of
 * indexer_mma.cu on the same path (dsv4__cuda_indexer_force_sync), bit for bit: the same d and
 * the same order of the heads' sums (SPEC §8.9's in fast mode).
 */
static void indexer_wg_kernels(ctx_t *c) {
  if (!dsv4__cuda_indexer_wg(IH)) {
    printf("skipped indexer on warpgroup MMAs: the device does not run them\n");
    return;
  }
  ix_t x;
  ix_make(c, &x);
  const size_t sel_n = (size_t)IX_TOKENS * IX_TOPK;
  const uint64_t keys_len =
      (uint64_t)dsv4__cuda_indexer_ctas(IX_TOKENS) * dsv4__cuda_indexer_keys_per_cta(IX_MAX_POS);
  int32_t *s0 = gpu_host_alloc(4 * sel_n), *s1 = gpu_host_alloc(4 * sel_n);
  uint32_t *k0 = gpu_host_alloc(4 * keys_len), *k1 = gpu_host_alloc(4 * keys_len);
  static const int paths[6] = {DSV4_CUDA_INDEXER_AUTO,
                               DSV4_CUDA_INDEXER_MMA_PARTIAL,
                               DSV4_CUDA_INDEXER_MMA_SCALAR,
                               DSV4_CUDA_INDEXER_MMA_FAST,
                               DSV4_CUDA_INDEXER_MMA_FAST_PARTIAL,
                               DSV4_CUDA_INDEXER_MMA_FAST_SCALAR};
  static const char *const names[6] = {"exact", "exact held to partial", "exact held to scalar",
                                       "fast",  "fast held to partial",  "fast held to scalar"};
  int bad = 0;
  for (int i = 0; i < 6; i++) {
    dsv4__cuda_indexer_force_sync(1);
    ix_cuda(c, &x, paths[i], s0, k0, keys_len);
    dsv4__cuda_indexer_force_sync(0);
    ix_cuda(c, &x, paths[i], s1, k1, keys_len);
    if (memcmp(k0, k1, 4 * keys_len) || memcmp(s0, s1, 4 * sel_n)) {
      fprintf(stderr,
              "FAIL indexer on warpgroup MMAs, %s: keys or selection differ from "
              "mma.sync's\n",
              names[i]);
      bad = 1;
    }
  }
  printf("%s indexer on warpgroup MMAs: exact and fast mode, fused, partial and scalar, give "
         "mma.sync's keys and selections\n",
         bad ? "FAIL" : "ok  ");
  fflush(stdout);
  c->failures += bad;
  free(s0);
  free(s1);
  free(k0);
  free(k1);
  ix_free(&x);
}

/* ---- the cases ---- */

/* Ratio 4, topk 512: s0 from 0 past 2,048 positions (more than 512 visible entries), s1 from
 * p0 = 37, s2 from p0 = 5 joining later; chunks, a mixed batch, decode steps across emissions. */
static const bspec_t sched_a[] = {
    {2, {0, 1}, {1300, 700}},
    {3, {0, 1, 2}, {900, 3, 45}},
    {3, {0, 1, 2}, {1, 1, 1}},
    {3, {0, 1, 2}, {1, 1, 1}},
    {3, {0, 1, 2}, {1, 1, 1}},
    {2, {2, 0}, {2, 150}},
    {1, {0}, {1}},
};
/* Ratio 4, topk 8: every sequence scores almost at once; bs 64. */
static const bspec_t sched_b[] = {
    {3, {0, 1, 2}, {90, 33, 7}}, {3, {2, 0, 1}, {40, 3, 1}}, {3, {0, 1, 2}, {1, 1, 1}},
    {3, {0, 1, 2}, {1, 1, 1}},   {2, {1, 0}, {62, 5}},
};
/* Ratio 128, bs 16: s0 from 0 past 2,048 positions (entries in a second block), s1 from p0 = 300,
 * s2 from p0 = 2100 (its first entry is 16, the second block's first); prefills in chunks that
 * straddle emissions, decode steps across one. */
static const bspec_t sched_c[] = {
    {2, {0, 1}, {1000, 100}}, {3, {0, 1, 2}, {1050, 200, 200}},
    {2, {0, 2}, {250, 1}},    {3, {0, 1, 2}, {1, 1, 1}},
    {2, {1, 0}, {30, 1}},
};
/* Ratio 128, bs 64, 64 heads: a short prefill and decode steps that emit. */
static const bspec_t sched_d[] = {
    {2, {0, 1}, {127, 200}},
    {2, {0, 1}, {1, 1}},
    {2, {0, 1}, {1, 70}},
    {1, {0}, {129}},
};
/* Quick: small versions of a and c. */
static const bspec_t sched_q4[] = {{2, {0, 1}, {70, 45}}, {2, {0, 1}, {1, 1}}, {2, {1, 0}, {9, 3}}};
static const bspec_t sched_q128[] = {{2, {0, 1}, {130, 20}}, {2, {0, 1}, {127, 1}}};

#define N(a) (uint32_t)(sizeof(a) / sizeof(a[0]))

int main(int argc, char **argv) {
  int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  if (!gpu_available("gpu_compress_test"))
    return GPU_SKIP;
  ctx_t c = {.rng = 0x243F6A8885A308D3ull};
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &c.cpu, why, sizeof(why)));
  int rc = dsv4_backend_open("cuda", &opt, &c.cuda, why, sizeof(why));
  if (rc == DSV4_ENODEV) {
    printf("gpu_compress_test: skipped: %s\n", why);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  CKD(rc);
  if (!c.cuda->ops->attention || !c.cuda->ops->compress || !c.cuda->ops->indexer) {
    printf("gpu_compress_test: skipped: device 0 cannot run the attention kernel\n");
    dsv4_backend_close(c.cuda);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  if (!c.cpu->ops->compress || !c.cpu->ops->indexer || !c.cpu->ops->attention) {
    fprintf(stderr, "gpu_compress_test: FAIL: the CPU backend lacks the ops to compare with\n");
    return 1;
  }
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv);
  CKD(dsv4_rope_table_create(inv, MAX_POS, &c.rope));
  /* name, ratio, bs, heads, topk, sequences, p0, schedule */
  const case_t quick_cases[] = {
      {"ratio 4, H=8, topk 8, bs 16", 4, 16, 8, 8, 2, {0, 13}, sched_q4, N(sched_q4)},
      {"ratio 128, H=8, bs 16", 128, 16, 8, 8, 2, {0, 7}, sched_q128, N(sched_q128)},
  };
  const case_t cases[] = {
      {"ratio 4, H=16, topk 512, bs 16", 4, 16, 16, 512, 3, {0, 37, 5}, sched_a, N(sched_a)},
      {"ratio 4, H=8, topk 8, bs 64", 4, 64, 8, 8, 3, {0, 3, 1000}, sched_b, N(sched_b)},
      {"ratio 128, H=8, bs 16", 128, 16, 8, 8, 3, {0, 300, 2100}, sched_c, N(sched_c)},
      {"ratio 128, H=64, bs 64", 128, 64, 64, 8, 2, {0, 5}, sched_d, N(sched_d)},
  };
  for (uint32_t i = 0; i < N(quick_cases); i++)
    run_case(&c, &quick_cases[i], 1);
  indexer_paths(&c);
  indexer_fast(&c);
  indexer_wg_kernels(&c);
  for (uint32_t i = 0; !quick && i < N(cases); i++)
    run_case(&c, &cases[i], 0);
  dsv4_backend_close(c.cuda);
  dsv4_backend_close(c.cpu);
  dsv4_rope_table_destroy(c.rope);
  if (c.failures) {
    printf("gpu_compress_test: %d check(s) FAILED\n", c.failures);
    return 1;
  }
  printf("gpu_compress_test: every case byte-identical to the CPU backend, every refusal clean\n");
  return 0;
}
