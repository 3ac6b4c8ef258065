/*
 * The compressed branch's vector work with AVX-512: the indexer's queries and scores (SPEC §8.5)
 * and the compressor's pooling (SPEC §8.3). Each is the scalar level's operations of
 * cpu_compress.c and dsv4-compress.h, each correctly rounded and in the same order, with one head,
 * entry or channel per lane, so the bytes are the same (tests/unit/compress_test.c compares every
 * level with the scalar one).
 *
 * Queries. Sixteen heads at a time, one per lane: their bf16 inputs are transposed into x[d][16],
 * where RoPE, the Hadamard butterflies and MXFP4 are element-wise. The result stays in that layout
 * (DSV4__CPU_INDEX_QHEADS), in which the four values of one dim of a quad of heads are side by
 * side.
 *
 * Scores. A pass takes four groups of 16 entries. Their records are dequantised once, into kt[d]
 * rows of 64 floats (dim d of the 64 entries): each record's 16 value dwords are transposed so
 * that a vector holds one dword (8 nibbles, dims 8m..8m+7) of 16 entries, and each nibble becomes
 * its e2m1 value by a permute, times the lane's block scale. The heads then run four at a time:
 * for each of the 8 chains, 16 accumulators (4 heads x 4 groups) advance together, each step
 * loading 4 key vectors and broadcasting 4 query values. The chains' sums are folded and added to
 * the scores head by head, in order.
 */
#if defined(__x86_64__)

/* Built with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma (kernels/CMakeLists.txt). */

#include <immintrin.h>
#include <stdint.h>

#include "cpu-simd.h"
#include "cpu-internal.h"
#include "dsv4-compress.h"

#define INLINE static inline __attribute__((always_inline))

#define LANES 16
#define GROUPS 4                /* groups of 16 entries per pass */
#define KT_ROW (GROUPS * LANES) /* floats of one dim of the dequantised keys */
#define QUAD DSV4__CPU_INDEX_QUAD
#define QSTRIDE DSV4__CPU_INDEX_QHEADS /* floats between two dims of one head of q^ */
#define CHAINS 8

/* ---- the queries: one head per lane ---- */

/* dsv4_round_bf16 per lane: round to nearest even, a NaN quieted. */
INLINE __m512 round_bf16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f), hi = _mm512_set1_epi32((int)0xffff0000u);
  __m512i r = _mm512_add_epi32(
      u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  r = _mm512_and_si512(r, hi);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan,
                            _mm512_or_si512(_mm512_and_si512(u, hi), _mm512_set1_epi32(0x400000)));
  return _mm512_castsi512_ps(r);
}

/* The bf16 inputs of heads 0..nh-1 (the rest zero) into x[d * 16 + head] as fp32. */
static void queries_load(const uint16_t *iq, uint32_t nh, float *x) {
  for (int db = 0; db < DSV4_INDEX_DIM / LANES; db++) {
    __m512 r[LANES];
    for (uint32_t i = 0; i < LANES; i++)
      r[i] = i < nh ? _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                              (const __m256i *)(iq + (size_t)i * DSV4_INDEX_DIM + LANES * db))),
                          16))
                    : _mm512_setzero_ps();
    dsv4__transpose16(r);
    for (int k = 0; k < LANES; k++)
      _mm512_store_ps(x + (LANES * db + k) * QSTRIDE, r[k]);
  }
}

