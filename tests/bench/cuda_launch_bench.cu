/*
 * What the CUDA runtime's calls of a batch cost the calling thread, hot and cold: the host side of
 * a decode's kernel stage (tests/bench/NOTES.md, "Cold launches"). A daemon's executor checks and
 * hashes the batch's bytes, touches its staging and answers between two batches, so the driver's
 * code and data have left the caches by its next launch; a loop of launches keeps them warm. Each
 * row times one call on the host clock, the mean over 512 calls (after 16), with `touch` bytes of
 * other memory written (a byte a 64-byte line) between two calls, and a stream sync every 8 calls
 * so that the queue never fills:
 *   launch      cudaLaunchKernelEx of an empty kernel (one CTA of 128 threads) with programmatic
 *               stream serialization, as the daemon launches (its wait on sm_90 and newer)
 *   event       cudaEventRecord on the same stream (the backend's marks)
 *   copy        cudaMemcpyAsync of 64 bytes from page-locked memory to the device
 *   round trip  a launch and cudaStreamSynchronize
 * The ceiling of each call is its row at touch 0 (warm caches).
 *
 * Usage: cuda_launch_bench (no arguments; a table on stdout).
 */
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "cuda_check.h"

#define CALLS 512
#define WARM 16
#define TOUCH_MAX ((size_t)16 << 20)

static __global__ void empty_kernel(int *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (p && threadIdx.x == 1024) /* never: keeps the parameter */
    *p = 1;
}

static double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

enum { LAUNCH, EVENT, COPY, ROUND_TRIP, KINDS };
static const char *const kind_name[KINDS] = {"launch (PDL, 1 CTA)", "cudaEventRecord",
                                             "cudaMemcpyAsync 64 B H2D", "launch + stream sync"};

typedef struct {
  cudaStream_t s;
  cudaEvent_t ev;
  int *d;
  void *h_pin;
  volatile uint8_t *junk;
} ctx_t;

static void call(const ctx_t &c, int kind) {
  if (kind == LAUNCH || kind == ROUND_TRIP) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1] = {};
    cfg.gridDim = dim3(1, 1, 1);
    cfg.blockDim = dim3(128, 1, 1);
    cfg.stream = c.s;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, empty_kernel, c.d));
    if (kind == ROUND_TRIP)
      CHECK(cudaStreamSynchronize(c.s));
  } else if (kind == EVENT) {
    CHECK(cudaEventRecord(c.ev, c.s));
  } else {
    CHECK(cudaMemcpyAsync(c.d, c.h_pin, 64, cudaMemcpyHostToDevice, c.s));
  }
}

/* The mean µs of one call of kind with touch bytes written between two calls. */
static double time_calls(const ctx_t &c, int kind, size_t touch) {
  double total = 0.0;
  for (int i = 0; i < WARM + CALLS; i++) {
    for (size_t j = 0; j < touch; j += 64)
      c.junk[j] = (uint8_t)(c.junk[j] + 1);
    const double t0 = now_us();
    call(c, kind);
    const double t1 = now_us();
    if (i >= WARM)
      total += t1 - t0;
    if (i % 8 == 7)
      CHECK(cudaStreamSynchronize(c.s));
  }
  CHECK(cudaStreamSynchronize(c.s));
  return total / CALLS;
}

int main() {
  int dev = 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceCount(&dev) != cudaSuccess || dev < 1) {
    printf("cuda_launch_bench: skipped (no CUDA device)\n");
    return 0;
  }
  CHECK(cudaGetDeviceProperties(&prop, 0));
  ctx_t c = {};
  CHECK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&c.ev, cudaEventDisableTiming));
  CHECK(cudaMalloc(&c.d, 64));
  CHECK(cudaMallocHost(&c.h_pin, 64));
  uint8_t *junk = static_cast<uint8_t *>(calloc(TOUCH_MAX, 1));
  if (!junk) {
    fprintf(stderr, "cuda_launch_bench: out of memory\n");
    return 1;
  }
  c.junk = junk;
  printf("cuda_launch_bench: %s, sm_%d%d; µs of the calling thread a call, the mean over %d\n",
         prop.name, prop.major, prop.minor, CALLS);
  static const size_t touch[] = {0, (size_t)1 << 20, (size_t)4 << 20, TOUCH_MAX};
  printf("%-28s %14s %14s %14s %14s\n", "call \\ bytes touched between", "0 (ceiling)", "1 MiB",
         "4 MiB", "16 MiB");
  for (int k = 0; k < KINDS; k++) {
    printf("%-28s", kind_name[k]);
    for (size_t t = 0; t < sizeof(touch) / sizeof(touch[0]); t++)
      printf(" %14.2f", time_calls(c, k, touch[t]));
    printf("\n");
  }
  free(junk);
  CHECK(cudaFreeHost(c.h_pin));
  CHECK(cudaFree(c.d));
  CHECK(cudaEventDestroy(c.ev));
  CHECK(cudaStreamDestroy(c.s));
  return 0;
}
