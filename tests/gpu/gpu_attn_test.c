/*
 * SPEC §7 on the GPU: exact-mode attention of the CUDA backend gives the CPU reference's bytes.
 * Each case builds sequences whose windows reach into an earlier batch (gpu_attn_common.h), runs
 * both batches' slot maps and inserts and then the attention launch through the CPU backend and
 * through the CUDA backend (each opened by name, driven through its op table), and compares every
 * byte of attn and every bit of lse. Cases: one-token decode steps of 1 to 128 sequences at
 * scattered positions up to 1,048,575, a 200-token prefill chunk crossing blocks, long prefills
 * (past the launch size from which a separate kernel checks the tables), the first token of a
 * sequence, p0 > 0 with windows cut at p0, block sizes 16, 64 and 256, plain and YaRN tables, H
 * from 1 to 128 (every CTA shape of the kernel is met and reported), sinks finite, +inf, -inf and
 * none, lse asked for or not. One case runs four more times, each equal to the first.
 *
 * Then the refusals (SPEC §7, backend.h): a window block that is -1, one outside its segment's
 * table, one outside the pool, and a token below its sequence's p0, in a small launch and a large
 * one: the CPU and CUDA backends both answer DSV4_EINVAL, and the CUDA backend writes no byte of
 * attn or lse; its next launch is right again. The engine's windows of the right tables, handed
 * with each broken table, are accepted with the right tables' bytes in exact and fast mode (the
 * window kernels read the windows, not the tables).
 *
 * Usage: gpu_attn_test [quick]   (quick: the small cases only, for compute-sanitizer)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_attn_common.h"

#define MAX_POS DSV4_MAX_POSITION_DEFAULT

enum { SINK_NONE, SINK_FINITE, SINK_EDGES };
enum { SHAPE_DECODE, SHAPE_PREFILL, SHAPE_MIXED };

typedef struct {
  uint32_t heads, tokens; /* tokens: decode sequences, or prefill chunk length */
  int shape;
  uint32_t bs;
  int sinks, want_lse, yarn, spread;
} case_t;

typedef struct {
  dsv4_backend_t *cpu, *cuda;
  dsv4_rope_table_t *rope[2];
  uint64_t rng;
  int failures;
  uint32_t shapes_seen; /* bit log2(64 / heads per CTA) of every CTA shape met */
} ctx_t;

/* A random position for a query whose sequence starts at p0, at least `past` after it. */
static int64_t pos_after(uint64_t *rng, int64_t p0, int64_t past) {
  return p0 + past + (int64_t)(gpu_rnd(rng) % (uint64_t)(MAX_POS - 300 - p0 - past));
}

/*
 * The segments of a case. Decode: one token per sequence; sequence g starts at 0 or later, and
 * its query is the first token of its sequence (g % 7 == 1), inside the first window (g % 7 == 2,
 * a window cut at p0), or far past it. Prefill: one segment of `tokens` queries starting 50 past
 * p0 > 0, so that the first windows are cut at p0 and the chunk crosses blocks. Mixed: a new
 * sequence's first 40 tokens, a 3-token continuation and 5 decode steps.
 */
static uint32_t make_specs(uint64_t *rng, const case_t *k, attn_seg_spec_t *spec) {
  uint32_t n = 0;
  if (k->shape == SHAPE_PREFILL) {
    int64_t p0 = 1 + (int64_t)gpu_below(rng, 5000);
    spec[n++] = (attn_seg_spec_t){p0, p0 + 50, k->tokens};
    return n;
  }
  if (k->shape == SHAPE_MIXED) {
    int64_t p0 = (int64_t)gpu_below(rng, 100000);
    spec[n++] = (attn_seg_spec_t){p0, p0, 40};
    p0 = (int64_t)gpu_below(rng, 100000);
    spec[n++] = (attn_seg_spec_t){p0, pos_after(rng, p0, 0), 3};
  }
  uint32_t decode = k->shape == SHAPE_MIXED ? 5 : k->tokens;
  for (uint32_t g = 0; g < decode; g++) {
    int64_t p0 = g % 3 == 0 ? 0 : (int64_t)gpu_below(rng, 500000);
    int64_t first = g % 7 == 1   ? p0
                    : g % 7 == 2 ? p0 + 1 + (int64_t)gpu_below(rng, 126)
                                 : pos_after(rng, p0, 127);
    spec[n++] = (attn_seg_spec_t){p0, first, 1};
  }
  return n;
}

