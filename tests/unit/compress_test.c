/*
 * The compressed branch on the CPU backend (SPEC §8.3, §8.5).
 *
 * First the shared math of kernels/dsv4-compress.h on its own: the e2m1 tie table and a
 * nearest-even search over many values, the MXFP4 exponent against a search in double (amax exactly
 * 6 * 2^e, one ulp above, the 6 * 2^-126 floor, tiny values, negative zero), the Hadamard transform
 * against an O(n^2) product with the +-1 Sylvester matrix in double, the fold order of the 128-long
 * reductions, and pooling on hand-worked cases.
 *
 * Then the ops. A model written here from the SPEC keeps every row a sequence ever had (not a
 * ring), builds each entry's row list from the SPEC's rule, pools channel by channel, and builds
 * the 584-byte and 68-byte records with its own norm, RoPE, UE8M0 search, butterflies and MXFP4
 * rounding. The compress op runs multi-segment batches at ratio 4 and 128 (emissions whose rows
 * come from earlier batches, p0 > 0, blocks across boundaries) over caches and rings filled with
 * garbage first, and the whole of every buffer must equal the model's image: the records in their
 * blocks and offsets, the ring rows, and nothing else changed. Refused launches must leave every
 * buffer as it was. The indexer is compared with a brute-force selection, and on constructed
 * records for ties and the ReLU. Thread counts and kernel levels must not change a byte. The
 * indexer's vector levels are also held against the scalar level's functions directly: q^ bit for
 * bit over every input magnitude the wire allows (meeting the e2m1 ties), and the scores bit for
 * bit over runs at every lane offset and tail length, 1 to 128 heads, with ties across lanes.
 * Batches smaller than the thread count score in pieces, which must select the same entries.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "cpu/cpu-internal.h"
#include "dsv4-compress.h"
#include "rope.h"

#define TEST_RNG_SEED 0x2545F4914F6CDD1Dull
#include "test_rng.h"

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

static float bf16r(float x) {
  return dsv4_bf16_to_f32(dsv4_f32_to_bf16(x));
}

/* ---- an independent model of the SPEC's arithmetic ---- */

static const double e2m1_grid[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

/* The e2m1 nibble by search: the nearest grid value, on a tie the even code. */
static uint8_t model_e2m1(float x) {
  uint8_t sign = signbit(x) ? 8 : 0;
  double a = fabs((double)x);
  int best = 0;
  for (int c = 1; c < 8; c++) {
    double d = fabs(a - e2m1_grid[c]), bd = fabs(a - e2m1_grid[best]);
    if (d < bd || (d == bd && (c & 1) == 0))
      best = c;
  }
  return (uint8_t)(sign | best);
}

/* The smallest e with amax <= 6 * 2^e, searched in double. */
static int model_mxfp4_exp(float amax) {
  int e = -140;
  while ((double)amax > ldexp(6.0, e))
    e++;
  return e;
}

static void model_mxfp4(const float *v, uint8_t *vals, uint8_t *codes) {
  memset(vals, 0, 64);
  for (int b = 0; b < 4; b++) {
    float amax = ldexpf(6.0f, -126);
    for (int k = 0; k < 32; k++)
      amax = fabsf(v[32 * b + k]) > amax ? fabsf(v[32 * b + k]) : amax;
    int e = model_mxfp4_exp(amax);
    codes[b] = (uint8_t)(e + 127);
    for (int k = 0; k < 32; k++) {
      int i = 32 * b + k;
      vals[i / 2] |= (uint8_t)(model_e2m1(ldexpf(v[i], -e)) << (4 * (i & 1)));
    }
  }
}

static void model_mxfp4_dequant(const uint8_t *vals, const uint8_t *codes, float *out) {
  for (int i = 0; i < 128; i++) {
    int nib = (vals[i / 2] >> (4 * (i & 1))) & 15;
    double g = e2m1_grid[nib & 7] * ldexp(1.0, codes[i / 32] - 127);
    out[i] = (float)((nib & 8) ? -g : g);
  }
}

/* The butterflies written as blocks of 2 * len (the same pairs as the SPEC's (i & h) = 0 rule). */
static void model_hadamard(float *a) {
  for (int len = 1; len < 128; len *= 2)
    for (int base = 0; base < 128; base += 2 * len)
      for (int k = base; k < base + len; k++) {
        float x = a[k], y = a[k + len];
        a[k] = x + y;
        a[k + len] = x - y;
      }
  for (int i = 0; i < 128; i++)
    a[i] = bf16r(a[i] * u2f(0x3DB504F3u));
}

/* n partials of 16 in fma chains, then the pairwise fold from step n / 2 down to 1. */
static float model_chains(const float *x, const float *y, int n) {
  float p[32];
  for (int l = 0; l < n; l++) {
    float acc = 0.0f;
    for (int k = 0; k < 16; k++)
      acc = fmaf(x[16 * l + k], y[16 * l + k], acc);
    p[l] = acc;
  }
  for (int step = n / 2; step >= 1; step /= 2)
    for (int l = 0; l < step; l++)
      p[l] = p[l] + p[l + step];
  return p[0];
}

static float model_pool(const float *s, const float *kv, int n) {
  float m = s[0];
  for (int k = 1; k < n; k++)
    if (s[k] > m)
      m = s[k];
  float sum = 0.0f, num = 0.0f;
  for (int k = 0; k < n; k++) {
    float e = dsv4_expf(s[k] - m);
    sum = sum + e;
    num = fmaf(e, kv[k], num);
  }
  return num / sum;
}

/* RoPE pair i of x at dims first + 2i, first + 2i + 1, rounded to bf16 (SPEC §2.1's formula). */
static void model_rope(float *x, int first, const float *cs) {
  for (int i = 0; i < 32; i++) {
    float e = x[first + 2 * i], o = x[first + 2 * i + 1], c = cs[i], s = cs[32 + i];
    x[first + 2 * i] = bf16r(fmaf(e, c, -(o * s)));
    x[first + 2 * i + 1] = bf16r(fmaf(e, s, o * c));
  }
}

/* The 584-byte logical record (NoPE | RoPE | scales) of a pooled z (SPEC §8.3 "Record", §2.2). */
static void model_record(const float *z, const float *w, float eps, const float *cs, uint8_t *rec) {
  float y[512];
  for (int d = 0; d < 512; d++)
    y[d] = bf16r(z[d]);
  float r = 1.0f / sqrtf(model_chains(y, y, 32) * 0x1p-9f + eps);
  for (int d = 0; d < 512; d++)
    y[d] = bf16r((y[d] * r) * w[d]);
  model_rope(y, 448, cs);
  for (int d = 0; d < 64; d++) {
    uint16_t h = dsv4_f32_to_bf16(y[448 + d]);
    rec[448 + 2 * d] = (uint8_t)(h & 0xff);
    rec[449 + 2 * d] = (uint8_t)(h >> 8);
  }
  for (int t = 0; t < 7; t++) {
    float amax = 1e-4f;
    for (int k = 0; k < 64; k++)
      amax = fabsf(y[64 * t + k]) > amax ? fabsf(y[64 * t + k]) : amax;
    int e = -140;
    while ((double)amax > ldexp(448.0, e))
      e++;
    for (int k = 0; k < 64; k++)
      rec[64 * t + k] = dsv4_f32_to_e4m3(ldexpf(y[64 * t + k], -e));
    rec[576 + t] = (uint8_t)(e + 127);
  }
  rec[583] = 0;
}

/* The 68-byte index record (values then codes) of a pooled z[128] (SPEC §8.5 "Index keys"). */
static void model_index_record(const float *z, const float *w, float eps, const float *cs,
                               uint8_t *rec) {
  float y[128];
  for (int d = 0; d < 128; d++)
    y[d] = bf16r(z[d]);
  float r = 1.0f / sqrtf(model_chains(y, y, 8) * 0x1p-7f + eps);
  for (int d = 0; d < 128; d++)
    y[d] = bf16r((y[d] * r) * w[d]);
  model_rope(y, 64, cs);
  model_hadamard(y);
  model_mxfp4(y, rec, rec + 64);
}

static void model_index_query(const uint16_t *iq, const float *cs, float *qhat) {
  float x[128];
  uint8_t rec[68];
  for (int d = 0; d < 128; d++)
    x[d] = dsv4_bf16_to_f32(iq[d]);
  model_rope(x, 64, cs);
  model_hadamard(x);
  model_mxfp4(x, rec, rec + 64);
  model_mxfp4_dequant(rec, rec + 64, qhat);
}

/* ---- the shared math on its own ---- */

static void test_e2m1_ties(void **state) {
  (void)state;
  static const struct {
    float x;
    uint8_t nib;
  } table[] = {
      {0.0f, 0x0},    {0.25f, 0x0},     {0.5f, 0x1},       {0.75f, 0x2},  {1.0f, 0x2},
      {1.25f, 0x2},   {1.5f, 0x3},      {1.75f, 0x4},      {2.0f, 0x4},   {2.5f, 0x4},
      {3.0f, 0x5},    {3.5f, 0x6},      {4.0f, 0x6},       {5.0f, 0x6},   {6.0f, 0x7},
      {-0.0f, 0x8},   {-0.25f, 0x8},    {-0.75f, 0xA},     {-1.25f, 0xA}, {-1.75f, 0xC},
      {-2.5f, 0xC},   {-3.5f, 0xE},     {-5.0f, 0xE},      {-6.0f, 0xF},  {1e-30f, 0x0},
      {-1e-30f, 0x8}, {0x1p-149f, 0x0}, {-0x1p-149f, 0x8},
  };
  for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
    if (dsv4_e2m1_nibble(table[i].x) != table[i].nib)
      fail_msg("e2m1(%a) = %#x, want %#x", (double)table[i].x, dsv4_e2m1_nibble(table[i].x),
               table[i].nib);
  }
  /* One ulp either side of every tie leaves it: up goes to the upper code, down to the lower. */
  static const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  static const uint8_t below[] = {0, 1, 2, 3, 4, 5, 6};
  for (int i = 0; i < 7; i++) {
    assert_int_equal(dsv4_e2m1_nibble(nextafterf(ties[i], 0.0f)), below[i]);
    assert_int_equal(dsv4_e2m1_nibble(nextafterf(ties[i], 7.0f)), below[i] + 1);
  }
  /* Every value the lattice 2^-10 reaches in [-6.5, 6.5], and random ones, against the search. */
  for (int k = -6656; k <= 6656; k++) {
    float x = (float)k * 0x1p-10f;
    assert_int_equal(dsv4_e2m1_nibble(x), model_e2m1(x));
  }
  for (int k = 0; k < 200000; k++) {
    float x = rnd_unit() * 6.0f;
    assert_int_equal(dsv4_e2m1_nibble(x), model_e2m1(x));
  }
  for (uint8_t n = 0; n < 16; n++) {
    float v = dsv4_e2m1_to_f32(n);
    double g = e2m1_grid[n & 7];
    assert_true((double)v == ((n & 8) ? -g : g));
    assert_int_equal(signbit(v) != 0, (n & 8) != 0);
    assert_int_equal(dsv4_e2m1_nibble(v), n);
  }
}

static void test_mxfp4_exponent(void **state) {
  (void)state;
  assert_int_equal(f2u(ldexpf(6.0f, -126)), DSV4_MXFP4_AMAX_FLOOR_BITS);
  for (int e = -126; e <= 125; e++) {
    float exact = ldexpf(6.0f, e);
    assert_int_equal(dsv4_mxfp4_exponent(exact), e);
    assert_int_equal(dsv4_mxfp4_exponent(nextafterf(exact, INFINITY)), e + 1);
    assert_int_equal(dsv4_mxfp4_exponent(nextafterf(exact, 0.0f)), e);
    if (e > -126) {
      assert_int_equal(dsv4_mxfp4_exponent(ldexpf(3.0f, e)), e - 1);
      assert_int_equal(dsv4_mxfp4_exponent(ldexpf(4.0f, e)), e);
    }
  }
  assert_int_equal(dsv4_mxfp4_exponent(u2f(0x7f7fffffu)), 126);
  for (int k = 0; k < 200000; k++) {
    uint32_t bits = (uint32_t)(rng() % (0x7f7fffffu - DSV4_MXFP4_AMAX_FLOOR_BITS + 1)) +
                    DSV4_MXFP4_AMAX_FLOOR_BITS;
    float amax = u2f(bits);
    assert_int_equal(dsv4_mxfp4_exponent(amax), model_mxfp4_exp(amax));
  }
}

