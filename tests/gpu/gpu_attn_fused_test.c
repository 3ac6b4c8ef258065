/*
 * SPEC §7's fused decode path on the GPU: the insert of the KV rows only (q_out NULL) followed by
 * the attention on the raw q (dsv4_attn_args_t.q_raw) gives the bytes of the unfused chain (the
 * insert with q_out, then the attention reading it): every byte of attn, every bit of lse and
 * every byte of the cache. Decode steps of 1, 16, 64 and 256 sequences at H = 8, 64 and 128, block
 * sizes 16, 64 and 256, plain and YaRN tables, sinks finite, +inf/-inf and none, in exact mode and
 * (where the device has it) fast mode, the fused attention with the engine's windows or its
 * tables; then a batch mixing a prefill with decode steps, which the kernels take as well although
 * the engine fuses decode batches only.
 *
 * Then the refusals (backend.h): the CUDA insert refuses q_out NULL on a launch that writes no KV
 * rows (a replay), and the CPU backend, which has no fused path, refuses a KV-only insert and an
 * attention on raw q with DSV4_EINVAL.
 *
 * Usage: gpu_attn_fused_test [quick]   (quick: the cases up to 64 sequences)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_attn_common.h"

#define MAX_POS DSV4_MAX_POSITION_DEFAULT

typedef struct {
  dsv4_backend_t *cpu, *cuda;
  dsv4_rope_table_t *rope[2];
  uint64_t rng;
  int fast; /* the device runs fast mode */
  int failures;
} ctx_t;

/* The first byte where two buffers differ, named; 1 when one does. */
static int same(const char *name, const char *what, const void *x, const void *y, size_t n,
                size_t row) {
  const uint8_t *a = x, *b = y;
  for (size_t i = 0; i < n; i++)
    if (a[i] != b[i]) {
      fprintf(stderr, "FAIL %s: %s differs first at byte %zu (row %zu): %02x, unfused %02x\n", name,
              what, i, i / row, a[i], b[i]);
      return 1;
    }
  return 0;
}

/* n decode steps at scattered positions (some a sequence's first token, some inside its first
 * window), and with mixed a 40-token prefill and a 3-token continuation before them. */
static uint32_t make_specs(uint64_t *rng, uint32_t n, int mixed, attn_seg_spec_t *spec) {
  uint32_t k = 0;
  if (mixed) {
    int64_t p0 = (int64_t)gpu_below(rng, 100000);
    spec[k++] = (attn_seg_spec_t){p0, p0, 40};
    p0 = (int64_t)gpu_below(rng, 100000);
    spec[k++] = (attn_seg_spec_t){p0, p0 + 500, 3};
  }
  for (uint32_t g = 0; g < n; g++) {
    int64_t p0 = g % 3 == 0 ? 0 : (int64_t)gpu_below(rng, 500000);
    int64_t first = g % 7 == 1   ? p0
                    : g % 7 == 2 ? p0 + 1 + (int64_t)gpu_below(rng, 126)
                                 : p0 + 127 + (int64_t)gpu_below(rng, 400000);
    spec[k++] = (attn_seg_spec_t){p0, first, 1};
  }
  return k;
}

/* Sinks: 0 none, 1 finite, 2 finite with +inf and -inf. */
static float *make_sinks(uint64_t *rng, uint32_t heads, int kind) {
  if (kind == 0)
    return NULL;
  float *s = gpu_host_alloc(sizeof(float) * heads);
  for (uint32_t h = 0; h < heads; h++) {
    s[h] = ((float)gpu_below(rng, 1u << 16) - 32768.0f) * 0x1p-12f;
    if (kind == 2 && h % 8 == 3)
      s[h] = INFINITY;
    if (kind == 2 && h % 8 == 5)
      s[h] = -INFINITY;
  }
  return s;
}

/* One batch through the unfused and the fused chain on the CUDA backend, in exact or fast mode,
 * the fused attention with the engine's windows (win) or walking its tables. */
