/*
 * Unit tests of kernels/dsv4-numerics.h (SPEC §2): the bf16 and fp8 E4M3FN codecs, the UE8M0 scale
 * rule, the canonical 512-long reductions, and the floating-point environment the daemon relies on
 * (no contraction, subnormals honoured). Every check compares the header against an independent
 * model written here from the SPEC text: values and midpoints rather than the header's bit tricks.
 *
 * The exhaustive sweeps cover all 2^32 fp32 bit patterns (and every fp32 UE8M0 input), split over
 * two threads. Under AddressSanitizer they take minutes and the sanitizer adds nothing to them: the
 * sweep is pure arithmetic whose every result the normal build already checks. So an ASan build
 * visits every 61st pattern (a prime, so every residue of the low bits is met) plus every pattern
 * within 2^16 of each exponent boundary, where the rounding carries and saturation live.
 * DSV4_NUMERICS_STRIDE=k overrides the stride in any build (1: everything).
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

#include <cmocka.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "dsv4-numerics.h"

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

/* ---- independent models ---- */

/* E4M3FN decoding from the format's definition: bias 7, 3 mantissa bits, no infinities. */
static double e4m3_value(unsigned b) {
  unsigned e = (b >> 3) & 15u, m = b & 7u;
  double sign = (b & 0x80u) ? -1.0 : 1.0;
  if (e == 15u && m == 7u)
    return NAN;
  if (e == 0u)
    return sign * ldexp((double)m, -9); /* subnormal: m/8 * 2^-6 */
  return sign * ldexp(8.0 + (double)m, (int)e - 7 - 3);
}

/* Midpoints below and above each of the 127 finite non-negative grid points, exact in fp32. */
static float grid_lo_mid[127], grid_hi_mid[127];

static void build_grid(void) {
  for (unsigned m = 0; m < 127; m++) {
    double v = e4m3_value(m);
    grid_lo_mid[m] = m == 0 ? -1.0f : (float)((e4m3_value(m - 1) + v) / 2.0);
    grid_hi_mid[m] = m == 126 ? INFINITY : (float)((v + e4m3_value(m + 1)) / 2.0);
  }
}

/* Whether byte b is the right encoding of f: the nearest grid point, ties to even mantissa. */
static int e4m3_ok(uint32_t u, unsigned b) {
  if ((b & 0x80u) != ((u >> 24) & 0x80u))
    return 0; /* the sign is always the input's */
  uint32_t abits = u & 0x7fffffffu;
  unsigned m = b & 0x7fu;
  if (abits > 0x7f800000u)
    return m == 0x7fu;
  if (m > 126u)
    return 0;
  float a = u2f(abits);
  if (a < grid_lo_mid[m] || a > grid_hi_mid[m])
    return 0;
  if ((a == grid_lo_mid[m] || a == grid_hi_mid[m]) && isfinite(a))
    return (m & 1u) == 0u;
  return 1;
}

/* The bf16 nearest to f, ties to even, computed from values (overflow rounds to infinity). */
static int bf16_ok(uint32_t u, uint16_t h) {
  uint32_t abits = u & 0x7fffffffu;
  if ((h >> 15) != (u >> 31))
    return 0;
  if (abits > 0x7f800000u)
    return (h & 0x7fffu) > 0x7f80u;
  uint32_t lo = abits & 0xffff0000u;
  uint32_t want = lo;
  if (abits != lo) {
    uint32_t hi = lo + 0x10000u;
    double hv = hi == 0x7f800000u ? ldexp(1.0, 128) : (double)u2f(hi);
    double mid = ((double)u2f(lo) + hv) / 2.0;
    double a = (double)u2f(abits);
    if (a > mid || (a == mid && ((lo >> 16) & 1u)))
      want = hi;
  }
  return (h & 0x7fffu) == (want >> 16);
}

/* ---- the exhaustive sweep over fp32 bit patterns ---- */

typedef struct {
  uint64_t first, end; /* patterns [first, end) */
  uint64_t stride;
  uint64_t e4m3_bad, bf16_bad, visited;
  uint32_t e4m3_first_bad, bf16_first_bad;
} sweep_t;

static void sweep_one(sweep_t *s, uint32_t u) {
  float f = u2f(u);
  unsigned b = dsv4_f32_to_e4m3(f);
  if (!e4m3_ok(u, b) && s->e4m3_bad++ == 0)
    s->e4m3_first_bad = u;
  uint16_t h = dsv4_f32_to_bf16(f);
  if (!bf16_ok(u, h) && s->bf16_bad++ == 0)
    s->bf16_first_bad = u;
  s->visited++;
}

