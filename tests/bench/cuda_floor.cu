/*
 * The latency floor of a forward at small batches (tests/bench/cuda_insert_bench.c): two empty
 * kernels launched back to back exactly as the producer and the consumer are (one block each,
 * griddepcontrol in the same places, programmatic dependent launch when asked). A forward of two
 * kernels in a graph can take no less than this pair.
 */
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