/* dsv4_index_rope, then dsv4_hadamard128, on every lane of x. */
static void queries_rope_hadamard(const float *rope_row, float *x) {
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float *pe = x + (DSV4_INDEX_ROPE_FIRST + 2 * i) * QSTRIDE, *po = pe + QSTRIDE;
    const __m512 e = _mm512_load_ps(pe), o = _mm512_load_ps(po);
    const __m512 c = _mm512_set1_ps(rope_row[i]),
                 sn = _mm512_set1_ps(rope_row[DSV4_ROPE_PAIRS + i]);
    /* dsv4_rope_even: fma(e, c, -(o * s)); dsv4_rope_odd: fma(e, s, o * c). */
    __m512 nos =
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(o, sn)), sign));
    _mm512_store_ps(pe, round_bf16(_mm512_fmadd_ps(e, c, nos)));
    _mm512_store_ps(po, round_bf16(_mm512_fmadd_ps(e, sn, _mm512_mul_ps(o, c))));
  }
  for (int h = 1; h < DSV4_INDEX_DIM; h <<= 1)
    for (int i = 0; i < DSV4_INDEX_DIM; i++)
      if ((i & h) == 0) {
        const __m512 a = _mm512_load_ps(x + i * QSTRIDE), b = _mm512_load_ps(x + (i + h) * QSTRIDE);
        _mm512_store_ps(x + i * QSTRIDE, _mm512_add_ps(a, b));
        _mm512_store_ps(x + (i + h) * QSTRIDE, _mm512_sub_ps(a, b));
      }
  const __m512 scale = _mm512_set1_ps(dsv4_u2f(DSV4_HADAMARD_SCALE_BITS));
  for (int i = 0; i < DSV4_INDEX_DIM; i++)
    _mm512_store_ps(x + i * QSTRIDE,
                    round_bf16(_mm512_mul_ps(_mm512_load_ps(x + i * QSTRIDE), scale)));
}

/*
 * dsv4_mxfp4_quant128 then dsv4_mxfp4_dequant128 on every lane of x, in place: per block of 32 the
 * amax (max(|v|, amax) skips a NaN as amax's a > amax ? a : amax does), its exponent e by exact
 * comparison, then each value's e2m1 code from v * 2^-e by the comparisons of dsv4_e2m1_nibble
 * (7 less the thresholds it meets, so a NaN gives 7 as there), its grid value with v's sign, times
 * 2^e.
 */
static void queries_mxfp4(float *x) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff),
                sign = _mm512_set1_epi32((int)0x80000000u);
  const __m512 grid = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0.0f, 0.0f,
                                     0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
  const __m512i one = _mm512_set1_epi32(1);
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++) {
    float *blk = x + DSV4_MXFP4_BLOCK * b * QSTRIDE;
    __m512 amax = _mm512_set1_ps(dsv4_u2f(DSV4_MXFP4_AMAX_FLOOR_BITS));
    for (int k = 0; k < DSV4_MXFP4_BLOCK; k++)
      amax = _mm512_max_ps(
          _mm512_castsi512_ps(_mm512_and_si512(_mm512_load_si512(blk + k * QSTRIDE), abs_mask)),
          amax);
    /* dsv4_mxfp4_exponent: E - 2, plus one when amax > 6 * 2^(E - 2). */
    __m512i e =
        _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(amax), 23), _mm512_set1_epi32(129));
    __m512 six = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(129)), 23),
                        _mm512_set1_epi32(0x400000)));
    e = _mm512_mask_add_epi32(e, _mm512_cmp_ps_mask(amax, six, _CMP_GT_OQ), e, one);
    const __m512 down =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), e), 23));
    const __m512 up =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23));
    for (int k = 0; k < DSV4_MXFP4_BLOCK; k++) {
      const __m512 v = _mm512_mul_ps(_mm512_load_ps(blk + k * QSTRIDE), down);
      const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
      __m512i code = _mm512_set1_epi32(7);
      code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LE_OQ),
                                   code, one);
      code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.75f), _CMP_LT_OQ),
                                   code, one);
      code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.25f), _CMP_LE_OQ),
                                   code, one);
      code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.75f), _CMP_LT_OQ),
                                   code, one);
      code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.5f), _CMP_LE_OQ),
                                   code, one);
      code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.5f), _CMP_LT_OQ),
                                   code, one);
      code = _mm512_mask_sub_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(5.0f), _CMP_LE_OQ),
                                   code, one);
      __m512 g = _mm512_permutexvar_ps(code, grid);
      g = _mm512_castsi512_ps(
          _mm512_or_si512(_mm512_castps_si512(g), _mm512_and_si512(_mm512_castps_si512(v), sign)));
      _mm512_store_ps(blk + k * QSTRIDE, _mm512_mul_ps(g, up));
    }
  }
}

void dsv4__cpu_index_queries_avx512(const uint16_t *iq, uint32_t n_heads, const float *rope_row,
                                    float *qt) {
  for (uint32_t h0 = 0; h0 < n_heads; h0 += LANES) {
    float *x = qt + (size_t)h0 * DSV4_INDEX_DIM;
    queries_load(iq + (size_t)h0 * DSV4_INDEX_DIM, n_heads - h0 < LANES ? n_heads - h0 : LANES, x);
    queries_rope_hadamard(rope_row, x);
    queries_mxfp4(x);
  }
}

