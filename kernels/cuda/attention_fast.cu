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
#include "attention-fast.cuh"

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
      fm.den[h] = fast_den(p, sum, m, fm.sink[h]);
      if (p.lse && h_first + h < p.heads)
        p.lse[(uint64_t)t * p.heads + h_first + h] = fast_lse(m, sum);
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
  const uint32_t kcs = ((n + 15) / 16) * 2;
#pragma unroll 1
  for (int ch = 0; ch < CHUNKS; ch++) {
    const uint32_t d0 = dw0 + ch * 8 * NT;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
      acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    fast_pv<NT>(pa, pla, ka, mt, d0, kcs, lane, acc);
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
  return 16u * (uint32_t)choose_mt(n_tokens, heads ? heads : 1, dev.sms, 4);
}

cudaError_t dsv4__attention_fast_launch(attn_params_t p, int sms, cudaStream_t s, int pdl) {
  const int mt = choose_mt(p.n_tokens, p.heads, sms, 4);
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
