/*
 * Attention after the insert, fast mode (SPEC §7): the window's scores and the weighted sum on the
 * tensor cores, within FlashMLA's tolerances of exact mode and deterministic from run to run (every
 * sum has one fixed order: the MMA's, then fixed shuffle trees).
 *
 * What is rounded, and where exact mode differs:
 *   - q (bf16 q_out) and the records dequantised to bf16 are exact (e4m3 times a power of two fits
 *     bf16), so the scores are fp32 sums of exact products, in the MMA's order;
 *   - the weights w = exp(l - m) are fp32 (the sums S and D, and lse, use them unrounded) and
 *     enter the products with the records as a bf16 pair hi + lo (hi = bf16(w), lo = bf16(w - hi)):
 *     about 16 significant bits, so that the bf16 output differs from exact mode by about its own
 *     rounding, where FlashMLA's single bf16 weight costs about 2^-9 relative per weight;
 *   - o = N (1 / D), then the inverse RoPE and the bf16 rounding as in exact mode.
 *
 * A CTA of 8 warps takes one query token and 16 MT heads (MT = 1, 2 or 4 m-tiles of 16 heads):
 *   stage   the window's records as bf16 in shared memory (swizzled for ldmatrix), q beside them
 *   scores  warp w: m-tile w % MT, candidates (w / MT) 16 MT.. of the 128, mma m16n8k16 over 512
 *   softmax warp w: heads w, w + 8, ...: max, w, S, D (with the sink), lse, the weights as bf16
 *   output  warp w: m-tile w % MT, dims (w / MT) 64 MT.., mma over the candidates, then o = N / D,
 *           inverse RoPE, bf16, stored
 * Ordering (SPEC §5.2) as the exact kernel: nothing but the parameters and the sinks is read before
 * griddepcontrol.wait; a launch whose check finds a bad token writes nothing.
 */
#include "attention-common.cuh"

/* Bytes of one row of weights (128 bf16) in shared memory. */
#define P_ROW 256
/* Floats per row of scores: 128 candidates and a pad that spreads the rows over the banks. */
#define S_STRIDE 132

/* The byte offset of 16-byte chunk c of row r in rows of `row` bytes, swizzled (c ^ (r & 7)). */
static __device__ __forceinline__ uint32_t swz(uint32_t r, uint32_t c, uint32_t row) {
  return r * row + ((c ^ (r & 7)) << 4);
}

static __device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