/* ---- the scores: one entry per lane ---- */

/* The lanes of the group that starts at lane `first` of the run's lanes that hold visible
 * entries (lanes lead .. end - 1). */
static __mmask16 group_lanes(uint32_t first, uint32_t lead, uint32_t end) {
  uint32_t lo = lead > first ? lead - first : 0, hi = end > first ? end - first : 0;
  if (hi > LANES)
    hi = LANES;
  if (lo >= hi)
    return 0;
  return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/*
 * The 16 records of a group into kt[d * KT_ROW + lane], as dsv4_mxfp4_dequant128 computes them:
 * the nibble's e2m1 value (exact) times 2^(code - 127) (one rounding, none in range). Lanes not in
 * `lanes` read nothing and hold +0.0f (zero values times a zero scale).
 */
static void dequant_group(const dsv4__cpu_index_group_t *g, __mmask16 lanes, float *kt) {
  const __m512 grid = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                     -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512i byte = _mm512_set1_epi32(0xff);
  const __m512i codes = _mm512_maskz_loadu_epi32(lanes, g->codes);
  __m512 scale[DSV4_MXFP4_BLOCKS];
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++)
    scale[b] = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(codes, 8 * b), byte), 23));
  __m512 r[LANES];
  for (int i = 0; i < LANES; i++)
    r[i] = (lanes >> i) & 1u ? _mm512_loadu_ps(g->vals + DSV4_INDEX_VALUE_BYTES * i)
                             : _mm512_setzero_ps();
  dsv4__transpose16(r);
  /* Dword m holds dims 8m..8m+7 (MXFP4 block m / 4), dim 8m+n in bits 4n..4n+3; vpermps reads
   * the low 4 bits of each index. */
  for (int b = 0; b < DSV4_MXFP4_BLOCKS; b++)
    for (int m = 4 * b; m < 4 * b + 4; m++) {
      const __m512i v = _mm512_castps_si512(r[m]);
#pragma GCC unroll 8
      for (int n = 0; n < 8; n++) {
        __m512 x = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * n), grid);
        _mm512_store_ps(kt + (8 * m + n) * KT_ROW, _mm512_mul_ps(x, scale[b]));
      }
    }
}

/* The 8 chains of four heads over the pass's keys: part[(l * 16 + 4 * h + g) * 16] is chain l of
 * head h over group g, each from +0.0f over its 16 dims in order. */
