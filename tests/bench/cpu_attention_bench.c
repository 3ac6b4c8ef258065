/*
 * CPU benchmark of exact attention (SPEC §7): decode batches of b = 1, 16 and 64 one-token queries,
 * each of its own sequence with a full window of 128 candidates, against the machine's fused
 * multiply-add peak measured in the same run.
 *
 * FLOPs per call: 4 * b * H * 128 * 512 (a multiply-add is two, over the logits and over N), the
 * floor FIELD-NOTES counts; the exponentials, the dequantisation and the transposes come on top and
 * are not counted. The peak is a loop of independent fused multiply-adds in registers, at each
 * kernel level's width, on 1 thread and on the backend's threads (one loop per thread); each row
 * is compared with the widest level's peak on its thread count. Before timing, every level's bytes
 * are checked against the scalar level's at b = 16.
 *
 * Usage: cpu_attention_bench [heads]
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
#include "dsv4-numerics.h"
#include "cpu_bench_common.h"
#include "rope.h"

#define BS 64
#define MAX_B 64
#define POS 128 /* the query position: candidates 1..128 */
#define BLOCKS_PER_SEQ 3

static uint64_t rng = 0x243F6A8885A308D3ull;

/* Magnitudes between 2^-4 and 2^4, either sign. */
static uint16_t rnd_bf16(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint16_t)((rng & 0x8000u) | ((uint32_t)(123 + (rng >> 20) % 8) << 7) |
                    ((rng >> 8) & 127));
}

/* ---- the attention batches ---- */

typedef struct {
  dsv4_backend_t *be;
  dsv4_attn_args_t a;
} attn_call_t;

static void do_attention(void *varg) {
  attn_call_t *c = varg;
  if (c->be->ops->attention(c->be, &c->a) != 0) {
    fprintf(stderr, "attention failed\n");
    exit(1);
  }
}

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

typedef struct {
  uint8_t *cache;
  dsv4_rope_table_t *rope;
  int64_t positions[MAX_B], seg_p0[MAX_B], first_lb[MAX_B];
  int32_t tok_seg[MAX_B], table[MAX_B * BLOCKS_PER_SEQ];
  uint32_t bt_off[MAX_B], bt_len[MAX_B];
  uint16_t *q;
} world_t;

/* MAX_B sequences of POS + 1 positions each, written by the backend's own insert. */
static void build_world(dsv4_backend_t *be, world_t *w, uint32_t heads) {
  const uint32_t per = POS + 1, n = MAX_B * per, n_blocks = MAX_B * BLOCKS_PER_SEQ;
  w->cache = xmalloc(n_blocks * DSV4_BLOCK_STRIDE(BS));
  memset(w->cache, 0, n_blocks * DSV4_BLOCK_STRIDE(BS));
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv);
  int64_t *pos = xmalloc(n * sizeof(int64_t)), *slots = xmalloc(n * sizeof(int64_t));
  uint16_t *kv = xmalloc((size_t)n * 1024), *q = xmalloc((size_t)n * 1024);
  for (uint32_t t = 0; t < n; t++) {
    pos[t] = t % per;
    slots[t] = (int64_t)(t / per) * BLOCKS_PER_SEQ * BS + pos[t];
    for (int d = 0; d < DSV4_HEAD_DIM; d++) {
      kv[(size_t)t * 512 + d] = rnd_bf16();
      q[(size_t)t * 512 + d] = rnd_bf16();
    }
  }
  if (dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &w->rope) ||
      dsv4_rope_table_ensure(w->rope, pos, n))
    exit(1);
  uint16_t *q_out = xmalloc((size_t)n * 1024);
  dsv4_insert_args_t ia = {.n_tokens = n,
                           .heads = 1,
                           .q = q,
                           .kv = kv,
                           .positions = pos,
                           .slots = slots,
                           .rope = w->rope,
                           .eps = 1e-6f,
                           .write_kv = 1,
                           .q_out = q_out,
                           .cache = w->cache,
                           .block_size = BS,
                           .n_blocks = n_blocks,
                           .stride = DSV4_BLOCK_STRIDE(BS)};
  if (be->ops->qkv_insert(be, &ia) != 0)
    exit(1);
  for (uint32_t t = 0; t < MAX_B; t++) {
    w->positions[t] = POS;
    w->tok_seg[t] = (int32_t)t;
    w->seg_p0[t] = 0;
    w->first_lb[t] = 0;
    w->bt_off[t] = t * BLOCKS_PER_SEQ;
    w->bt_len[t] = BLOCKS_PER_SEQ;
    for (int b = 0; b < BLOCKS_PER_SEQ; b++)
      w->table[t * BLOCKS_PER_SEQ + b] = (int32_t)(t * BLOCKS_PER_SEQ + b);
  }
  w->q = xmalloc((size_t)MAX_B * heads * 1024);
  for (size_t i = 0; i < (size_t)MAX_B * heads * 512; i++)
    w->q[i] = rnd_bf16();
  free(pos);
  free(slots);
  free(kv);
  free(q);
  free(q_out);
}

