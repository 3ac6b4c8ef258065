/*
 * Fast mode over the union of the window and the compressed entries (SPEC §7, §8.6): the layers of
 * compress ratio 4 (the window, then the indexer's selection) and 128 (the window, then every
 * visible entry), on the tensor cores, within FlashMLA's tolerances of exact mode and deterministic
 * from run to run. The conventions are the window's fast kernel's (attention_fast.cu): bf16 q and
 * records (both exact), fp32 scores in the MMA's order, fp32 weights entering the weighted sum as a
 * bf16 pair hi + lo, the sink in the denominator only, lse without the sink, o = N (1 / D), the
 * inverse RoPE and one bf16 rounding.
 *
 * A token's list (the window max(p0, p - 127)..p, then its entries, in that order) passes through
 * shared memory in tiles of 128 candidates, once: the softmax is online, as FlashMLA's. Per tile
 * and head, with m the maximum so far (-inf before the first tile):
 *   m' = max(m, the tile's maximum), a = exp(m - m'), S = S a + sum of exp(l - m'),
 *   N = N a + the tile's weights times its records,
 * every sum in one fixed order (the MMA's, fixed shuffle trees, tile after tile), so a run gives
 * the same bytes as the one before. The first tile holds at least the query's own position, so m
 * is finite from the first tile on (a = 0 there, and N and S start from zero).
 *
 * A CTA of 8 warps takes one query token and 16 MT heads (MT = 1 or 2: the accumulators N of the
 * warp's 16 heads and 64 MT dims, 32 MT floats a lane, live across the tiles in registers):
 *   q        loaded once after the wait, swizzled, kept in shared memory for every tile
 *   per tile the addresses (union_addrs), the records staged as bf16 (swizzled), the scores (warp
 *            w: m-tile w % MT, candidates (w / MT) 16 MT..), the online softmax (warp per head),
 *            then N rescaled and continued (warp w: m-tile w % MT, dims (w / MT) 64 MT..)
 *   end      D = S + exp(sink - m), lse = m + log S, o = N (1 / D), inverse RoPE, bf16, stored
 * Shared memory: 128 KiB of records, 16 MT KiB of queries, the scores (16 MT rows of 132 floats)
 * and the two weight planes (16 MT rows of 256 bytes each): about 193 KiB at MT = 2.
 *
 * Ordering (SPEC §5.2) as the exact union kernel: before griddepcontrol.wait a CTA reads only its
 * parameters and the sinks; the check kernel (attention.cu) always runs first, and a CTA that
 * finds its error word set returns before writing anything.
 */
#include "attention-fast.cuh"
#include "attention-union.cuh"

static constexpr size_t funion_smem_bytes(int mt) {
  return (size_t)DSV4_WINDOW * K_ROW + (size_t)16 * mt * (K_ROW + S_STRIDE * 4 + 2 * P_ROW);
}

/*
 * One tile of the online softmax, warp per head: the new maximum m' (ms.m), the weights exp(l - m')
 * as bf16 pairs into the two weight planes, the rescale a = exp(m - m') of the earlier tiles
 * (alpha), and S = S a + the tile's sum (um.s) in a fixed shuffle tree.
 */
template <int MT>
static __device__ void funion_softmax(const float *ss, uint8_t *sp, attn_misc_t &ms,
                                      union_misc_t &um, float *alpha, uint32_t warp,
                                      uint32_t lane) {
  uint8_t *sp_lo = sp + 16 * MT * P_ROW;
  for (uint32_t h = warp; h < 16 * MT; h += ATTN_WARPS) {
    float v[4], tm = -INFINITY;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      v[k] = ss[h * S_STRIDE + lane + 32 * k];
      tm = fmaxf(tm, v[k]);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
      tm = fmaxf(tm, __shfl_xor_sync(FULL, tm, off));
    const float m_old = ms.m[h], m = fmaxf(m_old, tm);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const float w = __expf(v[k] - m); /* exp(-inf) = +0 past the tile's candidates */
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
    __syncwarp(); /* every lane has read ms.m[h] before lane 0 replaces it */
    if (lane == 0) {
      const float a = __expf(m_old - m); /* 0 on the first tile (m_old = -inf) */
      um.s[h] = um.s[h] * a + sum;
      ms.m[h] = m;
      alpha[h] = a;
    }
  }
}

/* N of the warp's m-tile and dims rescaled by the heads' a, then continued over the tile's nt
 * candidates (rows nt..nt16 - 1 hold zeros and weights +0). */
template <int MT>
static __device__ void funion_accumulate(const uint8_t *sp, const uint8_t *sk, const float *alpha,
                                         uint32_t nt, uint32_t warp, uint32_t lane,
                                         float (&acc)[8 * MT][4]) {
  const uint32_t mt = warp % MT, dw0 = (warp / MT) * 64 * MT;
  const uint32_t h = mt * 16 + (lane >> 2);
  const float a0 = alpha[h], a1 = alpha[h + 8];
#pragma unroll
  for (int j = 0; j < 8 * MT; j++) {
    acc[j][0] *= a0;
    acc[j][1] *= a0;
    acc[j][2] *= a1;
    acc[j][3] *= a1;
  }
  fast_pv<8 * MT>(smem_addr(sp), smem_addr(sp + 16 * MT * P_ROW), smem_addr(sk), mt, dw0,
                  ((nt + 15) / 16) * 2, lane, acc);
}

