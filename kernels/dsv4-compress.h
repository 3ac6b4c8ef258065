#ifndef DSV4_KERNELS_COMPRESS_H
#define DSV4_KERNELS_COMPRESS_H

/*
 * The canonical math of the compressed branch (SPEC §8.3, §8.5), shared bit for bit by every
 * backend: the compressor's pooling, the indexer's RMS factor, the 128-point Hadamard transform,
 * MXFP4 (e2m1 values with UE8M0 block exponents), the index dot product and the score
 * accumulation.
 *
 * Like dsv4-numerics.h (which this header builds on) it is included by plain C, CUDA and OpenCL C.
 * Every function is integer bit manipulation or a fixed sequence of correctly rounded IEEE
 * operations (explicit fma included), so the result does not depend on the compiler or device. The
 * functions that take arrays expect them in the caller's private memory, as dsv4-numerics.h's do.
 */

#include "dsv4-numerics.h"

/* The indexer's head dimension and its MXFP4 blocks (SPEC §8.5). */
#define DSV4_INDEX_DIM 128
#define DSV4_INDEX_ROPE_FIRST 64 /* dims 64..127 are rotated, pairs (64 + 2i, 65 + 2i) */
#define DSV4_MXFP4_BLOCK 32
#define DSV4_MXFP4_BLOCKS 4       /* 128 / 32 */
#define DSV4_INDEX_VALUE_BYTES 64 /* two e2m1 nibbles per byte */
/* 128^-0.5 as fp32, the Hadamard scale. */
#define DSV4_HADAMARD_SCALE_BITS 0x3DB504F3u
/* The smallest MXFP4 block amax: 6 * 2^-126 (= 1.5 * 2^-124), so every exponent is >= -126. */
#define DSV4_MXFP4_AMAX_FLOOR_BITS 0x01C00000u
/* (float)(128 * 64)^-0.5 = 2^-6.5, the scale of the index weights for 64 index heads. */
#define DSV4_INDEX_W_SCALE_BITS 0x3C3504F3u

/* bf16(x) as fp32: the rounding every stage of the index path applies to its outputs. */
DSV4_FN float dsv4_round_bf16(float x) {
  return dsv4_bf16_to_f32(dsv4_f32_to_bf16(x));
}

/* ---- the compressor's pooling (SPEC §8.3) ---- */

/*
 * One channel is pooled over its row list R in three steps: m = the max of the scores (start from
 * the first row's score and apply dsv4_pool_max to each later one), then, from sum = num = +0.0f,
 * dsv4_pool_add for every row in R's order, then z = num / sum (one divide). A kernel that holds
 * one channel per lane streams the rows through these steps; dsv4_pool_channel is the same for
 * rows gathered into arrays.
 */
DSV4_FN float dsv4_pool_max(float m, float s) {
  return s > m ? s : m;
}

/* e = dsv4_expf(s - m) with the subtraction rounded once; sum += e; num = fma(e, kv, num). */
DSV4_FN void dsv4_pool_add(float s, float kv, float m, float *sum, float *num) {
  float e = dsv4_expf(s - m);
  *sum = *sum + e;
  *num = DSV4_FMA(e, kv, *num);
}

/* The pooled value of one channel over n >= 1 rows: scores s[k] and values kv[k] in R's order. */
DSV4_FN float dsv4_pool_channel(const float *s, const float *kv, dsv4_i32 n) {
  float m = s[0];
  for (dsv4_i32 k = 1; k < n; k++)
    m = dsv4_pool_max(m, s[k]);
  float sum = 0.0f, num = 0.0f;
  for (dsv4_i32 k = 0; k < n; k++)
    dsv4_pool_add(s[k], kv[k], m, &sum, &num);
  return num / sum;
}

/* ---- 128-long reductions of the indexer (SPEC §8.5) ---- */

/* The fold of 8 partials: p[l] = p[l] + p[l + step] for l < step, steps 4, 2, 1; returns p[0]. */
DSV4_FN float dsv4_fold8(float *p) {
  DSV4_UNROLL
  for (int step = 4; step >= 1; step >>= 1) {
    DSV4_UNROLL
    for (int l = 0; l < step; l++)
      p[l] = p[l] + p[l + step];
  }
  return p[0];
}