/* Sinks of a case: finite values around 0 (some large enough to dominate), and with SINK_EDGES
 * +inf on heads 3, 11, ... and -inf on heads 5, 13, .... */
static float *make_sinks(uint64_t *rng, const case_t *k) {
  if (k->sinks == SINK_NONE)
    return NULL;
  float *s = gpu_host_alloc(sizeof(float) * k->heads);
  for (uint32_t h = 0; h < k->heads; h++) {
    s[h] = ((float)gpu_below(rng, 1u << 16) - 32768.0f) * 0x1p-12f;
    if (k->sinks == SINK_EDGES && h % 8 == 3)
      s[h] = INFINITY;
    if (k->sinks == SINK_EDGES && h % 8 == 5)
      s[h] = -INFINITY;
  }
  return s;
}

static void rope_ensure(const attn_plan_t *p, dsv4_rope_table_t *rope) {
  CKD(dsv4_rope_table_ensure(rope, p->hist_pos, p->n_hist));
  CKD(dsv4_rope_table_ensure(rope, p->q_pos, p->n_q));
}

/* Names the first difference of attn and of lse, with the number of values that differ. */
static int compare(const char *what, const attn_plan_t *p, uint32_t heads, const uint16_t *out,
                   const uint16_t *ref, const float *lse, const float *ref_lse) {
  size_t n = (size_t)p->n_q * heads * DSV4_HEAD_DIM, diff = 0, first = 0;
  for (size_t i = 0; i < n; i++)
    if (out[i] != ref[i] && diff++ == 0)
      first = i;
  int bad = 0;
  if (diff) {
    size_t t = first / DSV4_HEAD_DIM / heads;
    fprintf(stderr,
            "FAIL %s: attn differs first at token %zu (position %lld, segment %d) head %zu dim "
            "%zu: %04x, expected %04x (%zu of %zu values differ)\n",
            what, t, (long long)p->q_pos[t], p->q_seg[t], first / DSV4_HEAD_DIM % heads,
            first % DSV4_HEAD_DIM, out[first], ref[first], diff, n);
    bad = 1;
  }
  if (lse) {
    size_t m = (size_t)p->n_q * heads, ldiff = 0, lfirst = 0;
    if (memcmp(lse, ref_lse, m * sizeof(float)) != 0)
      for (size_t i = 0; i < m; i++)
        if (memcmp(&lse[i], &ref_lse[i], sizeof(float)) != 0 && ldiff++ == 0)
          lfirst = i;
    if (ldiff) {
      uint32_t a, b;
      memcpy(&a, &lse[lfirst], 4);
      memcpy(&b, &ref_lse[lfirst], 4);
      fprintf(stderr,
              "FAIL %s: lse differs first at token %zu head %zu: %08x (%.9g), expected %08x "
              "(%.9g) (%zu of %zu values differ)\n",
              what, lfirst / heads, lfirst % heads, a, (double)lse[lfirst], b,
              (double)ref_lse[lfirst], ldiff, m);
      bad = 1;
    }
  }
  return bad;
}

