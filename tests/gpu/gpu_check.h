#ifndef DSV4_TESTS_GPU_GPU_CHECK_H
#define DSV4_TESTS_GPU_GPU_CHECK_H

/*
 * The device check of every GPU test (a machine without a CUDA device reports "skipped" and exit
 * 77) and checked CUDA calls. C and CUDA C++ alike.
 */

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#define GPU_SKIP 77

/* 1 when a CUDA device is usable; otherwise prints why the test is skipped and returns 0. */
static inline int gpu_available(const char *test) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    printf("%s: skipped: no CUDA device (%s)\n", test,
           e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 0;
  }
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    printf("%s: device 0: %s, sm_%d%d, %d SMs\n", test, prop.name, prop.major, prop.minor,
           prop.multiProcessorCount);
  return 1;
}

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t ck_e_ = (call);                                                                    \
    if (ck_e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(ck_e_));    \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

#endif /* DSV4_TESTS_GPU_GPU_CHECK_H */
