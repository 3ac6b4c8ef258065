#ifndef DSV4_TESTS_GPU_GPU_LATE_WRITER_H
#define DSV4_TESTS_GPU_GPU_LATE_WRITER_H

/*
 * A test-only kernel that stands for "the grid before the producer writes its inputs late": it
 * lets its dependents launch at once (griddepcontrol.launch_dependents, sm_90+), sleeps delay_ns
 * and only then copies up to four device regions, word by word. A kernel launched right behind it
 * with programmatic dependent launch is resident while the old bytes are still in place.
 */

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  uint32_t *dst[4];
  const uint32_t *src[4];
  uint32_t words[4];
  uint32_t n; /* regions used */
} gpu_late_copy_t;

/* Enqueue the late copy on s; 0 or the CUDA error of the launch. */
int gpu_late_copy(const gpu_late_copy_t *c, uint64_t delay_ns, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_TESTS_GPU_GPU_LATE_WRITER_H */
