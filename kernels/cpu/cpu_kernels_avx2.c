/*
 * AVX2 + FMA versions of the per-token kernels, for x86-64 machines without AVX-512 (AMD Zen 2/3,
 * many Intel parts). Like cpu_kernels_avx512.c they perform exactly the operations of the scalar
 * kernels in cpu_kernels.c, each correctly rounded and in the same order, here on 8 lanes at a
 * time, so their bytes are the same (the unit tests compare every level against a per-element
 * model and against each other).
 *
 * Data layout, as in the AVX-512 file. A head of 512 bf16 is read as 256 dwords; dword i holds dims
 * 2i (low half) and 2i+1 (high half). Shifting a dword left by 16 gives dim 2i as fp32, masking off
 * the low half gives dim 2i+1, so the element-wise steps and the RoPE pairs need no shuffles, and
 * (even >> 16) | (odd & 0xffff0000) restores the interleaved bf16 order.
 *
 * The canonical sum of squares needs 32 independent chains, chain l running over dims 16l..16l+15
 * in order: 32 bytes, dwords 0..3 in its first 16 bytes and dwords 4..7 in its second. Each vector
 * is loaded as two 16-byte halves, chain l in the low half and chain l+4 in the high half, so that
 * a 4 x 4 dword transpose inside each 128-bit lane (8 unpacks for 4 vectors) leaves vector c
 * holding dword c of chains l..l+3 | l+4..l+7: lanes are chains in natural order and each fmadd
 * advances 8 chains by one element.
 */
#if defined(__x86_64__)

/* Built with -mavx2 -mfma (kernels/CMakeLists.txt). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu-internal.h"
#include "dsv4-numerics.h"

#define INLINE static inline __attribute__((always_inline))

INLINE __m256 even_f32(__m256i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

INLINE __m256 odd_f32(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/*
 * dsv4_f32_to_bf16 per lane, the bf16 left in the high half of each dword (the low half is junk).
 * With nan_safe 0 it is exact for every input but NaN, and 3 of its 7 operations cheaper; callers
 * pass a constant, so each use compiles to one of the two forms.
 */
INLINE __m256i bf16_high_if(__m256 f, int nan_safe) {
  __m256i u = _mm256_castps_si256(f);
  /* u + 0x7fff + (bit 16 of u): the carry rounds to nearest, ties to even (Inf stays Inf). */
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  if (!nan_safe)
    return r;
  /* A NaN keeps its bits and becomes quiet, as (u >> 16) | 0x40 does in the scalar codec. */
  __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan));
}

INLINE __m256i bf16_high(__m256 f) {
  return bf16_high_if(f, 1);
}

/* Two rounded results back into interleaved bf16 pairs. */
INLINE __m256i pack_pairs(__m256i even_hi, __m256i odd_hi) {
  return _mm256_blend_epi16(_mm256_srli_epi32(even_hi, 16), odd_hi, 0xAA);
}

/* A vector of 16 bytes at lo (low lane) and 16 bytes at hi (high lane). */
INLINE __m256i load_halves(const uint16_t *lo, const uint16_t *hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                 _mm_loadu_si128((const __m128i *)hi), 1);
}

/* Transposes the 4 x 4 dwords of each 128-bit lane of v[0..3]. */
INLINE void transpose4(__m256i *v) {
  __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm256_unpacklo_epi64(t0, t2);
  v[1] = _mm256_unpackhi_epi64(t0, t2);
  v[2] = _mm256_unpacklo_epi64(t1, t3);
  v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* The canonical sum of squares (SPEC §2) of 512 bf16 values. */
INLINE float sumsq_bf16(const uint16_t *x) {
  __m256 acc[4];
#pragma GCC unroll 4
  for (int g = 0; g < 4; g++) {
    /* Chains 8g..8g+7: r[k] holds dwords 0..3 and r[4 + k] dwords 4..7 of chains 8g+k, 8g+k+4. */
    const uint16_t *lo = x + 16 * 8 * g, *hi = lo + 16 * 4;
    __m256i r[8];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
      r[k] = load_halves(lo + 16 * k, hi + 16 * k);
      r[4 + k] = load_halves(lo + 16 * k + 8, hi + 16 * k + 8);
    }
    transpose4(r);
    transpose4(r + 4);
    __m256 a = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      __m256 e = even_f32(r[c]), o = odd_f32(r[c]);
      a = _mm256_fmadd_ps(e, e, a);
      a = _mm256_fmadd_ps(o, o, a);
    }
    acc[g] = a;
  }
  /* The fold: step 16 pairs chains 0..7 with 16..23 and 8..15 with 24..31, then 8, 4, 2, 1. */
  __m256 p = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
  __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1));
  __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
  __m128 p1 = _mm_add_ss(p2, _mm_shuffle_ps(p2, p2, 1));
  return _mm_cvtss_f32(p1);
}

