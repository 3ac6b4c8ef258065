/*
 * Launches that read and write registered host memory in place (backend.h, host_alias) against the
 * copies they replace, on the device's own PCIe link: for a forward's q in and q_out out of n bytes
 * each, host wall time per step (launch or copies to the stream's completion), best of 3 rounds.
 *
 *   copies     H2D into device memory, a copy kernel, D2H back: what a staged forward does
 *   in place   one kernel reads the n bytes from mapped host memory, writes n bytes to another
 *              (16-byte loads and stores, whole rows: the insert's q and q_out)
 *   read only  the kernel reads in place and writes device memory (the answer stays staged)
 *   scattered  4-byte stores in place, 16 bytes of a row per 4 lanes over 8 rows (the attention
 *              kernels' output stores): why attn and lse stay staged
 *   ceiling    H2D and D2H of n bytes by the copy engines alone, no kernel (the PCIe floor)
 *
 * Usage: cuda_inplace_bench (no arguments; a table on stdout).
 */
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "cuda_check.h"

static __global__ void copy_rows(const uint4 *__restrict__ a, uint4 *__restrict__ b, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    b[i] = a[i];
}

/* Rows of 1 KiB: a warp stores 8 rows at a time, each lane 4 bytes, 4 lanes 16 contiguous bytes. */
static __global__ void store_scattered(uint32_t *__restrict__ b, size_t rows) {
  const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
  const uint32_t lane = threadIdx.x & 31;
  for (size_t r0 = ((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5) * 8; r0 < rows;
       r0 += warps * 8) {
    const size_t r = r0 + (lane >> 2);
    if (r >= rows)
      continue;
    for (uint32_t j = 0; j < 64; j++)
      b[r * 256 + j * 4 + (lane & 3)] = (uint32_t)r + j;
  }
}

static double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

enum { COPIES, IN_PLACE, READ_ONLY, SCATTERED, CEILING, WAYS };

/* One step of way w over n bytes: host buffers h_in/h_out (registered, mapped at m_in/m_out),
 * device buffers d_in/d_out. */
static void step(int w, cudaStream_t s, size_t n, uint8_t *h_in, uint8_t *h_out, uint8_t *m_in,
                 uint8_t *m_out, uint8_t *d_in, uint8_t *d_out) {
  const unsigned grid = 264, block = 512;
  switch (w) {
  case COPIES:
    CHECK(cudaMemcpyAsync(d_in, h_in, n, cudaMemcpyHostToDevice, s));
    copy_rows<<<grid, block, 0, s>>>((const uint4 *)d_in, (uint4 *)d_out, n / 16);
    CHECK(cudaMemcpyAsync(h_out, d_out, n, cudaMemcpyDeviceToHost, s));
    break;
  case IN_PLACE:
    copy_rows<<<grid, block, 0, s>>>((const uint4 *)m_in, (uint4 *)m_out, n / 16);
    break;
  case READ_ONLY:
    copy_rows<<<grid, block, 0, s>>>((const uint4 *)m_in, (uint4 *)d_out, n / 16);
    break;
  case SCATTERED:
    store_scattered<<<grid, block, 0, s>>>((uint32_t *)m_out, n / 1024);
    break;
  default:
    CHECK(cudaMemcpyAsync(d_in, h_in, n, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpyAsync(h_out, d_out, n, cudaMemcpyDeviceToHost, s));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaStreamSynchronize(s));
}

int main() {
  const size_t sizes[] = {64u << 10, 1u << 20, 4u << 20, 64u << 20};
  const char *names[WAYS] = {"copies", "in place", "read only", "scattered", "ceiling"};
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("# us a step (best of 3 rounds); ceiling: H2D + D2H of the bytes, copy engines alone\n");
  printf("%10s", "bytes");
  for (int w = 0; w < WAYS; w++)
    printf(" %10s", names[w]);
  printf(" | %9s %9s %9s\n", "copies/c", "place/c", "scat/c");
  for (size_t n : sizes) {
    uint8_t *h_in = (uint8_t *)aligned_alloc(4096, n), *h_out = (uint8_t *)aligned_alloc(4096, n);
    uint8_t *m_in, *m_out, *d_in, *d_out;
    for (size_t i = 0; i < n; i++)
      h_in[i] = (uint8_t)(i * 31 + 7);
    CHECK(cudaHostRegister(h_in, n, cudaHostRegisterMapped));
    CHECK(cudaHostRegister(h_out, n, cudaHostRegisterMapped));
    CHECK(cudaHostGetDevicePointer((void **)&m_in, h_in, 0));
    CHECK(cudaHostGetDevicePointer((void **)&m_out, h_out, 0));
    CHECK(cudaMalloc(&d_in, n));
    CHECK(cudaMalloc(&d_out, n));
    const int iters = n >= (64u << 20) ? 20 : 300;
    double best[WAYS];
    for (int w = 0; w < WAYS; w++)
      best[w] = 1e300;
    for (int round = 0; round < 3; round++)
      for (int w = 0; w < WAYS; w++) {
        step(w, s, n, h_in, h_out, m_in, m_out, d_in, d_out); /* warm */
        double t0 = now_us();
        for (int i = 0; i < iters; i++)
          step(w, s, n, h_in, h_out, m_in, m_out, d_in, d_out);
        double us = (now_us() - t0) / iters;
        best[w] = us < best[w] ? us : best[w];
      }
    /* The in-place copy must have moved every byte. */
    step(IN_PLACE, s, n, h_in, h_out, m_in, m_out, d_in, d_out);
    for (size_t i = 0; i < n; i++)
      if (h_out[i] != h_in[i]) {
        fprintf(stderr, "in place: byte %zu differs\n", i);
        return 1;
      }
    printf("%10zu", n);
    for (int w = 0; w < WAYS; w++)
      printf(" %10.1f", best[w]);
    printf(" | %8.2fx %8.2fx %8.2fx\n", best[COPIES] / best[CEILING],
           best[IN_PLACE] / best[CEILING], best[SCATTERED] / best[CEILING]);
    CHECK(cudaHostUnregister(h_in));
    CHECK(cudaHostUnregister(h_out));
    CHECK(cudaFree(d_in));
    CHECK(cudaFree(d_out));
    free(h_in);
    free(h_out);
  }
  return 0;
}
