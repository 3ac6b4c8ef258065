/*
 * The compressed branch's vector work with AVX2 + FMA, for machines without AVX-512: the indexer's
 * queries and scores (SPEC §8.5) and the compressor's pooling (SPEC §8.3), as in
 * cpu_compress_avx512.c on 8 lanes. Each is the scalar level's operations, each correctly rounded
 * and in the same order, with one head, entry or channel per lane, so the bytes are the same
 * (tests/unit/compress_test.c compares every level with the scalar one).
 *
 * Queries. Eight heads at a time, one per lane, in the DSV4__CPU_INDEX_QHEADS layout (two vectors
 * fill one group of 16 heads). The e2m1 value comes from a permute of the eight magnitudes and the
 * sign bit, as AVX2's permute reads only 8 entries.
 *
 * Scores. A pass takes one group of 16 entries, two vectors of 8. Its records are dequantised once,
 * into kt[d] rows of 16 floats (dim d of the 16 entries): the value dwords of 8 records are
 * transposed (two 8 x 8 transposes, dwords 0..7 and 8..15) so that a vector holds one dword (8
 * nibbles, dims 8m..8m+7) of 8 entries, and each nibble becomes its e2m1 value, times the lane's
 * block scale. The heads then run four at a time: for each of the 8 chains, 8 accumulators (4
 * heads x 2 vectors) advance together, each step loading 2 key vectors and broadcasting 4 query
 * values (16 registers hold no more). The chains' sums are folded and added to the scores head by
 * head, in order.
 */
#if defined(__x86_64__)

/* Built with -mavx2 -mfma (kernels/CMakeLists.txt). */

#include <immintrin.h>
#include <stdint.h>

#include "cpu-simd.h"
#include "cpu-internal.h"
#include "dsv4-compress.h"

#define INLINE static inline __attribute__((always_inline))

#define LANES 8
#define HALVES 2 /* vectors of one group of 16 entries */
#define KT_ROW DSV4__CPU_INDEX_GROUP
#define QUAD DSV4__CPU_INDEX_QUAD
#define QSTRIDE DSV4__CPU_INDEX_QHEADS /* floats between two dims of one head of q^ */
#define CHAINS 8

/* ---- the queries: one head per lane ---- */

/* dsv4_round_bf16 per lane: round to nearest even, a NaN quieted. */
INLINE __m256 round_bf16(__m256 f) {
  const __m256i u = _mm256_castps_si256(f), hi = _mm256_set1_epi32((int)0xffff0000u);
  __m256i r = _mm256_add_epi32(
      u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                          _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  r = _mm256_and_si256(r, hi);
  /* |u| as a signed integer is >= 0, so the signed comparison finds the NaNs. */
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                   _mm256_set1_epi32(0x7f800000));
  __m256i q = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x400000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan));
}

/* The bf16 inputs of heads 0..nh-1 (the rest zero) into x[d * 16 + head] as fp32. */
static void queries_load(const uint16_t *iq, uint32_t nh, float *x) {
  for (int db = 0; db < DSV4_INDEX_DIM / LANES; db++) {
    __m256 r[LANES];
    for (uint32_t i = 0; i < LANES; i++)
      r[i] = i < nh ? _mm256_castsi256_ps(_mm256_slli_epi32(
                          _mm256_cvtepu16_epi32(_mm_loadu_si128(
                              (const __m128i *)(iq + (size_t)i * DSV4_INDEX_DIM + LANES * db))),
                          16))
                    : _mm256_setzero_ps();
    dsv4__transpose8(r);
    for (int k = 0; k < LANES; k++)
      _mm256_store_ps(x + (LANES * db + k) * QSTRIDE, r[k]);
  }
}

