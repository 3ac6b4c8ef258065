/*
 * Attention after the insert, exact mode (SPEC §7), computing exactly the CPU reference's bytes:
 * for each query token and head, the canonical dot product with every candidate of the window
 * max(p0, p - 127)..p, one scale product, the maximum, dsv4_expf weights, the sums S and D (the
 * sink added last), the fma chains N in candidate order, o = N / D, the inverse RoPE at p, one
 * bf16 rounding, and lse = m + dsv4_logf(S).
 *
 * Every operation that decides a bit is the one SPEC §7 names, in its order; the mapping below only
 * chooses which thread performs it. The work is fp32 FMA (2 x 512 per head and candidate: the dot
 * product and the accumulation), so the mapping is built to keep the FMA pipes busy: the window's
 * records are dequantised once per CTA into shared memory and reused by every head of the CTA, a
 * warp holds eight heads' queries in registers, and a lane owns one canonical 16-dim partial.
 */
#include "attention-split.h"
#include "attention-union.cuh"
#include "phase-probe.cuh"

/* The window kernel's phases for the probe build (phase-probe.cuh). */
enum { XPH_WAIT, XPH_SETUP, XPH_STAGE, XPH_LOGITS, XPH_WEIGHTS, XPH_CHAINS, XPH_STORES };

/*
 * Pass 1, the logits of the warp's octet (SPEC §2's dot product, then one scale product). Lane l
 * holds dims 16l..16l+15 of the eight queries (128 registers) and, per candidate, the same dims of
 * the record: it computes the canonical partial l of each (head, candidate) as a 16-long fma chain
 * from +0. A step takes four candidates: 32 values, whose 32 partials are transposed through the
 * warp's buffer (lane l writes row l; lane j reads column j, value j = head j / 4, candidate
 * j % 4) and folded by dsv4_fold32, the canonical fold. The R warps of an octet take every R-th
 * step. Logits go to sl[candidate][head].
 */
template <int R>
static __device__ void attn_logits(const uint8_t *sk, float *sl, float *tb,
                                   const uint4 (&qraw)[OCT][2], uint32_t n, uint32_t oct,
                                   uint32_t r, uint32_t lane) {
  constexpr int LS = 64 / R + 4;
  float q[OCT][16];
#pragma unroll
  for (int hh = 0; hh < OCT; hh++) {
    unpack8(qraw[hh][0], q[hh]);
    unpack8(qraw[hh][1], q[hh] + 8);
  }
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  const uint32_t steps = (n + QUAD - 1) / QUAD;
  for (uint32_t st = r; st < steps; st += R) {
    float acc[OCT][QUAD];
#pragma unroll
    for (int cc = 0; cc < QUAD; cc++) {
      /* Past the window's end a step reads its last candidate again; those values are dropped. */
      const uint32_t s = min(st * QUAD + cc, n - 1);
      const uint8_t *row = sk + (size_t)s * K_ROW + 16 * lane;
      float k[16];
      unpack8(*reinterpret_cast<const uint4 *>(row), k);
      unpack8(*reinterpret_cast<const uint4 *>(row + 512), k + 8);
#pragma unroll
      for (int hh = 0; hh < OCT; hh++) {
        float a = 0.0f;
#pragma unroll
        for (int d = 0; d < 16; d++)
          a = __fmaf_rn(q[hh][d], k[d], a);
        acc[hh][cc] = a;
      }
    }
    float4 *mine = reinterpret_cast<float4 *>(tb + lane * T_STRIDE);
#pragma unroll
    for (int hh = 0; hh < OCT; hh++)
      mine[hh] = make_float4(acc[hh][0], acc[hh][1], acc[hh][2], acc[hh][3]);
    __syncwarp();
    float part[32];
#pragma unroll
    for (int i = 0; i < 32; i++)
      part[i] = tb[i * T_STRIDE + lane];
    const float dot = dsv4_fold32(part);
    const uint32_t s = st * QUAD + (lane & 3);
    if (s < n)
      sl[(size_t)s * LS + oct * OCT + (lane >> 2)] = __fmul_rn(dot, scale);
    __syncwarp(); /* the buffer is rewritten by the next step */
  }
}

/*
 * Each head's maximum and weights w = dsv4_expf(l - m), in place: warp w takes heads w, w + 8, ...;
 * lane j candidates j, j + 32, ... The maximum is exact in any order (and a +-0 tie leaves every
 * weight, D and lse unchanged), so the warp reduces it with shuffles.
 */