static uint8_t nibble_at(const uint8_t *vals, int i) {
  return (uint8_t)((vals[i / 2] >> (4 * (i & 1))) & 15);
}

static void test_mxfp4_blocks(void **state) {
  (void)state;
  float v[128] = {0};
  /* Block 0: amax exactly 6 * 2^3, so e = 3, and the ties scaled by 2^-3 go to even codes. */
  const float b0[] = {48.0f, 2.0f, 6.0f, 20.0f, 28.0f, 40.0f, -48.0f, -2.0f, 10.0f, 14.0f};
  const uint8_t n0[] = {0x7, 0x0, 0x2, 0x4, 0x6, 0x6, 0xF, 0x8, 0x2, 0x4};
  memcpy(v, b0, sizeof(b0));
  /* Block 1: zeros and a negative zero: the floor gives e = -126, code 1. */
  v[32 + 5] = -0.0f;
  /* Block 2: tiny values under the floor 6 * 2^-126: e = -126, they scale to 2^-23 and below. */
  v[64] = 0x1p-149f;
  v[65] = -0x1p-140f;
  v[66] = 0x1.8p-125f; /* 1.5 * 2^-125 = 3 * 2^-126: scaled 3 */
  v[67] = 0x1p-127f;   /* 0.5 * 2^-126: scaled 0.5 */
  v[68] = ldexpf(6.0f, -126);
  /* Block 3: amax one ulp above 6 * 2^-1 = 3, so e = 0: 3 stays 3 and the max rounds to 3. */
  v[96] = nextafterf(3.0f, 4.0f);
  v[97] = 3.0f;
  v[98] = -0.75f;
  uint8_t vals[64], codes[4], mv[64], mc[4];
  dsv4_mxfp4_quant128(v, vals, codes);
  model_mxfp4(v, mv, mc);
  assert_memory_equal(vals, mv, 64);
  assert_memory_equal(codes, mc, 4);
  assert_int_equal(codes[0], 130);
  assert_int_equal(codes[1], 1);
  assert_int_equal(codes[2], 1);
  assert_int_equal(codes[3], 127);
  for (int i = 0; i < 10; i++)
    assert_int_equal(nibble_at(vals, i), n0[i]);
  for (int i = 10; i < 32; i++)
    assert_int_equal(nibble_at(vals, i), 0);
  for (int i = 32; i < 64; i++)
    assert_int_equal(nibble_at(vals, i), i == 37 ? 0x8 : 0x0);
  assert_int_equal(nibble_at(vals, 64), 0x0);
  assert_int_equal(nibble_at(vals, 65), 0x8);
  assert_int_equal(nibble_at(vals, 66), 0x5);
  assert_int_equal(nibble_at(vals, 67), 0x1);
  assert_int_equal(nibble_at(vals, 68), 0x7);
  assert_int_equal(nibble_at(vals, 96), 0x5);
  assert_int_equal(nibble_at(vals, 97), 0x5);
  assert_int_equal(nibble_at(vals, 98), 0xA);
  /* Dequantisation is exact: grid value times 2^e, the sign kept (also on zero). */
  float out[128], mout[128];
  dsv4_mxfp4_dequant128(vals, codes, out);
  model_mxfp4_dequant(vals, codes, mout);
  assert_memory_equal(out, mout, sizeof(out));
  assert_true(out[0] == 48.0f && out[2] == 8.0f && out[3] == 16.0f && out[4] == 32.0f);
  assert_true(out[37] == 0.0f && signbit(out[37]));
  assert_true(out[66] == 0x1.8p-125f && out[67] == 0x1p-127f && out[68] == ldexpf(6.0f, -126));
  assert_true(out[98] == -1.0f);
  /* Random blocks over many magnitudes, each block its own scale. */
  for (int round = 0; round < 2000; round++) {
    for (int i = 0; i < 128; i++)
      v[i] = ldexpf(rnd_unit(), (int)(rng() % 40) - 20 + 30 * (i / 32) - 45);
    dsv4_mxfp4_quant128(v, vals, codes);
    model_mxfp4(v, mv, mc);
    assert_memory_equal(vals, mv, 64);
    assert_memory_equal(codes, mc, 4);
  }
}

/* H[i][j] = (-1)^popcount(i & j): the Sylvester order. */
static int sylvester(int i, int j) {
  return __builtin_popcount((unsigned)(i & j)) & 1 ? -1 : 1;
}

static void test_hadamard(void **state) {
  (void)state;
  const float scale = u2f(DSV4_HADAMARD_SCALE_BITS);
  assert_true(fabs((double)scale - 1.0 / sqrt(128.0)) < 0x1p-26);
  float a[128];
  /* Integers of 8 bits are exact in bf16 and every partial sum is exact in fp32, so the result is
   * the exact product H x, scaled and rounded once to fp32 and once to bf16. */
  for (int round = 0; round < 500; round++) {
    double x[128];
    for (int i = 0; i < 128; i++) {
      x[i] = (double)((int)(rng() % 511) - 255);
      a[i] = (float)x[i];
    }
    dsv4_hadamard128(a);
    for (int i = 0; i < 128; i++) {
      double hx = 0.0;
      for (int j = 0; j < 128; j++)
        hx += sylvester(i, j) * x[j];
      float want = bf16r((float)(hx * (double)scale));
      if (f2u(a[i]) != f2u(want))
        fail_msg("round %d: out[%d] = %a, want %a", round, i, (double)a[i], (double)want);
    }
  }
  /* A unit vector gives a column of H: the signs show the order of the transform. */
  for (int k = 0; k < 128; k++) {
    for (int i = 0; i < 128; i++)
      a[i] = i == k ? 1.0f : 0.0f;
    dsv4_hadamard128(a);
    for (int i = 0; i < 128; i++)
      assert_true(a[i] == sylvester(i, k) * bf16r(scale));
  }
  /* Arbitrary bf16 inputs: within bf16 rounding of the exact product; and H H = 128 I. */
  for (int round = 0; round < 500; round++) {
    double x[128], amax = 0.0;
    for (int i = 0; i < 128; i++) {
      a[i] = bf16r(ldexpf(rnd_unit(), (int)(rng() % 16) - 8));
      x[i] = a[i];
      amax = fabs(x[i]) > amax ? fabs(x[i]) : amax;
    }
    float b[128];
    dsv4_hadamard128(a);
    memcpy(b, a, sizeof(b));
    for (int i = 0; i < 128; i++) {
      double hx = 0.0;
      for (int j = 0; j < 128; j++)
        hx += sylvester(i, j) * x[j];
      hx *= 1.0 / sqrt(128.0);
      assert_true(fabs((double)a[i] - hx) <= fabs(hx) * 0x1p-8 + amax * 0x1p-16);
    }
    dsv4_hadamard128(b);
    for (int i = 0; i < 128; i++)
      assert_true(fabs((double)b[i] - x[i]) <= amax * 0x1p-5);
  }
}

static void test_reductions(void **state) {
  (void)state;
  float x[128] = {0}, y[128] = {0};
  /* Partials 2^24, 1, 0, 0, 0, 1, 0, 0: the fold 4, 2, 1 adds the two ones first (2^24 + 2); a
   * sequential or adjacent-pair sum would lose both to rounding (2^24). */
  x[0] = y[0] = 0x1p12f;
  x[16] = y[16] = 1.0f;
  x[80] = y[80] = 1.0f;
  assert_true(dsv4_dot128(x, y) == 16777218.0f);
  assert_true(dsv4_sumsq128(x) == 16777218.0f);
  for (int round = 0; round < 1000; round++) {
    for (int i = 0; i < 128; i++) {
      x[i] = ldexpf(rnd_unit(), (int)(rng() % 30) - 15);
      y[i] = ldexpf(rnd_unit(), (int)(rng() % 30) - 15);
    }
    assert_int_equal(f2u(dsv4_dot128(x, y)), f2u(model_chains(x, y, 8)));
    assert_int_equal(f2u(dsv4_sumsq128(x)), f2u(model_chains(x, x, 8)));
  }
  /* The RMS factor: 1 / sqrt(ss / 128 + eps), each step rounded once. */
  float eps = u2f(DSV4_RMS_EPS_BITS);
  assert_true(dsv4_index_rms_factor(128.0f, eps) == 1.0f / sqrtf(1.0f + eps));
  assert_true(dsv4_index_rms_factor(0.0f, eps) == 1.0f / sqrtf(eps));
  /* The score term: ReLU then one fma. */
  assert_true(dsv4_index_score_add(2.0f, -3.0f, 1.0f) == 1.0f);
  assert_true(dsv4_index_score_add(-2.0f, -0.0f, 0.0f) == 0.0f);
  assert_false(signbit(dsv4_index_score_add(-2.0f, -0.0f, 0.0f)));
  assert_true(dsv4_index_score_add(0.5f, 3.0f, 1.0f) == 2.5f);
  float w = 1.0f + 0x1p-12f, d = 1.0f + 0x1p-12f, acc = -(1.0f + 0x1p-11f);
  assert_true(dsv4_index_score_add(w, d, acc) == 0x1p-24f); /* fused: the product is not rounded */
  /* Score keys order like the scores; -0 counts as +0. */
  const float ordered[] = {-INFINITY, -1e30f, -2.0f, -1e-40f, 0.0f, 1e-40f, 1.0f, 3e38f};
  for (int i = 1; i < 8; i++)
    assert_true(dsv4_index_score_key(ordered[i - 1]) < dsv4_index_score_key(ordered[i]));
  assert_int_equal(dsv4_index_score_key(-0.0f), dsv4_index_score_key(0.0f));
}

static void test_pool_channel(void **state) {
  (void)state;
  /* One row: the weight is expf(0) = 1 and z = kv exactly. */
  float s1[] = {3.7f}, kv1[] = {-1.234f};
  assert_true(dsv4_pool_channel(s1, kv1, 1) == -1.234f);
  /* Equal scores: every weight is 1, so z is the plain mean. */
  float s4[] = {0.5f, 0.5f, 0.5f, 0.5f}, kv4[] = {1.0f, 2.0f, 3.0f, 4.0f};
  assert_true(dsv4_pool_channel(s4, kv4, 4) == 2.5f);
  /* A score 1000 below the max weighs expf(-1000) = 0. */
  float s2[] = {0.0f, -1000.0f}, kv2[] = {0.375f, 1e6f};
  assert_true(dsv4_pool_channel(s2, kv2, 2) == 0.375f);
  /* Weights 1 and e^-1 (the max first or last): N / S with one divide. */
  float e1 = dsv4_expf(-1.0f);
  float sa[] = {1.0f, 0.0f}, ka[] = {2.0f, 5.0f};
  assert_true(dsv4_pool_channel(sa, ka, 2) == fmaf(e1, 5.0f, 2.0f) / (1.0f + e1));
  float sb[] = {0.0f, 1.0f}, kb[] = {5.0f, 2.0f};
  assert_true(dsv4_pool_channel(sb, kb, 2) == fmaf(1.0f, 2.0f, e1 * 5.0f) / (e1 + 1.0f));
  /* Random lists of up to 128 rows against the model. */
  for (int round = 0; round < 2000; round++) {
    float s[128], kv[128];
    int n = 1 + (int)(rng() % 128);
    for (int k = 0; k < n; k++) {
      s[k] = rnd_unit() * 20.0f;
      kv[k] = rnd_unit() * 4.0f;
    }
    assert_int_equal(f2u(dsv4_pool_channel(s, kv, n)), f2u(model_pool(s, kv, n)));
  }
}

