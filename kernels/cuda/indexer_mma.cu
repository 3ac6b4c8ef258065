/*
 * The indexer's scores on tensor cores (SPEC §8.5): for 64 index heads, the keys of the per-entry
 * score kernel (indexer.cu), bit for bit, for the same grid of (token, split) CTAs, waves and key
 * slots, over the entries a CTA's split holds.
 *
 * The dot products d_hj = q^_h . k^_j come from bf16 MMAs (mma.sync m16n8k16) of the query's and
 * the entry's MXFP4 values, each nibble prescaled by its block's 2^(code - 127) (exact in bf16);
 * dsv4-compress.h ("the index dot product on matrix units") derives when these are the CPU's
 * dsv4_dot128 to the bit, and tests/unit/index_mx_test.c holds it. Per warp of 32 entries, from
 * the summaries of the heads' and the entries' blocks (dsv4_index_mx_mode):
 *   fused    the products of all 128 dims accumulated in the tensor cores, which is d exactly;
 *   partial  each 16-dim partial an MMA from zero, then dsv4_fold8's adds in fp32;
 *   scalar   dsv4_dot128 of the dequantised values, as the per-entry kernel computes it.
 * Then one thread per entry adds the heads' terms in order (dsv4_index_score_add, h = 0..63) and
 * stores dsv4_index_score_key at the entry's index in the token's slot, as the per-entry kernel.
 *
 * A query kernel before it forms each of the wave's scoring tokens' q^ once (a warp per head,
 * index_query_warp), with the heads' weights and block summaries, at the end of the token's key
 * slot. A CTA of 256 threads copies its token's rows into shared memory; each warp then holds the A
 * fragments of all 64 heads x 128 dims in registers (128 a thread). Rounds of 256 entries: their
 * 68-byte records are staged into shared memory by cp.async one round ahead (rows of 80 bytes, so
 * that the lanes' 2-byte reads of one partial fall in distinct banks); warp w takes entries
 * 32w..32w+31 as four n-tiles of 8, two at a time (the two tiles' MMA chains interleaved, so that
 * one's MMAs issue while the other's are in flight: with two warps a scheduler the kernel lives on
 * a warp's own parallelism), each lane turning the 16 nibbles of its entry and k-slots into bf16 B
 * fragments through a byte table per code (dsv4_index_mx_bf16x4), 32 MMAs (4 head tiles x 8
 * partials) per n-tile, and d to a [256][68] float tile; then its threads run the heads' chains of
 * the round before, from the other d tile, so that one warp's chains overlap another's MMAs. One
 * barrier a round. About 220 KiB of shared memory: one CTA an SM.
 *
 * Fast mode (the kernel's FAST instance, SPEC §8.9): the same rounds, modes and d, but no d tile
 * and no chains: each lane sums the weighted terms of its 8 heads of its 2 entries from its MMA
 * results in registers, and the 8 lanes of an entry add those sums by shuffles in a fixed tree
 * (ntile_pair_keys); a warp of the scalar product runs its own rows' chains.
 *
 * The MMA's k-slots 2c, 2c + 1, 2c + 8, 2c + 9 (c = lane % 4) of partial l hold dims 16l + 4c ..
 * 16l + 4c + 3 on both sides (the sum of 16 exact products does not depend on the order), so a lane
 * takes 4 consecutive nibbles, 2 bytes, of each partial; the A rows g and g + 8 of head tile m are
 * heads 16m + 2g and 16m + 2g + 1, so a lane's two results of an entry are adjacent in d.
 *
 * Ordering (SPEC §5.2): the byte table is built before the dependency wait (it reads nothing); the
 * wait comes before any other read, the error word is read after it, as in the per-entry kernel.
 * The query kernel waits before it reads anything, and the score kernel reads its rows after its
 * own wait; the next wave's query kernel rewrites them only after this wave's select kernel, which
 * waited for this score kernel, has completed.
 */
#include "indexer-mx.cuh"

#include <atomic>

