/*
 * SPEC §5.2 on the GPU, the compressed branch's side (SPEC §8.6): the union attention reads q_out,
 * the cache, the entry pool and the selection only after its dependency wait, and the combine of a
 * split fast launch reads the splits' partial states only after its own. Each batch's inserts, its
 * compressed entries (gpu_attn_common.h) and its attention are computed by the CPU backend; on the
 * device q_out, the cache and the entry pool start as zeros and the selection as -1 everywhere (no
 * entry listed), and a test-only kernel (gpu_late_writer.h) triggers its dependents at once, sleeps
 * 200 µs and then writes the real bytes. The attention launch (the union kernel, which checks a
 * launch of these few tokens itself) follows it with programmatic dependent launch, so the union
 * kernel's CTAs are resident while the old bytes are still in place. The batches alternate ratio 4
 * (a selection of 512 per token, what the indexer writes in the launch before the attention) and
 * ratio 128 (every visible entry, what the compressor emits). Output and lse must be the CPU
 * backend's, bit for bit.
 *
 * Built again with DSV4_TEST_BROKEN_UNION_EARLY_READ (the union kernels count the entries a token's
 * selection row lists before the wait), it must fail (ctest: gpu_inv_union_wait_broken_early_read).
 * On a device without PDL (below sm_90) the launches are in plain stream order and the test
 * reports "skipped".
 *
 * With the argument "fast" the same runs go through fast mode's union kernels
 * (attention_fast_union.cu; batches of more than 32 heads sm90a/attention_fast_union_wg.cu where
 * the device runs it), whose reference is fast mode's own output over the real bytes written
 * before the launch (fast mode is deterministic, SPEC §7): a launch that read stale bytes differs
 * from it. Its broken build is the same (ctest: gpu_inv_union_wait_fast_broken_early_read).
 *
 * With the argument "split" (fast mode, in a build whose kernels have DSV4_TEST_TUNE and
 * DSV4_TEST_DELAY_PARTS) every launch splits each token's list 2, 3, 5 or 8 ways, and each split,
 * once it has let the combine launch, waits 200 µs before it writes its partial state; the scratch
 * of the partial states starts every launch as zeros, so a combine that reads it before its wait
 * merges zeros. The batches are decode steps of 1 to 4 tokens: every split and combine CTA is
 * resident at once. Its broken build loads the splits' pairs (m, S) before the wait
 * (DSV4_TEST_BROKEN_COMBINE_EARLY_READ; ctest: gpu_inv_union_wait_split_broken_early_read).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "attention-split.h"
#include "gpu_attn_common.h"
#include "gpu_late_writer.h"

#define MAX_POS 65536
#define BATCHES 30
#define DELAY_NS 200000ull
#define TOPK 512 /* V4-Flash's index_topk */

#if defined(DSV4_TEST_TUNE) && defined(DSV4_TEST_DELAY_PARTS)
#define SPLIT_BUILD 1
#else
#define SPLIT_BUILD 0
#endif

typedef struct {
  int fast, split;
  const char *why; /* what a difference means in this mode */
  dsv4_backend_t *cpu;
  dsv4_rope_table_t *rope;
  float *mirror;
  cudaStream_t s;
  uint32_t *err;
  uint64_t rng;
} ctx_t;

/* One batch on the host: the plan, its inputs and entries, the reference, the launch's output,
 * and the real bytes after the CPU backend's inserts. */
typedef struct {
  uint32_t ratio, heads, nsplit;
  attn_plan_t p;
  attn_inputs_t in;
  attn_entries_t e;
  float *sink;
  uint16_t *ref, *out;
  float *ref_lse, *lse;
  attn_keep_t real;
} host_batch_t;

/* The regions the late writer writes, in its order. */
enum { R_Q, R_CACHE, R_C_CACHE, R_SEL, R_N };

/* The batch on the device: the launch over the regions (stale until the late writer), the real
 * bytes it copies over them, and the partial-state scratch of a split launch. */
