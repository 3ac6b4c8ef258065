/*
 * SPEC §7 fast mode on the GPU: the CUDA backend's tensor-core attention within FlashMLA's
 * tolerances of exact mode, and deterministic from run to run.
 *
 * Each case builds sequences whose windows reach into an earlier batch (gpu_attn_common.h), runs
 * them through the CPU backend in exact mode (the reference) and through the CUDA backend in fast
 * mode, and measures, as FlashMLA's tests do against their fp32 reference: every value passes when
 * its absolute error is at most 1e-3 or its relative error at most 2.01 / 128, and the cosine
 * distance of the whole output, 1 - 2 sum(x y) / sum(x^2 + y^2), is at most 5e-6. lse is held to
 * the same per-value bound. Then the same launch four more times must give the same bytes.
 *
 * Cases: decode steps of 1 to 256 sequences (every CTA shape of the kernel), H from 1 to 128 with
 * head counts that leave a CTA's last m-tile part-empty, the first token of a sequence (one
 * candidate), windows cut at p0, prefill chunks longer than the window, block sizes 16 to 256,
 * plain and YaRN tables, sinks finite, +inf, -inf and none. Adversarial inputs: every slot of the
 * pool that no insert writes filled with E4M3 NaN bytes (a read of anything outside the window
 * shows), wide exponent spreads, and queries of zeros (every score equal).
 *
 * One case goes past what any fp32 evaluation can promise: kv values spread over 2^-12..2^12 (no
 * kv_norm output comes near), whose logits reach thousands, where one fp32 ulp of a logit is about
 * 2.4e-4 and exact mode's own summation order places a weight no closer than about 1e-3 to the true
 * one; an output that cancels terms of such weights can then move by tens of percent in either
 * mode. Those cases (40 tokens, 32-head CTAs; 128 tokens, 64-head CTAs on the warpgroup MMAs where
 * the device runs them) are held to the cosine bound and to at most one value in 100,000 outside
 * the per-value bound (SPEC §7, fast mode).
 *
 * The union of the window and the compressed entries (SPEC §8.6) runs its own kernel, measured the
 * same way: ratio 4 with selections of 512 and 1024 (full rows, rows cut short and -1 padded, rows
 * of tokens that see fewer entries than topk), ratio 128 with few, about 512 and more than 4000
 * visible entries; p0 = 0 and p0 > 0, a token at its p0; H = 8, 64 and 128; sinks finite, +inf,
 * -inf and none; decode steps and prefill chunks; every CTA shape: 16 and 32 heads on mma.sync,
 * and where the device runs it 64 on warpgroup MMAs (sm90a/attention_fast_union_wg.cu), every case
 * of more than 32 heads on both kernels (the launcher's choice and the other one). The entry pool
 * is filled with E4M3 NaN bytes as well.
 *
 * Refusals (SPEC §7: DSV4_EINVAL, no byte of attn or lse written, the launch after it right again):
 * window launches with a block-table entry of -1 or past the pool in a token's window, at 1, 16, 64
 * and 1100 tokens; union launches with a bad selection row (repeated entry, entry not yet visible)
 * or an entry read whose block is -1 in the entry table, at 1, 8, 40 and 200 tokens of ratio 4 and
 * 1 and 15 of ratio 128; and at each of those sizes a valid launch queued after an invalid one in
 * the same batch (the error word already set: cuda-kernels.h, every later kernel of the batch
 * writes nothing). Between them they take every way a launch is checked: by every CTA of the
 * attention kernel (up to DSV4_CUDA_ATTN_CHECK_ALL_MAX tokens; with entries while
 * dsv4__cuda_union_checks_all holds, unsplit), by a split union's CTAs each checking what it reads
 * (the combine writing nothing once one has set the error word), or by the check kernel before it,
 * split with a combine after or not (on an H200: window 8, 2, 1 and 1 splits, union 32, 4, 3 and 1;
 * each names its path). Every selection row that ends early carries junk after its -1, which no
 * check may take for an error (the union case of 2 tokens of short rows takes it through the split
 * CTAs' checks).
 *
 * The small batches among those (1 to 16 decode tokens on an H200) split each token's list over
 * several CTAs and merge the partial states in a combine kernel (attention_fast_union.cu), the
 * window's cases as well as the union's; at least one case of each must have run split where the
 * device splits a one-token launch. The same source built with DSV4_TEST_TUNE (gpu_attn_split_test)
 * forces 1, 2, 3, 5, 8 and 32 splits on the same inputs of each of several union cases (both CTA
 * shapes, partial m-tiles, lists shorter than the splits' tiles, thousands of entries, sinks of
 * every kind, a prefill chunk), and 1, 2, 4 and 8 splits of the window on several window cases
 * (windows shorter than a split, a sequence's first token, part-empty m-tiles, a prefill chunk),
 * and holds every run to the same tolerances of exact mode, the same bytes on every run, and the
 * refusals to no byte written (the window's under 4 forced splits, the union's under 3: split at
 * every size, behind the check kernel too).
 *
 * Usage: gpu_attn_fast_test   (gpu_attn_split_test: the forced splits only)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_attn_common.h"

#define MAX_POS DSV4_MAX_POSITION_DEFAULT
#define ABS_TOL 1e-3
#define REL_TOL (2.01 / 128.0)
#define COS_TOL 5e-6
#ifdef DSV4_TEST_TUNE
#define TEST_NAME "gpu_attn_split_test"
#else
#define TEST_NAME "gpu_attn_fast_test"
#endif

enum { SINK_NONE, SINK_FINITE, SINK_EDGES };
enum { SHAPE_DECODE, SHAPE_PREFILL };

typedef struct {
  uint32_t heads, tokens; /* tokens: decode sequences, or prefill chunk length */
  int shape;
  uint32_t bs;
  int sinks, yarn, spread, zero_q;
  int wide; /* logits in the thousands: the looser per-value bound (above) */
} case_t;

typedef struct {
  dsv4_backend_t *cpu, *cuda;
  dsv4_rope_table_t *rope[2];
  uint64_t rng;
  int failures;
  uint32_t shapes_seen;       /* bit log2(heads per CTA / 16) of every CTA shape met */
  uint32_t union_shapes_seen; /* the same for the union kernel */
  uint32_t union_split_runs;  /* union cases whose launch split its tokens' lists */
  uint32_t window_split_runs; /* the same for the window's cases */
  uint32_t wg_compared;       /* window cases run on warpgroup MMAs and on mma.sync */
  double worst_cos, worst_rel;
} ctx_t;