static void run_case(ctx_t *c, const case_t *k, int repeats) {
  attn_seg_spec_t spec[160];
  uint32_t n_segs = make_specs(&c->rng, k, spec);
  attn_plan_t p;
  attn_plan_make(&c->rng, &p, spec, n_segs, k->bs, n_segs + 5);
  attn_inputs_t in = {0};
  attn_inputs_fill(&c->rng, &p, &in, k->heads, k->spread);
  float *sinks = make_sinks(&c->rng, k);
  in.sink = sinks;
  in.want_lse = k->want_lse;
  in.rope = c->rope[k->yarn];
  rope_ensure(&p, in.rope);
  uint32_t hpb = dsv4__cuda_attention_heads_per_block(p.n_q, k->heads);
  for (uint32_t s = 0; s < 4; s++)
    if (hpb == 64u >> s)
      c->shapes_seen |= 1u << s;
  char name[200];
  snprintf(name, sizeof(name),
           "H=%u %u queries in %u segments (%u history tokens) bs=%u %s sinks=%s%s", k->heads,
           p.n_q, n_segs, p.n_hist, k->bs, k->yarn ? "yarn" : "plain",
           k->sinks == SINK_NONE     ? "none"
           : k->sinks == SINK_FINITE ? "finite"
                                     : "finite/+inf/-inf",
           k->want_lse ? " lse" : "");
  size_t out_n = (size_t)p.n_q * k->heads * DSV4_HEAD_DIM, lse_n = (size_t)p.n_q * k->heads;
  uint16_t *ref = gpu_host_alloc(out_n * 2), *out = gpu_host_alloc(out_n * 2);
  float *ref_lse = gpu_host_alloc(lse_n * 4), *lse = gpu_host_alloc(lse_n * 4);
  int rc = attn_run(c->cpu, &p, &in, NULL, ref, ref_lse, NULL);
  int bad = 0;
  if (rc) {
    fprintf(stderr, "FAIL %s: the CPU backend refused the batch: %s\n", name, dsv4_strerror(rc));
    bad = 1;
  }
  if (!bad && (rc = attn_run(c->cuda, &p, &in, NULL, out, lse, NULL)) != 0) {
    fprintf(stderr, "FAIL %s: the CUDA backend refused the batch: %s\n", name, dsv4_strerror(rc));
    bad = 1;
  }
  if (!bad)
    bad = compare(name, &p, k->heads, out, ref, k->want_lse ? lse : NULL, ref_lse);
  if (!bad) { /* the engine's windows instead of the tables: the same bytes */
    uint16_t *w_out = gpu_host_alloc(out_n * 2);
    float *w_lse = gpu_host_alloc(lse_n * 4);
    char what[260];
    snprintf(what, sizeof(what), "%s, with the engine's windows vs the tables", name);
    in.win = ATTN_WIN_BUILT;
    CKD(attn_run(c->cuda, &p, &in, NULL, w_out, w_lse, NULL));
    in.win = ATTN_WIN_NONE;
    bad = compare(what, &p, k->heads, w_out, out, k->want_lse ? w_lse : NULL, lse);
    free(w_out);
    free(w_lse);
  }
  for (int rep = 0; rep < repeats && !bad; rep++) {
    uint16_t *again = gpu_host_alloc(out_n * 2);
    float *again_lse = gpu_host_alloc(lse_n * 4);
    char what[260];
    snprintf(what, sizeof(what), "%s, repeated run %d vs the first", name, rep + 1);
    CKD(attn_run(c->cuda, &p, &in, NULL, again, again_lse, NULL));
    bad = compare(what, &p, k->heads, again, out, k->want_lse ? again_lse : NULL, lse);
    free(again);
    free(again_lse);
  }
  printf("%s %s: %u heads per CTA%s\n", bad ? "FAIL" : "ok  ", name, hpb,
         repeats && !bad ? ", 4 more runs identical" : "");
  fflush(stdout);
  c->failures += bad;
  free(ref);
  free(out);
  free(ref_lse);
  free(lse);
  free(sinks);
  attn_inputs_free(&in);
  attn_plan_free(&p);
}

/* ---- refusals ---- */

enum { BREAK_NO_BLOCK, BREAK_OUTSIDE_TABLE, BREAK_OUTSIDE_POOL, BREAK_BELOW_P0, BREAKS };
static const char *const break_names[BREAKS] = {
    "a window block of -1", "a window block outside its segment's table",
    "a window block outside the pool", "a token below its sequence's p0"};

/* A copy of a plan's tables, one segment's broken. */
typedef struct {
  int32_t *bt;
  int64_t *first;
  uint32_t *off, *len;
  attn_table_t tab;
} broken_t;

