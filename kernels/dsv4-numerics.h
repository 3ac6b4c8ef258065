#ifndef DSV4_KERNELS_NUMERICS_H
#define DSV4_KERNELS_NUMERICS_H

/*
 * The canonical numerics of SPEC §2, shared bit for bit by every backend: bf16 and fp8 E4M3FN
 * codecs, the UE8M0 scale rule, the canonical 512-long reduction order, the RMS factor and the RoPE
 * pair.
 *
 * This header is included by plain C (host and CPU backend), CUDA (__host__ __device__) and OpenCL
 * C. Everything here is integer bit manipulation or a single correctly rounded IEEE operation, so
 * the result never depends on the compiler's contraction or flush-to-zero settings beyond what SPEC
 * §2 already forbids (-ffp-contract=off, --fmad=false, FP_CONTRACT OFF, no FTZ/DAZ).
 *
 * OpenCL C's `/` and `sqrt` are correctly rounded only when the program is built with
 * -cl-fp32-correctly-rounded-divide-sqrt on a device that reports it; elsewhere a backend must use
 * the SPEC §2 double-precision fallback for dsv4_rms_factor.
 */

#include "dsv4-layout.h"

#if defined(__OPENCL_VERSION__) || defined(__OPENCL_C_VERSION__)
typedef uint dsv4_u32;
typedef ushort dsv4_u16;
typedef uchar dsv4_u8;
typedef int dsv4_i32;
#define DSV4_FN static inline
#define DSV4_UNROLL
#define DSV4_FMA(a, b, c) fma((a), (b), (c))
#define DSV4_SQRT(x) sqrt(x)
DSV4_FN dsv4_u32 dsv4_f2u(float f) {
  return as_uint(f);
}
DSV4_FN float dsv4_u2f(dsv4_u32 u) {
  return as_float(u);
}
#elif defined(__CUDACC__)
#include <stdint.h>
typedef uint32_t dsv4_u32;
typedef uint16_t dsv4_u16;
typedef uint8_t dsv4_u8;
typedef int32_t dsv4_i32;
#define DSV4_FN static inline __host__ __device__
#ifdef __CUDA_ARCH__
/* Loops of a fixed count unrolled in device code, so that arrays indexed by their counters stay in
 * registers: the operations and their order are the loop's. */
#define DSV4_UNROLL _Pragma("unroll")
#define DSV4_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define DSV4_SQRT(x) __fsqrt_rn(x)
#else
#define DSV4_UNROLL
#include <math.h>
#define DSV4_FMA(a, b, c) fmaf((a), (b), (c))
#define DSV4_SQRT(x) sqrtf(x)
#endif
DSV4_FN dsv4_u32 dsv4_f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  dsv4_u32 u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
DSV4_FN float dsv4_u2f(dsv4_u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
typedef uint32_t dsv4_u32;
typedef uint16_t dsv4_u16;
typedef uint8_t dsv4_u8;
typedef int32_t dsv4_i32;
#define DSV4_FN static inline
#define DSV4_UNROLL
#define DSV4_FMA(a, b, c) fmaf((a), (b), (c))
#define DSV4_SQRT(x) sqrtf(x)
DSV4_FN dsv4_u32 dsv4_f2u(float f) {
  dsv4_u32 u;
  memcpy(&u, &f, 4);
  return u;
}
DSV4_FN float dsv4_u2f(dsv4_u32 u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#endif

/* (float)1e-6, the RMSNorm epsilon of both V4 models (0x358637BD). */
#define DSV4_RMS_EPS_BITS 0x358637BDu
/* The softmax scale 512^-0.5 as fp32 (0x3D3504F3). */
#define DSV4_SOFTMAX_SCALE_BITS 0x3D3504F3u
/* The smallest tile amax the UE8M0 rule accepts (1e-4f); smaller maxima are raised to it. */
#define DSV4_AMAX_FLOOR 1e-4f
/* bf16 bit patterns with (bits & 0x7fff) >= this have |x| >= 2^59 (also Inf and NaN). */
#define DSV4_BF16_LIMIT_BITS 0x5D00u

/* bf16 -> fp32 is exact: the 16 bits become the high half. */
DSV4_FN float dsv4_bf16_to_f32(dsv4_u16 h) {
  return dsv4_u2f((dsv4_u32)h << 16);
}

/* fp32 -> bf16, round to nearest even; NaN stays a quiet NaN. */
DSV4_FN dsv4_u16 dsv4_f32_to_bf16(float f) {
  dsv4_u32 u = dsv4_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (dsv4_u16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (dsv4_u16)(u >> 16);
}

/*
 * fp32 -> fp8 E4M3FN byte, round to nearest even, saturating: a magnitude above 448 after rounding
 * (and +-Inf) gives 0x7E with the sign; NaN gives 0x7F with the sign (the daemon never feeds NaN).
 * The sign bit is always the input's, so -0.0 and negative values that round to zero give 0x80.
 */
DSV4_FN dsv4_u8 dsv4_f32_to_e4m3(float f) {
  dsv4_u32 u = dsv4_f2u(f);
  dsv4_u8 sign = (dsv4_u8)((u >> 24) & 0x80u);
  dsv4_u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u)
    return (dsv4_u8)(sign | 0x7fu);
  if (a >= 0x3c800000u) { /* |f| >= 2^-6: the normal e4m3 range */
    /* Round the 23-bit mantissa to 3 bits; a carry moves into the exponent, as it should. */
    dsv4_u32 r = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;
    if (r > 0x43e00000u) /* above 448 */
      return (dsv4_u8)(sign | 0x7eu);
    return (dsv4_u8)(sign | ((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u)));
  }
  if (a <= 0x3a800000u) /* |f| <= 2^-10: half the subnormal step or less rounds to (signed) zero */
    return sign;
  /* Subnormal e4m3: count units of 2^-9 with round-to-nearest-even. Here 2^-10 < |f| < 2^-6, so the
   * fp32 input is normal with biased exponent 117..120 and |f| / 2^-9 = M * 2^(E - 141). */
  {
    dsv4_u32 e = a >> 23;
    dsv4_u32 m = (a & 0x7fffffu) | 0x800000u;
    dsv4_u32 shift = 141u - e; /* 21..24 */
    dsv4_u32 q = m >> shift;
    dsv4_u32 rem = m & ((1u << shift) - 1u);
    dsv4_u32 halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u)))
      q += 1u; /* q == 8 is 2^-6, which is exactly the normal encoding 0x08 */
    return (dsv4_u8)(sign | q);
  }
}

