#ifndef DSV4_TESTS_BENCH_CUDA_BENCH_COMMON_H
#define DSV4_TESTS_BENCH_CUDA_BENCH_COMMON_H

/*
 * What the CUDA kernel benchmarks share: the device-to-device copy ceiling measured in the run,
 * GPU time per call of a captured graph, and device copies of host arrays. Include after
 * tests/gpu/gpu_common.h (CK, gpu_dev_alloc).
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

#endif /* DSV4_TESTS_BENCH_CUDA_BENCH_COMMON_H */
