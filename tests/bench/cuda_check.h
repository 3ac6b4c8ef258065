#ifndef DSV4_TESTS_BENCH_CUDA_CHECK_H
#define DSV4_TESTS_BENCH_CUDA_CHECK_H
/* The standalone CUDA benchmarks' check of a runtime call: the call's text and error, then exit. */
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CHECK(x)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                                     \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

#endif /* DSV4_TESTS_BENCH_CUDA_CHECK_H */
