/*
 * The per-token kernels of the CPU backend (SPEC §2.1-2.2). The scalar versions read like the SPEC;
 * the vector versions (cpu_kernels_avx2.c, cpu_kernels_avx512.c) compute the same operations in the
 * same order on more lanes, so every level produces the same bytes.
 */
#include "cpu-internal.h"

#include <string.h>

#include "dsv4-clones.h"
#include "dsv4-numerics.h"

/* The AVX2 and AVX-512 kernels are built on every x86-64 compiler and chosen at run time. */
#if defined(__x86_64__)
#define HAVE_AVX512_KERNELS 1
#define HAVE_AVX2_KERNELS 1
#endif

int dsv4__cpu_isa_supported(int isa) {
  switch (isa) {
  case DSV4__CPU_ISA_SCALAR:
    return 1;
#ifdef HAVE_AVX2_KERNELS
  case DSV4__CPU_ISA_AVX2:
    /* libgcc and compiler-rt report avx2 only when the OS saves the ymm state as well. */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
#ifdef HAVE_AVX512_KERNELS
  case DSV4__CPU_ISA_AVX512:
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
  default:
    return 0;
  }
}

int dsv4__cpu_isa_best(void) {
  for (int isa = DSV4__CPU_ISA_COUNT - 1; isa > DSV4__CPU_ISA_SCALAR; isa--)
    if (dsv4__cpu_isa_supported(isa))
      return isa;
  return DSV4__CPU_ISA_SCALAR;
}

const char *dsv4__cpu_isa_name(int isa) {
  switch (isa) {
  case DSV4__CPU_ISA_SCALAR:
    return "scalar";
  case DSV4__CPU_ISA_AVX2:
    return "avx2";
  case DSV4__CPU_ISA_AVX512:
    return "avx512";
  default:
    return "unknown";
  }
}

/*
 * The scalar kernels are cloned for x86-64-v3 where the compiler can do so, so that fmaf becomes
 * one FMA instruction instead of a libm call. fmaf is correctly rounded either way: the bytes are
 * the same.
 */
#define SCALAR_CLONES DSV4_CLONES("arch=x86-64-v3", "default")

#ifdef DSV4_TEST_BROKEN_ORDER
/*
 * Test-only breakage of SPEC §5.4 (tests/unit/inv_determinism.c): worker threads sum the squares in
 * plain index order instead of the canonical 32 chains and fold, so the bytes depend on which
 * thread ran a head. Worker threads also always take the scalar kernels.
 */
static float broken_sumsq512(const float *x) {
  if (dsv4__host_pool_participant() == 0)
    return dsv4_sumsq512(x);
  float acc = 0.0f;
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    acc = fmaf(x[d], x[d], acc);
  return acc;
}
#define SUMSQ512(x) broken_sumsq512(x)
#else
#define SUMSQ512(x) dsv4_sumsq512(x)
#endif

SCALAR_CLONES static void q_head_scalar(const uint16_t *q, uint16_t *out, const float *cs,
                                        float eps) {
  float x[DSV4_HEAD_DIM];
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    x[d] = dsv4_bf16_to_f32(q[d]);
  float r = dsv4_rms_factor(SUMSQ512(x), eps);
  for (int d = 0; d < DSV4_NOPE_DIM; d++) {
    out[d] = dsv4_f32_to_bf16(x[d] * r);
    DSV4__COUNT_STORE(&out[d], sizeof(out[d]));
  }
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float e = x[DSV4_NOPE_DIM + 2 * i] * r;
    float o = x[DSV4_NOPE_DIM + 2 * i + 1] * r;
    float c = cs[i], s = cs[DSV4_ROPE_PAIRS + i];
    out[DSV4_NOPE_DIM + 2 * i] = dsv4_f32_to_bf16(dsv4_rope_even(e, o, c, s));
    out[DSV4_NOPE_DIM + 2 * i + 1] = dsv4_f32_to_bf16(dsv4_rope_odd(e, o, c, s));
    DSV4__COUNT_STORE(&out[DSV4_NOPE_DIM + 2 * i], 2 * sizeof(out[0]));
  }
}