static __device__ __forceinline__ void ldsm4_t(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* lo and hi rounded to bf16 (to nearest even) and packed, lo in the low half: one instruction. */
static __device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

/* d += a b for a 16 x 16 bf16 tile a (row-major fragments) and a 16 x 8 tile (b0, b1). */
static __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Shared memory of a CTA of MT m-tiles: the window (bf16, 128 rows of 1 KiB), then q (16 MT rows
 * of 1 KiB), whose space the scores and the weights (hi and lo) take once the scores are made. */
static constexpr size_t fast_q_bytes(int mt) {
  return (size_t)16 * mt * K_ROW > (size_t)16 * mt * (S_STRIDE * 4 + 2 * P_ROW)
             ? (size_t)16 * mt * K_ROW
             : (size_t)16 * mt * (S_STRIDE * 4 + 2 * P_ROW);
}
static constexpr size_t fast_smem_bytes(int mt) {
  return (size_t)DSV4_WINDOW * K_ROW + fast_q_bytes(mt);
}

/* Per-CTA facts beyond attn_misc_t: each head's sink, and its denominator D from the softmax. */
typedef struct {
  float sink[64];
  float den[64];
} fast_misc_t;

/*
 * The fused decode path's queries (p.q_raw): warp w takes rows w, w + 8, ... of the raw q, all in
 * flight at once, and turns each into the bf16 values the insert would have written (q-norm.cuh,
 * the run layout: lane l holds chunks 2l and 2l + 1), placed as fast_load_q places q_out.
 */
template <int MT>
static __device__ void fast_load_q_raw(const attn_params_t &p, uint32_t t, uint32_t h_first,
                                       uint8_t *sq, const float *rope) {
  constexpr int RW = 16 * MT / ATTN_WARPS;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4 v[RW][2];
#pragma unroll
  for (int i = 0; i < RW; i++) {
    const uint32_t h = warp + ATTN_WARPS * i;
    v[i][0] = v[i][1] = make_uint4(0, 0, 0, 0);
    if (h_first + h < p.heads) {
      const uint4 *row = p.q + ((uint64_t)t * p.heads + h_first + h) * 64;
      v[i][0] = row[2 * lane];
      v[i][1] = row[2 * lane + 1];
    }
  }
#pragma unroll
  for (int i = 0; i < RW; i++) {
    const uint32_t h = warp + ATTN_WARPS * i;
    if (h_first + h < p.heads) /* warp-uniform */
      qn_row_run(lane, rope, p.eps, v[i][0], v[i][1]);
    *reinterpret_cast<uint4 *>(sq + swz(h, 2 * lane, K_ROW)) = v[i][0];
    *reinterpret_cast<uint4 *>(sq + swz(h, 2 * lane + 1, K_ROW)) = v[i][1];
  }
}

/* The queries of heads h_first.. (zeros past the last head), swizzled like the records; rope: the
 * query position's RoPE row, for the fused decode path. */
template <int MT>
static __device__ void fast_load_q(const attn_params_t &p, uint32_t t, uint32_t h_first,
                                   uint8_t *sq, const float *rope) {
  if (p.q_raw) {
    fast_load_q_raw<MT>(p, t, h_first, sq, rope);
    return;
  }
  for (uint32_t i = threadIdx.x; i < 16 * MT * 64; i += ATTN_THREADS) {
    const uint32_t h = i >> 6, c = i & 63;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (h_first + h < p.heads)
      v = p.q[((uint64_t)t * p.heads + h_first + h) * 64 + c];
    *reinterpret_cast<uint4 *>(sq + swz(h, c, K_ROW)) = v;
  }
}

/* Zeros in the rows n..n16 - 1 of the window (n16 = n rounded up to 16), which the weighted sum
 * multiplies by zero weights: staged memory left from before could hold NaN patterns. */
static __device__ void fast_zero_tail(uint8_t *sk, uint32_t n) {
  const uint32_t n16 = (n + 15) & ~15u;
  for (uint32_t i = threadIdx.x; i < (n16 - n) * 64; i += ATTN_THREADS)
    *reinterpret_cast<uint4 *>(sk + (size_t)(n + (i >> 6)) * K_ROW + ((i & 63) << 4)) =
        make_uint4(0, 0, 0, 0);
}

/* The scores of the warp's m-tile and its 16 MT candidates: 2 MT n-tiles of 8, over 512 dims. */
template <int MT>
static __device__ void fast_scores(const uint8_t *sq, const uint8_t *sk, uint32_t warp,
                                   uint32_t lane, float (&acc)[2 * MT][4]) {
  const uint32_t mt = warp % MT, c0 = (warp / MT) * 16 * MT;
  const uint32_t qa = smem_addr(sq), ka = smem_addr(sk);
  const uint32_t arow = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, acol = lane >> 4;
  const uint32_t brow = c0 + (lane & 7) + (lane >> 4) * 8, bcol = (lane >> 3) & 1;
#pragma unroll
  for (int j = 0; j < 2 * MT; j++)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    /* Each MMA sums its 16 products from zero and the partial joins the total in an fp32 add: the
     * MMA's accumulation truncates relative to its largest operand, so a running total fed back as
     * its accumulator would lose bits of every later partial (large logits felt it). */
#pragma unroll 4
  for (uint32_t kc = 0; kc < 64; kc += 2) {
    uint32_t a[4];
    ldsm4(qa + swz(arow, kc + acol, K_ROW), a);
#pragma unroll
    for (int np = 0; np < MT; np++) {
      uint32_t b[4];
      float part[2][4] = {};
      ldsm4(ka + swz(brow + 16 * np, kc + bcol, K_ROW), b);
      mma16816(part[0], a, b[0], b[1]);
      mma16816(part[1], a, b[2], b[3]);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        acc[2 * np][i] += part[0][i];
        acc[2 * np + 1][i] += part[1][i];
      }
    }
  }
}