/* fp8 E4M3FN byte -> fp32, exact. 0x7F/0xFF decode to NaN. */
DSV4_FN float dsv4_e4m3_to_f32(dsv4_u8 b) {
  dsv4_u32 s = ((dsv4_u32)b & 0x80u) << 24;
  dsv4_u32 e = ((dsv4_u32)b >> 3) & 15u;
  dsv4_u32 m = (dsv4_u32)b & 7u;
  if (e == 15u && m == 7u)
    return dsv4_u2f(s | 0x7fc00000u);
  if (e == 0u) /* m * 2^-9, exact */
    return dsv4_u2f(s | dsv4_f2u((float)m * 0x1p-9f));
  return dsv4_u2f(s | ((e + 120u) << 23) | (m << 20));
}

/* The fp32 value 448 * 2^e, exact for the exponents the UE8M0 rule can meet. */
DSV4_FN float dsv4_448_pow2(dsv4_i32 e) {
  return dsv4_u2f(((dsv4_u32)(135 + e) << 23) | 0x600000u);
}

/*
 * The UE8M0 exponent of a tile (SPEC §2.2): the smallest integer e with amax <= 448 * 2^e, found by
 * exact comparison. amax must be finite and >= 1e-4f (the caller applies the floor). Writing
 * amax = m * 2^E with 1 <= m < 2, 448 * 2^(E-8) = 1.75 * 2^E, so e is E-8 or E-7.
 */
DSV4_FN dsv4_i32 dsv4_ue8m0_exponent(float amax) {
  dsv4_i32 e = (dsv4_i32)(dsv4_f2u(amax) >> 23) - 127 - 8;
  if (amax > dsv4_448_pow2(e))
    e += 1;
  return e;
}

/* 2^-e as fp32, built from its bits (never exp2f). Valid for -126 <= -e <= 127. */
DSV4_FN float dsv4_pow2_neg(dsv4_i32 e) {
  return dsv4_u2f((dsv4_u32)(127 - e) << 23);
}

/* A tile's UE8M0 scale code is its exponent e plus this bias (SPEC §2.2): 2^e is stored as e + 127.
 */
#define DSV4_UE8M0_BIAS 127

/* The dequantisation scale 2^(code-127) of a UE8M0 code (1 <= code <= 254). */
DSV4_FN float dsv4_ue8m0_scale(dsv4_u8 code) {
  return dsv4_u2f((dsv4_u32)code << 23);
}

/*
 * The fold of the 32 canonical partials (SPEC §2): p[l] = p[l] + p[l + step] for l < step, with
 * steps 16, 8, 4, 2, 1; returns p[0]. p is overwritten. Kernels that compute one partial per lane
 * gather the 32 partials and call this, so every backend folds in one order.
 */