/* Entries a round: one a thread in the heads' chains. */
#define TILE STAGE_ENTRIES
#define WARP_ROWS (TILE / SEL_WARPS)
static_assert(WARP_ROWS % 16 == 0, "a warp's rows are whole pairs of n-tiles");
/* Floats per entry's row of d: the 64 heads and a pad, so that the lanes' float2 stores of one
 * head tile fall in distinct banks and the chains' float4 reads of 8 rows too. */
#define D_STRIDE (MMA_HEADS + 4)

typedef struct {
  float qhat[MMA_HEADS * Q_STRIDE]; /* q^, row h of head h */
  float w[MMA_HEADS];
  uint4 lut[256];           /* dsv4_index_mx_lut of every code */
  uint32_t qsum[MMA_HEADS]; /* the heads' block summaries */
  uint32_t qstat[4];        /* the heads' per-block minima and maxima, the largest span */
  uint8_t stage[2][TILE * STAGE_ROW];
  uint32_t codes[2][TILE];
  float d[2][TILE * D_STRIDE]; /* a round's d while the last round's chains read the other */
  float kbuf[SEL_WARPS][DSV4_INDEX_DIM]; /* a warp's dequantised entry (the scalar product) */
} mma_smem_t;

static_assert(sizeof(mma_smem_t) % 16 == 0, "whole 16-byte chunks");

/* The A fragments of the 64 heads (dims permuted within each partial as the file's header says). */
static __device__ __forceinline__ void load_queries(const float *qhat, uint32_t (&a)[4][8][4]) {
  const uint32_t lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int m = 0; m < 4; m++)
#pragma unroll
    for (int l = 0; l < 8; l++) {
      const float *r = qhat + (16 * m + 2 * g) * Q_STRIDE + 16 * l + 4 * c;
      const float4 x = *reinterpret_cast<const float4 *>(r);
      const float4 y = *reinterpret_cast<const float4 *>(r + Q_STRIDE);
      /* q^ values are n * 2^e, bf16 numbers: the conversions are exact. */
      a[m][l][0] = dsv4__bf16x2_rn(x.x, x.y);
      a[m][l][1] = dsv4__bf16x2_rn(y.x, y.y);
      a[m][l][2] = dsv4__bf16x2_rn(x.z, x.w);
      a[m][l][3] = dsv4__bf16x2_rn(y.z, y.w);
    }
}

/* A lane's four results of head tile m into the tile of d (row: its first entry's row, at its
 * first head): heads 16m + 2g, + 1 of entries 2c and 2c + 1. */
static __device__ __forceinline__ void store_d(float *row, int m, const float (&x)[4]) {
  *reinterpret_cast<float2 *>(row + 16 * m) = make_float2(x[0], x[2]);
  *reinterpret_cast<float2 *>(row + D_STRIDE + 16 * m) = make_float2(x[1], x[3]);
}

/* Fused mode for two n-tiles: the products of all 8 partials accumulated on the tensor cores, d
 * exactly; d[k][m] is the lane's four results of n-tile k and head tile m (store_d's order). The
 * tiles' chains are independent, so they interleave, each in its own order. */
static __device__ __forceinline__ void d_fused(const uint32_t (&a)[4][8][4],
                                               const uint32_t (&b)[2][8][2], float (&d)[2][4][4]) {
#pragma unroll
  for (int k = 0; k < 2; k++)
#pragma unroll
    for (int m = 0; m < 4; m++)
      d[k][m][0] = d[k][m][1] = d[k][m][2] = d[k][m][3] = 0.0f;
#pragma unroll
  for (int l = 0; l < 8; l++)
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
      for (int k = 0; k < 2; k++)
        mma16816(d[k][m], a[m][l], b[k][l][0], b[k][l][1]);
}

/* Partial l of head tile m from zero. */
static __device__ __forceinline__ void
partial(const uint32_t (&a)[4][8][4], const uint32_t (&b)[8][2], int m, int l, float (&x)[4]) {
  x[0] = x[1] = x[2] = x[3] = 0.0f;
  mma16816(x, a[m][l], b[l][0], b[l][1]);
}

static __device__ __forceinline__ void add4(float (&x)[4], const float (&y)[4]) {
#pragma unroll
  for (int i = 0; i < 4; i++)
    x[i] = __fadd_rn(x[i], y[i]);
}

