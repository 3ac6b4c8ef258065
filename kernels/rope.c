#include "rope.h"

#include <assert.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"

const dsv4_rope_params_t dsv4_rope_plain_default = {
    .theta = 10000.0,
    .yarn = 0,
    .factor = 1.0,
    .original_max_position = 0.0,
    .beta_fast = 32.0,
    .beta_slow = 1.0,
};

const dsv4_rope_params_t dsv4_rope_yarn_default = {
    .theta = 160000.0,
    .yarn = 1,
    .factor = 16.0,
    .original_max_position = 65536.0,
    .beta_fast = 32.0,
    .beta_slow = 1.0,
};

/* SPEC §2.3, plain (theta 10000): what vLLM computes on NVIDIA GPUs. */
static const uint32_t plain_inv_freq_bits[DSV4_ROPE_PAIRS] = {
    0x3f800000, 0x3f3ff911, 0x3f0ff59a, 0x3ed7e89b, 0x3ea1e89b, 0x3e72d423, 0x3e361887, 0x3e088d77,
    0x3dcccccd, 0x3d99940d, 0x3d6655c2, 0x3d2cba16, 0x3d0186e3, 0x3cc2434f, 0x3c91ad39, 0x3c5a7bf2,
    0x3c23d70a, 0x3bf5b9b0, 0x3bb8449c, 0x3b8a2e77, 0x3b4f3e38, 0x3b1b690d, 0x3ae91528, 0x3aaec98e,
    0x3a83126f, 0x3a44948d, 0x3a136a16, 0x39dd1725, 0x39a5cb60, 0x3978a815, 0x393a7753, 0x390bd472,
};

/* SPEC §2.3, YaRN (theta 160000, factor 16, original length 65536, beta 32/1, no mscale). */
static const uint32_t yarn_inv_freq_bits[DSV4_ROPE_PAIRS] = {
    0x3f800000, 0x3f300a3a, 0x3ef21c1f, 0x3ea67d01, 0x3e64f92e, 0x3e1d7475, 0x3dd88cb4, 0x3d94e963,
    0x3d4ccccd, 0x3d0cd4fb, 0x3cc1b019, 0x3c8530ce, 0x3c372dbf, 0x3bfbed88, 0x3bad3d5e, 0x3b6e4237,
    0x3b147ae1, 0x3ab714e0, 0x3a5ebdb6, 0x3a0530ce, 0x399bb3af, 0x39305978, 0x38be904d, 0x383e9b5f,
    0x37a3d70c, 0x36b443d0, 0x3677eba6, 0x362a7be8, 0x35ea77ff, 0x35a13bdc, 0x355dbf30, 0x35187c4d,
};

static int params_equal(const dsv4_rope_params_t *a, const dsv4_rope_params_t *b) {
  if (a->theta != b->theta || (a->yarn != 0) != (b->yarn != 0))
    return 0;
  /* The YaRN fields mean nothing for a plain table, so they need not match there. */
  if (!a->yarn)
    return 1;
  return a->factor == b->factor && a->original_max_position == b->original_max_position &&
         a->beta_fast == b->beta_fast && a->beta_slow == b->beta_slow;
}

static void bits_to_floats(const uint32_t *bits, float *out) {
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++)
    memcpy(&out[i], &bits[i], sizeof(float));
}

void dsv4_rope_inv_freq(const dsv4_rope_params_t *p, float inv_freq[DSV4_ROPE_PAIRS]) {
  if (params_equal(p, &dsv4_rope_plain_default))
    bits_to_floats(plain_inv_freq_bits, inv_freq);
  else if (params_equal(p, &dsv4_rope_yarn_default))
    bits_to_floats(yarn_inv_freq_bits, inv_freq);
  else
    dsv4_rope_inv_freq_recipe(p, inv_freq);
}

/* The YaRN correction dimension of SPEC §2.3, in double as vLLM computes it. */
static double yarn_corr_dim(double n_rot, double theta, double original) {
  const double two_pi = 6.283185307179586;
  return ((double)DSV4_ROPE_DIM * log(original / (n_rot * two_pi))) / (2.0 * log(theta));
}