/* dsv4_index_rope, then dsv4_hadamard128, on every lane of x. */
static void queries_rope_hadamard(const float *rope_row, float *x) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float *pe = x + (DSV4_INDEX_ROPE_FIRST + 2 * i) * QSTRIDE, *po = pe + QSTRIDE;
    const __m256 e = _mm256_load_ps(pe), o = _mm256_load_ps(po);
    const __m256 c = _mm256_set1_ps(rope_row[i]),
                 sn = _mm256_set1_ps(rope_row[DSV4_ROPE_PAIRS + i]);
    /* dsv4_rope_even: fma(e, c, -(o * s)); dsv4_rope_odd: fma(e, s, o * c). */
    _mm256_store_ps(pe,
                    round_bf16(_mm256_fmadd_ps(e, c, _mm256_xor_ps(_mm256_mul_ps(o, sn), sign))));
    _mm256_store_ps(po, round_bf16(_mm256_fmadd_ps(e, sn, _mm256_mul_ps(o, c))));
  }
  for (int h = 1; h < DSV4_INDEX_DIM; h <<= 1)
    for (int i = 0; i < DSV4_INDEX_DIM; i++)
      if ((i & h) == 0) {
        const __m256 a = _mm256_load_ps(x + i * QSTRIDE), b = _mm256_load_ps(x + (i + h) * QSTRIDE);
        _mm256_store_ps(x + i * QSTRIDE, _mm256_add_ps(a, b));
        _mm256_store_ps(x + (i + h) * QSTRIDE, _mm256_sub_ps(a, b));
      }
  const __m256 scale = _mm256_set1_ps(dsv4_u2f(DSV4_HADAMARD_SCALE_BITS));
  for (int i = 0; i < DSV4_INDEX_DIM; i++)
    _mm256_store_ps(x + i * QSTRIDE,
                    round_bf16(_mm256_mul_ps(_mm256_load_ps(x + i * QSTRIDE), scale)));
}

/* One threshold of dsv4_e2m1_nibble: code - 1 where a meets it (an ordered comparison: a NaN meets
 * none, so its code stays 7 as there). */
#define NIBBLE_STEP(code, a, t, pred)                                                              \
  _mm256_add_epi32((code), _mm256_castps_si256(_mm256_cmp_ps((a), _mm256_set1_ps(t), (pred))))

/*
 * dsv4_mxfp4_quant128 then dsv4_mxfp4_dequant128 on every lane of x, in place: per block of 32 the
 * amax (max(|v|, amax) skips a NaN as amax's a > amax ? a : amax does), its exponent e by exact
 * comparison, then each value's e2m1 code from v * 2^-e by the comparisons of dsv4_e2m1_nibble,
 * its grid value with v's sign, times 2^e.
 */
static void queries_mxfp4(float *x) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  const __m256 grid = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    float *blk = x + DSV4_MXFP4_BLOCK * b * QSTRIDE;
    __m256 amax = _mm256_set1_ps(dsv4_u2f(DSV4_MXFP4_AMAX_FLOOR_BITS));
    for (int k = 0; k < DSV4_MXFP4_BLOCK; k++)
      amax = _mm256_max_ps(_mm256_and_ps(_mm256_load_ps(blk + k * QSTRIDE), abs_mask), amax);
    /* dsv4_mxfp4_exponent: E - 2, plus one when amax > 6 * 2^(E - 2). */
    __m256i e =
        _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(amax), 23), _mm256_set1_epi32(129));
    __m256 six = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(129)), 23),
                        _mm256_set1_epi32(0x400000)));
    e = _mm256_sub_epi32(e, _mm256_castps_si256(_mm256_cmp_ps(amax, six, _CMP_GT_OQ)));
    const __m256 down =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), e), 23));
    const __m256 up =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    for (int k = 0; k < DSV4_MXFP4_BLOCK; k++) {
      const __m256 v = _mm256_mul_ps(_mm256_load_ps(blk + k * QSTRIDE), down);
      const __m256 a = _mm256_and_ps(v, abs_mask);
      __m256i code = _mm256_set1_epi32(7);
      code = NIBBLE_STEP(code, a, 0.25f, _CMP_LE_OQ);
      code = NIBBLE_STEP(code, a, 0.75f, _CMP_LT_OQ);
      code = NIBBLE_STEP(code, a, 1.25f, _CMP_LE_OQ);
      code = NIBBLE_STEP(code, a, 1.75f, _CMP_LT_OQ);
      code = NIBBLE_STEP(code, a, 2.5f, _CMP_LE_OQ);
      code = NIBBLE_STEP(code, a, 3.5f, _CMP_LT_OQ);
      code = NIBBLE_STEP(code, a, 5.0f, _CMP_LE_OQ);
      __m256 g = _mm256_or_ps(_mm256_permutevar8x32_ps(grid, code), _mm256_and_ps(v, sign));
      _mm256_store_ps(blk + k * QSTRIDE, _mm256_mul_ps(g, up));
    }
  }
}

void dsv4__cpu_index_queries_avx2(const uint16_t *iq, uint32_t n_heads, const float *rope_row,
                                  float *qt) {
  const uint32_t padded = (n_heads + QSTRIDE - 1) / QSTRIDE * QSTRIDE;
  for (uint32_t h0 = 0; h0 < padded; h0 += LANES) {
    float *x = qt + (size_t)(h0 / QSTRIDE) * QSTRIDE * DSV4_INDEX_DIM + h0 % QSTRIDE;
    uint32_t nh = h0 < n_heads ? (n_heads - h0 < LANES ? n_heads - h0 : LANES) : 0;
    queries_load(nh ? iq + (size_t)h0 * DSV4_INDEX_DIM : iq, nh, x);
    queries_rope_hadamard(rope_row, x);
    queries_mxfp4(x);
  }
}

