/*
 * CPU benchmark of the compressed branch (SPEC §8.3, §8.5): the indexer's selection at 8K and 64K
 * context (2048 and 16384 visible entries), for one decode token and for a batch of 16 (each of its
 * own sequence), and the compressor on a 1024-token prefill at ratio 4 and at ratio 128; per kernel
 * level and on 1 thread and on all of the backend's threads. Each table states its ceilings,
 * measured in the same run on the same thread count:
 *
 * - the fused multiply-add peak: a loop of independent fmas in registers at each level's width (the
 *   widest level's peak is the ceiling of every row). The indexer's FLOPs are its dot products,
 *   2 * 128 * heads per visible entry; the queries' transform, the folds, the score chains and the
 *   selection come on top and are not counted. The compressor's work is counted in lane operations,
 *   the canonical pooling step of SPEC §8.3 with dsv4_expf (POOL_OPS per pooled channel and row),
 *   against the peak's rate of lane operations (GFLOP/s / 2, one fma being one operation);
 * - the copy rate: memcpy through the backend's own pool of buffers larger than the caches. The
 *   indexer's floor is its scan of 68 bytes per visible entry and token; the compressor's is its
 *   inputs (ckv, and ikv at ratio 4) read once and its records written. As in cpu_kernel_bench the
 *   copy moves (reads plus writes) as many bytes as the floor counts.
 *
 * Each row gives the fraction of the FMA floor and of the copy floor (floor time / measured time);
 * the larger one is the binding ceiling. The ceilings are measured before and after the rows and
 * the larger of the two is used (on a shared machine both move with the load); the tables are
 * printed at the end. Before timing, every level's selections and records are
 * checked against the scalar level's. The scalar level is timed at b = 1 only (it is the portable
 * reference: a 16-token batch at 64K context takes seconds).
 *
 * Usage: cpu_compress_bench [heads] [topk] [max_ctx]   (max_ctx 8192 leaves out the 64K rows)
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "cpu/cpu-internal.h"
#include "dsv4-compress.h"
#include "rope.h"
#include "cpu_bench_common.h"

#define BS 64
#define MAX_B 16
#define PREFILL 1024
/* Lane operations of one pooled channel and row: the max, the subtraction, dsv4_expf's 25
 * floating-point operations and one conversion on its common path (its range checks not counted),
 * the sum and the fma. */
#define POOL_OPS 30

static uint64_t rng = 0x243F6A8885A308D3ull;

static uint64_t rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

/* Uniform in [lo, hi). */
static float rnd_float(float lo, float hi) {
  return lo + (hi - lo) * (float)(rnd() >> 40) * 0x1p-24f;
}

/* ---- timing and the copy rate ---- */

/* Seconds per call: the best of five trials, each long enough to time (at least 50 ms). */
static double time_call(void (*fn)(void *), void *arg) {
  fn(arg);
  int reps = 1;
  for (;;) {
    double t0 = now_s();
    for (int r = 0; r < reps; r++)
      fn(arg);
    if (now_s() - t0 > 0.05 || reps >= (1 << 20))
      break;
    reps *= 2;
  }
  double best = 1e30;
  for (int trial = 0; trial < 5; trial++) {
    double t0 = now_s();
    for (int r = 0; r < reps; r++)
      fn(arg);
    double dt = (now_s() - t0) / reps;
    best = dt < best ? dt : best;
  }
  return best;
}

#define COPY_BYTES (128u << 20)
#define COPY_PIECE (64u << 10)

typedef struct {
  char *dst;
  const char *src;
  dsv4_host_pool_t *pool;
} copy_call_t;

static void copy_pieces(void *varg, size_t first, size_t last) {
  copy_call_t *c = varg;
  memcpy(c->dst + first * COPY_PIECE, c->src + first * COPY_PIECE, (last - first) * COPY_PIECE);
  __asm__ volatile("" : : "r"(c->dst) : "memory");
}

static void do_copy(void *varg) {
  copy_call_t *c = varg;
  size_t pieces = COPY_BYTES / COPY_PIECE;
  unsigned t = dsv4_host_pool_threads(c->pool);
  dsv4_host_pool_run(c->pool, copy_pieces, c, pieces, (pieces + t - 1) / t);
}