/* One RoPE vector (8 pairs): the inner product rounded first, then one fma each; bf16 results in
 * the high half of each dword of the two outputs. */
INLINE __m256i rope8(__m256 e, __m256 o, __m256 c, __m256 s) {
  __m256 neg = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  __m256 os = _mm256_xor_ps(_mm256_mul_ps(o, s), neg);
  __m256 even = _mm256_fmadd_ps(e, c, os);
  __m256 odd = _mm256_fmadd_ps(e, s, _mm256_mul_ps(o, c));
  return pack_pairs(bf16_high(even), bf16_high(odd));
}

/*
 * The normalised, rotated head given its RMS factor r; STORE writes one 32-byte vector. NAN_SAFE 0
 * rounds the NoPE dims x * r without the NaN case, which is exact unless r is a NaN: then a NaN
 * product can only be an input's (a bf16, its low 16 bits zero, quieted by the multiply) or the
 * default NaN 0xFFC00000 of 0 * Inf, and u + 0x7fff + lsb keeps the high half of such a NaN, as the
 * scalar codec does. The RoPE dims always take the full rounding (cos and sin are any floats).
 */
#define Q_HEAD_OUT(STORE, NAN_SAFE)                                                                \
  do {                                                                                             \
    __m256 vr = _mm256_set1_ps(r);                                                                 \
    _Pragma("GCC unroll 28") for (int j = 0; j < 28; j++) {                                        \
      __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 * j));                               \
      __m256i e = bf16_high_if(_mm256_mul_ps(even_f32(v), vr), (NAN_SAFE));                        \
      __m256i o = bf16_high_if(_mm256_mul_ps(odd_f32(v), vr), (NAN_SAFE));                         \
      STORE(out + 16 * j, pack_pairs(e, o));                                                       \
    }                                                                                              \
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {                                          \
      __m256i v = _mm256_loadu_si256((const __m256i *)(q + DSV4_NOPE_DIM + 16 * k));               \
      __m256 e = _mm256_mul_ps(even_f32(v), vr);                                                   \
      __m256 o = _mm256_mul_ps(odd_f32(v), vr);                                                    \
      __m256 c = _mm256_loadu_ps(cs + 8 * k);                                                      \
      __m256 s = _mm256_loadu_ps(cs + DSV4_ROPE_PAIRS + 8 * k);                                    \
      STORE(out + DSV4_NOPE_DIM + 16 * k, rope8(e, o, c, s));                                      \
    }                                                                                              \
  } while (0)

#define STORE_CACHED(p, v)                                                                         \
  do {                                                                                             \
    _mm256_storeu_si256((__m256i *)(void *)(p), (v));                                              \
    DSV4__COUNT_STORE((p), 32);                                                                    \
  } while (0)
#define STORE_STREAM(p, v)                                                                         \
  do {                                                                                             \
    _mm256_stream_si256((__m256i *)(void *)(p), (v));                                              \
    DSV4__COUNT_STORE((p), 32);                                                                    \
  } while (0)

INLINE void q_head_out(const uint16_t *q, uint16_t *out, const float *cs, float r) {
  Q_HEAD_OUT(STORE_CACHED, 0);
}

/* As q_head_out, bypassing the caches: out must be 32-byte aligned. */
INLINE void q_head_out_nt(const uint16_t *q, uint16_t *out, const float *cs, float r) {
  Q_HEAD_OUT(STORE_STREAM, 0);
}

/* A head whose r is a NaN (a NaN eps or input): kept out of line, it never runs in service. */
static __attribute__((noinline)) void q_head_out_any(const uint16_t *q, uint16_t *out,
                                                     const float *cs, float r) {
  Q_HEAD_OUT(STORE_CACHED, 1);
}

