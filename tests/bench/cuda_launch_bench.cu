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
 * and, for a chain of CHAIN such launches (a decode batch's kernels), three ways to queue it:
 *   launches    CHAIN cudaLaunchKernelEx calls
 *   graph, set  one graph of the chain instantiated once; per call each node's parameters set
 *               (cudaGraphExecKernelNodeSetParams) and the graph launched
 *   graph, capture  per call the chain captured from a second stream, the instance updated to it
 *               (cudaGraphExecUpdate) and launched
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
#define CHAIN 4

static __global__ void empty_kernel(int *p, int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (p && threadIdx.x == 1024) /* never: keeps the parameters */
    *p = v;
}

static double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

enum { LAUNCH, EVENT, COPY, ROUND_TRIP, CHAIN_LAUNCHES, GRAPH_SET, GRAPH_CAPTURE, KINDS };
static const char *const kind_name[KINDS] = {"launch (PDL, 1 CTA)",       "cudaEventRecord",
                                             "cudaMemcpyAsync 64 B H2D",  "launch + stream sync",
                                             "chain of 4: launches",      "chain of 4: graph, set",
                                             "chain of 4: graph, capture"};

typedef struct {
  cudaStream_t s, s_cap;
  cudaEvent_t ev;
  int *d;
  void *h_pin;
  volatile uint8_t *junk;
  cudaGraph_t graph; /* the instance's graph, whose nodes name the instance's */
  cudaGraphExec_t exec;
  cudaGraphNode_t nodes[CHAIN];
} ctx_t;

static void launch(cudaStream_t s, int *d, int v) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  cfg.gridDim = dim3(1, 1, 1);
  cfg.blockDim = dim3(128, 1, 1);
  cfg.stream = s;
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&cfg, empty_kernel, d, v));
}

/* The chain captured from c.s_cap into a new graph (the caller destroys it). */
static cudaGraph_t capture_chain(const ctx_t &c, int v) {
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(c.s_cap, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < CHAIN; k++)
    launch(c.s_cap, c.d, v + k);
  CHECK(cudaStreamEndCapture(c.s_cap, &g));
  return g;
}

/* The instance every graph row launches, and its kernel nodes (in any order: they differ in their
 * parameters only). */
static void make_graph(ctx_t &c) {
  c.graph = capture_chain(c, 0);
  CHECK(cudaGraphInstantiate(&c.exec, c.graph, 0));
  size_t n = CHAIN;
  CHECK(cudaGraphGetNodes(c.graph, c.nodes, &n));
}

static void graph_set(const ctx_t &c, int v) {
  for (int k = 0; k < CHAIN; k++) {
    int *d = c.d;
    int val = v + k;
    void *args[2] = {&d, &val};
    cudaKernelNodeParams kp = {};
    kp.func = reinterpret_cast<void *>(empty_kernel);
    kp.gridDim = dim3(1, 1, 1);
    kp.blockDim = dim3(128, 1, 1);
    kp.kernelParams = args;
    CHECK(cudaGraphExecKernelNodeSetParams(c.exec, c.nodes[k], &kp));
  }
  CHECK(cudaGraphLaunch(c.exec, c.s));
}

static void graph_capture(const ctx_t &c, int v) {
  cudaGraph_t g = capture_chain(c, v);
  cudaGraphExecUpdateResultInfo info;
  CHECK(cudaGraphExecUpdate(c.exec, g, &info));
  CHECK(cudaGraphLaunch(c.exec, c.s));
  CHECK(cudaGraphDestroy(g));
}

static void call(const ctx_t &c, int kind, int v) {
  if (kind == LAUNCH || kind == ROUND_TRIP) {
    launch(c.s, c.d, v);
    if (kind == ROUND_TRIP)
      CHECK(cudaStreamSynchronize(c.s));
  } else if (kind == EVENT) {
    CHECK(cudaEventRecord(c.ev, c.s));
  } else if (kind == COPY) {
    CHECK(cudaMemcpyAsync(c.d, c.h_pin, 64, cudaMemcpyHostToDevice, c.s));
  } else if (kind == CHAIN_LAUNCHES) {
    for (int k = 0; k < CHAIN; k++)
      launch(c.s, c.d, v + k);
  } else if (kind == GRAPH_SET) {
    graph_set(c, v);
  } else {
    graph_capture(c, v);
  }
}

/* The mean µs of one call of kind with touch bytes written between two calls. */
static double time_calls(const ctx_t &c, int kind, size_t touch) {
  double total = 0.0;
  for (int i = 0; i < WARM + CALLS; i++) {
    for (size_t j = 0; j < touch; j += 64)
      c.junk[j] = (uint8_t)(c.junk[j] + 1);
    const double t0 = now_us();
    call(c, kind, i);
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
  CHECK(cudaStreamCreateWithFlags(&c.s_cap, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&c.ev, cudaEventDisableTiming));
  CHECK(cudaMalloc(&c.d, 64));
  CHECK(cudaMallocHost(&c.h_pin, 64));
  uint8_t *junk = static_cast<uint8_t *>(calloc(TOUCH_MAX, 1));
  if (!junk) {
    fprintf(stderr, "cuda_launch_bench: out of memory\n");
    return 1;
  }
  c.junk = junk;
  make_graph(c);
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
  CHECK(cudaGraphExecDestroy(c.exec));
  CHECK(cudaGraphDestroy(c.graph));
  CHECK(cudaStreamDestroy(c.s_cap));
  CHECK(cudaFreeHost(c.h_pin));
  CHECK(cudaFree(c.d));
  CHECK(cudaEventDestroy(c.ev));
  CHECK(cudaStreamDestroy(c.s));
  return 0;
}