/* The sum of squares of a 128-vector: 8 fma chains of 16 from +0.0f in index order, then fold8. */
DSV4_FN float dsv4_sumsq128(const float *x) {
  float p[8];
  for (int l = 0; l < 8; l++) {
    float acc = 0.0f;
    for (int k = 0; k < 16; k++)
      acc = DSV4_FMA(x[16 * l + k], x[16 * l + k], acc);
    p[l] = acc;
  }
  return dsv4_fold8(p);
}

/* The index dot product q . k: the same 8 chains of 16 and fold as dsv4_sumsq128. */
DSV4_FN float dsv4_dot128(const float *x, const float *y) {
  float p[8];
  DSV4_UNROLL
  for (int l = 0; l < 8; l++) {
    float acc = 0.0f;
    DSV4_UNROLL
    for (int k = 0; k < 16; k++)
      acc = DSV4_FMA(x[16 * l + k], y[16 * l + k], acc);
    p[l] = acc;
  }
  return dsv4_fold8(p);
}

/* The index key's RMS factor: 1 / sqrt(ss * 2^-7 + eps), each operation rounded once. */
DSV4_FN float dsv4_index_rms_factor(float ss, float eps) {
  float t = ss * 0x1p-7f;
  t = t + eps;
  return 1.0f / DSV4_SQRT(t);
}

/*
 * RoPE on dims 64..127 of an index key or query (pairs (64 + 2i, 65 + 2i) with cos[i], sin[i] of
 * the row, the SPEC §2.1 pair formula), each result rounded to bf16; dims 0..63 are left alone.
 */
DSV4_FN void dsv4_index_rope(float *x, const float *rope_row) {
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float e = x[DSV4_INDEX_ROPE_FIRST + 2 * i], o = x[DSV4_INDEX_ROPE_FIRST + 2 * i + 1];
    float c = rope_row[i], s = rope_row[DSV4_ROPE_PAIRS + i];
    x[DSV4_INDEX_ROPE_FIRST + 2 * i] = dsv4_round_bf16(dsv4_rope_even(e, o, c, s));
    x[DSV4_INDEX_ROPE_FIRST + 2 * i + 1] = dsv4_round_bf16(dsv4_rope_odd(e, o, c, s));
  }
}

/*
 * The Sylvester-ordered Hadamard transform of 128 values, in place: a[] holds bf16 values as fp32
 * on entry and the bf16-rounded outputs as fp32 on return. Butterflies (a[i], a[i+h]) <- (a[i] +
 * a[i+h], a[i] - a[i+h]) for h = 1, 2, ..., 64 over every i with (i & h) = 0; the butterflies of
 * one stage are independent, so any order within a stage gives the same bits. Then each value is
 * multiplied by 128^-0.5 (rounded once) and rounded to bf16.
 */
DSV4_FN void dsv4_hadamard128(float *a) {
  for (int h = 1; h < DSV4_INDEX_DIM; h <<= 1)
    for (int i = 0; i < DSV4_INDEX_DIM; i++)
      if ((i & h) == 0) {
        float x = a[i], y = a[i + h];
        a[i] = x + y;
        a[i + h] = x - y;
      }
  const float scale = dsv4_u2f(DSV4_HADAMARD_SCALE_BITS);
  for (int i = 0; i < DSV4_INDEX_DIM; i++)
    a[i] = dsv4_round_bf16(a[i] * scale);
}

/* ---- MXFP4 (SPEC §8.5) ---- */

/* The fp32 value 6 * 2^e = 1.5 * 2^(e + 2), for -126 <= e <= 125. */
DSV4_FN float dsv4_6_pow2(dsv4_i32 e) {
  return dsv4_u2f(((dsv4_u32)(129 + e) << 23) | 0x400000u);
}

/*
 * The exponent of an MXFP4 block: the smallest integer e with amax <= 6 * 2^e, found by exact
 * comparison (never log2 or exp2). amax must be finite and >= 6 * 2^-126 (the caller applies the
 * floor). With amax = m * 2^E, 1 <= m < 2: 6 * 2^(E-2) = 1.5 * 2^E, so e is E - 2 or E - 1, and
 * the result lies in -126..126 (UE8M0 code e + 127 in 1..253).
 */