/* ---- the compress op against the model ---- */

#define MAX_POS 1024 /* positions per test sequence */
#define MAX_CLB 64   /* compressed logical blocks per test sequence */

typedef struct {
  dsv4_backend_t *be;
  uint32_t ratio, bs, n_blocks, n_slots;
  uint32_t w;  /* kv floats of a main row: coff * 512 */
  uint32_t rr; /* ring rows */
  uint64_t stride, ring_floats;
  uint8_t *c_cache, *i_cache, *exp_c, *exp_i;
  float *ring, *exp_ring;
  float *ape, *norm_w, *i_ape, *i_norm_w;
  float eps;
  dsv4_rope_table_t *rope;
  int32_t *free_ids;
  uint32_t n_free;
} cfx_t;

typedef struct {
  int64_t p0, next, first_lb;
  uint32_t slot;
  int32_t blocks[MAX_CLB]; /* physical block of logical block first_lb + i, or -1 */
  float *kv, *s;           /* every row the sequence had: [MAX_POS][w] */
  float *ikv, *is;         /* the indexer's rows: [MAX_POS][256] */
} cseq_t;

typedef struct {
  uint32_t n, n_segs, heads;
  int64_t *positions, *seg_p0, *seg_c_first_lb;
  int32_t *tok_seg, *c_block_table;
  uint32_t *seg_slot, *seg_cbt_off, *seg_cbt_len;
  uint32_t c_bt_entries;
  float *ckv, *ikv, *iw;
  uint16_t *iq;
} cbatch_t;

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  assert_non_null(p);
  return p;
}

static void fill_bytes(uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)rng();
}

static float *random_floats(size_t n, float lo, float hi) {
  float *p = xmalloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++)
    p[i] = lo + (hi - lo) * (rnd_unit() * 0.5f + 0.5f);
  return p;
}

/* A backend and one layer's caches, rings and weights, all holding garbage to begin with. */
static void cfx_open(cfx_t *fx, uint32_t ratio, uint32_t bs, uint32_t n_blocks, unsigned threads) {
  memset(fx, 0, sizeof(*fx));
  dsv4_backend_options_t opt = {.threads = threads};
  char why[256];
  assert_int_equal(dsv4_backend_open("cpu", &opt, &fx->be, why, sizeof(why)), 0);
  assert_non_null(fx->be->ops->compress);
  assert_non_null(fx->be->ops->indexer);
  fx->ratio = ratio;
  fx->bs = bs;
  fx->n_blocks = n_blocks;
  fx->n_slots = 6;
  fx->w = ratio == 4 ? 1024 : 512;
  fx->rr = ratio == 4 ? 8 : ratio;
  fx->stride = DSV4_BLOCK_STRIDE(bs);
  fx->ring_floats = DSV4_RING_FLOATS(ratio);
  assert_true(fx->ring_floats == (uint64_t)fx->rr * 2 * fx->w + (ratio == 4 ? 8 * 512 : 0));
  size_t cbytes = n_blocks * fx->stride, ibytes = n_blocks * DSV4_INDEX_BLOCK_BYTES(bs);
  fx->c_cache = xmalloc(cbytes);
  fx->exp_c = xmalloc(cbytes);
  fx->i_cache = xmalloc(ibytes);
  fx->exp_i = xmalloc(ibytes);
  fill_bytes(fx->c_cache, cbytes);
  fill_bytes(fx->i_cache, ibytes);
  memcpy(fx->exp_c, fx->c_cache, cbytes);
  memcpy(fx->exp_i, fx->i_cache, ibytes);
  fx->ring = random_floats(fx->n_slots * fx->ring_floats, -100.0f, 100.0f);
  fx->exp_ring = xmalloc(fx->n_slots * fx->ring_floats * sizeof(float));
  memcpy(fx->exp_ring, fx->ring, fx->n_slots * fx->ring_floats * sizeof(float));
  fx->ape = random_floats((size_t)ratio * fx->w, -1.0f, 1.0f);
  fx->i_ape = random_floats(4 * 256, -1.0f, 1.0f);
  /* Norm weights come from a bf16 checkpoint, widened exactly. */
  fx->norm_w = random_floats(512, 0.5f, 1.5f);
  fx->i_norm_w = random_floats(128, 0.5f, 1.5f);
  for (int d = 0; d < 512; d++)
    fx->norm_w[d] = bf16r(fx->norm_w[d]);
  for (int d = 0; d < 128; d++)
    fx->i_norm_w[d] = bf16r(fx->i_norm_w[d]);
  fx->eps = u2f(DSV4_RMS_EPS_BITS);
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv_freq);
  assert_int_equal(dsv4_rope_table_create(inv_freq, DSV4_MAX_POSITION_DEFAULT, &fx->rope), 0);
  assert_int_equal(dsv4_rope_table_ensure_range(fx->rope, 0, MAX_POS), 0);
  fx->free_ids = xmalloc(n_blocks * sizeof(int32_t));
  for (uint32_t i = 0; i < n_blocks; i++)
    fx->free_ids[i] = (int32_t)i;
  for (uint32_t i = n_blocks - 1; i > 0; i--) {
    uint32_t j = (uint32_t)(rng() % (i + 1));
    int32_t t = fx->free_ids[i];
    fx->free_ids[i] = fx->free_ids[j];
    fx->free_ids[j] = t;
  }
  fx->n_free = n_blocks;
}

static void cfx_close(cfx_t *fx) {
  dsv4_backend_close(fx->be);
  dsv4_rope_table_destroy(fx->rope);
  free(fx->c_cache);
  free(fx->exp_c);
  free(fx->i_cache);
  free(fx->exp_i);
  free(fx->ring);
  free(fx->exp_ring);
  free(fx->ape);
  free(fx->i_ape);
  free(fx->norm_w);
  free(fx->i_norm_w);
  free(fx->free_ids);
}

static void cseq_init(const cfx_t *fx, cseq_t *sq, int64_t p0, uint32_t slot) {
  memset(sq, 0, sizeof(*sq));
  sq->p0 = p0;
  sq->next = p0;
  sq->slot = slot;
  sq->first_lb = p0 / fx->ratio / fx->bs;
  for (int i = 0; i < MAX_CLB; i++)
    sq->blocks[i] = -1;
  sq->kv = xmalloc((size_t)MAX_POS * fx->w * sizeof(float));
  sq->s = xmalloc((size_t)MAX_POS * fx->w * sizeof(float));
  sq->ikv = xmalloc((size_t)MAX_POS * 256 * sizeof(float));
  sq->is = xmalloc((size_t)MAX_POS * 256 * sizeof(float));
}

static void cseq_free(cseq_t *sq) {
  free(sq->kv);
  free(sq->s);
  free(sq->ikv);
  free(sq->is);
}

static void cbatch_free(cbatch_t *b) {
  free(b->positions);
  free(b->seg_p0);
  free(b->seg_c_first_lb);
  free(b->tok_seg);
  free(b->c_block_table);
  free(b->seg_slot);
  free(b->seg_cbt_off);
  free(b->seg_cbt_len);
  free(b->ckv);
  free(b->ikv);
  free(b->iw);
  free(b->iq);
  memset(b, 0, sizeof(*b));
}

/* Segments seqs[i] x lens[i], each continuing its sequence, with tables that reach the last entry
 * the batch makes visible (blocks handed out from a shuffled list); random inputs. */
static void cbatch_build(cfx_t *fx, cbatch_t *b, cseq_t **seqs, const uint32_t *lens,
                         uint32_t n_segs) {
  memset(b, 0, sizeof(*b));
  b->n_segs = n_segs;
  for (uint32_t s = 0; s < n_segs; s++)
    b->n += lens[s];
  b->positions = xmalloc(b->n * sizeof(int64_t));
  b->tok_seg = xmalloc(b->n * sizeof(int32_t));
  b->seg_p0 = xmalloc(n_segs * sizeof(int64_t));
  b->seg_c_first_lb = xmalloc(n_segs * sizeof(int64_t));
  b->seg_slot = xmalloc(n_segs * sizeof(uint32_t));
  b->seg_cbt_off = xmalloc(n_segs * sizeof(uint32_t));
  b->seg_cbt_len = xmalloc(n_segs * sizeof(uint32_t));
  b->c_block_table = xmalloc((size_t)n_segs * MAX_CLB * sizeof(int32_t));
  uint32_t t = 0;
  for (uint32_t s = 0; s < n_segs; s++) {
    cseq_t *sq = seqs[s];
    int64_t last = sq->next + lens[s] - 1;
    assert_true(last < MAX_POS);
    int64_t last_entry = (last + 1) / fx->ratio - 1;
    int64_t n_lb = last_entry >= sq->p0 / fx->ratio ? last_entry / fx->bs - sq->first_lb + 1 : 0;
    assert_true(n_lb <= MAX_CLB);
    b->seg_p0[s] = sq->p0;
    b->seg_slot[s] = sq->slot;
    b->seg_c_first_lb[s] = sq->first_lb;
    b->seg_cbt_off[s] = b->c_bt_entries;
    b->seg_cbt_len[s] = (uint32_t)n_lb;
    for (int64_t i = 0; i < n_lb; i++) {
      if (sq->blocks[i] < 0) {
        assert_true(fx->n_free > 0);
        sq->blocks[i] = fx->free_ids[--fx->n_free];
      }
      b->c_block_table[b->c_bt_entries++] = sq->blocks[i];
    }
    for (int64_t p = sq->next; p <= last; p++, t++) {
      b->positions[t] = p;
      b->tok_seg[t] = (int32_t)s;
    }
  }
  b->ckv = random_floats((size_t)b->n * 2 * fx->w, -2.0f, 2.0f);
  b->ikv = random_floats((size_t)b->n * 512, -2.0f, 2.0f);
  /* Gates spread wider than kv, so the pooling weights differ a lot between rows. */
  for (uint32_t i = 0; i < b->n; i++) {
    for (uint32_t c = 0; c < fx->w; c++)
      b->ckv[(size_t)i * 2 * fx->w + fx->w + c] *= 2.0f;
    for (uint32_t c = 0; c < 256; c++)
      b->ikv[(size_t)i * 512 + 256 + c] *= 2.0f;
  }
}

static dsv4_compress_args_t cargs(const cfx_t *fx, const cbatch_t *b) {
  dsv4_compress_args_t a = {
      .ratio = fx->ratio,
      .n_tokens = b->n,
      .n_segments = b->n_segs,
      .positions = b->positions,
      .tok_seg = b->tok_seg,
      .seg_p0 = b->seg_p0,
      .seg_slot = b->seg_slot,
      .ckv = b->ckv,
      .ikv = fx->ratio == 4 ? b->ikv : NULL,
      .ring = fx->ring,
      .n_slots = fx->n_slots,
      .ape = fx->ape,
      .norm_weight = fx->norm_w,
      .i_ape = fx->ratio == 4 ? fx->i_ape : NULL,
      .i_norm_weight = fx->ratio == 4 ? fx->i_norm_w : NULL,
      .eps = fx->eps,
      .rope = fx->rope,
      .seg_c_first_lb = b->seg_c_first_lb,
      .seg_cbt_off = b->seg_cbt_off,
      .seg_cbt_len = b->seg_cbt_len,
      .c_block_table = b->c_block_table,
      .c_bt_entries = b->c_bt_entries,
      .c_cache = fx->c_cache,
      .i_cache = fx->ratio == 4 ? fx->i_cache : NULL,
      .c_n_blocks = fx->n_blocks,
      .block_size = fx->bs,
      .stride = fx->stride,
  };
  return a;
}

