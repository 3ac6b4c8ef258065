/*
 * The index dot product on matrix units (kernels/dsv4-compress.h, "the index dot product on matrix
 * units", SPEC §8.5) against the CPU's dsv4_dot128 of the dequantised records, bit for bit.
 *
 * The CUDA indexer forms d = q^ . k^ of two MXFP4 records from MMAs over their nibbles as bf16
 * values prescaled by 2^(code - 127): each 16-dim partial is the exact sum of its 16 products,
 * rounded once to fp32 (partial mode, then dsv4_fold8), or the whole dot product is (fused mode),
 * and a pair outside the bounds of both takes dsv4_dot128 itself. The model here computes those
 * sums exactly in double (every product and every sum of 16 products of one block is exact in
 * double, and so is a fused sum within the spans it is used at) and rounds once, as the matrix
 * units do within the bounds. It is then held against the CPU:
 *
 *   - the bf16 images of the nibbles (dsv4_index_mx_bf16x4 on the byte tables of
 *     dsv4_index_mx_lut): every code in [2, 252] and every 4-nibble word, against
 *     bf16(dsv4_e2m1_to_f32(n) * 2^(code - 127)), and every nonzero image normal; the 8-nibble
 *     form (dsv4_index_mx_bf16x8) equal to the 4-nibble one on each half;
 *   - every pair of block codes (0..255 each) with a nonzero block on both sides, and with a zero
 *     block on either: a battery of inputs (all +6, prefixes that overflow and cancel, products
 *     that round on the subnormal grid, random nibbles) finds a difference between the model
 *     without any fallback and the CPU exactly where the derivation says the CPU's values or chain
 *     differ from the exact sums (a code 253..255; a code 0 with E >= -159, where the model's sum
 *     is no longer rounded to zero; E in [-159, -148] or E >= 119; against a zero block: its code
 *     255 or the other's 253..255), and the mode the kernel takes there is the scalar product (the
 *     sign of a zero is not counted: the score's ReLU maps both to +0); the mode is the documented
 *     formula of the codes everywhere, and the scalar product's pairs beyond those are counted
 *     (subnormal or flushed matrix operands: codes 1, E in [-147, -125] or below -159);
 *   - millions of random pairs from generators that mix uniform codes, realistic codes, codes at
 *     and just outside every bound, spans of 0..12 between the blocks, zero blocks (with signed
 *     zeros), all +-6 (the largest partial sums) and sparse nibbles: the model with the pair's
 *     mode equals dsv4_dot128 bit for bit, and so do the partial model wherever the CPU's window
 *     (E in [-147, 118]) holds and the fused model wherever the fold's (span <= 10, E <= 115) does;
 *   - explicit witnesses for the bounds: a prefix that overflows at E = 119 but not at 118,
 *     products that round on the subnormal grid at E = -148 but not at -147, a dot product that is
 *     an fp32 number at span 10 with the largest sums but not at span 11 (where rounding to
 *     nearest and truncating differ);
 *   - sets of 64 queries and 32 keys (the kernel's warp tile): the mode dsv4_index_mx_mode gives a
 *     set from its per-block minima, maxima and spans is allowed for every pair of the set, and the
 *     model in that mode equals dsv4_dot128 for every pair;
 *   - the kernels' first look (dsv4_index_mx_fused_glance, from the extremes over all blocks)
 *     takes fused mode only where dsv4_index_mx_mode does, on those sets and on millions of pairs
 *     of summaries near the bounds.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-compress.h"

/* An MXFP4 record: 64 value bytes (element 2i in the low nibble of byte i), 4 UE8M0 codes. */
typedef struct {
  uint8_t v[64];
  uint8_t c[4];
} rec_t;

#define TEST_RNG_SEED 0x9E3779B97F4A7C15ull
#include "test_rng.h"