template <int HG>
static __device__ void attn_weights(float *sl, attn_misc_t &ms, uint32_t n, uint32_t warp,
                                    uint32_t lane) {
  constexpr int LS = HG + 4;
  for (uint32_t hl = warp; hl < HG; hl += ATTN_WARPS) {
    float v[DSV4_WINDOW / 32], m = -INFINITY;
#pragma unroll
    for (int k = 0; k < DSV4_WINDOW / 32; k++) {
      const uint32_t s = lane + 32 * k;
      v[k] = s < n ? sl[(size_t)s * LS + hl] : -INFINITY;
      m = fmaxf(m, v[k]);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
      m = fmaxf(m, __shfl_xor_sync(FULL, m, off));
#pragma unroll
    for (int k = 0; k < DSV4_WINDOW / 32; k++) {
      const uint32_t s = lane + 32 * k;
      if (s < n)
        sl[(size_t)s * LS + hl] = dsv4_expf(v[k] - m);
    }
    if (lane == 0)
      ms.m[hl] = m;
  }
}

/* One thread per head: S in candidate order from +0, D = S + w_sink, and lse = m + logf(S). */
template <int HG>
static __device__ void attn_sums(const attn_params_t &p, const float *sl, attn_misc_t &ms,
                                 uint32_t n, uint32_t t, uint32_t h_first, float sink) {
  constexpr int LS = HG + 4;
  const uint32_t hl = threadIdx.x;
  if (hl >= HG)
    return;
  float sum = 0.0f;
  /* Unrolled so that the loads of a run of weights are in flight together; the sum stays one
   * chain in candidate order. */
#pragma unroll 8
  for (uint32_t s = 0; s < n; s++)
    sum = sum + sl[(size_t)s * LS + hl];
  const float m = ms.m[hl];
  float den = sum;
  if (p.sink)
    den = den + dsv4_expf(sink - m);
  ms.d[hl] = den;
  if (p.lse && h_first + hl < p.heads)
    p.lse[(uint64_t)t * p.heads + h_first + hl] = m + dsv4_logf(sum);
}

/* DL bf16 values of a candidate's row at byte offset off (and, for DL = 16, off + 512). */
template <int DL>
static __device__ __forceinline__ void load_k(const uint8_t *row, uint32_t off, float (&k)[DL]) {
  if constexpr (DL == 16) {
    unpack8(*reinterpret_cast<const uint4 *>(row + off), k);
    unpack8(*reinterpret_cast<const uint4 *>(row + off + 512), k + 8);
  } else if constexpr (DL == 8) {
    unpack8(*reinterpret_cast<const uint4 *>(row + off), k);
  } else if constexpr (DL == 4) {
    const uint2 v = *reinterpret_cast<const uint2 *>(row + off);
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int j = 0; j < 2; j++) {
      k[2 * j] = __uint_as_float(w[j] << 16);
      k[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  } else {
    const uint32_t v = *reinterpret_cast<const uint32_t *>(row + off);
    k[0] = __uint_as_float(v << 16);
    k[1] = __uint_as_float(v & 0xffff0000u);
  }
}

/* DL bf16 values (already rounded, in pairs) to out: 16-byte stores where DL allows. */
template <int DL>
static __device__ __forceinline__ void store_out(uint4 *out, uint32_t d0,
                                                 const uint32_t (&w)[DL / 2]) {
  uint8_t *b = reinterpret_cast<uint8_t *>(out) + 2 * (size_t)d0;
  if constexpr (DL >= 8) {
#pragma unroll
    for (int j = 0; j < DL / 8; j++)
      reinterpret_cast<uint4 *>(b)[j] =
          make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
  } else if constexpr (DL == 4) {
    *reinterpret_cast<uint2 *>(b) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t *>(b) = w[0];
  }
}

/* The dims of the lane in pass 2: byte offset off of its values in a staged row, first dim d0. */
template <int R>
static __device__ __forceinline__ void out_lane(uint32_t r, uint32_t lane, uint32_t *off,
                                                uint32_t *d0) {
  constexpr int DL = 16 / R;
  if (R == 1) {
    *off = 16 * lane;
    *d0 = 16 * lane;
  } else {
    const uint32_t x = (r >> 1) * (1024 / R) + 2 * DL * lane;
    *off = (r & 1) * 512 + x;
    *d0 = 16 * (x >> 4) + 8 * (r & 1) + ((x & 15) >> 1);
  }
}

/* The chains N of the octet's eight heads continued over n staged candidates, in order. */
template <int R>
static __device__ __forceinline__ void attn_accumulate(const uint8_t *sk, const float *sl,
                                                       uint32_t n, uint32_t oct, uint32_t off,
                                                       float (&acc)[OCT][16 / R]) {
  constexpr int DL = 16 / R, LS = 64 / R + 4;
  for (uint32_t s = 0; s < n; s++) {
    const float4 *wv = reinterpret_cast<const float4 *>(sl + (size_t)s * LS + oct * OCT);
    const float4 wa = wv[0], wb = wv[1];
    const float w[OCT] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    float k[DL];
    load_k<DL>(sk + (size_t)s * K_ROW, off, k);
#pragma unroll
    for (int hh = 0; hh < OCT; hh++)
#pragma unroll
      for (int d = 0; d < DL; d++)
        acc[hh][d] = __fmaf_rn(w[hh], k[d], acc[hh][d]);
  }
}

/*
 * o = N / D, the inverse RoPE on dims 448..511 with the pair in the lane, one bf16 rounding (the
 * conversion instruction: dsv4_f32_to_bf16 for every value the kernel can produce, see
 * dsv4__bf16x2_rn), one store per value. One head a pass, whose values are always acc[0]: after
 * each pass the heads move down a row (register moves). Every warp runs this code once, so it is
 * kept one pass long: unrolled over the eight heads it waited on instruction fetches for about a
 * fifth of the kernel's time (ncu, b = 128).
 */
template <int R>
static __device__ __forceinline__ void attn_store(const attn_params_t &p, const attn_misc_t &ms,
                                                  uint32_t t, uint32_t h0, uint32_t oct,
                                                  uint32_t d0, float (&acc)[OCT][16 / R]) {
  constexpr int DL = 16 / R;
  const float *cs = ms.rope;
#pragma unroll 1
  for (uint32_t hh = 0; hh < OCT && h0 + hh < p.heads; hh++) {
    const float den = ms.d[oct * OCT + hh];
    float o[DL];
#pragma unroll
    for (int d = 0; d < DL; d++)
      o[d] = __fdiv_rn(acc[0][d], den);
    uint32_t wo[DL / 2];
#pragma unroll
    for (int j = 0; j < DL / 2; j++) {
      float e = o[2 * j], od = o[2 * j + 1];
      if (d0 >= DSV4_NOPE_DIM) {
        const uint32_t i = (d0 - DSV4_NOPE_DIM) / 2 + j;
        const float c = cs[i], sn = cs[DSV4_ROPE_PAIRS + i];
        const float ee = dsv4_rope_inv_even(e, od, c, sn);
        od = dsv4_rope_inv_odd(e, od, c, sn);
        e = ee;
      }
      wo[j] = dsv4__bf16x2_rn(e, od);
    }
    store_out<DL>(p.out + ((uint64_t)t * p.heads + h0 + hh) * 64, d0, wo);
#pragma unroll
    for (int k = 0; k + 1 < OCT; k++)
#pragma unroll
      for (int d = 0; d < DL; d++)
        acc[k][d] = acc[k + 1][d];
  }
}

/*
 * Pass 2 and the output. The R warps of an octet split the 512 dims: a lane owns DL = 16 / R
 * consecutive dims of the eight heads (8 DL accumulators) and runs N[d] = fmaf(w_s, k_s[d], N[d])
 * over the candidates in order from +0, reading the eight weights of a candidate with two
 * broadcast loads. Dims from shared memory: with R = 1 lane l reads pieces 2l and 2l + 1 (dims
 * 16l..16l+15); otherwise warp r reads a contiguous run of 1024 / R bytes of half r & 1 of the row,
 * lane l the DL dims at byte x = (r >> 1) * 1024 / R + 2 DL l of it, which are dims
 * 16 (x / 16) + 8 (r & 1) + (x % 16) / 2 onwards (the staging layout). Then attn_store.
 */
template <int R>
static __device__ void attn_output(const attn_params_t &p, const uint8_t *sk, const float *sl,
                                   const attn_misc_t &ms, uint32_t n, uint32_t t, uint32_t h0,
                                   uint32_t oct, uint32_t r, uint32_t lane) {
  constexpr int DL = 16 / R;
  uint32_t off, d0;
  out_lane<R>(r, lane, &off, &d0);
  float acc[OCT][DL];
#pragma unroll
  for (int hh = 0; hh < OCT; hh++)
#pragma unroll
    for (int d = 0; d < DL; d++)
      acc[hh][d] = 0.0f;
  attn_accumulate<R>(sk, sl, n, oct, off, acc);
#ifdef DSV4_PHASE_PROBE
  if (p.heads % 64 == 0) { /* every warp is live: the chains and the stores apart */
    __syncthreads();
    PHASE_MARK(XPH_CHAINS);
  }
#endif
  attn_store<R>(p, ms, t, h0, oct, d0, acc);
}

/*
 * Thread mapping (FlashMLA style). One CTA of 256 threads (8 warps) per (query token, group of
 * HG = 64 / R heads); R in {1, 2, 4, 8} is chosen per launch so that the grid fills the device
 * (dsv4__cuda_attention_heads_per_block). Warp w owns octet w / R of the group (8 heads) together
 * with the other R - 1 warps of that octet, as their (w % R)-th member.
 *
 *   stage    all threads: the window's records (up to 128 x 584 bytes; their lines prefetched
 *            into the L2 while the launch's check runs) -> bf16 in shared memory, 128 KiB, read
 *            once from the cache and reused by every head of the CTA
 *   logits   warp: its octet's queries in registers (lane = one canonical 16-dim partial), every
 *            R-th step of 4 candidates; the 32 partials of a (head, candidate) meet in one lane
 *            through a transposition buffer and are folded in the canonical order
 *   weights  warp per head: maximum (shuffles), w = dsv4_expf(l - m) in place
 *   sums     thread per head: S and D in candidate order, lse
 *   output   warp: its octet's 8 heads x 512 / R dims, N accumulated over the candidates in order,
 *            o = N / D, inverse RoPE, bf16, one store per value
 *
 * Shared memory: 128 KiB of window, (HG + 4) x 128 logits, 8 x 4.5 KiB of transposition buffers,
 * about 198 KiB at HG = 64: one CTA per SM, whose 8 warps each have 32 independent fma chains in
 * flight in both passes.
 *
 * Ordering (SPEC §5.2): before griddepcontrol.wait a CTA reads only its parameters and the sinks
 * (immutable for the backend's lifetime); every CTA executes the wait before anything else, and
 * returns early only after it. A launch whose check finds a bad token (every CTA checks every
 * token when the launch has at most CHECK_ALL_MAX of them, else the check kernel did before)
 * writes nothing.
 */
template <int R>
__global__ void __launch_bounds__(ATTN_THREADS, 1) dsv4__attention_kernel(attn_params_t p) {
  constexpr int HG = 64 / R;
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  float *sl = reinterpret_cast<float *>(sk + (size_t)DSV4_WINDOW * K_ROW);
  float *tbuf = sl + (size_t)DSV4_WINDOW * (HG + 4);
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t t = blockIdx.x / p.groups;
  const uint32_t h_first = (blockIdx.x - t * p.groups) * HG;
  const uint32_t oct = warp / R, r = warp % R, h0 = h_first + oct * OCT;
  PHASE_START();
  /* Before the wait: the sink of one head per thread, immutable data. */
  float sink = 0.0f;
  if (p.sink && tid < HG && h_first + tid < p.heads)
    sink = p.sink[h_first + tid];
  uint4 qraw[OCT][2];
#ifdef DSV4_TEST_BROKEN_ATTN_EARLY_READ
  /* Test-only breakage of SPEC §5.2 (tests/gpu/gpu_inv_attn_wait.c): the queries are loaded before
   * the wait, while the grid before this one may still be writing q_out. */
  load_q(p, t, h0, lane, qraw);
#endif
#ifdef DSV4_TEST_BROKEN_FUSED_EARLY_READ
  /* Test-only breakage of SPEC §5.2 on the fused decode path (tests/gpu/gpu_inv_attn_wait.c,
   * "fused"): the raw queries are loaded before the wait, while the grid before this one may still
   * be writing them. */
  if (p.q_raw)
    load_q(p, t, h0, lane, qraw);
#endif
  dsv4__dep_wait_params(p);
  PHASE_MARK(XPH_WAIT);
  dsv4__dep_trigger();
  const win_first_t wf = attn_window_first(p, t); /* ahead of q's loads */
#ifndef DSV4_TEST_BROKEN_ATTN_EARLY_READ
#ifdef DSV4_TEST_BROKEN_FUSED_EARLY_READ
  if (!p.q_raw)
#endif
    load_q(p, t, h0, lane, qraw); /* in flight during the setup and the staging */
#endif
  /* The records' addresses and L2 prefetches as soon as the window's blocks are known (reading
   * them needs no more than that they lie in the pool); the launch's check runs under them. */
  const uint32_t bits = attn_window(p, t, ms, wf);
  if (!__syncthreads_or(bits != 0))
    attn_addrs(p, ms);
  if (attn_check(p, bits))
    return;
  PHASE_MARK(XPH_SETUP);
  stage_records(ms.n, sk, ms);
  __syncthreads();
  PHASE_MARK(XPH_STAGE);
  const uint32_t n = ms.n;
  const bool live = h0 < p.heads; /* warp-uniform: an octet past the last head idles */
  if (live) {
    norm_q(p, h0, lane, ms.rope, qraw); /* the fused decode path's q, after the staging */
    attn_logits<R>(sk, sl, tbuf + warp * 32 * T_STRIDE, qraw, n, oct, r, lane);
  }
  __syncthreads();
  PHASE_MARK(XPH_LOGITS);
  attn_weights<HG>(sl, ms, n, warp, lane);
  __syncthreads();
  attn_sums<HG>(p, sl, ms, n, t, h_first, sink);
  __syncthreads();
  PHASE_MARK(XPH_WEIGHTS);
  if (live)
    attn_output<R>(p, sk, sl, ms, n, t, h0, oct, r, lane);
  PHASE_END(XPH_STORES);
}

/* ---- the union of the window and the compressed entries (SPEC §8.6) ---- */

/* One tile of the list into shared memory, and the logits of its candidates: the window kernel's
 * staging and pass 1 over candidates first..first + nt - 1. */
template <int R>
static __device__ void union_tile(const attn_params_t &p, uint32_t t, attn_misc_t &ms,
                                  union_misc_t &um, uint8_t *sk, float *sl, float *tb,
                                  uint32_t first, uint32_t nt, uint32_t h0, uint32_t oct,
                                  uint32_t r, uint32_t lane, bool live) {
  union_addrs(p, ms, um, first, nt);
  __syncthreads();
  stage_records(nt, sk, ms);
  __syncthreads();
  if (live) {
    uint4 qraw[OCT][2];
    load_q(p, t, h0, lane, qraw);
    norm_q(p, h0, lane, ms.rope, qraw);
    attn_logits<R>(sk, sl, tb, qraw, nt, oct, r, lane);
  }
  __syncthreads();
}

/* Each head's running maximum over the tile's logits (exact in any order). */
template <int HG>
static __device__ void union_tile_max(const float *sl, attn_misc_t &ms, uint32_t n, uint32_t warp,
                                      uint32_t lane) {
  constexpr int LS = HG + 4;
  for (uint32_t hl = warp; hl < HG; hl += ATTN_WARPS) {
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < DSV4_WINDOW / 32; k++) {
      const uint32_t s = lane + 32 * k;
      if (s < n)
        m = fmaxf(m, sl[(size_t)s * LS + hl]);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
      m = fmaxf(m, __shfl_xor_sync(FULL, m, off));
    if (lane == 0)
      ms.m[hl] = fmaxf(ms.m[hl], m);
  }
}

/* The tile's weights w = dsv4_expf(l - m) in place, with the maximum over the whole list. */
template <int HG>
static __device__ void union_tile_exp(float *sl, const attn_misc_t &ms, uint32_t n, uint32_t warp,
                                      uint32_t lane) {
  constexpr int LS = HG + 4;
  for (uint32_t hl = warp; hl < HG; hl += ATTN_WARPS) {
    const float m = ms.m[hl];
#pragma unroll
    for (int k = 0; k < DSV4_WINDOW / 32; k++) {
      const uint32_t s = lane + 32 * k;
      if (s < n)
        sl[(size_t)s * LS + hl] = dsv4_expf(sl[(size_t)s * LS + hl] - m);
    }
  }
}

/* One thread per head: S continued over the tile's weights in candidate order. */
template <int HG>
static __device__ void union_tile_sum(const float *sl, union_misc_t &um, uint32_t n) {
  constexpr int LS = HG + 4;
  const uint32_t hl = threadIdx.x;
  if (hl >= HG)
    return;
  float sum = um.s[hl];
#pragma unroll 8
  for (uint32_t s = 0; s < n; s++)
    sum = sum + sl[(size_t)s * LS + hl];
  um.s[hl] = sum;
}

/* One thread per head: D = S + w_sink, and lse = m + logf(S). */
template <int HG>
static __device__ void union_finish_sums(const attn_params_t &p, attn_misc_t &ms,
                                         const union_misc_t &um, uint32_t t, uint32_t h_first,
                                         float sink) {
  const uint32_t hl = threadIdx.x;
  if (hl >= HG)
    return;
  const float m = ms.m[hl], sum = um.s[hl];
  float den = sum;
  if (p.sink)
    den = den + dsv4_expf(sink - m);
  ms.d[hl] = den;
  if (p.lse && h_first + hl < p.heads)
    p.lse[(uint64_t)t * p.heads + h_first + hl] = m + dsv4_logf(sum);
}

/*
 * Attention over the union (SPEC §8.6): the window max(p0, p - 127)..p, then the token's compressed
 * entries (all visible ones, or its selection), one list. The list passes through shared memory in
 * tiles of DSV4_WINDOW candidates, twice: pass 1 stages every tile (from the last, so that the
 * first is still staged when pass 2 begins) and computes its logits for the maximum over the whole
 * list; pass 2 stages each tile again, recomputes its logits (the same operations, so the same
 * bits), turns them into weights with the final maximum, continues each head's sum S in candidate
 * order and the chains N in registers, candidate by candidate. Then D, lse and the output as in the
 * window kernel: one max, one denominator with the sink, one fma chain over the window then the
 * entries, as the CPU reference computes them.
 *
 * The same CTA shape as the window kernel, with R of 4 or 8 only: the chains N (8 x 16 / R floats
 * per lane) stay in registers across the tiles, beside the queries of pass 1. The queries are
 * loaded again for each tile. Ordering (SPEC §5.2) as the window kernel; the check kernel runs
 * first (or every CTA checks a small launch itself: dsv4__cuda_union_checks_all) and every CTA
 * reads its error word after the wait.
 */
template <int R>
__global__ void __launch_bounds__(ATTN_THREADS, 1) dsv4__attention_union_kernel(attn_params_t p) {
  constexpr int HG = 64 / R, DL = 16 / R;
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ union_misc_t um;
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  float *sl = reinterpret_cast<float *>(sk + (size_t)DSV4_WINDOW * K_ROW);
  float *tbuf = sl + (size_t)DSV4_WINDOW * (HG + 4);
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t t = blockIdx.x / p.groups;
  const uint32_t h_first = (blockIdx.x - t * p.groups) * HG;
  const uint32_t oct = warp / R, r = warp % R, h0 = h_first + oct * OCT;
  /* Before the wait: the sink of one head per thread, immutable data. */
  float sink = 0.0f;
  if (p.sink && tid < HG && h_first + tid < p.heads)
    sink = p.sink[h_first + tid];
#ifdef DSV4_TEST_BROKEN_UNION_EARLY_READ
  union_early_count(p, t, um);
#endif
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  if (union_setup(p, t, ms, um))
    return;
  const uint32_t nc = um.nc, tiles = (nc + DSV4_WINDOW - 1) / DSV4_WINDOW;
  const bool live = h0 < p.heads; /* warp-uniform: an octet past the last head idles */
  float *tb = tbuf + warp * 32 * T_STRIDE;
  for (uint32_t k = tiles; k-- > 0;) {
    const uint32_t first = k * DSV4_WINDOW, nt = min(nc - first, (uint32_t)DSV4_WINDOW);
    union_tile<R>(p, t, ms, um, sk, sl, tb, first, nt, h0, oct, r, lane, live);
    union_tile_max<HG>(sl, ms, nt, warp, lane);
    __syncthreads();
  }
  uint32_t off, d0;
  out_lane<R>(r, lane, &off, &d0);
  float acc[OCT][DL];
#pragma unroll
  for (int hh = 0; hh < OCT; hh++)
#pragma unroll
    for (int d = 0; d < DL; d++)
      acc[hh][d] = 0.0f;
  for (uint32_t k = 0; k < tiles; k++) {
    const uint32_t first = k * DSV4_WINDOW, nt = min(nc - first, (uint32_t)DSV4_WINDOW);
    if (k)
      union_tile<R>(p, t, ms, um, sk, sl, tb, first, nt, h0, oct, r, lane, live);
    union_tile_exp<HG>(sl, ms, nt, warp, lane);
    __syncthreads();
    union_tile_sum<HG>(sl, um, nt);
    if (live)
      attn_accumulate<R>(sk, sl, nt, oct, off, acc);
    __syncthreads();
  }
  union_finish_sums<HG>(p, ms, um, t, h_first, sink);
  __syncthreads();
  if (live)
    attn_store<R>(p, ms, t, h0, oct, d0, acc);
}

/* The launch check of a window launch of more than CHECK_ALL_MAX tokens: a warp per token. */
__global__ void __launch_bounds__(256) dsv4__attention_check_kernel(attn_params_t p) {
  /* The attention kernel may launch now; it still waits for this grid to complete. */
  dsv4__dep_trigger();
  dsv4__dep_wait_params(p);
  const uint32_t t = (blockIdx.x * 256 + threadIdx.x) / 32;
  if (t >= p.n_tokens) /* warp-uniform */
    return;
  window_t w;
  const uint32_t bits = token_check(p, t, &w);
  if (bits)
    atomicOr(p.err, bits);
}

/* The launch check of a launch with compressed entries too large for its CTAs to check: a
 * CTA per token, whose warps take the parts of its check side by side (union_check_part: a decode
 * token's selection of 512 is 16 parts), and a thread per segment. */
__global__ void __launch_bounds__(256) dsv4__attention_union_check_kernel(attn_params_t p) {
  __shared__ union_tok_check_t r;
  dsv4__dep_trigger();
  dsv4__dep_wait_params(p);
  const uint32_t tid = threadIdx.x, t = blockIdx.x, i = blockIdx.x * 256 + tid;
  if (tid == 0) {
    r.ev = NO_EVENT;
    r.wb = 0;
  }
  __syncthreads();
  uint32_t bits = i < p.n_segments ? segment_check(p, i) : 0u;
  if (t < p.n_tokens)
    for (uint32_t c = tid >> 5; c < entries_parts(p); c += 256 / 32) /* warp-uniform */
      union_check_part(p, t, c, tid & 31, r);
  __syncthreads();
  if (tid == 0 && t < p.n_tokens)
    bits |= union_check_bits(r);
  if (bits)
    atomicOr(p.err, bits);
}

#ifdef DSV4_PHASE_PROBE
extern "C" long long dsv4__cuda_attention_phases(double cycles[7]) {
  static_assert(XPH_STORES < DSV4_PHASE_SLOTS - 1, "a slot a phase");
  return dsv4__phase_take(cycles);
}
#endif

/* ---- the launch ---- */

/* The arguments the host can see (backend.h); the contents of device arrays are the kernels'. */
static int check_args(const dsv4_attn_args_t *a) {
  if (!a || a->heads < 1 || a->heads > DSV4_MAX_HEADS)
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->q || !a->positions || !a->tok_seg || !a->seg_p0 || !a->seg_first_lb || !a->seg_bt_off ||
      !a->seg_bt_len || !a->block_table || !a->cache || !a->out || a->n_segments == 0 ||
      a->n_blocks == 0)
    return DSV4_EINVAL;
  if (!DSV4_BLOCK_SIZE_VALID(a->block_size) || a->stride != DSV4_BLOCK_STRIDE(a->block_size))
    return DSV4_EINVAL;
  if (((uintptr_t)a->q | (uintptr_t)a->out | (uintptr_t)a->cache | (uintptr_t)a->win) & 15u)
    return DSV4_EINVAL;
  /* The compressed entries (SPEC §8.6), as dsv4_backend_check_attn_args has them. */
  if (!a->c_cache)
    return a->c_sel ? DSV4_EINVAL : 0;
  if ((a->ratio != 4 && a->ratio != 128) || !a->seg_c_first_lb || !a->seg_cbt_off ||
      !a->seg_cbt_len || !a->c_block_table || a->c_n_blocks == 0 ||
      (a->c_sel && a->c_sel_stride == 0) || ((uintptr_t)a->c_cache & 15u))
    return DSV4_EINVAL;
  return 0;
}

/*
 * R (warps per octet) for a launch: the fewest rounds of the busiest SM (one CTA per SM at a
 * time), a round as long as one CTA. A CTA's time is the work of one of its warps (8 heads over
 * 1 / R of the window, in quarters of one head over the whole window: 32 / R) times the warps
 * each of the 4 schedulers runs (a CTA of few live heads has idle warps), plus about 3 quarters of
 * staging. Ties go to larger groups: fewer CTAs stage the same window.
 */
static int choose_r(uint32_t n_tokens, uint32_t heads, int sms, int min_r) {
  const uint64_t heads8 = ((uint64_t)heads + 7) / 8 * 8;
  uint64_t best = UINT64_MAX;
  int best_r = min_r;
  for (int r = min_r; r <= 8; r *= 2) {
    const uint64_t hg = 64 / r, groups = (heads + hg - 1) / hg;
    const uint64_t waves = ((uint64_t)n_tokens * groups + sms - 1) / sms;
    const uint64_t warps = (hg < heads8 ? hg : heads8) / 8 * r;
    const uint64_t cost = waves * ((32 / r) * ((warps + 3) / 4) + 3);
    if (cost < best) {
      best = cost;
      best_r = r;
    }
  }
  return best_r;
}

template <int R>
static cudaError_t launch_r(const attn_params_t &p, unsigned grid, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  const size_t smem = attn_smem_bytes(64 / R);
  cudaError_t e = dsv4__cuda_smem_limit(dsv4__attention_kernel<R>, smem, limit_raised);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(dsv4__attention_kernel<R>, grid, ATTN_THREADS, smem, s, pdl, p);
}

/* The union kernel of R warps per octet (its own shared-memory limit, raised once). */
template <int R>
static cudaError_t launch_union_r(const attn_params_t &p, unsigned grid, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  const size_t smem = attn_smem_bytes(64 / R);
  cudaError_t e = dsv4__cuda_smem_limit(dsv4__attention_union_kernel<R>, smem, limit_raised);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(dsv4__attention_union_kernel<R>, grid, ATTN_THREADS, smem, s, pdl,
                                p);
}

/* The check kernel of a launch, before its attention kernel: a warp per token of a window
 * launch; a CTA per token, and a thread per segment, of a launch with compressed entries. */
static cudaError_t launch_check(const attn_params_t &p, cudaStream_t s, int pdl) {
  if (!p.c_cache)
    return dsv4__cuda_launch(dsv4__attention_check_kernel,
                             (unsigned)(((uint64_t)p.n_tokens * 32 + 255) / 256), 256, s, pdl, p);
  const uint64_t seg_ctas = ((uint64_t)p.n_segments + 255) / 256;
  return dsv4__cuda_launch(dsv4__attention_union_check_kernel,
                           (unsigned)(p.n_tokens > seg_ctas ? p.n_tokens : seg_ctas), 256, s, pdl,
                           p);
}

/* A union launch (SPEC §8.6): the check kernel (unless the launch is small enough for every CTA
 * to check all of it, p.check_all), then the union kernel with R = 4 or 8, or in fast mode the fast
 * union kernel (attention_fast_union.cu), behind the same check. */
static cudaError_t launch_union(const attn_params_t &p, int r, int fast, int sms, cudaStream_t s,
                                int pdl) {
  cudaError_t e = p.check_all ? cudaSuccess : launch_check(p, s, pdl);
  if (e != cudaSuccess)
    return e;
  if (fast)
    return dsv4__attention_fast_union_launch(p, sms, s, pdl);
  const unsigned grid = p.n_tokens * p.groups;
  return r == 4 ? launch_union_r<4>(p, grid, s, pdl) : launch_union_r<8>(p, grid, s, pdl);
}

extern "C" uint32_t dsv4__cuda_attention_heads_per_block(uint32_t n_tokens, uint32_t heads) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  return 64u / (uint32_t)choose_r(n_tokens, heads ? heads : 1, dev.sms, 1);
}

