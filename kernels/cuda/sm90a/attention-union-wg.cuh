#ifndef DSV4_KERNELS_CUDA_SM90A_ATTENTION_UNION_WG_CUH
#define DSV4_KERNELS_CUDA_SM90A_ATTENTION_UNION_WG_CUH
/*
 * What the fast union's 64-head kernels on warpgroup MMAs share (attention_fast_union_wg.cu, four
 * warpgroups; attention_fast_union_ws.cu, a producer and G = 2 math warpgroups): tiles of 64
 * candidates, the online softmax from the scores in the registers, each head's m and S at the end,
 * the end itself, and the launch. Warpgroup g of G holds the scores of candidates 64 / G g.. and
 * the output of dims 512 / G g.., warp w of it heads 16 (w % 4).. in mma.sync's m16n8 fragment.
 */
#include "../attention-fast-union.cuh"
#include "attention-wg.cuh"

#include <atomic>

/* Candidates of a tile; bytes of a row of weights (one 128-byte atom row: a group of 8 rows is an
 * atom). */
#define UWG_T 64
#define UWG_P_ROW (2 * UWG_T)
#define UWG_GROUP_P (8u * UWG_P_ROW)
static_assert(UWG_P_ROW == 128, "a weights row is the swizzle's 128 bytes");

/* The named barrier of the two math warpgroups of attention_fast_union_ws.cu (0 is
 * __syncthreads). */
#define UWG_BAR_MATH 5u

/* The G warpgroups that compute synchronised: the CTA (G = 4), or the math warpgroups by their
 * named barrier (G = 2, beside the producer). */
template <int G> static __device__ __forceinline__ void uwg_sync(void) {
  static_assert(G == 2 || G == 4, "four warpgroups, or two beside a producer");
  if constexpr (G == 4)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;\n" ::"n"(UWG_BAR_MATH), "n"(128 * G) : "memory");
}

/* The tile's online softmax from the scores in the warps' registers (acc: NJ n-tiles, heads h = 16
 * (warp % 4) + lane / 4 and h + 8, candidates 8 NJ g + 8 j + 2 (lane % 4) + 0, 1 of warpgroup g):
 * scaled (in place), -inf past the tile's nt candidates; each head's maximum over the G
 * warpgroups through red (a float a warpgroup and head); m' = max(m, it) and a = exp(m - m') for
 * both heads (0 on the first tile); the weights w = exp(l - m') as bf16 pairs into the two weight
 * planes at sp (hi = bf16(w), lo = bf16(w - hi)); and the thread's own part of each head's S: S a
 * + its weights in order. */
template <int G, int NJ>
static __device__ void uwg_softmax(float (&acc)[4 * NJ], float *red, uint8_t *sp, uint32_t nt,
                                   uint32_t warp, uint32_t lane, float (&m)[2], float (&sum)[2],
                                   float (&a)[2]) {
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  const uint32_t g = warp >> 2, h = (warp & 3) * 16 + (lane >> 2);
  const uint32_t c0 = 8 * NJ * g + 2 * (lane & 3);
  float tm[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < NJ; j++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float v = c0 + 8 * j + (i & 1) < nt ? __fmul_rn(acc[4 * j + i], scale) : -INFINITY;
      acc[4 * j + i] = v;
      tm[i >> 1] = fmaxf(tm[i >> 1], v);
    }
#pragma unroll
  for (int r = 0; r < 2; r++) {
    tm[r] = fmaxf(tm[r], __shfl_xor_sync(FULL, tm[r], 1));
    tm[r] = fmaxf(tm[r], __shfl_xor_sync(FULL, tm[r], 2));
    if ((lane & 3) == 0)
      red[64 * g + h + 8 * r] = tm[r];
  }
  uwg_sync<G>();
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const uint32_t hr = h + 8 * r;
    float mn;
    if constexpr (G == 4)
      mn = fmaxf(fmaxf(m[r], fmaxf(red[hr], red[64 + hr])), fmaxf(red[128 + hr], red[192 + hr]));
    else
      mn = fmaxf(m[r], fmaxf(red[hr], red[64 + hr]));
    a[r] = __expf(m[r] - mn); /* 0 on the first tile (m = -inf) */
    m[r] = mn;
    sum[r] *= a[r];
  }
  uint8_t *sp_lo = sp + 64 * UWG_P_ROW;