static void run_case(ctx_t *c, uint32_t n, int mixed, uint32_t heads, uint32_t bs, int yarn,
                     int sinks, int fast, int win) {
  attn_seg_spec_t *spec = gpu_host_alloc(sizeof(attn_seg_spec_t) * (n + 2));
  uint32_t n_segs = make_specs(&c->rng, n, mixed, spec);
  attn_plan_t p;
  attn_plan_make(&c->rng, &p, spec, n_segs, bs, n_segs + 5);
  attn_inputs_t in = {0};
  attn_inputs_fill(&c->rng, &p, &in, heads, 3);
  float *sink = make_sinks(&c->rng, heads, sinks);
  in.sink = sink;
  in.want_lse = 1;
  in.rope = c->rope[yarn];
  in.fast = fast;
  CKD(dsv4_rope_table_ensure(in.rope, p.hist_pos, p.n_hist));
  CKD(dsv4_rope_table_ensure(in.rope, p.q_pos, p.n_q));
  char name[200];
  snprintf(name, sizeof(name), "%s H=%u %u queries in %u segments bs=%u %s sinks=%s, %s",
           fast ? "fast" : "exact", heads, p.n_q, n_segs, bs, yarn ? "yarn" : "plain",
           sinks == 0   ? "none"
           : sinks == 1 ? "finite"
                        : "finite/+inf/-inf",
           win ? "the engine's windows" : "the tables");
  size_t out_n = (size_t)p.n_q * heads * DSV4_HEAD_DIM, lse_n = (size_t)p.n_q * heads;
  size_t cache_n = (size_t)p.n_blocks * DSV4_BLOCK_STRIDE(bs);
  uint16_t *ref = gpu_host_alloc(out_n * 2), *out = gpu_host_alloc(out_n * 2);
  float *ref_lse = gpu_host_alloc(lse_n * 4), *lse = gpu_host_alloc(lse_n * 4);
  attn_keep_t kref = {0}, kfused = {0};
  int bad = 0, rc = attn_run(c->cuda, &p, &in, NULL, ref, ref_lse, &kref);
  if (rc) {
    fprintf(stderr, "FAIL %s: the unfused chain refused the batch: %s\n", name, dsv4_strerror(rc));
    bad = 1;
  }
  in.fused = 1;
  in.win = win ? ATTN_WIN_BUILT : ATTN_WIN_NONE; /* a decode's launch has them from the engine */
  if (!bad && (rc = attn_run(c->cuda, &p, &in, NULL, out, lse, &kfused)) != 0) {
    fprintf(stderr, "FAIL %s: the fused chain refused the batch: %s\n", name, dsv4_strerror(rc));
    bad = 1;
  }
  if (!bad)
    bad = same(name, "attn", out, ref, out_n * 2, (size_t)heads * DSV4_HEAD_DIM * 2) ||
          same(name, "lse", lse, ref_lse, lse_n * 4, (size_t)heads * 4) ||
          same(name, "cache", kfused.cache, kref.cache, cache_n, DSV4_BLOCK_STRIDE(bs));
  printf("%s %s\n", bad ? "FAIL" : "ok  ", name);
  fflush(stdout);
  c->failures += bad;
  free(kref.q_out);
  free(kref.cache);
  free(kfused.cache);
  free(ref);
  free(out);
  free(ref_lse);
  free(lse);
  free(sink);
  free(spec);
  attn_inputs_free(&in);
  attn_plan_free(&p);
}

/* rc must be DSV4_EINVAL; 1 (reported) when it is not. */
static int refused(const char *what, int rc) {
  if (rc == DSV4_EINVAL)
    return 0;
  fprintf(stderr, "FAIL %s: answered %s, expected a refusal (invalid argument)\n", what,
          rc ? dsv4_strerror(rc) : "success");
  return 1;
}

