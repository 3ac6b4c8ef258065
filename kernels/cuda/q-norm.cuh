#ifndef DSV4_KERNELS_CUDA_Q_NORM_CUH
#define DSV4_KERNELS_CUDA_Q_NORM_CUH
/*
 * SPEC §2.1's Q path on the device (weightless RMSNorm of a 512-value head row, RoPE on dims
 * 448..511, bf16), the one source of these numerics for the insert (qkv_insert.cu, which writes
 * q_out, and normalises KV rows with the same sum of squares) and for the attention kernels (which
 * normalise the raw q themselves on the fused decode path, SPEC §7). Every function works on one
 * lane's values of a row that a whole warp holds; the canonical sum of squares (SPEC §2: 32 fma
 * chains over 16 consecutive dims from +0 in index order, then the fold 16, 8, 4, 2, 1) is laid on
 * the warp in one of two ways:
 *
 *   split (the insert): lane l holds dims 8l..8l+7 ("a") and 256+8l..256+8l+7 ("b"). Chain m is
 *     lane 2m's eight values continued by lane 2m+1's, so each even lane starts the chain and hands
 *     it to its odd neighbour with one shuffle; chain m of "a" and chain 16+m of "b" then meet in
 *     odd lane 2m+1 (the fold's first step), and the remaining steps are xor shuffles over the odd
 *     lanes. The RoPE dims are "b" of lanes 24..31, four pairs each.
 *   run (the attention): lane l holds dims 16l..16l+15, the whole of chain l, so the fold is five
 *     xor shuffles. The RoPE dims are lanes 28..31, eight pairs each.
 *
 * Both give every lane the bits of dsv4_sumsq512 (an fp32 add is commutative, so the butterfly's
 * mirrored operands change nothing). The caller's warp must be converged: every function but the
 * element-wise ones shuffles over all 32 lanes.
 */
#include "cuda-internal.cuh"

#include "dsv4-numerics.h"

#define QN_FULL 0xffffffffu
/* The first lane of each layout whose values include RoPE dims. */
#define QN_SPLIT_ROPE_LANE0 ((DSV4_NOPE_DIM - DSV4_HEAD_DIM / 2) / 8)
#define QN_RUN_ROPE_LANE0 (DSV4_NOPE_DIM / 16)