static void quad_chains(const float *kt, const float *q4, float *part) {
  for (int l = 0; l < CHAINS; l++) {
    __m512 acc[QUAD][GROUPS];
#pragma GCC unroll 4
    for (int h = 0; h < QUAD; h++)
#pragma GCC unroll 4
      for (int g = 0; g < GROUPS; g++)
        acc[h][g] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
      const int d = 16 * l + k;
      __m512 kv[GROUPS];
#pragma GCC unroll 4
      for (int g = 0; g < GROUPS; g++)
        kv[g] = _mm512_load_ps(kt + d * KT_ROW + LANES * g);
#pragma GCC unroll 4
      for (int h = 0; h < QUAD; h++) {
        const __m512 q = _mm512_set1_ps(q4[QSTRIDE * d + h]);
#pragma GCC unroll 4
        for (int g = 0; g < GROUPS; g++)
          acc[h][g] = _mm512_fmadd_ps(q, kv[g], acc[h][g]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < QUAD; h++)
#pragma GCC unroll 4
      for (int g = 0; g < GROUPS; g++)
        _mm512_store_ps(part + ((l * QUAD + h) * GROUPS + g) * LANES, acc[h][g]);
  }
}

/* Heads h0..h0+nh-1 in order: each one's chains folded (dsv4_fold8), then added to the scores. */
static void quad_scores(const float *part, const float *w, uint32_t nh, __m512 *sc) {
  const __m512 zero = _mm512_setzero_ps();
  for (uint32_t h = 0; h < nh; h++) {
    const __m512 wh = _mm512_set1_ps(w[h]);
#pragma GCC unroll 4
    for (int g = 0; g < GROUPS; g++) {
      __m512 p[CHAINS];
#pragma GCC unroll 8
      for (int l = 0; l < CHAINS; l++)
        p[l] = _mm512_load_ps(part + ((l * QUAD + h) * GROUPS + g) * LANES);
      /* dsv4_fold8, written out so that the partials stay in registers. */
      p[0] = _mm512_add_ps(p[0], p[4]);
      p[1] = _mm512_add_ps(p[1], p[5]);
      p[2] = _mm512_add_ps(p[2], p[6]);
      p[3] = _mm512_add_ps(p[3], p[7]);
      p[0] = _mm512_add_ps(p[0], p[2]);
      p[1] = _mm512_add_ps(p[1], p[3]);
      p[0] = _mm512_add_ps(p[0], p[1]);
      /* vmaxps returns its second operand for a NaN and for two zeros: max(-0, +0) = +0. */
      sc[g] = _mm512_fmadd_ps(wh, _mm512_max_ps(p[0], zero), sc[g]);
    }
  }
}

void dsv4__cpu_index_scan_avx512(const dsv4__cpu_index_scan_t *s) {
  float *kt = s->work;
  float *part = kt + DSV4_INDEX_DIM * KT_ROW;
  const uint32_t end = s->lead + s->n, n_groups = (end + LANES - 1) / LANES;
  for (uint32_t g0 = 0; g0 < n_groups; g0 += GROUPS) {
    for (uint32_t g = 0; g < GROUPS; g++) {
      __mmask16 lanes = group_lanes(LANES * (g0 + g), s->lead, end);
      if (lanes) {
        dequant_group(&s->groups[g0 + g], lanes, kt + LANES * g);
        continue;
      }
      for (int d = 0; d < DSV4_INDEX_DIM; d++)
        _mm512_store_ps(kt + d * KT_ROW + LANES * g, _mm512_setzero_ps());
    }
    __m512 sc[GROUPS];
    for (int g = 0; g < GROUPS; g++)
      sc[g] = _mm512_setzero_ps();
    for (uint32_t h0 = 0; h0 < s->n_heads; h0 += QUAD) {
      quad_chains(kt, s->qt + (size_t)(h0 / QSTRIDE) * QSTRIDE * DSV4_INDEX_DIM + h0 % QSTRIDE,
                  part);
      uint32_t nh = s->n_heads - h0 < QUAD ? s->n_heads - h0 : QUAD;
      quad_scores(part, s->w + h0, nh, sc);
    }
    for (uint32_t g = 0; g < GROUPS && g0 + g < n_groups; g++) {
      const uint32_t first = LANES * (g0 + g);
      __mmask16 lanes = group_lanes(first, s->lead, end);
      /* Lane i is entry first + i - lead of the run. */
      __m512i idx =
          _mm512_add_epi32(_mm512_set1_epi32((int)(first - s->lead)),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      _mm512_mask_i32scatter_ps(s->scores, lanes, idx, sc[g], 4);
    }
  }
}

/* ---- the compressor's pooling: one channel per lane ---- */

/* Row k's scores at channels c..c+15: s + ape rounded once, or the ring's stored s. */
INLINE __m512 pool_score(const dsv4__cpu_pool_row_t *r, uint32_t c) {
  const __m512 s = _mm512_loadu_ps(r->s + c);
  return r->ape ? _mm512_add_ps(s, _mm512_loadu_ps(r->ape + c)) : s;
}

/* max(s, m) returns m for a NaN s and for equal values, as dsv4_pool_max's s > m ? s : m does. */
void dsv4__cpu_pool_rows_avx512(const dsv4__cpu_pool_row_t *rows, uint32_t n, uint32_t channels,
                                float *z) {
  for (uint32_t c = 0; c < channels; c += 16) {
    __m512 m = pool_score(&rows[0], c);
    for (uint32_t k = 1; k < n; k++)
      m = _mm512_max_ps(pool_score(&rows[k], c), m);
    __m512 sum = _mm512_setzero_ps(), num = _mm512_setzero_ps();
    for (uint32_t k = 0; k < n; k++) {
      const __m512 e = dsv4__expf16(_mm512_sub_ps(pool_score(&rows[k], c), m));
      sum = _mm512_add_ps(sum, e);
      num = _mm512_fmadd_ps(e, _mm512_loadu_ps(rows[k].kv + c), num);
    }
    _mm512_storeu_ps(z + c, _mm512_div_ps(num, sum));
  }
}

#endif /* __x86_64__ */