/* Pools channels c < nch of entry j from the sequence's full history (SPEC §8.3's row list). */
static void model_pool_entry(const cfx_t *fx, const cseq_t *sq, int64_t j, const float *kvh,
                             const float *sh, uint32_t width, uint32_t nch, float *z) {
  const int64_t r = fx->ratio, lo = sq->p0 > 0 ? sq->p0 : 0;
  static float s[256], kv[256];
  for (uint32_t c = 0; c < nch; c++) {
    int n = 0;
    if (r == 4)
      for (int64_t q = 4 * j - 4; q < 4 * j; q++)
        if (q >= lo) {
          s[n] = sh[q * width + c];
          kv[n++] = kvh[q * width + c];
        }
    uint32_t off = r == 4 ? nch : 0;
    for (int64_t q = r * j; q < r * j + r; q++)
      if (q >= lo) {
        s[n] = sh[q * width + off + c];
        kv[n++] = kvh[q * width + off + c];
      }
    z[c] = model_pool(s, kv, n);
  }
}

/* Entry j's records into the expected caches. */
static void model_emit(cfx_t *fx, const cseq_t *sq, int64_t j) {
  const float *cs = dsv4_rope_table_row(fx->rope, j * fx->ratio);
  float z[512];
  uint8_t rec[584];
  model_pool_entry(fx, sq, j, sq->kv, sq->s, fx->w, 512, z);
  model_record(z, fx->norm_w, fx->eps, cs, rec);
  int32_t blk = sq->blocks[j / fx->bs - sq->first_lb];
  assert_true(blk >= 0);
  uint64_t o = (uint64_t)j % fx->bs;
  uint8_t *base = fx->exp_c + (uint64_t)blk * fx->stride;
  memcpy(base + 576 * o, rec, 576);
  memcpy(base + 576 * fx->bs + 8 * o, rec + 576, 8);
  if (fx->ratio != 4)
    return;
  model_pool_entry(fx, sq, j, sq->ikv, sq->is, 256, 128, z);
  model_index_record(z, fx->i_norm_w, fx->eps, cs, rec);
  uint8_t *ib = fx->exp_i + (uint64_t)blk * DSV4_INDEX_BLOCK_BYTES(fx->bs);
  memcpy(ib + 64 * o, rec, 64);
  memcpy(ib + 64 * fx->bs + 4 * o, rec + 64, 4);
}

/* The SPEC token by token: the row into the history and the expected ring, then the emission. */
static void model_apply(cfx_t *fx, const cbatch_t *b, cseq_t **seqs) {
  for (uint32_t t = 0; t < b->n; t++) {
    cseq_t *sq = seqs[b->tok_seg[t]];
    int64_t p = b->positions[t];
    assert_true(p == sq->next);
    const float *in = b->ckv + (size_t)t * 2 * fx->w;
    float *ring = fx->exp_ring + sq->slot * fx->ring_floats;
    float *row = ring + (uint64_t)(p % fx->rr) * 2 * fx->w;
    for (uint32_t c = 0; c < fx->w; c++) {
      sq->kv[p * fx->w + c] = in[c];
      sq->s[p * fx->w + c] = in[fx->w + c] + fx->ape[(p % fx->ratio) * fx->w + c];
      row[c] = sq->kv[p * fx->w + c];
      row[fx->w + c] = sq->s[p * fx->w + c];
    }
    if (fx->ratio == 4) {
      const float *iin = b->ikv + (size_t)t * 512;
      float *irow = ring + 8 * 2048 + (uint64_t)(p % 8) * 512;
      for (uint32_t c = 0; c < 256; c++) {
        sq->ikv[p * 256 + c] = iin[c];
        sq->is[p * 256 + c] = iin[256 + c] + fx->i_ape[(p % 4) * 256 + c];
        irow[c] = sq->ikv[p * 256 + c];
        irow[256 + c] = sq->is[p * 256 + c];
      }
    }
    if ((p + 1) % fx->ratio == 0)
      model_emit(fx, sq, p / fx->ratio);
    sq->next = p + 1;
  }
}

/* Every byte of the caches and rings equals the model's image. */
static void expect_image(const cfx_t *fx, const char *what) {
  size_t cbytes = fx->n_blocks * fx->stride, ibytes = fx->n_blocks * DSV4_INDEX_BLOCK_BYTES(fx->bs);
  size_t rbytes = fx->n_slots * fx->ring_floats * sizeof(float);
  for (size_t i = 0; i < cbytes; i++)
    if (fx->c_cache[i] != fx->exp_c[i])
      fail_msg("%s: c_cache block %zu byte %zu: %#x, want %#x", what, i / fx->stride,
               i % fx->stride, fx->c_cache[i], fx->exp_c[i]);
  for (size_t i = 0; i < ibytes; i++)
    if (fx->i_cache[i] != fx->exp_i[i])
      fail_msg("%s: i_cache block %zu byte %zu: %#x, want %#x", what,
               i / DSV4_INDEX_BLOCK_BYTES(fx->bs), i % DSV4_INDEX_BLOCK_BYTES(fx->bs),
               fx->i_cache[i], fx->exp_i[i]);
  if (memcmp(fx->ring, fx->exp_ring, rbytes) != 0)
    fail_msg("%s: the rings differ from the model's", what);
}

/* The launch, then the model: the op must give the model's image of every buffer. */
static void compress_run(cfx_t *fx, const cbatch_t *b, cseq_t **seqs, const char *what) {
  dsv4_compress_args_t a = cargs(fx, b);
  assert_int_equal(fx->be->ops->compress(fx->be, &a), 0);
  model_apply(fx, b, seqs);
  expect_image(fx, what);
}

static void compress_step(cfx_t *fx, cseq_t **seqs, const uint32_t *lens, uint32_t n_segs,
                          const char *what) {
  cbatch_t b;
  cbatch_build(fx, &b, seqs, lens, n_segs);
  compress_run(fx, &b, seqs, what);
  cbatch_free(&b);
}

/* The configurations every op test runs under: thread counts and kernel levels. */
typedef struct {
  unsigned threads;
  int isa; /* -1: the best level of this machine */
} config_t;

static const config_t configs[] = {{1, DSV4__CPU_ISA_SCALAR}, {4, -1}, {3, DSV4__CPU_ISA_AVX2}};
#define N_CONFIGS (sizeof(configs) / sizeof(configs[0]))

/* Opens the fixture under configuration i; 0 when this machine lacks the configuration's level. */
static int cfx_open_config(cfx_t *fx, size_t i, uint32_t ratio, uint32_t bs, uint32_t n_blocks) {
  cfx_open(fx, ratio, bs, n_blocks, configs[i].threads);
  if (configs[i].isa >= 0 && dsv4__cpu_backend_set_isa(fx->be, configs[i].isa) != 0) {
    cfx_close(fx);
    return 0;
  }
  return 1;
}

/* The final buffers of the first configuration, which every later one must reproduce. */
typedef struct {
  uint8_t *c, *i;
  float *ring;
  size_t cbytes, ibytes, rbytes;
} image_t;

static void image_check(image_t *im, const cfx_t *fx, const char *what) {
  size_t cbytes = fx->n_blocks * fx->stride, ibytes = fx->n_blocks * DSV4_INDEX_BLOCK_BYTES(fx->bs);
  size_t rbytes = fx->n_slots * fx->ring_floats * sizeof(float);
  if (!im->c) {
    im->c = xmalloc(cbytes);
    im->i = xmalloc(ibytes);
    im->ring = xmalloc(rbytes);
    memcpy(im->c, fx->c_cache, cbytes);
    memcpy(im->i, fx->i_cache, ibytes);
    memcpy(im->ring, fx->ring, rbytes);
    im->cbytes = cbytes;
    im->ibytes = ibytes;
    im->rbytes = rbytes;
    return;
  }
  assert_int_equal(im->cbytes, cbytes);
  if (memcmp(im->c, fx->c_cache, cbytes) || memcmp(im->i, fx->i_cache, ibytes) ||
      memcmp(im->ring, fx->ring, rbytes))
    fail_msg("%s: the buffers differ between configurations", what);
}

static void image_free(image_t *im) {
  free(im->c);
  free(im->i);
  free(im->ring);
}

/*
 * Ratio 4, block size 16: sequences from p0 = 0 (slots out of order), p0 = 5 (the first entry has
 * no previous window at or after p0) and p0 = 37; segments of 1 to 200 tokens, so emissions take
 * rows from earlier batches through the ring, entries cross block boundaries, and a prefill emits
 * dozens of entries at once.
 */
static void test_compress_ratio4(void **state) {
  (void)state;
  image_t im = {0};
  for (size_t cfg = 0; cfg < N_CONFIGS; cfg++) {
    rng_state = 0x1234567887654321ull;
    cfx_t fx;
    if (!cfx_open_config(&fx, cfg, 4, 16, 64))
      continue;
    cseq_t A, B, C, D;
    cseq_init(&fx, &A, 0, 3);
    cseq_init(&fx, &B, 5, 0);
    cseq_init(&fx, &C, 0, 5);
    cseq_init(&fx, &D, 37, 1);
    cseq_t *s1[] = {&A, &B, &C};
    compress_step(&fx, s1, (const uint32_t[]){7, 3, 1}, 3, "ratio 4, batch 1");
    cseq_t *s2[] = {&A, &B, &C, &D};
    compress_step(&fx, s2, (const uint32_t[]){1, 6, 2, 3}, 4, "ratio 4, batch 2");
    cseq_t *s3[] = {&A, &D, &B, &C};
    compress_step(&fx, s3, (const uint32_t[]){130, 1, 1, 61}, 4, "ratio 4, batch 3");
    cseq_t *s4[] = {&C, &B, &A, &D};
    compress_step(&fx, s4, (const uint32_t[]){1, 2, 3, 200}, 4, "ratio 4, batch 4");
    cseq_t *s5[] = {&D};
    compress_step(&fx, s5, (const uint32_t[]){1}, 1, "ratio 4, decode");
    image_check(&im, &fx, "ratio 4");
    cseq_free(&A);
    cseq_free(&B);
    cseq_free(&C);
    cseq_free(&D);
    cfx_close(&fx);
  }
  image_free(&im);
}

/* Ratio 128: windows that straddle batches (rows 0..99 from the ring, 100..127 from the batch),
 * p0 = 100 and p0 = 130 (partial first windows), and prefills emitting two entries. */
static void test_compress_ratio128(void **state) {
  (void)state;
  image_t im = {0};
  for (size_t cfg = 0; cfg < N_CONFIGS; cfg++) {
    rng_state = 0x0F1E2D3C4B5A6978ull;
    cfx_t fx;
    if (!cfx_open_config(&fx, cfg, 128, 16, 16))
      continue;
    cseq_t A, B, C;
    cseq_init(&fx, &A, 0, 2);
    cseq_init(&fx, &B, 100, 4);
    cseq_init(&fx, &C, 130, 0);
    cseq_t *s1[] = {&A, &B, &C};
    compress_step(&fx, s1, (const uint32_t[]){100, 28, 1}, 3, "ratio 128, batch 1");
    cseq_t *s2[] = {&C, &A, &B};
    compress_step(&fx, s2, (const uint32_t[]){200, 50, 1}, 3, "ratio 128, batch 2");
    cseq_t *s3[] = {&A, &B, &C};
    compress_step(&fx, s3, (const uint32_t[]){300, 300, 2}, 3, "ratio 128, batch 3");
    image_check(&im, &fx, "ratio 128");
    cseq_free(&A);
    cseq_free(&B);
    cseq_free(&C);
    cfx_close(&fx);
  }
  image_free(&im);
}

/* The stored records of entry j equal those of the given pooled values. */
static void expect_entry(const cfx_t *fx, const cseq_t *sq, int64_t j, const float *z,
                         const float *zi) {
  const float *cs = dsv4_rope_table_row(fx->rope, j * fx->ratio);
  uint8_t rec[584];
  model_record(z, fx->norm_w, fx->eps, cs, rec);
  int32_t blk = sq->blocks[j / fx->bs - sq->first_lb];
  uint64_t o = (uint64_t)j % fx->bs;
  const uint8_t *base = fx->c_cache + (uint64_t)blk * fx->stride;
  assert_memory_equal(base + 576 * o, rec, 576);
  assert_memory_equal(base + 576 * fx->bs + 8 * o, rec + 576, 8);
  if (!zi)
    return;
  model_index_record(zi, fx->i_norm_w, fx->eps, cs, rec);
  const uint8_t *ib = fx->i_cache + (uint64_t)blk * DSV4_INDEX_BLOCK_BYTES(fx->bs);
  assert_memory_equal(ib + 64 * o, rec, 64);
  assert_memory_equal(ib + 64 * fx->bs + 4 * o, rec + 64, 4);
}