/* (p_l + p_l+4) + (p_l+2 + p_l+6) of head tile m, l = 0 or 1: one half of dsv4_fold8's tree. */
static __device__ __forceinline__ void
partial_half(const uint32_t (&a)[4][8][4], const uint32_t (&b)[8][2], int m, int l, float (&x)[4]) {
  float y[4], u[4], v[4];
  partial(a, b, m, l, x);
  partial(a, b, m, l + 4, y);
  add4(x, y);
  partial(a, b, m, l + 2, u);
  partial(a, b, m, l + 6, v);
  add4(u, v);
  add4(x, u);
}

/* Partial mode: dsv4_fold8 of the 8 partials, ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)),
 * of head tile m. */
static __device__ __forceinline__ void d_partial(const uint32_t (&a)[4][8][4],
                                                 const uint32_t (&b)[8][2], int m, float (&x)[4]) {
  float u[4];
  partial_half(a, b, m, 0, x);
  partial_half(a, b, m, 1, u);
  add4(x, u);
}

/* The B fragments of the 8 entries of rows r0..r0 + 7 of the staged round: a lane's from entry
 * r0 + g. */
static __device__ __forceinline__ void ntile_b(const uint8_t *stage, const uint32_t *codes,
                                               const uint4 *lut, uint32_t r0, uint32_t (&b)[8][2]) {
  const uint32_t lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const uint8_t *v = stage + (r0 + g) * STAGE_ROW + 2 * c;
  const uint32_t c4 = codes[r0 + g];
#pragma unroll
  for (int blk = 0; blk < DSV4_MXFP4_BLOCKS; blk++) {
    const uint4 t = lut[(c4 >> (8 * blk)) & 255u];
    const uint32_t tw[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int l = 2 * blk + h; /* partial l: bytes 8l..8l + 7, this lane's 8l + 2c, + 1 */
      const uint32_t x = *reinterpret_cast<const uint16_t *>(v + 8 * l);
      dsv4_index_mx_bf16x4(x, tw, &b[l][0], &b[l][1]);
    }
  }
}

/* The lane's d of the 64 heads and two n-tiles' entries (rows r0.. and r0 + 8..), in the mode
 * FUSED names (d[k][m]: n-tile k, head tile m, store_d's order). In fused mode both tiles'
 * fragments are built first and their MMA chains interleave, one's MMAs issuing while the other's
 * are in flight. */
template <bool FUSED>
static __device__ __forceinline__ void
ntile_pair_d(const uint32_t (&a)[4][8][4], const uint8_t *stage, const uint32_t *codes,
             const uint4 *lut, uint32_t r0, float (&d)[2][4][4]) {
  if (FUSED) {
    uint32_t b[2][8][2];
    ntile_b(stage, codes, lut, r0, b[0]);
    ntile_b(stage, codes, lut, r0 + 8, b[1]);
    d_fused(a, b, d);
  } else {
    /* Partial mode's temporaries leave no room for both tiles' fragments at once. */
#pragma unroll
    for (int k = 0; k < 2; k++) {
      uint32_t b[8][2];
      ntile_b(stage, codes, lut, r0 + 8 * k, b);
#pragma unroll
      for (int m = 0; m < 4; m++)
        d_partial(a, b, m, d[k][m]);
    }
  }
}

/* The d of the 64 heads and the 16 entries of rows r0..r0 + 15 of the staged round, into rows
 * r0.. of dt: a lane's B fragments from entries r0 + g and r0 + 8 + g, its results for entries
 * r0 + 8k + 2c, + 1. */
template <bool FUSED>
static __device__ __forceinline__ void
ntile_pair_scores(const uint32_t (&a)[4][8][4], const uint8_t *stage, const uint32_t *codes,
                  const uint4 *lut, uint32_t r0, float *dt) {
  const uint32_t lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  float d[2][4][4];
  ntile_pair_d<FUSED>(a, stage, codes, lut, r0, d);
#pragma unroll
  for (int k = 0; k < 2; k++) {
    float *row = dt + (r0 + 8 * k + 2 * c) * D_STRIDE + 2 * g;
#pragma unroll
    for (int m = 0; m < 4; m++)
      store_d(row, m, d[k][m]);
  }
}

