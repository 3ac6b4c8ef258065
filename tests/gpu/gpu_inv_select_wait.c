/*
 * SPEC §5.2 on the GPU, the indexer's side (SPEC §8.5): the select kernel reads the keys the score
 * kernel before it wrote only after its dependency wait. Each batch's keys (a token's scores in the
 * daemon's key order, 600 to 8000 of them a token, 1 to 8 tokens) are selected on the host by a
 * plain sort (gpu_select_model.h). On the device the key slots start as zeros, and a test-only
 * kernel (gpu_late_writer.h) triggers its dependents at once, sleeps 200 µs and then writes the
 * real keys; the select kernel follows it with programmatic dependent launch, so its CTAs are
 * resident while the zeros are still in place. Every token's selection must be the sort's: zeros
 * read early would select the token's first topk entries.
 *
 * Built again with DSV4_TEST_BROKEN_SELECT_EARLY_READ (the select kernel copies its slot's keys
 * into shared memory before the wait and selects from the copy), it must fail (ctest:
 * gpu_inv_select_wait_broken_early_read). On a device without PDL (below sm_90) the test reports
 * "skipped".
 *
 * Usage: gpu_inv_select_wait
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "gpu_common.h"
#include "gpu_late_writer.h"
#include "gpu_select_model.h"

#define BATCHES 30
#define MAX_TOKENS 8
#define MAX_KEYS 8000
#define SLOT 8192 /* keys a token's slot holds */
#define TOPK 512  /* V4-Flash's index_topk */
#define DELAY_NS 200000ull

typedef struct {
  cudaStream_t s;
  uint64_t rng;
  int64_t *d_pos, *d_p0;
  int32_t *d_seg, *d_sel;
  uint32_t *d_keys, *d_real, *d_err;
} ctx_t;

/* One batch: its keys and the sort's selections, then the launch behind the late writer; 0 when
 * every selection is the sort's. */
static int run_batch(ctx_t *c, int batch) {
  const uint32_t n_tok = 1 + gpu_below(&c->rng, MAX_TOKENS);
  static uint32_t keys[MAX_TOKENS * SLOT];
  static int32_t want[MAX_TOKENS * TOPK], got[MAX_TOKENS * TOPK];
  int64_t pos[MAX_TOKENS], p0s[MAX_TOKENS];
  int32_t seg[MAX_TOKENS];
  uint32_t n[MAX_TOKENS];
  memset(keys, 0, sizeof(keys));
  for (uint32_t t = 0; t < n_tok; t++) {
    n[t] = TOPK + 88 + gpu_below(&c->rng, MAX_KEYS - TOPK - 88);
    pos[t] = 4 * (int64_t)n[t] - 1 + gpu_below(&c->rng, 4); /* (pos + 1) / 4 = n: ratio 4 */
    seg[t] = (int32_t)t;                                    /* a segment a token, from position 0 */
    p0s[t] = 0;
    for (uint32_t i = 0; i < n[t]; i++)
      keys[t * SLOT + i] = dsv4_index_score_key(gpu_select_score(&c->rng, 3.0f));
    (void)gpu_select_ref(keys + t * SLOT, n[t], TOPK, want + t * TOPK);
  }
  CK(cudaMemcpy(c->d_pos, pos, sizeof(int64_t) * n_tok, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(c->d_seg, seg, sizeof(int32_t) * n_tok, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(c->d_p0, p0s, sizeof(int64_t) * n_tok, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(c->d_real, keys, sizeof(uint32_t) * SLOT * n_tok, cudaMemcpyHostToDevice));
  CK(cudaMemset(c->d_keys, 0, sizeof(uint32_t) * SLOT * n_tok));
  CK(cudaMemset(c->d_sel, 0xff, sizeof(int32_t) * TOPK * n_tok));
  CK(cudaDeviceSynchronize());
  const gpu_late_copy_t late = {
      .dst = {c->d_keys}, .src = {c->d_real}, .words = {SLOT * n_tok}, .n = 1};
  CK((cudaError_t)gpu_late_copy(&late, DELAY_NS, c->s));
  const dsv4_test_select_launch_t a = {.positions = c->d_pos,
                                       .tok_seg = c->d_seg,
                                       .seg_p0 = c->d_p0,
                                       .keys = c->d_keys,
                                       .sel = c->d_sel,
                                       .err = c->d_err,
                                       .max_positions = 4 * (int64_t)SLOT,
                                       .keys_per_cta = SLOT,
                                       .n_tokens = n_tok,
                                       .n_segments = n_tok,
                                       .topk = TOPK};
  CKD(dsv4__cuda_test_select_launch(&a, c->s, 1));
  CK(cudaStreamSynchronize(c->s));
  CK(cudaMemcpy(got, c->d_sel, sizeof(int32_t) * TOPK * n_tok, cudaMemcpyDeviceToHost));
  for (uint32_t t = 0; t < n_tok; t++)
    for (uint32_t i = 0; i < TOPK; i++)
      if (got[t * TOPK + i] != want[t * TOPK + i]) {
        INV_REPORT(2,
                   "token %u place %u: entry %d, expected %d: the select kernel read its keys "
                   "before its dependency wait [batch %d, %u tokens, %u keys]",
                   t, i, got[t * TOPK + i], want[t * TOPK + i], batch, n_tok, n[t]);
        return 1;
      }
  return 0;
}

int main(void) {
  if (!gpu_available("gpu_inv_select_wait"))
    return GPU_SKIP;
  if (!dsv4__cuda_pdl_supported(0)) {
    printf("gpu_inv_select_wait: skipped: device 0 has no programmatic dependent launch\n");
    return GPU_SKIP;
  }
  ctx_t c = {.rng = 0xBB67AE8584CAA73Bull};
  CK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
  c.d_pos = gpu_dev_alloc(sizeof(int64_t) * MAX_TOKENS);
  c.d_p0 = gpu_dev_alloc(sizeof(int64_t) * MAX_TOKENS);
  c.d_seg = gpu_dev_alloc(sizeof(int32_t) * MAX_TOKENS);
  c.d_sel = gpu_dev_alloc(sizeof(int32_t) * MAX_TOKENS * TOPK);
  c.d_keys = gpu_dev_alloc(sizeof(uint32_t) * MAX_TOKENS * SLOT);
  c.d_real = gpu_dev_alloc(sizeof(uint32_t) * MAX_TOKENS * SLOT);
  c.d_err = gpu_dev_alloc(sizeof(uint32_t));
  CK(cudaMemset(c.d_err, 0, sizeof(uint32_t)));
  int bad = 0;
  for (int batch = 0; batch < BATCHES && !bad; batch++)
    bad = run_batch(&c, batch);
  cudaFree(c.d_pos);
  cudaFree(c.d_p0);
  cudaFree(c.d_seg);
  cudaFree(c.d_sel);
  cudaFree(c.d_keys);
  cudaFree(c.d_real);
  cudaFree(c.d_err);
  cudaStreamDestroy(c.s);
  if (bad)
    return 1;
  printf("gpu_inv_select_wait: %d batches, every selection from the late writer's keys\n", BATCHES);
  return 0;
}