DSV4_FN dsv4_i32 dsv4_mxfp4_exponent(float amax) {
  dsv4_i32 e = (dsv4_i32)(dsv4_f2u(amax) >> 23) - 127 - 2;
  if (amax > dsv4_6_pow2(e))
    e += 1;
  return e;
}

/*
 * The e2m1 nibble of x (already scaled by 2^-e): bit 3 is x's sign bit (so -0.0 and negative values
 * that round to zero give 0x8), bits 0..2 the magnitude rounded to nearest on {0, 0.5, 1, 1.5, 2,
 * 3, 4, 6} with ties to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 ->
 * 4, 5 -> 4. A magnitude above 6 (which a correctly scaled block never has) saturates to 6, as
 * cvt.rn.satfinite does.
 */
DSV4_FN dsv4_u8 dsv4_e2m1_nibble(float x) {
  dsv4_u32 u = dsv4_f2u(x);
  dsv4_u8 sign = (dsv4_u8)((u >> 28) & 8u);
  float a = dsv4_u2f(u & 0x7fffffffu);
  dsv4_u8 code;
  if (a <= 0.25f)
    code = 0;
  else if (a < 0.75f)
    code = 1;
  else if (a <= 1.25f)
    code = 2;
  else if (a < 1.75f)
    code = 3;
  else if (a <= 2.5f)
    code = 4;
  else if (a < 3.5f)
    code = 5;
  else if (a <= 5.0f)
    code = 6;
  else
    code = 7;
  return (dsv4_u8)(sign | code);
}

/* The value of an e2m1 nibble (exact): 0, 0.5, 1, 1.5, 2, 3, 4, 6 with the sign of bit 3. */
DSV4_FN float dsv4_e2m1_to_f32(dsv4_u8 nib) {
  dsv4_u32 c = (dsv4_u32)nib & 7u;
  float g = c >= 2u ? (float)(2u + (c & 1u)) * dsv4_pow2i((dsv4_i32)(c >> 1) - 2) : 0.5f * (float)c;
  return (nib & 8u) ? -g : g;
}

/*
 * MXFP4 of 128 values: four blocks of 32, each with amax = max(max |v|, 6 * 2^-126), its exponent
 * e, and the nibbles of v * 2^-e (exact unless it falls below 2^-126, where any value rounds to a
 * signed zero anyway). vals[i] holds element 2i in its low nibble and 2i + 1 in its high nibble;
 * codes[b] = e + 127 of block b.
 */
DSV4_FN void dsv4_mxfp4_quant128(const float *v, dsv4_u8 *vals, dsv4_u8 *codes) {
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    const float *blk = v + DSV4_MXFP4_BLOCK * b;
    float amax = dsv4_u2f(DSV4_MXFP4_AMAX_FLOOR_BITS);
    for (int k = 0; k < DSV4_MXFP4_BLOCK; k++) {
      float a = dsv4_u2f(dsv4_f2u(blk[k]) & 0x7fffffffu);
      amax = a > amax ? a : amax;
    }
    dsv4_i32 e = dsv4_mxfp4_exponent(amax);
    float scale = dsv4_pow2_neg(e);
    for (int i = 0; i < DSV4_MXFP4_BLOCK / 2; i++) {
      dsv4_u8 lo = dsv4_e2m1_nibble(blk[2 * i] * scale);
      dsv4_u8 hi = dsv4_e2m1_nibble(blk[2 * i + 1] * scale);
      vals[(DSV4_MXFP4_BLOCK / 2) * b + i] = (dsv4_u8)(lo | (hi << 4));
    }
    codes[b] = (dsv4_u8)(e + DSV4_UE8M0_BIAS);
  }
}