void dsv4_rope_inv_freq_recipe(const dsv4_rope_params_t *p, float inv_freq[DSV4_ROPE_PAIRS]) {
  float base[DSV4_ROPE_PAIRS], extrap[DSV4_ROPE_PAIRS];
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    /* The exponent is an fp32 quotient, as torch.arange(0, dim, 2).float() / dim gives it. */
    float ex = (float)(2 * i) / (float)DSV4_ROPE_DIM;
    base[i] = (float)pow(p->theta, (double)ex);
    extrap[i] = 1.0f / base[i];
  }
  if (!p->yarn) {
    memcpy(inv_freq, extrap, sizeof(extrap));
    return;
  }
  double low = floor(yarn_corr_dim(p->beta_fast, p->theta, p->original_max_position));
  double high = ceil(yarn_corr_dim(p->beta_slow, p->theta, p->original_max_position));
  if (low < 0.0)
    low = 0.0;
  if (high > (double)(DSV4_ROPE_DIM - 1))
    high = (double)(DSV4_ROPE_DIM - 1);
  if (low == high)
    high += 0.001; /* avoids a division by zero in the ramp, as the reference does */
  float flow = (float)low, span = (float)(high - low), ffactor = (float)p->factor;
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float interp = 1.0f / (ffactor * base[i]);
    float ramp = ((float)i - flow) / span;
    if (ramp < 0.0f)
      ramp = 0.0f;
    if (ramp > 1.0f)
      ramp = 1.0f;
    float mask = 1.0f - ramp;
    float a = interp * (1.0f - mask);
    float b = extrap[i] * mask;
    inv_freq[i] = a + b;
  }
}

/*
 * Correct rounding of cos and sin to fp32. A double result from libm is within about one double ulp
 * of the true value, so rounding it to fp32 can only go wrong when it lies within a few double ulps
 * of a midpoint between two floats. That happens for roughly one evaluation in 2^25; those are
 * redone in long double (64-bit significand on x86-64), which settles all but about one in 2^36 of
 * them again, and the rest are settled by a double-double evaluation with an exact argument
 * reduction.
 */

/* Nonzero when d (a normal double whose magnitude is a normal float) is within slack double ulps
 * of a midpoint between two adjacent floats, i.e. when its low 29 significand bits are near 2^28.
 */
static int near_float_midpoint(double d, int64_t slack) {
  uint64_t u;
  memcpy(&u, &d, sizeof(u));
  int64_t low = (int64_t)(u & ((UINT64_C(1) << 29) - 1));
  int64_t off = low - (INT64_C(1) << 28);
  return off <= slack && off >= -slack;
}

/* The midpoint test for a long double v and its float rounding f, valid for any magnitude. */
static int near_float_midpoint_l(long double v, float f, long double slack_ulps) {
  float g = nextafterf(f, (long double)f < v ? INFINITY : -INFINITY);
  long double mid = ((long double)f + (long double)g) * 0.5L;
  long double ulp = fabsl(v) * LDBL_EPSILON;
  return fabsl(v - mid) <= slack_ulps * ulp;
}

/* Double-double helpers for the last-resort evaluation. */
typedef struct {
  double hi, lo;
} dd_t;

static dd_t dd_two_sum(double a, double b) {
  double s = a + b;
  double bb = s - a;
  double err = (a - (s - bb)) + (b - bb);
  return (dd_t){s, err};
}

static dd_t dd_add(dd_t a, dd_t b) {
  dd_t s = dd_two_sum(a.hi, b.hi);
  dd_t t = dd_two_sum(a.lo, b.lo);
  s.lo += t.hi;
  s = dd_two_sum(s.hi, s.lo);
  s.lo += t.lo;
  return dd_two_sum(s.hi, s.lo);
}

static dd_t dd_mul(dd_t a, dd_t b) {
  double p = a.hi * b.hi;
  double e = fma(a.hi, b.hi, -p);
  e += a.hi * b.lo + a.lo * b.hi;
  return dd_two_sum(p, e);
}

/* a / b for a double b, to double-double accuracy: the remainder of the first quotient is exact. */
static dd_t dd_div_d(dd_t a, double b) {
  double q1 = a.hi / b;
  double rem = fma(-q1, b, a.hi) + a.lo;
  return dd_two_sum(q1, rem / b);
}

/*
 * cos and sin of a float x to about 100 bits. x has 24 significant bits and |x| < 2^64 is assumed
 * far larger than any angle the daemon meets (pos < 2^40, inv_freq <= 1 gives |x| < 2^40): pi/2 is
 * split into three 53-bit pieces so that k * pi/2 is formed with exact fma products for k < 2^40.
 */