static float *make_sinks(uint64_t *rng, uint32_t heads, int kind) {
  if (kind == SINK_NONE)
    return NULL;
  float *s = gpu_host_alloc(sizeof(float) * heads);
  for (uint32_t h = 0; h < heads; h++) {
    s[h] = ((float)gpu_below(rng, 1u << 16) - 32768.0f) * 0x1p-12f;
    if (kind == SINK_EDGES && h % 8 == 3)
      s[h] = INFINITY;
    if (kind == SINK_EDGES && h % 8 == 5)
      s[h] = -INFINITY;
  }
  return s;
}

static const char *sink_name(int kind) {
  return kind == SINK_NONE ? "none" : kind == SINK_FINITE ? "finite" : "finite/+inf/-inf";
}

static double bf16_value(uint16_t v) {
  uint32_t b = (uint32_t)v << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

/* FlashMLA's per-value test: close in absolute or in relative terms. */
static int close_enough(double a, double r) {
  if (isnan(a) || isnan(r))
    return isnan(a) && isnan(r);
  if (isinf(a) || isinf(r))
    return a == r;
  double e = fabs(a - r);
  return e <= ABS_TOL || e <= REL_TOL * fabs(r);
}

/* 0, or 1 after naming the first value out of tolerance, or a cosine distance above it. */
static int measure(ctx_t *c, const char *what, const attn_plan_t *p, uint32_t heads, int wide,
                   const uint16_t *out, const uint16_t *ref, const float *lse,
                   const float *ref_lse) {
  size_t n = (size_t)p->n_q * heads * DSV4_HEAD_DIM, bad = 0, first = 0;
  double xy = 0, xx = 0, worst = 0;
  for (size_t i = 0; i < n; i++) {
    double a = bf16_value(out[i]), r = bf16_value(ref[i]);
    if (!close_enough(a, r) && bad++ == 0)
      first = i;
    xy += a * r;
    xx += a * a + r * r;
    double rel = fabs(a - r) / (fabs(r) > 1e-30 ? fabs(r) : 1e-30);
    if (!wide && fabs(a - r) > ABS_TOL && rel > worst)
      worst = rel;
  }
  double cosd = xx > 0 ? 1.0 - 2.0 * xy / xx : 0.0;
  if (cosd > c->worst_cos)
    c->worst_cos = cosd;
  if (worst > c->worst_rel)
    c->worst_rel = worst;
  int fail = 0;
  /* The wide case: at most one value in 100,000 outside the per-value bound (above). */
  if (bad && (!wide || (double)bad > 1e-5 * (double)n)) {
    size_t t = first / DSV4_HEAD_DIM / heads;
    fprintf(stderr,
            "FAIL %s: attn out of tolerance first at token %zu (position %lld) head %zu dim %zu: "
            "%.9g, exact %.9g (%zu of %zu values)\n",
            what, t, (long long)p->q_pos[t], first / DSV4_HEAD_DIM % heads, first % DSV4_HEAD_DIM,
            bf16_value(out[first]), bf16_value(ref[first]), bad, n);
    fail = 1;
  }
  if (cosd > COS_TOL) {
    fprintf(stderr, "FAIL %s: cosine distance %.3g > %.3g\n", what, cosd, COS_TOL);
    fail = 1;
  }
  for (size_t i = 0; i < (size_t)p->n_q * heads; i++)
    if (!close_enough(lse[i], ref_lse[i])) {
      fprintf(stderr, "FAIL %s: lse of token %zu head %zu: %.9g, exact %.9g\n", what, i / heads,
              i % heads, (double)lse[i], (double)ref_lse[i]);
      fail = 1;
      break;
    }
  printf("%s %s: cosine distance %.2e, %zu values, %zu outside the per-value bound%s\n",
         fail ? "FAIL" : "ok  ", what, cosd, n, bad,
         wide ? " (logits in the thousands: at most 1e-5 of them may be)" : "");
  return fail;
}

/*
 * The batch of plan p and inputs in on the CPU backend in exact mode (the reference) and on the
 * CUDA backend in fast mode, measured; then fast mode four more times, which must give the same
 * bytes. A window launch that splits (window_split) ends in thread-block clusters where the device
 * runs them: in the split build it runs once more through the combine kernel, which must give the
 * same bytes too. Returns 1 on a failure (named on stderr).
 */
static int check_fast(ctx_t *c, const char *what, const attn_plan_t *p, attn_inputs_t *in, int wide,
                      int window_split) {
  const uint32_t heads = in->heads;
  size_t out_n = (size_t)p->n_q * heads * DSV4_HEAD_DIM, lse_n = (size_t)p->n_q * heads;
  uint16_t *ref = gpu_host_alloc(out_n * 2), *out = gpu_host_alloc(out_n * 2);
  uint16_t *again = gpu_host_alloc(out_n * 2);
  float *ref_lse = gpu_host_alloc(lse_n * 4), *lse = gpu_host_alloc(lse_n * 4);
  float *again_lse = gpu_host_alloc(lse_n * 4);
  in->fast = 0;
  int bad = 0, rc = attn_run(c->cpu, p, in, NULL, ref, ref_lse, NULL);
  if (rc) {
    fprintf(stderr, "FAIL %s: the CPU backend refused the batch: %s\n", what, dsv4_strerror(rc));
    bad = 1;
  }
  in->fast = 1;
  if (!bad && (rc = attn_run(c->cuda, p, in, NULL, out, lse, NULL)) != 0) {
    fprintf(stderr, "FAIL %s: fast mode refused the batch: %s\n", what, dsv4_strerror(rc));
    bad = 1;
  }
  if (!bad)
    bad = measure(c, what, p, heads, wide, out, ref, lse, ref_lse);
  for (int rep = 0; rep < 4 && !bad; rep++) {
    in->win = rep % 2 ? ATTN_WIN_BUILT : ATTN_WIN_NONE; /* runs 3 and 5: the engine's windows */
    CKD(attn_run(c->cuda, p, in, NULL, again, again_lse, NULL));
    if (memcmp(again, out, out_n * 2) != 0 || memcmp(again_lse, lse, lse_n * 4) != 0) {
      fprintf(stderr, "FAIL %s: run %d of fast mode%s differs from the first\n", what, rep + 2,
              rep % 2 ? " (with the engine's windows)" : "");
      bad = 1;
    }
  }
  in->win = ATTN_WIN_NONE;
#ifdef DSV4_TEST_TUNE
  /* The combine kernel, without and with the engine's windows (it takes the query's position from
   * them then). */
  for (int w = 0; w < 2 && !bad && window_split; w++) {
    dsv4__cuda_test_window_combine = 1;
    in->win = w ? ATTN_WIN_BUILT : ATTN_WIN_NONE;
    rc = attn_run(c->cuda, p, in, NULL, again, again_lse, NULL);
    in->win = ATTN_WIN_NONE;
    dsv4__cuda_test_window_combine = 0;
    CKD(rc);
    if (memcmp(again, out, out_n * 2) != 0 || memcmp(again_lse, lse, lse_n * 4) != 0) {
      fprintf(stderr, "FAIL %s: the splits ended in clusters differ from the combine kernel's%s\n",
              what, w ? " (with the engine's windows)" : "");
      bad = 1;
    }
  }
#else
  (void)window_split;
#endif
  free(ref);
  free(out);
  free(again);
  free(ref_lse);
  free(lse);
  free(again_lse);
  return bad;
}

static uint32_t make_specs(uint64_t *rng, const case_t *k, attn_seg_spec_t *spec) {
  if (k->shape == SHAPE_PREFILL) {
    int64_t p0 = 1 + (int64_t)gpu_below(rng, 5000);
    spec[0] = (attn_seg_spec_t){p0, p0 + 50, k->tokens};
    return 1;
  }
  for (uint32_t g = 0; g < k->tokens; g++) {
    int64_t p0 = g % 3 == 0 ? 0 : (int64_t)gpu_below(rng, 500000);
    int64_t first = g % 7 == 1 ? p0
                    : g % 7 == 2
                        ? p0 + 1 + (int64_t)gpu_below(rng, 126)
                        : p0 + 127 + (int64_t)(gpu_rnd(rng) % (uint64_t)(MAX_POS - 500000 - 500));
    spec[g] = (attn_seg_spec_t){p0, first, 1};
  }
  return k->tokens;
}

/* The plan and inputs of window case k (no compressed entries); returns its sinks (or NULL), which
 * in->sink holds. */
static float *window_setup(ctx_t *c, const case_t *k, attn_plan_t *p, attn_inputs_t *in) {
  attn_seg_spec_t spec[300];
  uint32_t n_segs = make_specs(&c->rng, k, spec);
  attn_plan_make(&c->rng, p, spec, n_segs, k->bs, n_segs + 5);
  memset(in, 0, sizeof(*in));
  attn_inputs_fill(&c->rng, p, in, k->heads, k->spread);
  if (k->zero_q) {
    memset((void *)in->q_q, 0, (size_t)p->n_q * k->heads * DSV4_HEAD_DIM * 2);
    memset((void *)in->q_hist, 0, (size_t)p->n_hist * k->heads * DSV4_HEAD_DIM * 2);
  }
  float *sinks = make_sinks(&c->rng, k->heads, k->sinks);
  in->sink = sinks;
  in->want_lse = 1;
  in->rope = c->rope[k->yarn];
  in->cache_fill = 0x7f; /* E4M3 NaN in every slot no insert writes */
  CKD(dsv4_rope_table_ensure(in->rope, p->hist_pos, p->n_hist));
  CKD(dsv4_rope_table_ensure(in->rope, p->q_pos, p->n_q));
  return sinks;
}

#ifndef DSV4_TEST_TUNE
/* A window launch of 64-head CTAs on warpgroup MMAs (sm90a/attention_fast_wg.cu) against the same
 * launch on mma.sync (dsv4__cuda_attention_fast_force_sync): the same bytes of attn and lse. */
static int compare_wg(ctx_t *c, const char *what, const attn_plan_t *p, attn_inputs_t *in) {
  const size_t out_n = (size_t)p->n_q * in->heads * DSV4_HEAD_DIM,
               lse_n = (size_t)p->n_q * in->heads;
  uint16_t *wg = gpu_host_alloc(out_n * 2), *sync = gpu_host_alloc(out_n * 2);
  float *wg_lse = gpu_host_alloc(lse_n * 4), *sync_lse = gpu_host_alloc(lse_n * 4);
  in->fast = 1;
  CKD(attn_run(c->cuda, p, in, NULL, wg, wg_lse, NULL));
  dsv4__cuda_attention_fast_force_sync(1);
  int rc = attn_run(c->cuda, p, in, NULL, sync, sync_lse, NULL);
  dsv4__cuda_attention_fast_force_sync(0);
  CKD(rc);
  size_t dv = 0, dl = 0;
  int most = 0;
  for (size_t i = 0; i < out_n; i++)
    if (wg[i] != sync[i]) {
      const int d = abs((int)wg[i] - (int)sync[i]);
      dv++;
      most = d > most ? d : most;
    }
  for (size_t i = 0; i < lse_n; i++)
    dl += memcmp(&wg_lse[i], &sync_lse[i], 4) != 0;
  if (dv || dl)
    fprintf(stderr,
            "FAIL %s: on warpgroup MMAs %zu of %zu values (at most %d bf16 steps apart) and %zu "
            "of %zu lse differ from mma.sync's\n",
            what, dv, out_n, most, dl, lse_n);
  c->wg_compared++;
  free(wg);
  free(sync);
  free(wg_lse);
  free(sync_lse);
  return dv || dl;
}
#endif

static void run_case(ctx_t *c, const case_t *k) {
  attn_plan_t p;
  attn_inputs_t in;
  float *sinks = window_setup(c, k, &p, &in);
  uint32_t hpb = dsv4__cuda_attention_fast_heads_per_block(p.n_q, k->heads);
  uint32_t splits = dsv4__cuda_attention_fast_splits(p.n_q, k->heads);
  for (uint32_t s = 0; s < 3; s++)
    if (hpb == 16u << s)
      c->shapes_seen |= 1u << s;
  c->window_split_runs += splits > 1;
  char what[260];
  snprintf(what, sizeof(what),
           "H=%u %u queries in %u segments bs=%u %s sinks=%s spread=%d%s, %u heads per CTA, "
           "%u split(s)",
           k->heads, p.n_q, p.n_segs, k->bs, k->yarn ? "yarn" : "plain", sink_name(k->sinks),
           k->spread, k->zero_q ? " q=0" : "", hpb, splits);
  c->failures += check_fast(c, what, &p, &in, k->wide, splits > 1);
#ifndef DSV4_TEST_TUNE
  if (hpb == 64 && dsv4__cuda_attention_fast_wg())
    c->failures += compare_wg(c, what, &p, &in);
#endif
  free(sinks);
  attn_inputs_free(&in);
  attn_plan_free(&p);
}

/* ---- refusals (SPEC §7: a launch that fails writes no byte of attn or lse) ---- */

/* The launch of plan p (over table tab, or the plan's own; after in->earlier's launch when set)
 * in fast mode must be refused with DSV4_EINVAL and leave attn and lse as the canary left them. */
static void expect_refusal(ctx_t *c, const char *what, const attn_plan_t *p, attn_inputs_t *in,
                           const attn_table_t *tab) {
  size_t out_n = (size_t)p->n_q * in->heads * DSV4_HEAD_DIM, lse_n = (size_t)p->n_q * in->heads;
  uint16_t *out = gpu_host_alloc(out_n * 2);
  float *lse = gpu_host_alloc(lse_n * 4);
  in->fast = 1;
  int rc = attn_run(c->cuda, p, in, tab, out, lse, NULL);
  const int out_ok = attn_untouched(out, out_n * 2), lse_ok = attn_untouched(lse, lse_n * 4);
  if (rc != DSV4_EINVAL || !out_ok || !lse_ok) {
    fprintf(stderr, "FAIL %s: %s, attn %s, lse %s\n", what, rc ? dsv4_strerror(rc) : "accepted",
            out_ok ? "untouched" : "written", lse_ok ? "untouched" : "written");
    c->failures++;
  } else {
    printf("ok   %s: refused (invalid), nothing written\n", what);
  }
  free(out);
  free(lse);
}

/* The path a fast launch of n tokens takes: who checks it (every CTA of the attention kernel, a
 * split union's CTAs what each reads, or the check kernel before it) and into how many splits each
 * token's list goes (a combine after). */
static void launch_path(char *buf, size_t len, uint32_t n, int with_entries, uint32_t sel_stride,
                        uint32_t splits) {
  const int all =
      with_entries ? dsv4__cuda_union_checks_all(n, sel_stride) : n <= DSV4_CUDA_ATTN_CHECK_ALL_MAX;
  const char *who = !all                         ? "the check kernel first"
                    : with_entries && splits > 1 ? "each CTA checking what it reads"
                                                 : "checked by every CTA";
  snprintf(buf, len, "%s, %u split%s%s", who, splits, splits == 1 ? "" : "s",
           splits == 1 ? "" : " and the combine");
}

/* The entry of the plan's block table that maps the first candidate of a token's window: the last
 * token whose window is whole (128 candidates), else the last token. */
static uint32_t window_entry(const attn_plan_t *p) {
  uint32_t t = p->n_q - 1;
  for (uint32_t u = p->n_q; u-- > 0;)
    if (p->q_pos[u] - (DSV4_WINDOW - 1) >= p->seg_p0[p->q_seg[u]]) {
      t = u;
      break;
    }
  const uint32_t s = (uint32_t)p->q_seg[t];
  const int64_t pos = p->q_pos[t], p0 = p->seg_p0[s];
  const int64_t lo = pos - (DSV4_WINDOW - 1) > p0 ? pos - (DSV4_WINDOW - 1) : p0;
  return p->seg_bt_off[s] + (uint32_t)(lo / p->bs - p->seg_first_lb[s]);
}

/*
 * Fast window launches (no compressed entries) made invalid by one entry of the block table, the
 * block of a token's first candidate (that token's window whole where the batch has one): -1, or
 * a block past the pool. Each is refused with DSV4_EINVAL and writes no byte of attn or lse; so is
 * a valid launch queued after the first of them in the same batch (the error word already set). At
 * 1, 16, 64 and 1100 tokens of 64 heads: on an H200 (132 SMs) 8, 2, 1 and 1 splits, every CTA
 * checking the whole launch up to DSV4_CUDA_ATTN_CHECK_ALL_MAX tokens, the check kernel before
 * the attention kernel past it. The launch after them is right again (the next case).
 */
static void window_refusals(ctx_t *c) {
  static const char *const names[4] = {
      "a block-table entry of -1", "a block-table entry past the pool",
      "nothing wrong, queued after one with a block of -1 (the error word already set)",
      "right tables and the engine's windows, the last token's with a block past the pool"};
  /* heads, tokens, shape, bs, sinks, yarn, spread, zero_q, wide */
  static const case_t cases[] = {
      {64, 1, SHAPE_DECODE, 64, SINK_FINITE, 0, 3, 0, 0},
      {64, 16, SHAPE_DECODE, 16, SINK_EDGES, 1, 3, 0, 0},
      {64, 64, SHAPE_DECODE, 64, SINK_NONE, 0, 3, 0, 0},
      {64, 1100, SHAPE_PREFILL, 64, SINK_FINITE, 0, 3, 0, 0},
  };
  /* Drawn from a copy of the generator: the window cases after these see the inputs they had
   * before the refusals were added. */
  const uint64_t rng = c->rng;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const case_t *k = &cases[i];
    attn_plan_t p;
    attn_inputs_t in;
    float *sinks = window_setup(c, k, &p, &in);
    const uint32_t e = window_entry(&p);
    int32_t *bt = gpu_host_alloc(sizeof(int32_t) * p.bt_len);
    attn_table_t tab = attn_plan_table(&p);
    tab.block_table = bt;
    char path[96];
    launch_path(path, sizeof(path), p.n_q, 0, 0, dsv4__cuda_attention_fast_splits(p.n_q, k->heads));
    for (int brk = 0; brk < 4; brk++) {
      memcpy(bt, p.block_table, sizeof(int32_t) * p.bt_len);
      if (brk < 3)
        bt[e] = brk == 1 ? (int32_t)p.n_blocks : -1;
      in.earlier = brk == 2 ? &tab : NULL;
      in.win = brk == 3 ? ATTN_WIN_BAD_BLOCK : ATTN_WIN_NONE;
      in.win_bad_token = p.n_q - 1;
      char what[300];
      snprintf(what, sizeof(what), "fast window launch of %u tokens (%s) with %s", p.n_q, path,
               names[brk]);
      expect_refusal(c, what, &p, &in, brk == 1 || brk == 0 ? &tab : NULL);
    }
    in.win = ATTN_WIN_NONE;
    free(bt);
    free(sinks);
    attn_inputs_free(&in);
    attn_plan_free(&p);
  }
  c->rng = rng;
}