/* Eight bf16 values (16 bytes) as fp32, exactly. */
static __device__ __forceinline__ void qn_unpack8(uint4 v, float x[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; k++) {
    x[2 * k] = __uint_as_float(w[k] << 16);
    x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

/* Eight fp32 values rounded to bf16 (to nearest even), packed in order. */
static __device__ __forceinline__ uint4 qn_pack8(const float y[8]) {
  return make_uint4(dsv4__bf16x2_rn(y[0], y[1]), dsv4__bf16x2_rn(y[2], y[3]),
                    dsv4__bf16x2_rn(y[4], y[5]), dsv4__bf16x2_rn(y[6], y[7]));
}

/* Eight more steps of a canonical chain: acc = fma(x, x, acc) in index order. */
static __device__ __forceinline__ float qn_chain8(const float x[8], float acc) {
#pragma unroll
  for (int k = 0; k < 8; k++)
    acc = __fmaf_rn(x[k], x[k], acc);
  return acc;
}

/* y = x * r, one rounding per value (SPEC §2.1: the Q norm has no weight). */
static __device__ __forceinline__ void qn_scale8(float x[8], float r) {
#pragma unroll
  for (int j = 0; j < 8; j++)
    x[j] = __fmul_rn(x[j], r);
}

/* Four RoPE pairs of normalised values y with their cos c and sin s, rounded to bf16. */
static __device__ __forceinline__ uint4 qn_rope4(const float y[8], float4 c, float4 s) {
  const float cc[4] = {c.x, c.y, c.z, c.w}, ss[4] = {s.x, s.y, s.z, s.w};
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const float e = y[2 * k], o = y[2 * k + 1];
    w[k] = dsv4__bf16x2_rn(dsv4_rope_even(e, o, cc[k], ss[k]), dsv4_rope_odd(e, o, cc[k], ss[k]));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* The canonical sum of squares of the warp's row in the split layout; every lane gets it. */
static __device__ __forceinline__ float qn_sumsq_split(const float xa[8], const float xb[8]) {
  float ca = qn_chain8(xa, 0.0f), cb = qn_chain8(xb, 0.0f);
  float ea = __shfl_xor_sync(QN_FULL, ca, 1), eb = __shfl_xor_sync(QN_FULL, cb, 1);
  /* Odd lanes continue their even neighbour's chain; the even lanes' results are not used. */
  float p = __fadd_rn(qn_chain8(xa, ea), qn_chain8(xb, eb));
  p = __fadd_rn(p, __shfl_xor_sync(QN_FULL, p, 16));
  p = __fadd_rn(p, __shfl_xor_sync(QN_FULL, p, 8));
  p = __fadd_rn(p, __shfl_xor_sync(QN_FULL, p, 4));
  p = __fadd_rn(p, __shfl_xor_sync(QN_FULL, p, 2));
  return __shfl_sync(QN_FULL, p, 1);
}

/* The canonical sum of squares of the warp's row in the run layout (x: the lane's 16 dims in
 * order); every lane gets it. */
static __device__ __forceinline__ float qn_sumsq_run(const float x0[8], const float x1[8]) {
  float p = qn_chain8(x1, qn_chain8(x0, 0.0f));
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1)
    p = __fadd_rn(p, __shfl_xor_sync(QN_FULL, p, off));
  return p;
}

/*
 * One Q row in the split layout: the lane's raw bf16 values ra ("a") and rb ("b") in, its q_out
 * pieces oa, ob out; c, s: the cos and sin of the lane's four pairs (read only on lanes
 * QN_SPLIT_ROPE_LANE0..).
 */
static __device__ __forceinline__ void qn_row_split(uint32_t lane, uint4 ra, uint4 rb, float4 c,
                                                    float4 s, float eps, uint4 *oa, uint4 *ob) {
  float xa[8], xb[8];
  qn_unpack8(ra, xa);
  qn_unpack8(rb, xb);
  const float r = dsv4_rms_factor(qn_sumsq_split(xa, xb), eps);
  qn_scale8(xa, r);
  qn_scale8(xb, r);
  *oa = qn_pack8(xa);
  *ob = lane < QN_SPLIT_ROPE_LANE0 ? qn_pack8(xb) : qn_rope4(xb, c, s);
}

/*
 * One Q row in the run layout, in place: r0, r1 (the lane's dims 16 lane.. and 16 lane + 8..,
 * raw bf16) become the bf16 values the insert writes to q_out for them. rope: the 64 floats of
 * the query position's RoPE row (cos then sin), 16-byte aligned, read only on lanes
 * QN_RUN_ROPE_LANE0..; the exact bytes of qn_row_split's over the same row.
 */
static __device__ __forceinline__ void qn_row_run(uint32_t lane, const float *rope, float eps,
                                                  uint4 &r0, uint4 &r1) {
  float x0[8], x1[8];
  qn_unpack8(r0, x0);
  qn_unpack8(r1, x1);
  const float r = dsv4_rms_factor(qn_sumsq_run(x0, x1), eps);
  qn_scale8(x0, r);
  qn_scale8(x1, r);
  if (lane < QN_RUN_ROPE_LANE0) {
    r0 = qn_pack8(x0);
    r1 = qn_pack8(x1);
  } else {
    /* Pairs 8 (lane - 28) .. + 7: cos float4s 2 (lane - 28) and the next, sin 8 float4s on. */
    const float4 *cs = reinterpret_cast<const float4 *>(rope) + 2 * (lane - QN_RUN_ROPE_LANE0);
    r0 = qn_rope4(x0, cs[0], cs[DSV4_ROPE_PAIRS / 4]);
    r1 = qn_rope4(x1, cs[1], cs[DSV4_ROPE_PAIRS / 4 + 1]);
  }
}

#endif /* DSV4_KERNELS_CUDA_Q_NORM_CUH */