/*
 * Fast mode: the keys of two n-tiles' entries (rows r0.., r0 + 8..) from the lane's d in
 * registers. For each tile k the lane adds the terms of its 8 heads of each of its two entries
 * (entries r0 + 8k + 2c, + 1; heads 16m + 2g, + 1 for m = 0..3, in that order,
 * dsv4_index_score_add from +0.0f), the 8 lanes of an entry add their sums in a fixed tree (lanes g
 * and g ^ 1, then ^ 2, then ^ 4: every lane gets the same value), and lanes 0..3 store the keys of
 * entries with index i0 + 8k + 2c, + 1 below i1. d is the exact mode's, bit for bit; only the
 * order of the heads' sum differs from the chain of entry_chain.
 */
template <bool FUSED>
static __device__ __forceinline__ void ntile_pair_keys(const uint32_t (&a)[4][8][4], const float *w,
                                                       const uint8_t *stage, const uint32_t *codes,
                                                       const uint4 *lut, uint32_t r0,
                                                       uint32_t *keys, uint32_t i0, uint32_t i1) {
  const uint32_t lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  float d[2][4][4];
  ntile_pair_d<FUSED>(a, stage, codes, lut, r0, d);
  float s[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
  for (int m = 0; m < 4; m++) {
    const float2 wm = *reinterpret_cast<const float2 *>(w + 16 * m + 2 * g);
#pragma unroll
    for (int k = 0; k < 2; k++) {
      s[k][0] = dsv4_index_score_add(wm.x, d[k][m][0], s[k][0]);
      s[k][0] = dsv4_index_score_add(wm.y, d[k][m][2], s[k][0]);
      s[k][1] = dsv4_index_score_add(wm.x, d[k][m][1], s[k][1]);
      s[k][1] = dsv4_index_score_add(wm.y, d[k][m][3], s[k][1]);
    }
  }
#pragma unroll
  for (uint32_t x = 4; x < 32; x <<= 1)
#pragma unroll
    for (int k = 0; k < 2; k++) {
      s[k][0] = __fadd_rn(s[k][0], __shfl_xor_sync(FULL, s[k][0], x));
      s[k][1] = __fadd_rn(s[k][1], __shfl_xor_sync(FULL, s[k][1], x));
    }
#pragma unroll
  for (int k = 0; k < 2; k++) {
    const uint32_t i = i0 + 8 * k + 2 * c;
    if (lane < 4 && i < i1)
      keys[i] = dsv4_index_score_key(s[k][0]);
    if (lane < 4 && i + 1 < i1)
      keys[i + 1] = dsv4_index_score_key(s[k][1]);
  }
}

/* dsv4_dot128(x, y) by the same operations in the same order (8 fma chains of 16 dims from +0.0f,
 * then dsv4_fold8), a chain's loads issued as it runs: beside the 128 registers of A fragments the
 * fully unrolled function would not fit. */
static __device__ __forceinline__ float dot128_lean(const float *x, const float *y) {
  float p[8];
#pragma unroll
  for (int l = 0; l < 8; l++) {
    float acc = 0.0f;
#pragma unroll 1
    for (int k = 0; k < 16; k++)
      acc = DSV4_FMA(x[16 * l + k], y[16 * l + k], acc);
    p[l] = acc;
  }
  return dsv4_fold8(p);
}

/* Scalar mode: d of rows r0..r0 + n - 1, the dot product of q^ and the entry dequantised as
 * dsv4_mxfp4_dequant128 does (lane l: dims 4l..4l + 3), two heads a lane. */
static __device__ void rows_scalar(const float *qhat, const uint8_t *stage, const uint32_t *codes,
                                   uint32_t r0, uint32_t n, float *kb, float *dt) {
  const uint32_t lane = threadIdx.x & 31;
  for (uint32_t r = r0; r < r0 + n; r++) {
    const uint8_t *v = stage + r * STAGE_ROW + 2 * lane;
    const float scale = dsv4_ue8m0_scale((uint8_t)(codes[r] >> (8 * (lane / 8))));
    kb[4 * lane] = dsv4_e2m1_to_f32((uint8_t)(v[0] & 15u)) * scale;
    kb[4 * lane + 1] = dsv4_e2m1_to_f32((uint8_t)(v[0] >> 4)) * scale;
    kb[4 * lane + 2] = dsv4_e2m1_to_f32((uint8_t)(v[1] & 15u)) * scale;
    kb[4 * lane + 3] = dsv4_e2m1_to_f32((uint8_t)(v[1] >> 4)) * scale;
    __syncwarp();
    for (uint32_t h = lane; h < MMA_HEADS; h += 32)
      dt[r * D_STRIDE + h] = dot128_lean(qhat + h * Q_STRIDE, kb);
    __syncwarp();
  }
}

/* Entry i's score (the thread's row of d[buf], the heads in order) as its key, if i < i1. */
static __device__ void entry_chain(const mma_smem_t &sm, int buf, uint32_t *keys, uint32_t i,
                                   uint32_t i1) {
  if (i >= i1)
    return;
  const float4 *row = reinterpret_cast<const float4 *>(sm.d[buf] + threadIdx.x * D_STRIDE);
  const float4 *w = reinterpret_cast<const float4 *>(sm.w);
  float acc = 0.0f;
#pragma unroll 4
  for (int k = 0; k < MMA_HEADS / 4; k++) {
    const float4 d = row[k], ww = w[k];
    acc = dsv4_index_score_add(ww.x, d.x, acc);
    acc = dsv4_index_score_add(ww.y, d.y, acc);
    acc = dsv4_index_score_add(ww.z, d.z, acc);
    acc = dsv4_index_score_add(ww.w, d.w, acc);
  }
  keys[i] = dsv4_index_score_key(acc);
}

/* Warp w's rows 32w.. of the staged round (entries base + row, n in it), in the mode warp_mode
 * gives: exact mode into d[buf], for the chains a round later; fast mode (FAST) to their keys, the
 * heads' sums in registers (ntile_pair_keys), a warp of the scalar product summing its own rows'
 * chains from its rows of d[buf], which no other warp touches. */
template <bool FAST>
static __device__ __forceinline__ void warp_round(mma_smem_t &sm, const uint32_t (&a)[4][8][4],
                                                  int buf, uint32_t n, uint32_t cap, uint32_t *keys,
                                                  uint32_t base, uint32_t i1) {
  const uint32_t warp = threadIdx.x >> 5, r0 = warp * WARP_ROWS;
  if (r0 >= n)
    return; /* warp-uniform */
  const uint32_t rows = min(n - r0, (uint32_t)WARP_ROWS);
  const uint8_t *stage = sm.stage[buf];
  const uint32_t *codes = sm.codes[buf];
  const int mode = warp_mode(sm.qstat, stage, codes, r0, rows, cap);
  if (mode == DSV4_INDEX_MX_SCALAR) {
    rows_scalar(sm.qhat, stage, codes, r0, rows, sm.kbuf[warp], sm.d[buf]);
    if (FAST) {
      __syncwarp();
      entry_chain(sm, buf, keys, base + threadIdx.x, i1);
    }
    return;
  }
  /* Pairs of n-tiles past the last entry are skipped; the rows past it in the last pair hold
   * stale bytes (or none yet), whose columns of d nobody reads and whose keys fast mode does not
   * store. */
  const bool fused = mode == DSV4_INDEX_MX_FUSED;
  for (uint32_t t = 0; t < WARP_ROWS / 8 && 8 * t < rows; t += 2) {
    const uint32_t r = r0 + 8 * t;
    if (FAST && fused)
      ntile_pair_keys<true>(a, sm.w, stage, codes, sm.lut, r, keys, base + r, i1);
    else if (FAST)
      ntile_pair_keys<false>(a, sm.w, stage, codes, sm.lut, r, keys, base + r, i1);
    else if (fused)
      ntile_pair_scores<true>(a, stage, codes, sm.lut, r, sm.d[buf]);
    else
      ntile_pair_scores<false>(a, stage, codes, sm.lut, r, sm.d[buf]);
  }
}

/* CTAs of the query kernel a token: a warp a head. */
#define QUERY_Y (MMA_HEADS / SEL_WARPS)

/*
 * Query CTA (x, y) of the wave (after the dependency wait): warp w forms head 8y + w's q^ of token
 * t_base + x (index_query_warp), its summary and its weight into slot x's query rows, once for all
 * the splits of the token that the score kernel after it runs. Nothing for a token that does not
 * score, nor when the error word is set. The token's segment and position are checked here
 * (token_range), so its RoPE row lies in the table whether or not the check has run; the rows
 * are scratch that only the score kernel reads, after its wait, which follows the check.
 */
static __device__ void query_cta(const idx_params_t &p, uint32_t x, uint32_t y) {
  const uint32_t t = p.t_base + x, h = y * SEL_WARPS + threadIdx.x / 32;
  uint32_t s;
  int64_t jlo, jhi;
  /* CTA-uniform: no rows for a token that does not score (it sees at most topk entries) */
  if (__ldcg(p.err) != 0 || t >= p.n_tokens || h >= MMA_HEADS ||
      token_range(p, t, &s, &jlo, &jhi) || jhi - jlo <= (int64_t)p.topk)
    return;
  const float *rope_row = p.rope + (uint64_t)p.pos[t] * DSV4_ROPE_ROW_FLOATS;
  float *row = slot_queries(p, x) + (uint64_t)h * QROW;
  index_query_warp(p.iq + ((uint64_t)t * MMA_HEADS + h) * DSV4_INDEX_DIM, rope_row, row,
                   reinterpret_cast<uint32_t *>(row + DSV4_INDEX_DIM + 1));
  if ((threadIdx.x & 31) == 0) { /* the weight; the pad written too, so that no copy reads junk */
    row[DSV4_INDEX_DIM] = __fmul_rn(p.iw[(uint64_t)t * MMA_HEADS + h], p.w_scale);
    row[DSV4_INDEX_DIM + 2] = row[DSV4_INDEX_DIM + 3] = 0.0f;
  }
}

/* The query kernel, grid (tokens of the wave, QUERY_Y): query_cta (blockIdx.x, blockIdx.y). */
__global__ void __launch_bounds__(SEL_THREADS) dsv4__indexer_query_kernel(idx_params_t p) {
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  query_cta(p, blockIdx.x, blockIdx.y);
}

/*
 * The first wave's query kernel and the launch's check in one grid: CTAs 0..query_ctas - 1 are
 * query_cta (x, y) for CTA x QUERY_Y + y, the rest check items (indexer_check_item). The two are
 * independent (query_cta's comment), so the check runs beside the queries instead of one kernel
 * ahead of them; the score kernel reads the error word after its wait for this whole grid.
 */
__global__ void __launch_bounds__(SEL_THREADS)
    dsv4__indexer_check_query_kernel(idx_params_t p, uint32_t query_ctas) {
  static_assert(CHECK_BLOCK == SEL_THREADS, "one CTA size for both parts");
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  if (blockIdx.x < query_ctas)
    query_cta(p, blockIdx.x / QUERY_Y, blockIdx.x % QUERY_Y);
  else
    indexer_check_item(p, (blockIdx.x - query_ctas) * CHECK_BLOCK + threadIdx.x);
}

/* The queries, the weights and the heads' statistics of the CTA's token into sm: the query kernel's
 * rows of slot blockIdx.x (after the dependency wait). */
static __device__ void token_queries(const idx_params_t &p, mma_smem_t &sm) {
  const float4 *src = reinterpret_cast<const float4 *>(slot_queries(p, blockIdx.x));
  float4 *dst = reinterpret_cast<float4 *>(sm.qhat);
  static_assert(QROW == Q_STRIDE, "the rows copied as they are");
  for (uint32_t i = threadIdx.x; i < MMA_HEADS * QROW / 4; i += SEL_THREADS)
    dst[i] = __ldcg(src + i);
  __syncthreads();
  for (uint32_t h = threadIdx.x; h < MMA_HEADS; h += SEL_THREADS) {
    sm.w[h] = sm.qhat[h * Q_STRIDE + DSV4_INDEX_DIM];
    sm.qsum[h] = __float_as_uint(sm.qhat[h * Q_STRIDE + DSV4_INDEX_DIM + 1]);
  }
  __syncthreads();
  if (threadIdx.x < 32)
    heads_stats(sm.qsum, sm.qstat);
}

/* Split y of token t_base + blockIdx.x: the queries, then rounds of TILE entries; FAST: the heads'
 * sums in registers (warp_round's fast mode), no chains a round behind. */
template <bool FAST>
__global__ void __launch_bounds__(SEL_THREADS, 1) dsv4__indexer_score_mma_kernel(idx_params_t p) {
  extern __shared__ uint4 smem_raw[];
  mma_smem_t &sm = *reinterpret_cast<mma_smem_t *>(smem_raw);
  mx_lut_build(sm.lut, SEL_THREADS);
  uint32_t t, s, i0, i1;
  int64_t jlo;
  if (!score_begin(p, &t, &s, &jlo, &i0, &i1))
    return;
  const dsv4__seg_table_t tb = dsv4__seg_table(p, s);
  stage_round(p, tb, jlo, i0, min(i1, i0 + TILE), sm.stage[0], sm.codes[0], threadIdx.x);
  token_queries(p, sm);
  uint32_t a[4][8][4];
  load_queries(sm.qhat, a);
  uint32_t *keys = p.keys + (uint64_t)blockIdx.x * p.keys_per_cta;
  /* Round r: its records staged in stage[r & 1] during round r - 1; its d into d[r & 1] while
   * the chains of round r - 1 read d[(r - 1) & 1]. One barrier a round separates every write of a
   * buffer from the reads of its last use. */
  int buf = 0;
  uint32_t base = i0;
  for (;; buf ^= 1) {
    dsv4__cp_async_wait_all();
    __syncthreads(); /* round staged, qstat written; d[buf] and stage[buf ^ 1] free */
    if (base + TILE < i1)
      stage_round(p, tb, jlo, base + TILE, min(i1, base + 2 * TILE), sm.stage[buf ^ 1],
                  sm.codes[buf ^ 1], threadIdx.x);
    warp_round<FAST>(sm, a, buf, min(i1 - base, (uint32_t)TILE), p.mma_cap, keys, base, i1);
    if (!FAST && base > i0)
      entry_chain(sm, buf ^ 1, keys, base - TILE + threadIdx.x, i1);
    if (base + TILE >= i1)
      break;
    base += TILE;
  }
  if (!FAST) {
    __syncthreads();
    entry_chain(sm, buf, keys, base + threadIdx.x, i1);
  }
}

static std::atomic<int> fits_cache[DEV_CACHE];

static int mma_fits_probe(int dev) {
  return smem_grants(dev, sizeof(mma_smem_t));
}

int dsv4__indexer_mma_fits(void) {
  return per_device_cached(fits_cache, mma_fits_probe);
}

cudaError_t dsv4__indexer_query_launch(const idx_params_t &p, uint32_t ctas, cudaStream_t s,
                                       int pdl) {
  return dsv4__cuda_launch_smem(dsv4__indexer_query_kernel, dim3(ctas, QUERY_Y, 1), SEL_THREADS, 0,
                                s, pdl, p);
}

cudaError_t dsv4__indexer_check_query_launch(const idx_params_t &p, uint32_t ctas,
                                             uint32_t check_ctas, cudaStream_t s, int pdl) {
  const uint64_t grid = (uint64_t)ctas * QUERY_Y + check_ctas;
  if (grid > 0x7fffffffu)
    return cudaErrorInvalidValue;
  return dsv4__cuda_launch(dsv4__indexer_check_query_kernel, (unsigned)grid, SEL_THREADS, s, pdl, p,
                           ctas * QUERY_Y);
}

cudaError_t dsv4__indexer_mma_launch(const idx_params_t &p, dim3 grid, cudaStream_t s, int pdl,
                                     int fast) {
  static void (*const kernels[2])(idx_params_t) = {dsv4__indexer_score_mma_kernel<false>,
                                                   dsv4__indexer_score_mma_kernel<true>};
  static std::atomic<uint64_t> limit_raised[2] = {{0}, {0}};
  return score_kernel_launch(kernels, limit_raised, sizeof(mma_smem_t), SEL_THREADS, p, grid, s,
                             pdl, fast);
}