/* The 128 values of an MXFP4 record: nibble value * 2^(code - 127), exact in fp32. */
DSV4_FN void dsv4_mxfp4_dequant128(const dsv4_u8 *vals, const dsv4_u8 *codes, float *out) {
  DSV4_UNROLL
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    float scale = dsv4_ue8m0_scale(codes[b]);
    DSV4_UNROLL
    for (int i = 0; i < DSV4_MXFP4_BLOCK / 2; i++) {
      dsv4_u8 byte = vals[(DSV4_MXFP4_BLOCK / 2) * b + i];
      out[DSV4_MXFP4_BLOCK * b + 2 * i] = dsv4_e2m1_to_f32((dsv4_u8)(byte & 15u)) * scale;
      out[DSV4_MXFP4_BLOCK * b + 2 * i + 1] = dsv4_e2m1_to_f32((dsv4_u8)(byte >> 4)) * scale;
    }
  }
}

/* ---- the index dot product on matrix units (SPEC §8.5) ----
 *
 * q^ . k^ of two MXFP4 vectors has products n_q * n_k * 2^(E_b) within block b, where n_q, n_k are
 * e2m1 values (multiples of 1/2, |n| <= 6) and E_b = e_q,b + e_k,b = code_q,b + code_k,b - 254. A
 * 16-dim partial l lies in block l / 2 on both sides, so every product and every prefix of its fma
 * chain is an integer multiple of 2^(E_b - 2) below 576 * 2^(E_b) in magnitude (at most 2304 units,
 * 12 bits). Such a value is an fp32 number whenever E_b - 2 >= -149 (the subnormal grid) and
 * 2304 * 2^(E_b - 2) < 2^128, i.e. -147 <= E_b <= 118: there the CPU's chain (dsv4_dot128) rounds
 * nothing and each partial is the exact sum. Outside it the chain can round: for every E_b in
 * [-159, -148] and every E_b >= 119 some input makes it differ from the exact sum (below -159 both
 * round every value to zero). The matrix path computes the same partials as sums of 16 bf16
 * products of the prescaled values n * 2^e (exact in bf16, which has fp32's exponent range), so it
 * has the CPU's partials whenever the tensor cores sum 16 exact products exactly: they keep at
 * least fp32's 24 bits of a sum aligned to its largest term, and 12 suffice. To keep their inputs,
 * products and sums normal, the path asks more than the CPU's window:
 *   - a block with a nonzero value has a code in [2, 252] (e in [-125, 125]: n * 2^e is a normal
 *     bf16, and finite: code 253 and 254 dequantise 4 and 6 to infinity, code 0 to zero, 255 to
 *     infinity or NaN);
 *   - a block whose nibbles are all +-0 contributes +0 to both sides' sums (its code only must
 *     not be 255, whose infinity makes 0 * inf = NaN on the CPU);
 *   - E_b in [-124, 118] for every block nonzero on both sides (the smallest product 2^(E_b - 2)
 *     is normal).
 * Then d = dsv4_fold8 of the partials is the CPU's d bit for bit ("partial" mode: each partial
 * an MMA from zero). Outside these bounds the pair takes dsv4_dot128 itself.
 *
 * The fold adds partials of different blocks in fp32. It rounds nothing either when every sum it
 * forms is an fp32 number: with span = max E_b - min E_b over the blocks nonzero on both sides,
 * every sum is a multiple of 2^(min E_b - 2) of at most 1152 * (3 * 2^(max E_b) + 2^(min E_b)),
 * i.e. at most 4608 * (3 * 2^span + 1) < 2^24 units for span <= 10, and below 2^128 for
 * max E_b <= 115. Then d is the exact dot product, which a chain of MMAs over all 128 dims
 * (accumulating in the tensor core) also gives if it holds that many bits: "fused" mode, taken for
 * span <= DSV4_INDEX_MX_SPAN = 6 (at most 2^20 units, four bits inside fp32's 24).
 *
 * tests/unit/index_mx_test.c holds all of this against dsv4_dot128 bit for bit, and shows every
 * bound that the CPU's numerics impose tight.
 */
