/*
 * The latency floor of a forward at small batches (tests/bench/cuda_insert_bench.c): two empty
 * kernels launched back to back exactly as the producer and the consumer are (one block each,
 * griddepcontrol in the same places, programmatic dependent launch when asked). A forward of two
 * kernels in a graph can take no less than this pair.
 *
 * The PCIe floor (tests/bench/shm_bench.c): a forward's inputs copied from page-locked host memory
 * and its answer copied back, the least a backend on the far side of PCIe must move.
 */
#include <stdio.h>
#include <string.h>

#include "cuda-internal.cuh"

#include "cuda_floor.h"

__global__ void floor_producer(int unused) {
  (void)unused;
  dsv4__dep_trigger();
  dsv4__dep_wait();
}

__global__ void floor_consumer(int unused) {
  (void)unused;
  dsv4__dep_wait();
  dsv4__dep_trigger();
}

extern "C" int bench_floor_pair(cudaStream_t s, int pdl) {
  cudaError_t e = dsv4__cuda_launch(floor_producer, 1, 32, s, pdl, 0);
  if (e == cudaSuccess)
    e = dsv4__cuda_launch(floor_consumer, 1, 32, s, pdl, 0);
  return dsv4__cuda_err(e);
}

/* GPU time of one timed sequence: H2D, optionally the empty pair, D2H. */
static cudaError_t pcie_once(cudaStream_t s, void *d_in, const void *h_in, size_t in_bytes,
                             void *h_out, const void *d_out, size_t out_bytes, int pair,
                             cudaEvent_t e0, cudaEvent_t e1, double *us) {
  cudaError_t e = cudaEventRecord(e0, s);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(d_in, h_in, in_bytes, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess && pair && bench_floor_pair(s, 1))
    e = cudaErrorLaunchFailure;
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(h_out, d_out, out_bytes, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess)
    e = cudaEventRecord(e1, s);
  if (e == cudaSuccess)
    e = cudaEventSynchronize(e1);
  float ms = 0;
  if (e == cudaSuccess)
    e = cudaEventElapsedTime(&ms, e0, e1);
  *us = (double)ms * 1e3;
  return e;
}

extern "C" int bench_pcie_floor(cudaStream_t s, size_t in_bytes, size_t out_bytes, int reps,
                                double *us_copy, double *us_pair) {
  void *h_in = NULL, *h_out = NULL, *d_in = NULL, *d_out = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL;
  cudaError_t e = cudaMallocHost(&h_in, in_bytes);
  if (e == cudaSuccess)
    e = cudaMallocHost(&h_out, out_bytes);
  if (e == cudaSuccess)
    e = cudaMalloc(&d_in, in_bytes);
  if (e == cudaSuccess)
    e = cudaMalloc(&d_out, out_bytes);
  if (e == cudaSuccess)
    e = cudaEventCreate(&e0);
  if (e == cudaSuccess)
    e = cudaEventCreate(&e1);
  if (e == cudaSuccess)
    e = cudaMemset(d_out, 1, out_bytes);
  if (e == cudaSuccess)
    memset(h_in, 2, in_bytes);
  double unused;
  /* Ten unmeasured rounds first: the first copies pay for mapping the buffers. */
  for (int i = -10; i < reps && e == cudaSuccess; i++) {
    e = pcie_once(s, d_in, h_in, in_bytes, h_out, d_out, out_bytes, 0, e0, e1,
                  i < 0 ? &unused : &us_copy[i]);
    if (e == cudaSuccess && us_pair)
      e = pcie_once(s, d_in, h_in, in_bytes, h_out, d_out, out_bytes, 1, e0, e1,
                    i < 0 ? &unused : &us_pair[i]);
  }
  if (e != cudaSuccess)
    fprintf(stderr, "bench_pcie_floor: %s\n", cudaGetErrorString(e));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(d_in);
  cudaFree(d_out);
  cudaFreeHost(h_in);
  cudaFreeHost(h_out);
  return e == cudaSuccess ? 0 : -1;
}
