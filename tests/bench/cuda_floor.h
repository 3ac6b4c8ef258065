#ifndef DSV4_TESTS_BENCH_CUDA_FLOOR_H
#define DSV4_TESTS_BENCH_CUDA_FLOOR_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Enqueues one pair of empty kernels shaped like the producer and the consumer (cuda_floor.cu). */
int bench_floor_pair(cudaStream_t s, int pdl);

/*
 * The PCIe floor of a forward whose inputs and answer live in host memory: in_bytes copied to the
 * device and out_bytes back, between page-locked host buffers and device buffers, on stream s,
 * reps times (after a few unmeasured ones). us_copy[i] is the GPU time of copy i (event to event);
 * with pair set, an empty producer/consumer pair (bench_floor_pair, with PDL) runs between the two
 * copies, and us_pair[i] is the time of that whole sequence. 0, or -1 with the CUDA error printed.
 */
int bench_pcie_floor(cudaStream_t s, size_t in_bytes, size_t out_bytes, int reps, double *us_copy,
                     double *us_pair);

#ifdef __cplusplus
}
#endif

#endif