#define DSV4_INDEX_MX_CODE_MIN 2
#define DSV4_INDEX_MX_CODE_MAX 252
#define DSV4_INDEX_MX_E_MIN (-124)
#define DSV4_INDEX_MX_E_MAX 118
#define DSV4_INDEX_MX_FUSED_E_MAX 115
#define DSV4_INDEX_MX_SPAN 6
/* A block's summary byte that sends the vector's pairs to the scalar product. */
#define DSV4_INDEX_MX_INVALID 0xFFu
/* The code sum of E = 0: E_b = code_q + code_k - DSV4_INDEX_MX_CODE_SUM0. */
#define DSV4_INDEX_MX_CODE_SUM0 254
#define DSV4_INDEX_MX_SCALAR 0
#define DSV4_INDEX_MX_PARTIAL 1
#define DSV4_INDEX_MX_FUSED 2

/* The summary byte of one MXFP4 block: 0 for a block of zeros (any code but 255), the code for a
 * block with a nonzero value and a code in [2, 252], else DSV4_INDEX_MX_INVALID. */
DSV4_FN dsv4_u32 dsv4_index_mx_block(int nonzero, dsv4_u32 code) {
  if (!nonzero)
    return code == 255u ? DSV4_INDEX_MX_INVALID : 0u;
  return code >= DSV4_INDEX_MX_CODE_MIN && code <= DSV4_INDEX_MX_CODE_MAX ? code
                                                                          : DSV4_INDEX_MX_INVALID;
}

/* The summary of an MXFP4 record (64 value bytes, 4 codes): block b's byte in bits 8b..8b+7. */
DSV4_FN dsv4_u32 dsv4_index_mx_summary(const dsv4_u8 *vals, const dsv4_u8 *codes) {
  dsv4_u32 s = 0;
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    dsv4_u32 any = 0;
    for (int i = 0; i < DSV4_MXFP4_BLOCK / 2; i++)
      any |= (dsv4_u32)vals[(DSV4_MXFP4_BLOCK / 2) * b + i] & 0x77u;
    s |= dsv4_index_mx_block(any != 0u, codes[b]) << (8 * b);
  }
  return s;
}

/* max - min of a summary's nonzero bytes (0 with fewer than two). */
DSV4_FN dsv4_u32 dsv4_index_mx_span(dsv4_u32 s) {
  dsv4_u32 lo = 255u, hi = 0u;
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    dsv4_u32 c = (s >> (8 * b)) & 255u;
    if (c != 0u) {
      lo = c < lo ? c : lo;
      hi = c > hi ? c : hi;
    }
  }
  return hi >= lo ? hi - lo : 0u;
}

/*
 * The mode for every pair of a set of queries and a set of keys, from each set's per-block minima
 * lo (of the nonzero summary bytes, 255 where none: byte b in bits 8b..), maxima hi (0 where none)
 * and largest span: DSV4_INDEX_MX_FUSED, _PARTIAL or _SCALAR. Every pair of the sets meets the
 * bounds of the mode returned (a block zero on one side has no E_b, and 255 + 2 or 0 + 252 pass
 * either bound).
 */
DSV4_FN int dsv4_index_mx_mode(dsv4_u32 q_lo, dsv4_u32 q_hi, dsv4_u32 q_span, dsv4_u32 k_lo,
                               dsv4_u32 k_hi, dsv4_u32 k_span) {
  int fused = q_span + k_span <= DSV4_INDEX_MX_SPAN;
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    dsv4_i32 ql = (dsv4_i32)((q_lo >> (8 * b)) & 255u), qh = (dsv4_i32)((q_hi >> (8 * b)) & 255u);
    dsv4_i32 kl = (dsv4_i32)((k_lo >> (8 * b)) & 255u), kh = (dsv4_i32)((k_hi >> (8 * b)) & 255u);
    if (qh == (dsv4_i32)DSV4_INDEX_MX_INVALID || kh == (dsv4_i32)DSV4_INDEX_MX_INVALID ||
        ql + kl - DSV4_INDEX_MX_CODE_SUM0 < DSV4_INDEX_MX_E_MIN ||
        qh + kh - DSV4_INDEX_MX_CODE_SUM0 > DSV4_INDEX_MX_E_MAX)
      return DSV4_INDEX_MX_SCALAR;
    if (qh + kh - DSV4_INDEX_MX_CODE_SUM0 > DSV4_INDEX_MX_FUSED_E_MAX)
      fused = 0;
  }
  return fused ? DSV4_INDEX_MX_FUSED : DSV4_INDEX_MX_PARTIAL;
}

