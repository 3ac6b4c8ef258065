/*
 * Exact attention (SPEC §7, §8.6) with AVX-512: the operations of the scalar level in
 * cpu_attention.c, each correctly rounded and in the same order, on 16 independent chains at a
 * time, so the bytes are the same (tests/unit/attention_test.c and attention_union_test.c compare
 * every level with the scalar one).
 *
 * Layout. The canonical dot product runs 32 chains, chain l over dims 16l..16l+15 in order. Each
 * candidate's 512 values are stored chain-transposed: row k (32 floats) holds element k of chains
 * 0..31, so one fmadd advances 16 chains of a dot product by one element, and the queries are
 * transposed the same way. The accumulation of N is element-wise, so it runs in the same layout;
 * each head's N is transposed back (a 16 x 16 transpose is its own inverse) before the division's
 * result is rotated and rounded. Heads go four at a time through both passes over each tile, so
 * each candidate row is read from the cache hierarchy once per four heads; N is kept in memory
 * between tiles (a store and a load are exact).
 */
#if defined(__x86_64__)

/* Built with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma (kernels/CMakeLists.txt). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu-internal.h"
#include "cpu-simd.h"
#include "dsv4-numerics.h"

#define INLINE static inline __attribute__((always_inline))

/* Heads per pass over a tile. */
#define QUAD 4

/* Writes 32 chain vectors (lanes = elements 0..15 of chain l) as 16 rows of 32 (lanes = chains). */
INLINE void store_transposed(__m512 *chains, float *rows) {
  dsv4__transpose16(chains);
  dsv4__transpose16(chains + 16);
#pragma GCC unroll 16
  for (int k = 0; k < 16; k++) {
    _mm512_store_ps(rows + 32 * k, chains[k]);
    _mm512_store_ps(rows + 32 * k + 16, chains[16 + k]);
  }
}

/* dsv4_e4m3_to_f32 of 16 bytes, times the tile's scale (both exact, as in the scalar level). */
INLINE __m512 e4m3x16(__m128i bytes, __m512 scale) {
  __m512i b = _mm512_cvtepu8_epi32(bytes);
  __m512i s = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  __m512i e = _mm512_and_si512(_mm512_srli_epi32(b, 3), _mm512_set1_epi32(15));
  __m512i m = _mm512_and_si512(b, _mm512_set1_epi32(7));
  __m512i v = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                              _mm512_slli_epi32(m, 20));
  __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-9f));
  v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                            _mm512_castps_si512(sub));
  __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)),
                                          _mm512_set1_epi32(0x7f));
  v = _mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(v, s)), scale);
}