extern "C" int dsv4__cuda_attention_supported(int dev) {
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return (size_t)optin >= attn_smem_bytes(64) + sizeof(attn_misc_t);
}

/* The splits of each token's list in a launch of a's shape on sms SMs: 1 for exact mode. */
static uint32_t launch_splits(const dsv4_attn_args_t *a, int sms) {
  if (!a->fast)
    return 1;
  return a->c_cache ? dsv4__attention_fast_union_splits(a->n_tokens, a->heads, sms)
                    : dsv4__attention_fast_splits(a->n_tokens, a->heads, sms);
}

extern "C" uint64_t dsv4__cuda_attention_part_floats(const dsv4_attn_args_t *a) {
  dsv4__cuda_dev_t dev;
  if (!a || dsv4__cuda_dev_info(&dev))
    return 0;
  return dsv4__union_part_floats(a->n_tokens, a->heads, launch_splits(a, dev.sms));
}

/* The partial states of a fast launch that splits (attention-split.h): part_len floats at
 * part_dev (16-byte aligned), at least what the launch's splits write. */
static int check_part(const dsv4_attn_args_t *a, const float *part_dev, uint64_t part_len,
                      int sms) {
  const uint64_t need = dsv4__union_part_floats(a->n_tokens, a->heads, launch_splits(a, sms));
  if (need && (!part_dev || part_len < need || ((uintptr_t)part_dev & 15u)))
    return DSV4_EINVAL;
  return 0;
}

