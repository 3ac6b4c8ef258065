/*
 * The fp32 FMA ceiling of an arithmetic-bound kernel (tests/bench/cuda_attn_bench.c): every thread
 * runs 16 independent fma chains in registers, 2048 threads per SM, so the FMA pipes, not latency,
 * set the rate. The operands are kernel arguments and the result is stored only under a condition
 * the compiler cannot decide, so no chain is folded away. Beside it, the bf16 tensor-core rate of
 * the instruction fast-mode attention uses (mma.sync m16n8k16, fp32 accumulation), measured the
 * same way: 8 independent accumulator tiles per warp, 8 warps per block, 2 blocks per SM.
 * bench_peaks measures and prints both for the benchmarks (cuda_attn_bench.c and the prefill row of
 * cuda_compress_bench.c).
 */
#include <stdint.h>
#include <stdio.h>

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

/* Milliseconds of `reps` launches of launch(out) on s after one warm-up, with the SM count in
 * *sms; 0 when a CUDA call failed. */
template <typename F> static float time_launches(cudaStream_t s, int reps, int *sms, F launch) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 0;
  float *out = NULL;
  cudaEvent_t e0, e1;
  if (cudaMalloc((void **)&out, PEAK_BLOCK * sizeof(float)) != cudaSuccess)
    return 0;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  launch(out);
  cudaEventRecord(e0, s);
  for (int r = 0; r < reps; r++)
    launch(out);
  cudaEventRecord(e1, s);
  float ms = 0;
  int ok = cudaEventSynchronize(e1) == cudaSuccess && cudaGetLastError() == cudaSuccess &&
           cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(out);
  return ok ? ms : 0;
}

extern "C" double bench_fma_peak_gflops(cudaStream_t s) {
  const int iters = 8192, reps = 5;
  int sms = 0;
  float ms = time_launches(s, reps, &sms, [&](float *out) {
    fma_peak_kernel<<<(unsigned)sms * PEAK_BLOCKS_PER_SM, PEAK_BLOCK, 0, s>>>(out, 0.9999f, 1e-4f,
                                                                              iters);
  });
  if (ms <= 0)
    return 0;
  const double fmas = (double)sms * PEAK_BLOCKS_PER_SM * PEAK_BLOCK * PEAK_CHAINS * iters * reps;
  return 2.0 * fmas / (ms * 1e-3) / 1e9;
}

#define MMA_TILES 8

__global__ void __launch_bounds__(PEAK_BLOCK)
    mma_peak_kernel(float *out, uint32_t a0, uint32_t b0, int iters) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d[MMA_TILES][4];
#pragma unroll
  for (int i = 0; i < MMA_TILES; i++)
    d[i][0] = d[i][1] = d[i][2] = d[i][3] = (float)threadIdx.x;
  const uint32_t a = a0 ^ threadIdx.x, b = b0 ^ threadIdx.x;
#pragma unroll 2
  for (int k = 0; k < iters; k++)
#pragma unroll
    for (int i = 0; i < MMA_TILES; i++)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                   "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                   : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
                   : "r"(a), "r"(b), "r"(a), "r"(b), "r"(b), "r"(a));
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < MMA_TILES; i++)
    s += d[i][0] + d[i][1] + d[i][2] + d[i][3];
  if (s == 1234.5f)
    out[threadIdx.x] = s;
#endif
}

extern "C" double bench_mma_peak_gflops(cudaStream_t s) {
  const int iters = 4096, reps = 5;
  int sms = 0;
  float ms = time_launches(s, reps, &sms, [&](float *out) {
    mma_peak_kernel<<<(unsigned)sms * 2, PEAK_BLOCK, 0, s>>>(out, 0x3f803f80u, 0x3f003f00u, iters);
  });
  if (ms <= 0)
    return 0;
  /* 2 x 16 x 8 x 16 FLOP per warp and instruction. */
  const double mmas = (double)sms * 2 * (PEAK_BLOCK / 32) * MMA_TILES * iters * reps;
  return mmas * 4096.0 / (ms * 1e-3) / 1e9;
}

extern "C" int bench_peaks(const char *bench, cudaStream_t s, int tensor_cores, double peak[2]) {
  peak[0] = bench_fma_peak_gflops(s);
  peak[1] = tensor_cores ? bench_mma_peak_gflops(s) : 0.0;
  if (peak[0] <= 0 || (tensor_cores && peak[1] <= 0)) {
    fprintf(stderr, "%s: the %s-peak kernel failed\n", bench, peak[0] <= 0 ? "FMA" : "MMA");
    return -1;
  }
  printf("fp32 FMA peak (16 chains per thread, 2048 threads per SM): %.1f GFLOP/s\n", peak[0]);
  if (tensor_cores)
    printf("bf16 tensor-core peak (mma.sync m16n8k16, 8 tiles per warp): %.1f GFLOP/s\n", peak[1]);
  return 0;
}
