/*
 * AVX-512 versions of the per-token kernels. They perform exactly the operations of the scalar
 * kernels in cpu_kernels.c, each correctly rounded and in the same order, only on 16 lanes at a
 * time, so their bytes are the same (the unit tests compare both against a per-element model).
 *
 * Data layout. A head of 512 bf16 is read as 256 dwords; dword i holds dims 2i (low half) and 2i+1
 * (high half). Shifting a dword left by 16 gives dim 2i as fp32, masking off the low half gives dim
 * 2i+1, so the element-wise steps and the RoPE pairs need no shuffles at all, and writing the bf16
 * results back as (even >> 16) | (odd & 0xffff0000) restores the interleaved order.
 *
 * The canonical sum of squares needs 32 independent chains, chain l running over dims 16l..16l+15
 * in order. The 16 loaded vectors hold the chains row by row (vector j = chains 2j and 2j+1, 8
 * dwords each); three rounds of two-source permutes (a 32 x 8 dword transpose) turn them into
 * vectors whose lanes are chains, so that each fmadd advances 16 chains by one element. After the
 * transpose vector 8*h + c holds dword c of chains 16h..16h+15, lanes in the order of LANE_OF_CHAIN
 * below.
 */
#if defined(__x86_64__)

/* Built with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma (kernels/CMakeLists.txt). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu-internal.h"
#include "dsv4-numerics.h"

static inline __attribute__((always_inline)) __m512 even_f32(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

static inline __attribute__((always_inline)) __m512 odd_f32(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* dsv4_f32_to_bf16 per lane, the bf16 left in the high half of each dword (the low half is junk).
 */
static inline __attribute__((always_inline)) __m512i bf16_high(__m512 f) {
  __m512i u = _mm512_castps_si512(f);
  /* u + 0x7fff + (bit 16 of u): the carry rounds to nearest, ties to even. */
  __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
  r = _mm512_mask_add_epi32(r, _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000)), r,
                            _mm512_set1_epi32(1));
  __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
}

/* Two rounded results back into interleaved bf16 pairs. */
static inline __attribute__((always_inline)) __m512i pack_pairs(__m512i even_hi, __m512i odd_hi) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(even_hi, 16), odd_hi);
}

/* One transpose round: swap lane bit m with the register bit that pairs r[j] and r[j + d]. */
static inline __attribute__((always_inline)) void exchange(__m512i *r, int m, int d) {
  int lo[16], hi[16];
#pragma GCC unroll 32
  for (int i = 0; i < 16; i++) {
    lo[i] = (i & m) ? 16 + i - m : i;
    hi[i] = (i & m) ? 16 + i : i + m;
  }
  __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
#pragma GCC unroll 32
  for (int j = 0; j < 16; j++) {
    if (j & d)
      continue;
    __m512i a = r[j], b = r[j + d];
    r[j] = _mm512_permutex2var_epi32(a, ilo, b);
    r[j + d] = _mm512_permutex2var_epi32(a, ihi, b);
  }
}

/*
 * After the transpose, lane i of a chain vector holds chain (within its half of 16)
 * l = 8*bit2(i)... as listed: the lane of chain l is LANE_OF_CHAIN[l].
 */
static const int LANE_OF_CHAIN[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

/* The canonical sum of squares (SPEC §2) of 512 bf16 values. */
static inline __attribute__((always_inline)) float sumsq_bf16(const uint16_t *x) {
  __m512i r[16];
#pragma GCC unroll 32
  for (int j = 0; j < 16; j++)
    r[j] = _mm512_loadu_si512(x + 32 * j);
  exchange(r, 1, 1);
  exchange(r, 2, 2);
  exchange(r, 4, 4);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
#pragma GCC unroll 32
  for (int c = 0; c < 8; c++) {
    __m512 e0 = even_f32(r[c]), o0 = odd_f32(r[c]);
    __m512 e1 = even_f32(r[8 + c]), o1 = odd_f32(r[8 + c]);
    acc0 = _mm512_fmadd_ps(e0, e0, acc0);
    acc1 = _mm512_fmadd_ps(e1, e1, acc1);
    acc0 = _mm512_fmadd_ps(o0, o0, acc0);
    acc1 = _mm512_fmadd_ps(o1, o1, acc1);
  }
  /* The fold: step 16 lane by lane, then the natural chain order for steps 8, 4, 2 and 1. */
  __m512 p = _mm512_add_ps(acc0, acc1);
  p = _mm512_permutexvar_ps(_mm512_loadu_si512(LANE_OF_CHAIN), p);
  __m256 p8 = _mm256_add_ps(_mm512_castps512_ps256(p), _mm512_extractf32x8_ps(p, 1));
  __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));
  __m128 p2 = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));
  __m128 p1 = _mm_add_ss(p2, _mm_shuffle_ps(p2, p2, 1));
  return _mm_cvtss_f32(p1);
}