static void *sweep_run(void *arg) {
  sweep_t *s = arg;
  if (s->stride <= 1) {
    for (uint64_t v = s->first; v < s->end; v++)
      sweep_one(s, (uint32_t)v);
    return NULL;
  }
  for (uint64_t v = s->first; v < s->end; v += s->stride)
    sweep_one(s, (uint32_t)v);
  /* Around every exponent boundary (both signs): where mantissa carries and saturation happen. */
  for (uint64_t v = s->first; v < s->end; v++) {
    uint32_t low = (uint32_t)v & 0x7fffffu;
    if (low < 0x10000u || low >= 0x7f0000u)
      sweep_one(s, (uint32_t)v);
    else
      v += 0x7f0000u - low - 1u;
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

static uint64_t sweep_stride(void) {
  const char *e = getenv("DSV4_NUMERICS_STRIDE");
  uint64_t k = e ? strtoull(e, NULL, 10) : DEFAULT_STRIDE;
  return k ? k : 1;
}

static void test_exhaustive_e4m3_and_bf16(void **state) {
  (void)state;
  build_grid();
  uint64_t stride = sweep_stride();
  sweep_t s[2];
  memset(s, 0, sizeof(s));
  s[0].first = 0;
  s[0].end = UINT64_C(1) << 31;
  s[1].first = UINT64_C(1) << 31;
  s[1].end = UINT64_C(1) << 32;
  s[0].stride = s[1].stride = stride;
  pthread_t tid;
  assert_int_equal(pthread_create(&tid, NULL, sweep_run, &s[1]), 0);
  sweep_run(&s[0]);
  assert_int_equal(pthread_join(tid, NULL), 0);
  for (int k = 0; k < 2; k++) {
    if (s[k].e4m3_bad)
      print_error("e4m3: %llu wrong, first input 0x%08x -> 0x%02x\n",
                  (unsigned long long)s[k].e4m3_bad, (unsigned)s[k].e4m3_first_bad,
                  (unsigned)dsv4_f32_to_e4m3(u2f(s[k].e4m3_first_bad)));
    if (s[k].bf16_bad)
      print_error("bf16: %llu wrong, first input 0x%08x -> 0x%04x\n",
                  (unsigned long long)s[k].bf16_bad, (unsigned)s[k].bf16_first_bad,
                  (unsigned)dsv4_f32_to_bf16(u2f(s[k].bf16_first_bad)));
    assert_int_equal(s[k].e4m3_bad, 0);
    assert_int_equal(s[k].bf16_bad, 0);
  }
  if (stride <= 1)
    assert_true(s[0].visited + s[1].visited == UINT64_C(1) << 32);
}

/* ---- known vectors ---- */

static void test_e4m3_vectors(void **state) {
  (void)state;
  struct {
    float in;
    unsigned out;
  } v[] = {
      {448.0f, 0x7E},         {-448.0f, 0xFE},        {464.0f, 0x7E},
      {1e30f, 0x7E},          {INFINITY, 0x7E},       {-INFINITY, 0xFE},
      {0x1p-6f, 0x08},        {0x1p-9f, 0x01},        {-0x1p-9f, 0x81},
      {0x1p-10f, 0x00},       {-0x1p-10f, 0x80},      {0x1.000002p-10f, 0x01},
      {1.5f * 0x1p-9f, 0x02}, {2.5f * 0x1p-9f, 0x02}, {3.5f * 0x1p-9f, 0x04},
      {7.5f * 0x1p-9f, 0x08}, {0.0f, 0x00},           {-0.0f, 0x80},
      {-1e-30f, 0x80},        {-0x1p-149f, 0x80},     {1.0f, 0x38},
      {1.0625f, 0x38},        {1.1875f, 0x3A},        {1.125f, 0x39},
      {1.9375f, 0x40},        {240.0f, 0x77},         {0x1.ep7f, 0x77},
      {0x1.f0p7f, 0x78},      {-2.0f, 0xC0},          {0x1.1p-6f, 0x08},
      {0x1.3p-6f, 0x0A},
  };
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
    unsigned got = dsv4_f32_to_e4m3(v[i].in);
    if (got != v[i].out)
      print_error("e4m3(%a) = 0x%02x, want 0x%02x\n", (double)v[i].in, got, v[i].out);
    assert_int_equal(got, v[i].out);
  }
  /* NaN keeps its sign and encodes 0x7F. */
  assert_int_equal(dsv4_f32_to_e4m3(u2f(0x7fc00000u)), 0x7F);
  assert_int_equal(dsv4_f32_to_e4m3(u2f(0xff800001u)), 0xFF);
}

static void test_e4m3_decode_all(void **state) {
  (void)state;
  for (unsigned b = 0; b < 256; b++) {
    float got = dsv4_e4m3_to_f32((dsv4_u8)b);
    double want = e4m3_value(b);
    if ((b & 0x7f) == 0x7f) {
      assert_true(isnan(got));
      continue;
    }
    assert_false(isnan(got));
    assert_true((double)got == want);
    /* Zero keeps its sign: 0x80 is -0.0. */
    assert_int_equal(signbit(got) != 0, (b & 0x80) != 0);
    /* Every finite byte survives a round trip through the encoder. */
    assert_int_equal(dsv4_f32_to_e4m3(got), b);
  }
  assert_true(dsv4_e4m3_to_f32(0x7E) == 448.0f);
  assert_true(dsv4_e4m3_to_f32(0x01) == 0x1p-9f);
  assert_true(dsv4_e4m3_to_f32(0x08) == 0x1p-6f);
}

static void test_bf16(void **state) {
  (void)state;
  /* Ties go to the even neighbour; above the tie rounds up; carries ripple into the exponent. */
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x3f808000u)), 0x3f80);
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x3f818000u)), 0x3f82);
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x3f808001u)), 0x3f81);
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x3f807fffu)), 0x3f80);
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x3fff8000u)), 0x4000);
  assert_int_equal(dsv4_f32_to_bf16(u2f(0xbfff8000u)), 0xc000);
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x007f8000u)), 0x0080); /* subnormal carries to normal */
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x00008000u)), 0x0000); /* tie to even zero */
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x00018000u)), 0x0002);
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x7f7fffffu)), 0x7f80); /* FLT_MAX overflows to Inf */
  assert_int_equal(dsv4_f32_to_bf16(u2f(0x7f7f7fffu)), 0x7f7f);
  assert_int_equal(dsv4_f32_to_bf16(INFINITY), 0x7f80);
  assert_int_equal(dsv4_f32_to_bf16(-0.0f), 0x8000);
  /* NaN stays NaN, including a signalling NaN whose payload sits only in the low half. */
  uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffc0ffffu};
  for (size_t i = 0; i < sizeof(nans) / sizeof(nans[0]); i++) {
    uint16_t h = dsv4_f32_to_bf16(u2f(nans[i]));
    assert_true((h & 0x7fffu) > 0x7f80u);
    assert_int_equal(h >> 15, nans[i] >> 31);
    assert_true(isnan(dsv4_bf16_to_f32(h)));
  }
  /* bf16 -> fp32 is exact: the value from the fields, and a round trip back. */
  for (uint32_t h = 0; h < 0x10000u; h++) {
    float f = dsv4_bf16_to_f32((dsv4_u16)h);
    unsigned e = (h >> 7) & 0xffu, m = h & 0x7fu;
    double sign = (h & 0x8000u) ? -1.0 : 1.0;
    if (e == 0xffu) {
      assert_true(m ? isnan(f) : isinf(f));
      continue;
    }
    double want = e ? sign * ldexp(128.0 + m, (int)e - 127 - 7) : sign * ldexp((double)m, -133);
    assert_true((double)f == want);
    assert_int_equal(dsv4_f32_to_bf16(f), h);
  }
}

