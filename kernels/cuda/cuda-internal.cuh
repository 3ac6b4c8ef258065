#ifndef DSV4_KERNELS_CUDA_CUDA_INTERNAL_CUH
#define DSV4_KERNELS_CUDA_CUDA_INTERNAL_CUH

/*
 * Pieces shared by the kernel files of kernels/cuda: the programmatic-dependent-launch primitives,
 * the launch helper and the per-device facts the launches are sized by. CUDA C++ only.
 */

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <atomic>

#include "cuda-kernels.h"
#include "dsv4-numerics.h"

/*
 * griddepcontrol (PTX ISA 7.8, sm_90+). wait: block until every grid this one depends on has
 * completed and its memory operations are visible; a no-op when the launch had no programmatic
 * dependency. launch_dependents: allow the next kernel on the stream to start its prologue once
 * every block of this grid has issued it or exited. sm_80 has neither: there the launch order
 * itself is the dependency.
 */
static __device__ __forceinline__ void dsv4__dep_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/*
 * dsv4__dep_wait, issued only once every 32-bit word of the kernel's parameter block p has been
 * read into a register. Kernel parameters are immutable (SPEC §5.2 allows reading them before the
 * wait), and they live in the constant bank, whose cache misses each cost about an L2 round trip:
 * read after the wait, a parameter line missing from the cache lies on the critical path of a
 * small launch; read here, the misses overlap the wait for the previous grid. Afterwards every
 * parameter read hits the constant cache. Below sm_90, where there is no wait, it does nothing.
 */
template <typename P> static __device__ __forceinline__ void dsv4__dep_wait_params(const P &p) {
  static_assert(sizeof(P) % 4 == 0, "parameter block of whole words");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t *w = reinterpret_cast<const uint32_t *>(&p);
  uint32_t x = 0;
#pragma unroll
  for (unsigned i = 0; i < sizeof(P) / 4; i++)
    x ^= w[i];
  asm volatile("griddepcontrol.wait;" ::"r"(x) : "memory");
#else
  (void)p; /* no wait to hide the reads behind */
#endif
}

/*
 * An L2 prefetch of the line holding p (sm_90+ only, where there is a dependency wait for it to
 * overlap). It returns nothing to the thread, so it may be issued before the wait for lines the
 * previous grid may still write (README, Decisions): the L2 is where every store on the device
 * lands, so the load after the wait sees the previous grid's bytes whether or not the line was
 * prefetched.
 */
static __device__ __forceinline__ void dsv4__prefetch_l2(const void *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

static __device__ __forceinline__ void dsv4__dep_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#if defined(DSV4_TEST_DELAY_PRODUCER) || defined(DSV4_TEST_DELAY_PARTS) ||                         \
    defined(DSV4_TEST_DELAY_CLUSTER)
/* Test-only (the ordering tests' delayed builds): the calling thread waits 200 µs of the global
 * timer, napping 1 µs between two looks at it, before the writes that follow. */
static __device__ __forceinline__ void dsv4__test_delay(void) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < 200000ull);
}
#endif

/* ---- asynchronous copies from global to shared memory (cp.async, sm_80+) ---- */

/* 16 bytes (both addresses 16-byte aligned), around the L1. */
static __device__ __forceinline__ void dsv4__cp_async16(void *smem, const void *gmem) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
      "l"(gmem)
      : "memory");
}

/* 8 or 4 bytes (both addresses aligned to their size). */
template <int N>
static __device__ __forceinline__ void dsv4__cp_async(void *smem, const void *gmem) {
  static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], %2;" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
      "l"(gmem), "n"(N)
      : "memory");
}