static dsv4_attn_args_t args_for(const world_t *w, uint32_t b, uint32_t heads, uint16_t *out,
                                 float *lse, const float *sink) {
  dsv4_attn_args_t a = {.n_tokens = b,
                        .n_segments = b,
                        .heads = heads,
                        .q = w->q,
                        .positions = w->positions,
                        .tok_seg = w->tok_seg,
                        .seg_p0 = w->seg_p0,
                        .seg_first_lb = w->first_lb,
                        .seg_bt_off = w->bt_off,
                        .seg_bt_len = w->bt_len,
                        .block_table = w->table,
                        .bt_entries = b * BLOCKS_PER_SEQ,
                        .cache = w->cache,
                        .block_size = BS,
                        .n_blocks = MAX_B * BLOCKS_PER_SEQ,
                        .stride = DSV4_BLOCK_STRIDE(BS),
                        .sink = sink,
                        .rope = w->rope,
                        .out = out,
                        .lse = lse};
  return a;
}

/* Every level stores the scalar level's bytes for a b = 16 batch. */
static void check_levels(dsv4_backend_t *be, const world_t *w, uint32_t heads, const float *sink) {
  size_t n = (size_t)16 * heads * 512;
  uint16_t *ref = xmalloc(n * 2), *out = xmalloc(n * 2);
  float *lref = xmalloc(16 * heads * 4), *lse = xmalloc(16 * heads * 4);
  dsv4__cpu_backend_set_isa(be, DSV4__CPU_ISA_SCALAR);
  attn_call_t c = {be, args_for(w, 16, heads, ref, lref, sink)};
  do_attention(&c);
  for (int isa = 1; isa < DSV4__CPU_ISA_COUNT; isa++) {
    if (dsv4__cpu_backend_set_isa(be, isa) != 0)
      continue;
    c.a.out = out;
    c.a.lse = lse;
    do_attention(&c);
    if (memcmp(out, ref, n * 2) != 0 || memcmp(lse, lref, 16 * heads * 4) != 0) {
      fprintf(stderr, "level %s differs from the scalar level\n", dsv4__cpu_isa_name(isa));
      exit(1);
    }
  }
  free(ref);
  free(out);
  free(lref);
  free(lse);
}

int main(int argc, char **argv) {
  uint32_t heads = argc > 1 ? (uint32_t)atoi(argv[1]) : 64;
  if (heads < 1 || heads > DSV4_MAX_HEADS) {
    fprintf(stderr, "usage: cpu_attention_bench [heads 1..128]\n");
    return 2;
  }
  char why[256];
  dsv4_backend_t *be[2] = {NULL, NULL};
  dsv4_backend_options_t one = {.threads = 1}, all = {.threads = 0};
  if (dsv4_backend_open("cpu", &one, &be[0], why, sizeof(why)) ||
      dsv4_backend_open("cpu", &all, &be[1], why, sizeof(why))) {
    fprintf(stderr, "cpu backend: %s\n", why);
    return 1;
  }
  unsigned threads[2] = {1, dsv4__cpu_backend_workers(be[1]) + 1};
  world_t w;
  build_world(be[1], &w, heads);
  float sink[DSV4_MAX_HEADS];
  for (uint32_t h = 0; h < heads; h++)
    sink[h] = (float)(h % 7) - 3.0f;
  check_levels(be[1], &w, heads, sink);

  int best = dsv4__cpu_isa_best();
  printf("fused multiply-add peak (GFLOP/s, %d independent chains per thread)\n", PEAK_CHAINS);
  printf("   isa  threads    GFLOP/s\n");
  double peak[2] = {0, 0};
  for (int k = 0; k < 2 && (k == 0 || threads[1] > 1); k++)
    for (int isa = best; isa >= 0; isa--) {
      double gf = fma_peak(isa, threads[k]);
      printf("%6s %8u %10.1f\n", dsv4__cpu_isa_name(isa), threads[k], gf);
      if (isa == best)
        peak[k] = gf;
    }

  printf("\nexact attention, decode: b one-token queries, H = %u, 128 candidates each, bs = %d\n",
         heads, BS);
  printf("     b    H threads      isa      us/call    GFLOP/s  %%peak(%s)\n",
         dsv4__cpu_isa_name(best));
  uint16_t *out = xmalloc((size_t)MAX_B * heads * 1024);
  float *lse = xmalloc((size_t)MAX_B * heads * 4);
  static const uint32_t bs[] = {1, 16, 64};
  for (int k = 0; k < 2 && (k == 0 || threads[1] > 1); k++)
    for (size_t i = 0; i < sizeof(bs) / sizeof(bs[0]); i++)
      for (int isa = best; isa >= 0; isa--) {
        /* The scalar level is the portable fallback: timed at b = 1 only. */
        if (isa == DSV4__CPU_ISA_SCALAR && bs[i] > 1)
          continue;
        dsv4__cpu_backend_set_isa(be[k], isa);
        attn_call_t c = {be[k], args_for(&w, bs[i], heads, out, lse, sink)};
        double s = time_call(do_attention, &c);
        double gf = 4.0 * bs[i] * heads * DSV4_WINDOW * DSV4_HEAD_DIM / s * 1e-9;
        printf("%6u %4u %7u %8s %12.1f %10.1f %9.1f%%\n", bs[i], heads, threads[k],
               dsv4__cpu_isa_name(isa), s * 1e6, gf, 100.0 * gf / peak[k]);
      }
  dsv4_backend_close(be[0]);
  dsv4_backend_close(be[1]);
  return 0;
}