/* One thread per head: D = S + exp(sink - m) and lse = m + log S (the sink excluded). */
template <int MT>
static __device__ void funion_finish(const attn_params_t &p, const attn_misc_t &ms,
                                     const union_misc_t &um, fast_misc_t &fm, uint32_t t,
                                     uint32_t h_first) {
  const uint32_t h = threadIdx.x;
  if (h >= 16 * MT)
    return;
  const float m = ms.m[h], sum = um.s[h];
  fm.den[h] = fast_den(p, sum, m, fm.sink[h]);
  if (p.lse && h_first + h < p.heads)
    p.lse[(uint64_t)t * p.heads + h_first + h] = fast_lse(m, sum);
}

/* Tile `first` of nt candidates: addresses, records staged as bf16 (zeros up to a multiple of 16),
 * scores into ss (-inf past nt). */
template <int MT>
static __device__ void funion_tile_scores(const attn_params_t &p, const attn_misc_t &ms,
                                          union_misc_t &um, const uint8_t *sq, uint8_t *sk,
                                          float *ss, uint32_t first, uint32_t nt, uint32_t warp,
                                          uint32_t lane) {
  union_addrs(p, ms, um, first, nt);
  __syncthreads();
  stage_records<true>(nt, sk, [&](uint32_t s, const uint8_t **rec, const uint8_t **scl) {
    *rec = um.rec[s];
    *scl = um.scl[s];
  });
  fast_zero_tail(sk, nt);
  __syncthreads();
  float acc[2 * MT][4];
  fast_scores<MT>(sq, sk, warp, lane, acc);
  fast_store_scores<MT>(ss, warp, lane, nt, acc);
}

template <int MT>
__global__ void __launch_bounds__(ATTN_THREADS, 1)
    dsv4__attention_fast_union_kernel(attn_params_t p) {
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ union_misc_t um;
  __shared__ fast_misc_t fm;
  __shared__ float alpha[16 * MT];
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  uint8_t *sq = sk + (size_t)DSV4_WINDOW * K_ROW;
  float *ss = reinterpret_cast<float *>(sq + (size_t)16 * MT * K_ROW);
  uint8_t *sp = reinterpret_cast<uint8_t *>(ss + (size_t)16 * MT * S_STRIDE);
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t t = blockIdx.x / p.groups;
  const uint32_t h_first = (blockIdx.x - t * p.groups) * 16 * MT;
  /* Before the wait: the sinks, immutable data. */
  if (tid < 16 * MT)
    fm.sink[tid] = p.sink && h_first + tid < p.heads ? p.sink[h_first + tid] : 0.0f;
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  if (union_setup(p, t, ms, um))
    return;
  /* q is read once and kept for every tile, where the window's kernel reuses its space after
   * its one tile; made visible by the first tile's barriers. */
  fast_load_q<MT>(p, t, h_first, sq, ms.rope);
  const uint32_t nc = um.nc;
  float acc[8 * MT][4];
#pragma unroll
  for (int j = 0; j < 8 * MT; j++)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  for (uint32_t first = 0; first < nc; first += DSV4_WINDOW) {
    const uint32_t nt = min(nc - first, (uint32_t)DSV4_WINDOW);
    funion_tile_scores<MT>(p, ms, um, sq, sk, ss, first, nt, warp, lane);
    __syncthreads();
    funion_softmax<MT>(ss, sp, ms, um, alpha, warp, lane);
    __syncthreads();
    funion_accumulate<MT>(sp, sk, alpha, nt, warp, lane, acc);
    __syncthreads(); /* the next tile rewrites the addresses, the records and the weights */
  }
  funion_finish<MT>(p, ms, um, fm, t, h_first);
  __syncthreads();
  fast_store_out<8 * MT>(p, ms, fm, t, h_first, (warp % MT) * 16 + (lane >> 2),
                         (warp / MT) * 64 * MT, lane, acc);
}

template <int MT>
static cudaError_t launch_funion_mt(const attn_params_t &p, unsigned grid, cudaStream_t s,
                                    int pdl) {
  static int ready = 0; /* the shared-memory limit, raised once per process */
  const size_t smem = funion_smem_bytes(MT);
  if (!ready) {
    cudaError_t e = cudaFuncSetAttribute(dsv4__attention_fast_union_kernel<MT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return e;
    }
    ready = 1;
  }
  return dsv4__cuda_launch_smem(dsv4__attention_fast_union_kernel<MT>, grid, ATTN_THREADS, smem, s,
                                pdl, p);
}

extern "C" int dsv4__cuda_attention_fast_union_supported(int dev) {
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return (size_t)optin >= funion_smem_bytes(2) + sizeof(attn_misc_t) + sizeof(union_misc_t) +
                              sizeof(fast_misc_t) + 32 * sizeof(float);
}

extern "C" uint32_t dsv4__cuda_attention_fast_union_heads_per_block(uint32_t n_tokens,
                                                                    uint32_t heads) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  return 16u * (uint32_t)choose_mt(n_tokens, heads ? heads : 1, dev.sms, 2);
}

cudaError_t dsv4__attention_fast_union_launch(attn_params_t p, int sms, cudaStream_t s, int pdl) {
  const int mt = choose_mt(p.n_tokens, p.heads, sms, 2);
  p.groups = (p.heads + 16u * mt - 1) / (16u * mt);
  const uint64_t grid = (uint64_t)p.n_tokens * p.groups;
  if (grid > 0x7fffffffu)
    return cudaErrorInvalidValue;
  return mt == 1 ? launch_funion_mt<1>(p, (unsigned)grid, s, pdl)
                 : launch_funion_mt<2>(p, (unsigned)grid, s, pdl);
}