SCALAR_CLONES static void kv_token_scalar(const uint16_t *kv, const float *cs, const float *w,
                                          float eps, uint8_t *data, uint8_t *scales) {
  float z[DSV4_HEAD_DIM];
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    z[d] = dsv4_bf16_to_f32(kv[d]);
  if (w) {
    float r = dsv4_rms_factor(SUMSQ512(z), eps);
    for (int d = 0; d < DSV4_HEAD_DIM; d++)
      z[d] = dsv4_bf16_to_f32(dsv4_f32_to_bf16((z[d] * r) * w[d]));
  }
  /* The record is assembled here and copied out once, so each cache byte is stored once. */
  uint8_t rec[DSV4_TOKEN_DATA_BYTES];
  uint8_t sc[DSV4_SCALE_BYTES];
  for (int j = 0; j < DSV4_NTILES; j++) {
    const float *t = z + DSV4_TILE * j;
    float amax = DSV4_AMAX_FLOOR;
    for (int k = 0; k < DSV4_TILE; k++) {
      float a = fabsf(t[k]);
      amax = a > amax ? a : amax;
    }
    dsv4_i32 e = dsv4_ue8m0_exponent(amax);
    float scale = dsv4_pow2_neg(e);
    for (int k = 0; k < DSV4_TILE; k++)
      rec[DSV4_TILE * j + k] = dsv4_f32_to_e4m3(t[k] * scale);
    sc[j] = (uint8_t)(e + DSV4_UE8M0_BIAS);
  }
  sc[DSV4_NTILES] = 0;
#ifdef DSV4_TEST_BROKEN_BULK_STORE
  /* Test-only breakage of SPEC §5.1 (the vLLM XPU bug, tests/unit/inv_one_writer.c): store all 512
   * values unrotated first, then overwrite dims 448..511 with the rotated ones below. */
  for (int d = 0; d < DSV4_ROPE_DIM; d++) {
    uint16_t u = dsv4_f32_to_bf16(z[DSV4_NOPE_DIM + d]);
    rec[DSV4_NOPE_DIM + 2 * d] = (uint8_t)(u & 0xff);
    rec[DSV4_NOPE_DIM + 2 * d + 1] = (uint8_t)(u >> 8);
  }
  memcpy(data, rec, sizeof(rec));
  DSV4__COUNT_STORE(data, sizeof(rec));
#endif
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float e = z[DSV4_NOPE_DIM + 2 * i];
    float o = z[DSV4_NOPE_DIM + 2 * i + 1];
    float c = cs[i], s = cs[DSV4_ROPE_PAIRS + i];
    uint16_t be = dsv4_f32_to_bf16(dsv4_rope_even(e, o, c, s));
    uint16_t bo = dsv4_f32_to_bf16(dsv4_rope_odd(e, o, c, s));
    /* Little-endian bf16, whatever the host's byte order. */
    rec[DSV4_NOPE_DIM + 4 * i + 0] = (uint8_t)(be & 0xff);
    rec[DSV4_NOPE_DIM + 4 * i + 1] = (uint8_t)(be >> 8);
    rec[DSV4_NOPE_DIM + 4 * i + 2] = (uint8_t)(bo & 0xff);
    rec[DSV4_NOPE_DIM + 4 * i + 3] = (uint8_t)(bo >> 8);
  }
#ifdef DSV4_TEST_BROKEN_BULK_STORE
  memcpy(data + DSV4_NOPE_DIM, rec + DSV4_NOPE_DIM, 2 * DSV4_ROPE_DIM);
  DSV4__COUNT_STORE(data + DSV4_NOPE_DIM, 2 * DSV4_ROPE_DIM);
#else
  memcpy(data, rec, sizeof(rec));
  DSV4__COUNT_STORE(data, sizeof(rec));
#endif
  memcpy(scales, sc, sizeof(sc));
  DSV4__COUNT_STORE(scales, sizeof(sc));
}

void dsv4__cpu_q_heads(int isa, const uint16_t *q, uint16_t *out, uint32_t heads,
                       const float *rope_row, float eps, int stream) {
#ifdef DSV4_TEST_BROKEN_ORDER
  if (dsv4__host_pool_participant() != 0)
    isa = DSV4__CPU_ISA_SCALAR;
#endif
#ifdef HAVE_AVX512_KERNELS
  if (isa == DSV4__CPU_ISA_AVX512) {
    dsv4__cpu_q_heads_avx512(q, out, heads, rope_row, eps, stream);
    return;
  }
#endif
#ifdef HAVE_AVX2_KERNELS
  if (isa == DSV4__CPU_ISA_AVX2) {
    dsv4__cpu_q_heads_avx2(q, out, heads, rope_row, eps, stream);
    return;
  }
#endif
  (void)isa;
  (void)stream;
  for (uint32_t h = 0; h < heads; h++)
    q_head_scalar(q + (size_t)h * DSV4_HEAD_DIM, out + (size_t)h * DSV4_HEAD_DIM, rope_row, eps);
}

void dsv4__cpu_kv_token(int isa, const uint16_t *kv, const float *rope_row, const float *w,
                        float eps, uint8_t *data, uint8_t *scales) {
#ifdef DSV4_TEST_BROKEN_ORDER
  if (dsv4__host_pool_participant() != 0)
    isa = DSV4__CPU_ISA_SCALAR;
#endif
#ifdef HAVE_AVX512_KERNELS
  if (isa == DSV4__CPU_ISA_AVX512) {
    dsv4__cpu_kv_token_avx512(kv, rope_row, w, eps, data, scales);
    return;
  }
#endif
#ifdef HAVE_AVX2_KERNELS
  if (isa == DSV4__CPU_ISA_AVX2) {
    dsv4__cpu_kv_token_avx2(kv, rope_row, w, eps, data, scales);
    return;
  }
#endif
  (void)isa;
  kv_token_scalar(kv, rope_row, w, eps, data, scales);
}
