#ifndef DSV4_KERNELS_CUDA_PHASE_PROBE_CUH
#define DSV4_KERNELS_CUDA_PHASE_PROBE_CUH
/*
 * Where a CTA's time goes, for the benchmarks (CMake option DSV4_CUDA_PHASES, which defines
 * DSV4_PHASE_PROBE for the CUDA backend; off in every other build, where these are no-ops).
 * Thread 0 of each CTA reads the SM's cycle counter at the kernel's start and at each mark (placed
 * after a barrier, so it is the CTA's progress, not one warp's) and adds the cycles since the last
 * one to the phase's total, summed over every CTA of every launch of the translation unit (a phase
 * marked once a tile sums its tiles); the last slot counts the CTAs that reached PHASE_END. A
 * kernel file that uses them defines a function that reads and resets the totals (cuda-kernels.h).
 */
#define DSV4_PHASE_SLOTS 8

#ifdef DSV4_PHASE_PROBE
static __device__ unsigned long long dsv4__phase_cycles[DSV4_PHASE_SLOTS];
/* The last stamp, thread 0's (so that a mark may sit in any function the kernel calls). */
static __shared__ unsigned long long dsv4__phase_last;

#define PHASE_START()                                                                              \
  do {                                                                                             \
    if (threadIdx.x == 0)                                                                          \
      dsv4__phase_last = clock64();                                                                \
  } while (0)
#define PHASE_MARK(k)                                                                              \
  do {                                                                                             \
    if (threadIdx.x == 0) {                                                                        \
      const unsigned long long c_ = clock64();                                                     \
      atomicAdd(&dsv4__phase_cycles[(k)], c_ - dsv4__phase_last);                                  \
      dsv4__phase_last = c_;                                                                       \
    }                                                                                              \
  } while (0)
/* The last phase k ends when every warp is done; the CTA is counted. */
#define PHASE_END(k)                                                                               \
  do {                                                                                             \
    __syncthreads();                                                                               \
    PHASE_MARK(k);                                                                                 \
    if (threadIdx.x == 0)                                                                          \
      atomicAdd(&dsv4__phase_cycles[DSV4_PHASE_SLOTS - 1], 1ull);                                  \
  } while (0)

/* The totals divided by the CTAs counted into out[0..DSV4_PHASE_SLOTS - 2], then reset; returns
 * the CTAs counted, or -1 when the totals cannot be read. */
static inline long long dsv4__phase_take(double *out) {
  unsigned long long h[DSV4_PHASE_SLOTS] = {0};
  if (cudaMemcpyFromSymbol(h, dsv4__phase_cycles, sizeof(h)) != cudaSuccess)
    return -1;
  for (int i = 0; i < DSV4_PHASE_SLOTS - 1; i++)
    out[i] = h[DSV4_PHASE_SLOTS - 1] ? (double)h[i] / (double)h[DSV4_PHASE_SLOTS - 1] : 0.0;
  const unsigned long long zero[DSV4_PHASE_SLOTS] = {0};
  if (cudaMemcpyToSymbol(dsv4__phase_cycles, zero, sizeof(zero)) != cudaSuccess)
    return -1;
  return (long long)h[DSV4_PHASE_SLOTS - 1];
}

/* dsv4__phase_take's totals of this translation unit and of another's (`other`, its own take, as
 * a warpgroup-MMA form's in its sm_90a unit) as one: each CTA counted once. */
static inline long long dsv4__phase_take_with(double *out, long long (*other)(double *)) {
  double o[DSV4_PHASE_SLOTS - 1];
  const long long n = dsv4__phase_take(out), no = other(o);
  if (n < 0 || no <= 0) /* unreadable, or no CTA of the other unit's kernels */
    return n;
  for (int i = 0; i < DSV4_PHASE_SLOTS - 1; i++)
    out[i] = (out[i] * (double)n + o[i] * (double)no) / (double)(n + no);
  return n + no;
}
#else
#define PHASE_START() ((void)0)
#define PHASE_MARK(k) ((void)0)
#define PHASE_END(k) ((void)0)
#endif

#endif /* DSV4_KERNELS_CUDA_PHASE_PROBE_CUH */
