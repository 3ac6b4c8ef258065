#ifndef DSV4_KERNELS_CPU_CPU_SIMD_H
#define DSV4_KERNELS_CPU_CPU_SIMD_H

/*
 * Helpers of the CPU backend's vector levels, included only by files built with the level's -m
 * flags (kernels/CMakeLists.txt): the AVX-512 ones where __AVX512F__ is defined, the AVX2 ones
 * where
 * __AVX2__ and __FMA__ are.
 *
 * dsv4__expf16 and dsv4__expf8 are dsv4_expf (dsv4-numerics.h) on lanes: the same correctly rounded
 * operations in the same order on every lane, the special cases (NaN, overflow, underflow, |x| <
 * 2^-25) blended in afterwards, so each lane gives dsv4_expf's bits. dsv4__transpose16 and
 * dsv4__transpose8 transpose square blocks of dwords (floats or integers alike), which is how the
 * levels turn rows into lanes.
 */

#include <immintrin.h>

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 dsv4__expf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  __m512 k = _mm512_mul_ps(x, _mm512_set1_ps(0x1.715476p+0f));
  k = _mm512_sub_ps(_mm512_add_ps(k, _mm512_set1_ps(0x1.8p+23f)), _mm512_set1_ps(0x1.8p+23f));
  const __m512 rh = _mm512_fnmadd_ps(k, _mm512_set1_ps(0x1.62e4p-1f), x);
  const __m512 nk = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(k), _mm512_set1_epi32((int)0x80000000u)));
  const __m512 rl = _mm512_mul_ps(nk, _mm512_set1_ps(0x1.7f7d1cp-20f));
  const __m512 r = _mm512_add_ps(rh, rl);
  const __m512 bv = _mm512_sub_ps(r, rh);
  const __m512 re = _mm512_add_ps(_mm512_sub_ps(rh, _mm512_sub_ps(r, bv)), _mm512_sub_ps(rl, bv));
  __m512 p = _mm512_set1_ps(0x1.9f0894p-13f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.6d8d04p-10f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.11127p-7f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.55548ep-5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.555554p-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1p-1f));
  const __m512 w = _mm512_fmadd_ps(_mm512_mul_ps(r, r), p, re);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 hi = _mm512_add_ps(one, r);
  const __m512 lo = _mm512_add_ps(_mm512_sub_ps(one, hi), r);
  __m512 y = _mm512_add_ps(hi, _mm512_add_ps(lo, w));
  /* q / 2 rounds towards zero, as C's division does. */
  const __m512i q = _mm512_cvttps_epi32(k);
  const __m512i q1 = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_srli_epi32(q, 31)), 1);
  const __m512i e1 = _mm512_slli_epi32(_mm512_add_epi32(q1, _mm512_set1_epi32(127)), 23);
  const __m512i e2 =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(q, q1), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_castsi512_ps(e1)), _mm512_castsi512_ps(e2));
  y = _mm512_mask_mov_ps(y, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x33000000)), one);
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LT_OQ),
                         _mm512_setzero_ps());
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(89.0f), _CMP_GT_OQ),
                         _mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_ps(y, nan,
                            _mm512_castsi512_ps(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000))));
}

/* Transposes the 16 x 16 dwords of r[0..15] in place. */
static inline __attribute__((always_inline)) void dsv4__transpose16(__m512 *r) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
    __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++) {
    int j = (i & 3) | ((i & 4) << 1);
    t[j] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88);
    t[j + 4] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xDD);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) __m256 dsv4__expf8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  __m256 k = _mm256_mul_ps(x, _mm256_set1_ps(0x1.715476p+0f));
  k = _mm256_sub_ps(_mm256_add_ps(k, _mm256_set1_ps(0x1.8p+23f)), _mm256_set1_ps(0x1.8p+23f));
  const __m256 rh = _mm256_fnmadd_ps(k, _mm256_set1_ps(0x1.62e4p-1f), x);
  const __m256 nk = _mm256_castsi256_ps(
      _mm256_xor_si256(_mm256_castps_si256(k), _mm256_set1_epi32((int)0x80000000u)));
  const __m256 rl = _mm256_mul_ps(nk, _mm256_set1_ps(0x1.7f7d1cp-20f));
  const __m256 r = _mm256_add_ps(rh, rl);
  const __m256 bv = _mm256_sub_ps(r, rh);
  const __m256 re = _mm256_add_ps(_mm256_sub_ps(rh, _mm256_sub_ps(r, bv)), _mm256_sub_ps(rl, bv));
  __m256 p = _mm256_set1_ps(0x1.9f0894p-13f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0x1.6d8d04p-10f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0x1.11127p-7f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0x1.55548ep-5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0x1.555554p-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0x1p-1f));
  const __m256 w = _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, re);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 hi = _mm256_add_ps(one, r);
  const __m256 lo = _mm256_add_ps(_mm256_sub_ps(one, hi), r);
  __m256 y = _mm256_add_ps(hi, _mm256_add_ps(lo, w));
  /* q / 2 rounds towards zero, as C's division does. */
  const __m256i q = _mm256_cvttps_epi32(k);
  const __m256i q1 = _mm256_srai_epi32(_mm256_add_epi32(q, _mm256_srli_epi32(q, 31)), 1);
  const __m256i e1 = _mm256_slli_epi32(_mm256_add_epi32(q1, _mm256_set1_epi32(127)), 23);
  const __m256i e2 =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, q1), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e1)), _mm256_castsi256_ps(e2));
  /* |x| as an int32 is non-negative, so signed comparisons order it. */
  y = _mm256_blendv_ps(y, one,
                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x33000000), a)));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(),
                       _mm256_cmp_ps(x, _mm256_set1_ps(-104.0f), _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)),
                       _mm256_cmp_ps(x, _mm256_set1_ps(89.0f), _CMP_GT_OQ));
  const __m256 quiet = _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)));
  return _mm256_blendv_ps(
      y, quiet, _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000))));
}

/* Transposes the 8 x 8 dwords of r[0..7] in place. */
static inline __attribute__((always_inline)) void dsv4__transpose8(__m256 *r) {
  __m256 t[8], s[8];
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}
#endif

#endif /* DSV4_KERNELS_CPU_CPU_SIMD_H */