/* ---- the scores: one entry per lane ---- */

/* The lanes (bit i: lane i of the group's 16) of the group that starts at lane `first` of the run's
 * lanes that hold visible entries (lanes lead .. end - 1). */
static uint32_t group_lanes(uint32_t first, uint32_t lead, uint32_t end) {
  uint32_t lo = lead > first ? lead - first : 0, hi = end > first ? end - first : 0;
  if (hi > DSV4__CPU_INDEX_GROUP)
    hi = DSV4__CPU_INDEX_GROUP;
  if (lo >= hi)
    return 0;
  return ((1u << hi) - 1u) & ~((1u << lo) - 1u);
}

/* The 8 lanes of bits as a vector mask (all ones in a lane that is set). */
static __m256i lane_mask(uint32_t bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}

/*
 * Entries 8h..8h+7 of a group into kt[d * KT_ROW + 8h + lane], as dsv4_mxfp4_dequant128 computes
 * them: the nibble's e2m1 value (exact) times 2^(code - 127). Lanes not in bits (the 8 lanes of
 * this half) read nothing and hold +0.0f (zero values times a zero scale).
 */
static void dequant_half(const dsv4__cpu_index_group_t *g, int h, uint32_t bits, float *kt) {
  const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u), byte = _mm256_set1_epi32(0xff);
  const __m256i codes = _mm256_maskload_epi32(
      (const int *)(g->codes + DSV4_MXFP4_BLOCKS * LANES * h), lane_mask(bits));
  __m256 scale[DSV4_MXFP4_BLOCKS];
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++)
    scale[b] = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(codes, 8 * b), byte), 23));
  __m256 lo[LANES], hi[LANES];
  for (int i = 0; i < LANES; i++) {
    const uint8_t *rec = g->vals + DSV4_INDEX_VALUE_BYTES * (LANES * h + i);
    int on = (bits >> i) & 1u;
    lo[i] = on ? _mm256_loadu_ps((const float *)rec) : _mm256_setzero_ps();
    hi[i] = on ? _mm256_loadu_ps((const float *)(rec + 32)) : _mm256_setzero_ps();
  }
  dsv4__transpose8(lo);
  dsv4__transpose8(hi);
  /* Dword m holds dims 8m..8m+7 (MXFP4 block m / 4), dim 8m+n in bits 4n..4n+3: vpermps reads the
   * magnitude from the low 3 bits, bit 3 is the sign. */
  for (int m = 0; m < 16; m++) {
    const __m256i v = _mm256_castps_si256(m < 8 ? lo[m] : hi[m - 8]);
#pragma GCC unroll 8
    for (int n = 0; n < 8; n++) {
      __m256i t = _mm256_srli_epi32(v, 4 * n);
      __m256 x = _mm256_permutevar8x32_ps(mag, t);
      x = _mm256_or_ps(x,
                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(t, 28), sign_bit)));
      _mm256_store_ps(kt + (8 * m + n) * KT_ROW + LANES * h, _mm256_mul_ps(x, scale[m / 4]));
    }
  }
}

/* The 8 chains of four heads over the group's keys: part[(l * 8 + 2 * q + v) * 8] is chain l of
 * head q over vector v, each from +0.0f over its 16 dims in order. */
static void quad_chains(const float *kt, const float *q4, float *part) {
  for (int l = 0; l < CHAINS; l++) {
    __m256 acc[QUAD][HALVES];
#pragma GCC unroll 4
    for (int q = 0; q < QUAD; q++)
#pragma GCC unroll 2
      for (int v = 0; v < HALVES; v++)
        acc[q][v] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
      const int d = 16 * l + k;
      const __m256 k0 = _mm256_load_ps(kt + d * KT_ROW), k1 = _mm256_load_ps(kt + d * KT_ROW + 8);
#pragma GCC unroll 4
      for (int q = 0; q < QUAD; q++) {
        const __m256 x = _mm256_broadcast_ss(q4 + QSTRIDE * d + q);
        acc[q][0] = _mm256_fmadd_ps(x, k0, acc[q][0]);
        acc[q][1] = _mm256_fmadd_ps(x, k1, acc[q][1]);
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < QUAD; q++)
#pragma GCC unroll 2
      for (int v = 0; v < HALVES; v++)
        _mm256_store_ps(part + ((l * QUAD + q) * HALVES + v) * LANES, acc[q][v]);
  }
}