/* One RoPE pair vector (16 pairs): the inner product rounded first, then one fma each. */
static inline __attribute__((always_inline)) __m512i rope16(__m512 e, __m512 o, __m512 c,
                                                            __m512 s) {
  __m512i neg = _mm512_set1_epi32((int)0x80000000u);
  __m512 os = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(o, s)), neg));
  __m512 even = _mm512_fmadd_ps(e, c, os);
  __m512 odd = _mm512_fmadd_ps(e, s, _mm512_mul_ps(o, c));
  return pack_pairs(bf16_high(even), bf16_high(odd));
}

/* The normalised, rotated head given its RMS factor r; STORE writes one 64-byte vector. */
#define Q_HEAD_OUT(STORE)                                                                          \
  do {                                                                                             \
    __m512 vr = _mm512_set1_ps(r);                                                                 \
    _Pragma("GCC unroll 32") for (int j = 0; j < 14; j++) {                                        \
      __m512i v = _mm512_loadu_si512(q + 32 * j);                                                  \
      __m512i e = bf16_high(_mm512_mul_ps(even_f32(v), vr));                                       \
      __m512i o = bf16_high(_mm512_mul_ps(odd_f32(v), vr));                                        \
      STORE(out + 32 * j, pack_pairs(e, o));                                                       \
    }                                                                                              \
    _Pragma("GCC unroll 32") for (int k = 0; k < 2; k++) {                                         \
      __m512i v = _mm512_loadu_si512(q + DSV4_NOPE_DIM + 32 * k);                                  \
      __m512 e = _mm512_mul_ps(even_f32(v), vr);                                                   \
      __m512 o = _mm512_mul_ps(odd_f32(v), vr);                                                    \
      __m512 c = _mm512_loadu_ps(cs + 16 * k);                                                     \
      __m512 s = _mm512_loadu_ps(cs + DSV4_ROPE_PAIRS + 16 * k);                                   \
      STORE(out + DSV4_NOPE_DIM + 32 * k, rope16(e, o, c, s));                                     \
    }                                                                                              \
  } while (0)

#define STORE_CACHED(p, v)                                                                         \
  do {                                                                                             \
    _mm512_storeu_si512((void *)(p), (v));                                                         \
    DSV4__COUNT_STORE((p), 64);                                                                    \
  } while (0)
#define STORE_STREAM(p, v)                                                                         \
  do {                                                                                             \
    _mm512_stream_si512((void *)(p), (v));                                                         \
    DSV4__COUNT_STORE((p), 64);                                                                    \
  } while (0)

static inline __attribute__((always_inline)) void q_head_out(const uint16_t *q, uint16_t *out,
                                                             const float *cs, float r) {
  Q_HEAD_OUT(STORE_CACHED);
}

/* As q_head_out, bypassing the caches: out must be 64-byte aligned. */
static inline __attribute__((always_inline)) void q_head_out_nt(const uint16_t *q, uint16_t *out,
                                                                const float *cs, float r) {
  Q_HEAD_OUT(STORE_STREAM);
}

/* Heads per group: the RMS factors of a group are computed before its outputs, so the long
 * dependency chain of one head's reduction overlaps with its neighbours' (8 KiB stays in L1). */
#define Q_GROUP 8

void dsv4__cpu_q_heads_avx512(const uint16_t *q, uint16_t *out, uint32_t heads,
                              const float *rope_row, float eps, int stream) {
  /* Non-temporal stores need aligned rows; a misaligned q_out simply takes the cached path. */
  stream = stream && ((uintptr_t)out & 63) == 0;
  for (uint32_t h0 = 0; h0 < heads; h0 += Q_GROUP) {
    uint32_t n = heads - h0 < Q_GROUP ? heads - h0 : Q_GROUP;
    float r[Q_GROUP];
    for (uint32_t h = 0; h < n; h++)
      r[h] = dsv4_rms_factor(sumsq_bf16(q + (size_t)(h0 + h) * DSV4_HEAD_DIM), eps);
    for (uint32_t h = 0; h < n; h++) {
      const uint16_t *qh = q + (size_t)(h0 + h) * DSV4_HEAD_DIM;
      uint16_t *oh = out + (size_t)(h0 + h) * DSV4_HEAD_DIM;
      if (stream)
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
static inline __attribute__((always_inline)) __m512i e4m3(__m512 f) {
  __m512i u = _mm512_castps_si512(f);
  __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  /* Normal range: round the mantissa to 3 bits; the exponent carries as it should. */
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i rn =
      _mm512_and_si512(_mm512_add_epi32(a, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7ffff))),
                       _mm512_set1_epi32((int)0xfff00000u));
  __m512i mag = _mm512_sub_epi32(_mm512_srli_epi32(rn, 20), _mm512_set1_epi32(960));
  mag = _mm512_mask_mov_epi32(mag, _mm512_cmpgt_epu32_mask(rn, _mm512_set1_epi32(0x43e00000)),
                              _mm512_set1_epi32(0x7e));
  /* Below 2^-6: units of 2^-9, rounded to nearest even. |f| * 512 is exact, and the conversion
   * rounds to nearest even; at or below 2^-10 it gives 0, as the scalar codec does. */
  __m512 af = _mm512_castsi512_ps(a);
  __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(af, _mm512_set1_ps(512.0f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  mag = _mm512_mask_mov_epi32(mag, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000)), sub);
  mag = _mm512_mask_mov_epi32(mag, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000)),
                              _mm512_set1_epi32(0x7f));
  return _mm512_or_si512(mag, sign);
}