/*
 * Pooling through the op on hand-worked inputs: every score equal (ape 0, gate constant), so every
 * weight is 1 and z is the plain mean of the rows the SPEC names, exact in fp32. Rows the SPEC
 * excludes hold values (1000 + c, or ring garbage) that would change every channel.
 */
static void hand_inputs(const cfx_t *fx, const cbatch_t *b, float (*kv_of)(int64_t p, uint32_t c)) {
  for (uint32_t t = 0; t < b->n; t++) {
    float *in = b->ckv + (size_t)t * 2 * fx->w, *iin = b->ikv + (size_t)t * 512;
    uint32_t half = fx->ratio == 4 ? 512 : 0;
    for (uint32_t c = 0; c < fx->w; c++) {
      in[c] = c >= half ? kv_of(b->positions[t], c - half) : 1000.0f + (float)c;
      in[fx->w + c] = 0.25f;
    }
    for (uint32_t c = 0; c < 256; c++) {
      iin[c] = c >= 128 ? kv_of(b->positions[t], c - 128) : 1000.0f + (float)c;
      iin[256 + c] = 0.25f;
    }
  }
}

static float kv_first_window(int64_t p, uint32_t c) {
  return (float)(p + 1) * 0.5f + (float)c * 0.25f;
}

static float kv_linear(int64_t p, uint32_t c) {
  return (float)c * 0.25f + (float)(p % 128);
}

static void test_compress_hand(void **state) {
  (void)state;
  float z[512], zi[128];
  for (int ratio = 4; ratio <= 128; ratio *= 32) {
    cfx_t fx;
    cfx_open(&fx, (uint32_t)ratio, 16, 8, 2);
    memset(fx.ape, 0, (size_t)ratio * fx.w * sizeof(float));
    memset(fx.i_ape, 0, 4 * 256 * sizeof(float));
    cseq_t A, B;
    cbatch_t b;
    cseq_init(&fx, &A, 0, 1);
    cseq_init(&fx, &B, ratio == 4 ? 6 : 100, 2);
    cseq_t *ss[] = {&A, &B};
    /* Ratio 4: A's entry 0 has no previous window: the mean of (p + 1) / 2 + c / 4 over p = 0..3.
     * B starts at p0 = 6: its entry 1 pools rows 6 and 7 alone (c / 4 + 6, c / 4 + 7). Ratio 128:
     * A emits nothing yet (4 tokens); B pools rows 100..127 alone (c / 4 + 113.5). */
    uint32_t lens[] = {4, ratio == 4 ? 2 : 28};
    cbatch_build(&fx, &b, ss, lens, 2);
    hand_inputs(&fx, &b, ratio == 4 ? kv_first_window : kv_linear);
    if (ratio == 4)
      for (uint32_t t = 4; t < 6; t++)
        for (uint32_t c = 0; c < 512; c++) {
          b.ckv[(size_t)t * 2048 + 512 + c] = kv_linear(b.positions[t], c);
          if (c < 128)
            b.ikv[(size_t)t * 512 + 128 + c] = kv_linear(b.positions[t], c);
        }
    compress_run(&fx, &b, ss, "hand-worked pooling");
    if (ratio == 4) {
      for (uint32_t c = 0; c < 512; c++)
        z[c] = 1.25f + (float)c * 0.25f;
      for (uint32_t c = 0; c < 128; c++)
        zi[c] = z[c];
      expect_entry(&fx, &A, 0, z, zi);
      for (uint32_t c = 0; c < 512; c++)
        z[c] = (float)c * 0.25f + 6.5f;
      for (uint32_t c = 0; c < 128; c++)
        zi[c] = z[c];
      expect_entry(&fx, &B, 1, z, zi);
    } else {
      for (uint32_t c = 0; c < 512; c++)
        z[c] = (float)c * 0.25f + 113.5f;
      expect_entry(&fx, &B, 0, z, NULL);
    }
    cbatch_free(&b);
    cseq_free(&A);
    cseq_free(&B);
    cfx_close(&fx);
  }
}

/* A launch that must be refused: DSV4_EINVAL and every buffer as it was. */
static void expect_compress_refused(cfx_t *fx, const dsv4_compress_args_t *a, const char *what) {
  int rc = fx->be->ops->compress(fx->be, a);
  if (rc != DSV4_EINVAL)
    fail_msg("%s: compress returned %d, want DSV4_EINVAL", what, rc);
  expect_image(fx, what);
}

static void test_compress_refused(void **state) {
  (void)state;
  cfx_t fx;
  cfx_open(&fx, 4, 16, 8, 2);
  cseq_t A, B;
  cseq_init(&fx, &A, 0, 0);
  cseq_init(&fx, &B, 0, 1);
  cseq_t *ss[] = {&A, &B};
  compress_step(&fx, ss, (const uint32_t[]){3, 2}, 2, "before the refusals");
  /* A emits entries 0 and 1 (positions 3 and 7) before B emits its entry 0 (position 3): B's
   * block is checked before A's records are written. */
  cbatch_t b;
  cbatch_build(&fx, &b, ss, (const uint32_t[]){5, 2}, 2);
  const dsv4_compress_args_t good = cargs(&fx, &b);
  dsv4_compress_args_t a;
  const uint32_t saved_len = b.seg_cbt_len[1];
  const int32_t saved_block = b.c_block_table[b.seg_cbt_off[1]];

  b.seg_cbt_len[1] = 0;
  expect_compress_refused(&fx, &good, "an emission whose block is not in the table");
  b.seg_cbt_len[1] = saved_len;
  b.c_block_table[b.seg_cbt_off[1]] = -1;
  expect_compress_refused(&fx, &good, "an emission whose table entry is -1");
  b.c_block_table[b.seg_cbt_off[1]] = (int32_t)fx.n_blocks;
  expect_compress_refused(&fx, &good, "an emission whose block is past the pool");
  b.c_block_table[b.seg_cbt_off[1]] = saved_block;
  b.seg_c_first_lb[1] = 1;
  expect_compress_refused(&fx, &good, "a table that starts after the entry");
  b.seg_c_first_lb[1] = 0;
  a = good;
  a.c_bt_entries = b.seg_cbt_off[1];
  expect_compress_refused(&fx, &a, "a segment's table past c_bt_entries");

  b.seg_slot[1] = b.seg_slot[0];
  expect_compress_refused(&fx, &good, "two segments with one state slot");
  b.seg_slot[1] = fx.n_slots;
  expect_compress_refused(&fx, &good, "a state slot past n_slots");
  b.seg_slot[1] = B.slot;

  b.positions[6] += 1;
  expect_compress_refused(&fx, &good, "a segment with a gap in its positions");
  b.positions[6] -= 1;
  b.tok_seg[0] = 1;
  expect_compress_refused(&fx, &good, "a segment split in two runs");
  b.tok_seg[0] = 0;
  b.tok_seg[6] = 2;
  expect_compress_refused(&fx, &good, "a token of a segment that does not exist");
  b.tok_seg[6] = 1;
  b.seg_p0[0] = 4;
  expect_compress_refused(&fx, &good, "a position below p0");
  b.seg_p0[0] = -1;
  expect_compress_refused(&fx, &good, "a negative p0");
  b.seg_p0[0] = 0;

  dsv4_rope_table_t *bare;
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv_freq);
  assert_int_equal(dsv4_rope_table_create(inv_freq, DSV4_MAX_POSITION_DEFAULT, &bare), 0);
  a = good;
  a.rope = bare;
  expect_compress_refused(&fx, &a, "an emission whose RoPE row is not materialised");
  dsv4_rope_table_destroy(bare);

  a = good;
  a.ratio = 8;
  expect_compress_refused(&fx, &a, "ratio 8");
  a = good;
  a.ikv = NULL;
  expect_compress_refused(&fx, &a, "ratio 4 without ikv");
  a = good;
  a.i_cache = NULL;
  expect_compress_refused(&fx, &a, "ratio 4 without i_cache");
  a = good;
  a.ring = NULL;
  expect_compress_refused(&fx, &a, "no ring");
  a = good;
  a.stride += 576;
  expect_compress_refused(&fx, &a, "a wrong stride");
  a = good;
  a.block_size = 24;
  expect_compress_refused(&fx, &a, "block size 24");
  a = good;
  a.n_slots = 0;
  expect_compress_refused(&fx, &a, "no state slots");
  assert_int_equal(dsv4_backend_check_compress_args(NULL), DSV4_EINVAL);
  /* Zero tokens need no pointers and change nothing. */
  dsv4_compress_args_t none = {.ratio = 128, .block_size = 64};
  assert_int_equal(fx.be->ops->compress(fx.be, &none), 0);
  expect_image(&fx, "an empty launch");

  /* The batch itself is fine: unchanged, it is applied. */
  compress_run(&fx, &b, ss, "after the refusals");
  cbatch_free(&b);
  cseq_free(&A);
  cseq_free(&B);
  cfx_close(&fx);
}

/* ---- the indexer ---- */

static void cbatch_index_inputs(cbatch_t *b, uint32_t heads) {
  b->heads = heads;
  b->iq = xmalloc((size_t)b->n * heads * 128 * sizeof(uint16_t));
  for (size_t i = 0; i < (size_t)b->n * heads * 128; i++)
    b->iq[i] = dsv4_f32_to_bf16(rnd_unit() * 4.0f);
  b->iw = random_floats((size_t)b->n * heads, -1.0f, 1.0f);
}

static dsv4_indexer_args_t iargs(const cfx_t *fx, const cbatch_t *b, uint32_t topk, int32_t *sel) {
  dsv4_indexer_args_t a = {
      .n_tokens = b->n,
      .n_segments = b->n_segs,
      .topk = topk,
      .n_heads = b->heads,
      .w_scale = u2f(DSV4_INDEX_W_SCALE_BITS),
      .positions = b->positions,
      .tok_seg = b->tok_seg,
      .seg_p0 = b->seg_p0,
      .iq = b->iq,
      .iw = b->iw,
      .rope = fx->rope,
      .seg_c_first_lb = b->seg_c_first_lb,
      .seg_cbt_off = b->seg_cbt_off,
      .seg_cbt_len = b->seg_cbt_len,
      .c_block_table = b->c_block_table,
      .c_bt_entries = b->c_bt_entries,
      .i_cache = fx->i_cache,
      .c_n_blocks = fx->n_blocks,
      .block_size = fx->bs,
      .sel = sel,
  };
  return a;
}

typedef struct {
  float score;
  int32_t j;
} scored_t;

static int by_score_then_entry(const void *x, const void *y) {
  const scored_t *a = x, *b = y;
  if (a->score != b->score)
    return a->score > b->score ? -1 : 1;
  return a->j < b->j ? -1 : a->j > b->j;
}

static int by_entry(const void *x, const void *y) {
  int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
  return a < b ? -1 : a > b;
}