typedef struct {
  void *meta[12]; /* the window's seven arrays, the entries' four tables, the sinks */
  void *dst[R_N], *real[R_N];
  size_t bytes[R_N], lse_bytes;
  uint32_t n_regions; /* R_SEL only at ratio 4 */
  uint16_t *out;
  float *lse, *part;
  uint64_t part_len;
  dsv4_attn_args_t aa;
} dev_batch_t;

static void *dev_copy(const void *h, size_t n) {
  void *d = gpu_dev_alloc(n ? n : 16);
  if (n)
    CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
  return d;
}

/*
 * Batch `batch`: 1..8 decode steps (1..4 in split mode) of 1..32 or 33..64 heads (every other
 * pair of batches), one of them a sequence's first token,
 * and outside split mode now and then a short prefill. Ratio 4 on even batches (up to about 2000
 * visible entries a token, selections of 512 among them), ratio 128 on odd ones (up to about 300).
 * Every row of it computed by the CPU backend.
 */
static void batch_make(ctx_t *c, int batch, host_batch_t *b) {
  memset(b, 0, sizeof(*b));
  b->ratio = batch % 2 ? 128 : 4;
  const uint32_t span = b->ratio == 4 ? 4000 : 20000;
  attn_seg_spec_t spec[9];
  uint32_t n_segs = 1 + gpu_below(&c->rng, c->split ? 4 : 8);
  /* 1..32 heads, or 33..64 (in fast mode the 64-head CTAs on warpgroup MMAs where the device runs
   * them, main forcing them), each with both ratios */
  b->heads = 1 + gpu_below(&c->rng, 32) + (batch / 2 % 2 ? 32u : 0u);
  const uint32_t bs = gpu_below(&c->rng, 2) ? 64 : 16;
  for (uint32_t g = 0; g < n_segs; g++) {
    const int64_t p0 = (int64_t)gpu_below(&c->rng, span);
    const int64_t first = g == 1 ? p0 : p0 + (int64_t)gpu_below(&c->rng, 2 * span);
    spec[g] = (attn_seg_spec_t){p0, first, 1};
  }
  if (!c->split && batch % 3 == 2)
    spec[n_segs++] = (attn_seg_spec_t){100, 300, 1 + gpu_below(&c->rng, 40)};
  attn_plan_make(&c->rng, &b->p, spec, n_segs, bs, 3);
  attn_inputs_fill(&c->rng, &b->p, &b->in, b->heads, 3);
  attn_entries_make(&c->rng, &b->p, &b->e, b->ratio, TOPK, 3, 3);
  b->sink = gpu_host_alloc(sizeof(float) * b->heads);
  for (uint32_t h = 0; h < b->heads; h++)
    b->sink[h] = ((float)gpu_below(&c->rng, 4096) - 2048.0f) * 0x1p-9f;
  b->in.sink = b->sink;
  b->in.want_lse = 1;
  b->in.rope = c->rope;
  b->in.ent = &b->e;
  gpu_rope_upload(c->rope, c->mirror, MAX_POS, b->p.hist_pos, b->p.n_hist);
  gpu_rope_upload(c->rope, c->mirror, MAX_POS, b->p.q_pos, b->p.n_q);
  const size_t out_n = (size_t)b->p.n_q * b->heads * DSV4_HEAD_DIM;
  const size_t lse_n = (size_t)b->p.n_q * b->heads;
  b->ref = gpu_host_alloc(out_n * 2);
  b->out = gpu_host_alloc(out_n * 2);
  b->ref_lse = gpu_host_alloc(lse_n * 4);
  b->lse = gpu_host_alloc(lse_n * 4);
  CKD(attn_run(c->cpu, &b->p, &b->in, NULL, b->ref, b->ref_lse, &b->real));
}

static void batch_free(host_batch_t *b) {
  free(b->real.q_out);
  free(b->real.cache);
  free(b->real.c_cache);
  free(b->ref);
  free(b->out);
  free(b->ref_lse);
  free(b->lse);
  free(b->sink);
  attn_entries_free(&b->e);
  attn_inputs_free(&b->in);
  attn_plan_free(&b->p);
}

/* The device side of batch b: the metadata as they are, the regions and the real bytes (the
 * regions filled by dev_fill), the launch's arguments. */