/* The KV row in registers, 16 fp32 dims per vector: the row's vectors, one NoPE tile's and the
 * first vector of the RoPE dims. */
#define KV_VECS (DSV4_HEAD_DIM / 16)
#define TILE_VECS (DSV4_TILE / 16)
#define ROPE_VEC0 (DSV4_NOPE_DIM / 16)

void dsv4__cpu_kv_token_avx512(const uint16_t *kv, const float *cs, const float *w, float eps,
                               uint8_t *data, uint8_t *scales) {
  __m512 z[KV_VECS];
#pragma GCC unroll 32
  for (int j = 0; j < KV_VECS; j++)
    z[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(kv + 16 * j))), 16));
  if (w) {
    __m512 vr = _mm512_set1_ps(dsv4_rms_factor(sumsq_bf16(kv), eps));
    __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 32
    for (int j = 0; j < KV_VECS; j++) {
      __m512 y = _mm512_mul_ps(_mm512_mul_ps(z[j], vr), _mm512_loadu_ps(w + 16 * j));
      z[j] = _mm512_castsi512_ps(_mm512_and_si512(bf16_high(y), hi));
    }
  }
  uint8_t sc[DSV4_SCALE_BYTES];
  __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
#pragma GCC unroll 32
  for (int t = 0; t < DSV4_NTILES; t++) {
    const __m512 *v = z + TILE_VECS * t;
    __m512 m01 = _mm512_max_ps(_mm512_and_ps(v[0], absmask), _mm512_and_ps(v[1], absmask));
    __m512 m23 = _mm512_max_ps(_mm512_and_ps(v[2], absmask), _mm512_and_ps(v[3], absmask));
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(m01, m23));
    if (!(amax > DSV4_AMAX_FLOOR))
      amax = DSV4_AMAX_FLOOR;
    dsv4_i32 e = dsv4_ue8m0_exponent(amax);
    __m512 scale = _mm512_set1_ps(dsv4_pow2_neg(e));
#pragma GCC unroll 32
    for (int k = 0; k < TILE_VECS; k++) {
      _mm_storeu_si128((__m128i *)(data + DSV4_TILE * t + 16 * k),
                       _mm512_cvtepi32_epi8(e4m3(_mm512_mul_ps(v[k], scale))));
      DSV4__COUNT_STORE(data + DSV4_TILE * t + 16 * k, 16);
    }
    sc[t] = (uint8_t)(e + DSV4_UE8M0_BIAS);
  }
  sc[DSV4_NTILES] = 0;
#ifdef DSV4_TEST_BROKEN_BULK_STORE
  /* Test-only breakage of SPEC §5.1 (the vLLM XPU bug, tests/unit/inv_one_writer.c): store dims
   * 448..511 unrotated (their bf16 inputs) before the rotated stores below overwrite them. */
  for (int j = ROPE_VEC0; j < KV_VECS; j++) {
    __m256i u = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(z[j]), 16));
    _mm256_storeu_si256((__m256i *)(data + DSV4_NOPE_DIM + 32 * (j - ROPE_VEC0)), u);
    DSV4__COUNT_STORE(data + DSV4_NOPE_DIM + 32 * (j - ROPE_VEC0), 32);
  }
#endif
  /* RoPE: split the 64 dims into even and odd lanes, rotate, and interleave the bf16 pairs again.
   */
  __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#pragma GCC unroll 32
  for (int k = 0; k < 2; k++) {
    __m512 a = z[ROPE_VEC0 + 2 * k], b = z[ROPE_VEC0 + 2 * k + 1];
    __m512 e = _mm512_permutex2var_ps(a, ie, b), o = _mm512_permutex2var_ps(a, io, b);
    __m512 c = _mm512_loadu_ps(cs + 16 * k), s = _mm512_loadu_ps(cs + DSV4_ROPE_PAIRS + 16 * k);
    _mm512_storeu_si512(data + DSV4_NOPE_DIM + 64 * k, rope16(e, o, c, s));
    DSV4__COUNT_STORE(data + DSV4_NOPE_DIM + 64 * k, 64);
  }
  memcpy(scales, sc, sizeof(sc));
  DSV4__COUNT_STORE(scales, sizeof(sc));
}

#endif /* __x86_64__ */
