/*
 * dsv4_expf and dsv4_logf (kernels/dsv4-numerics.h, SPEC §7) over all 2^32 fp32 inputs:
 *
 * - the XXH3-64 of their output bit patterns equals the frozen constants of
 *   tests/support/numerics_digests.h, so any change of either routine (or a compiler that rounds
 *   one of its operations differently) fails here and in the CUDA test of the same digests;
 * - their error against libm's double-precision exp and log: the distance in ulps between each
 *   output and the double result rounded to fp32 is at most 1 for every input, the largest real
 *   error (|y - ref| over the ulp of ref's binade) is printed and bounded below one ulp (faithful),
 *   and NaN, the infinities, zero and the subnormals land where IEEE 754 puts them.
 *
 * Two participants (the calling thread and one worker) compute blocks of 2^22 outputs, half each,
 * while the caller hashes the previous block in input order. Under AddressSanitizer the error
 * check visits every 61st input (a prime, as tests/unit/numerics_test.c does) and the digest still
 * covers every input; DSV4_NUMERICS_STRIDE=k sets the check's stride in any build (1: every input).
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <xxhash.h>

#include "dsv4-numerics.h"
#include "numerics_digests.h"

#define BLOCK_BITS 22
#define BLOCK (UINT64_C(1) << BLOCK_BITS)
#define N_BLOCKS (UINT64_C(1) << (32 - BLOCK_BITS))

enum { FN_EXP = 0, FN_LOG = 1 };

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* The error of one participant's share of the inputs. */
typedef struct {
  uint64_t checked;
  uint64_t max_dist; /* the largest distance in ulps from the rounded libm result */
  uint32_t max_dist_at;
  double max_err; /* the largest real error in ulps of the exact result's binade */
  uint32_t max_err_at;
  uint64_t dist_gt1;    /* inputs more than one ulp from the rounded libm result */
  uint64_t special_bad; /* NaN, infinity or sign where IEEE 754 puts another */
  uint32_t special_bad_at;
} stats_t;

/* Floats as integers in the order of their values (-0 and +0 adjacent, one apart). */
static int64_t ordered(float f) {
  int32_t i = (int32_t)f2u(f);
  return i < 0 ? (int64_t)INT32_MIN - i : i;
}

/* 1 / (the ulp of fp32 numbers in the binade of |v|), 2^149 below the normal range; made from
 * exponent bits, since this runs 2^32 times per routine. */
static double inv_ulp_of(double v) {
  uint64_t b;
  memcpy(&b, &v, 8);
  int e = (int)((b >> 52) & 0x7ff) - 1023;
  if (e < -126)
    e = -126;
  uint64_t r = (uint64_t)(1023 + 23 - e) << 52;
  double d;
  memcpy(&d, &r, 8);
  return d;
}

static void check_one(stats_t *st, uint32_t u, float y, double ref) {
  float rf = (float)ref;
  st->checked++;
  if (isnan(rf) || isnan(y) || isinf(rf) || isinf(y)) {
    if (isnan(rf) != isnan(y) || (!isnan(rf) && rf != y)) {
      if (st->special_bad++ == 0)
        st->special_bad_at = u;
    }
    return;
  }
  /* A result rounded to zero keeps the sign of the exact one (ln x < 0 below 1, e^x > 0). */
  if (y == 0.0f && signbit(y) != signbit(ref)) {
    if (st->special_bad++ == 0)
      st->special_bad_at = u;
  }
  int64_t d = ordered(y) - ordered(rf);
  uint64_t dist = (uint64_t)(d < 0 ? -d : d);
  if (dist > st->max_dist) {
    st->max_dist = dist;
    st->max_dist_at = u;
  }
  if (dist > 1)
    st->dist_gt1++;
  double err = fabs((double)y - ref) * inv_ulp_of(ref);
  if (err > st->max_err) {
    st->max_err = err;
    st->max_err_at = u;
  }
}

/*
 * The scalar routines are cloned for x86-64-v3 where the compiler can do so (as the CPU backend's
 * scalar kernels are), so that fmaf is one instruction rather than a libm call: the same bits,
 * several times faster (flatten: the routines are inlined into each clone, not called in their
 * default build). Not in sanitizer builds, whose ifunc resolvers run too early.
 */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones) && !defined(__SANITIZE_ADDRESS__) &&                            \
    !defined(__SANITIZE_THREAD__)
#define SWEEP_CLONES __attribute__((flatten, target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#ifndef SWEEP_CLONES
#define SWEEP_CLONES
#endif