/* Heads h0..h0+nh-1 in order: each one's chains folded (dsv4_fold8), then added to the scores. */
static void quad_scores(const float *part, const float *w, uint32_t nh, __m256 *sc) {
  const __m256 zero = _mm256_setzero_ps();
  for (uint32_t q = 0; q < nh; q++) {
    const __m256 wq = _mm256_set1_ps(w[q]);
#pragma GCC unroll 2
    for (int v = 0; v < HALVES; v++) {
      __m256 p[CHAINS];
#pragma GCC unroll 8
      for (int l = 0; l < CHAINS; l++)
        p[l] = _mm256_load_ps(part + ((l * QUAD + q) * HALVES + v) * LANES);
      /* dsv4_fold8, written out so that the partials stay in registers. */
      p[0] = _mm256_add_ps(p[0], p[4]);
      p[1] = _mm256_add_ps(p[1], p[5]);
      p[2] = _mm256_add_ps(p[2], p[6]);
      p[3] = _mm256_add_ps(p[3], p[7]);
      p[0] = _mm256_add_ps(p[0], p[2]);
      p[1] = _mm256_add_ps(p[1], p[3]);
      p[0] = _mm256_add_ps(p[0], p[1]);
      /* vmaxps returns its second operand for a NaN and for two zeros: max(-0, +0) = +0. */
      sc[v] = _mm256_fmadd_ps(wq, _mm256_max_ps(p[0], zero), sc[v]);
    }
  }
}

void dsv4__cpu_index_scan_avx2(const dsv4__cpu_index_scan_t *s) {
  float *kt = s->work;
  float *part = kt + DSV4_INDEX_DIM * KT_ROW;
  const uint32_t end = s->lead + s->n;
  for (uint32_t first = 0; first < end; first += DSV4__CPU_INDEX_GROUP) {
    const dsv4__cpu_index_group_t *g = &s->groups[first / DSV4__CPU_INDEX_GROUP];
    const uint32_t bits = group_lanes(first, s->lead, end);
    for (int h = 0; h < HALVES; h++)
      dequant_half(g, h, (bits >> (LANES * h)) & 0xffu, kt);
    __m256 sc[HALVES] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (uint32_t h0 = 0; h0 < s->n_heads; h0 += QUAD) {
      quad_chains(kt, s->qt + (size_t)(h0 / QSTRIDE) * QSTRIDE * DSV4_INDEX_DIM + h0 % QSTRIDE,
                  part);
      uint32_t nh = s->n_heads - h0 < QUAD ? s->n_heads - h0 : QUAD;
      quad_scores(part, s->w + h0, nh, sc);
    }
    float out[DSV4__CPU_INDEX_GROUP] __attribute__((aligned(32)));
    _mm256_store_ps(out, sc[0]);
    _mm256_store_ps(out + LANES, sc[1]);
    /* Lane i is entry first + i - lead of the run. */
    for (uint32_t i = 0; i < DSV4__CPU_INDEX_GROUP; i++)
      if ((bits >> i) & 1u)
        s->scores[first + i - s->lead] = out[i];
  }
}

/* ---- the compressor's pooling: one channel per lane ---- */

/* Row k's scores at channels c..c+7: s + ape rounded once, or the ring's stored s. */
INLINE __m256 pool_score(const dsv4__cpu_pool_row_t *r, uint32_t c) {
  const __m256 s = _mm256_loadu_ps(r->s + c);
  return r->ape ? _mm256_add_ps(s, _mm256_loadu_ps(r->ape + c)) : s;
}

/* max(s, m) returns m for a NaN s and for equal values, as dsv4_pool_max's s > m ? s : m does. */
void dsv4__cpu_pool_rows_avx2(const dsv4__cpu_pool_row_t *rows, uint32_t n, uint32_t channels,
                              float *z) {
  for (uint32_t c = 0; c < channels; c += 8) {
    __m256 m = pool_score(&rows[0], c);
    for (uint32_t k = 1; k < n; k++)
      m = _mm256_max_ps(pool_score(&rows[k], c), m);
    __m256 sum = _mm256_setzero_ps(), num = _mm256_setzero_ps();
    for (uint32_t k = 0; k < n; k++) {
      const __m256 e = dsv4__expf8(_mm256_sub_ps(pool_score(&rows[k], c), m));
      sum = _mm256_add_ps(sum, e);
      num = _mm256_fmadd_ps(e, _mm256_loadu_ps(rows[k].kv + c), num);
    }
    _mm256_storeu_ps(z + c, _mm256_div_ps(num, sum));
  }
}

#endif /* __x86_64__ */