/* Brute force: every visible entry scored as the SPEC spells it, sorted, the first topk kept. */
static void model_select(const cfx_t *fx, const dsv4_indexer_args_t *a, uint32_t t, int32_t *sel) {
  const uint32_t s = (uint32_t)a->tok_seg[t];
  const int64_t p = a->positions[t], jlo = a->seg_p0[s] / 4, jhi = (p + 1) / 4;
  const int64_t n = jhi > jlo ? jhi - jlo : 0;
  for (uint32_t k = 0; k < a->topk; k++)
    sel[k] = -1;
  if (n <= (int64_t)a->topk) {
    for (int64_t k = 0; k < n; k++)
      sel[k] = (int32_t)(jlo + k);
    return;
  }
  static float qhat[128][128], w[128];
  const float *cs = dsv4_rope_table_row(fx->rope, p);
  for (uint32_t h = 0; h < a->n_heads; h++) {
    model_index_query(a->iq + ((size_t)t * a->n_heads + h) * 128, cs, qhat[h]);
    w[h] = a->iw[(size_t)t * a->n_heads + h] * a->w_scale;
  }
  scored_t *all = xmalloc((size_t)n * sizeof(scored_t));
  for (int64_t i = 0; i < n; i++) {
    int64_t j = jlo + i, lb = j / fx->bs;
    int32_t blk = a->c_block_table[a->seg_cbt_off[s] + (lb - a->seg_c_first_lb[s])];
    const uint8_t *ib = fx->i_cache + (uint64_t)blk * DSV4_INDEX_BLOCK_BYTES(fx->bs);
    float k[128];
    model_mxfp4_dequant(ib + 64 * (j % fx->bs), ib + 64 * fx->bs + 4 * (j % fx->bs), k);
    float score = 0.0f;
    for (uint32_t h = 0; h < a->n_heads; h++) {
      float d = model_chains(qhat[h], k, 8);
      score = fmaf(w[h], d > 0.0f ? d : 0.0f, score);
    }
    all[i].score = score;
    all[i].j = (int32_t)j;
  }
  qsort(all, (size_t)n, sizeof(scored_t), by_score_then_entry);
  for (uint32_t k = 0; k < a->topk; k++)
    sel[k] = all[k].j;
  qsort(sel, a->topk, sizeof(int32_t), by_entry);
  free(all);
}

static void expect_selection(const cfx_t *fx, const dsv4_indexer_args_t *a, const char *what) {
  int32_t *want = xmalloc(a->topk * sizeof(int32_t));
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    model_select(fx, a, t, want);
    for (uint32_t k = 0; k < a->topk; k++)
      if (a->sel[(size_t)t * a->topk + k] != want[k])
        fail_msg("%s: token %u (position %lld) sel[%u] = %d, want %d", what, t,
                 (long long)a->positions[t], k, a->sel[(size_t)t * a->topk + k], want[k]);
  }
  free(want);
}

/* Two sequences compressed over a few batches, then the last batch's tokens select. */
typedef struct {
  cfx_t fx;
  cseq_t A, B;
  cbatch_t last;
} ix_t;

static void ix_open(ix_t *x, unsigned threads, uint32_t heads) {
  cfx_open(&x->fx, 4, 16, 64, threads);
  cseq_init(&x->fx, &x->A, 0, 0);
  cseq_init(&x->fx, &x->B, 37, 1);
  cseq_t *ss[] = {&x->A, &x->B};
  compress_step(&x->fx, ss, (const uint32_t[]){150, 100}, 2, "indexer history");
  cbatch_build(&x->fx, &x->last, ss, (const uint32_t[]){50, 30}, 2);
  compress_run(&x->fx, &x->last, ss, "indexer batch");
  cbatch_index_inputs(&x->last, heads);
}

static void ix_close(ix_t *x) {
  cbatch_free(&x->last);
  cseq_free(&x->A);
  cseq_free(&x->B);
  cfx_close(&x->fx);
}

/* With at most topk visible entries every one is selected (no scores), then -1 padding. */
static void test_indexer_all_visible(void **state) {
  (void)state;
  ix_t x;
  ix_open(&x, 2, 64);
  const uint32_t topk = 64;
  int32_t *sel = xmalloc((size_t)x.last.n * topk * sizeof(int32_t));
  memset(sel, 0x55, (size_t)x.last.n * topk * sizeof(int32_t));
  dsv4_indexer_args_t a = iargs(&x.fx, &x.last, topk, sel);
  assert_int_equal(x.fx.be->ops->indexer(x.fx.be, &a), 0);
  for (uint32_t t = 0; t < a.n_tokens; t++) {
    int64_t p = a.positions[t], jlo = a.seg_p0[a.tok_seg[t]] / 4, jhi = (p + 1) / 4;
    for (uint32_t k = 0; k < topk; k++)
      assert_int_equal(sel[(size_t)t * topk + k], jlo + k < jhi ? (int32_t)(jlo + k) : -1);
  }
  expect_selection(&x.fx, &a, "all visible");
  /* No score is computed, so no block is read: an empty table and no RoPE rows still select. */
  uint32_t saved[2] = {x.last.seg_cbt_len[0], x.last.seg_cbt_len[1]};
  x.last.seg_cbt_len[0] = x.last.seg_cbt_len[1] = 0;
  dsv4_rope_table_t *bare;
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv_freq);
  assert_int_equal(dsv4_rope_table_create(inv_freq, DSV4_MAX_POSITION_DEFAULT, &bare), 0);
  a.rope = bare;
  memset(sel, 0x55, (size_t)x.last.n * topk * sizeof(int32_t));
  assert_int_equal(x.fx.be->ops->indexer(x.fx.be, &a), 0);
  expect_selection(&x.fx, &a, "all visible, no table");
  dsv4_rope_table_destroy(bare);
  x.last.seg_cbt_len[0] = saved[0];
  x.last.seg_cbt_len[1] = saved[1];
  /* Positions 0..2 see no entry at all: a row of -1. */
  cseq_t C;
  cbatch_t b;
  cseq_init(&x.fx, &C, 0, 2);
  cseq_t *sc[] = {&C};
  cbatch_build(&x.fx, &b, sc, (const uint32_t[]){3}, 1);
  cbatch_index_inputs(&b, 64);
  a = iargs(&x.fx, &b, topk, sel);
  assert_int_equal(x.fx.be->ops->indexer(x.fx.be, &a), 0);
  for (uint32_t k = 0; k < 3 * topk; k++)
    assert_int_equal(sel[k], -1);
  cbatch_free(&b);
  cseq_free(&C);
  free(sel);
  ix_close(&x);
}

/* Sets every backend's kernel level; 0 when this machine lacks it. */
static int set_level(dsv4_backend_t **be, int n, int isa) {
  for (int i = 0; i < n; i++)
    if (dsv4__cpu_backend_set_isa(be[i], isa) != 0)
      return 0;
  return 1;
}

/*
 * More visible entries than topk: the brute-force selection, with 64 heads and with 5, 17 and 128
 * (partial quads and groups of heads), and the same selection from 1, 2 and 4 threads at every
 * kernel level. Segment B's entries start at 9 (not a multiple of the vector levels' 16 lanes) and
 * the tokens see every count of entries from 25 to 50.
 */
static void test_indexer_brute_force(void **state) {
  (void)state;
  static const uint32_t topks[] = {8, 20, 36};
  static const uint32_t heads[] = {64, 5, 17, 128};
  for (int hi = 0; hi < 4; hi++) {
    ix_t x;
    ix_open(&x, 2, heads[hi]);
    dsv4_backend_t *be[3] = {x.fx.be, NULL, NULL};
    dsv4_backend_options_t o1 = {.threads = 1}, o4 = {.threads = 4};
    char why[256];
    assert_int_equal(dsv4_backend_open("cpu", &o1, &be[1], why, sizeof(why)), 0);
    assert_int_equal(dsv4_backend_open("cpu", &o4, &be[2], why, sizeof(why)), 0);
    for (int ki = 0; ki < 3; ki++) {
      const uint32_t topk = topks[ki];
      size_t bytes = (size_t)x.last.n * topk * sizeof(int32_t);
      int32_t *sel = xmalloc(bytes), *sel2 = xmalloc(bytes);
      dsv4_indexer_args_t a = iargs(&x.fx, &x.last, topk, sel);
      assert_true(set_level(be, 3, DSV4__CPU_ISA_SCALAR));
      assert_int_equal(be[0]->ops->indexer(be[0], &a), 0);
      expect_selection(&x.fx, &a, "brute force");
      for (int isa = DSV4__CPU_ISA_SCALAR; isa < DSV4__CPU_ISA_COUNT; isa++) {
        if (!set_level(be, 3, isa))
          continue;
        for (int bi = 0; bi < 3; bi++) {
          memset(sel2, 0x55, bytes);
          a.sel = sel2;
          assert_int_equal(be[bi]->ops->indexer(be[bi], &a), 0);
          if (memcmp(sel, sel2, bytes) != 0)
            fail_msg("brute force, %u heads, topk %u: level %s, backend %d differs from scalar",
                     heads[hi], topk, dsv4__cpu_isa_name(isa), bi);
        }
      }
      free(sel);
      free(sel2);
    }
    dsv4_backend_close(be[1]);
    dsv4_backend_close(be[2]);
    ix_close(&x);
  }
}

/*
 * Constructed index records for ties, at every kernel level: head 0 weighs 1, head 1 weighs 0.
 * Entries holding R, the MXFP4 form of head 0's own q^, score w * |q^|^2 > 0; zero records score
 * +0; -R scores +0 too (the ReLU). The selection must take the positive ones, then the lowest
 * entries among the ties.
 */
static void test_indexer_ties(void **state) {
  (void)state;
  cfx_t fx;
  cfx_open(&fx, 4, 16, 8, 2);
  cseq_t A;
  cseq_init(&fx, &A, 0, 0);
  A.next = 79; /* entries 0..19 are visible to position 79 */
  cseq_t *ss[] = {&A};
  cbatch_t b;
  cbatch_build(&fx, &b, ss, (const uint32_t[]){1}, 1);
  cbatch_index_inputs(&b, 2);
  b.iw[0] = 1.0f;
  b.iw[1] = 0.0f;
  float qhat[128];
  uint8_t rec[68], neg[68];
  model_index_query(b.iq, dsv4_rope_table_row(fx.rope, 79), qhat);
  model_mxfp4(qhat, rec, rec + 64);
  memcpy(neg, rec, 68);
  for (int i = 0; i < 64; i++)
    neg[i] ^= 0x88;
  static const struct {
    const char *what;
    uint32_t topk;
    int with[4];
    int negative;
    int32_t want[5];
  } cases[] = {
      {"three positive, then the lowest zeros", 5, {3, 9, 12, -1}, 0, {0, 1, 3, 9, 12}},
      {"negative dots are all ties at zero", 5, {3, 9, 12, -1}, 1, {0, 1, 2, 3, 4}},
      {"four equal positive scores for three places", 3, {2, 5, 11, 17}, 0, {2, 5, 11}},
  };
  int32_t sel[5];
  for (size_t n = 0; n < DSV4__CPU_ISA_COUNT * sizeof(cases) / sizeof(cases[0]); n++) {
    const size_t c = n % (sizeof(cases) / sizeof(cases[0]));
    const int isa = (int)(n / (sizeof(cases) / sizeof(cases[0])));
    if (!set_level(&fx.be, 1, isa))
      continue;
    for (int j = 0; j < 20; j++) {
      int32_t blk = A.blocks[j / 16];
      uint8_t *ib = fx.i_cache + (uint64_t)blk * DSV4_INDEX_BLOCK_BYTES(16);
      const uint8_t *src = NULL;
      for (int k = 0; k < 4; k++)
        if (cases[c].with[k] == j)
          src = cases[c].negative ? neg : rec;
      memset(ib + 64 * (j % 16), 0, 64);
      memset(ib + 64 * 16 + 4 * (j % 16), 127, 4);
      if (src) {
        memcpy(ib + 64 * (j % 16), src, 64);
        memcpy(ib + 64 * 16 + 4 * (j % 16), src + 64, 4);
      }
    }
    dsv4_indexer_args_t a = iargs(&fx, &b, cases[c].topk, sel);
    assert_int_equal(fx.be->ops->indexer(fx.be, &a), 0);
    for (uint32_t k = 0; k < cases[c].topk; k++)
      if (sel[k] != cases[c].want[k])
        fail_msg("%s (%s): sel[%u] = %d, want %d", cases[c].what, dsv4__cpu_isa_name(isa), k,
                 sel[k], cases[c].want[k]);
    expect_selection(&fx, &a, cases[c].what);
  }
  cbatch_free(&b);
  cseq_free(&A);
  cfx_close(&fx);
}

