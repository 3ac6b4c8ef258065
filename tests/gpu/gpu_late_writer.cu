/* The late writer of gpu_late_writer.h. */
#include "gpu_late_writer.h"

static __device__ __forceinline__ uint64_t globaltimer(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void gpu_late_copy_kernel(gpu_late_copy_t c, uint64_t delay_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const uint64_t t0 = globaltimer();
  while (globaltimer() - t0 < delay_ns)
    __nanosleep(1000);
  for (uint32_t r = 0; r < c.n && r < 4; r++)
    for (uint32_t i = threadIdx.x; i < c.words[r]; i += blockDim.x)
      c.dst[r][i] = c.src[r][i];
}

extern "C" int gpu_late_copy(const gpu_late_copy_t *c, uint64_t delay_ns, cudaStream_t s) {
  gpu_late_copy_kernel<<<1, 256, 0, s>>>(*c, delay_ns);
  return (int)cudaGetLastError();
}
