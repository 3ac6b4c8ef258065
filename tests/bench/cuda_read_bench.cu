/*
 * How fast a launch of one wave reads a fast attention CTA's inputs into shared memory: the ceiling
 * of the fast kernels' input phase (tests/bench/NOTES.md), beside the streaming read ceiling of the
 * same device. Each CTA copies q bytes contiguous (a token's query rows) and rec records of 576
 * bytes in runs of `run` consecutive records (a window's blocks; run 1: records scattered as a C4
 * layer's selected entries are) from pseudo-random places of a 4 GiB buffer into shared memory,
 * then waits for them; nothing is computed. Per configuration: µs a launch (200 launches after 3,
 * back to back on one stream), GB/s over the device and bytes a cycle an SM at 1.98 GHz; "empty"
 * is the same launch with no bytes, the part of each figure that is launch and drain.
 *
 * Usage: cuda_read_bench (no arguments; a table on stdout).
 */
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "cuda_check.h"

#define REC 576
#define SPAN ((size_t)4 << 30)
#define PLACE 65536 /* the granule of the pseudo-random places */

static __device__ __forceinline__ void cp16(void *s, const void *g) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(s)),
      "l"(g)
      : "memory");
}

static __device__ __forceinline__ const uint8_t *place(const uint8_t *buf, uint64_t h) {
  return buf + ((h >> 11) % (SPAN / PLACE - 4)) * PLACE;
}

/* One CTA's inputs: q bytes, then rec records in runs of run, by cp.async (or, with loads, by
 * 16-byte loads and shared stores), all issued before one wait. */
static __global__ void read_inputs(const uint8_t *buf, uint32_t q, uint32_t rec, uint32_t run,
                                   uint32_t seed, int loads, uint32_t *sink) {
  extern __shared__ uint4 smem[];
  uint8_t *s = reinterpret_cast<uint8_t *>(smem);
  const uint64_t h = (blockIdx.x + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xBF58476D1CE4E5B9ull;
  const uint8_t *qs = place(buf, h);
  for (uint32_t i = threadIdx.x; i < q / 16; i += blockDim.x) {
    if (loads)
      reinterpret_cast<uint4 *>(s)[i] = reinterpret_cast<const uint4 *>(qs)[i];
    else
      cp16(s + 16 * i, qs + 16 * i);
  }
  for (uint32_t i = threadIdx.x; i < rec * (REC / 16); i += blockDim.x) {
    const uint32_t r = i / (REC / 16), c = i % (REC / 16);
    const uint8_t *src =
        place(buf, (h + (r / run) * 0x94D049BB133111EBull) * 0xD6E8FEB86659FD93ull) +
        (r % run) * REC + 16 * c;
    uint8_t *dst = s + q + (size_t)r * REC + 16 * c;
    if (loads)
      *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
    else
      cp16(dst, src);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0 && q + rec)
    sink[blockIdx.x] = s[seed % (q + rec * REC)];
}

static __global__ void stream_read(const uint4 *a, size_t n, uint32_t *sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = a[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u)
    sink[0] = x;
}

typedef struct {
  const char *name;
  int per_sm;
  uint32_t threads, q, rec, run;
  int loads;
} config_t;

/* µs a launch of config c over 200 launches; *bytes: what one launch reads. */
static double time_config(const config_t &c, int sms, const uint8_t *buf, uint32_t *sink,
                          double *bytes) {
  const size_t smem = c.q + (size_t)c.rec * REC;
  const int grid = sms * c.per_sm, iters = 200;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int k = 0; k < 3; k++)
    read_inputs<<<grid, c.threads, smem>>>(buf, c.q, c.rec, c.run, 1000 + k, c.loads, sink);
  CHECK(cudaEventRecord(e0));
  for (int k = 0; k < iters; k++)
    read_inputs<<<grid, c.threads, smem>>>(buf, c.q, c.rec, c.run, k, c.loads, sink);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  *bytes = (double)grid * smem;
  return ms * 1e3 / iters;
}

int main(void) {
  uint8_t *buf;
  uint32_t *sink;
  int sms = 0;
  CHECK(cudaMalloc(&buf, SPAN));
  CHECK(cudaMemset(buf, 1, SPAN));
  CHECK(cudaMalloc(&sink, 1 << 20));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(read_inputs, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  stream_read<<<sms * 8, 512>>>(reinterpret_cast<const uint4 *>(buf), SPAN / 16, sink);
  CHECK(cudaEventRecord(e0));
  for (int k = 0; k < 5; k++)
    stream_read<<<sms * 8, 512>>>(reinterpret_cast<const uint4 *>(buf), SPAN / 16, sink);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  printf("ceiling: streaming read of 4 GiB, %d CTAs of 512: %.0f GB/s\n", sms * 8,
         5.0 * SPAN / (ms * 1e-3) / 1e9);
  static const config_t cfg[] = {
      {"empty: 1 CTA an SM, 512 threads, no bytes", 1, 512, 0, 0, 1, 0},
      {"1 CTA an SM, 512 thr, cp.async: q 64 KiB + 128 rec, runs of 43", 1, 512, 65536, 128, 43, 0},
      {"1 CTA an SM, 512 thr, loads:    q 64 KiB + 128 rec, runs of 43", 1, 512, 65536, 128, 43, 1},
      {"1 CTA an SM, 1024 thr, cp.async: q 64 KiB + 128 rec, runs of 43", 1, 1024, 65536, 128, 43,
       0},
      {"2 CTAs an SM, 512 thr, cp.async: q 32 KiB + 64 rec, runs of 43", 2, 512, 32768, 64, 43, 0},
      {"4 CTAs an SM, 256 thr, cp.async: q 16 KiB + 32 rec, runs of 32", 4, 256, 16384, 32, 32, 0},
      {"1 CTA an SM, 512 thr, cp.async: q 64 KiB + 128 rec, scattered", 1, 512, 65536, 128, 1, 0},
      {"1 CTA an SM, 512 thr, cp.async: 256 rec, scattered", 1, 512, 0, 256, 1, 0},
      {"2 CTAs an SM, 512 thr, cp.async: 128 rec, scattered", 2, 512, 0, 128, 1, 0},
  };
  printf("%-66s %10s %8s %12s\n", "one wave reads, per CTA", "us/launch", "GB/s", "B/cycle/SM");
  for (const config_t &c : cfg) {
    double bytes = 0;
    const double us = time_config(c, sms, buf, sink, &bytes);
    printf("%-66s %10.2f %8.0f %12.1f\n", c.name, us, bytes / (us * 1e-6) / 1e9,
           bytes / sms / (us * 1980.0));
  }
  CHECK(cudaFree(buf));
  CHECK(cudaFree(sink));
  return 0;
}
