/*
 * Exact attention (SPEC §7, §8.6) with AVX2 + FMA, for x86-64 machines without AVX-512: the
 * operations of the scalar level in cpu_attention.c, each correctly rounded and in the same order,
 * on 8 independent chains at a time, so the bytes are the same (tests/unit/attention_test.c and
 * attention_union_test.c compare every level with the scalar one).
 *
 * The layout is cpu_attention_avx512.c's: each candidate chain-transposed (row k holds element k
 * of the dot product's 32 chains), so that one fmadd advances 8 chains; N accumulates element-wise
 * in that layout and is transposed back per head (8 x 8 blocks) before the division's result is
 * rotated and rounded. With 16 vector registers the logits take two heads per pass over a
 * tile and the accumulation of N four heads, two vectors of each per pass; N is kept in memory
 * between tiles (a store and a load are exact).
 */
#if defined(__x86_64__)

/* Built with -mavx2 -mfma (kernels/CMakeLists.txt). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu-internal.h"
#include "cpu-simd.h"
#include "dsv4-numerics.h"

#define INLINE static inline __attribute__((always_inline))

/* Heads of one item processed together (the accumulation of N); logits go by pairs. */
#define QUAD 4

/*
 * 32 chains given as c[2l] (elements 0..7 of chain l) and c[2l + 1] (elements 8..15) written as 16
 * rows of 32 floats (lanes = chains): one 8 x 8 transpose per group of 8 chains and half.
 */
INLINE void store_transposed(__m256 *c, float *rows) {
#pragma GCC unroll 4
  for (int g = 0; g < 4; g++)
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
      __m256 b[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++)
        b[i] = c[2 * (8 * g + i) + half];
      dsv4__transpose8(b);
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++)
        _mm256_store_ps(rows + 32 * (8 * half + j) + 8 * g, b[j]);
    }
}

/* The inverse: rows (lanes = chains) back to natural order, 16 values per chain. */
INLINE void load_untransposed(const float *rows, __m256 den, __m256 *c) {
#pragma GCC unroll 4
  for (int g = 0; g < 4; g++)
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
      __m256 b[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++)
        b[j] = _mm256_div_ps(_mm256_load_ps(rows + 32 * (8 * half + j) + 8 * g), den);
      dsv4__transpose8(b);
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++)
        c[2 * (8 * g + i) + half] = b[i];
    }
}

INLINE __m256i set1(uint32_t v) {
  return _mm256_set1_epi32((int)v);
}

/* dsv4_e4m3_to_f32 of 8 bytes, times the tile's scale (both exact, as in the scalar level). */
INLINE __m256 e4m3x8(const uint8_t *p, __m256 scale) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  __m256i s = _mm256_slli_epi32(_mm256_and_si256(b, set1(0x80)), 24);
  __m256i e = _mm256_and_si256(_mm256_srli_epi32(b, 3), set1(15));
  __m256i m = _mm256_and_si256(b, set1(7));
  __m256i v = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, set1(120)), 23),
                              _mm256_slli_epi32(m, 20));
  __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0x1p-9f));
  v = _mm256_blendv_epi8(v, _mm256_castps_si256(sub),
                         _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
  v = _mm256_blendv_epi8(v, set1(0x7fc00000),
                         _mm256_cmpeq_epi32(_mm256_and_si256(b, set1(0x7f)), set1(0x7f)));
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(v, s)), scale);
}

/* 8 bf16 values as fp32, exact. */
INLINE __m256 bf16x8(const void *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* A record dequantised into the chain-transposed layout (rows of 32 floats, 32-byte aligned). */
INLINE void dequant_record_t(const uint8_t *data, const uint8_t *scales, float *rows) {
  __m256 c[64];
#pragma GCC unroll 56
  for (int v = 0; v < 56; v++)
    c[v] = e4m3x8(data + 8 * v, _mm256_set1_ps(dsv4_ue8m0_scale(scales[v / 8])));
#pragma GCC unroll 8
  for (int v = 56; v < 64; v++)
    c[v] = bf16x8(data + DSV4_NOPE_DIM + 16 * (v - 56));
  store_transposed(c, rows);
}

/* The queries of a head quad, transposed; heads past nh are zeros (their results are not used). */
static void queries_t(const uint16_t *q, uint32_t nh, float *qt) {
  for (uint32_t h = 0; h < QUAD; h++) {
    __m256 c[64];
    for (int v = 0; v < 64; v++)
      c[v] = h < nh ? bf16x8(q + (size_t)h * DSV4_HEAD_DIM + 8 * v) : _mm256_setzero_ps();
    store_transposed(c, qt + (size_t)h * DSV4_HEAD_DIM);
  }
}

/* The fold of SPEC §2 over chains 0..7, 8..15, 16..23, 24..31: steps 16, 8, 4, 2, 1. */
INLINE float fold32(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 p8 = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
  __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));
  __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
  __m128 p1 = _mm_add_ss(p2, _mm_shuffle_ps(p2, p2, 1));
  return _mm_cvtss_f32(p1);
}