extern "C" int dsv4__cuda_attention(const dsv4_attn_args_t *a, const float *rope_rows_dev,
                                    int64_t max_positions, float *part_dev, uint64_t part_len,
                                    uint32_t *err_dev, cudaStream_t s, int pdl) {
  int rc = check_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  if (!rope_rows_dev || max_positions <= 0 || !err_dev || ((uintptr_t)rope_rows_dev & 15u))
    return DSV4_EINVAL;
  dsv4__cuda_dev_t dev;
  int err = dsv4__cuda_dev_info(&dev);
  if (!err && a->fast && !dev.pdl) /* tensor-core fast mode: sm_90 and newer */
    err = DSV4_EUNSUPPORTED;
  if (!err)
    err = check_part(a, part_dev, part_len, dev.sms);
  if (err)
    return err;
  /* A union launch keeps its chains N in registers across tiles: 4 or 8 warps per octet. */
  const int r = choose_r(a->n_tokens, a->heads, dev.sms, a->c_cache ? 4 : 1);
  attn_params_t p = {};
  p.q = reinterpret_cast<const uint4 *>(a->q);
  p.pos = a->positions;
  p.tok_seg = a->tok_seg;
  p.seg_p0 = a->seg_p0;
  p.seg_first_lb = a->seg_first_lb;
  p.seg_bt_off = a->seg_bt_off;
  p.seg_bt_len = a->seg_bt_len;
  p.bt = a->block_table;
  /* The engine's windows (backend.h), for the window kernels: a union launch walks its tables. */
  p.win = a->c_cache ? nullptr : reinterpret_cast<const uint4 *>(a->win);
  p.cache = a->cache;
  p.sink = a->sink;
  p.rope = reinterpret_cast<const float4 *>(rope_rows_dev);
  p.out = reinterpret_cast<uint4 *>(a->out);
  p.lse = a->lse;
  p.err = err_dev;
  p.stride = a->stride;
  p.max_pos = max_positions;
  p.n_tokens = a->n_tokens;
  p.n_segments = a->n_segments;
  p.heads = a->heads;
  p.groups = (a->heads + (64u / r) - 1) / (64u / r);
  p.bt_entries = a->bt_entries;
  p.n_blocks = a->n_blocks;
  while ((1u << p.bs_shift) < a->block_size)
    p.bs_shift++;
  p.check_all = a->c_cache
                    ? dsv4__cuda_union_checks_all(a->n_tokens, a->c_sel ? a->c_sel_stride : 0)
                    : a->n_tokens <= CHECK_ALL_MAX;
  p.c_cache = a->c_cache;
  p.seg_c_first_lb = a->seg_c_first_lb;
  p.seg_cbt_off = a->seg_cbt_off;
  p.seg_cbt_len = a->seg_cbt_len;
  p.c_bt = a->c_block_table;
  p.c_sel = a->c_sel;
  p.c_sel_stride = a->c_sel_stride;
  p.c_bt_entries = a->c_bt_entries;
  p.c_n_blocks = a->c_n_blocks;
  p.ratio = a->ratio;
  p.q_raw = a->q_raw ? 1u : 0u;
  p.eps = a->eps;
  p.part = part_dev;
  const uint64_t grid = (uint64_t)a->n_tokens * p.groups;
  if (grid > 0x7fffffffu)
    return DSV4_EINVAL;
  pdl = pdl && dev.pdl;
  if (a->c_cache)
    return dsv4__cuda_err(launch_union(p, r, a->fast, dev.sms, s, pdl));
  cudaError_t e = cudaSuccess;
  if (!p.check_all)
    e = launch_check(p, s, pdl);
  if (e == cudaSuccess && a->fast)
    return dsv4__cuda_err(dsv4__attention_fast_launch(p, dev.sms, s, pdl));
  if (e == cudaSuccess) {
    switch (r) {
    case 1:
      e = launch_r<1>(p, (unsigned)grid, s, pdl);
      break;
    case 2:
      e = launch_r<2>(p, (unsigned)grid, s, pdl);
      break;
    case 4:
      e = launch_r<4>(p, (unsigned)grid, s, pdl);
      break;
    default:
      e = launch_r<8>(p, (unsigned)grid, s, pdl);
      break;
    }
  }
  return dsv4__cuda_err(e);
}
