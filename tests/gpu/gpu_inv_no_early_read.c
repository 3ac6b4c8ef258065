/*
 * SPEC §5.2 on the GPU: nothing touches mutable memory before the dependency wait. Linked against a
 * build of the kernels made with DSV4_TEST_DELAY_PRODUCER, whose slot-map producer triggers its
 * dependents at once and then waits 200 µs before it writes a slot, so the insert kernel, launched
 * with programmatic dependent launch right behind it, is resident long before the slots exist.
 * The slot buffer is reused from batch to batch and starts each batch holding slots of a canary
 * block; after both launches the canary block must be untouched, every slot must be the one the
 * block table gives, and q_out and the cache must equal the CPU backend's.
 *
 * Built again with DSV4_TEST_BROKEN_EARLY_READ (the insert kernel reads its first item's slot
 * before griddepcontrol.wait: the SGLang bug), this test must fail (ctest:
 * gpu_inv_no_early_read_broken_early_read). On a device without PDL (below sm_90) the launches
 * are in plain stream order and the test reports "skipped".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "gpu_common.h"

#ifndef DSV4_TEST_DELAY_PRODUCER
#error "gpu_inv_no_early_read needs the kernels built with DSV4_TEST_DELAY_PRODUCER"
#endif

#define MAX_POS 65536
#define BATCHES 40

int main(void) {
  if (!gpu_available("gpu_inv_no_early_read"))
    return GPU_SKIP;
  if (!dsv4__cuda_pdl_supported(0)) {
    printf("gpu_inv_no_early_read: skipped: device 0 has no programmatic dependent launch\n");
    return GPU_SKIP;
  }
  dsv4_backend_t *cpu = NULL;
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)));
  float *mirror = NULL;
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_plain_default, MAX_POS, &mirror);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t rng = 0x13198A2E03707344ull;
  /* The reused slot buffer, as the host glue reuses its own. */
  int64_t *dslots = gpu_dev_alloc(sizeof(int64_t) * 64);
  int bad = 0;
  for (int batch = 0; batch < BATCHES && !bad; batch++) {
    gpu_plan_t p;
    uint32_t n = 1 + gpu_below(&rng, 64), heads = 1 + gpu_below(&rng, 16);
    uint32_t bs = gpu_below(&rng, 2) ? 64 : 16;
    gpu_plan_make(&rng, &p, n, 1 + gpu_below(&rng, n < 4 ? n : 4), bs, MAX_POS, 5);
    /* One more block than the plan uses: the canary, never in a block table. */
    uint32_t canary = p.n_blocks;
    uint32_t n_blocks = p.n_blocks + 1;
    p.n_blocks = n_blocks;
    uint64_t stride = DSV4_BLOCK_STRIDE(bs);
    size_t cache_bytes = (size_t)n_blocks * stride, q_elems = (size_t)n * heads * DSV4_HEAD_DIM;
    uint16_t *q = gpu_host_alloc(q_elems * 2), *kv = gpu_host_alloc((size_t)n * 1024);
    gpu_fill_bf16(&rng, q, q_elems, 127, 8);
    gpu_fill_bf16(&rng, kv, (size_t)n * DSV4_HEAD_DIM, 127, 8);
    gpu_rope_upload(rope, mirror, MAX_POS, p.pos, n);
    int64_t stale[64], *ref_slots = gpu_host_alloc(sizeof(int64_t) * n);
    for (uint32_t t = 0; t < 64; t++)
      stale[t] = (int64_t)canary * bs + t % bs;
    CK(cudaMemcpy(dslots, stale, sizeof(stale), cudaMemcpyHostToDevice));

    /* The reference on the CPU. */
    uint8_t *ref_cache = calloc(1, cache_bytes), *cache = gpu_host_alloc(cache_bytes);
    uint16_t *ref_q_out = gpu_host_alloc(q_elems * 2), *q_out = gpu_host_alloc(q_elems * 2);
    dsv4_map_args_t ma = gpu_plan_map_args(&p, p.pos, p.tok_seg, p.seg_first_lb, p.seg_bt_off,
                                           p.seg_bt_len, p.block_table, ref_slots);
    dsv4_insert_args_t ia = {.n_tokens = n,
                             .heads = heads,
                             .q = q,
                             .kv = kv,
                             .positions = p.pos,
                             .slots = ref_slots,
                             .rope = rope,
                             .eps = 1e-6f,
                             .write_kv = 1,
                             .q_out = ref_q_out,
                             .cache = ref_cache,
                             .block_size = bs,
                             .n_blocks = n_blocks,
                             .stride = stride};
    CKD(cpu->ops->map_slots(cpu, &ma));
    CKD(cpu->ops->qkv_insert(cpu, &ia));

    /* The GPU: producer and consumer back to back with PDL. */
    gpu_plan_dev_t d;
    gpu_plan_upload(&p, &d);
    uint16_t *dq = gpu_dev_alloc(q_elems * 2), *dq_out = gpu_dev_alloc(q_elems * 2);
    uint16_t *dkv = gpu_dev_alloc((size_t)n * 1024);
    uint8_t *dcache = gpu_dev_alloc(cache_bytes);
    CK(cudaMemcpy(dq, q, q_elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dkv, kv, (size_t)n * 1024, cudaMemcpyHostToDevice));
    CK(cudaMemset(dcache, 0, cache_bytes));
    CK(cudaDeviceSynchronize());
    ma = gpu_plan_map_args(&p, d.pos, d.tok_seg, d.seg_first_lb, d.seg_bt_off, d.seg_bt_len,
                           d.block_table, dslots);
    ia.q = dq;
    ia.kv = dkv;
    ia.positions = d.pos;
    ia.slots = dslots;
    ia.rope = NULL;
    ia.q_out = dq_out;
    ia.cache = dcache;
    CKD(dsv4__cuda_map_slots(&ma, s, 1));
    CKD(dsv4__cuda_qkv_insert(&ia, mirror, MAX_POS, s, 1));
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    int64_t seen[64];
    CK(cudaMemcpy(seen, dslots, sizeof(int64_t) * n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(cache, dcache, cache_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(q_out, dq_out, q_elems * 2, cudaMemcpyDeviceToHost));

    size_t touched = 0;
    for (uint64_t i = 0; i < stride; i++)
      touched += cache[(size_t)canary * stride + i] != 0;
    if (touched) {
      INV_REPORT(
          2,
          "the consumer wrote %zu bytes of canary block %u: the insert kernel read slots "
          "before the slot-map kernel had written them [batch %d, %u tokens, %u heads, bs %u]",
          touched, canary, batch, n, heads, bs);
      bad++;
    }
    for (uint32_t t = 0; t < n; t++)
      if (seen[t] != ref_slots[t]) {
        INV_REPORT(2, "token %u has slot %lld after the producer, expected %lld [batch %d]", t,
                   (long long)seen[t], (long long)ref_slots[t], batch);
        bad++;
        break;
      }
    if (memcmp(cache, ref_cache, cache_bytes) != 0) {
      INV_REPORT(2, "the cache differs from the CPU backend's [batch %d]", batch);
      bad++;
    }
    if (memcmp(q_out, ref_q_out, q_elems * 2) != 0) {
      INV_REPORT(2, "q_out differs from the CPU backend's [batch %d]", batch);
      bad++;
    }
    cudaFree(dq);
    cudaFree(dq_out);
    cudaFree(dkv);
    cudaFree(dcache);
    gpu_plan_dev_free(&d);
    free(q);
    free(kv);
    free(ref_slots);
    free(ref_cache);
    free(cache);
    free(ref_q_out);
    free(q_out);
    gpu_plan_free(&p);
  }
  cudaFree(dslots);
  cudaFree(mirror);
  cudaStreamDestroy(s);
  dsv4_rope_table_destroy(rope);
  dsv4_backend_close(cpu);
  if (bad)
    return 1;
  printf(
      "gpu_inv_no_early_read: %d batches, canary block untouched, slots and bytes as the CPU's\n",
      BATCHES);
  return 0;
}