static uint32_t below(uint32_t n) {
  return (uint32_t)((rng() >> 32) % n);
}

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* Equal bits, with -0 taken as +0 (the score's ReLU maps both to +0). */
static int same_score_input(float a, float b) {
  uint32_t x = f2u(a), y = f2u(b);
  return (x == 0x80000000u ? 0u : x) == (y == 0x80000000u ? 0u : y);
}

static unsigned nib(const rec_t *r, int d) {
  return (r->v[d >> 1] >> (4 * (d & 1))) & 15u;
}

static void set_nib(rec_t *r, int d, unsigned n) {
  unsigned sh = 4u * (unsigned)(d & 1);
  r->v[d >> 1] = (uint8_t)((r->v[d >> 1] & ~(15u << sh)) | ((n & 15u) << sh));
}

static uint32_t summary(const rec_t *r) {
  return dsv4_index_mx_summary(r->v, r->c);
}

/* ---- the CPU and the model ---- */

static float cpu_dot(const rec_t *q, const rec_t *k) {
  float x[128], y[128];
  dsv4_mxfp4_dequant128(q->v, q->c, x);
  dsv4_mxfp4_dequant128(k->v, k->c, y);
  return dsv4_dot128(x, y);
}

/* The prescaled value of dim d: e2m1 value * 2^(code - 127), exact in double for every code. */
static double mx_val(const rec_t *r, int d) {
  return ldexp((double)dsv4_e2m1_to_f32((dsv4_u8)nib(r, d)), (int)r->c[d / 32] - 127);
}

/* Partial l as the matrix units form it: the exact sum of its 16 products, rounded once. */
static float mx_partial(const rec_t *q, const rec_t *k, int l) {
  double s = 0.0;
  for (int i = 0; i < 16; i++)
    s += mx_val(q, 16 * l + i) * mx_val(k, 16 * l + i);
  return (float)s;
}

/* Partial mode: the eight partials, then the CPU's fold. */
static float mx_dot_partial(const rec_t *q, const rec_t *k) {
  float p[8];
  for (int l = 0; l < 8; l++)
    p[l] = mx_partial(q, k, l);
  return dsv4_fold8(p);
}

/* Fused mode: the exact dot product rounded once (exact in double for the spans it is used at). */
static float mx_dot_fused(const rec_t *q, const rec_t *k) {
  double s = 0.0;
  for (int d = 0; d < 128; d++)
    s += mx_val(q, d) * mx_val(k, d);
  return (float)s;
}

static float mx_dot_mode(const rec_t *q, const rec_t *k, int mode) {
  if (mode == DSV4_INDEX_MX_FUSED)
    return mx_dot_fused(q, k);
  if (mode == DSV4_INDEX_MX_PARTIAL)
    return mx_dot_partial(q, k);
  return cpu_dot(q, k);
}

/* The decomposed d of a pair: its mode from the two summaries, the matrix model or the fallback. */
static float mx_dot(const rec_t *q, const rec_t *k, int *mode) {
  *mode = dsv4_index_mx_pair_mode(summary(q), summary(k));
  return mx_dot_mode(q, k, *mode);
}

/* ---- the CPU's own windows (what the derivation says its numerics need) ---- */

static int block_nonzero(const rec_t *r, int b) {
  for (int d = 32 * b; d < 32 * b + 32; d++)
    if (nib(r, d) & 7u)
      return 1;
  return 0;
}

/*
 * Whether the CPU's chains round nothing: no code 255 (whose infinity makes even zeros NaN), every
 * nonzero block's code in [1, 252] (finite and not flushed to zero), and E_b in [-147, 118] for
 * every block nonzero on both sides. *span and *emax: over those blocks (0 and INT32_MIN without
 * any).
 */
static int cpu_window(const rec_t *q, const rec_t *k, int *span, int *emax) {
  int lo = INT32_MAX, hi = INT32_MIN, ok = 1;
  for (int b = 0; b < 4; b++) {
    int zq = !block_nonzero(q, b), zk = !block_nonzero(k, b);
    if (q->c[b] == 255 || k->c[b] == 255)
      ok = 0;
    if ((!zq && (q->c[b] < 1 || q->c[b] > 252)) || (!zk && (k->c[b] < 1 || k->c[b] > 252)))
      ok = 0;
    if (zq || zk)
      continue;
    int e = (int)q->c[b] + (int)k->c[b] - 254;
    if (e < -147 || e > 118)
      ok = 0;
    lo = e < lo ? e : lo;
    hi = e > hi ? e : hi;
  }
  *span = hi >= lo ? hi - lo : 0;
  *emax = hi;
  return ok;
}

/* ---- generators ---- */

static void gen_nibbles(rec_t *r, unsigned style) {
  for (int i = 0; i < 64; i++)
    r->v[i] = (uint8_t)rng();
  switch (style) {
  case 0: /* uniform */
    break;
  case 1: /* +-6 everywhere */
    for (int d = 0; d < 128; d++)
      set_nib(r, d, 7u | (below(2) << 3));
    break;
  case 2: /* +6 everywhere: the largest partial sums */
    memset(r->v, 0x77, 64);
    break;
  case 3: /* sparse: signed zeros mostly */
    for (int d = 0; d < 128; d++)
      set_nib(r, d, below(4) ? (below(2) << 3) : (unsigned)below(16));
    break;
  case 4: /* random blocks of signed zeros */
    for (int b = 0; b < 4; b++)
      if (below(3) == 0)
        for (int d = 32 * b; d < 32 * b + 32; d++)
          set_nib(r, d, below(2) << 3);
    break;
  default: /* small magnitudes: 0.5 and 1 */
    for (int d = 0; d < 128; d++)
      set_nib(r, d, (1u + below(2)) | (below(2) << 3));
    break;
  }
}

static uint8_t clamp_code(int c) {
  return (uint8_t)(c < 0 ? 0 : c > 255 ? 255 : c);
}

/* The E_b a generator aims at near a bound: one of the bounds or a neighbour. */
static int edge_e(void) {
  static const int edges[] = {-160, -159, -158, -149, -148, -147, -146, -126, -125, -124, -123,
                              -122, 0,    113,  114,  115,  116,  117,  118,  119,  120};
  return edges[below((uint32_t)(sizeof(edges) / sizeof(edges[0])))];
}

static void gen_codes(rec_t *q, rec_t *k, unsigned style) {
  switch (style) {
  case 0: /* uniform */
    for (int b = 0; b < 4; b++) {
      q->c[b] = (uint8_t)below(256);
      k->c[b] = (uint8_t)below(256);
    }
    break;
  case 1: { /* realistic: one base per vector, blocks within 1 of it */
    int bq = 110 + (int)below(30), bk = 118 + (int)below(14);
    for (int b = 0; b < 4; b++) {
      q->c[b] = clamp_code(bq + (int)below(3) - 1);
      k->c[b] = clamp_code(bk + (int)below(3) - 1);
    }
    break;
  }
  case 2: /* every block's E at or next to a bound, codes anywhere that gives it */
    for (int b = 0; b < 4; b++) {
      int e = edge_e(), cq = 1 + (int)below(254);
      int ck = e + 254 - cq;
      if (ck < 0 || ck > 255) {
        ck = ck < 0 ? 0 : 255;
        cq = e + 254 - ck;
      }
      q->c[b] = clamp_code(cq);
      k->c[b] = clamp_code(ck);
    }
    break;
  case 3: { /* spans: a base E and blocks up to 12 above it, split between q and k */
    int e0 = -130 + (int)below(250), s = (int)below(13);
    for (int b = 0; b < 4; b++) {
      int e = e0 + (b == 0 ? 0 : b == 1 ? s : (int)below((uint32_t)s + 1));
      int cq = 127 + (int)below(9) - 4 + (e - e0) / 2;
      q->c[b] = clamp_code(cq);
      k->c[b] = clamp_code(e + 254 - cq);
    }
    break;
  }
  default: /* the ends of the code range */
    for (int b = 0; b < 4; b++) {
      static const uint8_t ends[] = {0, 1, 2, 3, 125, 126, 127, 250, 251, 252, 253, 254, 255};
      q->c[b] = ends[below(sizeof(ends))];
      k->c[b] = ends[below(sizeof(ends))];
    }
    break;
  }
}

static void gen_pair(rec_t *q, rec_t *k) {
  gen_nibbles(q, below(6));
  gen_nibbles(k, below(6));
  gen_codes(q, k, below(5));
}

/* ---- the bf16 images ---- */

static void test_bf16_images(void **state) {
  (void)state;
  for (uint32_t code = DSV4_INDEX_MX_CODE_MIN; code <= DSV4_INDEX_MX_CODE_MAX; code++) {
    uint32_t lut[4];
    dsv4_index_mx_lut(code, lut);
    const float scale = dsv4_ue8m0_scale((dsv4_u8)code);
    for (uint32_t x = 0; x < 65536u; x++) {
      uint32_t b[2];
      dsv4_index_mx_bf16x4(x, lut, &b[0], &b[1]);
      for (int i = 0; i < 4; i++) {
        const uint16_t got = (uint16_t)(b[i / 2] >> (16 * (i & 1)));
        const float v = dsv4_e2m1_to_f32((dsv4_u8)((x >> (4 * i)) & 15u)) * scale;
        const uint16_t want = dsv4_f32_to_bf16(v);
        if (got != want || f2u(dsv4_bf16_to_f32(got)) != f2u(v))
          fail_msg("code %u nibbles %04x element %d: bf16 %04x, expected %04x (%a)", code, x, i,
                   got, want, (double)v);
        const uint32_t ex = (got >> 7) & 255u;
        if ((got & 0x7fffu) != 0 && (ex == 0 || ex == 255))
          fail_msg("code %u nibbles %04x element %d: %04x is not a normal bf16", code, x, i, got);
      }
    }
  }
}

/* dsv4_index_mx_bf16x8 is dsv4_index_mx_bf16x4 of each half, on every byte table: on the tables
 * of the ends and the middle of the code range each half runs through all 65536 values against a
 * random other half, on the others 2048 random ones. */
static void test_bf16x8(void **state) {
  (void)state;
  for (uint32_t code = 0; code < 256u; code++) {
    uint32_t lut[4];
    dsv4_index_mx_lut(code, lut);
    const int all = code <= 2u || code == 127u || code >= 252u;
    for (uint32_t n = 0; n < (all ? 65536u : 2048u); n++) {
      const uint32_t v = all ? n : below(65536u), r = below(65536u);
      const uint32_t xs[2] = {v | r << 16, r | v << 16};
      for (int k = 0; k < 2; k++) {
        uint32_t got[4], want[4];
        dsv4_index_mx_bf16x8(xs[k], lut, got);
        dsv4_index_mx_bf16x4(xs[k] & 0xffffu, lut, &want[0], &want[1]);
        dsv4_index_mx_bf16x4(xs[k] >> 16, lut, &want[2], &want[3]);
        for (int i = 0; i < 4; i++)
          if (got[i] != want[i])
            fail_msg("code %u nibbles %08x word %d: %08x, expected %08x", code, xs[k], i, got[i],
                     want[i]);
      }
    }
  }
}

/* ---- every pair of block codes ---- */

/* The battery of block-0 inputs (dims 0..31; the other blocks zero with code 127). */
#define BATTERY 12

static void battery(rec_t *q, rec_t *k, int which, uint8_t cq, uint8_t ck) {
  memset(q, 0, sizeof(*q));
  memset(k, 0, sizeof(*k));
  q->c[0] = cq;
  k->c[0] = ck;
  for (int b = 1; b < 4; b++)
    q->c[b] = k->c[b] = 127;
  for (int d = 0; d < 32; d++) {
    unsigned a = 0, c = 0;
    switch (which) {
    case 0: /* all +6: the largest partial sums */
      a = c = 7;
      break;
    case 1: /* partial 0: 15 products of +36 then one of -36 (a prefix of 540, a sum of 504) */
      a = d < 15 ? 7 : d == 15 ? 15 : 0;
      c = d < 16 ? 7 : 0;
      break;
    case 2: /* partial 0: 8 of +36 then 8 of -36 (a prefix of 288, a sum of 0) */
      a = d < 8 ? 7 : d < 16 ? 15 : 0;
      c = d < 16 ? 7 : 0;
      break;
    case 3: /* partial 0: 16 products of 1/4 */
      a = c = d < 16 ? 1 : 0;
      break;
    case 4: /* partial 0: two products of 3/4 */
      a = d < 2 ? 3 : 0;
      c = d < 2 ? 1 : 0;
      break;
    case 5: /* a single product of -1/4 */
      a = d == 0 ? 9 : 0;
      c = d == 0 ? 1 : 0;
      break;
    default: /* random nibbles */
      a = (unsigned)below(16);
      c = (unsigned)below(16);
      break;
    }
    set_nib(q, d, a);
    set_nib(k, d, c);
  }
}

/* Whether the derivation says the CPU's chain can round for a block nonzero on both sides. */
static int must_fall_back(int cq, int ck) {
  const int e = cq + ck - 254;
  if (cq >= 253 || ck >= 253)
    return 1; /* an infinite value (or 0 * inf) on the CPU */
  if (cq == 0 || ck == 0)
    return e >= -159; /* the CPU's values are zero; the model's sum is not zero from E = -159 */
  return (e >= -159 && e <= -148) || e >= 119;
}

static int expected_mode(int cq, int ck) {
  const int e = cq + ck - 254;
  if (cq < 2 || cq > 252 || ck < 2 || ck > 252 || e < -124 || e > 118)
    return DSV4_INDEX_MX_SCALAR;
  return e <= 115 ? DSV4_INDEX_MX_FUSED : DSV4_INDEX_MX_PARTIAL;
}

static void test_code_pairs(void **state) {
  (void)state;
  uint32_t scalar_not_needed = 0, needed = 0;
  for (int cq = 0; cq < 256; cq++)
    for (int ck = 0; ck < 256; ck++) {
      int found = 0, mode = -1;
      for (int w = 0; w < BATTERY; w++) {
        rec_t q, k;
        battery(&q, &k, w, (uint8_t)cq, (uint8_t)ck);
        const int m = dsv4_index_mx_pair_mode(summary(&q), summary(&k));
        if (mode < 0)
          mode = m;
        if (m != mode)
          fail_msg("codes %d, %d: the mode depends on the nibbles (%d, %d)", cq, ck, mode, m);
        const float cpu = cpu_dot(&q, &k);
        if (!same_score_input(mx_dot_partial(&q, &k), cpu))
          found = 1;
        int mm;
        const float d = mx_dot(&q, &k, &mm);
        if (f2u(d) != f2u(cpu))
          fail_msg("codes %d, %d, input %d: mode %d gives %a, the CPU %a", cq, ck, w, mm, (double)d,
                   (double)cpu);
      }
      const int must = must_fall_back(cq, ck);
      if (found != must)
        fail_msg("codes %d, %d (E = %d): the model %s the CPU, the derivation says it %s", cq, ck,
                 cq + ck - 254, found ? "differs from" : "equals", must ? "can differ" : "cannot");
      if (mode != expected_mode(cq, ck))
        fail_msg("codes %d, %d: mode %d, expected %d", cq, ck, mode, expected_mode(cq, ck));
      needed += (uint32_t)must;
      scalar_not_needed += (uint32_t)(mode == DSV4_INDEX_MX_SCALAR && !must);
    }
  printf("code pairs: the scalar product needed at %u of 65536, taken besides at %u (subnormal or "
         "flushed matrix operands)\n",
         needed, scalar_not_needed);
}

/* A block of zeros (signed) against a nonzero block, both ways round. */
static void test_zero_blocks(void **state) {
  (void)state;
  for (int side = 0; side < 2; side++)
    for (int cz = 0; cz < 256; cz++)
      for (int cn = 0; cn < 256; cn++) {
        int found = 0, mode = -1;
        for (int w = 0; w < BATTERY; w++) {
          rec_t q, k;
          battery(&q, &k, w, 0, 0);
          rec_t *z = side ? &k : &q, *n = side ? &q : &k;
          for (int d = 0; d < 32; d++)
            set_nib(z, d, below(2) << 3);
          z->c[0] = (uint8_t)cz;
          n->c[0] = (uint8_t)cn;
          if (!block_nonzero(n, 0))
            set_nib(n, 0, 7);
          const int m = dsv4_index_mx_pair_mode(summary(&q), summary(&k));
          mode = mode < 0 ? m : mode;
          if (m != mode)
            fail_msg("zero block code %d, other %d: the mode depends on the nibbles", cz, cn);
          const float cpu = cpu_dot(&q, &k);
          found |= !same_score_input(mx_dot_partial(&q, &k), cpu);
          int mm;
          const float d = mx_dot(&q, &k, &mm);
          if (f2u(d) != f2u(cpu))
            fail_msg("zero block code %d, other %d: %a, the CPU %a", cz, cn, (double)d,
                     (double)cpu);
        }
        /* 0 * inf = NaN on the CPU: a zero block's code 255, or the other block's infinities. */
        const int must = cz == 255 || cn >= 253;
        if (found != must)
          fail_msg("zero block code %d, other %d: the model %s the CPU", cz, cn,
                   found ? "differs from" : "equals");
        const int expect =
            cz == 255 || cn < 2 || cn > 252 ? DSV4_INDEX_MX_SCALAR : DSV4_INDEX_MX_FUSED;
        if (mode != expect)
          fail_msg("zero block code %d, other %d: mode %d, expected %d", cz, cn, mode, expect);
      }
}

/* ---- random pairs ---- */

static void test_random_pairs(void **state) {
  (void)state;
  enum { PAIRS = 3000000 };
  uint32_t modes[3] = {0}, in_cpu = 0, in_fold = 0;
  for (uint32_t i = 0; i < PAIRS; i++) {
    rec_t q, k;
    gen_pair(&q, &k);
    int mode;
    const float cpu = cpu_dot(&q, &k), d = mx_dot(&q, &k, &mode);
    modes[mode]++;
    if (f2u(d) != f2u(cpu))
      fail_msg("pair %u, mode %d: %a (%08x), the CPU %a (%08x)", i, mode, (double)d, f2u(d),
               (double)cpu, f2u(cpu));
    int span, emax;
    if (cpu_window(&q, &k, &span, &emax)) {
      in_cpu++;
      const float dp = mx_dot_partial(&q, &k);
      if (f2u(dp) != f2u(cpu))
        fail_msg("pair %u in the CPU's window: partials %a, the CPU %a", i, (double)dp,
                 (double)cpu);
      if (span <= 10 && emax <= 115) {
        in_fold++;
        const float df = mx_dot_fused(&q, &k);
        if (f2u(df) != f2u(cpu))
          fail_msg("pair %u, span %d: fused %a, the CPU %a", i, span, (double)df, (double)cpu);
      }
    }
  }
  printf("random pairs: %u scalar, %u partial, %u fused; %u in the CPU's window, %u of them in the "
         "fold's\n",
         modes[0], modes[1], modes[2], in_cpu, in_fold);
  for (int m = 0; m < 3; m++)
    assert_true(modes[m] > PAIRS / 50);
  assert_true(in_fold > in_cpu / 4 && in_cpu > modes[1] + modes[2]);
}

/* ---- the bounds' witnesses ---- */

/* Records with block b's codes giving E and nibbles from pattern fills. */
static void witness_codes(rec_t *q, rec_t *k, int b, int e) {
  q->c[b] = (uint8_t)(e >= 0 ? 127 + (e + 1) / 2 : 127 - (-e + 1) / 2);
  k->c[b] = (uint8_t)(e + 254 - q->c[b]);
}

static void test_witnesses(void **state) {
  (void)state;
  rec_t q, k;
  /* E = 119: 15 products of +36 * 2^119 overflow the chain's prefix (540 * 2^119 >= 2^128), the sum
   * (504 * 2^119) does not. At E = 118 the prefix is 540 * 2^118 < 2^128. */
  for (int e = 118; e <= 119; e++) {
    battery(&q, &k, 1, 0, 0);
    witness_codes(&q, &k, 0, e);
    const float cpu = cpu_dot(&q, &k), model = mx_dot_partial(&q, &k);
    assert_true(isfinite(model));
    assert_int_equal(e == 119, !isfinite(cpu));
    assert_int_equal(e == 119, f2u(model) != f2u(cpu));
    assert_int_equal(dsv4_index_mx_pair_mode(summary(&q), summary(&k)),
                     e == 119 ? DSV4_INDEX_MX_SCALAR : DSV4_INDEX_MX_PARTIAL);
  }
  /* E = -148: two products of 3/4 * 2^-148 (1.5 units of 2^-149 each) round to 2 units, then 3.5 to
   * 4; their sum, 3 units, is an fp32 number. At E = -147 every value is on the grid. */
  for (int e = -148; e <= -147; e++) {
    battery(&q, &k, 4, 0, 0);
    witness_codes(&q, &k, 0, e);
    const float cpu = cpu_dot(&q, &k), model = mx_dot_partial(&q, &k);
    if (e == -148) {
      assert_true(model == 0x3p-149f && cpu == 0x1p-147f);
    } else {
      assert_true(f2u(model) == f2u(cpu) && model == 0x3p-148f);
    }
    assert_int_equal(dsv4_index_mx_pair_mode(summary(&q), summary(&k)), DSV4_INDEX_MX_SCALAR);
  }
  /* The fold: blocks 0..2 at E with +6 everywhere (partials of 576 * 2^E, 3456 * 2^E together) and
   * a product of 3/4 in block 3 at E - span. Span 10: 3456 * 2^12 + 3 units of 2^(E - 12) < 2^24,
   * every sum of the fold is exact and the fused chain has the CPU's bits. Span 11: 3456 * 2^13 + 3
   * units is no fp32 number; the CPU's last add rounds it to nearest (up, to + 4), a sum that
   * truncates (as the tensor cores' does) gives + 2: no chain over all dims may be trusted there.
   */
  for (int span = 10; span <= 11; span++) {
    memset(&q, 0, sizeof(q));
    memset(&k, 0, sizeof(k));
    memset(q.v, 0x77, 48);
    memset(k.v, 0x77, 48);
    set_nib(&q, 96, 3);
    set_nib(&k, 96, 1);
    for (int b = 0; b < 4; b++)
      witness_codes(&q, &k, b, b < 3 ? 20 : 20 - span);
    double exact = 0.0;
    for (int d = 0; d < 128; d++)
      exact += mx_val(&q, d) * mx_val(&k, d);
    const float cpu = cpu_dot(&q, &k), nearest = (float)exact;
    const float truncated = (double)nearest > exact ? nextafterf(nearest, 0.0f) : nearest;
    assert_true(f2u(mx_dot_partial(&q, &k)) == f2u(cpu) && f2u(nearest) == f2u(cpu));
    assert_int_equal(span == 11, (double)nearest != exact);
    assert_int_equal(span == 11, f2u(truncated) != f2u(cpu));
    assert_int_equal(dsv4_index_mx_pair_mode(summary(&q), summary(&k)), DSV4_INDEX_MX_PARTIAL);
  }
}

/* ---- the kernel's sets ---- */

/* A set's per-block minima of the nonzero summary bytes (255 without), maxima, largest span. */
static void set_stats(const rec_t *r, int n, uint32_t *lo, uint32_t *hi, uint32_t *span) {
  *lo = 0xFFFFFFFFu;
  *hi = 0;
  *span = 0;
  for (int i = 0; i < n; i++) {
    const uint32_t s = summary(&r[i]);
    for (int b = 0; b < 4; b++) {
      uint32_t c = (s >> (8 * b)) & 255u, l = (*lo >> (8 * b)) & 255u, h = (*hi >> (8 * b)) & 255u;
      if (c && c < l)
        *lo = (*lo & ~(255u << (8 * b))) | (c << (8 * b));
      if (c > h)
        *hi = (*hi & ~(255u << (8 * b))) | (c << (8 * b));
    }
    const uint32_t sp = dsv4_index_mx_span(s);
    *span = sp > *span ? sp : *span;
  }
}

/* dsv4_index_mx_fused_glance of two sets' statistics (their extremes by dsv4_index_mx_range). */
static int glance_of(uint32_t ql, uint32_t qh, uint32_t qs, uint32_t kl, uint32_t kh, uint32_t ks) {
  uint32_t qhi, qlo, khi, klo, unused;
  dsv4_index_mx_range(qh, &qhi, &unused);
  dsv4_index_mx_range(ql, &unused, &qlo);
  dsv4_index_mx_range(kh, &khi, &unused);
  dsv4_index_mx_range(kl, &unused, &klo);
  return dsv4_index_mx_fused_glance(qhi, qlo, qs, khi, klo, ks);
}

static void test_sets(void **state) {
  (void)state;
  enum { NQ = 64, NK = 32, SETS = 1500 };
  static rec_t q[NQ], k[NK];
  uint32_t modes[3] = {0}, glances = 0;
  for (int t = 0; t < SETS; t++) {
    /* One style per set, as the daemon's tiles are alike (realistic codes half of the time), and
     * in half of the sets an odd vector now and then. */
    static const unsigned code_style[8] = {1, 1, 1, 1, 0, 2, 3, 4};
    const unsigned ns = below(6), cs = code_style[below(8)], odd = below(2) ? 48 : 0;
    for (int i = 0; i < NQ + NK; i++) {
      rec_t other, *r = i < NQ ? &q[i] : &k[i - NQ];
      const int o = odd && below(odd) == 0;
      gen_nibbles(r, o ? below(6) : ns);
      if (i < NQ)
        gen_codes(r, &other, o ? below(5) : cs);
      else
        gen_codes(&other, r, o ? below(5) : cs);
    }
    uint32_t ql, qh, qs, kl, kh, ks;
    set_stats(q, NQ, &ql, &qh, &qs);
    set_stats(k, NK, &kl, &kh, &ks);
    const int mode = dsv4_index_mx_mode(ql, qh, qs, kl, kh, ks);
    modes[mode]++;
    if (glance_of(ql, qh, qs, kl, kh, ks)) {
      glances++;
      if (mode != DSV4_INDEX_MX_FUSED)
        fail_msg("set %d: the first look says fused, dsv4_index_mx_mode %d", t, mode);
    }
    for (int h = 0; h < NQ; h++)
      for (int j = 0; j < NK; j++) {
        const int pm = dsv4_index_mx_pair_mode(summary(&q[h]), summary(&k[j]));
        if (pm < mode)
          fail_msg("set %d: mode %d, but pair (%d, %d) allows only %d", t, mode, h, j, pm);
        const float cpu = cpu_dot(&q[h], &k[j]), d = mx_dot_mode(&q[h], &k[j], mode);
        if (f2u(d) != f2u(cpu))
          fail_msg("set %d mode %d pair (%d, %d): %a, the CPU %a", t, mode, h, j, (double)d,
                   (double)cpu);
      }
  }
  printf("sets of %d x %d: %u scalar, %u partial, %u fused (%u of them at a first look)\n", NQ, NK,
         modes[0], modes[1], modes[2], glances);
  for (int m = 0; m < 3; m++)
    assert_true(modes[m] > SETS / 20);
  assert_true(glances > SETS / 20);
}

/* A summary byte for test_glance: zero blocks, invalid ones, codes at and near the bounds that
 * the code sums meet (E_MIN and FUSED_E_MAX around a partner's code), or any. */
static uint32_t glance_byte(void) {
  static const uint32_t near[] = {2,   3,   4,   5,   6,   120, 124, 125, 126, 127, 128,
                                  129, 130, 180, 184, 185, 186, 187, 188, 250, 251, 252};
  switch (below(8)) {
  case 0:
  case 1:
    return 0;
  case 2:
    return DSV4_INDEX_MX_INVALID;
  case 3:
  case 4:
    return near[below((uint32_t)(sizeof(near) / sizeof(near[0])))];
  case 5:
    return 124 + below(7);
  default:
    return 2 + below(251);
  }
}

/*
 * The first look (dsv4_index_mx_fused_glance, the CUDA kernels' warp_mode) never takes fused mode
 * where dsv4_index_mx_pair_mode does not: millions of pairs of summaries whose bytes are zero,
 * invalid, near the bounds or any code, and sets of them (the same for their statistics).
 */
static void test_glance(void **state) {
  (void)state;
  enum { PAIRS = 4000000 };
  uint32_t fused = 0, glances = 0;
  for (int i = 0; i < PAIRS; i++) {
    uint32_t qs = 0, ks = 0;
    const int near_q = below(2); /* half of the pairs: every byte of q one code */
    const uint32_t qb = glance_byte();
    for (int b = 0; b < 4; b++) {
      qs |= (near_q ? qb : glance_byte()) << (8 * b);
      ks |= glance_byte() << (8 * b);
    }
    uint32_t ql = 0, kl = 0;
    for (int b = 0; b < 4; b++) {
      const uint32_t q = (qs >> (8 * b)) & 255u, k = (ks >> (8 * b)) & 255u;
      ql |= (q ? q : 255u) << (8 * b);
      kl |= (k ? k : 255u) << (8 * b);
    }
    const int mode = dsv4_index_mx_pair_mode(qs, ks);
    fused += mode == DSV4_INDEX_MX_FUSED;
    if (glance_of(ql, qs, dsv4_index_mx_span(qs), kl, ks, dsv4_index_mx_span(ks))) {
      glances++;
      if (mode != DSV4_INDEX_MX_FUSED)
        fail_msg("summaries %08x and %08x: the first look says fused, the pair's mode is %d", qs,
                 ks, mode);
    }
  }
  printf("%d pairs: %u fused, %u of them at a first look\n", PAIRS, fused, glances);
  assert_true(glances > PAIRS / 100);
}

/*
 * The first look from the codes alone (dsv4_index_mx_code_range) is a first look on the record's
 * summary too: millions of records of every nibble style (zero blocks, signed zeros) and code
 * style, against heads' statistics of glance_byte summaries; where the codes' look passes, so does
 * the summary's, and the codes' look passes often on the compressor's codes.
 */
static void test_code_glance(void **state) {
  (void)state;
  enum { RECORDS = 2000000 };
  uint32_t passes = 0, near = 0, near_passes = 0;
  for (int i = 0; i < RECORDS; i++) {
    rec_t q, k;
    gen_nibbles(&k, below(6));
    gen_codes(&q, &k, below(5));
    const int close = below(4) == 0; /* the compressor's codes: within one of each other */
    if (close) {
      const uint32_t c0 = 110 + below(30);
      for (int b = 0; b < 4; b++)
        k.c[b] = (uint8_t)(c0 + below(2));
    }
    uint32_t qs = 0;
    for (int b = 0; b < 4; b++)
      qs |= (close ? 120 + below(8) : glance_byte()) << (8 * b);
    uint32_t qhi, qlo, chi, clo, cspan, khi, klo;
    dsv4_index_mx_range(qs, &qhi, &qlo);
    const uint32_t qspan = dsv4_index_mx_span(qs);
    dsv4_index_mx_code_range((uint32_t)k.c[0] | (uint32_t)k.c[1] << 8 | (uint32_t)k.c[2] << 16 |
                                 (uint32_t)k.c[3] << 24,
                             &chi, &clo, &cspan);
    const uint32_t ks = summary(&k);
    dsv4_index_mx_range(ks, &khi, &klo);
    near += close;
    if (dsv4_index_mx_fused_glance(qhi, qlo, qspan, chi, clo, cspan)) {
      passes++;
      near_passes += close;
      if (!dsv4_index_mx_fused_glance(qhi, qlo, qspan, khi, klo, dsv4_index_mx_span(ks)))
        fail_msg("codes %02x %02x %02x %02x (summary %08x), heads %08x: the codes' first look "
                 "passes, the summary's does not",
                 k.c[0], k.c[1], k.c[2], k.c[3], ks, qs);
    }
  }
  printf("%d records: the codes' first look passed %u times, %u of %u with close codes\n", RECORDS,
         passes, near_passes, near);
  assert_true(near_passes > near / 2);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bf16_images),  cmocka_unit_test(test_bf16x8),
      cmocka_unit_test(test_code_pairs),   cmocka_unit_test(test_zero_blocks),
      cmocka_unit_test(test_random_pairs), cmocka_unit_test(test_witnesses),
      cmocka_unit_test(test_sets),         cmocka_unit_test(test_glance),
      cmocka_unit_test(test_code_glance),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