/* The scaled scores into ss[head][candidate], -inf past the window's n candidates. */
template <int MT>
static __device__ void fast_store_scores(float *ss, uint32_t warp, uint32_t lane, uint32_t n,
                                         const float (&acc)[2 * MT][4]) {
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  const uint32_t mt = warp % MT, c0 = (warp / MT) * 16 * MT;
  const uint32_t h = mt * 16 + (lane >> 2);
#pragma unroll
  for (int j = 0; j < 2 * MT; j++) {
    const uint32_t s = c0 + 8 * j + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const uint32_t si = s + (i & 1), hi = h + (i >> 1) * 8;
      ss[hi * S_STRIDE + si] = si < n ? __fmul_rn(acc[j][i], scale) : -INFINITY;
    }
  }
}

/*
 * Warp per head: the maximum m, the weights w = exp(l - m) in fp32, S and D = S + exp(sink - m),
 * lse = m + log S, and the weights as bf16 pairs (hi, lo) into the two weight planes. The sums
 * run as fixed shuffle trees, the same on every run.
 */
template <int MT>
static __device__ void fast_softmax(const attn_params_t &p, const float *ss, uint8_t *sp,
                                    fast_misc_t &fm, uint32_t t, uint32_t h_first, uint32_t warp,
                                    uint32_t lane) {
  uint8_t *sp_lo = sp + 16 * MT * P_ROW;
  for (uint32_t h = warp; h < 16 * MT; h += ATTN_WARPS) {
    float v[4], m = -INFINITY;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      v[k] = ss[h * S_STRIDE + lane + 32 * k];
      m = fmaxf(m, v[k]);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
      m = fmaxf(m, __shfl_xor_sync(FULL, m, off));
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const float w = __expf(v[k] - m); /* exp(-inf) = +0 past the window */
      sum += w;
      const uint32_t hw = bf16x2(w, 0.0f);
      const uint16_t hi = (uint16_t)hw, lo = (uint16_t)bf16x2(w - __uint_as_float(hw << 16), 0.0f);
      const uint32_t s = lane + 32 * k, off = swz(h, s >> 3, P_ROW) + 2 * (s & 7);
      *reinterpret_cast<uint16_t *>(sp + off) = hi;
      *reinterpret_cast<uint16_t *>(sp_lo + off) = lo;
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
      sum += __shfl_xor_sync(FULL, sum, off);
    if (lane == 0) {
      fm.den[h] = p.sink ? sum + __expf(fm.sink[h] - m) : sum;
      if (p.lse && h_first + h < p.heads)
        p.lse[(uint64_t)t * p.heads + h_first + h] = m + logf(sum);
    }
  }
}

/* o = N (1 / D), the inverse RoPE on dims 448..511, bf16, stored: n-tile j of dims d0.. of the
 * warp's m-tile (a lane holds dims d, d + 1 of two heads, an even-odd pair of the RoPE part). */
template <int NT>
static __device__ void fast_store_out(const attn_params_t &p, const attn_misc_t &ms,
                                      const fast_misc_t &fm, uint32_t t, uint32_t h_first,
                                      uint32_t h, uint32_t d0, uint32_t lane,
                                      const float (&acc)[NT][4]) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const uint32_t hh = h + 8 * half;
    if (h_first + hh >= p.heads)
      continue;
    const float inv = 1.0f / fm.den[hh]; /* +inf (a sink of +inf) gives 0 */
    uint32_t *row =
        reinterpret_cast<uint32_t *>(p.out + ((uint64_t)t * p.heads + h_first + hh) * 64);