static void dd_cos_sin(float xf, dd_t *c_out, dd_t *s_out) {
  const double pio2_1 = 0x1.921fb54442d18p+0;
  const double pio2_2 = 0x1.1a62633145c07p-54;
  const double pio2_3 = -0x1.f1976b7ed8fbcp-110;
  double x = (double)xf;
  double k = nearbyint(x * 0x1.45f306dc9c883p-1); /* x * 2/pi */
  /* r = x - k*pio2_1 - k*pio2_2 - k*pio2_3, each product kept exactly as a double-double. */
  double p1 = k * pio2_1, e1 = fma(k, pio2_1, -p1);
  double p2 = k * pio2_2, e2 = fma(k, pio2_2, -p2);
  double p3 = k * pio2_3;
  dd_t r = dd_two_sum(x, -p1); /* exact: x and p1 are close */
  r = dd_add(r, (dd_t){-e1, 0.0});
  r = dd_add(r, (dd_t){-p2, -e2});
  r = dd_add(r, (dd_t){-p3, 0.0});
  /* Taylor series on |r| <= pi/4: 27 terms are far past double-double precision. */
  dd_t r2 = dd_mul(r, r);
  dd_t sn = {1.0, 0.0}, cs = {1.0, 0.0};
  for (int n = 27; n >= 1; n--) {
    /* sin(r)/r = 1 - r^2/(2*3) (1 - r^2/(4*5) (...)); cos(r) = 1 - r^2/(1*2) (1 - ...). */
    dd_t ts = dd_mul(sn, r2), tc = dd_mul(cs, r2);
    double ds = (double)(2 * n) * (double)(2 * n + 1), dc = (double)(2 * n - 1) * (double)(2 * n);
    ts = dd_div_d(ts, -ds);
    tc = dd_div_d(tc, -dc);
    sn = dd_add((dd_t){1.0, 0.0}, ts);
    cs = dd_add((dd_t){1.0, 0.0}, tc);
  }
  sn = dd_mul(sn, r);
  long q = (long)fmod(k, 4.0);
  if (q < 0)
    q += 4;
  dd_t c = cs, s = sn;
  switch (q) {
  case 1:
    c = (dd_t){-sn.hi, -sn.lo};
    s = cs;
    break;
  case 2:
    c = (dd_t){-cs.hi, -cs.lo};
    s = (dd_t){-sn.hi, -sn.lo};
    break;
  case 3:
    c = sn;
    s = (dd_t){-cs.hi, -cs.lo};
    break;
  default:
    break;
  }
  *c_out = c;
  *s_out = s;
}

/* Round a double-double to fp32 correctly: hi alone decides unless hi is itself a midpoint. */
static float dd_to_float(dd_t v) {
  float f = (float)v.hi;
  float g = nextafterf(f, (double)f < v.hi ? INFINITY : -INFINITY);
  double mid = ((double)f + (double)g) * 0.5;
  if (v.hi == mid && v.lo != 0.0) {
    /* Exactly on a midpoint by hi: the sign of lo says on which side the true value lies. */
    float lower = f < g ? f : g, upper = f < g ? g : f;
    return v.lo > 0.0 ? upper : lower;
  }
  return f;
}

static float round_slow(float x, int want_sin) {
  long double c, s;
  sincosl((long double)x, &s, &c);
  long double v = want_sin ? s : c;
  float f = (float)v;
  if (!near_float_midpoint_l(v, f, 64.0L))
    return f;
  dd_t dc, ds;
  dd_cos_sin(x, &dc, &ds);
  return dd_to_float(want_sin ? ds : dc);
}

static inline float round_fast(double d, float x, int want_sin) {
  double a = fabs(d);
  if (a >= (double)FLT_MIN && !near_float_midpoint(d, 16))
    return (float)d;
  if (a == 0.0)
    return (float)d; /* sin(+0) = +0 exactly; no other float angle has a zero sine or cosine */
  return round_slow(x, want_sin);
}

void dsv4_rope_row_compute(const float inv_freq[DSV4_ROPE_PAIRS], int64_t pos,
                           float out[DSV4_ROPE_ROW_FLOATS]) {
  float fpos = (float)pos;
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float x = fpos * inv_freq[i]; /* the fp32 angle, one rounding */
    double s, c;
    sincos((double)x, &s, &c);
    out[i] = round_fast(c, x, 0);
    out[DSV4_ROPE_PAIRS + i] = round_fast(s, x, 1);
  }
}

struct dsv4_rope_table {
  float inv_freq[DSV4_ROPE_PAIRS];
  int64_t max_positions;
  int64_t nchunks;
  /* Published with release stores so that a reader that acquires a pointer sees its filled rows. */
  _Atomic(float *) *chunks;
  atomic_size_t bytes;
};