/* 16 bf16 values as fp32, exact. */
INLINE __m512 bf16x16(const void *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* A record dequantised into the chain-transposed layout (rows of 32 floats, 64-byte aligned). */
INLINE void dequant_record_t(const uint8_t *data, const uint8_t *scales, float *rows) {
  __m512 c[32];
#pragma GCC unroll 28
  for (int l = 0; l < 28; l++)
    c[l] = e4m3x16(_mm_loadu_si128((const __m128i *)(data + 16 * l)),
                   _mm512_set1_ps(dsv4_ue8m0_scale(scales[l / 4])));
#pragma GCC unroll 4
  for (int l = 28; l < 32; l++)
    c[l] = bf16x16(data + DSV4_NOPE_DIM + 32 * (l - 28));
  store_transposed(c, rows);
}

/* The queries of a head quad, transposed; heads past nh are zeros (their results are not used). */
static void queries_t(const uint16_t *q, uint32_t nh, float *qt) {
  for (uint32_t h = 0; h < QUAD; h++) {
    __m512 c[32];
    for (int l = 0; l < 32; l++)
      c[l] = h < nh ? bf16x16(q + (size_t)h * DSV4_HEAD_DIM + 16 * l) : _mm512_setzero_ps();
    store_transposed(c, qt + (size_t)h * DSV4_HEAD_DIM);
  }
}

/* The fold of SPEC §2 over chain vectors lo (chains 0..15) and hi (16..31): steps 16, 8, 4, 2, 1.
 */
INLINE float fold32(__m512 lo, __m512 hi) {
  __m512 v = _mm512_add_ps(lo, hi);
  __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  __m128 v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
  return _mm_cvtss_f32(v1);
}

/* Logits of nc (1 or 2) candidates from kt for the four heads of qt, into l[h * l_stride + s]. */
INLINE void logits_quad(const float *qt, const float *kt, uint32_t s, int nc, float *l,
                        uint32_t l_stride) {
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  __m512 a[QUAD][2][2];
#pragma GCC unroll 4
  for (int h = 0; h < QUAD; h++)
    for (int c = 0; c < 2; c++)
      a[h][c][0] = a[h][c][1] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int k = 0; k < 16; k++) {
    __m512 kv[2][2];
    for (int c = 0; c < nc; c++) {
      const float *row = kt + (size_t)(s + c) * DSV4_HEAD_DIM + 32 * k;
      kv[c][0] = _mm512_load_ps(row);
      kv[c][1] = _mm512_load_ps(row + 16);
    }
#pragma GCC unroll 4
    for (int h = 0; h < QUAD; h++) {
      __m512 q0 = _mm512_load_ps(qt + h * DSV4_HEAD_DIM + 32 * k);
      __m512 q1 = _mm512_load_ps(qt + h * DSV4_HEAD_DIM + 32 * k + 16);
      for (int c = 0; c < nc; c++) {
        a[h][c][0] = _mm512_fmadd_ps(q0, kv[c][0], a[h][c][0]);
        a[h][c][1] = _mm512_fmadd_ps(q1, kv[c][1], a[h][c][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < QUAD; h++)
    for (int c = 0; c < nc; c++)
      l[(size_t)h * l_stride + s + c] = fold32(a[h][c][0], a[h][c][1]) * scale;
}

/*
 * The largest logit. Lanes keep running maxima that skip NaN (max(x, m) returns m when x is NaN)
 * from a start of l[0], as the scalar level's l > m ? l : m does; a zero's sign may differ from the
 * scalar level's, which no later step can see (x - (+0) = x - (-0) but for x = -0, and e^(+-0) =
 * 1).
 */
static float max_logit(const float *l, uint32_t nc) {
  __m512 m = _mm512_set1_ps(l[0]);
  uint32_t s = 0;
  for (; s + 16 <= nc; s += 16)
    m = _mm512_max_ps(_mm512_loadu_ps(l + s), m);
  if (s < nc)
    m = _mm512_mask_max_ps(m, (__mmask16)((1u << (nc - s)) - 1u), _mm512_loadu_ps(l + s), m);
  __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(m),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  return _mm_cvtss_f32(m4);
}

/* The weights e^(l - m) in place (lanes past nc computed too, never read). */
static void weights(float *l, uint32_t nc, float m) {
  __m512 vm = _mm512_set1_ps(m);
  for (uint32_t s = 0; s < nc; s += 16)
    _mm512_storeu_ps(l + s, dsv4__expf16(_mm512_sub_ps(_mm512_loadu_ps(l + s), vm)));
}

/*
 * The chains N of the four heads over one eighth of the transposed layout (64 floats: columns
 * j0..j0+63), continued over count candidates of kt in list order: from +0 (resume 0) or from the
 * values in nt[h * 512 + j], where they are stored back. Four rows of kt are loaded per candidate
 * and each feeds four heads; w holds the heads' weights at w[h * l_stride + s].
 */
INLINE void accumulate_eighth(const float *kt, const float *w, uint32_t l_stride, uint32_t count,
                              uint32_t j0, int resume, float *nt) {
  __m512 n[QUAD][4];
#pragma GCC unroll 4
  for (int h = 0; h < QUAD; h++)
    for (int v = 0; v < 4; v++)
      n[h][v] = resume ? _mm512_load_ps(nt + h * DSV4_HEAD_DIM + j0 + 16 * v) : _mm512_setzero_ps();
  for (uint32_t s = 0; s < count; s++) {
    const float *row = kt + (size_t)s * DSV4_HEAD_DIM + j0;
    __m512 k0 = _mm512_load_ps(row), k1 = _mm512_load_ps(row + 16);
    __m512 k2 = _mm512_load_ps(row + 32), k3 = _mm512_load_ps(row + 48);
#pragma GCC unroll 4
    for (int h = 0; h < QUAD; h++) {
      __m512 wv = _mm512_set1_ps(w[(size_t)h * l_stride + s]);
      n[h][0] = _mm512_fmadd_ps(wv, k0, n[h][0]);
      n[h][1] = _mm512_fmadd_ps(wv, k1, n[h][1]);
      n[h][2] = _mm512_fmadd_ps(wv, k2, n[h][2]);
      n[h][3] = _mm512_fmadd_ps(wv, k3, n[h][3]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < QUAD; h++)
    for (int v = 0; v < 4; v++)
      _mm512_store_ps(nt + h * DSV4_HEAD_DIM + j0 + 16 * v, n[h][v]);
}

/* dsv4_f32_to_bf16 of 16 lanes, packed to 16 bf16 (a NaN made quiet, as the scalar codec does). */
INLINE __m256i bf16_round16(__m512 f) {
  __m512i u = _mm512_castps_si512(f);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* o = N / D back in natural order, the inverse rotation at the query's position, bf16 stores. */
static void finish_head(const float *nt, float den, const float *cs, uint16_t *out) {
  __m512 c[32];
  __m512 vd = _mm512_set1_ps(den);
  for (int k = 0; k < 16; k++) {
    c[k] = _mm512_div_ps(_mm512_load_ps(nt + 32 * k), vd);
    c[16 + k] = _mm512_div_ps(_mm512_load_ps(nt + 32 * k + 16), vd);
  }
  dsv4__transpose16(c); /* c[l] = dims 16l..16l+15 */
  dsv4__transpose16(c + 16);
  for (int l = 0; l < 28; l++)
    _mm256_storeu_si256((__m256i *)(void *)(out + 16 * l), bf16_round16(c[l]));
  /* Pair i of a vector sits in lanes 2i (even dim) and 2i+1: e and o duplicated over both, cos and
   * sin of the pair likewise; the even lane computes fma(e, c, o * s), the odd fma(e, -s, o * c),
   * which is fma(-e, s, o * c) exactly. */
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __mmask16 odd = 0xAAAA;
  for (int v = 0; v < 4; v++) {
    __m512 x = c[28 + v];
    __m512 e = _mm512_moveldup_ps(x), o = _mm512_movehdup_ps(x);
    __m512 cv = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(cs + 8 * v)));
    __m512 sv = _mm512_permutexvar_ps(
        dup, _mm512_castps256_ps512(_mm256_loadu_ps(cs + DSV4_ROPE_PAIRS + 8 * v)));
    __m512 ma = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(cv), odd,
                                                          _mm512_castps_si512(sv),
                                                          _mm512_set1_epi32((int)0x80000000u)));
    __m512 mb = _mm512_mask_mov_ps(sv, odd, cv);
    __m512 r = _mm512_fmadd_ps(e, ma, _mm512_mul_ps(o, mb));
    _mm256_storeu_si256((__m256i *)(void *)(out + DSV4_NOPE_DIM + 16 * v), bf16_round16(r));
  }
}

/* Candidates first..first + count - 1 of the item dequantised into it->tile (transposed). */
static void tile_load(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  const uint8_t *data[DSV4__CPU_ATTN_TILE], *scales[DSV4__CPU_ATTN_TILE];
  dsv4__cpu_attn_records(it, first, count, data, scales);
  for (uint32_t s = 0; s < count; s++)
    dequant_record_t(data[s], scales[s], it->tile + (size_t)s * DSV4_HEAD_DIM);
}

/* The logits of every head quad for the tile's candidates, into l[h * l_stride + first + s]. */
static void tile_logits(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  for (uint32_t h0 = 0; h0 < it->nh; h0 += QUAD) {
    const float *qt = it->qf + (size_t)h0 * DSV4_HEAD_DIM;
    float *l = it->l + (size_t)h0 * it->l_stride + first;
    uint32_t s = 0;
    for (; s + 2 <= count; s += 2)
      logits_quad(qt, it->tile, s, 2, l, it->l_stride);
    if (s < count)
      logits_quad(qt, it->tile, s, 1, l, it->l_stride);
  }
}

/* Every head quad's chains N continued over the tile's candidates. */
static void tile_accumulate(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  for (uint32_t h0 = 0; h0 < it->nh; h0 += QUAD) {
    const float *w = it->l + (size_t)h0 * it->l_stride + first;
    float *nt = it->n + (size_t)h0 * DSV4_HEAD_DIM;
    for (uint32_t j0 = 0; j0 < DSV4_HEAD_DIM; j0 += 64)
      accumulate_eighth(it->tile, w, it->l_stride, count, j0, first > 0, nt);
  }
}

#define DSV4__CPU_ATTN_ITEM_FN dsv4__cpu_attn_item_avx512
#include "cpu-attn-item.h"

#endif /* __x86_64__ */