#ifndef DSV4_TEST_TUNE
/* The window's cases (no compressed entries), then a decode batch for every CTA shape not met. */
static void run_window_cases(ctx_t *c) {
  /* heads, tokens, shape, bs, sinks, yarn, spread, zero_q, wide */
  static const case_t cases[] = {
      {64, 1, SHAPE_DECODE, 64, SINK_FINITE, 0, 3, 0, 0},
      {64, 16, SHAPE_DECODE, 64, SINK_EDGES, 1, 3, 0, 0},
      {64, 64, SHAPE_DECODE, 64, SINK_FINITE, 0, 3, 0, 0},
      {64, 128, SHAPE_DECODE, 16, SINK_EDGES, 0, 3, 0, 0},
      {64, 256, SHAPE_DECODE, 256, SINK_FINITE, 1, 3, 0, 0},
      {128, 64, SHAPE_DECODE, 64, SINK_EDGES, 1, 3, 0, 0},
      {8, 3, SHAPE_DECODE, 16, SINK_NONE, 0, 3, 0, 0},
      {1, 5, SHAPE_DECODE, 64, SINK_EDGES, 0, 3, 0, 0},
      {13, 40, SHAPE_DECODE, 64, SINK_FINITE, 1, 6, 0, 0},
      {100, 32, SHAPE_DECODE, 16, SINK_NONE, 0, 8, 0, 0},
      {64, 200, SHAPE_PREFILL, 64, SINK_FINITE, 0, 3, 0, 0},
      {16, 1500, SHAPE_PREFILL, 16, SINK_EDGES, 1, 3, 0, 0},
      {64, 20, SHAPE_DECODE, 64, SINK_FINITE, 0, 3, 1, 0},
      {64, 40, SHAPE_DECODE, 64, SINK_NONE, 0, 12, 0, 1},
      {64, 128, SHAPE_DECODE, 64, SINK_EDGES, 1, 12, 0, 1},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    run_case(c, &cases[i]);
    if (i == 0)
      window_refusals(c);
  }
  /* Every CTA shape (16, 32 and 64 heads) must have met exact mode. */
  for (uint32_t sh = 0; sh < 3; sh++) {
    if (c->shapes_seen & (1u << sh))
      continue;
    case_t k = {0, 0, SHAPE_DECODE, 64, SINK_EDGES, 0, 3, 0, 0};
    for (uint32_t b = 1; b <= 256 && !k.heads; b++)
      if (dsv4__cuda_attention_fast_heads_per_block(b, 64) == 16u << sh) {
        k.heads = 64;
        k.tokens = b;
      }
    if (!k.heads) {
      fprintf(stderr, "FAIL no decode batch of this device gets %u heads per CTA\n", 16u << sh);
      c->failures++;
      continue;
    }
    run_case(c, &k);
  }
  if (dsv4__cuda_attention_fast_splits(1, 64) > 1 && c->window_split_runs == 0) {
    fprintf(stderr, "FAIL no window case of this device split its tokens' windows\n");
    c->failures++;
  }
  if (dsv4__cuda_attention_fast_wg()) {
    if (!c->wg_compared) {
      fprintf(stderr, "FAIL no window case ran on warpgroup MMAs, which this device runs\n");
      c->failures++;
    }
    printf("%s: %u window cases on warpgroup MMAs against mma.sync\n", TEST_NAME, c->wg_compared);
  }
}
#endif

