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