/* Heads per group: the RMS factors of a group are computed before its outputs, so the long
 * dependency chain of one head's reduction overlaps with its neighbours' (8 KiB stays in L1). */
#define Q_GROUP 8

void dsv4__cpu_q_heads_avx2(const uint16_t *q, uint16_t *out, uint32_t heads, const float *rope_row,
                            float eps, int stream) {
  /* Non-temporal stores need aligned rows; a misaligned q_out simply takes the cached path. */
  stream = stream && ((uintptr_t)out & 31) == 0;
  for (uint32_t h0 = 0; h0 < heads; h0 += Q_GROUP) {
    uint32_t n = heads - h0 < Q_GROUP ? heads - h0 : Q_GROUP;
    float r[Q_GROUP];
    for (uint32_t h = 0; h < n; h++)
      r[h] = dsv4_rms_factor(sumsq_bf16(q + (size_t)(h0 + h) * DSV4_HEAD_DIM), eps);
    for (uint32_t h = 0; h < n; h++) {
      const uint16_t *qh = q + (size_t)(h0 + h) * DSV4_HEAD_DIM;
      uint16_t *oh = out + (size_t)(h0 + h) * DSV4_HEAD_DIM;
      if ((dsv4_f2u(r[h]) & 0x7fffffffu) > 0x7f800000u)
        q_head_out_any(qh, oh, rope_row, r[h]);
      else if (stream)
        q_head_out_nt(qh, oh, rope_row, r[h]);
      else
        q_head_out(qh, oh, rope_row, r[h]);
    }
  }
  /* Non-temporal stores are weakly ordered: fence them before the launch's join publishes them. */
  if (stream)
    _mm_sfence();
}

/* dsv4_f32_to_e4m3 per lane, as a byte in the low 8 bits of each dword. */
INLINE __m256i e4m3(__m256 f) {
  __m256i u = _mm256_castps_si256(f);
  __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  /* Normal range: round the mantissa to 3 bits; the exponent carries as it should. */
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i rn =
      _mm256_and_si256(_mm256_add_epi32(a, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7ffff))),
                       _mm256_set1_epi32((int)0xfff00000u));
  __m256i mag = _mm256_sub_epi32(_mm256_srli_epi32(rn, 20), _mm256_set1_epi32(960));
  /* Signed compares are exact here: up to +Inf, rn stays below 2^31 (NaN is replaced last). */
  mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7e),
                           _mm256_cmpgt_epi32(rn, _mm256_set1_epi32(0x43e00000)));
  /* Below 2^-6: units of 2^-9, rounded to nearest even. |f| * 512 is exact, and the rounding is
   * explicit (whatever MXCSR says); at or below 2^-10 it gives 0, as the scalar codec does. */
  __m256 units = _mm256_round_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  mag = _mm256_blendv_epi8(mag, _mm256_cvttps_epi32(units),
                           _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a));
  mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7f),
                           _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
  return _mm256_or_si256(mag, sign);
}

/* The low bytes of the dwords of a, b, c, d (32 values below 256), in that order. */
INLINE __m256i pack_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  /* The packs work per 128-bit lane: dword k of the result is quarter k % 2 of vector k / 2. */
  __m256i x = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Reorders the 64-bit quarters 0 1 2 3 as 0 2 1 3 (its own inverse). */
#define SWAP_MIDDLE 0xD8

/* The KV row in registers, 8 fp32 dims per vector: the row's vectors, one NoPE tile's and the first
 * vector of the RoPE dims. */
#define KV_VECS (DSV4_HEAD_DIM / 8)
#define TILE_VECS (DSV4_TILE / 8)
#define ROPE_VEC0 (DSV4_NOPE_DIM / 8)

void dsv4__cpu_kv_token_avx2(const uint16_t *kv, const float *cs, const float *w, float eps,
                             uint8_t *data, uint8_t *scales) {
  /* The token as fp32 in natural order, 8 dims per vector. */
  __m256 z[KV_VECS];
#pragma GCC unroll 64
  for (int j = 0; j < KV_VECS; j++)
    z[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(kv + 8 * j))), 16));
  if (w) {
    __m256 vr = _mm256_set1_ps(dsv4_rms_factor(sumsq_bf16(kv), eps));
    __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 64
    for (int j = 0; j < KV_VECS; j++) {
      __m256 y = _mm256_mul_ps(_mm256_mul_ps(z[j], vr), _mm256_loadu_ps(w + 8 * j));
      z[j] = _mm256_castsi256_ps(_mm256_and_si256(bf16_high(y), hi));
    }
  }
  uint8_t sc[DSV4_SCALE_BYTES];
  __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
