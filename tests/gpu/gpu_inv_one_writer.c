/*
 * SPEC §5.1 on the GPU: one writer per byte. Linked against a build of the kernels made with
 * DSV4_TEST_COUNT_STORES, where every store of the insert kernel into q_out or the cache also adds
 * one to a device counter per byte it stores (dsv4__cuda_test_count_regions). Random batches (H
 * 1..128, N 1..300, slot -1 rows, replays, prenormed and fused kv_norm, block sizes 16, 64 and
 * 256, both kernel grids); after each, every q_out byte and each written token's 584-byte record
 * must have been stored exactly once, and every other cache byte never.
 *
 * Built again with DSV4_TEST_BROKEN_BULK_STORE (the KV lanes store the unrotated RoPE values and
 * then the rotated ones over them: the vLLM XPU bug), this test must fail and name the bytes
 * stored twice (ctest: gpu_inv_one_writer_broken_bulk_store).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "gpu_common.h"

#ifndef DSV4_TEST_COUNT_STORES
#error "gpu_inv_one_writer needs the kernels built with DSV4_TEST_COUNT_STORES"
#endif

#define MAX_POS 65536
#define BATCHES 60

/* What a cache byte at offset off of a block is: a range name for the report. */
static const char *part_of(uint64_t off, uint32_t bs, uint64_t *tok, uint64_t *lo, uint64_t *hi) {
  if (off < (uint64_t)DSV4_TOKEN_DATA_BYTES * bs) {
    uint64_t r = off % DSV4_TOKEN_DATA_BYTES;
    *tok = off / DSV4_TOKEN_DATA_BYTES;
    *lo = r < DSV4_NOPE_DIM ? 0 : DSV4_NOPE_DIM;
    *hi = r < DSV4_NOPE_DIM ? DSV4_NOPE_DIM - 1 : DSV4_TOKEN_DATA_BYTES - 1;
    return r < DSV4_NOPE_DIM ? "NoPE" : "RoPE";
  }
  if (off < (uint64_t)DSV4_RECORD_BYTES * bs) {
    *tok = (off - (uint64_t)DSV4_TOKEN_DATA_BYTES * bs) / DSV4_SCALE_BYTES;
    *lo = DSV4_TOKEN_DATA_BYTES;
    *hi = DSV4_RECORD_BYTES - 1;
    return "scales";
  }
  *tok = 0;
  *lo = *hi = off;
  return "block padding";
}