static void expect_indexer_refused(dsv4_backend_t *be, const dsv4_indexer_args_t *a, int32_t *sel,
                                   size_t bytes, const char *what) {
  memset(sel, 0x55, bytes);
  int rc = be->ops->indexer(be, a);
  if (rc != DSV4_EINVAL)
    fail_msg("%s: indexer returned %d, want DSV4_EINVAL", what, rc);
  for (size_t i = 0; i < bytes; i++)
    if (((const uint8_t *)sel)[i] != 0x55)
      fail_msg("%s: sel was written", what);
}

static void test_indexer_refused(void **state) {
  (void)state;
  ix_t x;
  ix_open(&x, 2, 8);
  const uint32_t topk = 8;
  size_t bytes = (size_t)x.last.n * topk * sizeof(int32_t);
  int32_t *sel = xmalloc(bytes);
  dsv4_backend_t *be = x.fx.be;
  cbatch_t *b = &x.last;
  const dsv4_indexer_args_t good = iargs(&x.fx, b, topk, sel);
  dsv4_indexer_args_t a;
  /* The last token of B scores entries 9..41: its table must reach entry 41. */
  uint32_t saved_len = b->seg_cbt_len[1];
  b->seg_cbt_len[1] = 2;
  expect_indexer_refused(be, &good, sel, bytes, "a scored entry's block not in the table");
  b->seg_cbt_len[1] = saved_len;
  int32_t saved_block = b->c_block_table[b->seg_cbt_off[1] + 1];
  b->c_block_table[b->seg_cbt_off[1] + 1] = -1;
  expect_indexer_refused(be, &good, sel, bytes, "a scored entry's table entry is -1");
  b->c_block_table[b->seg_cbt_off[1] + 1] = (int32_t)x.fx.n_blocks;
  expect_indexer_refused(be, &good, sel, bytes, "a scored entry's block past the pool");
  b->c_block_table[b->seg_cbt_off[1] + 1] = saved_block;
  a = good;
  a.c_bt_entries = b->c_bt_entries - 1;
  expect_indexer_refused(be, &a, sel, bytes, "a table past c_bt_entries");
  b->seg_p0[0] = 180;
  expect_indexer_refused(be, &good, sel, bytes, "a position below p0");
  b->seg_p0[0] = 0;
  b->tok_seg[3] = 2;
  expect_indexer_refused(be, &good, sel, bytes, "a token of a segment that does not exist");
  b->tok_seg[3] = 0;
  dsv4_rope_table_t *bare;
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv_freq);
  assert_int_equal(dsv4_rope_table_create(inv_freq, DSV4_MAX_POSITION_DEFAULT, &bare), 0);
  a = good;
  a.rope = bare;
  expect_indexer_refused(be, &a, sel, bytes, "a scoring token's RoPE row not materialised");
  dsv4_rope_table_destroy(bare);
  a = good;
  a.topk = 0;
  expect_indexer_refused(be, &a, sel, bytes, "topk 0");
  a = good;
  a.n_heads = 0;
  expect_indexer_refused(be, &a, sel, bytes, "no heads");
  a = good;
  a.n_heads = 129;
  expect_indexer_refused(be, &a, sel, bytes, "129 heads");
  a = good;
  a.iq = NULL;
  expect_indexer_refused(be, &a, sel, bytes, "no iq");
  a = good;
  a.block_size = 8;
  expect_indexer_refused(be, &a, sel, bytes, "block size 8");
  a = good;
  a.sel = NULL;
  assert_int_equal(be->ops->indexer(be, &a), DSV4_EINVAL);
  assert_int_equal(dsv4_backend_check_indexer_args(NULL), DSV4_EINVAL);
  dsv4_indexer_args_t none = {.topk = 1, .n_heads = 64, .block_size = 64};
  assert_int_equal(be->ops->indexer(be, &none), 0);
  /* The launch itself is fine. */
  assert_int_equal(be->ops->indexer(be, &good), 0);
  expect_selection(&x.fx, &good, "after the refusals");
  free(sel);
  ix_close(&x);
}

/* ---- the vector levels of the indexer against the scalar level's functions ---- */

static const int vector_levels[] = {DSV4__CPU_ISA_AVX2, DSV4__CPU_ISA_AVX512};

static void *xalloc64(size_t n) {
  void *p = aligned_alloc(64, (n + 63) / 64 * 64);
  assert_non_null(p);
  return p;
}

static void level_queries(int isa, const uint16_t *iq, uint32_t heads, const float *cs, float *qt) {
#if defined(__x86_64__)
  if (isa == DSV4__CPU_ISA_AVX512)
    dsv4__cpu_index_queries_avx512(iq, heads, cs, qt);
  else
    dsv4__cpu_index_queries_avx2(iq, heads, cs, qt);
#else
  (void)isa, (void)iq, (void)heads, (void)cs, (void)qt;
  fail_msg("no vector levels on this machine");
#endif
}

static void level_scan(int isa, const dsv4__cpu_index_scan_t *scan) {
#if defined(__x86_64__)
  if (isa == DSV4__CPU_ISA_AVX512)
    dsv4__cpu_index_scan_avx512(scan);
  else
    dsv4__cpu_index_scan_avx2(scan);
#else
  (void)isa, (void)scan;
  fail_msg("no vector levels on this machine");
#endif
}

/*
 * One head's iq by kind: 0 random values up to 2^8; 1 every bf16 exponent from zero and subnormals
 * to 2^31 (just under the wire's bound 2^32), zeros and negative zeros among them; 2 zeros but for
 * two unrotated dims, so the 128 outputs of the Hadamard transform take only two magnitudes.
 */
static void query_inputs(uint16_t *iq, int kind) {
  for (int d = 0; d < 128; d++) {
    if (kind == 0)
      iq[d] = dsv4_f32_to_bf16(ldexpf(rnd_unit(), (int)(rng() % 9)));
    else if (kind == 1)
      iq[d] = (uint16_t)((rng() & 0x807fu) | ((rng() % 159) << 7));
    else
      iq[d] = 0;
  }
  if (kind == 1)
    iq[rng() % 128] = 0x8000;
  if (kind == 2) {
    iq[rng() % 64] = dsv4_f32_to_bf16((float)(rng() % 64 + 1) * 0.5f);
    iq[rng() % 64] = dsv4_f32_to_bf16(-(float)(rng() % 64 + 1) * 0.5f);
  }
}

/* The e2m1 ties (0.25, 0.75, ... 5 after the block's scaling) that dsv4_index_query meets. */
static int query_ties(const uint16_t *iq, const float *cs) {
  float x[128];
  int ties = 0;
  for (int d = 0; d < 128; d++)
    x[d] = dsv4_bf16_to_f32(iq[d]);
  dsv4_index_rope(x, cs);
  dsv4_hadamard128(x);
  for (int b = 0; b < 4; b++) {
    float amax = u2f(DSV4_MXFP4_AMAX_FLOOR_BITS);
    for (int k = 0; k < 32; k++)
      amax = fabsf(x[32 * b + k]) > amax ? fabsf(x[32 * b + k]) : amax;
    int e = dsv4_mxfp4_exponent(amax);
    for (int k = 0; k < 32; k++) {
      float t = fabsf(ldexpf(x[32 * b + k], -e));
      ties += t == 0.25f || t == 0.75f || t == 1.25f || t == 1.75f || t == 2.5f || t == 3.5f ||
              t == 5.0f;
    }
  }
  return ties;
}

/*
 * q^ of every vector level equals dsv4_index_query's (the scalar level's) bit for bit, head by
 * head, for head counts that leave partial groups of 8 and 16, inputs of every magnitude the wire
 * allows, and three RoPE rows; the heads past the last up to a multiple of 16 are zero. The inputs
 * meet the e2m1 ties (counted, so the test knows it covers them).
 */
static void test_index_queries_levels(void **state) {
  (void)state;
  static const uint32_t heads[] = {1, 5, 8, 9, 16, 17, 31, 64, 128};
  static const int64_t positions[] = {0, 4711, 1000003};
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *rope;
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv_freq);
  assert_int_equal(dsv4_rope_table_create(inv_freq, DSV4_MAX_POSITION_DEFAULT, &rope), 0);
  assert_int_equal(dsv4_rope_table_ensure(rope, positions, 3), 0);
  uint16_t *iq = xmalloc(128 * 128 * sizeof(uint16_t));
  float *qt = xalloc64(128 * 128 * sizeof(float)), want[128];
  int ties = 0, ran = 0;
  for (size_t li = 0; li < 2; li++) {
    const int isa = vector_levels[li];
    if (!dsv4__cpu_isa_supported(isa))
      continue;
    for (size_t hi = 0; hi < sizeof(heads) / sizeof(heads[0]); hi++)
      for (int kind = 0; kind < 3; kind++)
        for (int pi = 0; pi < 3; pi++) {
          const float *cs = dsv4_rope_table_row(rope, positions[pi]);
          const uint32_t padded = (heads[hi] + 15) / 16 * 16;
          for (uint32_t h = 0; h < heads[hi]; h++)
            query_inputs(iq + 128 * h, kind);
          memset(qt, 0x7f, padded * 128 * sizeof(float));
          level_queries(isa, iq, heads[hi], cs, qt);
          ran++;
          for (uint32_t h = 0; h < padded; h++) {
            if (h < heads[hi]) {
              dsv4_index_query(iq + 128 * h, cs, want);
              ties += query_ties(iq + 128 * h, cs);
            } else {
              memset(want, 0, sizeof(want));
            }
            for (int d = 0; d < 128; d++) {
              float got = qt[(h / 16) * 16 * 128 + 16 * d + h % 16];
              if (f2u(got) != f2u(want[d]))
                fail_msg("%s q^, %u heads, kind %d, position %lld: head %u dim %d is %a, want %a",
                         dsv4__cpu_isa_name(isa), heads[hi], kind, (long long)positions[pi], h, d,
                         (double)got, (double)want[d]);
            }
          }
        }
  }
  if (ran)
    assert_true(ties > 100);
  free(iq);
  free(qt);
  dsv4_rope_table_destroy(rope);
}

/* Index blocks of bs 64 holding random records: codes around 127, and runs of equal records (and
 * of zero records) whose scores tie across lanes. */
static uint8_t *scan_records(uint32_t n_blocks) {
  const size_t bb = DSV4_INDEX_BLOCK_BYTES(64);
  uint8_t *cache = xmalloc(n_blocks * bb);
  for (uint32_t j = 0; j < 64 * n_blocks; j++) {
    uint8_t *blk = cache + (j / 64) * bb, *vals = blk + 64 * (j % 64);
    uint8_t *codes = blk + 64 * 64 + 4 * (j % 64);
    if (j % 37 >= 30) {
      /* A run of 7 copies of entry j - 1 (or zeros), across the groups of 16. */
      uint32_t src = j - 1;
      const uint8_t *sb = cache + (src / 64) * bb;
      memcpy(vals, sb + 64 * (src % 64), 64);
      memcpy(codes, sb + 64 * 64 + 4 * (src % 64), 4);
      if (j % 74 >= 67)
        memset(vals, 0, 64);
      continue;
    }
    fill_bytes(vals, 64);
    for (int b = 0; b < 4; b++)
      codes[b] = (uint8_t)(120 + rng() % 14);
  }
  return cache;
}

/* The scalar level's score of entry j (dsv4-compress.h's functions, in cpu_compress.c's order). */
static float scan_want(const uint8_t *cache, uint32_t j, const float *qhat, const float *w,
                       uint32_t heads) {
  const uint8_t *blk = cache + (j / 64) * DSV4_INDEX_BLOCK_BYTES(64);
  float k[128], acc = 0.0f;
  dsv4_mxfp4_dequant128(blk + 64 * (j % 64), blk + 64 * 64 + 4 * (j % 64), k);
  for (uint32_t h = 0; h < heads; h++)
    acc = dsv4_index_score_add(w[h], dsv4_dot128(qhat + 128 * h, k), acc);
  return acc;
}