/* b: p's tables with segment g's broken as `how` says (a table fault, not BREAK_BELOW_P0). */
static void broken_make(const attn_plan_t *p, uint32_t g, int how, broken_t *b) {
  b->bt = gpu_host_alloc(sizeof(int32_t) * p->bt_len);
  b->first = gpu_host_alloc(sizeof(int64_t) * p->n_segs);
  b->off = gpu_host_alloc(sizeof(uint32_t) * p->n_segs);
  b->len = gpu_host_alloc(sizeof(uint32_t) * p->n_segs);
  memcpy(b->bt, p->block_table, sizeof(int32_t) * p->bt_len);
  memcpy(b->first, p->seg_first_lb, sizeof(int64_t) * p->n_segs);
  memcpy(b->off, p->seg_bt_off, sizeof(uint32_t) * p->n_segs);
  memcpy(b->len, p->seg_bt_len, sizeof(uint32_t) * p->n_segs);
  b->tab = (attn_table_t){b->first, b->off, b->len, b->bt, p->bt_len};
  if (how == BREAK_NO_BLOCK)
    b->bt[b->off[g] + b->len[g] - 1] = -1;
  else if (how == BREAK_OUTSIDE_TABLE) {
    b->first[g]++; /* the window's first logical block is no longer in the table */
    b->off[g]++;
    b->len[g]--;
  } else if (how == BREAK_OUTSIDE_POOL)
    b->bt[b->off[g]] = (int32_t)p->n_blocks;
}

static void broken_free(broken_t *b) {
  free(b->bt);
  free(b->first);
  free(b->off);
  free(b->len);
}

/* One refusal on a plan whose segment g has a window of at least two blocks. */
static int refuse_one(ctx_t *c, const char *shape, attn_plan_t *p, const attn_inputs_t *in,
                      uint32_t g, int how) {
  broken_t b;
  broken_make(p, g, how, &b);
  int64_t saved_p0 = p->seg_p0[g];
  if (how == BREAK_BELOW_P0)
    for (uint32_t t = 0; t < p->n_q; t++) /* every query of segment g below its p0 */
      if (p->q_seg[t] == (int32_t)g && p->q_pos[t] >= p->seg_p0[g])
        p->seg_p0[g] = p->q_pos[t] + 1;
  size_t out_bytes = (size_t)p->n_q * in->heads * DSV4_HEAD_DIM * 2;
  size_t lse_bytes = (size_t)p->n_q * in->heads * 4;
  uint16_t *out = gpu_host_alloc(out_bytes);
  float *lse = gpu_host_alloc(lse_bytes);
  int cpu_rc = attn_run(c->cpu, p, in, &b.tab, out, lse, NULL);
  int cuda_rc = attn_run(c->cuda, p, in, &b.tab, out, lse, NULL);
  p->seg_p0[g] = saved_p0;
  int bad = 0;
  if (cpu_rc != DSV4_EINVAL || cuda_rc != DSV4_EINVAL) {
    fprintf(stderr, "FAIL refusal (%s, %s): CPU answered %s, CUDA %s; expected %s from both\n",
            shape, break_names[how], dsv4_strerror(cpu_rc), dsv4_strerror(cuda_rc),
            dsv4_strerror(DSV4_EINVAL));
    bad = 1;
  } else if (!attn_untouched(out, out_bytes) || !attn_untouched(lse, lse_bytes)) {
    fprintf(stderr, "FAIL refusal (%s, %s): the CUDA backend wrote attn or lse bytes\n", shape,
            break_names[how]);
    bad = 1;
  }
  printf("%s refusal (%s, %s): DSV4_EINVAL, nothing written\n", bad ? "FAIL" : "ok  ", shape,
         break_names[how]);
  broken_free(&b);
  free(out);
  free(lse);
  return bad;
}

/* The engine's windows of a right plan (backend.h, dsv4_attn_args_t.win), the last token's with a
 * block past the pool: the CUDA backend, which reads the windows instead of the tables, must
 * refuse the launch and write nothing. */
