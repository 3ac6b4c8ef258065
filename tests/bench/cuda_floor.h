#ifndef DSV4_TESTS_BENCH_CUDA_FLOOR_H
#define DSV4_TESTS_BENCH_CUDA_FLOOR_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Enqueues one pair of empty kernels shaped like the producer and the consumer (cuda_floor.cu). */
int bench_floor_pair(cudaStream_t s, int pdl);

#ifdef __cplusplus
}
#endif

#endif