DSV4_FN float dsv4_fold32(float *p) {
  for (int step = 16; step >= 1; step >>= 1)
    for (int l = 0; l < step; l++)
      p[l] = p[l] + p[l + step];
  return p[0];
}

/*
 * The canonical sum of squares of a 512-vector (SPEC §2): 32 partial fma chains over 16 consecutive
 * elements each, from +0.0f in index order, then a pairwise fold with steps 16, 8, 4, 2, 1.
 */
DSV4_FN float dsv4_sumsq512(const float *x) {
  float p[32];
  for (int l = 0; l < 32; l++) {
    float acc = 0.0f;
    for (int k = 0; k < 16; k++)
      acc = DSV4_FMA(x[16 * l + k], x[16 * l + k], acc);
    p[l] = acc;
  }
  return dsv4_fold32(p);
}

/* The canonical 512-long dot product: the same 32 partials and fold as dsv4_sumsq512. */
DSV4_FN float dsv4_dot512(const float *x, const float *y) {
  float p[32];
  for (int l = 0; l < 32; l++) {
    float acc = 0.0f;
    for (int k = 0; k < 16; k++)
      acc = DSV4_FMA(x[16 * l + k], y[16 * l + k], acc);
    p[l] = acc;
  }
  return dsv4_fold32(p);
}

/* r = 1 / sqrt(ss * 2^-9 + eps): multiply, add, sqrt and divide, each rounded once. */
DSV4_FN float dsv4_rms_factor(float ss, float eps) {
  float t = ss * 0x1p-9f;
  t = t + eps;
  return 1.0f / DSV4_SQRT(t);
}

/* One RoPE pair (GPT-J, interleaved): the inner product is rounded first, then one fma. */
DSV4_FN float dsv4_rope_even(float e, float o, float c, float s) {
  return DSV4_FMA(e, c, -(o * s));
}
DSV4_FN float dsv4_rope_odd(float e, float o, float c, float s) {
  return DSV4_FMA(e, s, o * c);
}

/* The inverse rotation of an attention output pair (SPEC §7): the inner product rounded first. */
DSV4_FN float dsv4_rope_inv_even(float e, float o, float c, float s) {
  return DSV4_FMA(e, c, o * s);
}
DSV4_FN float dsv4_rope_inv_odd(float e, float o, float c, float s) {
  return DSV4_FMA(-e, s, o * c);
}

/*
 * exp and log for attention (SPEC §7): one definition for C, CUDA and OpenCL C, built only from
 * fmaf, +, x, round-to-nearest-even (the 1.5 * 2^23 trick: adding and subtracting it rounds any
 * |v| < 2^22 to an integer with the current, round-to-nearest-even, mode) and scaling by powers of
 * two made from exponent bits. Every operation is one correctly rounded IEEE operation, so every
 * backend gets the same bits; tests/unit/expf_logf_test.c freezes both over all 2^32 inputs by
 * digest and measures their error against libm's double routines (faithful: below one ulp).
 *
 * A NaN input returns itself made quiet (its sign and payload kept by bit operations, since devices
 * differ in the NaN their arithmetic produces); a NaN made here (log of a negative) is 0x7FC00000.
 */

/* 2^e as fp32 from its exponent bits, for -126 <= e <= 127. */
DSV4_FN float dsv4_pow2i(dsv4_i32 e) {
  return dsv4_u2f((dsv4_u32)(127 + e) << 23);
}

/* The quiet form of a NaN: the same bits with the quiet bit set. */
DSV4_FN float dsv4_quiet_nan(dsv4_u32 u) {
  return dsv4_u2f(u | 0x00400000u);
}

/*
 * e^x. x = k ln2 + r with k = rne(x log2(e)) and |r| <= ln2/2 (Cody-Waite: k * ln2_hi has at most
 * 24 significant bits for |k| <= 151, and x - k ln2_hi is exact by Sterbenz's lemma); r = rh + rl
 * is rounded once and its rounding error kept exactly (2Sum). e^r = 1 + r + r^2 P(r) with a
 * degree-5 minimax P; 1 + r is split into a rounded sum and its exact error (Fast2Sum, |r| < 1), so
 * the only large rounding is the last addition. 2^k is applied as two exact factors 2^(k/2) and
 * 2^(k-k/2), so a subnormal result is rounded once, by the second product. e^x overflows
 * above 88.7228 and is below half the smallest subnormal under -103.97, so the bounds 89 and -104
 * need no arithmetic.
 */