/* ---- the union of the window and the compressed entries (SPEC §8.6) ---- */

typedef struct {
  uint32_t heads, tokens; /* tokens: decode sequences, or prefill chunk length */
  int shape;
  uint32_t bs, ratio, topk; /* topk: ratio 4's selection width (512, or 1024 as on V4-Pro) */
  int64_t lo, hi;           /* query positions in lo..hi - 1 (a prefill starts there) */
  int sinks, yarn;
  uint32_t short_every; /* every short_every-th token lists fewer entries than it could (0: none) */
} ucase_t;

/* Segments whose queries lie in lo..hi: p0 of 0 on every third, else above 0 (up to lo / 2), one in
 * seven at its p0 (a window of one, no entry yet at most ratios). */
static uint32_t make_union_specs(uint64_t *rng, const ucase_t *k, attn_seg_spec_t *spec) {
  const uint32_t n_segs = k->shape == SHAPE_PREFILL ? 1 : k->tokens;
  for (uint32_t g = 0; g < n_segs; g++) {
    int64_t p0 = g % 3 == 0 ? 0 : 1 + (int64_t)gpu_below(rng, (uint32_t)(k->lo / 2));
    int64_t first = k->lo + (int64_t)(gpu_rnd(rng) % (uint64_t)(k->hi - k->lo));
    if (g % 7 == 1 && k->shape == SHAPE_DECODE)
      first = p0;
    spec[g] = (attn_seg_spec_t){p0, first, k->shape == SHAPE_PREFILL ? k->tokens : 1};
  }
  return n_segs;
}