/*
 * The reference: libm's double exp or log wherever the result is finite and non-zero, and the
 * IEEE 754 result itself where it is known exactly (e^x overflows above 89 and rounds to +0 below
 * -104, the log of a negative number is NaN), which is also where libm is slowest (errno paths).
 */
static double reference(int fn, float x) {
  if (fn == FN_EXP) {
    if (x > 89.0f)
      return INFINITY;
    if (x < -104.0f)
      return 0.0;
    return exp((double)x);
  }
  if (x < 0.0f)
    return NAN;
  return log((double)x);
}

/* Outputs of inputs first..first+n-1 into out; every stride-th input checked against libm. */
SWEEP_CLONES static void eval_range(int fn, uint64_t first, uint64_t n, uint32_t *out,
                                    uint64_t stride, stats_t *st) {
  for (uint64_t i = 0; i < n; i++) {
    uint32_t u = (uint32_t)(first + i);
    float x = u2f(u);
    float y = fn == FN_EXP ? dsv4_expf(x) : dsv4_logf(x);
    out[i] = f2u(y);
    if (stride == 1 || u % stride == 0)
      check_one(st, u, y, reference(fn, x));
  }
}

typedef struct {
  int fn;
  uint64_t stride;
  uint32_t *buf[2];
  pthread_barrier_t barrier;
  stats_t st[2];
} sweep_t;

typedef struct {
  sweep_t *s;
  unsigned who; /* 0: the caller, which also hashes; 1: the worker */
  XXH3_state_t *xs;
} part_t;

/*
 * Block b goes to buffer b % 2, each participant computing one half. After the barrier that ends
 * block b the caller hashes it while the worker already computes block b + 1 into the other
 * buffer; the next barrier comes after that hash, so no buffer is rewritten while it is hashed.
 */
static void *sweep_part(void *arg) {
  part_t *p = arg;
  sweep_t *s = p->s;
  for (uint64_t b = 0; b < N_BLOCKS; b++) {
    uint32_t *buf = s->buf[b & 1];
    uint64_t half = BLOCK / 2, off = p->who * half;
    eval_range(s->fn, b * BLOCK + off, half, buf + off, s->stride, &s->st[p->who]);
    pthread_barrier_wait(&s->barrier);
    if (p->who == 0)
      XXH3_64bits_update(p->xs, buf, BLOCK * sizeof(uint32_t));
  }
  return NULL;
}

#if defined(__SANITIZE_ADDRESS__)
#define DEFAULT_STRIDE 61
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DEFAULT_STRIDE 61
#endif
#endif
#ifndef DEFAULT_STRIDE
#define DEFAULT_STRIDE 1
#endif