static __device__ __forceinline__ void dsv4__cp_async_commit(void) {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Until every copy the thread issued has landed (its own copies only: a barrier after it makes
 * them the CTA's). */
static __device__ __forceinline__ void dsv4__cp_async_wait_all(void) {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

/*
 * Two fp32 values to a packed pair of bf16 (lo in the low half), round to nearest even, in one
 * instruction (sm_80+). For every non-NaN input this is dsv4_f32_to_bf16 of each half
 * (tests/gpu/gpu_numerics_test checks all 2^32); a NaN becomes the canonical 0x7FFF instead of
 * keeping its payload, and the kernels never produce one: their inputs are finite bf16 (the daemon
 * refuses others) and every step from them stays finite.
 */
static __device__ __forceinline__ uint32_t dsv4__bf16x2_rn(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

/*
 * Two fp32 values to a packed pair of fp8 E4M3FN bytes (lo in the low byte), round to nearest even,
 * saturating to +-448: one instruction on sm_89+, dsv4_f32_to_e4m3 of each value below. For every
 * non-NaN input both are dsv4_f32_to_e4m3 (tests/gpu/gpu_numerics_test checks all 2^32); a NaN
 * becomes a NaN code without its sign, and the kernels never produce one (see dsv4__bf16x2_rn).
 */
static __device__ __forceinline__ uint32_t dsv4__e4m3x2_rn(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)dsv4_f32_to_e4m3(lo) | ((uint32_t)dsv4_f32_to_e4m3(hi) << 8);
#endif
}

/*
 * d += a b on the tensor cores (mma.sync m16n8k16, sm_80+) for a 16 x 16 bf16 tile a (row-major
 * fragments) and a 16 x 8 tile (b0, b1), fp32 accumulation. With g = lane / 4 and c = lane % 4:
 * a[0] holds a(g, 2c..2c+1), a[1] a(g+8, 2c..2c+1), a[2] a(g, 2c+8..2c+9), a[3] a(g+8, 2c+8..2c+9);
 * b0 holds b(2c..2c+1, g), b1 b(2c+8..2c+9, g); d[0], d[1] are d(g, 2c..2c+1), d[2], d[3]
 * d(g+8, 2c..2c+1); the lower index in the lower half of each register.
 */
static __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Facts of the current device, read once per device. */
typedef struct {
  int sms;
  int pdl; /* compute capability >= 9.0 */
} dsv4__cuda_dev_t;

/* 0 or a project error code. */
int dsv4__cuda_dev_info(dsv4__cuda_dev_t *out);

/* Launch kernel k on s with smem bytes of dynamic shared memory, with programmatic stream
 * serialization when pdl (grid: a count of CTAs, or a dim3). */
template <typename... Params, typename... Args>
static cudaError_t dsv4__cuda_launch_smem(void (*k)(Params...), dim3 grid, unsigned block,
                                          size_t smem, cudaStream_t s, int pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(block, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  if (pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  cudaError_t e = cudaLaunchKernelEx(&cfg, k, args...);
  /* A launch error is also the thread's "last error": clear it so it is reported once. */
  if (e != cudaSuccess)
    (void)cudaGetLastError();
  return e;
}

/* Raise kernel k's dynamic shared-memory limit to bytes on the current device, once per device
 * (the limit is an attribute of the kernel on each device): done holds a bit per device already
 * raised, one variable per kernel. Devices from 64 on are raised at every call. */
template <typename... Params>
static cudaError_t dsv4__cuda_smem_limit(void (*k)(Params...), size_t bytes,
                                         std::atomic<uint64_t> &done) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  const uint64_t bit = e == cudaSuccess && dev >= 0 && dev < 64 ? UINT64_C(1) << dev : 0;
  if (e == cudaSuccess && (done.load(std::memory_order_acquire) & bit))
    return cudaSuccess;
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  done.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

/* Launch kernel k on s, with programmatic stream serialization when pdl. */
template <typename... Params, typename... Args>
static cudaError_t dsv4__cuda_launch(void (*k)(Params...), unsigned grid, unsigned block,
                                     cudaStream_t s, int pdl, Args... args) {
  return dsv4__cuda_launch_smem(k, grid, block, 0, s, pdl, args...);
}

/* A segment's entry table in a launch's entry tables (SPEC §8.4): its first logical block, its
 * place and length in c_bt. Read once by a kernel that looks up many of the segment's blocks. */
typedef struct {
  int64_t first_lb;
  uint64_t off;
  uint32_t len;
} dsv4__seg_table_t;

/* Segment s's table. P: a kernel's parameter block with the fields seg_c_first_lb, seg_cbt_off
 * and seg_cbt_len. */
template <typename P>
static __device__ __forceinline__ dsv4__seg_table_t dsv4__seg_table(const P &p, uint32_t s) {
  dsv4__seg_table_t t;
  t.first_lb = p.seg_c_first_lb[s];
  t.off = p.seg_cbt_off[s];
  t.len = p.seg_cbt_len[s];
  return t;
}

/*
 * The physical block of logical entry block lb of the segment of table t, or -1 when lb is
 * outside the segment's table (or past c_bt_entries, when given), or the table names a negative
 * block or one outside the pool. P: a kernel's parameter block with the fields c_bt,
 * c_bt_entries and c_n_blocks.
 */
template <typename P>
static __device__ __forceinline__ int32_t dsv4__table_block(const P &p, const dsv4__seg_table_t &t,
                                                            int64_t lb) {
  const int64_t idx = lb - t.first_lb;
  if (idx < 0 || idx >= (int64_t)t.len)
    return -1;
  const uint64_t e = t.off + (uint64_t)idx;
  if (p.c_bt_entries && e >= p.c_bt_entries)
    return -1;
  const int32_t b = p.c_bt[e];
  return b >= 0 && (uint32_t)b < p.c_n_blocks ? b : -1;
}

/* dsv4__table_block of segment s (dsv4__seg_table's fields and those above). */
template <typename P>
static __device__ __forceinline__ int32_t dsv4__entry_block(const P &p, uint32_t s, int64_t lb) {
  return dsv4__table_block(p, dsv4__seg_table(p, s), lb);
}

/* Device ids whose answers per_device_cached keeps. */
#define DEV_CACHE 64

/* probe(dev)'s answer (0 or more) for the current device, asked once per device id below
 * DEV_CACHE (cache: 0 = not asked yet, else the answer + 1; racing askers store the same); 0 when
 * there is no current device. */
static inline int per_device_cached(std::atomic<int> (&cache)[DEV_CACHE], int (*probe)(int dev)) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (dev >= 0 && dev < DEV_CACHE) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v)
      return v - 1;
  }
  const int answer = probe(dev);
  if (!answer) /* a probe's failed call is its answer, not the thread's error */
    (void)cudaGetLastError();
  if (dev >= 0 && dev < DEV_CACHE)
    cache[dev].store(answer + 1, std::memory_order_relaxed);
  return answer;
}

/* Whether device dev grants a CTA bytes of shared memory. */
static inline int smem_grants(int dev, size_t bytes) {
  int optin = 0;
  return cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) ==
             cudaSuccess &&
         (size_t)optin >= bytes;
}

#endif /* DSV4_KERNELS_CUDA_CUDA_INTERNAL_CUH */
