/*
 * SPEC §5.2 on the GPU, the producer's side: the slot-map kernel reads its inputs (positions,
 * segments of the tokens, block tables) only after its dependency wait. Each batch's metadata is
 * uploaded stale (every block-table entry names a canary block, positions and segments are off by
 * one); a test-only kernel (gpu_late_writer.h) triggers its dependents at once, sleeps 200 µs and
 * then writes the real values; the slot-map kernel is launched right behind it with programmatic
 * dependent launch. Its slots must be those the CPU backend maps from the real values.
 *
 * The shipped producer also prefetches those lines into the L2 before its wait (README, Decisions:
 * a prefetch returns nothing, and the loads after the wait must still see the late writer's
 * bytes); this test is what shows that. Built again with DSV4_TEST_BROKEN_EARLY_MAP_READ (the
 * producer loads its block-table entries before the wait), it must fail (ctest:
 * gpu_inv_producer_wait_broken_early_map_read). On a device without PDL (below sm_90) the launches
 * are in plain stream order and the test reports "skipped".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "gpu_common.h"
#include "gpu_late_writer.h"

#define MAX_POS 65536
#define BATCHES 40
#define DELAY_NS 200000ull

/* A device copy of n bytes of host memory. */
static void *dev_copy(const void *h, size_t n) {
  void *d = gpu_dev_alloc(n ? n : 1);
  CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
  return d;
}

int main(void) {
  if (!gpu_available("gpu_inv_producer_wait"))
    return GPU_SKIP;
  if (!dsv4__cuda_pdl_supported(0)) {
    printf("gpu_inv_producer_wait: skipped: device 0 has no programmatic dependent launch\n");
    return GPU_SKIP;
  }
  dsv4_backend_t *cpu = NULL;
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t rng = 0xA4093822299F31D0ull;
  int bad = 0;
  for (int batch = 0; batch < BATCHES && !bad; batch++) {
    gpu_plan_t p;
    uint32_t n = 1 + gpu_below(&rng, 256);
    uint32_t segs = 1 + gpu_below(&rng, n < 8 ? n : 8);
    uint32_t bs = gpu_below(&rng, 2) ? 64 : 16;
    gpu_plan_make(&rng, &p, n, segs, bs, MAX_POS, 5);
    /* One more block than the plan uses: the canary, named only by the stale table. */
    uint32_t canary = p.n_blocks;
    p.n_blocks++;
    int64_t *ref_slots = gpu_host_alloc(sizeof(int64_t) * n);
    dsv4_map_args_t ma = gpu_plan_map_args(&p, p.pos, p.tok_seg, p.seg_first_lb, p.seg_bt_off,
                                           p.seg_bt_len, p.block_table, ref_slots);
    CKD(cpu->ops->map_slots(cpu, &ma));

    /* The stale metadata on the device, and the real values the late writer copies over it. */
    int64_t *stale_pos = gpu_host_alloc(sizeof(int64_t) * n);
    int32_t *stale_seg = gpu_host_alloc(sizeof(int32_t) * n);
    int32_t *stale_bt = gpu_host_alloc(sizeof(int32_t) * p.bt_len);
    for (uint32_t t = 0; t < n; t++) {
      stale_pos[t] = p.pos[t] ^ 1;
      stale_seg[t] = (int32_t)((uint32_t)(p.tok_seg[t] + 1) % segs);
    }
    for (uint32_t i = 0; i < p.bt_len; i++)
      stale_bt[i] = (int32_t)canary;
    gpu_plan_dev_t d;
    gpu_plan_upload(&p, &d);
    CK(cudaMemcpy(d.pos, stale_pos, sizeof(int64_t) * n, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.tok_seg, stale_seg, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.block_table, stale_bt, sizeof(int32_t) * p.bt_len, cudaMemcpyHostToDevice));
    void *real_pos = dev_copy(p.pos, sizeof(int64_t) * n);
    void *real_seg = dev_copy(p.tok_seg, sizeof(int32_t) * n);
    void *real_bt = dev_copy(p.block_table, sizeof(int32_t) * p.bt_len);
    int64_t *dslots = gpu_dev_alloc(sizeof(int64_t) * n);
    CK(cudaMemset(dslots, 0xff, sizeof(int64_t) * n));
    CK(cudaDeviceSynchronize());

    gpu_late_copy_t late = {
        .dst = {(uint32_t *)d.pos, (uint32_t *)d.tok_seg, (uint32_t *)d.block_table},
        .src = {real_pos, real_seg, real_bt},
        .words = {2 * n, n, p.bt_len},
        .n = 3};
    ma = gpu_plan_map_args(&p, d.pos, d.tok_seg, d.seg_first_lb, d.seg_bt_off, d.seg_bt_len,
                           d.block_table, dslots);
    CK((cudaError_t)gpu_late_copy(&late, DELAY_NS, s));
    CKD(dsv4__cuda_map_slots(&ma, s, 1));
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    int64_t *seen = gpu_host_alloc(sizeof(int64_t) * n);
    CK(cudaMemcpy(seen, dslots, sizeof(int64_t) * n, cudaMemcpyDeviceToHost));

    for (uint32_t t = 0; t < n && !bad; t++) {
      if (seen[t] == ref_slots[t])
        continue;
      if (seen[t] >= 0 && (uint64_t)seen[t] / bs == canary)
        INV_REPORT(2,
                   "token %u has slot %lld in canary block %u: the slot-map kernel read the "
                   "block table before its dependency wait [batch %d, %u tokens, %u segments, "
                   "bs %u]",
                   t, (long long)seen[t], canary, batch, n, segs, bs);
      else
        INV_REPORT(2,
                   "token %u has slot %lld, expected %lld: the slot-map kernel read stale "
                   "metadata [batch %d, %u tokens, %u segments, bs %u]",
                   t, (long long)seen[t], (long long)ref_slots[t], batch, n, segs, bs);
      bad++;
    }
    cudaFree(real_pos);
    cudaFree(real_seg);
    cudaFree(real_bt);
    cudaFree(dslots);
    gpu_plan_dev_free(&d);
    free(stale_pos);
    free(stale_seg);
    free(stale_bt);
    free(ref_slots);
    free(seen);
    gpu_plan_free(&p);
  }
  cudaStreamDestroy(s);
  dsv4_backend_close(cpu);
  if (bad)
    return 1;
  printf("gpu_inv_producer_wait: %d batches, every slot mapped from the late writer's values\n",
         BATCHES);
  return 0;
}