/* ---- UE8M0 ---- */

/* ceil(log2(q)) of a positive normal fp32 q, exactly: its binary exponent, plus one unless q is a
 * power of two. */
static int ceil_log2f(float q) {
  uint32_t b = f2u(q);
  int e = (int)(b >> 23) - 127;
  return (b & 0x7fffffu) ? e + 1 : e;
}

typedef struct {
  uint32_t first, last; /* fp32 bit patterns, inclusive; last is always visited */
  uint64_t stride;
  uint64_t bad;
  uint32_t first_bad;
  int min_code, max_code;
} ue8m0_job_t;

/* The next pattern of a strided walk that never steps over its last pattern. */
static uint64_t next_u(uint64_t u, uint64_t stride, uint64_t last) {
  if (u == last)
    return last + 1;
  return u + stride > last ? last : u + stride;
}

static void *ue8m0_run(void *arg) {
  ue8m0_job_t *j = arg;
  j->min_code = 1000;
  j->max_code = -1000;
  for (uint64_t u = j->first; u <= j->last; u = next_u(u, j->stride, j->last)) {
    float amax = u2f((uint32_t)u);
    float q = amax / 448.0f; /* the IEEE fp32 quotient; q is normal for every amax >= 1e-4f */
    int want = ceil_log2f(q);
    int e = dsv4_ue8m0_exponent(amax);
    if (e != want && j->bad++ == 0)
      j->first_bad = (uint32_t)u;
    int code = e + 127;
    if (code < j->min_code)
      j->min_code = code;
    if (code > j->max_code)
      j->max_code = code;
  }
  return NULL;
}