/* The largest and the smallest nonzero byte of a summary, or of a set's per-block maxima or minima
 * (0 and 255 where none); DSV4_INDEX_MX_INVALID is the largest byte there is. */
DSV4_FN void dsv4_index_mx_range(dsv4_u32 s, dsv4_u32 *hi, dsv4_u32 *lo) {
  *hi = 0u;
  *lo = 255u;
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    dsv4_u32 c = (s >> (8 * b)) & 255u;
    *hi = c > *hi ? c : *hi;
    *lo = c && c < *lo ? c : *lo;
  }
}

/*
 * A first look at the mode of a set of queries and a set of keys from their extremes over all four
 * blocks (the CUDA kernels' warp_mode, three warp reductions where dsv4_index_mx_mode's statistics
 * take nine): 1 when the largest summary bytes (q_hi, k_hi, from the sets' maxima by
 * dsv4_index_mx_range) are valid and sum to at most DSV4_INDEX_MX_FUSED_E_MAX, the smallest (q_lo,
 * k_lo) to at least DSV4_INDEX_MX_E_MIN, and the spans to at most DSV4_INDEX_MX_SPAN. Every block's
 * code sums then lie within the same bounds, so dsv4_index_mx_mode gives fused mode too
 * (index_mx_test holds it); 0 says nothing.
 */
DSV4_FN int dsv4_index_mx_fused_glance(dsv4_u32 q_hi, dsv4_u32 q_lo, dsv4_u32 q_span, dsv4_u32 k_hi,
                                       dsv4_u32 k_lo, dsv4_u32 k_span) {
  return q_hi != DSV4_INDEX_MX_INVALID && k_hi != DSV4_INDEX_MX_INVALID &&
         (dsv4_i32)(q_hi + k_hi) - DSV4_INDEX_MX_CODE_SUM0 <= DSV4_INDEX_MX_FUSED_E_MAX &&
         (dsv4_i32)(q_lo + k_lo) - DSV4_INDEX_MX_CODE_SUM0 >= DSV4_INDEX_MX_E_MIN &&
         q_span + k_span <= DSV4_INDEX_MX_SPAN;
}

/*
 * The range of a record's four codes taken as if every block were nonzero: *hi the largest code
 * (DSV4_INDEX_MX_INVALID where some code is outside [2, 252]), *lo the smallest, *span their
 * difference. The record's summary byte of a block is its code, or 0 for a zero block (or
 * DSV4_INDEX_MX_INVALID for a zero block of code 255, which makes *hi invalid here too), so
 * dsv4_index_mx_range and dsv4_index_mx_span of the summary lie within these (its largest byte no
 * larger, its smallest no smaller, its span no larger), and a first look
 * (dsv4_index_mx_fused_glance) that passes on these passes on the summary: the CUDA kernels take
 * it from the codes before they read a value byte (index_mx_test holds it).
 */
DSV4_FN void dsv4_index_mx_code_range(dsv4_u32 codes, dsv4_u32 *hi, dsv4_u32 *lo, dsv4_u32 *span) {
  dsv4_u32 h = 0u, l = 255u;
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    dsv4_u32 c = (codes >> (8 * b)) & 255u;
    h = c > h ? c : h;
    l = c < l ? c : l;
  }
  *hi = l >= DSV4_INDEX_MX_CODE_MIN && h <= DSV4_INDEX_MX_CODE_MAX ? h : DSV4_INDEX_MX_INVALID;
  *lo = l;
  *span = h - l;
}

/* The mode of one pair: dsv4_index_mx_mode of two sets of one vector each. */
DSV4_FN int dsv4_index_mx_pair_mode(dsv4_u32 qs, dsv4_u32 ks) {
  dsv4_u32 ql = 0, kl = 0;
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    dsv4_u32 q = (qs >> (8 * b)) & 255u, k = (ks >> (8 * b)) & 255u;
    ql |= (q ? q : 255u) << (8 * b);
    kl |= (k ? k : 255u) << (8 * b);
  }
  return dsv4_index_mx_mode(ql, qs, dsv4_index_mx_span(qs), kl, ks, dsv4_index_mx_span(ks));
}