DSV4_FN float dsv4_expf(float x) {
  dsv4_u32 u = dsv4_f2u(x);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return dsv4_quiet_nan(u);
  if (x > 89.0f)
    return dsv4_u2f(0x7f800000u);
  if (x < -104.0f)
    return 0.0f;
  /* |x| < 2^-25: e^x rounds to 1 (and the steps below would meet subnormal intermediates). */
  if ((u & 0x7fffffffu) < 0x33000000u)
    return 1.0f;
  float t = x * 0x1.715476p+0f;
  float k = (t + 0x1.8p+23f) - 0x1.8p+23f;
  float rh = DSV4_FMA(-k, 0x1.62e4p-1f, x);
  float rl = -k * 0x1.7f7d1cp-20f;
  float r = rh + rl;
  float bv = r - rh;
  float re = (rh - (r - bv)) + (rl - bv);
  float p = 0x1.9f0894p-13f;
  p = DSV4_FMA(p, r, 0x1.6d8d04p-10f);
  p = DSV4_FMA(p, r, 0x1.11127p-7f);
  p = DSV4_FMA(p, r, 0x1.55548ep-5f);
  p = DSV4_FMA(p, r, 0x1.555554p-3f);
  p = DSV4_FMA(p, r, 0x1p-1f);
  float w = DSV4_FMA(r * r, p, re);
  float hi = 1.0f + r;
  float lo = (1.0f - hi) + r;
  float y = hi + (lo + w);
  dsv4_i32 q = (dsv4_i32)k;
  dsv4_i32 q1 = q / 2;
  return (y * dsv4_pow2i(q1)) * dsv4_pow2i(q - q1);
}

/*
 * ln x. x = m * 2^e with m in [sqrt(1/2), sqrt(2)) taken from the bits (a subnormal x is first
 * scaled by 2^23, exactly); f = m - 1 is exact (Sterbenz). ln(1 + f) = f + f^2 P(f) with a
 * degree-10 minimax P, f^2 carried as a rounded product plus its exact error (one fma). The sum
 * e ln2_hi + f (e ln2_hi exact: e has at most 8 bits) is rounded once and its error kept exactly
 * (Fast2Sum: |e ln2_hi| >= 0.69 > |f| unless e = 0, where the error is 0), so the small terms are
 * added to it before the last rounding. ln(+-0) = -inf, ln(+inf) = +inf, ln(x < 0) = NaN.
 */
DSV4_FN float dsv4_logf(float x) {
  dsv4_u32 u = dsv4_f2u(x);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return dsv4_quiet_nan(u);
  if ((u & 0x7fffffffu) == 0u)
    return dsv4_u2f(0xff800000u);
  if (u >> 31)
    return dsv4_u2f(0x7fc00000u);
  if (u == 0x7f800000u)
    return x;
  dsv4_i32 ebias = 128;
  if (u < 0x00800000u) {
    u = dsv4_f2u(x * 0x1p+23f);
    ebias = 128 + 23;
  }
  /* Adding 0x40000000 - bits(sqrt(1/2)) moves the mantissa boundary to sqrt(1/2). */
  dsv4_u32 b = u + 0x00cafb0du;
  float fe = (float)((dsv4_i32)(b >> 23) - ebias);
  float f = dsv4_u2f((b & 0x007fffffu) + 0x3f3504f3u) - 1.0f;
  float p = -0x1.eb0abcp-5f;
  p = DSV4_FMA(p, f, 0x1.b7614cp-4f);
  p = DSV4_FMA(p, f, -0x1.bd41a6p-4f);
  p = DSV4_FMA(p, f, 0x1.c36c76p-4f);
  p = DSV4_FMA(p, f, -0x1.fc6bf8p-4f);
  p = DSV4_FMA(p, f, 0x1.249234p-3f);
  p = DSV4_FMA(p, f, -0x1.556888p-3f);
  p = DSV4_FMA(p, f, 0x1.999a1cp-3f);
  p = DSV4_FMA(p, f, -0x1.ffffacp-3f);
  p = DSV4_FMA(p, f, 0x1.555554p-2f);
  p = DSV4_FMA(p, f, -0x1p-1f);
  float f2 = f * f;
  float f2e = DSV4_FMA(f, f, -f2);
  float c = DSV4_FMA(f2, p, DSV4_FMA(f2e, p, fe * 0x1.7f7d1cp-20f));
  float hi = fe * 0x1.62e4p-1f;
  float s = hi + f;
  float se = (hi - s) + f;
  return s + (c + se);
}

#endif /* DSV4_KERNELS_NUMERICS_H */