static void ue8m0_sweep(uint32_t first, uint32_t last, int *min_code, int *max_code) {
  uint32_t mid = first + (last - first) / 2;
  uint64_t stride = sweep_stride();
  ue8m0_job_t j[2] = {{first, mid, stride, 0, 0, 0, 0}, {mid + 1, last, stride, 0, 0, 0, 0}};
  pthread_t tid;
  assert_int_equal(pthread_create(&tid, NULL, ue8m0_run, &j[1]), 0);
  ue8m0_run(&j[0]);
  assert_int_equal(pthread_join(tid, NULL), 0);
  for (int k = 0; k < 2; k++) {
    if (j[k].bad)
      print_error("ue8m0: %llu wrong, first amax 0x%08x\n", (unsigned long long)j[k].bad,
                  (unsigned)j[k].first_bad);
    assert_int_equal(j[k].bad, 0);
  }
  *min_code = j[0].min_code < j[1].min_code ? j[0].min_code : j[1].min_code;
  *max_code = j[0].max_code > j[1].max_code ? j[0].max_code : j[1].max_code;
}

static void test_ue8m0_exhaustive(void **state) {
  (void)state;
  int lo, hi;
  /* Every fp32 amax the daemon can meet: the floor 1e-4f up to the largest value below 2^59. */
  ue8m0_sweep(f2u(DSV4_AMAX_FLOOR), f2u(0x1p59f) - 1u, &lo, &hi);
  assert_int_equal(lo, 105);
  assert_int_equal(hi, 178);
  /* And on to FLT_MAX: the code never exceeds 247, so no clamp and never 0xFF. */
  ue8m0_sweep(f2u(0x1p59f), 0x7f7fffffu, &lo, &hi);
  assert_true(lo >= 105);
  assert_int_equal(hi, 247);
  /* The exact boundary: 448 * 2^e itself takes e, its successor takes e + 1. */
  for (int e = -22; e <= 119; e++) {
    float b = ldexpf(448.0f, e);
    assert_int_equal(dsv4_ue8m0_exponent(b), e);
    assert_int_equal(dsv4_ue8m0_exponent(nextafterf(b, INFINITY)), e + 1);
    assert_true(dsv4_448_pow2(e) == b);
  }
  /* Scales are exact powers of two. */
  for (int c = 1; c <= 254; c++)
    assert_true((double)dsv4_ue8m0_scale((dsv4_u8)c) == ldexp(1.0, c - 127));
  for (int e = -22; e <= 120; e++)
    assert_true((double)dsv4_pow2_neg(e) == ldexp(1.0, -e));
}

/* ---- floating-point environment ---- */

static void test_no_contraction(void **state) {
  (void)state;
  /* Runtime inputs: the compiler cannot fold them. With contraction a*b+c would be 2^-24. */
  volatile float va = 1.0f + 0x1p-12f, vb = 1.0f + 0x1p-12f, vc = -(1.0f + 0x1p-11f);
  const char *env = getenv("DSV4_NUMERICS_CONTRACT_A");
  if (env)
    va = strtof(env, NULL);
  float a = va, b = vb, c = vc;
  float r = a * b + c;
  assert_int_equal(f2u(r), 0x00000000u);
  /* The explicit fma is the contracted value, so the difference is visible. */
  assert_true(fmaf(a, b, c) == 0x1p-24f);
}

static void test_subnormals_honoured(void **state) {
  (void)state;
#if defined(__x86_64__) || defined(__i386__)
  unsigned csr = _mm_getcsr();
  assert_int_equal(csr & 0x8000u, 0); /* FTZ */
  assert_int_equal(csr & 0x0040u, 0); /* DAZ */
#endif
  volatile float s = 0x1p-140f, one = 1.0f, half = 0.5f, tiny_normal = 0x1p-126f;
  float r = s * one;
  assert_int_equal(fpclassify(r), FP_SUBNORMAL);
  assert_int_equal(f2u(r), f2u(0x1p-140f));
  float h = tiny_normal * half;
  assert_int_equal(f2u(h), 0x00400000u);
  /* A subnormal input is read as itself, not as zero. */
  assert_true(s + s == 0x1p-139f);
  /* SPEC §2's vector: the NoPE part of the Q path on a head (0x0001, 0x8001, 0x0080, 0, ...). The
   * squares underflow to zero, so r = 1/sqrt(eps), and the products stay subnormal or tiny. */
  float x[512] = {0};
  x[0] = dsv4_bf16_to_f32(0x0001);
  x[1] = dsv4_bf16_to_f32(0x8001);
  x[2] = dsv4_bf16_to_f32(0x0080);
  float rf = dsv4_rms_factor(dsv4_sumsq512(x), u2f(DSV4_RMS_EPS_BITS));
  assert_int_equal(dsv4_f32_to_bf16(x[0] * rf), 0x01FA);
  assert_int_equal(dsv4_f32_to_bf16(x[1] * rf), 0x81FA);
  assert_int_equal(dsv4_f32_to_bf16(x[2] * rf), 0x057A);
}