/* Bytes moved per second (read plus written) by memcpy of 128 MiB on `threads` threads. */
static double copy_rate(unsigned threads) {
  copy_call_t c;
  if (dsv4_host_pool_create(threads, &c.pool))
    exit(1);
  c.dst = xmalloc(COPY_BYTES);
  char *src = xmalloc(COPY_BYTES);
  memset(src, 1, COPY_BYTES);
  memset(c.dst, 0, COPY_BYTES);
  c.src = src;
  double s = time_call(do_copy, &c);
  free(c.dst);
  free(src);
  dsv4_host_pool_destroy(c.pool);
  return 2.0 * COPY_BYTES / s;
}

/* ---- the indexer ---- */

typedef struct {
  uint32_t heads, topk, ctx, entries, lbs; /* lbs: logical blocks of each sequence */
  uint8_t *i_cache;
  dsv4_rope_table_t *rope;
  int64_t positions[MAX_B], seg_p0[MAX_B], first_lb[MAX_B];
  int32_t tok_seg[MAX_B], *table;
  uint32_t bt_off[MAX_B], bt_len[MAX_B];
  uint16_t *iq;
  float *iw;
  int32_t *sel;
} ix_world_t;

/*
 * MAX_B sequences at position ctx - 1, each seeing ctx / 4 entries, their blocks spread over the
 * pool in a shuffled order. Records are random MXFP4 values with block codes 124..129 (values of
 * a few units, as the Hadamard transform of a normed key gives).
 */
static void ix_build(ix_world_t *w, uint32_t ctx, uint32_t heads, uint32_t topk) {
  memset(w, 0, sizeof(*w));
  w->heads = heads;
  w->topk = topk;
  w->ctx = ctx;
  w->entries = ctx / 4;
  w->lbs = w->entries / BS;
  const uint32_t n_blocks = MAX_B * w->lbs;
  w->i_cache = xmalloc(n_blocks * DSV4_INDEX_BLOCK_BYTES(BS));
  for (size_t blk = 0; blk < n_blocks; blk++) {
    uint8_t *b = w->i_cache + blk * DSV4_INDEX_BLOCK_BYTES(BS);
    for (uint32_t i = 0; i < DSV4_INDEX_VALUE_BYTES * BS; i++)
      b[i] = (uint8_t)rnd();
    for (uint32_t i = 0; i < DSV4_MXFP4_BLOCKS * BS; i++)
      b[DSV4_INDEX_VALUE_BYTES * BS + i] = (uint8_t)(124 + rnd() % 6);
  }
  w->table = xmalloc(n_blocks * sizeof(int32_t));
  for (uint32_t i = 0; i < n_blocks; i++)
    w->table[i] = (int32_t)i;
  for (uint32_t i = n_blocks - 1; i > 0; i--) {
    uint32_t j = (uint32_t)(rnd() % (i + 1));
    int32_t t = w->table[i];
    w->table[i] = w->table[j];
    w->table[j] = t;
  }
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv);
  for (uint32_t t = 0; t < MAX_B; t++) {
    w->positions[t] = ctx - 1;
    w->tok_seg[t] = (int32_t)t;
    w->bt_off[t] = t * w->lbs;
    w->bt_len[t] = w->lbs;
  }
  if (dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &w->rope) ||
      dsv4_rope_table_ensure(w->rope, w->positions, MAX_B))
    exit(1);
  w->iq = xmalloc((size_t)MAX_B * heads * DSV4_INDEX_DIM * sizeof(uint16_t));
  for (size_t i = 0; i < (size_t)MAX_B * heads * DSV4_INDEX_DIM; i++)
    w->iq[i] = dsv4_f32_to_bf16(rnd_float(-4.0f, 4.0f));
  w->iw = xmalloc((size_t)MAX_B * heads * sizeof(float));
  for (size_t i = 0; i < (size_t)MAX_B * heads; i++)
    w->iw[i] = rnd_float(-1.0f, 1.0f);
  w->sel = xmalloc((size_t)MAX_B * topk * sizeof(int32_t));
}

static void ix_free(ix_world_t *w) {
  free(w->i_cache);
  free(w->table);
  free(w->iq);
  free(w->iw);
  free(w->sel);
  dsv4_rope_table_destroy(w->rope);
}