int main(void) {
  if (!gpu_available("gpu_inv_one_writer"))
    return GPU_SKIP;
  float *mirror = NULL;
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_yarn_default, MAX_POS, &mirror);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t rng = 0xA4093822299F31D0ull;
  float w[DSV4_HEAD_DIM];
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    w[d] = 0.5f + (float)gpu_below(&rng, 1u << 20) * 0x1p-20f;
  float *dw = gpu_dev_alloc(sizeof(w));
  CK(cudaMemcpy(dw, w, sizeof(w), cudaMemcpyHostToDevice));
  static const uint32_t sizes[] = {16, 64, 256};
  int bad = 0;
  for (int batch = 0; batch < BATCHES && !bad; batch++) {
    /* Every fifth batch is large enough for the strided grid of several items per warp. */
    uint32_t n = batch % 5 == 4 ? 2000 + gpu_below(&rng, 2000) : 1 + gpu_below(&rng, 300);
    uint32_t heads = batch % 5 == 4 ? 64 : 1 + gpu_below(&rng, 128);
    uint32_t bs = sizes[gpu_below(&rng, 3)];
    int write_kv = gpu_below(&rng, 6) != 0, fused = gpu_below(&rng, 2);
    gpu_plan_t p;
    gpu_plan_make(&rng, &p, n, 1 + gpu_below(&rng, n < 8 ? n : 8), bs, MAX_POS, 5);
    uint64_t stride = DSV4_BLOCK_STRIDE(bs);
    size_t cache_bytes = (size_t)p.n_blocks * stride, q_elems = (size_t)n * heads * DSV4_HEAD_DIM;
    uint16_t *q = gpu_host_alloc(q_elems * 2), *kv = gpu_host_alloc((size_t)n * 1024);
    gpu_fill_bf16(&rng, q, q_elems, 127, 8);
    gpu_fill_bf16(&rng, kv, (size_t)n * DSV4_HEAD_DIM, 127, 8);
    gpu_rope_upload(rope, mirror, MAX_POS, p.pos, n);
    gpu_plan_dev_t d;
    gpu_plan_upload(&p, &d);
    uint16_t *dq = gpu_dev_alloc(q_elems * 2), *dq_out = gpu_dev_alloc(q_elems * 2);
    uint16_t *dkv = gpu_dev_alloc((size_t)n * 1024);
    uint8_t *dcache = gpu_dev_alloc(cache_bytes);
    int64_t *dslots = gpu_dev_alloc(sizeof(int64_t) * n);
    unsigned *cq = gpu_dev_alloc(q_elems * 2 * sizeof(unsigned));
    unsigned *cc = gpu_dev_alloc(cache_bytes * sizeof(unsigned));
    CK(cudaMemcpy(dq, q, q_elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dkv, kv, (size_t)n * 1024, cudaMemcpyHostToDevice));
    CK(cudaMemset(dcache, 0, cache_bytes));
    CK(cudaMemset(cq, 0, q_elems * 2 * sizeof(unsigned)));
    CK(cudaMemset(cc, 0, cache_bytes * sizeof(unsigned)));
    CKD(dsv4__cuda_test_count_regions(dq_out, q_elems * 2, cq, dcache, cache_bytes, cc));
    /* The memsets ran on the legacy stream, which the launches' stream does not wait for. */
    CK(cudaDeviceSynchronize());
    dsv4_map_args_t ma = gpu_plan_map_args(&p, d.pos, d.tok_seg, d.seg_first_lb, d.seg_bt_off,
                                           d.seg_bt_len, d.block_table, dslots);
    dsv4_insert_args_t ia = {.n_tokens = n,
                             .heads = heads,
                             .q = dq,
                             .kv = dkv,
                             .positions = d.pos,
                             .slots = dslots,
                             .kv_norm_weight = fused ? dw : NULL,
                             .eps = 1e-6f,
                             .write_kv = write_kv,
                             .q_out = dq_out,
                             .cache = dcache,
                             .block_size = bs,
                             .n_blocks = p.n_blocks,
                             .stride = stride};
    CKD(dsv4__cuda_map_slots(&ma, s, 1));
    CKD(dsv4__cuda_qkv_insert(&ia, mirror, MAX_POS, s, 1));
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    unsigned *hq = gpu_host_alloc(q_elems * 2 * sizeof(unsigned));
    unsigned *hc = gpu_host_alloc(cache_bytes * sizeof(unsigned));
    int64_t *slots = gpu_host_alloc(sizeof(int64_t) * n);
    CK(cudaMemcpy(hq, cq, q_elems * 2 * sizeof(unsigned), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hc, cc, cache_bytes * sizeof(unsigned), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(slots, dslots, sizeof(int64_t) * n, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < q_elems * 2 && !bad; i++)
      if (hq[i] != 1) {
        size_t el = i / 2;
        INV_REPORT(1,
                   "one writer per byte: q_out token %zu head %zu byte %zu stored %u times, "
                   "expected 1 [batch %d, H %u, N %u]",
                   el / DSV4_HEAD_DIM / heads, el / DSV4_HEAD_DIM % heads, i % 1024, hq[i], batch,
                   heads, n);
        bad++;
      }
    /* The expected count of every cache byte: 1 inside a written record, else 0. */
    uint8_t *want = calloc(1, cache_bytes);
    for (uint32_t t = 0; t < n && write_kv; t++) {
      if (slots[t] < 0)
        continue;
      uint64_t b = (uint64_t)slots[t] / bs, o = (uint64_t)slots[t] % bs;
      memset(want + b * stride + DSV4_TOKEN_DATA_OFFSET(o), 1, DSV4_TOKEN_DATA_BYTES);
      memset(want + b * stride + DSV4_SCALE_OFFSET(bs, o), 1, DSV4_SCALE_BYTES);
    }
    for (size_t i = 0; i < cache_bytes && !bad; i++)
      if (hc[i] != want[i]) {
        uint64_t tok, lo, hi;
        const char *part = part_of(i % stride, bs, &tok, &lo, &hi);
        /* The whole run of bytes of this part with the same wrong count, for the report. */
        size_t run = 1;
        while (i + run < cache_bytes && hc[i + run] == hc[i] && want[i + run] == want[i] &&
               run <= hi - lo)
          run++;
        INV_REPORT(1,
                   "one writer per byte: cache block %llu offset %llu record bytes %llu..%llu [%s] "
                   "(%zu bytes) stored %u times, expected %u [batch %d, H %u, N %u, bs %u]",
                   (unsigned long long)(i / stride), (unsigned long long)tok,
                   (unsigned long long)lo, (unsigned long long)(lo + run - 1), part, run, hc[i],
                   want[i], batch, heads, n, bs);
        bad++;
      }
    free(want);
    free(hq);
    free(hc);
    free(slots);
    cudaFree(cq);
    cudaFree(cc);
    cudaFree(dq);
    cudaFree(dq_out);
    cudaFree(dkv);
    cudaFree(dcache);
    cudaFree(dslots);
    gpu_plan_dev_free(&d);
    free(q);
    free(kv);
    gpu_plan_free(&p);
  }
  cudaFree(dw);
  cudaFree(mirror);
  cudaStreamDestroy(s);
  dsv4_rope_table_destroy(rope);
  if (bad)
    return 1;
  printf("gpu_inv_one_writer: %d batches, every output byte stored exactly once\n", BATCHES);
  return 0;
}