static void dev_make(const ctx_t *c, const host_batch_t *b, dev_batch_t *d) {
  memset(d, 0, sizeof(*d));
  const attn_plan_t *p = &b->p;
  const attn_entries_t *e = &b->e;
  const uint32_t ns = p->n_segs, heads = b->heads;
  const uint64_t stride = DSV4_BLOCK_STRIDE(p->bs);
  const void *meta[12] = {p->q_pos,      p->q_seg,      p->seg_p0,      p->seg_first_lb,
                          p->seg_bt_off, p->seg_bt_len, p->block_table, e->seg_first_lb,
                          e->seg_bt_off, e->seg_bt_len, e->block_table, b->sink};
  const size_t meta_bytes[12] = {
      sizeof(int64_t) * p->n_q,    sizeof(int32_t) * p->n_q,    sizeof(int64_t) * ns,
      sizeof(int64_t) * ns,        sizeof(uint32_t) * ns,       sizeof(uint32_t) * ns,
      sizeof(int32_t) * p->bt_len, sizeof(int64_t) * ns,        sizeof(uint32_t) * ns,
      sizeof(uint32_t) * ns,       sizeof(int32_t) * e->bt_len, sizeof(float) * heads};
  for (int i = 0; i < 12; i++)
    d->meta[i] = dev_copy(meta[i], meta_bytes[i]);
  const size_t out_n = (size_t)p->n_q * heads * DSV4_HEAD_DIM;
  const void *real[R_N] = {b->real.q_out, b->real.cache, b->real.c_cache, e->sel};
  d->bytes[R_Q] = out_n * 2;
  d->bytes[R_CACHE] = (size_t)p->n_blocks * stride;
  d->bytes[R_C_CACHE] = (size_t)e->n_blocks * stride;
  d->bytes[R_SEL] = e->sel ? sizeof(int32_t) * p->n_q * e->sel_stride : 0;
  d->n_regions = e->sel ? R_N : R_SEL;
  for (uint32_t r = 0; r < d->n_regions; r++) {
    d->real[r] = dev_copy(real[r], d->bytes[r]);
    d->dst[r] = gpu_dev_alloc(d->bytes[r]);
  }
  d->out = gpu_dev_alloc(out_n * 2);
  d->lse_bytes = (size_t)p->n_q * heads * sizeof(float);
  d->lse = gpu_dev_alloc(d->lse_bytes);
  d->part_len = dsv4__union_part_floats(p->n_q, heads, b->nsplit);
  d->part = d->part_len ? gpu_dev_alloc(d->part_len * sizeof(float)) : NULL;
  d->aa = (dsv4_attn_args_t){.n_tokens = p->n_q,
                             .n_segments = ns,
                             .heads = heads,
                             .q = d->dst[R_Q],
                             .positions = d->meta[0],
                             .tok_seg = d->meta[1],
                             .seg_p0 = d->meta[2],
                             .seg_first_lb = d->meta[3],
                             .seg_bt_off = d->meta[4],
                             .seg_bt_len = d->meta[5],
                             .block_table = d->meta[6],
                             .bt_entries = p->bt_len,
                             .cache = d->dst[R_CACHE],
                             .block_size = p->bs,
                             .n_blocks = p->n_blocks,
                             .stride = stride,
                             .sink = d->meta[11],
                             .rope = c->rope,
                             .out = d->out,
                             .lse = d->lse,
                             .fast = c->fast,
                             .eps = ATTN_EPS,
                             .ratio = e->ratio,
                             .c_cache = d->dst[R_C_CACHE],
                             .c_n_blocks = e->n_blocks,
                             .seg_c_first_lb = d->meta[7],
                             .seg_cbt_off = d->meta[8],
                             .seg_cbt_len = d->meta[9],
                             .c_block_table = d->meta[10],
                             .c_bt_entries = e->bt_len,
                             .c_sel = e->sel ? d->dst[R_SEL] : NULL,
                             .c_sel_stride = e->sel_stride};
}

