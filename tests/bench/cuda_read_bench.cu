/*
 * How fast a launch of one wave reads a fast attention CTA's inputs into shared memory: the ceiling
 * of the fast kernels' input phase (tests/bench/NOTES.md), beside the streaming read ceiling of the
 * same device. Each CTA copies q bytes contiguous (a token's query rows) and rec records of 576
 * bytes in runs of `run` consecutive records (a window's blocks; run 1: records scattered as a C4
 * layer's selected entries are) from pseudo-random places of a 4 GiB buffer into shared memory,
 * then waits for them; nothing is computed. Per configuration: µs a launch (200 launches after 3,
 * back to back on one stream), GB/s over the device and bytes a cycle an SM at 1.98 GHz; "empty"
 * is the same launch with no bytes, the part of each figure that is launch and drain. "cycles a
 * CTA" is inside the CTAs: from a CTA's start to the end of its wait, by the SM's cycle counter,
 * the mean over every CTA of the 200 launches (the figure to set beside a kernel's phases in the
 * DSV4_CUDA_PHASES build), and "B/cycle in a CTA" its bytes over those cycles. Three more
 * configurations add one part of the fast window kernel's CTA each: "chain", a chain of four
 * dependent 4-byte loads at pseudo-random places before the copies, whose last value the
 * records' places depend on (the token's segment, position, block table); "+ scales", each
 * record's 8 scale bytes by their own copy from a second place; "then 64 KiB out", the CTA's
 * output rows stored from shared memory after its wait (counted after the cycles, so that what
 * they cost shows in the next launch's reads, as the kernel's stores do); "a warp a record", the
 * records copied as the kernel copies them (a warp's 32 lanes the first 512 bytes, 4 of them the
 * last 64) instead of as one stream of 16-byte chunks over all of them.
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

enum { LOADS = 1, CHAIN = 2, SCALES = 4, WRITE = 8, WARP_REC = 16 };
#define OUT_BYTES 65536u /* a CTA's output rows with WRITE */

/* One CTA's inputs: q bytes, then rec records in runs of run, by cp.async (or, with LOADS, by
 * 16-byte loads and shared stores), all issued before one wait; the other flags as above. */
static __global__ void read_inputs(const uint8_t *buf, uint32_t q, uint32_t rec, uint32_t run,
                                   uint32_t seed, int flags, uint32_t *sink,
                                   unsigned long long *cycles, uint4 *out) {
  const long long t0 = clock64();
  extern __shared__ uint4 smem[];
  uint8_t *s = reinterpret_cast<uint8_t *>(smem);
  const int loads = flags & LOADS;
  uint64_t h = (blockIdx.x + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xBF58476D1CE4E5B9ull;
  const uint8_t *qs = place(buf, h);
  if (flags & CHAIN) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++)
      v = *reinterpret_cast<const volatile uint32_t *>(place(buf, h + k + v) + 4 * threadIdx.x);
    h ^= v == 7u; /* the buffer holds 0x01010101: h is unchanged, but waits for v */
  }
  for (uint32_t i = threadIdx.x; i < q / 16; i += blockDim.x) {
    if (loads)
      reinterpret_cast<uint4 *>(s)[i] = reinterpret_cast<const uint4 *>(qs)[i];
    else
      cp16(s + 16 * i, qs + 16 * i);
  }
  const uint32_t lane = threadIdx.x & 31, warps = blockDim.x / 32;
  for (uint32_t r = threadIdx.x / 32; (flags & WARP_REC) && r < rec; r += warps) {
    const uint8_t *src =
        place(buf, (h + (r / run) * 0x94D049BB133111EBull) * 0xD6E8FEB86659FD93ull) +
        (r % run) * REC;
    uint8_t *dst = s + q + (size_t)r * REC;
    cp16(dst + 16 * lane, src + 16 * lane);
    if (lane < REC / 16 - 32)
      cp16(dst + 16 * (32 + lane), src + 16 * (32 + lane));
  }
  for (uint32_t i = threadIdx.x; !(flags & WARP_REC) && i < rec * (REC / 16); i += blockDim.x) {
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
  if (flags & SCALES) /* 8 bytes a record, into the last 8 of its 576 */
    for (uint32_t r = threadIdx.x; r < rec; r += blockDim.x)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(
                       (uint32_t)__cvta_generic_to_shared(s + q + (size_t)r * REC + REC - 8)),
                   "l"(place(buf, h * 0x2545F4914F6CDD1Dull + r / run) + 8 * (r % run))
                   : "memory");
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicAdd(cycles, (unsigned long long)(clock64() - t0));
    if (q + rec)
      sink[blockIdx.x] = s[seed % (q + rec * REC)];
  }
  if (flags & WRITE)
    for (uint32_t i = threadIdx.x; i < OUT_BYTES / 16; i += blockDim.x)
      out[(size_t)blockIdx.x * (OUT_BYTES / 16) + i] = smem[i];
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
  int flags;
} config_t;