#pragma unroll
    for (int j = 0; j < NT; j++) {
      const uint32_t d = d0 + 8 * j + 2 * (lane & 3);
      float e = acc[j][2 * half] * inv, od = acc[j][2 * half + 1] * inv;
      if (d >= DSV4_NOPE_DIM) {
        const uint32_t i = (d - DSV4_NOPE_DIM) / 2;
        const float c = ms.rope[i], sn = ms.rope[DSV4_ROPE_PAIRS + i];
        const float ee = dsv4_rope_inv_even(e, od, c, sn);
        od = dsv4_rope_inv_odd(e, od, c, sn);
        e = ee;
      }
      row[d >> 1] = bf16x2(e, od);
    }
  }
}

/*
 * The weighted sums of the warp's m-tile over its 64 MT dims, in chunks of at most 128 dims (16
 * n-tiles of accumulators): N = P_hi V + P_lo V over the candidates 0..n16 - 1, then stored.
 */
template <int MT>
static __device__ void fast_output(const attn_params_t &p, const attn_misc_t &ms,
                                   const fast_misc_t &fm, const uint8_t *sp, const uint8_t *sk,
                                   uint32_t n, uint32_t t, uint32_t h_first, uint32_t warp,
                                   uint32_t lane) {
  constexpr int NT = 8 * MT < 16 ? 8 * MT : 16, CHUNKS = 8 * MT / NT;
  const uint32_t mt = warp % MT, dw0 = (warp / MT) * 64 * MT;
  const uint32_t pa = smem_addr(sp), pla = smem_addr(sp + 16 * MT * P_ROW), ka = smem_addr(sk);
  const uint32_t arow = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, acol = lane >> 4;
  const uint32_t brow = (lane & 7) + ((lane >> 3) & 1) * 8, bcol = lane >> 4;
  const uint32_t kcs = ((n + 15) / 16) * 2;
#pragma unroll 1
  for (int ch = 0; ch < CHUNKS; ch++) {
    const uint32_t d0 = dw0 + ch * 8 * NT;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
      acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (uint32_t kc = 0; kc < kcs; kc += 2) {
      uint32_t a[4], al[4];
      ldsm4(pa + swz(arow, kc + acol, P_ROW), a);
      ldsm4(pla + swz(arow, kc + acol, P_ROW), al);
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {
        uint32_t b[4];
        ldsm4_t(ka + swz(kc * 8 + brow, d0 / 8 + 2 * np + bcol, K_ROW), b);
        mma16816(acc[2 * np], a, b[0], b[1]);
        mma16816(acc[2 * np + 1], a, b[2], b[3]);
        mma16816(acc[2 * np], al, b[0], b[1]);
        mma16816(acc[2 * np + 1], al, b[2], b[3]);
      }
    }
    fast_store_out<NT>(p, ms, fm, t, h_first, mt * 16 + (lane >> 2), d0, lane, acc);
  }
}

