/*
 * SPEC §5.2 on the GPU, attention's side: the attention kernel reads q_out and the cache only after
 * its dependency wait. Each batch's inserts are computed by the CPU backend; on the device the
 * query rows and the cache start stale (zeros) and a test-only kernel (gpu_late_writer.h) triggers
 * its dependents at once, sleeps 200 µs and then writes the real q_out and cache bytes; the
 * attention launch follows it with programmatic dependent launch, so its CTAs are resident while
 * the old bytes are still in place. Its output and lse must be the CPU backend's, bit for bit.
 *
 * Built again with DSV4_TEST_BROKEN_ATTN_EARLY_READ (the kernel loads its queries before the
 * wait), it must fail (ctest: gpu_inv_attn_wait_broken_early_read). On a device without PDL (below
 * sm_90) the launches are in plain stream order and the test reports "skipped".
 *
 * With the argument "fast" the same runs go through fast mode (attention_fast.cu), whose reference
 * is fast mode's own output on the real bytes written before the launch (fast mode is
 * deterministic, SPEC §7): a launch that read stale bytes differs from it. Its broken build loads
 * the queries before the wait (DSV4_TEST_BROKEN_FAST_EARLY_READ; ctest:
 * gpu_inv_attn_wait_fast_broken_early_read).
 *
 * With the argument "fused" (alone or with "fast") the launch is the fused decode path's (SPEC §7:
 * the attention reads the raw q and normalises it itself), and the late writer writes the raw q
 * and the cache; the reference is the same (the fused path's bytes are the unfused path's). Its
 * broken build loads the raw queries before the wait (DSV4_TEST_BROKEN_FUSED_EARLY_READ; ctest:
 * gpu_inv_attn_wait_fused_broken_early_read).
 *
 * Every fifth batch has 64 heads and a prefill long enough that fast mode runs it in CTAs of 64
 * heads, on warpgroup MMAs where the device has them (sm90a/attention_fast_wg.cu); with the
 * argument "wide" every batch does (to see the broken builds fail on that kernel too).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "gpu_attn_common.h"
#include "gpu_late_writer.h"

#define MAX_POS 65536
#define BATCHES 30
#define DELAY_NS 200000ull

static void *dev_copy(const void *h, size_t n) {
  void *d = gpu_dev_alloc(n ? n : 16);
  if (n)
    CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
  return d;
}

/* The first value of out (and lse) that differs from the reference, reported; 1 when one does. */
static int check(int batch, const attn_plan_t *p, uint32_t heads, const uint16_t *out,
                 const uint16_t *ref, const float *lse, const float *ref_lse) {
  size_t n = (size_t)p->n_q * heads * DSV4_HEAD_DIM;
  for (size_t i = 0; i < n; i++)
    if (out[i] != ref[i]) {
      INV_REPORT(2,
                 "token %zu head %zu dim %zu: attention output %04x, expected %04x: the attention "
                 "kernel read q_out or the cache before its dependency wait [batch %d, %u tokens, "
                 "%u heads, bs %u]",
                 i / DSV4_HEAD_DIM / heads, i / DSV4_HEAD_DIM % heads, i % DSV4_HEAD_DIM, out[i],
                 ref[i], batch, p->n_q, heads, p->bs);
      return 1;
    }
  if (memcmp(lse, ref_lse, (size_t)p->n_q * heads * sizeof(float)) != 0) {
    INV_REPORT(2,
               "lse differs from the CPU backend's: the attention kernel read q_out or the cache "
               "before its dependency wait [batch %d, %u tokens, %u heads, bs %u]",
               batch, p->n_q, heads, p->bs);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  int fast = 0, fused = 0, all_wide = 0;
  for (int i = 1; i < argc; i++) {
    fast |= strcmp(argv[i], "fast") == 0;
    fused |= strcmp(argv[i], "fused") == 0;
    all_wide |= strcmp(argv[i], "wide") == 0;
  }
  if (!gpu_available("gpu_inv_attn_wait"))
    return GPU_SKIP;
  if (!dsv4__cuda_pdl_supported(0)) {
    printf("gpu_inv_attn_wait: skipped: device 0 has no programmatic dependent launch\n");
    return GPU_SKIP;
  }
  if (!dsv4__cuda_attention_supported(0) || (fast && !dsv4__cuda_attention_fast_supported(0))) {
    printf("gpu_inv_attn_wait: skipped: device 0 cannot run the attention kernel%s\n",
           fast ? " in fast mode" : "");
    return GPU_SKIP;
  }
  dsv4_backend_t *cpu = NULL;
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)));
  if (!cpu->ops->attention) {
    fprintf(stderr, "gpu_inv_attn_wait: FAIL: the CPU backend has no attention op\n");
    return 1;
  }
  float *mirror = NULL;
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_plain_default, MAX_POS, &mirror);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint32_t *err = gpu_dev_alloc(sizeof(uint32_t));
  CK(cudaMemset(err, 0, sizeof(uint32_t)));
  uint64_t rng = 0xBE5466CF34E90C6Cull;
  int bad = 0, wg_runs = 0; /* fast launches of 64-head CTAs on warpgroup MMAs */
  for (int batch = 0; batch < BATCHES && !bad; batch++) {
    /* 1..8 decode steps, one of them a sequence's first token, and now and then a short prefill;
     * every fifth batch 64 heads and a prefill as long as fast mode needs to run the batch in CTAs
     * of 64 heads on this device (on warpgroup MMAs where it has them). */
    attn_seg_spec_t spec[9];
    const int wide = all_wide || batch % 5 == 4;
    uint32_t n_segs = 1 + gpu_below(&rng, 8), heads = wide ? 64 : 1 + gpu_below(&rng, 16);
    uint32_t bs = gpu_below(&rng, 2) ? 64 : 16;
    for (uint32_t g = 0; g < n_segs; g++) {
      int64_t p0 = (int64_t)gpu_below(&rng, 20000);
      int64_t first = g == 1 ? p0 : p0 + (int64_t)gpu_below(&rng, 40000);
      spec[g] = (attn_seg_spec_t){p0, first, 1};
    }
    uint32_t chunk = 1 + gpu_below(&rng, 40);
    if (wide) /* the first length from 60 on (1024 at most) whose launch takes 64-head CTAs */
      for (chunk = 60; chunk < 1024; chunk++)
        if (dsv4__cuda_attention_fast_heads_per_block(n_segs + chunk, heads) == 64)
          break;
    if (batch % 3 == 2 || wide)
      spec[n_segs++] = (attn_seg_spec_t){100, 300, chunk};
    attn_plan_t p;
    attn_plan_make(&rng, &p, spec, n_segs, bs, 3);
    wg_runs += fast && dsv4__cuda_attention_fast_wg() &&
               dsv4__cuda_attention_fast_heads_per_block(p.n_q, heads) == 64;
    attn_inputs_t in = {0};
    attn_inputs_fill(&rng, &p, &in, heads, 3);
    float *sink = gpu_host_alloc(sizeof(float) * heads);
    for (uint32_t h = 0; h < heads; h++)
      sink[h] = ((float)gpu_below(&rng, 4096) - 2048.0f) * 0x1p-9f;
    in.sink = sink;
    in.want_lse = 1;
    in.rope = rope;
    gpu_rope_upload(rope, mirror, MAX_POS, p.hist_pos, p.n_hist);
    gpu_rope_upload(rope, mirror, MAX_POS, p.q_pos, p.n_q);

    /* The reference, and the real q_out and cache bytes, from the CPU backend. */
    size_t out_n = (size_t)p.n_q * heads * DSV4_HEAD_DIM, lse_n = (size_t)p.n_q * heads;
    size_t cache_bytes = (size_t)p.n_blocks * DSV4_BLOCK_STRIDE(bs);
    uint16_t *ref = gpu_host_alloc(out_n * 2), *out = gpu_host_alloc(out_n * 2);
    float *ref_lse = gpu_host_alloc(lse_n * 4), *lse = gpu_host_alloc(lse_n * 4);
    attn_keep_t real = {0};
    CKD(attn_run(cpu, &p, &in, NULL, ref, ref_lse, &real));

    /* The device: the metadata as they are, q_out and the cache stale until the late writer. */
    void *d[7] = {dev_copy(p.q_pos, sizeof(int64_t) * p.n_q),
                  dev_copy(p.q_seg, sizeof(int32_t) * p.n_q),
                  dev_copy(p.seg_p0, sizeof(int64_t) * n_segs),
                  dev_copy(p.seg_first_lb, sizeof(int64_t) * n_segs),
                  dev_copy(p.seg_bt_off, sizeof(uint32_t) * n_segs),
                  dev_copy(p.seg_bt_len, sizeof(uint32_t) * n_segs),
                  dev_copy(p.block_table, sizeof(int32_t) * p.bt_len)};
    void *dsink = dev_copy(sink, sizeof(float) * heads);
    uint16_t *dq = gpu_dev_alloc(out_n * 2), *dout = gpu_dev_alloc(out_n * 2);
    uint8_t *dcache = gpu_dev_alloc(cache_bytes);
    float *dlse = gpu_dev_alloc(lse_n * 4);
    /* On the fused path the launch reads the raw q (the query batch's input) instead of q_out. */
    void *real_q = dev_copy(fused ? in.q_q : real.q_out, out_n * 2);
    void *real_cache = dev_copy(real.cache, cache_bytes);
    CK(cudaMemset(dq, 0, out_n * 2));
    CK(cudaMemset(dcache, 0, cache_bytes));
    CK(cudaMemset(dout, ATTN_CANARY, out_n * 2));
    CK(cudaMemset(dlse, ATTN_CANARY, lse_n * 4));
    CK(cudaDeviceSynchronize());

    gpu_late_copy_t late = {.dst = {(uint32_t *)dq, (uint32_t *)dcache},
                            .src = {real_q, real_cache},
                            .words = {(uint32_t)(out_n / 2), (uint32_t)(cache_bytes / 4)},
                            .n = 2};
    dsv4_attn_args_t aa = {.n_tokens = p.n_q,
                           .n_segments = n_segs,
                           .heads = heads,
                           .q = dq,
                           .positions = d[0],
                           .tok_seg = d[1],
                           .seg_p0 = d[2],
                           .seg_first_lb = d[3],
                           .seg_bt_off = d[4],
                           .seg_bt_len = d[5],
                           .block_table = d[6],
                           .bt_entries = p.bt_len,
                           .cache = dcache,
                           .block_size = bs,
                           .n_blocks = p.n_blocks,
                           .stride = DSV4_BLOCK_STRIDE(bs),
                           .sink = dsink,
                           .rope = rope,
                           .out = dout,
                           .lse = dlse,
                           .fast = fast,
                           .q_raw = fused,
                           .eps = ATTN_EPS};
    /* A fast launch of a few tokens splits each token's window: its partial states. */
    const uint64_t part_len = dsv4__cuda_attention_part_floats(&aa);
    float *part = part_len ? gpu_dev_alloc(part_len * sizeof(float)) : NULL;
    if (fast) {
      /* The reference: fast mode over the real bytes, written before the launch. */
      CK(cudaMemcpy(dq, real_q, out_n * 2, cudaMemcpyDeviceToDevice));
      CK(cudaMemcpy(dcache, real_cache, cache_bytes, cudaMemcpyDeviceToDevice));
      CK(cudaDeviceSynchronize()); /* a device-to-device copy may return before it is done */
      CKD(dsv4__cuda_attention(&aa, mirror, MAX_POS, part, part_len, err, s, 0));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(ref, dout, out_n * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ref_lse, dlse, lse_n * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemset(dq, 0, out_n * 2));
      CK(cudaMemset(dcache, 0, cache_bytes));
      CK(cudaMemset(dout, ATTN_CANARY, out_n * 2));
      CK(cudaMemset(dlse, ATTN_CANARY, lse_n * 4));
      CK(cudaDeviceSynchronize());
    }
    CK((cudaError_t)gpu_late_copy(&late, DELAY_NS, s));
    CKD(dsv4__cuda_attention(&aa, mirror, MAX_POS, part, part_len, err, s, 1));
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    uint32_t word = 0;
    CK(cudaMemcpy(out, dout, out_n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse, dlse, lse_n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&word, err, sizeof(word), cudaMemcpyDeviceToHost));
    if (word) {
      fprintf(stderr, "gpu_inv_attn_wait: batch %d: the kernel refused a valid batch (word %#x)\n",
              batch, word);
      bad = 1;
    } else {
      bad = check(batch, &p, heads, out, ref, lse, ref_lse);
    }
    for (int i = 0; i < 7; i++)
      cudaFree(d[i]);
    cudaFree(dsink);
    cudaFree(dq);
    cudaFree(dout);
    cudaFree(dcache);
    cudaFree(dlse);
    cudaFree(part);
    cudaFree(real_q);
    cudaFree(real_cache);
    free(real.q_out);
    free(real.cache);
    free(ref);
    free(out);
    free(ref_lse);
    free(lse);
    free(sink);
    attn_inputs_free(&in);
    attn_plan_free(&p);
  }
  cudaFree(err);
  cudaStreamDestroy(s);
  cudaFree(mirror);
  dsv4_rope_table_destroy(rope);
  dsv4_backend_close(cpu);
  if (bad)
    return 1;
  if (fast && dsv4__cuda_attention_fast_wg() && wg_runs == 0) {
    fprintf(stderr,
            "gpu_inv_attn_wait: FAIL: no batch ran on warpgroup MMAs, which device 0 has\n");
    return 1;
  }
  printf("gpu_inv_attn_wait: %d batches (%s mode%s; %d of them on warpgroup MMAs), every output "
         "from the late writer's %s and cache\n",
         BATCHES, fast ? "fast" : "exact", fused ? ", fused" : "", wg_runs,
         fused ? "raw q" : "q_out");
  return 0;
}