int dsv4_rope_table_create(const float inv_freq[DSV4_ROPE_PAIRS], int64_t max_positions,
                           dsv4_rope_table_t **out) {
  if (!out || !inv_freq || max_positions <= 0)
    return DSV4_EINVAL;
  dsv4_rope_table_t *t = calloc(1, sizeof(*t));
  if (!t)
    return DSV4_ENOMEM;
  memcpy(t->inv_freq, inv_freq, sizeof(t->inv_freq));
  t->max_positions = max_positions;
  t->nchunks = (max_positions + DSV4_ROPE_CHUNK_ROWS - 1) / DSV4_ROPE_CHUNK_ROWS;
  t->chunks = calloc((size_t)t->nchunks, sizeof(*t->chunks));
  if (!t->chunks) {
    free(t);
    return DSV4_ENOMEM;
  }
  for (int64_t c = 0; c < t->nchunks; c++)
    atomic_init(&t->chunks[c], NULL);
  atomic_init(&t->bytes, 0);
  *out = t;
  return 0;
}

void dsv4_rope_table_destroy(dsv4_rope_table_t *t) {
  if (!t)
    return;
  for (int64_t c = 0; c < t->nchunks; c++)
    free(atomic_load_explicit(&t->chunks[c], memory_order_relaxed));
  free(t->chunks);
  free(t);
}

/* Fill and publish chunk c if it is not there yet (one writer at a time, by contract). */
static int ensure_chunk(dsv4_rope_table_t *t, int64_t c) {
  if (atomic_load_explicit(&t->chunks[c], memory_order_acquire))
    return 0;
  int64_t first = c * DSV4_ROPE_CHUNK_ROWS;
  int64_t rows = t->max_positions - first;
  if (rows > DSV4_ROPE_CHUNK_ROWS)
    rows = DSV4_ROPE_CHUNK_ROWS;
  size_t bytes = (size_t)rows * DSV4_ROPE_ROW_FLOATS * sizeof(float);
  float *rowsbuf = malloc(bytes);
  if (!rowsbuf)
    return DSV4_ENOMEM;
  for (int64_t r = 0; r < rows; r++)
    dsv4_rope_row_compute(t->inv_freq, first + r, rowsbuf + r * DSV4_ROPE_ROW_FLOATS);
  atomic_store_explicit(&t->chunks[c], rowsbuf, memory_order_release);
  atomic_fetch_add_explicit(&t->bytes, bytes, memory_order_relaxed);
  return 0;
}

int dsv4_rope_table_ensure(dsv4_rope_table_t *t, const int64_t *positions, size_t n) {
  if (!t || (n && !positions))
    return DSV4_EINVAL;
  for (size_t k = 0; k < n; k++)
    if (positions[k] < 0 || positions[k] >= t->max_positions)
      return DSV4_EPOSRANGE;
  for (size_t k = 0; k < n; k++) {
    int err = ensure_chunk(t, positions[k] / DSV4_ROPE_CHUNK_ROWS);
    if (err)
      return err;
  }
  return 0;
}

int dsv4_rope_table_ensure_range(dsv4_rope_table_t *t, int64_t first, int64_t count) {
  if (!t || count < 0)
    return DSV4_EINVAL;
  if (count == 0)
    return 0;
  if (first < 0 || first >= t->max_positions || count > t->max_positions - first)
    return DSV4_EPOSRANGE;
  int64_t c0 = first / DSV4_ROPE_CHUNK_ROWS, c1 = (first + count - 1) / DSV4_ROPE_CHUNK_ROWS;
  for (int64_t c = c0; c <= c1; c++) {
    int err = ensure_chunk(t, c);
    if (err)
      return err;
  }
  return 0;
}

const float *dsv4_rope_table_row(const dsv4_rope_table_t *t, int64_t pos) {
  assert(pos >= 0 && pos < t->max_positions);
  float *chunk = atomic_load_explicit(&t->chunks[pos / DSV4_ROPE_CHUNK_ROWS], memory_order_acquire);
  assert(chunk != NULL);
  return chunk + (pos % DSV4_ROPE_CHUNK_ROWS) * DSV4_ROPE_ROW_FLOATS;
}

size_t dsv4_rope_table_bytes(const dsv4_rope_table_t *t) {
  return atomic_load_explicit(&((dsv4_rope_table_t *)t)->bytes, memory_order_relaxed);
}

int64_t dsv4_rope_table_positions(const dsv4_rope_table_t *t) {
  return t->max_positions;
}

const float *dsv4_rope_table_chunk(const dsv4_rope_table_t *t, int64_t c, int64_t *rows) {
  if (c < 0 || c >= t->nchunks)
    return NULL;
  float *chunk = atomic_load_explicit(&t->chunks[c], memory_order_acquire);
  if (chunk && rows) {
    int64_t left = t->max_positions - c * DSV4_ROPE_CHUNK_ROWS;
    *rows = left < DSV4_ROPE_CHUNK_ROWS ? left : DSV4_ROPE_CHUNK_ROWS;
  }
  return chunk;
}