static dsv4_indexer_args_t ix_args(const ix_world_t *w, uint32_t b) {
  dsv4_indexer_args_t a = {.n_tokens = b,
                           .n_segments = b,
                           .topk = w->topk,
                           .n_heads = w->heads,
                           .w_scale = dsv4_u2f(DSV4_INDEX_W_SCALE_BITS),
                           .positions = w->positions,
                           .tok_seg = w->tok_seg,
                           .seg_p0 = w->seg_p0,
                           .iq = w->iq,
                           .iw = w->iw,
                           .rope = w->rope,
                           .seg_c_first_lb = w->first_lb,
                           .seg_cbt_off = w->bt_off,
                           .seg_cbt_len = w->bt_len,
                           .c_block_table = w->table,
                           .c_bt_entries = b * w->lbs,
                           .i_cache = w->i_cache,
                           .c_n_blocks = MAX_B * w->lbs,
                           .block_size = BS,
                           .sel = w->sel};
  return a;
}

typedef struct {
  dsv4_backend_t *be;
  dsv4_indexer_args_t a;
} ix_call_t;

static void do_indexer(void *varg) {
  ix_call_t *c = varg;
  if (c->be->ops->indexer(c->be, &c->a) != 0) {
    fprintf(stderr, "indexer failed\n");
    exit(1);
  }
}

/* Every level selects what the scalar level selects, for a 16-token batch. */
static void ix_check_levels(dsv4_backend_t *be, ix_world_t *w) {
  size_t bytes = (size_t)MAX_B * w->topk * sizeof(int32_t);
  int32_t *ref = xmalloc(bytes);
  ix_call_t c = {be, ix_args(w, MAX_B)};
  dsv4__cpu_backend_set_isa(be, DSV4__CPU_ISA_SCALAR);
  do_indexer(&c);
  memcpy(ref, w->sel, bytes);
  for (int isa = 1; isa < DSV4__CPU_ISA_COUNT; isa++) {
    if (dsv4__cpu_backend_set_isa(be, isa) != 0)
      continue;
    memset(w->sel, 0x55, bytes);
    do_indexer(&c);
    if (memcmp(ref, w->sel, bytes) != 0) {
      fprintf(stderr, "indexer: level %s differs from the scalar level\n", dsv4__cpu_isa_name(isa));
      exit(1);
    }
  }
  free(ref);
}

/* One timed row: its floors are computed when the tables are printed, after the ceilings'
 * second measurement. */
typedef struct {
  int table;     /* 0: indexer, 1: compress */
  uint32_t size; /* the context, or the ratio */
  uint32_t entries, b;
  int k; /* thread count index */
  int isa;
  double s;           /* seconds per token */
  double work, bytes; /* FLOPs (indexer) or lane operations (compress), and bytes, per token */
} row_t;

#define MAX_ROWS 64

typedef struct {
  dsv4_backend_t *be[2];
  unsigned threads[2];
  double peak[2]; /* the widest level's GFLOP/s, the larger of two measurements */
  double copy[2]; /* bytes per second, likewise */
  int best;
  row_t rows[MAX_ROWS];
  int n_rows;
} bench_t;

static void add_row(bench_t *B, row_t r) {
  if (B->n_rows < MAX_ROWS)
    B->rows[B->n_rows++] = r;
}

static void ix_rows(bench_t *B, uint32_t heads, uint32_t topk, uint32_t max_ctx) {
  static const uint32_t ctxs[] = {8192, 65536}, bs[] = {1, MAX_B};
  for (size_t ci = 0; ci < 2 && ctxs[ci] <= max_ctx; ci++) {
    ix_world_t w;
    ix_build(&w, ctxs[ci], heads, topk);
    if (ci == 0)
      ix_check_levels(B->be[1], &w);
    for (int k = 0; k < 2; k++)
      for (size_t bi = 0; bi < 2; bi++)
        for (int isa = B->best; isa >= 0; isa--) {
          if (isa == DSV4__CPU_ISA_SCALAR && bs[bi] > 1)
            continue;
          dsv4__cpu_backend_set_isa(B->be[k], isa);
          ix_call_t c = {B->be[k], ix_args(&w, bs[bi])};
          add_row(B, (row_t){.table = 0,
                             .size = ctxs[ci],
                             .entries = w.entries,
                             .b = bs[bi],
                             .k = k,
                             .isa = isa,
                             .s = time_call(do_indexer, &c) / bs[bi],
                             .work = 2.0 * DSV4_INDEX_DIM * heads * w.entries,
                             .bytes = (double)DSV4_INDEX_RECORD_BYTES * w.entries});
        }
    ix_free(&w);
  }
}