#pragma GCC unroll 7
  for (int t = 0; t < DSV4_NTILES; t++) {
    /* max(x, m) returns m when x is NaN, so the running maxima skip NaN as the scalar loop does
     * and never hold one; their order then does not matter. */
    __m256 m0 = _mm256_set1_ps(DSV4_AMAX_FLOOR), m1 = m0;
#pragma GCC unroll 4
    for (int k = 0; k < TILE_VECS; k += 2) {
      m0 = _mm256_max_ps(_mm256_and_ps(z[TILE_VECS * t + k], absmask), m0);
      m1 = _mm256_max_ps(_mm256_and_ps(z[TILE_VECS * t + k + 1], absmask), m1);
    }
    __m256 m = _mm256_max_ps(m0, m1);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    dsv4_i32 e = dsv4_ue8m0_exponent(_mm_cvtss_f32(h));
    __m256 scale = _mm256_set1_ps(dsv4_pow2_neg(e));
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
      const __m256 *v = z + TILE_VECS * t + 4 * k;
      __m256i b = pack_bytes(e4m3(_mm256_mul_ps(v[0], scale)), e4m3(_mm256_mul_ps(v[1], scale)),
                             e4m3(_mm256_mul_ps(v[2], scale)), e4m3(_mm256_mul_ps(v[3], scale)));
      _mm256_storeu_si256((__m256i *)(void *)(data + DSV4_TILE * t + 32 * k), b);
      DSV4__COUNT_STORE(data + DSV4_TILE * t + 32 * k, 32);
    }
    sc[t] = (uint8_t)(e + DSV4_UE8M0_BIAS);
  }
  sc[DSV4_NTILES] = 0;
#ifdef DSV4_TEST_BROKEN_BULK_STORE
  /* Test-only breakage of SPEC §5.1 (the vLLM XPU bug, tests/unit/inv_one_writer.c): store dims
   * 448..511 unrotated (their bf16 inputs) before the rotated stores below overwrite them. */
  for (int k = 0; k < 4; k++) {
    __m256i a = _mm256_srli_epi32(_mm256_castps_si256(z[ROPE_VEC0 + 2 * k]), 16);
    __m256i b = _mm256_srli_epi32(_mm256_castps_si256(z[ROPE_VEC0 + 2 * k + 1]), 16);
    __m256i u = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), SWAP_MIDDLE);
    _mm256_storeu_si256((__m256i *)(void *)(data + DSV4_NOPE_DIM + 32 * k), u);
    DSV4__COUNT_STORE(data + DSV4_NOPE_DIM + 32 * k, 32);
  }
#endif
  /*
   * RoPE, 8 pairs per vector. The in-lane shuffles that split 16 dims into even and odd take the
   * pairs in the order 0 1 4 5 | 2 3 6 7; cos and sin are put in the same order, and the packed
   * bf16 pairs are put back in natural order by the same swap of the middle quarters.
   */
#pragma GCC unroll 4
  for (int k = 0; k < 4; k++) {
    __m256 a = z[ROPE_VEC0 + 2 * k], b = z[ROPE_VEC0 + 2 * k + 1];
    __m256 e = _mm256_shuffle_ps(a, b, 0x88), o = _mm256_shuffle_ps(a, b, 0xDD);
    __m256 c = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_loadu_ps(cs + 8 * k)), SWAP_MIDDLE));
    __m256 s = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_loadu_ps(cs + DSV4_ROPE_PAIRS + 8 * k)), SWAP_MIDDLE));
    __m256i p = _mm256_permute4x64_epi64(rope8(e, o, c, s), SWAP_MIDDLE);
    _mm256_storeu_si256((__m256i *)(void *)(data + DSV4_NOPE_DIM + 32 * k), p);
    DSV4__COUNT_STORE(data + DSV4_NOPE_DIM + 32 * k, 32);
  }
  memcpy(scales, sc, sizeof(sc));
  DSV4__COUNT_STORE(scales, sizeof(sc));
}

#endif /* __x86_64__ */