static uint64_t check_stride(void) {
  const char *e = getenv("DSV4_NUMERICS_STRIDE");
  uint64_t k = e ? strtoull(e, NULL, 10) : DEFAULT_STRIDE;
  return k ? k : 1;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sweep(int fn, const char *name, uint64_t frozen) {
  sweep_t s;
  memset(&s, 0, sizeof(s));
  s.fn = fn;
  s.stride = check_stride();
  for (int k = 0; k < 2; k++) {
    s.buf[k] = malloc(BLOCK * sizeof(uint32_t));
    assert_non_null(s.buf[k]);
  }
  assert_int_equal(pthread_barrier_init(&s.barrier, NULL, 2), 0);
  XXH3_state_t *xs = XXH3_createState();
  assert_non_null(xs);
  assert_int_equal(XXH3_64bits_reset(xs), XXH_OK);
  part_t parts[2] = {{&s, 0, xs}, {&s, 1, NULL}};
  double t0 = now_s();
  pthread_t tid;
  assert_int_equal(pthread_create(&tid, NULL, sweep_part, &parts[1]), 0);
  sweep_part(&parts[0]);
  assert_int_equal(pthread_join(tid, NULL), 0);
  uint64_t digest = XXH3_64bits_digest(xs);
  double secs = now_s() - t0;
  XXH3_freeState(xs);
  pthread_barrier_destroy(&s.barrier);
  free(s.buf[0]);
  free(s.buf[1]);

  stats_t t = s.st[0];
  const stats_t *o = &s.st[1];
  t.checked += o->checked;
  t.dist_gt1 += o->dist_gt1;
  if (o->max_dist > t.max_dist) {
    t.max_dist = o->max_dist;
    t.max_dist_at = o->max_dist_at;
  }
  if (o->max_err > t.max_err) {
    t.max_err = o->max_err;
    t.max_err_at = o->max_err_at;
  }
  if (o->special_bad && !t.special_bad)
    t.special_bad_at = o->special_bad_at;
  t.special_bad += o->special_bad;

  printf("%s: digest %016llx (frozen %016llx), %.1f s\n", name, (unsigned long long)digest,
         (unsigned long long)frozen, secs);
  printf("%s: %llu inputs checked against libm: max error %.4f ulp (input 0x%08x), max distance "
         "%llu ulp from the rounded double result (input 0x%08x), %llu inputs beyond 1 ulp, %llu "
         "special values wrong%s\n",
         name, (unsigned long long)t.checked, t.max_err, (unsigned)t.max_err_at,
         (unsigned long long)t.max_dist, (unsigned)t.max_dist_at, (unsigned long long)t.dist_gt1,
         (unsigned long long)t.special_bad, s.stride > 1 ? " (strided)" : "");
  if (t.special_bad)
    printf("%s: first wrong special value at input 0x%08x\n", name, (unsigned)t.special_bad_at);
  fflush(stdout);
  assert_int_equal(t.special_bad, 0);
  assert_true(t.max_dist <= 1);
  assert_true(t.max_err < 1.0);
  if (s.stride == 1)
    assert_true(t.checked == UINT64_C(1) << 32);
  assert_true(digest == frozen);
}

static void test_expf_all_inputs(void **state) {
  (void)state;
  sweep(FN_EXP, "dsv4_expf", DSV4_EXPF_DIGEST);
}

static void test_logf_all_inputs(void **state) {
  (void)state;
  sweep(FN_LOG, "dsv4_logf", DSV4_LOGF_DIGEST);
}

/* Values the attention step relies on, and the edges of both domains, bit for bit. */
static void test_vectors(void **state) {
  (void)state;
  /* exp(0) is exactly 1: the largest logit of a head always weighs exactly 1. */
  assert_int_equal(f2u(dsv4_expf(0.0f)), 0x3f800000u);
  assert_int_equal(f2u(dsv4_expf(-0.0f)), 0x3f800000u);
  assert_int_equal(f2u(dsv4_expf(-INFINITY)), 0x00000000u);
  assert_int_equal(f2u(dsv4_expf(INFINITY)), 0x7f800000u);
  assert_int_equal(f2u(dsv4_expf(u2f(0x7fa00001u))), 0x7fe00001u); /* quieted, payload kept */
  assert_int_equal(f2u(dsv4_expf(u2f(0xffc00000u))), 0xffc00000u);
  /* Overflow exactly where the correctly rounded result becomes infinite. */
  assert_int_equal(f2u(dsv4_expf(u2f(0x42b17217u))), 0x7f7fff84u);
  assert_int_equal(f2u(dsv4_expf(u2f(0x42b17218u))), 0x7f800000u);
  assert_int_equal(f2u(dsv4_expf(88.8f)), 0x7f800000u);
  /* Subnormal results are honoured down to the smallest one (SPEC §2). */
  assert_int_equal(f2u(dsv4_expf(-103.9f)), 0x00000001u);
  assert_int_equal(f2u(dsv4_expf(-104.0f)), 0x00000000u);
  float sub = dsv4_expf(-100.0f);
  assert_true(sub > 0.0f && f2u(sub) < 0x00800000u);
  assert_true(fabs((double)sub - exp(-100.0)) <= 0x1p-149);

  assert_int_equal(f2u(dsv4_logf(1.0f)), 0x00000000u);
  assert_int_equal(f2u(dsv4_logf(0.0f)), 0xff800000u);
  assert_int_equal(f2u(dsv4_logf(-0.0f)), 0xff800000u);
  assert_int_equal(f2u(dsv4_logf(INFINITY)), 0x7f800000u);
  assert_int_equal(f2u(dsv4_logf(-1.0f)), 0x7fc00000u);
  assert_int_equal(f2u(dsv4_logf(-INFINITY)), 0x7fc00000u);
  assert_int_equal(f2u(dsv4_logf(u2f(0xff800001u))), 0xffc00001u);
  /* ln 2^-149 and ln FLT_MAX, from subnormal and largest inputs. */
  assert_true(fabs((double)dsv4_logf(u2f(1u)) - log(0x1p-149)) <= 0x1p-17);
  assert_true(fabs((double)dsv4_logf(u2f(0x7f7fffffu)) - log((double)u2f(0x7f7fffffu))) <= 0x1p-17);
  /* Sums of exact weights: ln 2 and ln 128 (a full window of equal scores). */
  assert_int_equal(f2u(dsv4_logf(2.0f)), f2u((float)log(2.0)));
  assert_int_equal(f2u(dsv4_logf(128.0f)), f2u((float)log(128.0)));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_vectors),
      cmocka_unit_test(test_expf_all_inputs),
      cmocka_unit_test(test_logf_all_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