static int refuse_window(ctx_t *c, const char *shape, const attn_plan_t *p, attn_inputs_t *in) {
  size_t out_bytes = (size_t)p->n_q * in->heads * DSV4_HEAD_DIM * 2;
  size_t lse_bytes = (size_t)p->n_q * in->heads * 4;
  uint16_t *out = gpu_host_alloc(out_bytes);
  float *lse = gpu_host_alloc(lse_bytes);
  in->win = ATTN_WIN_BAD_BLOCK;
  in->win_bad_token = p->n_q - 1;
  const int rc = attn_run(c->cuda, p, in, NULL, out, lse, NULL);
  in->win = ATTN_WIN_NONE;
  const int bad =
      rc != DSV4_EINVAL || !attn_untouched(out, out_bytes) || !attn_untouched(lse, lse_bytes);
  if (bad)
    fprintf(
        stderr, "FAIL refusal (%s, an engine's window block past the pool): %s, attn or lse %s\n",
        shape, rc ? dsv4_strerror(rc) : "accepted",
        attn_untouched(out, out_bytes) && attn_untouched(lse, lse_bytes) ? "untouched" : "written");
  printf("%s refusal (%s, an engine's window block past the pool): DSV4_EINVAL, nothing written\n",
         bad ? "FAIL" : "ok  ", shape);
  free(out);
  free(lse);
  return bad;
}

/*
 * The engine's windows of the plan's right tables, handed with tables broken in each way a table
 * can be (segment g's), in exact and in fast mode: the CUDA window kernels read the windows
 * instead of the tables, so each launch is accepted and gives the bytes of the same mode over
 * the right tables without windows (exact: ref and ref_lse).
 */
static int windows_over_broken(ctx_t *c, const char *shape, const attn_plan_t *p, attn_inputs_t *in,
                               uint32_t g, const uint16_t *ref, const float *ref_lse) {
  size_t out_n = (size_t)p->n_q * in->heads * DSV4_HEAD_DIM, lse_n = (size_t)p->n_q * in->heads;
  uint16_t *out = gpu_host_alloc(out_n * 2), *fast_ref = gpu_host_alloc(out_n * 2);
  float *lse = gpu_host_alloc(lse_n * 4), *fast_lse = gpu_host_alloc(lse_n * 4);
  int bad = 0;
  for (int fast = 0; fast < 2 && !bad; fast++) {
    in->fast = fast;
    int rc = fast ? attn_run(c->cuda, p, in, NULL, fast_ref, fast_lse, NULL) : 0;
    if (rc == DSV4_EUNSUPPORTED) {
      printf("windows over broken tables (%s), fast mode: skipped: not on this device\n", shape);
      break;
    }
    CKD(rc);
    for (int how = 0; how < BREAK_BELOW_P0 && !bad; how++) {
      broken_t b;
      broken_make(p, g, how, &b);
      in->win = ATTN_WIN_PLAN;
      rc = attn_run(c->cuda, p, in, &b.tab, out, lse, NULL);
      in->win = ATTN_WIN_NONE;
      broken_free(&b);
      char what[200];
      snprintf(what, sizeof(what), "%s mode, the right windows over tables with %s (%s)",
               fast ? "fast" : "exact", break_names[how], shape);
      if (rc) {
        fprintf(stderr, "FAIL %s: the CUDA backend answered %s\n", what, dsv4_strerror(rc));
        bad = 1;
      } else
        bad =
            compare(what, p, in->heads, out, fast ? fast_ref : ref, lse, fast ? fast_lse : ref_lse);
      printf("%s %s: accepted, the right tables' bytes\n", bad ? "FAIL" : "ok  ", what);
    }
  }
  in->fast = 0;
  free(out);
  free(fast_ref);
  free(lse);
  free(fast_lse);
  return bad;
}

/* Every refusal on a decode batch of 16 sequences and on a 1100-token prefill, then the same plan
 * unbroken on the same backend, equal to the CPU's. */