/* ---- the compressor ---- */

typedef struct {
  uint32_t ratio, w; /* w: kv floats of a row */
  int64_t positions[PREFILL], seg_p0, first_lb;
  int32_t tok_seg[PREFILL], table[PREFILL / 4 / BS];
  uint32_t slot, bt_off, bt_len;
  float *ckv, *ikv, *ring, *ape, *norm_w, *i_ape, *i_norm_w;
  uint8_t *c_cache, *i_cache;
  dsv4_rope_table_t *rope;
} cp_world_t;

/* One sequence's prefill of PREFILL tokens from position 0: random inputs, gates spread wider. */
static void cp_build(cp_world_t *w, uint32_t ratio) {
  memset(w, 0, sizeof(*w));
  w->ratio = ratio;
  w->w = ratio == 4u ? 2u * DSV4_HEAD_DIM : DSV4_HEAD_DIM;
  w->bt_len = (PREFILL / ratio + BS - 1) / BS;
  for (uint32_t i = 0; i < w->bt_len; i++)
    w->table[i] = (int32_t)(w->bt_len - 1 - i);
  for (uint32_t t = 0; t < PREFILL; t++)
    w->positions[t] = t;
  w->ckv = xmalloc((size_t)PREFILL * 2 * w->w * sizeof(float));
  for (size_t i = 0; i < (size_t)PREFILL * 2 * w->w; i++)
    w->ckv[i] = rnd_float(-2.0f, 2.0f) * ((i / w->w) % 2 ? 2.0f : 1.0f);
  w->ikv = xmalloc((size_t)PREFILL * 512 * sizeof(float));
  for (size_t i = 0; i < (size_t)PREFILL * 512; i++)
    w->ikv[i] = rnd_float(-2.0f, 2.0f) * ((i / 256) % 2 ? 2.0f : 1.0f);
  w->ring = xmalloc(DSV4_RING_FLOATS(ratio) * sizeof(float));
  memset(w->ring, 0, DSV4_RING_FLOATS(ratio) * sizeof(float));
  w->ape = xmalloc((size_t)ratio * w->w * sizeof(float));
  for (size_t i = 0; i < (size_t)ratio * w->w; i++)
    w->ape[i] = rnd_float(-1.0f, 1.0f);
  w->i_ape = xmalloc(4 * 256 * sizeof(float));
  for (size_t i = 0; i < 4 * 256; i++)
    w->i_ape[i] = rnd_float(-1.0f, 1.0f);
  w->norm_w = xmalloc(512 * sizeof(float));
  w->i_norm_w = xmalloc(128 * sizeof(float));
  for (int d = 0; d < 512; d++)
    w->norm_w[d] = dsv4_round_bf16(rnd_float(0.5f, 1.5f));
  for (int d = 0; d < 128; d++)
    w->i_norm_w[d] = dsv4_round_bf16(rnd_float(0.5f, 1.5f));
  w->c_cache = xmalloc(w->bt_len * DSV4_BLOCK_STRIDE(BS));
  w->i_cache = xmalloc(w->bt_len * DSV4_INDEX_BLOCK_BYTES(BS));
  memset(w->c_cache, 0, w->bt_len * DSV4_BLOCK_STRIDE(BS));
  memset(w->i_cache, 0, w->bt_len * DSV4_INDEX_BLOCK_BYTES(BS));
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv);
  if (dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &w->rope) ||
      dsv4_rope_table_ensure_range(w->rope, 0, PREFILL))
    exit(1);
}

static void cp_free(cp_world_t *w) {
  free(w->ckv);
  free(w->ikv);
  free(w->ring);
  free(w->ape);
  free(w->i_ape);
  free(w->norm_w);
  free(w->i_norm_w);
  free(w->c_cache);
  free(w->i_cache);
  dsv4_rope_table_destroy(w->rope);
}