/* µs a launch of config c over 200 launches; *bytes: what one launch reads; *cta: cycles a CTA
 * inside it (cycles: a device counter). */
static double time_config(const config_t &c, int sms, const uint8_t *buf, uint32_t *sink,
                          unsigned long long *cycles, uint4 *out, double *bytes, double *cta) {
  const size_t smem = c.q + (size_t)c.rec * REC;
  const int grid = sms * c.per_sm, iters = 200;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int k = 0; k < 3; k++)
    read_inputs<<<grid, c.threads, smem>>>(buf, c.q, c.rec, c.run, 1000 + k, c.flags, sink, cycles,
                                           out);
  CHECK(cudaMemset(cycles, 0, sizeof(*cycles)));
  CHECK(cudaEventRecord(e0));
  for (int k = 0; k < iters; k++)
    read_inputs<<<grid, c.threads, smem>>>(buf, c.q, c.rec, c.run, k, c.flags, sink, cycles, out);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  unsigned long long total = 0;
  CHECK(cudaMemcpy(&total, cycles, sizeof(total), cudaMemcpyDeviceToHost));
  *bytes = (double)grid * smem;
  *cta = (double)total / ((double)grid * iters);
  return ms * 1e3 / iters;
}

int main(void) {
  uint8_t *buf;
  uint32_t *sink;
  unsigned long long *cycles;
  uint4 *out;
  int sms = 0;
  CHECK(cudaMalloc(&buf, SPAN));
  CHECK(cudaMemset(buf, 1, SPAN));
  CHECK(cudaMalloc(&sink, 1 << 20));
  CHECK(cudaMalloc(&cycles, sizeof(*cycles)));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaMalloc(&out, (size_t)sms * OUT_BYTES));
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
      {"1 CTA an SM, 512 thr, loads:    q 64 KiB + 128 rec, runs of 43", 1, 512, 65536, 128, 43,
       LOADS},
      {"1 CTA an SM, 1024 thr, cp.async: q 64 KiB + 128 rec, runs of 43", 1, 1024, 65536, 128, 43,
       0},
      {"2 CTAs an SM, 512 thr, cp.async: q 32 KiB + 64 rec, runs of 43", 2, 512, 32768, 64, 43, 0},
      {"4 CTAs an SM, 256 thr, cp.async: q 16 KiB + 32 rec, runs of 32", 4, 256, 16384, 32, 32, 0},
      {"1 CTA an SM, 512 thr, cp.async: q 64 KiB + 128 rec, scattered", 1, 512, 65536, 128, 1, 0},
      {"1 CTA an SM, 512 thr, cp.async: 256 rec, scattered", 1, 512, 0, 256, 1, 0},
      {"2 CTAs an SM, 512 thr, cp.async: 128 rec, scattered", 2, 512, 0, 128, 1, 0},
      {"1 CTA an SM, 512 thr, cp.async: q 64 KiB + 128 rec, runs of 43, chain", 1, 512, 65536, 128,
       43, CHAIN},
      {"the same + scales", 1, 512, 65536, 128, 43, CHAIN | SCALES},
      {"the same, then 64 KiB out", 1, 512, 65536, 128, 43, CHAIN | SCALES | WRITE},
      {"1 CTA an SM, 512 thr, cp.async: q 64 KiB + 128 rec, runs of 43, then 64 KiB out", 1, 512,
       65536, 128, 43, WRITE},
      {"1 CTA an SM, 512 thr, cp.async: q 64 KiB + 128 rec, runs of 43, a warp a record", 1, 512,
       65536, 128, 43, WARP_REC},
      {"the same, chain + scales, then 64 KiB out", 1, 512, 65536, 128, 43,
       WARP_REC | CHAIN | SCALES | WRITE},
  };
  printf("%-66s %10s %8s %12s %14s %17s\n", "one wave reads, per CTA", "us/launch", "GB/s",
         "B/cycle/SM", "cycles a CTA", "B/cycle in a CTA");
  for (const config_t &c : cfg) {
    double bytes = 0, cta = 0;
    const double us = time_config(c, sms, buf, sink, cycles, out, &bytes, &cta);
    printf("%-66s %10.2f %8.0f %12.1f %14.0f %17.1f\n", c.name, us, bytes / (us * 1e-6) / 1e9,
           bytes / sms / (us * 1980.0), cta, bytes / (sms * c.per_sm) / cta);
  }
  CHECK(cudaFree(buf));
  CHECK(cudaFree(sink));
  CHECK(cudaFree(cycles));
  CHECK(cudaFree(out));
  return 0;
}
