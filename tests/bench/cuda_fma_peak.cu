/*
 * The fp32 FMA ceiling of an arithmetic-bound kernel (tests/bench/cuda_attn_bench.c): every thread
 * runs 16 independent fma chains in registers, 2048 threads per SM, so the FMA pipes, not latency,
 * set the rate. The operands are kernel arguments and the result is stored only under a condition
 * the compiler cannot decide, so no chain is folded away.
 */
#include <stdint.h>

#include "cuda_fma_peak.h"

#define PEAK_CHAINS 16
#define PEAK_BLOCK 256
#define PEAK_BLOCKS_PER_SM 8

__global__ void __launch_bounds__(PEAK_BLOCK)
    fma_peak_kernel(float *out, float a, float b, int iters) {
  float x[PEAK_CHAINS];
#pragma unroll
  for (int i = 0; i < PEAK_CHAINS; i++)
    x[i] = (float)threadIdx.x * 0x1p-10f + (float)i;
#pragma unroll 4
  for (int k = 0; k < iters; k++)
#pragma unroll
    for (int i = 0; i < PEAK_CHAINS; i++)
      x[i] = __fmaf_rn(x[i], a, b);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < PEAK_CHAINS; i++)
    s = __fadd_rn(s, x[i]);
  if (s == 1234.5f)
    out[threadIdx.x] = s;
}

extern "C" double bench_fma_peak_gflops(cudaStream_t s) {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 0;
  const int iters = 8192, reps = 5;
  const unsigned grid = (unsigned)sms * PEAK_BLOCKS_PER_SM;
  float *out = NULL;
  cudaEvent_t e0, e1;
  if (cudaMalloc((void **)&out, PEAK_BLOCK * sizeof(float)) != cudaSuccess)
    return 0;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  fma_peak_kernel<<<grid, PEAK_BLOCK, 0, s>>>(out, 0.9999f, 1e-4f, iters);
  cudaEventRecord(e0, s);
  for (int r = 0; r < reps; r++)
    fma_peak_kernel<<<grid, PEAK_BLOCK, 0, s>>>(out, 0.9999f, 1e-4f, iters);
  cudaEventRecord(e1, s);
  float ms = 0;
  int ok = cudaEventSynchronize(e1) == cudaSuccess && cudaGetLastError() == cudaSuccess &&
           cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(out);
  if (!ok)
    return 0;
  const double fmas = (double)grid * PEAK_BLOCK * PEAK_CHAINS * iters * reps;
  return 2.0 * fmas / (ms * 1e-3) / 1e9;
}
