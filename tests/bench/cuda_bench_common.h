#ifndef DSV4_TESTS_BENCH_CUDA_BENCH_COMMON_H
#define DSV4_TESTS_BENCH_CUDA_BENCH_COMMON_H

/*
 * What the CUDA kernel benchmarks share: the device-to-device copy ceiling measured in the run,
 * GPU time per call of a captured graph, device copies of host arrays, and a batch written into a
 * cache by the real slot map and insert. Include after tests/gpu/gpu_common.h (CK, CKD,
 * gpu_dev_alloc, the launch wrappers).
 */
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

/* The device-to-device copy rate in GB/s (bytes read + written) over buffers of `bytes`. */
static inline double copy_ceiling(size_t bytes) {
  void *a = gpu_dev_alloc(bytes), *b = gpu_dev_alloc(bytes);
  CK(cudaMemset(a, 1, bytes));
  CK(cudaMemset(b, 2, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 2; i++)
    CK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  const int reps = 10;
  CK(cudaEventRecord(e0, 0));
  for (int i = 0; i < reps; i++)
    CK(cudaMemcpyAsync(i & 1 ? a : b, i & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice, 0));
  CK(cudaEventRecord(e1, 0));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  cudaFree(a);
  cudaFree(b);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * (double)bytes * reps / (ms * 1e-3) / 1e9; /* read + written */
}

/* GPU time per item of a captured graph of `items` items (3 warm-up replays, 10 timed). */
static inline double replay_us(cudaStream_t s, cudaGraph_t g, uint32_t items) {
  const int reps = 10;
  cudaGraphExec_t ge;
  cudaEvent_t e0, e1;
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; i++)
    CK(cudaGraphLaunch(ge, s));
  CK(cudaEventRecord(e0, s));
  for (int i = 0; i < reps; i++)
    CK(cudaGraphLaunch(ge, s));
  CK(cudaEventRecord(e1, s));
  CK(cudaEventSynchronize(e1));
  CK(cudaGetLastError());
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return ms * 1e3 / ((double)reps * items);
}

static inline void *dev_put(const void *h, size_t n) {
  void *d = gpu_dev_alloc(n ? n : 16);
  if (n)
    CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
  return d;
}

/*
 * One insert batch of n tokens on s, as the daemon's batches write the cache: the slot map over the
 * segments and block table of tab (its n_segments, block_size, n_blocks, seg_* arrays, block_table
 * and bt_entries, on the device; the other fields are this call's), then qkv_insert of random bf16
 * q (`heads` heads) and kv rows at the host positions pos of segments tok_seg: q_out [n, heads,
 * 512] bf16 and the tokens' records in cache. Returns once the stream has run both.
 */
static inline void bench_insert(const dsv4_map_args_t *tab, uint32_t n, const int64_t *pos,
                                const int32_t *tok_seg, uint32_t heads, uint16_t *q_out,
                                uint8_t *cache, const float *mirror, int64_t max_pos, uint64_t *rng,
                                cudaStream_t s) {
  size_t q_elems = (size_t)n * heads * DSV4_HEAD_DIM;
  uint16_t *hq = gpu_host_alloc(q_elems * 2), *hkv = gpu_host_alloc((size_t)n * 1024);
  gpu_fill_bf16(rng, hq, q_elems, 127, 3);
  gpu_fill_bf16(rng, hkv, (size_t)n * DSV4_HEAD_DIM, 127, 3);
  void *dpos = dev_put(pos, sizeof(int64_t) * n), *dseg = dev_put(tok_seg, sizeof(int32_t) * n);
  void *dq = dev_put(hq, q_elems * 2), *dkv = dev_put(hkv, (size_t)n * 1024);
  int64_t *slots = gpu_dev_alloc(sizeof(int64_t) * n);
  dsv4_map_args_t ma = *tab;
  ma.n_tokens = n;
  ma.positions = dpos;
  ma.tok_seg = dseg;
  ma.slots = slots;
  dsv4_insert_args_t ia = {.n_tokens = n,
                           .heads = heads,
                           .q = dq,
                           .kv = dkv,
                           .positions = dpos,
                           .slots = slots,
                           .eps = 1e-6f,
                           .write_kv = 1,
                           .q_out = q_out,
                           .cache = cache,
                           .block_size = tab->block_size,
                           .n_blocks = tab->n_blocks,
                           .stride = DSV4_BLOCK_STRIDE(tab->block_size)};
  CKD(dsv4__cuda_map_slots(&ma, s, 1));
  CKD(dsv4__cuda_qkv_insert(&ia, mirror, max_pos, s, 1));
  CK(cudaStreamSynchronize(s));
  cudaFree(dpos);
  cudaFree(dseg);
  cudaFree(dq);
  cudaFree(dkv);
  cudaFree(slots);
  free(hq);
  free(hkv);
}

#endif /* DSV4_TESTS_BENCH_CUDA_BENCH_COMMON_H */