static void refusals(ctx_t *c, int quick) {
  static const case_t shapes[] = {
      {64, 16, SHAPE_DECODE, 64, SINK_FINITE, 1, 0, 3},
      {8, 1100, SHAPE_PREFILL, 16, SINK_FINITE, 1, 0, 3},
  };
  for (size_t i = 0; i < (quick ? 1u : 2u); i++) {
    const case_t *k = &shapes[i];
    attn_seg_spec_t spec[160];
    uint32_t n_segs = make_specs(&c->rng, k, spec);
    attn_plan_t p;
    attn_plan_make(&c->rng, &p, spec, n_segs, k->bs, 4);
    attn_inputs_t in = {0};
    attn_inputs_fill(&c->rng, &p, &in, k->heads, k->spread);
    in.want_lse = 1;
    in.rope = c->rope[0];
    rope_ensure(&p, in.rope);
    /* A segment whose queries' windows span two blocks or more: the prefill's, or a decode step
     * far past its p0 (g % 7 == 0). */
    uint32_t g = 0;
    while (g < n_segs && p.seg_bt_len[g] < 2)
      g++;
    if (g == n_segs) {
      fprintf(stderr, "FAIL refusals: no segment spans two blocks\n");
      c->failures++;
      attn_inputs_free(&in);
      attn_plan_free(&p);
      continue;
    }
    char shape[64];
    snprintf(shape, sizeof(shape), "%u queries, H=%u", p.n_q, k->heads);
    for (int how = 0; how < BREAKS; how++)
      c->failures += refuse_one(c, shape, &p, &in, g, how);
    c->failures += refuse_window(c, shape, &p, &in);
    size_t out_n = (size_t)p.n_q * k->heads * DSV4_HEAD_DIM, lse_n = (size_t)p.n_q * k->heads;
    uint16_t *ref = gpu_host_alloc(out_n * 2), *out = gpu_host_alloc(out_n * 2);
    float *ref_lse = gpu_host_alloc(lse_n * 4), *lse = gpu_host_alloc(lse_n * 4);
    CKD(attn_run(c->cpu, &p, &in, NULL, ref, ref_lse, NULL));
    int rc = attn_run(c->cuda, &p, &in, NULL, out, lse, NULL);
    char what[100];
    snprintf(what, sizeof(what), "after the refusals (%s)", shape);
    int bad = rc != 0;
    if (bad)
      fprintf(stderr, "FAIL %s: the CUDA backend answered %s\n", what, dsv4_strerror(rc));
    else
      bad = compare(what, &p, k->heads, out, ref, lse, ref_lse);
    printf("%s %s: the next launch is byte-identical to the CPU's\n", bad ? "FAIL" : "ok  ", what);
    c->failures += bad;
    if (!bad)
      c->failures += windows_over_broken(c, shape, &p, &in, g, out, lse);
    free(ref);
    free(out);
    free(ref_lse);
    free(lse);
    attn_inputs_free(&in);
    attn_plan_free(&p);
  }
}

/*
 * Every CTA shape of the kernel (64, 32, 16 and 8 heads per CTA) must meet the reference. Which
 * shape a launch gets depends on the device's SM count, so the shapes the cases above missed are
 * found here: the first decode batch of 1..256 sequences at H 64 or 128 that gets the shape.
 */
static void cover_shapes(ctx_t *c) {
  for (uint32_t sh = 0; sh < 4; sh++) {
    if (c->shapes_seen & (1u << sh))
      continue;
    case_t k = {0, 0, SHAPE_DECODE, 64, SINK_EDGES, 1, 0, 3};
    for (uint32_t b = 1; b <= 256 && !k.heads; b++)
      for (uint32_t heads = 64; heads <= 128 && !k.heads; heads += 64)
        if (dsv4__cuda_attention_heads_per_block(b, heads) == 64u >> sh) {
          k.heads = heads;
          k.tokens = b;
        }
    if (!k.heads) {
      fprintf(stderr, "FAIL no decode batch of this device gets %u heads per CTA\n", 64u >> sh);
      c->failures++;
      continue;
    }
    run_case(c, &k, 0);
  }
}

