#ifndef DSV4_TESTS_BENCH_CPU_BENCH_COMMON_H
#define DSV4_TESTS_BENCH_CPU_BENCH_COMMON_H

/*
 * What the CPU kernel benchmarks share: a monotonic clock, page-aligned allocations that exit on
 * failure, and each level's fused multiply-add peak measured in the run (x86-64: the loops are
 * written with AVX-512 and AVX2 intrinsics). Include after cpu/cpu-internal.h (DSV4__CPU_ISA_*).
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *xmalloc(size_t n) {
  void *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

/* ---- the fused multiply-add peak ---- */

#define PEAK_ITERS 20000000L
#define PEAK_CHAINS 12

__attribute__((target("avx512f"))) static void fma_loop_avx512(float *sink) {
  __m512 a[PEAK_CHAINS];
  const __m512 b = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < PEAK_CHAINS; i++)
    a[i] = _mm512_set1_ps((float)i);
  for (long it = 0; it < PEAK_ITERS; it++)
#pragma GCC unroll 12
    for (int i = 0; i < PEAK_CHAINS; i++)
      a[i] = _mm512_fmadd_ps(a[i], b, c);
  for (int i = 1; i < PEAK_CHAINS; i++)
    a[0] = _mm512_add_ps(a[0], a[i]);
  *sink = _mm512_reduce_add_ps(a[0]);
}

__attribute__((target("avx2,fma"))) static void fma_loop_avx2(float *sink) {
  __m256 a[PEAK_CHAINS];
  const __m256 b = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < PEAK_CHAINS; i++)
    a[i] = _mm256_set1_ps((float)i);
  for (long it = 0; it < PEAK_ITERS; it++)
#pragma GCC unroll 12
    for (int i = 0; i < PEAK_CHAINS; i++)
      a[i] = _mm256_fmadd_ps(a[i], b, c);
  float v[8];
  for (int i = 1; i < PEAK_CHAINS; i++)
    a[0] = _mm256_add_ps(a[0], a[i]);
  _mm256_storeu_ps(v, a[0]);
  *sink = v[0] + v[7];
}

/* Lanes of each level's fused multiply-add (the scalar level's is one fmaf, one instruction where
 * the machine has FMA). */
static const int LANES[DSV4__CPU_ISA_COUNT] = {1, 8, 16};

__attribute__((target("fma"))) static void fma_loop_scalar(float *sink) {
  float a[PEAK_CHAINS];
  for (int i = 0; i < PEAK_CHAINS; i++)
    a[i] = (float)i;
  for (long it = 0; it < PEAK_ITERS; it++)
#pragma GCC unroll 12
    for (int i = 0; i < PEAK_CHAINS; i++)
      a[i] = __builtin_fmaf(a[i], 0.9999999f, 1e-7f);
  *sink = a[0] + a[PEAK_CHAINS - 1];
}

typedef struct {
  int isa;
  float sink;
} peak_job_t;

static void *peak_thread(void *arg) {
  peak_job_t *j = arg;
  if (j->isa == DSV4__CPU_ISA_AVX512)
    fma_loop_avx512(&j->sink);
  else if (j->isa == DSV4__CPU_ISA_AVX2)
    fma_loop_avx2(&j->sink);
  else
    fma_loop_scalar(&j->sink);
  return NULL;
}

/* GFLOP/s of the loop on `threads` threads at once (the best of three runs). */
static double fma_peak(int isa, unsigned threads) {
  double best = 0.0;
  for (int trial = 0; trial < 3; trial++) {
    pthread_t tid[256];
    peak_job_t jobs[256];
    double t0 = now_s();
    for (unsigned t = 0; t < threads; t++) {
      jobs[t].isa = isa;
      if (pthread_create(&tid[t], NULL, peak_thread, &jobs[t]) != 0)
        exit(1);
    }
    for (unsigned t = 0; t < threads; t++)
      pthread_join(tid[t], NULL);
    double dt = now_s() - t0;
    double gf = 2.0 * LANES[isa] * PEAK_CHAINS * (double)PEAK_ITERS * threads / dt * 1e-9;
    if (gf > best)
      best = gf;
  }
  return best;
}

#endif /* DSV4_TESTS_BENCH_CPU_BENCH_COMMON_H */