/* The most and fewest candidates (window and entries) of a token of the plan. */
static void union_span(const attn_plan_t *p, const attn_entries_t *e, uint32_t *most,
                       uint32_t *fewest) {
  *most = 0;
  *fewest = UINT32_MAX;
  for (uint32_t t = 0; t < p->n_q; t++) {
    const int64_t pos = p->q_pos[t], p0 = p->seg_p0[p->q_seg[t]];
    uint32_t n = (uint32_t)(pos - (pos - 127 > p0 ? pos - 127 : p0) + 1);
    if (e->sel) {
      for (uint32_t k = 0; k < e->sel_stride && e->sel[(size_t)t * e->sel_stride + k] >= 0; k++)
        n++;
    } else {
      n += (uint32_t)((pos + 1) / e->ratio - p0 / e->ratio);
    }
    *most = n > *most ? n : *most;
    *fewest = n < *fewest ? n : *fewest;
  }
}

/* Junk after the first -1 of every selection row of e that ends before its stride: entries not
 * yet visible, decreasing, of blocks outside the tables. A row ends at its first -1 (SPEC §8.4),
 * so every backend must ignore them (and the launch's checks, whose parts take 32 entries each,
 * must not fail on them). */
static void junk_after_rows(const attn_plan_t *p, attn_entries_t *e) {
  for (uint32_t t = 0; e->sel && t < p->n_q; t++) {
    int32_t *row = e->sel + (size_t)t * e->sel_stride;
    uint32_t n = 0;
    while (n < e->sel_stride && row[n] >= 0)
      n++;
    for (uint32_t k = n + 1; k < e->sel_stride; k++)
      row[k] = k % 3 == 0 ? (int32_t)((p->q_pos[t] + 1) / e->ratio + k) : (int32_t)(k % 5);
  }
}