/* The bytes of a and b selected by s (CUDA's __byte_perm, PTX prmt without sign replication):
 * byte i of the result is byte (s >> 4i) & 7 of the 8 bytes a (0..3), b (4..7). */
DSV4_FN dsv4_u32 dsv4_byte_perm(dsv4_u32 a, dsv4_u32 b, dsv4_u32 s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, s);
#else
  dsv4_u32 r = 0;
  for (int i = 0; i < 4; i++) {
    dsv4_u32 k = (s >> (4 * i)) & 7u;
    dsv4_u32 byte = k < 4u ? (a >> (8 * k)) & 255u : (b >> (8 * (k - 4u))) & 255u;
    r |= byte << (8 * i);
  }
  return r;
#endif
}

/*
 * The byte table of the bf16 values of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 times
 * 2^(code - 127), for a code in [2, 252] (other codes give some table): lut[0] and lut[1] hold the
 * high bytes of magnitudes 0..3 and 4..7, lut[2] and lut[3] the low bytes. Magnitude m >= 1 is
 * 2^a (1 + f / 2) with (a, f) = (-1, 0), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), so its
 * bf16 exponent field is code + a and its mantissa f << 6.
 */
DSV4_FN void dsv4_index_mx_lut(dsv4_u32 code, dsv4_u32 *lut) {
  lut[0] = lut[1] = lut[2] = lut[3] = 0;
  for (dsv4_u32 m = 1; m < 8u; m++) {
    dsv4_u32 a = m < 2u ? 0u : m < 4u ? 1u : m < 6u ? 2u : 3u; /* a + 1 */
    dsv4_u32 f = m >= 3u && (m & 1u) ? 1u : 0u;
    dsv4_u32 bits = ((code + a - 1u) & 255u) << 7 | f << 6;
    lut[m >> 2] |= (bits >> 8) << (8 * (m & 3u));
    lut[2 + (m >> 2)] |= (bits & 255u) << (8 * (m & 3u));
  }
}

/*
 * Four e2m1 nibbles x (element i in bits 4i..4i+3, sign in bit 3) as bf16 values times the
 * table's 2^(code - 127): elements 0 and 1 in *b0, 2 and 3 in *b1 (the lower element in the low
 * half). Exactly the bf16 bits of dsv4_e2m1_to_f32(nibble) * 2^(code - 127) for a code in
 * [2, 252]; a zero magnitude gives a signed zero. Six byte permutes and three logic operations.
 */
DSV4_FN void dsv4_index_mx_bf16x4(dsv4_u32 x, const dsv4_u32 *lut, dsv4_u32 *b0, dsv4_u32 *b1) {
  dsv4_u32 sel = x & 0x7777u;
  dsv4_u32 hi = dsv4_byte_perm(lut[0], lut[1], sel), lo = dsv4_byte_perm(lut[2], lut[3], sel);
  /* The signs (bits 3, 7, 11, 15 of x) to the top of bytes 0..3: from x << 4 and x. */
  dsv4_u32 sg = dsv4_byte_perm(x << 4, x, 0x5140u);
  hi |= sg & 0x80808080u;
  *b0 = dsv4_byte_perm(lo, hi, 0x5140u);
  *b1 = dsv4_byte_perm(lo, hi, 0x7362u);
}

/*
 * Eight nibbles x (element i in bits 4i..4i+3) on one byte table: b[0], b[1] are
 * dsv4_index_mx_bf16x4 of the low half, b[2], b[3] of the high half, bit for bit. The permutes
 * read only the low 16 bits of a selector, so both halves share the masking and the shifted copy
 * of x: ten byte permutes and four other operations for eight values.
 */