#pragma unroll
  for (int j = 0; j < NJ; j++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const float w0 = __expf(acc[4 * j + 2 * r] - m[r]),
                  w1 = __expf(acc[4 * j + 2 * r + 1] - m[r]);
      sum[r] += w0;
      sum[r] += w1;
      const uint32_t hw = bf16x2(w0, w1);
      const uint32_t lw =
          bf16x2(w0 - __uint_as_float(hw << 16), w1 - __uint_as_float(hw & 0xFFFF0000u));
      const uint32_t c = c0 + 8 * j,
                     off = swz_atoms::at(h + 8 * r, c >> 3, UWG_P_ROW) + 2 * (c & 7);
      *reinterpret_cast<uint32_t *>(sp + off) = hw;
      *reinterpret_cast<uint32_t *>(sp_lo + off) = lw;
    }
}

/* Each head's m (the same in every thread of its row) and S (the threads' parts: a quad's lanes,
 * then the G warpgroups, pairwise for four) into ms.m and um.s for the end; the warpgroups
 * synchronised. */
template <int G>
static __device__ void uwg_state_out(attn_misc_t &ms, union_misc_t &um, float *red, uint32_t warp,
                                     uint32_t lane, const float (&m)[2], float (&sum)[2]) {
  const uint32_t g = warp >> 2, h = (warp & 3) * 16 + (lane >> 2);
#pragma unroll
  for (int r = 0; r < 2; r++) {
    sum[r] += __shfl_xor_sync(FULL, sum[r], 1);
    sum[r] += __shfl_xor_sync(FULL, sum[r], 2);
  }
  uwg_sync<G>(); /* the last tile's maxima read */
  if ((lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      red[64 * g + h + 8 * r] = sum[r];
      if (g == 0)
        ms.m[h + 8 * r] = m[r];
    }
  }
  uwg_sync<G>();
  const uint32_t tid = threadIdx.x;
  if (tid < 64) {
    if constexpr (G == 4)
      um.s[tid] = (red[tid] + red[64 + tid]) + (red[128 + tid] + red[192 + tid]);
    else
      um.s[tid] = red[tid] + red[64 + tid];
  }
  uwg_sync<G>();
}

/* N of warpgroup g's 2 R dims (R accumulators a thread) rescaled by the heads' a, then the MMAs
 * that continue it over the tile's rows (zero weights and zero rows past its candidates) issued,
 * the hi plane then the lo plane each k-step: m64n128k16 for the four warpgroups' 128 dims,
 * m64n256k16 for the math warpgroups' 256 (V: 16 rows, two groups of 8 AWG_GROUP_K apart, of dims
 * 2 R g.., R / 32 atoms AWG_ATOM apart); complete after uwg_sums_wait. */
template <int R>
static __device__ void uwg_sums_issue(const uint8_t *sp, const uint8_t *sk, const float (&a)[2],
                                      uint32_t g, float (&d)[R]) {
  static_assert(R == 64 || R == 128, "m64n128 or m64n256");
#pragma unroll
  for (int j = 0; j < R / 4; j++) {
    d[4 * j] *= a[0];
    d[4 * j + 1] *= a[0];
    d[4 * j + 2] *= a[1];
    d[4 * j + 3] *= a[1];
  }
  const uint32_t pa = smem_addr(sp), pla = smem_addr(sp + 64 * UWG_P_ROW);
  const uint32_t va = smem_addr(sk) + (R / 32) * g * AWG_ATOM;
  wg_tie(d);  /* the rescale stays before the fence */
  wg_fence(); /* the rescaled registers before the MMAs that continue them */
#pragma unroll
  for (uint32_t k = 0; k < UWG_T / 16; k++) {
    const uint64_t v = awg_desc(va + 2 * k * AWG_GROUP_K, AWG_ATOM, AWG_GROUP_K);
    const uint64_t ph = awg_desc_k(pa + k * AWG_KSTEP, UWG_GROUP_P),
                   pl = awg_desc_k(pla + k * AWG_KSTEP, UWG_GROUP_P);
    if constexpr (R == 64) {
      awg_mma_n128(d, ph, v);
      awg_mma_n128(d, pl, v);
    } else {
      awg_mma_n256(d, ph, v);
      awg_mma_n256(d, pl, v);
    }
  }
  wg_commit();
}