static void union_setup(ctx_t *c, const ucase_t *k, attn_plan_t *p, attn_inputs_t *in,
                        attn_entries_t *e) {
  attn_seg_spec_t spec[300];
  uint32_t n_segs = make_union_specs(&c->rng, k, spec);
  attn_plan_make(&c->rng, p, spec, n_segs, k->bs, n_segs + 5);
  memset(in, 0, sizeof(*in));
  attn_inputs_fill(&c->rng, p, in, k->heads, 3);
  attn_entries_make(&c->rng, p, e, k->ratio, k->topk, k->short_every, 3);
  junk_after_rows(p, e);
  in->ent = e;
  in->want_lse = 1;
  in->rope = c->rope[k->yarn];
  in->cache_fill = 0x7f; /* E4M3 NaN in every slot no insert writes, in both pools */
  CKD(dsv4_rope_table_ensure(in->rope, p->hist_pos, p->n_hist));
  CKD(dsv4_rope_table_ensure(in->rope, p->q_pos, p->n_q));
}

/* The union kernel other than the launcher's choice for a launch of n tokens of `heads` heads,
 * where the device has both (sm_90a, more than 32 heads): mma.sync
 * (dsv4__cuda_attention_fast_force_sync) in place of 64-head CTAs on warpgroup MMAs, or those
 * (dsv4__cuda_attention_fast_union_force_wg) in place of mma.sync. 0 when there is none. */
static int union_other_form(uint32_t n, uint32_t heads, int on) {
  if (!on) {
    dsv4__cuda_attention_fast_force_sync(0);
    dsv4__cuda_attention_fast_union_force_wg(0);
    return 1;
  }
  if (heads <= 32 || !dsv4__cuda_attention_fast_union_wg())
    return 0;
  if (dsv4__cuda_attention_fast_union_heads_per_block(n, heads) == 64)
    dsv4__cuda_attention_fast_force_sync(1);
  else
    dsv4__cuda_attention_fast_union_force_wg(1);
  return 1;
}

/* One union case's launch as the device runs it, then on the other union kernel where the device
 * has both (union_other_form), each held to exact mode on its own. */
static void run_union_case(ctx_t *c, const ucase_t *k) {
  attn_plan_t p;
  attn_inputs_t in;
  attn_entries_t e;
  union_setup(c, k, &p, &in, &e);
  float *sinks = make_sinks(&c->rng, k->heads, k->sinks);
  in.sink = sinks;
  uint32_t most, fewest;
  union_span(&p, &e, &most, &fewest);
  for (int form = 0; form < 2 && union_other_form(p.n_q, k->heads, form); form++) {
    const uint32_t hpb = dsv4__cuda_attention_fast_union_heads_per_block(p.n_q, k->heads);
    for (uint32_t s = 0; s < 3; s++)
      if (hpb == 16u << s)
        c->union_shapes_seen |= 1u << s;
    const uint32_t splits = dsv4__cuda_attention_fast_union_splits(p.n_q, k->heads);
    c->union_split_runs += splits > 1;
    char what[300];
    snprintf(what, sizeof(what),
             "C%u%s%.0u H=%u %u queries in %u segments bs=%u %s sinks=%s, %u..%u candidates, %u "
             "heads per CTA%s, %u split%s",
             k->ratio, k->ratio == 4 ? " topk " : "", k->ratio == 4 ? k->topk : 0, k->heads, p.n_q,
             p.n_segs, k->bs, k->yarn ? "yarn" : "plain", sink_name(k->sinks), fewest, most, hpb,
             hpb == 64 ? " (warpgroup MMAs)" : "", splits, splits == 1 ? "" : "s");
    c->failures += check_fast(c, what, &p, &in, 0, 0);
  }
  union_other_form(0, 0, 0);
  free(sinks);
  attn_entries_free(&e);
  attn_inputs_free(&in);
  attn_plan_free(&p);
}

/* Breaks token t's entries in e: brk 0 repeats an entry of its selection row, brk 1 lists one not
 * yet visible, brk 3 sets the entry table's block of one it reads (the row's middle one, or at
 * ratio 128 the middle visible one) to -1 (brk 2 leaves them whole). 1 when the token reads too
 * few entries to break. */
static int break_entries(const attn_plan_t *p, attn_entries_t *e, uint32_t t, int brk) {
  const uint32_t g = (uint32_t)p->q_seg[t];
  const int64_t j_lo = p->seg_p0[g] / e->ratio, j_hi = (p->q_pos[t] + 1) / e->ratio;
  int32_t *row = e->sel ? e->sel + (size_t)t * e->sel_stride : NULL;
  uint32_t n = row ? 0u : (uint32_t)(j_hi > j_lo ? j_hi - j_lo : 0);
  while (row && n < e->sel_stride && row[n] >= 0)
    n++;
  if (n < 8 || (!row && brk != 2 && brk != 3))
    return 1;
  if (brk == 0)
    row[7] = row[6];
  else if (brk == 1) /* after the last entry listed, or in place of it: past the visible ones */
    row[n < e->sel_stride ? n : e->sel_stride - 1] = (int32_t)((p->q_pos[t] + 1) / 4);
  else if (brk == 3) {
    const int64_t j = row ? row[n / 2] : j_lo + n / 2;
    e->block_table[e->seg_bt_off[g] + (uint32_t)(j / p->bs - e->seg_first_lb[g])] = -1;
  }
  return 0;
}

/*
 * Fast union launches whose entries are bad (a selection row repeating an entry or naming one not
 * yet visible; an entry read whose block the entry table gives as -1), and a valid one queued
 * after an invalid launch in the same batch (the error word already set): each is refused with
 * DSV4_EINVAL and writes no byte of attn or lse. At 1 token of 64 heads (32 splits on an H200,
 * each CTA checking the entries it reads), 8 (the check kernel first, a CTA per token; 4 splits),
 * 40 of 16 heads (the check kernel first; 3 splits on an H200, where every launch of more than 16
 * tokens of 64 heads fills half the device and runs unsplit), 200 of 64 heads (the check kernel,
 * unsplit), and at ratio 128 1 and 15 tokens of 64 heads (split, each CTA checking the blocks of
 * the entries it reads). The launch after them is right again (the next case). Each case runs on
 * the launcher's kernel, then, where the device has both, on the other (64-head CTAs on warpgroup
 * MMAs, whose split counts differ).
 */
