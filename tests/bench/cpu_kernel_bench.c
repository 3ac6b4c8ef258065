/*
 * CPU kernel benchmark: qkv_insert (SPEC §2.1-2.2 plus the paged insert) for a range of batch
 * sizes, against memcpy of the same number of bytes measured in the same run.
 *
 * Minimal bytes per call: q read + q_out written (2 * N * H * 1024), kv read (N * 1024), 584 cache
 * bytes per token written, positions and slots read (16 per token). The memcpy ceiling copies half
 * that many bytes, so it too reads and writes the minimal byte count, split over the same number of
 * threads as the row (on the backend's own worker pool, in 64 KiB pieces).
 *
 * Before timing, every kernel level is run once on batches of up to 64 tokens and must give the
 * same bytes as the scalar level; the scalar level is timed only up to 64 tokens (it is the
 * portable fallback). Rows: avx512, avx2 (AVX2 + FMA, the level of machines without AVX-512),
 * scalar, each where this machine can run it.
 *
 * Usage: cpu_kernel_bench [heads] [max_tokens] [stream_mib]
 * (stream_mib: q_out size from which stores bypass the caches; the backend's default if absent)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "cpu/cpu-internal.h"
#include "dsv4-numerics.h"
#include "rope.h"

#define BS 64

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x243F6A8885A308D3ull;

static uint16_t rnd_bf16(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  /* Magnitudes between 2^-8 and 2^8, either sign. */
  return (uint16_t)((rng & 0x8000u) | ((uint32_t)(119 + (rng >> 20) % 16) << 7) |
                    ((rng >> 8) & 127));
}