template <int MT>
__global__ void __launch_bounds__(ATTN_THREADS, 1) dsv4__attention_fast_kernel(attn_params_t p) {
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ fast_misc_t fm;
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  uint8_t *sq = sk + (size_t)DSV4_WINDOW * K_ROW;
  float *ss = reinterpret_cast<float *>(sq);
  uint8_t *sp = sq + (size_t)16 * MT * S_STRIDE * 4;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t t = blockIdx.x / p.groups;
  const uint32_t h_first = (blockIdx.x - t * p.groups) * 16 * MT;
  /* Before the wait: the sinks, immutable data. */
  if (tid < 16 * MT)
    fm.sink[tid] = p.sink && h_first + tid < p.heads ? p.sink[h_first + tid] : 0.0f;
#ifdef DSV4_TEST_BROKEN_FAST_EARLY_READ
  /* Test-only breakage of SPEC §5.2 (tests/gpu/gpu_inv_attn_wait.c, "fast"): the queries are
   * loaded before the wait, while the grid before this one may still be writing q_out. */
  fast_load_q<MT>(p, t, h_first, sq, ms.rope);
#endif
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  if (attn_setup(p, t, ms))
    return;
#ifndef DSV4_TEST_BROKEN_FAST_EARLY_READ
  fast_load_q<MT>(p, t, h_first, sq, ms.rope);
#endif
  attn_stage<true>(p, ms, sk);
  const uint32_t n = ms.n;
  fast_zero_tail(sk, n);
  __syncthreads();
  {
    float acc[2 * MT][4];
    fast_scores<MT>(sq, sk, warp, lane, acc);
    __syncthreads(); /* every warp is done with q: its space takes the scores */
    fast_store_scores<MT>(ss, warp, lane, n, acc);
  }
  __syncthreads();
  fast_softmax<MT>(p, ss, sp, fm, t, h_first, warp, lane);
  __syncthreads();
  fast_output<MT>(p, ms, fm, sp, sk, n, t, h_first, warp, lane);
}

template <int MT>
static cudaError_t launch_fast_mt(const attn_params_t &p, unsigned grid, cudaStream_t s, int pdl) {
  static int ready = 0; /* the shared-memory limit, raised once per process */
  const size_t smem = fast_smem_bytes(MT);
  if (!ready) {
    cudaError_t e = cudaFuncSetAttribute(dsv4__attention_fast_kernel<MT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return e;
    }
    ready = 1;
  }
  return dsv4__cuda_launch_smem(dsv4__attention_fast_kernel<MT>, grid, ATTN_THREADS, smem, s, pdl,
                                p);
}

/*
 * MT for a launch: the fewest rounds of the busiest SM (one CTA per SM), a CTA costing about one
 * unit of staging plus one per m-tile; ties go to larger CTAs (fewer stagings of one window).
 */
static int choose_mt(uint32_t n_tokens, uint32_t heads, int sms) {
  uint64_t best = UINT64_MAX;
  int best_mt = 4;
  for (int mt = 4; mt >= 1; mt /= 2) {
    const uint64_t groups = (heads + 16u * mt - 1) / (16u * mt);
    const uint64_t waves = ((uint64_t)n_tokens * groups + sms - 1) / sms;
    const uint64_t cost = waves * (uint64_t)(mt + 1);
    if (cost < best) {
      best = cost;
      best_mt = mt;
    }
  }
  return best_mt;
}

extern "C" int dsv4__cuda_attention_fast_supported(int dev) {
  int optin = 0, major = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return major >= 9 &&
         (size_t)optin >= fast_smem_bytes(4) + sizeof(attn_misc_t) + sizeof(fast_misc_t);
}

extern "C" uint32_t dsv4__cuda_attention_fast_heads_per_block(uint32_t n_tokens, uint32_t heads) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  return 16u * (uint32_t)choose_mt(n_tokens, heads ? heads : 1, dev.sms);
}

cudaError_t dsv4__attention_fast_launch(attn_params_t p, int sms, cudaStream_t s, int pdl) {
  const int mt = choose_mt(p.n_tokens, p.heads, sms);
  p.groups = (p.heads + 16u * mt - 1) / (16u * mt);
  const uint64_t grid = (uint64_t)p.n_tokens * p.groups;
  if (grid > 0x7fffffffu)
    return cudaErrorInvalidValue;
  switch (mt) {
  case 1:
    return launch_fast_mt<1>(p, (unsigned)grid, s, pdl);
  case 2:
    return launch_fast_mt<2>(p, (unsigned)grid, s, pdl);
  default:
    return launch_fast_mt<4>(p, (unsigned)grid, s, pdl);
  }
}