static void union_refusals(ctx_t *c) {
  static const char *const names[4] = {
      "a selection row not increasing", "a selection row naming an entry not yet visible",
      "nothing wrong, queued after one with a block-table entry of -1 (the error word already "
      "set)",
      "an entry table's block of -1 under an entry read"};
  static const ucase_t cases[] = {
      {64, 1, SHAPE_DECODE, 64, 4, 512, 3000, 9000, SINK_FINITE, 0, 0},
      {64, 8, SHAPE_DECODE, 64, 4, 512, 3000, 9000, SINK_FINITE, 0, 0},
      {16, 40, SHAPE_DECODE, 64, 4, 512, 3000, 9000, SINK_EDGES, 1, 0},
      {64, 200, SHAPE_DECODE, 16, 4, 512, 3000, 9000, SINK_FINITE, 0, 0},
      {64, 1, SHAPE_DECODE, 64, 128, 0, 60000, 70000, SINK_FINITE, 0, 0},
      {64, 15, SHAPE_DECODE, 64, 128, 0, 60000, 70000, SINK_EDGES, 1, 0},
  };
  const size_t nc = sizeof(cases) / sizeof(cases[0]);
  for (size_t f = 0; f < 2 * nc; f++) {
    const ucase_t *k = &cases[f % nc];
    /* each case on the launcher's kernel, then on the other one where the device has both */
    if (!union_other_form(k->tokens, k->heads, f >= nc))
      continue;
    const uint32_t hpb = dsv4__cuda_attention_fast_union_heads_per_block(k->tokens, k->heads);
    char path[128];
    launch_path(path, sizeof(path), k->tokens, 1, k->ratio == 4 ? k->topk : 0,
                dsv4__cuda_attention_fast_union_splits(k->tokens, k->heads));
    snprintf(path + strlen(path), sizeof(path) - strlen(path), ", %u-head CTAs", hpb);
    for (int brk = k->ratio == 4 ? 0 : 2; brk < 4; brk++) {
      attn_plan_t p;
      attn_inputs_t in;
      attn_entries_t e;
      union_setup(c, k, &p, &in, &e);
      float *sinks = make_sinks(&c->rng, k->heads, k->sinks);
      in.sink = sinks;
      /* The last token, well past its p0: a full row, or at ratio 128 hundreds of entries. */
      if (break_entries(&p, &e, p.n_q - 1, brk)) {
        fprintf(stderr, "FAIL the refusal's token lists too few entries to break\n");
        c->failures++;
      }
      /* The third: rows and tables whole, after a launch whose window table has a block of -1. */
      int32_t *bt = gpu_host_alloc(sizeof(int32_t) * p.bt_len);
      memcpy(bt, p.block_table, sizeof(int32_t) * p.bt_len);
      bt[window_entry(&p)] = -1;
      attn_table_t tab = attn_plan_table(&p);
      tab.block_table = bt;
      in.earlier = brk == 2 ? &tab : NULL;
      char what[300];
      snprintf(what, sizeof(what), "fast union launch of %u tokens of %u heads (%s) with %s", p.n_q,
               k->heads, path, names[brk]);
      expect_refusal(c, what, &p, &in, NULL);
      free(bt);
      free(sinks);
      attn_entries_free(&e);
      attn_inputs_free(&in);
      attn_plan_free(&p);
    }
    union_other_form(0, 0, 0);
  }
}

/* The union's cases: heads, tokens, shape, bs, ratio, topk, lo, hi, sinks, yarn, short_every. */
static const ucase_t union_cases[] = {
    {64, 64, SHAPE_DECODE, 64, 4, 512, 2000, 12000, SINK_FINITE, 0, 5},
    {64, 1, SHAPE_DECODE, 64, 4, 512, 8000, 9000, SINK_FINITE, 1, 0},
    {64, 16, SHAPE_DECODE, 16, 4, 1024, 3000, 9000, SINK_EDGES, 1, 4},
    {128, 32, SHAPE_DECODE, 64, 4, 512, 100, 5000, SINK_EDGES, 0, 3},
    {8, 3, SHAPE_DECODE, 64, 4, 1024, 4000, 6000, SINK_NONE, 0, 0},
    {64, 300, SHAPE_PREFILL, 64, 4, 512, 2500, 3000, SINK_FINITE, 0, 0},
    {64, 256, SHAPE_DECODE, 64, 4, 512, 2100, 4000, SINK_FINITE, 1, 6},
    {64, 64, SHAPE_DECODE, 64, 128, 0, 200, 3000, SINK_FINITE, 0, 0},
    {8, 5, SHAPE_DECODE, 16, 128, 0, 100, 900, SINK_EDGES, 0, 0},
    {64, 16, SHAPE_DECODE, 64, 128, 0, 60000, 70000, SINK_EDGES, 1, 0},
    {128, 4, SHAPE_DECODE, 64, 128, 0, 520000, 600000, SINK_EDGES, 0, 0},
    {64, 2, SHAPE_DECODE, 256, 128, 0, 530000, 540000, SINK_FINITE, 1, 0},
    {8, 8, SHAPE_DECODE, 64, 128, 0, 525000, 560000, SINK_NONE, 0, 0},
    {64, 200, SHAPE_PREFILL, 64, 128, 0, 66000, 67000, SINK_FINITE, 0, 0},
    {64, 2, SHAPE_DECODE, 64, 4, 512, 300, 1800, SINK_FINITE, 0, 1},
};

#ifdef DSV4_TEST_TUNE
/* The window's cases of the split build, each under 1, 2, 4 and 8 forced splits on the same inputs:
 * one token of 64 heads (a decode step at b = 1), 16 with YaRN and sinks +-inf, 5 of one head and
 * 3 of 8 (part-empty m-tiles, no sinks) whose batches hold a sequence's first token and windows
 * shorter than a split (splits without a candidate), a prefill chunk, and 256 tokens of 100 heads,
 * which take 64-head CTAs (the warpgroup MMAs' split path where the device runs them) whose second
 * head group holds 36 heads (a partial store by lane). */