/* ---- canonical reductions ---- */

/* The canonical fold of SPEC §2 written as the tree it builds: T(l, s) = T(l, 2s) + T(l + s, 2s).
 */
static float fold_tree(const float *partial, int l, int s) {
  if (s == 32)
    return partial[l];
  return fold_tree(partial, l, 2 * s) + fold_tree(partial, l + s, 2 * s);
}

static float ref_dot512(const float *x, const float *y) {
  float partial[32];
  for (int l = 0; l < 32; l++) {
    float acc = +0.0f;
    const float *xs = x + 16 * l, *ys = y + 16 * l;
    for (int k = 0; k < 16; k++)
      acc = fmaf(xs[k], ys[k], acc);
    partial[l] = acc;
  }
  return fold_tree(partial, 0, 1);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15u;

static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

/* A random fp32 with a random sign and a magnitude spread over 2^-20..2^20. */
static float rand_float(void) {
  uint64_t r = rng();
  float m = 1.0f + (float)(r & 0xffffff) * 0x1p-24f;
  int e = (int)((r >> 24) % 41) - 20;
  float v = ldexpf(m, e);
  return (r >> 40) & 1 ? -v : v;
}

static void test_reductions(void **state) {
  (void)state;
  float x[512], y[512];
  int diff_sumsq = 0, diff_dot = 0;
  for (int trial = 0; trial < 2000; trial++) {
    for (int i = 0; i < 512; i++) {
      x[i] = rand_float();
      y[i] = rand_float();
    }
    float s = dsv4_sumsq512(x), d = dsv4_dot512(x, y);
    assert_int_equal(f2u(s), f2u(ref_dot512(x, x)));
    assert_int_equal(f2u(d), f2u(ref_dot512(x, y)));
    float ns = 0.0f, nd = 0.0f;
    for (int i = 0; i < 512; i++) {
      ns = ns + x[i] * x[i];
      nd = nd + x[i] * y[i];
    }
    diff_sumsq += f2u(ns) != f2u(s);
    diff_dot += f2u(nd) != f2u(d);
  }
  /* The order matters: a naive sequential sum gives other bits for many of these inputs. */
  assert_true(diff_sumsq > 100);
  assert_true(diff_dot > 100);
  /* A zero vector sums to +0.0, and the partials start from +0.0 (not -0.0). */
  memset(x, 0, sizeof(x));
  assert_int_equal(f2u(dsv4_sumsq512(x)), 0u);
  for (int i = 0; i < 512; i++)
    y[i] = -0.0f;
  assert_int_equal(f2u(dsv4_dot512(x, y)), 0u);
}

static void test_rms_factor(void **state) {
  (void)state;
  float eps = u2f(DSV4_RMS_EPS_BITS);
  assert_true(eps == (float)1e-6);
  assert_true(u2f(DSV4_SOFTMAX_SCALE_BITS) == (float)(1.0 / sqrt(512.0)));
  for (int trial = 0; trial < 100000; trial++) {
    float ss = fabsf(rand_float()) * 512.0f;
    volatile float t = ss * 0x1p-9f;
    float u = t + eps;
    /* Each step rounded once: the double computation of each step gives the same fp32. */
    float want = (float)(1.0 / (double)(float)sqrt((double)u));
    assert_int_equal(f2u(dsv4_rms_factor(ss, eps)), f2u(want));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_no_contraction),
      cmocka_unit_test(test_subnormals_honoured),
      cmocka_unit_test(test_bf16),
      cmocka_unit_test(test_e4m3_vectors),
      cmocka_unit_test(test_e4m3_decode_all),
      cmocka_unit_test(test_reductions),
      cmocka_unit_test(test_rms_factor),
      cmocka_unit_test(test_ue8m0_exhaustive),
      cmocka_unit_test(test_exhaustive_e4m3_and_bf16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