/* Logits of candidate s for heads h and h + 1 of qt, into l[h * l_stride + s]. */
INLINE void logits_pair(const float *qt, const float *kt, uint32_t s, int h, float *l,
                        uint32_t l_stride) {
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  const float *q0 = qt + h * DSV4_HEAD_DIM, *q1 = q0 + DSV4_HEAD_DIM;
  const float *row = kt + (size_t)s * DSV4_HEAD_DIM;
  __m256 a[2][4];
#pragma GCC unroll 4
  for (int v = 0; v < 4; v++)
    a[0][v] = a[1][v] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int k = 0; k < 16; k++)
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      __m256 kv = _mm256_load_ps(row + 32 * k + 8 * v);
      a[0][v] = _mm256_fmadd_ps(_mm256_load_ps(q0 + 32 * k + 8 * v), kv, a[0][v]);
      a[1][v] = _mm256_fmadd_ps(_mm256_load_ps(q1 + 32 * k + 8 * v), kv, a[1][v]);
    }
  l[(size_t)h * l_stride + s] = fold32(a[0][0], a[0][1], a[0][2], a[0][3]) * scale;
  l[(size_t)(h + 1) * l_stride + s] = fold32(a[1][0], a[1][1], a[1][2], a[1][3]) * scale;
}

/* The largest logit, as in cpu_attention_avx512.c (NaN skipped from a start of l[0]; the sign of
 * a zero maximum is invisible to every later step). */
static float max_logit(const float *l, uint32_t nc) {
  __m256 m = _mm256_set1_ps(l[0]);
  uint32_t s = 0;
  for (; s + 8 <= nc; s += 8)
    m = _mm256_max_ps(_mm256_loadu_ps(l + s), m);
  for (; s < nc; s++)
    m = _mm256_max_ps(_mm256_set1_ps(l[s]), m);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  return _mm_cvtss_f32(m4);
}

/* The weights e^(l - m) in place (lanes past nc computed too, never read). */
static void weights(float *l, uint32_t nc, float m) {
  __m256 vm = _mm256_set1_ps(m);
  for (uint32_t s = 0; s < nc; s += 8)
    _mm256_storeu_ps(l + s, dsv4__expf8(_mm256_sub_ps(_mm256_loadu_ps(l + s), vm)));
}

/* The chains N of the four heads over columns j0..j0+15 of the transposed layout, continued over
 * count candidates of kt in list order: from +0 (resume 0) or from the values in nt[h * 512 + j],
 * where they are stored back; w holds the heads' weights at w[h * l_stride + s]. */
INLINE void accumulate_16(const float *kt, const float *w, uint32_t l_stride, uint32_t count,
                          uint32_t j0, int resume, float *nt) {
  __m256 n[QUAD][2];
#pragma GCC unroll 4
  for (int h = 0; h < QUAD; h++) {
    n[h][0] = resume ? _mm256_load_ps(nt + h * DSV4_HEAD_DIM + j0) : _mm256_setzero_ps();
    n[h][1] = resume ? _mm256_load_ps(nt + h * DSV4_HEAD_DIM + j0 + 8) : _mm256_setzero_ps();
  }
  for (uint32_t s = 0; s < count; s++) {
    const float *row = kt + (size_t)s * DSV4_HEAD_DIM + j0;
    __m256 k0 = _mm256_load_ps(row), k1 = _mm256_load_ps(row + 8);
#pragma GCC unroll 4
    for (int h = 0; h < QUAD; h++) {
      __m256 wv = _mm256_broadcast_ss(w + (size_t)h * l_stride + s);
      n[h][0] = _mm256_fmadd_ps(wv, k0, n[h][0]);
      n[h][1] = _mm256_fmadd_ps(wv, k1, n[h][1]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < QUAD; h++) {
    _mm256_store_ps(nt + h * DSV4_HEAD_DIM + j0, n[h][0]);
    _mm256_store_ps(nt + h * DSV4_HEAD_DIM + j0 + 8, n[h][1]);
  }
}

/* dsv4_f32_to_bf16 per lane, the bf16 in the low half of each dword (a NaN made quiet, as the
 * scalar codec does). */
INLINE __m256i bf16_round8(__m256 f) {
  __m256i u = _mm256_castps_si256(f);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), set1(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, set1(0x7fff)), lsb);
  __m256i quiet = _mm256_or_si256(u, set1(0x00400000));
  r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  return _mm256_srli_epi32(r, 16);
}