static void dev_free(dev_batch_t *d) {
  for (int i = 0; i < 12; i++)
    cudaFree(d->meta[i]);
  for (uint32_t r = 0; r < d->n_regions; r++) {
    cudaFree(d->dst[r]);
    cudaFree(d->real[r]);
  }
  cudaFree(d->out);
  cudaFree(d->lse);
  cudaFree(d->part);
}

/* Output and lse as canaries, and the regions stale (the selection -1, the rest and the partial
 * states zeros) or real; complete before the next launch. */
static void dev_fill(dev_batch_t *d, int real) {
  for (uint32_t r = 0; r < d->n_regions; r++) {
    if (real)
      CK(cudaMemcpy(d->dst[r], d->real[r], d->bytes[r], cudaMemcpyDeviceToDevice));
    else
      CK(cudaMemset(d->dst[r], r == R_SEL ? 0xFF : 0, d->bytes[r]));
  }
  if (d->part)
    CK(cudaMemset(d->part, 0, d->part_len * sizeof(float)));
  CK(cudaMemset(d->out, ATTN_CANARY, d->bytes[R_Q]));
  CK(cudaMemset(d->lse, ATTN_CANARY, d->lse_bytes));
  CK(cudaDeviceSynchronize());
}

/* The launch's attn and lse, after it; 1 when its error word is set (it refused a valid batch). */
static int dev_launch(const ctx_t *c, dev_batch_t *d, int pdl, uint16_t *out, float *lse) {
  CKD(dsv4__cuda_attention(&d->aa, c->mirror, MAX_POS, d->part, d->part_len, c->err, c->s, pdl));
  CK(cudaStreamSynchronize(c->s));
  CK(cudaGetLastError());
  uint32_t word = 0;
  CK(cudaMemcpy(out, d->out, d->bytes[R_Q], cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse, d->lse, d->lse_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&word, c->err, sizeof(word), cudaMemcpyDeviceToHost));
  if (word)
    fprintf(stderr, "gpu_inv_union_wait: the kernel refused a valid batch (word %#x)\n", word);
  return word != 0;
}

/* The first value of out (and lse) that differs from the reference, reported; 1 when one does. */
static int check(const ctx_t *c, int batch, const host_batch_t *b) {
  const size_t n = (size_t)b->p.n_q * b->heads * DSV4_HEAD_DIM;
  char what[160];
  snprintf(what, sizeof(what), "[batch %d, ratio %u, %u tokens, %u heads, bs %u, %u split%s]",
           batch, b->ratio, b->p.n_q, b->heads, b->p.bs, b->nsplit, b->nsplit == 1 ? "" : "s");
  for (size_t i = 0; i < n; i++)
    if (b->out[i] != b->ref[i]) {
      INV_REPORT(2, "token %zu head %zu dim %zu: attention output %04x, expected %04x: %s %s",
                 i / DSV4_HEAD_DIM / b->heads, i / DSV4_HEAD_DIM % b->heads, i % DSV4_HEAD_DIM,
                 b->out[i], b->ref[i], c->why, what);
      return 1;
    }
  if (memcmp(b->lse, b->ref_lse, (size_t)b->p.n_q * b->heads * sizeof(float)) != 0) {
    INV_REPORT(2, "lse differs from the reference: %s %s", c->why, what);
    return 1;
  }
  return 0;
}

/* One batch: the reference (fast mode: the launch over the real bytes), then the launch behind the
 * late writer over the stale ones; 1 when it fails. */