static void run_window_split_cases(ctx_t *c) {
  /* heads, tokens, shape, bs, sinks, yarn, spread, zero_q, wide */
  static const case_t cases[] = {
      {64, 1, SHAPE_DECODE, 64, SINK_FINITE, 0, 3, 0, 0},
      {64, 16, SHAPE_DECODE, 64, SINK_EDGES, 1, 3, 0, 0},
      {1, 5, SHAPE_DECODE, 64, SINK_EDGES, 0, 3, 0, 0},
      {8, 3, SHAPE_DECODE, 16, SINK_NONE, 0, 3, 0, 0},
      {64, 40, SHAPE_PREFILL, 64, SINK_FINITE, 0, 3, 0, 0},
      {100, 256, SHAPE_DECODE, 64, SINK_EDGES, 0, 3, 0, 0},
  };
  const uint32_t wide_hpb = dsv4__cuda_attention_fast_heads_per_block(256, 100);
  if (wide_hpb != 64) {
    fprintf(stderr, "FAIL 256 tokens of 100 heads took %u-head CTAs, not 64\n", wide_hpb);
    c->failures++;
  }
  static const uint32_t splits[] = {1, 2, 4, 8};
  const unsigned clusters0 = dsv4__cuda_test_window_cluster_launches;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const uint64_t rng = c->rng;
    for (size_t j = 0; j < sizeof(splits) / sizeof(splits[0]); j++) {
      dsv4__cuda_test_union_splits = splits[j];
      if (dsv4__cuda_attention_fast_splits(cases[i].tokens, cases[i].heads) != splits[j]) {
        fprintf(stderr, "FAIL the window's launcher did not take %u forced splits\n", splits[j]);
        c->failures++;
        continue;
      }
      c->rng = rng;
      run_case(c, &cases[i]);
      if (i == 0 && splits[j] == 4)
        window_refusals(c);
    }
  }
  dsv4__cuda_test_union_splits = 0;
  /* Every device with fast mode (compute capability 9.0 and newer) runs clusters of 8 such CTAs. */
  if (dsv4__cuda_test_window_cluster_launches == clusters0) {
    fprintf(stderr, "FAIL no split window launch ran as thread-block clusters\n");
    c->failures++;
  } else {
    printf("ok   %u split window launches ran as thread-block clusters\n",
           dsv4__cuda_test_window_cluster_launches - clusters0);
  }
}

/* The union cases of the split build: each shape's inputs once, then every forced split count. */
static void run_split_cases(ctx_t *c) {
  static const uint32_t splits[] = {1, 2, 3, 5, 8, 32};
  /* C4: one token (the split of every decode step at b = 1), 64 tokens of 32 heads per CTA with
   * short rows, 128 heads and sinks +-inf, H = 8 (a part-empty m-tile, no sinks); C128: entries
   * fewer than the splits' tiles, thousands of entries, two tokens of bs 256, a prefill chunk; C4
   * again: two tokens of short rows with junk after their -1 (each split CTA checks its entries).
   */
  static const size_t picks[] = {1, 0, 3, 4, 8, 10, 11, 13, 14};
  for (size_t i = 0; i < sizeof(picks) / sizeof(picks[0]); i++) {
    const ucase_t *k = &union_cases[picks[i]];
    const uint64_t rng = c->rng; /* each split count draws the same inputs */
    for (size_t j = 0; j < sizeof(splits) / sizeof(splits[0]); j++) {
      dsv4__cuda_test_union_splits = splits[j];
      if (dsv4__cuda_attention_fast_union_splits(k->tokens, k->heads) != splits[j]) {
        fprintf(stderr, "FAIL the launcher did not take %u forced splits\n", splits[j]);
        c->failures++;
        continue;
      }
      c->rng = rng;
      run_union_case(c, k);
      if (i == 0 && splits[j] == 3)
        union_refusals(c);
    }
  }
  dsv4__cuda_test_union_splits = 0;
  for (uint32_t sh = 0; sh < (dsv4__cuda_attention_fast_union_wg() ? 3u : 2u); sh++)
    if (!(c->union_shapes_seen & (1u << sh))) {
      fprintf(stderr, "FAIL no split case of this device got %u heads per CTA\n", 16u << sh);
      c->failures++;
    }
}
#else
static void run_union_cases(ctx_t *c) {
  for (size_t i = 0; i < sizeof(union_cases) / sizeof(union_cases[0]); i++) {
    run_union_case(c, &union_cases[i]);
    if (i == 1)
      union_refusals(c);
  }
  /* Every CTA shape of the union kernel (16 and 32 heads, 64 on warpgroup MMAs where the device
   * runs them) must have met exact mode, and so must the split lists where this device splits a
   * one-token launch. */
  for (uint32_t sh = 0; sh < (dsv4__cuda_attention_fast_union_wg() ? 3u : 2u); sh++)
    if (!(c->union_shapes_seen & (1u << sh))) {
      fprintf(stderr, "FAIL no union case of this device got %u heads per CTA\n", 16u << sh);
      c->failures++;
    }
  if (dsv4__cuda_attention_fast_union_splits(1, 64) > 1 && c->union_split_runs == 0) {
    fprintf(stderr, "FAIL no union case of this device split its tokens' lists\n");
    c->failures++;
  }
}
#endif

int main(void) {
  if (!gpu_available(TEST_NAME))
    return GPU_SKIP;
  ctx_t c = {.rng = 0x243F6A8885A308D3ull};
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &c.cpu, why, sizeof(why)));
  int rc = dsv4_backend_open("cuda", &opt, &c.cuda, why, sizeof(why));
  if (rc == DSV4_ENODEV) {
    printf("%s: skipped: %s\n", TEST_NAME, why);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  CKD(rc);
  if (!c.cuda->ops->attention || !(c.cuda->ops->caps & DSV4_BE_ATTN_FAST)) {
    printf("%s: skipped: device 0 has no fast mode (compute capability < 9.0)\n", TEST_NAME);
    dsv4_backend_close(c.cuda);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv);
  CKD(dsv4_rope_table_create(inv, MAX_POS, &c.rope[0]));
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv);
  CKD(dsv4_rope_table_create(inv, MAX_POS, &c.rope[1]));
#ifdef DSV4_TEST_TUNE
  run_window_split_cases(&c);
  run_split_cases(&c);
#else
  run_window_cases(&c);
  run_union_cases(&c);
#endif
  dsv4_backend_close(c.cuda);
  dsv4_backend_close(c.cpu);
  dsv4_rope_table_destroy(c.rope[0]);
  dsv4_rope_table_destroy(c.rope[1]);
  printf("%s: worst cosine distance %.3g (bound %.0e), worst relative error of a value past 1e-3 "
         "absolute %.3g (bound %.4f; the wide case apart)\n",
         TEST_NAME, c.worst_cos, COS_TOL, c.worst_rel, REL_TOL);
  if (c.failures) {
    printf("%s: %d check(s) FAILED\n", TEST_NAME, c.failures);
    return 1;
  }
  printf("%s: fast mode within FlashMLA's tolerances of exact mode, deterministic\n", TEST_NAME);
  return 0;
}