/* Two vectors of 8 rounded values stored as 16 bf16 in order. */
INLINE void store_bf16x16(uint16_t *out, __m256 a, __m256 b) {
  __m256i p = _mm256_packus_epi32(bf16_round8(a), bf16_round8(b));
  _mm256_storeu_si256((__m256i *)(void *)out, _mm256_permute4x64_epi64(p, 0xD8));
}

/* o = N / D back in natural order, the inverse rotation at the query's position, bf16 stores. */
static void finish_head(const float *nt, float den, const float *cs, uint16_t *out) {
  __m256 c[64]; /* c[2l + half] = dims 16l + 8 half .. + 7 */
  load_untransposed(nt, _mm256_set1_ps(den), c);
  for (int l = 0; l < 28; l++)
    store_bf16x16(out + 16 * l, c[2 * l], c[2 * l + 1]);
  /* Pair i in lanes 2i (even dim) and 2i+1, e and o duplicated over both, cos and sin likewise:
   * the even lane computes fma(e, c, o * s), the odd fma(e, -s, o * c) = fma(-e, s, o * c). */
  const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256 odd = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
  const __m256 sign = _mm256_castsi256_ps(_mm256_setr_epi32(
      0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u));
  __m256 r[8];
  for (int v = 0; v < 8; v++) {
    __m256 x = c[56 + v];
    __m256 e = _mm256_moveldup_ps(x), o = _mm256_movehdup_ps(x);
    __m128 c4 = _mm_loadu_ps(cs + 4 * v), s4 = _mm_loadu_ps(cs + DSV4_ROPE_PAIRS + 4 * v);
    __m256 cv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(c4), dup);
    __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s4), dup);
    __m256 ma = _mm256_blendv_ps(cv, _mm256_xor_ps(sv, sign), odd);
    __m256 mb = _mm256_blendv_ps(sv, cv, odd);
    r[v] = _mm256_fmadd_ps(e, ma, _mm256_mul_ps(o, mb));
  }
  for (int v = 0; v < 8; v += 2)
    store_bf16x16(out + DSV4_NOPE_DIM + 8 * v, r[v], r[v + 1]);
}

/* Candidates first..first + count - 1 of the item dequantised into it->tile (transposed). */
static void tile_load(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  const uint8_t *data[DSV4__CPU_ATTN_TILE], *scales[DSV4__CPU_ATTN_TILE];
  dsv4__cpu_attn_records(it, first, count, data, scales);
  for (uint32_t s = 0; s < count; s++)
    dequant_record_t(data[s], scales[s], it->tile + (size_t)s * DSV4_HEAD_DIM);
}

/* The logits of every head quad (by pairs) for the tile's candidates, into l[h * l_stride + first
 * + s]. */
static void tile_logits(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  for (uint32_t h0 = 0; h0 < it->nh; h0 += QUAD) {
    const float *qt = it->qf + (size_t)h0 * DSV4_HEAD_DIM;
    float *l = it->l + (size_t)h0 * it->l_stride + first;
    for (int h = 0; h < QUAD; h += 2)
      for (uint32_t s = 0; s < count; s++)
        logits_pair(qt, it->tile, s, h, l, it->l_stride);
  }
}

/* Every head quad's chains N continued over the tile's candidates. */
static void tile_accumulate(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  for (uint32_t h0 = 0; h0 < it->nh; h0 += QUAD) {
    const float *w = it->l + (size_t)h0 * it->l_stride + first;
    float *nt = it->n + (size_t)h0 * DSV4_HEAD_DIM;
    for (uint32_t j0 = 0; j0 < DSV4_HEAD_DIM; j0 += 16)
      accumulate_16(it->tile, w, it->l_stride, count, j0, first > 0, nt);
  }
}

#define DSV4__CPU_ATTN_ITEM_FN dsv4__cpu_attn_item_avx2
#include "cpu-attn-item.h"

#endif /* __x86_64__ */