/*
 * The scores of every vector level equal the scalar level's bit for bit: runs that start at every
 * lane offset of a group (lead) and hold 1 to 447 entries (so every tail length of the groups of
 * 16 and of the AVX-512 passes of 64), 1 to 128 heads (partial quads), over records with ties
 * across lanes. No score outside the run is written.
 */
static void test_index_scan_levels(void **state) {
  (void)state;
  static const uint32_t heads[] = {1, 3, 4, 5, 16, 17, 64, 128};
  static const uint32_t runs[][2] = {{0, 1},  {0, 16},  {0, 17}, {5, 11}, {5, 12},  {15, 1},
                                     {15, 2}, {9, 100}, {0, 64}, {1, 63}, {3, 200}, {0, 447}};
  const uint32_t n_blocks = 8;
  uint8_t *cache = scan_records(n_blocks);
  uint16_t *iq = xmalloc(128 * 128 * sizeof(uint16_t));
  float *qhat = xmalloc(128 * 128 * sizeof(float)), *w = xmalloc(128 * sizeof(float));
  float *qt = xalloc64(128 * 128 * sizeof(float));
  float *work = xalloc64(DSV4__CPU_INDEX_WORK_FLOATS * sizeof(float));
  float *scores = xmalloc(512 * sizeof(float));
  dsv4__cpu_index_group_t groups[40];
  float cs[64];
  for (int i = 0; i < 64; i++)
    cs[i] = i < 32 ? 1.0f : 0.0f;
  for (uint32_t h = 0; h < 128; h++) {
    query_inputs(iq + 128 * h, 0);
    dsv4_index_query(iq + 128 * h, cs, qhat + 128 * h);
    w[h] = rnd_unit() * u2f(DSV4_INDEX_W_SCALE_BITS);
  }
  for (size_t li = 0; li < 2; li++) {
    const int isa = vector_levels[li];
    if (!dsv4__cpu_isa_supported(isa))
      continue;
    for (size_t hi = 0; hi < sizeof(heads) / sizeof(heads[0]); hi++) {
      level_queries(isa, iq, heads[hi], cs, qt);
      for (size_t ri = 0; ri < sizeof(runs) / sizeof(runs[0]); ri++) {
        const uint32_t lead = runs[ri][0], n = runs[ri][1], e0 = 64 + lead;
        for (uint32_t g = 0; 16 * g < lead + n; g++) {
          uint32_t j = 64 + 16 * g;
          const uint8_t *blk = cache + (j / 64) * DSV4_INDEX_BLOCK_BYTES(64);
          groups[g].vals = blk + 64 * (j % 64);
          groups[g].codes = blk + 64 * 64 + 4 * (j % 64);
        }
        memset(scores, 0x55, 512 * sizeof(float));
        dsv4__cpu_index_scan_t scan = {.qt = qt,
                                       .w = w,
                                       .n_heads = heads[hi],
                                       .groups = groups,
                                       .lead = lead,
                                       .n = n,
                                       .scores = scores,
                                       .work = work};
        level_scan(isa, &scan);
        for (uint32_t i = 0; i < 512; i++) {
          float want = i < n ? scan_want(cache, e0 + i, qhat, w, heads[hi]) : u2f(0x55555555u);
          if (f2u(scores[i]) != f2u(want))
            fail_msg("%s scan, %u heads, lead %u, %u entries: score %u is %a, want %a",
                     dsv4__cpu_isa_name(isa), heads[hi], lead, n, i, (double)scores[i],
                     (double)want);
        }
      }
    }
  }
  free(cache);
  free(iq);
  free(qhat);
  free(w);
  free(qt);
  free(work);
  free(scores);
}

static void level_pool(int isa, const dsv4__cpu_pool_row_t *rows, uint32_t n, uint32_t channels,
                       float *z) {
#if defined(__x86_64__)
  if (isa == DSV4__CPU_ISA_AVX512)
    dsv4__cpu_pool_rows_avx512(rows, n, channels, z);
  else
    dsv4__cpu_pool_rows_avx2(rows, n, channels, z);
#else
  (void)isa, (void)rows, (void)n, (void)channels, (void)z;
  fail_msg("no vector levels on this machine");
#endif
}

/*
 * The pooled z of every vector level equals dsv4_pool_channel's (the scalar level's) bit for bit,
 * before any rounding to bf16 hides a difference: 1 to 128 rows, rows of this batch (score plus
 * ape) mixed with ring rows, scores spread so that some weights underflow to zero and some rows
 * tie for the max, at the 512 and 128 channels of the two compressors.
 */
static void test_pool_rows_levels(void **state) {
  (void)state;
  static const uint32_t ns[] = {1, 2, 3, 7, 8, 64, 127, 128};
  float *kv = xmalloc(128 * 512 * sizeof(float)), *sc = xmalloc(128 * 512 * sizeof(float));
  float *ape = xmalloc(128 * 512 * sizeof(float)), z[512], s1[128], kv1[128];
  dsv4__cpu_pool_row_t rows[128];
  for (size_t i = 0; i < 128 * 512; i++) {
    kv[i] = ldexpf(rnd_unit(), (int)(rng() % 20) - 10);
    sc[i] = rnd_unit() * (i % 3 ? 8.0f : 120.0f);
    ape[i] = rnd_unit();
  }
  for (int c = 0; c < 512; c += 5)
    sc[512 * 3 + c] = sc[c]; /* rows 0 and 3 tie for the max in some channels */
  for (size_t li = 0; li < 2; li++) {
    const int isa = vector_levels[li];
    if (!dsv4__cpu_isa_supported(isa))
      continue;
    for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++)
      for (uint32_t channels = 128; channels <= 512; channels += 384) {
        const uint32_t n = ns[ni];
        for (uint32_t k = 0; k < n; k++)
          rows[k] = (dsv4__cpu_pool_row_t){
              .kv = kv + 512 * k, .s = sc + 512 * k, .ape = k % 3 == 1 ? NULL : ape + 512 * k};
        memset(z, 0x55, sizeof(z));
        level_pool(isa, rows, n, channels, z);
        for (uint32_t c = 0; c < 512; c++) {
          for (uint32_t k = 0; k < n; k++) {
            s1[k] = rows[k].ape ? rows[k].s[c] + rows[k].ape[c] : rows[k].s[c];
            kv1[k] = rows[k].kv[c];
          }
          float want = c < channels ? dsv4_pool_channel(s1, kv1, (dsv4_i32)n) : u2f(0x55555555u);
          if (f2u(z[c]) != f2u(want))
            fail_msg("%s pooling, %u rows, %u channels: z[%u] is %a, want %a",
                     dsv4__cpu_isa_name(isa), n, channels, c, (double)z[c], (double)want);
        }
      }
  }
  free(kv);
  free(sc);
  free(ape);
}

/*
 * Decode batches smaller than the thread count score each token in pieces (more than 1024 visible
 * entries), and larger ones token by token: both give the brute-force selection at every level.
 * Two sequences see 1141 entries from entry 37 (not a multiple of 16) and 1101 from entry 0, with
 * 17 heads of positive weights. Six records in ten are zero, so fewer than 512 entries score above
 * zero and the 512th place falls inside the tie at zero, which spans lanes, groups and pieces: the
 * lower entries must win (checked: some zero records are selected and some are not).
 */
static void test_indexer_pieces(void **state) {
  (void)state;
  cfx_t fx;
  cfx_open(&fx, 4, 64, 40, 4);
  const uint32_t topk = 512, heads = 17, lbs[2] = {19, 18};
  uint8_t *records = scan_records(19);
  uint8_t zero[19 * 64];
  for (uint32_t j = 0; j < 19 * 64; j++) {
    zero[j] = (uint8_t)(((j * 2654435761u) >> 7) % 10 < 6);
    if (zero[j])
      memset(records + (j / 64) * DSV4_INDEX_BLOCK_BYTES(64) + 64 * (j % 64), 0, 64);
  }
  int64_t positions[2] = {4711, 4403}, seg_p0[2] = {148, 0}, first_lb[2] = {0, 0};
  int32_t tok_seg[2] = {0, 1}, table[37];
  uint32_t bt_off[2] = {0, 19}, bt_len[2] = {19, 18};
  for (uint32_t s = 0, i = 0; s < 2; s++)
    for (uint32_t lb = 0; lb < lbs[s]; lb++, i++) {
      table[i] = fx.free_ids[--fx.n_free];
      memcpy(fx.i_cache + (uint64_t)table[i] * DSV4_INDEX_BLOCK_BYTES(64),
             records + (size_t)lb * DSV4_INDEX_BLOCK_BYTES(64), DSV4_INDEX_BLOCK_BYTES(64));
    }
  assert_int_equal(dsv4_rope_table_ensure(fx.rope, positions, 2), 0);
  cbatch_t b = {.n = 2, .n_segs = 2};
  cbatch_index_inputs(&b, heads);
  for (uint32_t i = 0; i < 2 * heads; i++)
    b.iw[i] = fabsf(b.iw[i]) + 0.125f;
  dsv4_indexer_args_t a = {.n_tokens = 2,
                           .n_segments = 2,
                           .topk = topk,
                           .n_heads = heads,
                           .w_scale = u2f(DSV4_INDEX_W_SCALE_BITS),
                           .positions = positions,
                           .tok_seg = tok_seg,
                           .seg_p0 = seg_p0,
                           .iq = b.iq,
                           .iw = b.iw,
                           .rope = fx.rope,
                           .seg_c_first_lb = first_lb,
                           .seg_cbt_off = bt_off,
                           .seg_cbt_len = bt_len,
                           .c_block_table = table,
                           .c_bt_entries = 37,
                           .i_cache = fx.i_cache,
                           .c_n_blocks = fx.n_blocks,
                           .block_size = 64};
  int32_t *sel = xmalloc(2 * topk * sizeof(int32_t));
  dsv4_backend_t *be[2] = {fx.be, NULL};
  dsv4_backend_options_t o1 = {.threads = 1};
  char why[256];
  assert_int_equal(dsv4_backend_open("cpu", &o1, &be[1], why, sizeof(why)), 0);
  for (int isa = DSV4__CPU_ISA_SCALAR; isa < DSV4__CPU_ISA_COUNT; isa++) {
    if (!set_level(be, 2, isa))
      continue;
    for (uint32_t n_tokens = 1; n_tokens <= 2; n_tokens++)
      for (int bi = 0; bi < 2; bi++) {
        a.n_tokens = n_tokens;
        a.sel = sel;
        memset(sel, 0x55, 2 * topk * sizeof(int32_t));
        assert_int_equal(be[bi]->ops->indexer(be[bi], &a), 0);
        expect_selection(&fx, &a, bi ? "one thread" : "pieces");
        for (uint32_t t = 0; t < n_tokens; t++) {
          uint32_t taken = 0, all = 0;
          for (uint32_t k = 0; k < topk; k++)
            taken += zero[sel[t * topk + k]];
          for (int64_t j = seg_p0[t] / 4; j < (positions[t] + 1) / 4; j++)
            all += zero[j];
          assert_true(taken > 0 && taken < all);
        }
      }
  }
  dsv4_backend_close(be[1]);
  free(sel);
  free(records);
  free(b.iq);
  free(b.iw);
  cfx_close(&fx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_e2m1_ties),
      cmocka_unit_test(test_mxfp4_exponent),
      cmocka_unit_test(test_mxfp4_blocks),
      cmocka_unit_test(test_hadamard),
      cmocka_unit_test(test_reductions),
      cmocka_unit_test(test_pool_channel),
      cmocka_unit_test(test_compress_ratio4),
      cmocka_unit_test(test_compress_ratio128),
      cmocka_unit_test(test_compress_hand),
      cmocka_unit_test(test_compress_refused),
      cmocka_unit_test(test_indexer_all_visible),
      cmocka_unit_test(test_indexer_brute_force),
      cmocka_unit_test(test_indexer_ties),
      cmocka_unit_test(test_indexer_refused),
      cmocka_unit_test(test_index_queries_levels),
      cmocka_unit_test(test_index_scan_levels),
      cmocka_unit_test(test_pool_rows_levels),
      cmocka_unit_test(test_indexer_pieces),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