/* Page-aligned, as the daemon's buffers from buf_alloc are. */
static void *xmalloc(size_t n) {
  void *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

/* Seconds per call: the best of five trials, each long enough to time (at least 50 ms). */
typedef void (*call_fn)(void *arg);

static double time_call(call_fn fn, void *arg) {
  fn(arg); /* warm up: touches every page once */
  int reps = 1;
  for (;;) {
    double t0 = now_s();
    for (int r = 0; r < reps; r++)
      fn(arg);
    double dt = now_s() - t0;
    if (dt > 0.05 || reps >= (1 << 20))
      break;
    reps *= 2;
  }
  double best = 1e30;
  for (int trial = 0; trial < 5; trial++) {
    double t0 = now_s();
    for (int r = 0; r < reps; r++)
      fn(arg);
    double dt = (now_s() - t0) / reps;
    if (dt < best)
      best = dt;
  }
  return best;
}

typedef struct {
  dsv4_backend_t *be;
  dsv4_insert_args_t a;
} insert_call_t;

static void do_insert(void *varg) {
  insert_call_t *c = varg;
  if (c->be->ops->qkv_insert(c->be, &c->a) != 0) {
    fprintf(stderr, "qkv_insert failed\n");
    exit(1);
  }
}

#define COPY_PIECE (64u << 10)

typedef struct {
  void *dst;
  const void *src;
  size_t n;
  dsv4_host_pool_t *pool;
} copy_call_t;

static void copy_pieces(void *varg, size_t first, size_t last) {
  copy_call_t *c = varg;
  size_t lo = first * COPY_PIECE, hi = last * COPY_PIECE;
  if (hi > c->n)
    hi = c->n;
  memcpy((char *)c->dst + lo, (const char *)c->src + lo, hi - lo);
  /* Keep the copy from being optimised away. */
  __asm__ volatile("" : : "r"(c->dst) : "memory");
}

static void do_copy(void *varg) {
  copy_call_t *c = varg;
  size_t pieces = (c->n + COPY_PIECE - 1) / COPY_PIECE;
  unsigned t = dsv4_host_pool_threads(c->pool);
  /* Contiguous shares (one per thread) keep each memcpy long, as a single-thread copy is. */
  dsv4_host_pool_run(c->pool, copy_pieces, c, pieces, (pieces + t - 1) / t);
}

int main(int argc, char **argv) {
  uint32_t heads = argc > 1 ? (uint32_t)atoi(argv[1]) : 64;
  uint32_t max_n = argc > 2 ? (uint32_t)atoi(argv[2]) : 4096;
  long stream_mib = argc > 3 ? atol(argv[3]) : -1;
  static const uint32_t ns[] = {1, 16, 64, 256, 1024, 4096};
  static const uint32_t threads[] = {1, 2};
  static const int isas[] = {DSV4__CPU_ISA_AVX512, DSV4__CPU_ISA_AVX2, DSV4__CPU_ISA_SCALAR};
  /* The order of the equality check: the scalar reference first. */
  static const int check_isas[] = {DSV4__CPU_ISA_SCALAR, DSV4__CPU_ISA_AVX2, DSV4__CPU_ISA_AVX512};

  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv);
  dsv4_rope_table_t *rope;
  if (dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &rope) ||
      dsv4_rope_table_ensure_range(rope, 0, max_n)) {
    fprintf(stderr, "rope table failed\n");
    return 1;
  }
  printf("qkv_insert, H = %u, bs = %u, prenormed kv, every token written\n", heads, BS);
  printf("%6s %4s %7s %8s %12s %10s %10s %8s\n", "N", "H", "threads", "isa", "us/call", "GB/s",
         "memcpy", "%memcpy");
  for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
    uint32_t n = ns[ni];
    if (n > max_n)
      break;
    size_t qbytes = (size_t)n * heads * DSV4_HEAD_DIM * 2;
    uint16_t *q = xmalloc(qbytes), *q_out = xmalloc(qbytes);
    uint16_t *kv = xmalloc((size_t)n * DSV4_HEAD_DIM * 2);
    int64_t *pos = xmalloc(n * sizeof(int64_t)), *slots = xmalloc(n * sizeof(int64_t));
    for (size_t i = 0; i < qbytes / 2; i++)
      q[i] = rnd_bf16();
    for (size_t i = 0; i < (size_t)n * DSV4_HEAD_DIM; i++)
      kv[i] = rnd_bf16();
    for (uint32_t t = 0; t < n; t++) {
      pos[t] = t;
      slots[t] = t;
    }
    uint32_t n_blocks = (n + BS - 1) / BS;
    size_t cache_bytes = (size_t)n_blocks * DSV4_BLOCK_STRIDE(BS);
    uint8_t *cache = calloc(1, cache_bytes);
    double bytes = 2.0 * (double)qbytes + (double)n * (DSV4_HEAD_DIM * 2 + DSV4_RECORD_BYTES + 16);
    size_t half = (size_t)(bytes / 2);
    copy_call_t cp = {xmalloc(half), xmalloc(half), half, NULL};
    memset(cp.dst, 1, half);
    memset((void *)cp.src, 2, half);
    if (n <= 64) {
      /* Every level must produce the same bytes before any of them is timed. */
      uint16_t *ref_q = xmalloc(qbytes);
      uint8_t *ref_c = calloc(1, cache_bytes);
      dsv4_backend_options_t opt1 = {.threads = 2};
      dsv4_backend_t *be1;
      char why1[128];
      if (!ref_c || dsv4_backend_open("cpu", &opt1, &be1, why1, sizeof(why1)))
        return 1;
      for (size_t ii = 0; ii < sizeof(check_isas) / sizeof(check_isas[0]); ii++) {
        if (dsv4__cpu_backend_set_isa(be1, check_isas[ii]) != 0)
          continue;
        memset(q_out, 0, qbytes);
        memset(cache, 0, cache_bytes);
        dsv4_insert_args_t a = {.n_tokens = n,
                                .heads = heads,
                                .q = q,
                                .kv = kv,
                                .positions = pos,
                                .slots = slots,
                                .rope = rope,
                                .eps = dsv4_u2f(DSV4_RMS_EPS_BITS),
                                .write_kv = 1,
                                .q_out = ii == 0 ? ref_q : q_out,
                                .cache = ii == 0 ? ref_c : cache,
                                .block_size = BS,
                                .n_blocks = n_blocks,
                                .stride = DSV4_BLOCK_STRIDE(BS)};
        if (be1->ops->qkv_insert(be1, &a) != 0)
          return 1;
        if (ii > 0 && (memcmp(ref_q, q_out, qbytes) || memcmp(ref_c, cache, cache_bytes))) {
          fprintf(stderr, "N = %u: the %s and %s kernels disagree\n", n,
                  dsv4__cpu_isa_name(check_isas[0]), dsv4__cpu_isa_name(check_isas[ii]));
          return 1;
        }
      }
      dsv4_backend_close(be1);
      free(ref_q);
      free(ref_c);
    }
    for (size_t ti = 0; ti < sizeof(threads) / sizeof(threads[0]); ti++) {
      dsv4_backend_options_t opt = {.threads = threads[ti]};
      dsv4_backend_t *be;
      char why[128];
      if (dsv4_backend_open("cpu", &opt, &be, why, sizeof(why))) {
        fprintf(stderr, "%s\n", why);
        return 1;
      }
      if (dsv4_host_pool_create(threads[ti], &cp.pool))
        return 1;
      double copy_gbs = bytes / time_call(do_copy, &cp) * 1e-9;
      dsv4_host_pool_destroy(cp.pool);
      if (stream_mib >= 0)
        dsv4__cpu_backend_set_stream_bytes(be, (uint64_t)stream_mib << 20);
      for (size_t ii = 0; ii < sizeof(isas) / sizeof(isas[0]); ii++) {
        if (dsv4__cpu_backend_set_isa(be, isas[ii]) != 0 ||
            (isas[ii] == DSV4__CPU_ISA_SCALAR && n > 64))
          continue;
        insert_call_t c = {.be = be,
                           .a = {.n_tokens = n,
                                 .heads = heads,
                                 .q = q,
                                 .kv = kv,
                                 .positions = pos,
                                 .slots = slots,
                                 .rope = rope,
                                 .eps = dsv4_u2f(DSV4_RMS_EPS_BITS),
                                 .write_kv = 1,
                                 .q_out = q_out,
                                 .cache = cache,
                                 .block_size = BS,
                                 .n_blocks = n_blocks,
                                 .stride = DSV4_BLOCK_STRIDE(BS)}};
        double t = time_call(do_insert, &c);
        double gbs = bytes / t * 1e-9;
        printf("%6u %4u %7u %8s %12.2f %10.2f %10.2f %7.1f%%\n", n, heads, threads[ti],
               dsv4__cpu_isa_name(isas[ii]), t * 1e6, gbs, copy_gbs, 100.0 * gbs / copy_gbs);
        fflush(stdout);
      }
      dsv4_backend_close(be);
    }
    free(cp.dst);
    free((void *)cp.src);
    free(q);
    free(q_out);
    free(kv);
    free(pos);
    free(slots);
    free(cache);
  }
  dsv4_rope_table_destroy(rope);
  return 0;
}