/* uwg_sums_issue's MMAs complete, their registers N again. */
template <int R> static __device__ void uwg_sums_wait(float (&d)[R]) {
  wg_wait_group<0>();
  wg_tie(d);
}

/* n-tile j's value i (mma.sync's m16n8 fragment) of a warp's accumulators: the four warpgroups'
 * 128 dims (m64n128) or the math warpgroups' 256 dims (m64n256). */
template <int R>
static __device__ __forceinline__ float uwg_acc(const float (&d)[R], int j, int i) {
  return d[4 * j + i];
}

/* The CTA's end from the warps' accumulators d (uwg_acc; as the mma.sync kernel's n-tiles: warp
 * w's n-tile j is dims 8 NT (w / 4) + 8 j of heads 16 (w % 4)..): o = N / D stored through the
 * warps' tiles in sk, or the split's partial state. */
template <int G, int NT, class D>
static __device__ void uwg_end(const attn_params_t &p, const attn_misc_t &ms,
                               const union_misc_t &um, fast_misc_t &fm, uint8_t *sk, uint32_t t,
                               uint32_t h_first, uint32_t split, uint32_t warp, uint32_t lane,
                               const D &d) {
  static_assert(G * 8 * NT == DSV4_HEAD_DIM, "the G warpgroups cover the dims");
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++)
#pragma unroll
    for (int i = 0; i < 4; i++)
      acc[j][i] = uwg_acc(d, j, i);
  if (p.nsplit > 1) {
    funion_store_part<4, NT>(p, ms, um, t, h_first, split, warp, lane, acc);
    return;
  }
  funion_finish<4>(p, ms, um, fm, t, h_first);
  uwg_sync<G>();
  const uint32_t g = warp >> 2, mt = warp & 3;
#pragma unroll
  for (int ch = 0; ch < NT / 8; ch++) {
    float a[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int i = 0; i < 4; i++)
        a[j][i] = acc[8 * ch + j][i];
    fast_store_out_tile(p, ms, fm, t, h_first, mt, 8 * NT * g + 64 * ch, lane, sk + warp * OUT_TILE,
                        a);
  }
}

/* Whether the device runs the kernel's two instances k0, k1 (sm_90a: elsewhere their attributes
 * cannot be read) with smem bytes of dynamic shared memory and, where regs is not 0, at least regs
 * registers for the CTA of `threads` (what setmaxnreg hands out). */
template <class K>
static int uwg_probe(int dev, K k0, K k1, size_t smem, uint32_t threads, int regs) {
  cudaFuncAttributes fa, fc;
  return cudaFuncGetAttributes(&fa, k0) == cudaSuccess &&
         cudaFuncGetAttributes(&fc, k1) == cudaSuccess && fa.numRegs * (int)threads >= regs &&
         fc.numRegs * (int)threads >= regs && smem_grants(dev, smem + fa.sharedSizeBytes) &&
         smem_grants(dev, smem + fc.sharedSizeBytes);
}

/* Kernel k launched with smem bytes of dynamic shared memory (the limit raised once a device,
 * `raised`). */
template <class K>
static cudaError_t uwg_launch_kernel(K k, std::atomic<uint64_t> &raised, const attn_params_t &p,
                                     dim3 grid, uint32_t threads, size_t smem, cudaStream_t s,
                                     int pdl) {
  cudaError_t e = dsv4__cuda_smem_limit(k, smem, raised);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(k, grid, threads, smem, s, pdl, p);
}

#endif /* DSV4_KERNELS_CUDA_SM90A_ATTENTION_UNION_WG_CUH */