int main(int argc, char **argv) {
  int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  if (!gpu_available("gpu_attn_test"))
    return GPU_SKIP;
  ctx_t c = {.rng = 0x452821E638D01377ull};
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &c.cpu, why, sizeof(why)));
  int rc = dsv4_backend_open("cuda", &opt, &c.cuda, why, sizeof(why));
  if (rc == DSV4_ENODEV) {
    printf("gpu_attn_test: skipped: %s\n", why);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  CKD(rc);
  if (!c.cuda->ops->attention) {
    printf("gpu_attn_test: skipped: device 0 cannot run the attention kernel (shared memory)\n");
    dsv4_backend_close(c.cuda);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  if (!c.cpu->ops->attention) {
    fprintf(stderr, "gpu_attn_test: FAIL: the CPU backend has no attention op to compare with\n");
    return 1;
  }
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv);
  CKD(dsv4_rope_table_create(inv, MAX_POS, &c.rope[0]));
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv);
  CKD(dsv4_rope_table_create(inv, MAX_POS, &c.rope[1]));

  /* heads, tokens, shape, bs, sinks, lse, yarn, spread. The heads per CTA follow from the launch's
   * shape and the device (on an H200: decode steps of 1 and 16 sequences at H 64 get 8, 16 at
   * H 128 get 16, 64 at H 64 get 32, 64 at H 128 and 128 at H 64 get 64); cover_shapes adds what
   * another device's cases miss. */
  static const case_t small[] = {
      {64, 1, SHAPE_DECODE, 64, SINK_FINITE, 1, 0, 3},
      {8, 1, SHAPE_DECODE, 16, SINK_NONE, 0, 1, 3},
      {1, 3, SHAPE_DECODE, 64, SINK_EDGES, 1, 0, 3},
      {64, 16, SHAPE_DECODE, 64, SINK_EDGES, 1, 1, 3},
      {128, 16, SHAPE_DECODE, 256, SINK_FINITE, 0, 0, 3},
      {13, 7, SHAPE_MIXED, 16, SINK_EDGES, 1, 0, 6},
      {64, 64, SHAPE_DECODE, 64, SINK_FINITE, 1, 0, 3},
  };
  static const case_t large[] = {
      {128, 64, SHAPE_DECODE, 64, SINK_EDGES, 1, 1, 3},
      {64, 128, SHAPE_DECODE, 64, SINK_FINITE, 1, 0, 3},
      {100, 128, SHAPE_DECODE, 16, SINK_NONE, 1, 0, 8},
      {64, 200, SHAPE_PREFILL, 64, SINK_FINITE, 1, 0, 3},
      {8, 200, SHAPE_PREFILL, 16, SINK_EDGES, 1, 1, 6},
      {128, 200, SHAPE_PREFILL, 256, SINK_NONE, 0, 0, 3},
      {64, 40, SHAPE_MIXED, 64, SINK_EDGES, 1, 1, 3},
      {8, 1100, SHAPE_PREFILL, 64, SINK_FINITE, 1, 0, 3},
      {16, 3000, SHAPE_PREFILL, 16, SINK_EDGES, 1, 1, 3},
  };
  for (size_t i = 0; i < sizeof(small) / sizeof(small[0]); i++)
    run_case(&c, &small[i], 0);
  if (!quick)
    for (size_t i = 0; i < sizeof(large) / sizeof(large[0]); i++)
      run_case(&c, &large[i], 0);
  /* SPEC §5.4: the same batch four more times. */
  static const case_t rep = {64, 64, SHAPE_DECODE, 64, SINK_EDGES, 1, 0, 3};
  run_case(&c, &rep, 4);
  if (!quick)
    cover_shapes(&c);
  refusals(&c, quick);
  dsv4_backend_close(c.cuda);
  dsv4_backend_close(c.cpu);
  dsv4_rope_table_destroy(c.rope[0]);
  dsv4_rope_table_destroy(c.rope[1]);
  if (c.failures) {
    printf("gpu_attn_test: %d check(s) FAILED\n", c.failures);
    return 1;
  }
  printf("gpu_attn_test: every case byte-identical to the CPU backend, every refusal clean\n");
  return 0;
}