static dsv4_compress_args_t cp_args(cp_world_t *w) {
  int r4 = w->ratio == 4u;
  dsv4_compress_args_t a = {.ratio = w->ratio,
                            .n_tokens = PREFILL,
                            .n_segments = 1,
                            .positions = w->positions,
                            .tok_seg = w->tok_seg,
                            .seg_p0 = &w->seg_p0,
                            .seg_slot = &w->slot,
                            .ckv = w->ckv,
                            .ikv = r4 ? w->ikv : NULL,
                            .ring = w->ring,
                            .n_slots = 1,
                            .ape = w->ape,
                            .norm_weight = w->norm_w,
                            .i_ape = r4 ? w->i_ape : NULL,
                            .i_norm_weight = r4 ? w->i_norm_w : NULL,
                            .eps = dsv4_u2f(DSV4_RMS_EPS_BITS),
                            .rope = w->rope,
                            .seg_c_first_lb = &w->first_lb,
                            .seg_cbt_off = &w->bt_off,
                            .seg_cbt_len = &w->bt_len,
                            .c_block_table = w->table,
                            .c_bt_entries = w->bt_len,
                            .c_cache = w->c_cache,
                            .i_cache = r4 ? w->i_cache : NULL,
                            .c_n_blocks = w->bt_len,
                            .block_size = BS,
                            .stride = DSV4_BLOCK_STRIDE(BS)};
  return a;
}

typedef struct {
  dsv4_backend_t *be;
  dsv4_compress_args_t a;
} cp_call_t;

static void do_compress(void *varg) {
  cp_call_t *c = varg;
  if (c->be->ops->compress(c->be, &c->a) != 0) {
    fprintf(stderr, "compress failed\n");
    exit(1);
  }
}

/* Every level writes the scalar level's records and ring rows. */
static void cp_check_levels(dsv4_backend_t *be, cp_world_t *w) {
  size_t cb = w->bt_len * DSV4_BLOCK_STRIDE(BS), ib = w->bt_len * DSV4_INDEX_BLOCK_BYTES(BS);
  size_t rb = DSV4_RING_FLOATS(w->ratio) * sizeof(float);
  uint8_t *ref = xmalloc(cb + ib + rb);
  cp_call_t c = {be, cp_args(w)};
  dsv4__cpu_backend_set_isa(be, DSV4__CPU_ISA_SCALAR);
  do_compress(&c);
  memcpy(ref, w->c_cache, cb);
  memcpy(ref + cb, w->i_cache, ib);
  memcpy(ref + cb + ib, w->ring, rb);
  for (int isa = 1; isa < DSV4__CPU_ISA_COUNT; isa++) {
    if (dsv4__cpu_backend_set_isa(be, isa) != 0)
      continue;
    memset(w->c_cache, 0, cb);
    memset(w->i_cache, 0, ib);
    memset(w->ring, 0, rb);
    do_compress(&c);
    if (memcmp(ref, w->c_cache, cb) || memcmp(ref + cb, w->i_cache, ib) ||
        memcmp(ref + cb + ib, w->ring, rb)) {
      fprintf(stderr, "compress: level %s differs from the scalar level\n",
              dsv4__cpu_isa_name(isa));
      exit(1);
    }
  }
  free(ref);
}

static void cp_rows(bench_t *B) {
  static const uint32_t ratios[] = {4, 128};
  for (size_t ri = 0; ri < 2; ri++) {
    cp_world_t w;
    cp_build(&w, ratios[ri]);
    cp_check_levels(B->be[1], &w);
    const uint32_t entries = PREFILL / w.ratio;
    /* Rows pooled per entry: 2r at ratio 4 (both compressors), r at ratio 128. */
    const double rows = w.ratio == 4u ? 8.0 : 128.0;
    const double channels = w.ratio == 4u ? DSV4_HEAD_DIM + DSV4_INDEX_DIM : DSV4_HEAD_DIM;
    const double ops = POOL_OPS * rows * channels * entries;
    double bytes = (double)PREFILL * 2 * w.w * sizeof(float) + entries * DSV4_RECORD_BYTES;
    if (w.ratio == 4u)
      bytes += (double)PREFILL * 512 * sizeof(float) + entries * DSV4_INDEX_RECORD_BYTES;
    for (int k = 0; k < 2; k++)
      for (int isa = B->best; isa >= 0; isa--) {
        dsv4__cpu_backend_set_isa(B->be[k], isa);
        cp_call_t c = {B->be[k], cp_args(&w)};
        add_row(B, (row_t){.table = 1,
                           .size = w.ratio,
                           .entries = entries,
                           .b = PREFILL,
                           .k = k,
                           .isa = isa,
                           .s = time_call(do_compress, &c) / PREFILL,
                           .work = ops / PREFILL,
                           .bytes = bytes / PREFILL});
      }
    cp_free(&w);
  }
}

/* The ceilings on 1 and on all threads, each kept as the larger of this and an earlier run (a
 * shared machine's load moves both the ceilings and the rows). */