static int run_batch(ctx_t *c, int batch) {
  host_batch_t b;
  batch_make(c, batch, &b);
#if SPLIT_BUILD
  static const unsigned forced[] = {2, 3, 5, 8};
  dsv4__cuda_test_union_splits = c->split ? forced[batch % 4] : 0;
#endif
  b.nsplit = c->fast ? dsv4__cuda_attention_fast_union_splits(b.p.n_q, b.heads) : 1;
  if (c->split && b.nsplit < 2) {
    fprintf(stderr, "gpu_inv_union_wait: FAIL: batch %d: the launcher did not split\n", batch);
    batch_free(&b);
    return 1;
  }
  dev_batch_t d;
  dev_make(c, &b, &d);
  int bad = 0;
  if (c->fast) {
    dev_fill(&d, 1);
    bad = dev_launch(c, &d, 0, b.ref, b.ref_lse);
  }
  if (!bad) {
    dev_fill(&d, 0);
    gpu_late_copy_t late = {.n = d.n_regions};
    for (uint32_t r = 0; r < d.n_regions; r++) {
      late.dst[r] = d.dst[r];
      late.src[r] = d.real[r];
      late.words[r] = (uint32_t)(d.bytes[r] / 4);
    }
    CK((cudaError_t)gpu_late_copy(&late, DELAY_NS, c->s));
    bad = dev_launch(c, &d, 1, b.out, b.lse);
  }
  if (!bad)
    bad = check(c, batch, &b);
  dev_free(&d);
  batch_free(&b);
  return bad;
}

/* 0 when device 0 runs the mode's kernels under programmatic dependent launch, else GPU_SKIP. */
static int device_ready(const ctx_t *c) {
  if (!gpu_available("gpu_inv_union_wait"))
    return GPU_SKIP;
  if (!dsv4__cuda_pdl_supported(0)) {
    printf("gpu_inv_union_wait: skipped: device 0 has no programmatic dependent launch\n");
    return GPU_SKIP;
  }
  if (!dsv4__cuda_attention_supported(0) ||
      (c->fast && (!dsv4__cuda_attention_fast_supported(0) ||
                   !dsv4__cuda_attention_fast_union_supported(0)))) {
    printf("gpu_inv_union_wait: skipped: device 0 cannot run the union kernel%s\n",
           c->fast ? " in fast mode" : "");
    return GPU_SKIP;
  }
  return 0;
}

int main(int argc, char **argv) {
  ctx_t c = {.rng = 0x6A09E667F3BCC909ull};
  for (int i = 1; i < argc; i++) {
    c.fast |= strcmp(argv[i], "fast") == 0;
    c.split |= strcmp(argv[i], "split") == 0;
  }
  if (c.split && !SPLIT_BUILD) {
    fprintf(stderr, "gpu_inv_union_wait: FAIL: \"split\" needs the kernels built with "
                    "DSV4_TEST_TUNE and DSV4_TEST_DELAY_PARTS\n");
    return 1;
  }
  c.fast |= c.split;
  /* fast mode's batches of more than 32 heads on the 64-head CTAs of warpgroup MMAs where the
   * device runs them, whatever the launcher would choose for so few tokens */
  dsv4__cuda_attention_fast_union_force_wg(c.fast);
  c.why = c.split ? "the union attention read its inputs, or the combine the partial states, "
                    "before the dependency wait"
                  : "the union attention read q_out, the caches or the selection before its "
                    "dependency wait";
  int rc = device_ready(&c);
  if (rc)
    return rc;
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &c.cpu, why, sizeof(why)));
  if (!c.cpu->ops->attention) {
    fprintf(stderr, "gpu_inv_union_wait: FAIL: the CPU backend has no attention op\n");
    return 1;
  }
  c.rope = gpu_rope_open(&dsv4_rope_plain_default, MAX_POS, &c.mirror);
  CK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
  c.err = gpu_dev_alloc(sizeof(uint32_t));
  CK(cudaMemset(c.err, 0, sizeof(uint32_t)));
  int bad = 0;
  for (int batch = 0; batch < BATCHES && !bad; batch++)
    bad = run_batch(&c, batch);
  cudaFree(c.err);
  cudaStreamDestroy(c.s);
  cudaFree(c.mirror);
  dsv4_rope_table_destroy(c.rope);
  dsv4_backend_close(c.cpu);
  if (bad)
    return 1;
  printf("gpu_inv_union_wait: %d batches (%s mode%s, ratios 4 and 128), every output from the late "
         "writer's q_out, caches and selection%s\n",
         BATCHES, c.fast ? "fast" : "exact", c.split ? ", split 2, 3, 5 and 8 ways" : "",
         c.split ? " and the splits' late partial states" : "");
  return 0;
}