DSV4_FN void dsv4_index_mx_bf16x8(dsv4_u32 x, const dsv4_u32 *lut, dsv4_u32 *b) {
  dsv4_u32 sel = x & 0x77777777u, x4 = x << 4;
#ifdef __CUDA_ARCH__
  /* One mask for both halves: the compiler would narrow it to the low half for the first permutes
   * and mask again for the high half's. */
  asm("" : "+r"(sel));
#endif
  dsv4_u32 hi0 = dsv4_byte_perm(lut[0], lut[1], sel), lo0 = dsv4_byte_perm(lut[2], lut[3], sel);
  dsv4_u32 hi1 = dsv4_byte_perm(lut[0], lut[1], sel >> 16);
  dsv4_u32 lo1 = dsv4_byte_perm(lut[2], lut[3], sel >> 16);
  /* The signs of elements 0..3 (bits 3, 7, 11, 15) and 4..7 to the top of bytes 0..3. */
  hi0 |= dsv4_byte_perm(x4, x, 0x5140u) & 0x80808080u;
  hi1 |= dsv4_byte_perm(x4, x, 0x7362u) & 0x80808080u;
  b[0] = dsv4_byte_perm(lo0, hi0, 0x5140u);
  b[1] = dsv4_byte_perm(lo0, hi0, 0x7362u);
  b[2] = dsv4_byte_perm(lo1, hi1, 0x5140u);
  b[3] = dsv4_byte_perm(lo1, hi1, 0x7362u);
}

/* ---- index keys, queries and scores (SPEC §8.5) ---- */

/*
 * The index record of one entry from its pooled z[128]: z rounded to bf16, the RMS factor over
 * those values, y = bf16((z * r) * w) with the indexer compressor's norm weight, RoPE on dims
 * 64..127 with the row of position 4j, the Hadamard transform, MXFP4. vals receives the 64 value
 * bytes, codes the 4 block codes.
 */
DSV4_FN void dsv4_index_key(const float *z, const float *w, float eps, const float *rope_row,
                            dsv4_u8 *vals, dsv4_u8 *codes) {
  float y[DSV4_INDEX_DIM];
  for (int d = 0; d < DSV4_INDEX_DIM; d++)
    y[d] = dsv4_round_bf16(z[d]);
  float r = dsv4_index_rms_factor(dsv4_sumsq128(y), eps);
  for (int d = 0; d < DSV4_INDEX_DIM; d++)
    y[d] = dsv4_round_bf16((y[d] * r) * w[d]);
  dsv4_index_rope(y, rope_row);
  dsv4_hadamard128(y);
  dsv4_mxfp4_quant128(y, vals, codes);
}

/*
 * The dequantised index query q^ of one head from its 128 bf16 inputs (before RoPE): RoPE on dims
 * 64..127 at the token's position, the Hadamard transform, MXFP4, dequantisation. No norm.
 */
DSV4_FN void dsv4_index_query(const dsv4_u16 *iq, const float *rope_row, float *qhat) {
  float x[DSV4_INDEX_DIM];
  dsv4_u8 vals[DSV4_INDEX_VALUE_BYTES], codes[DSV4_MXFP4_BLOCKS];
  for (int d = 0; d < DSV4_INDEX_DIM; d++)
    x[d] = dsv4_bf16_to_f32(iq[d]);
  dsv4_index_rope(x, rope_row);
  dsv4_hadamard128(x);
  dsv4_mxfp4_quant128(x, vals, codes);
  dsv4_mxfp4_dequant128(vals, codes, qhat);
}

/* One head's term of an entry's score: fma(w_h, max(d, +0.0f), acc), where max gives +0.0f for
 * every d <= 0 (-0.0 included). Scores start from +0.0f and add the heads in order. */
DSV4_FN float dsv4_index_score_add(float w, float d, float acc) {
  return DSV4_FMA(w, d > 0.0f ? d : 0.0f, acc);
}

/*
 * A score as an unsigned key whose integer order is the scores' numeric order (-0.0 taken as
 * +0.0), for selection: the k largest keys, ties broken towards the lower entry, are the selection
 * of SPEC §8.5. Scores are finite (SPEC §8.8 bounds the inputs).
 */
DSV4_FN dsv4_u32 dsv4_index_score_key(float score) {
  dsv4_u32 u = dsv4_f2u(score);
  if ((u & 0x7fffffffu) == 0u)
    u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#endif /* DSV4_KERNELS_COMPRESS_H */