static void ceilings(bench_t *B, const char *when) {
  printf("ceilings %s: fused multiply-add peak (%d independent chains per thread) and memcpy of "
         "%u MiB\n",
         when, PEAK_CHAINS, COPY_BYTES >> 20);
  printf("   isa  threads    GFLOP/s  copy GB/s\n");
  for (int k = 0; k < 2; k++) {
    double copy = copy_rate(B->threads[k]);
    B->copy[k] = copy > B->copy[k] ? copy : B->copy[k];
    for (int isa = B->best; isa >= 0; isa--) {
      double gf = fma_peak(isa, B->threads[k]);
      printf("%6s %8u %10.1f %10.1f\n", dsv4__cpu_isa_name(isa), B->threads[k], gf, copy * 1e-9);
      if (isa == B->best && gf > B->peak[k])
        B->peak[k] = gf;
    }
  }
}

static void print_rows(const bench_t *B, uint32_t heads, uint32_t topk) {
  printf("\nindexer: b tokens of their own sequences, H = %u, topk = %u, bs = %d\n", heads, topk,
         BS);
  printf("   ctx entries   b threads      isa    us/token   tokens/s    GFLOP/s  %%fma(%s)  "
         "%%scan\n",
         dsv4__cpu_isa_name(B->best));
  for (int i = 0; i < B->n_rows; i++) {
    const row_t *r = &B->rows[i];
    if (r->table == 0)
      printf("%6u %7u %3u %7u %8s %11.1f %10.1f %10.1f %9.1f%% %6.1f%%\n", r->size, r->entries,
             r->b, B->threads[r->k], dsv4__cpu_isa_name(r->isa), r->s * 1e6, 1.0 / r->s,
             r->work / r->s * 1e-9, 100.0 * r->work / (B->peak[r->k] * 1e9) / r->s,
             100.0 * r->bytes / B->copy[r->k] / r->s);
  }
  printf("\ncompress: one sequence's %d-token prefill from position 0, bs = %d\n", PREFILL, BS);
  printf(" ratio entries threads      isa    us/token   tokens/s     Gop/s  %%ops(%s)  %%copy\n",
         dsv4__cpu_isa_name(B->best));
  for (int i = 0; i < B->n_rows; i++) {
    const row_t *r = &B->rows[i];
    if (r->table == 1)
      printf("%6u %7u %7u %8s %11.2f %10.0f %9.1f %9.1f%% %6.1f%%\n", r->size, r->entries,
             B->threads[r->k], dsv4__cpu_isa_name(r->isa), r->s * 1e6, 1.0 / r->s,
             r->work / r->s * 1e-9, 100.0 * r->work / (B->peak[r->k] * 0.5e9) / r->s,
             100.0 * r->bytes / B->copy[r->k] / r->s);
  }
}

int main(int argc, char **argv) {
  uint32_t heads = argc > 1 ? (uint32_t)atoi(argv[1]) : 64;
  uint32_t topk = argc > 2 ? (uint32_t)atoi(argv[2]) : 512;
  uint32_t max_ctx = argc > 3 ? (uint32_t)atoi(argv[3]) : 65536;
  if (heads < 1 || heads > DSV4_MAX_HEADS || topk < 1 || topk > 2048 || max_ctx < 8192) {
    fprintf(stderr, "usage: cpu_compress_bench [heads 1..128] [topk 1..2048] [max_ctx >= 8192]\n");
    return 2;
  }
  static bench_t B;
  char why[256];
  dsv4_backend_options_t one = {.threads = 1}, all = {.threads = 0};
  if (dsv4_backend_open("cpu", &one, &B.be[0], why, sizeof(why)) ||
      dsv4_backend_open("cpu", &all, &B.be[1], why, sizeof(why))) {
    fprintf(stderr, "cpu backend: %s\n", why);
    return 1;
  }
  B.threads[0] = 1;
  B.threads[1] = dsv4__cpu_backend_workers(B.be[1]) + 1;
  B.best = dsv4__cpu_isa_best();
  ceilings(&B, "before the rows");
  ix_rows(&B, heads, topk, max_ctx);
  cp_rows(&B);
  ceilings(&B, "after the rows");
  print_rows(&B, heads, topk);
  dsv4_backend_close(B.be[0]);
  dsv4_backend_close(B.be[1]);
  return 0;
}