/* The launches the fused path may not be asked for (backend.h). */
static void refusals(ctx_t *c) {
  dsv4_backend_t *bes[2] = {c->cuda, c->cpu};
  int bad = 0;
  for (int b = 0; b < 2; b++) {
    dsv4_backend_t *be = bes[b];
    dsv4_devbuf_t buf = {0};
    CKD(be->ops->buf_alloc(be, DSV4_BLOCK_STRIDE(64) * 2 + 4096, &buf));
    uint8_t *base = buf.ptr;
    dsv4_insert_args_t ia = {.n_tokens = 1,
                             .heads = 8,
                             .q = (const uint16_t *)base,
                             .kv = (const uint16_t *)base,
                             .positions = (const int64_t *)base,
                             .slots = (const int64_t *)base,
                             .rope = c->rope[0],
                             .eps = ATTN_EPS,
                             .write_kv = 0,
                             .q_out = NULL,
                             .cache = base + 4096,
                             .block_size = 64,
                             .n_blocks = 2,
                             .stride = DSV4_BLOCK_STRIDE(64)};
    char what[120];
    snprintf(what, sizeof(what), "%s: insert with q_out NULL on a replay (no KV rows)",
             be->ops->name);
    bad |= refused(what, be->ops->qkv_insert(be, &ia));
    if (be == c->cpu) {
      ia.write_kv = 1;
      snprintf(what, sizeof(what), "%s: insert of the KV rows only", be->ops->name);
      bad |= refused(what, be->ops->qkv_insert(be, &ia));
      dsv4_attn_args_t aa = {.n_tokens = 1,
                             .n_segments = 1,
                             .heads = 8,
                             .q = (const uint16_t *)base,
                             .positions = (const int64_t *)base,
                             .tok_seg = (const int32_t *)base,
                             .seg_p0 = (const int64_t *)base,
                             .seg_first_lb = (const int64_t *)base,
                             .seg_bt_off = (const uint32_t *)base,
                             .seg_bt_len = (const uint32_t *)base,
                             .block_table = (const int32_t *)base,
                             .cache = base + 4096,
                             .block_size = 64,
                             .n_blocks = 2,
                             .stride = DSV4_BLOCK_STRIDE(64),
                             .rope = c->rope[0],
                             .out = (uint16_t *)base,
                             .q_raw = 1,
                             .eps = ATTN_EPS};
      snprintf(what, sizeof(what), "%s: attention on raw q", be->ops->name);
      bad |= refused(what, be->ops->attention(be, &aa));
    }
    CKD(be->ops->sync(be));
    be->ops->buf_free(be, &buf);
  }
  printf("%s refusals of the fused path's launches where it does not apply\n",
         bad ? "FAIL" : "ok  ");
  c->failures += bad;
}

int main(int argc, char **argv) {
  int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  if (!gpu_available("gpu_attn_fused_test"))
    return GPU_SKIP;
  ctx_t c = {.rng = 0x13198A2E03707344ull};
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &c.cpu, why, sizeof(why)));
  int rc = dsv4_backend_open("cuda", &opt, &c.cuda, why, sizeof(why));
  if (rc == DSV4_ENODEV) {
    printf("gpu_attn_fused_test: skipped: %s\n", why);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  CKD(rc);
  if (!c.cuda->ops->attention) {
    printf("gpu_attn_fused_test: skipped: device 0 cannot run the attention kernel\n");
    dsv4_backend_close(c.cuda);
    dsv4_backend_close(c.cpu);
    return GPU_SKIP;
  }
  if (!(c.cuda->ops->caps & DSV4_BE_ATTN_FUSED_Q)) {
    fprintf(stderr, "gpu_attn_fused_test: FAIL: the CUDA backend runs attention but does not "
                    "offer the fused decode path\n");
    return 1;
  }
  c.fast = (c.cuda->ops->caps & DSV4_BE_ATTN_FAST) != 0;
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv);
  CKD(dsv4_rope_table_create(inv, MAX_POS, &c.rope[0]));
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv);
  CKD(dsv4_rope_table_create(inv, MAX_POS, &c.rope[1]));

  static const uint32_t batches[] = {1, 16, 64, 256}, heads[] = {8, 64, 128}, bss[] = {16, 64, 256};
  int k = 0;
  for (size_t b = 0; b < sizeof(batches) / sizeof(batches[0]); b++) {
    if (quick && batches[b] > 64)
      continue;
    for (size_t h = 0; h < sizeof(heads) / sizeof(heads[0]); h++, k++)
      for (int fast = 0; fast <= c.fast; fast++)
        run_case(&c, batches[b], 0, heads[h], bss[k % 3], k % 2, k % 3, fast, (k + fast) % 2);
  }
  for (int fast = 0; fast <= c.fast; fast++)
    for (int win = 0; win < 2; win++)
      run_case(&c, 5, 1, 13, 16, 1, 2, fast, win);
  refusals(&c);
  dsv4_backend_close(c.cuda);
  dsv4_backend_close(c.cpu);
  dsv4_rope_table_destroy(c.rope[0]);
  dsv4_rope_table_destroy(c.rope[1]);
  if (c.failures) {
    printf("gpu_attn_fused_test: %d check(s) FAILED\n", c.failures);
    return 1;
  }
  printf("gpu_attn_fused_test: the fused chain gives the unfused chain's bytes in every case\n");
  return 0;
}
