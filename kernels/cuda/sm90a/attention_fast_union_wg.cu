/*
 * The fast union kernel's CTAs of 64 heads on Hopper's warpgroup MMAs (SPEC §7, §8.6): the
 * conventions and the online softmax of attention_fast_union.cu, with a token's 64 heads in one CTA
 * of four warpgroups instead of two or four CTAs of 16 or 32 heads that each stage the same
 * candidates. Built for sm_90a only; dsv4__attention_fast_union_wg_ready says whether the current
 * device runs it.
 *
 * Why: a union CTA's time is its own, not the device's bandwidth (tests/bench/NOTES.md: a 32-head
 * CTA walks 640 candidates in about 60 µs whether 100 or 128 SMs walk at once), most of it staging
 * the records, which every head group of a token did again. One CTA of 64 heads stages each record
 * once, and its warpgroup MMAs read each operand once for the group's four warps.
 *
 * q (64 rows) stays in shared memory for every tile, so a tile is 64 candidates (the records 64
 * KiB, q 64 KiB, the weights 16 KiB, the scores 17 KiB). Per tile, in the 128-byte swizzle
 * (swz_atoms), as the window's warpgroup kernel (attention_fast_wg.cu):
 *   staging  the records copied raw into a buffer of their own (a warp a record; their addresses
 *            from union_addrs) while the tile before computes, then dequantised into the tile's
 *            rows, zeros past its candidates (the weighted sums read every row)
 *   scores   warpgroup g: candidates 16 g.. of the 64 heads, m64n16k16 over 32 k-steps of 16 dims,
 *            each from zero and added to the total in fp32 (two in flight)
 *   softmax  warp per head, online (funion_softmax over 64 candidates)
 *   sums     warpgroup g: dims 128 g.. of the 64 heads in two chunks of 64, rescaled by a = exp(m -
 *            m') in their registers, then m64n64k16 over the tile's 4 k-steps, the hi plane then
 *            the lo plane each step, accumulated in the tensor cores
 * Warp w of warpgroup g holds rows 16 w.. of its group's results in mma.sync's m16n8 fragment, so
 * the stores are the mma.sync kernel's. The end is the union kernel's: o = N / D, the inverse RoPE
 * and bf16, or a split's partial state for the combine kernel. Tiles of 64 round the online
 * softmax's rescales differently from the mma.sync kernel's tiles of 128: the bytes are this
 * kernel's own, deterministic, within the same tolerances of exact mode (gpu_attn_fast_test).
 *
 * Ordering (SPEC §5.2) is the union kernel's (union_setup): before griddepcontrol.wait a CTA reads
 * only its parameters and the sinks; the MMAs read only shared memory staged after the wait.
 */
#include "../attention-fast-union.cuh"
#include "../attention-split.h"
#include "attention-wg.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90a/attention_fast_union_wg.cu is built for sm_90a only"
#endif

/* Candidates of a tile; floats of a row of scores (a pad spreads the rows over the banks); bytes of
 * a row of weights (one 128-byte atom row: a group of 8 rows is an atom). */
#define UWG_T 64
#define UWG_SS (UWG_T + 4)
#define UWG_P_ROW (2 * UWG_T)
#define UWG_GROUP_P (8u * UWG_P_ROW)
static_assert(UWG_P_ROW == 128, "a weights row is the swizzle's 128 bytes");

/* The dynamic shared memory: the records, q, the weights' two planes (all on 1 KiB boundaries), the
 * scores, and room to start them on a boundary. The warps' output tiles take the records' space
 * after the last tile. */
static constexpr size_t uwg_smem_bytes() {
  return (size_t)UWG_T * K_ROW + (size_t)64 * K_ROW + (size_t)2 * 64 * UWG_P_ROW +
         (size_t)64 * UWG_SS * 4 + (size_t)UWG_T * DSV4_TOKEN_DATA_BYTES + AWG_ATOM - 16;
}

/* The raw buffer's layout for fast_copy_record: record s's 576 data bytes as the cache holds them,
 * at s 576. */
struct uwg_raw {
  static __device__ __forceinline__ uint32_t raw(uint32_t s, uint32_t j) {
    return s * DSV4_TOKEN_DATA_BYTES + 16 * j;
  }
};

/* Records 0..nt - 1, whose addresses ms holds, into the raw buffer (a warp a record). */
static __device__ void uwg_copy_raw(const attn_misc_t &ms, uint8_t *sr, uint2 *sscl, uint32_t nt,
                                    uint32_t warp, uint32_t lane) {
  for (uint32_t s = warp; s < nt; s += 16)
    fast_copy_record<uwg_raw>(sr, sscl, s, ms.rec[s], ms.scl[s], lane);
}

/* The raw buffer's rows 0..nt - 1 into the tile's rows as bf16 (swz_atoms), a warp a row, two in
 * flight: lane l < 28 dequantises NoPE chunk l (dequant8, exact), lanes 28..31 move two chunks of
 * RoPE dims each; then zeros in the rows nt.. of the tile. */
static __device__ void uwg_dequant(const uint8_t *sr, const uint2 *sscl, uint8_t *sk, uint32_t nt,
                                   uint32_t warp, uint32_t lane) {
  const uint32_t j = lane < 28 ? lane : 28 + 2 * (lane - 28); /* the first raw chunk it reads */
  for (uint32_t s0 = warp; s0 < nt; s0 += 32) {
    uint4 a[2], b[2];
    uint32_t code[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const uint32_t s = s0 + 16 * r;
      if (s < nt) {
        a[r] = *reinterpret_cast<const uint4 *>(sr + uwg_raw::raw(s, j));
        if (lane >= 28)
          b[r] = *reinterpret_cast<const uint4 *>(sr + uwg_raw::raw(s, j + 1));
        code[r] = reinterpret_cast<const uint8_t *>(sscl + s)[(lane & 31) >> 2];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const uint32_t s = s0 + 16 * r;
      if (s >= nt)
        continue;
      const uint32_t c = lane < 28 ? 2 * lane : 56 + 2 * (lane - 28);
      if (lane < 28) {
        b[r] = dequant8(a[r].z, a[r].w, code[r]);
        a[r] = dequant8(a[r].x, a[r].y, code[r]);
      }
      *reinterpret_cast<uint4 *>(sk + swz_atoms::at(s, c, K_ROW)) = a[r];
      *reinterpret_cast<uint4 *>(sk + swz_atoms::at(s, c + 1, K_ROW)) = b[r];
    }
  }
  fast_zero_tail<swz_atoms>(sk, nt, UWG_T);
}
static_assert((size_t)16 * OUT_TILE <= (size_t)UWG_T * K_ROW, "the output tiles in the records");

/* The scores of warpgroup g's 16 candidates (all of them: fast_store_scores puts -inf past the
 * tile's), k-step by k-step, UWG_KF in flight (N's 64 registers a thread live beside them), each
 * k-step's partial added to the total in k-step order once it has landed. acc: the warp's two
 * n-tiles, as fast_scores' NP = 1. */
#define UWG_KF 2
static __device__ void uwg_scores(const uint8_t *sq, const uint8_t *sk, uint32_t warp,
                                  float (&acc)[2][4]) {
  constexpr int KS = DSV4_HEAD_DIM / 16;
  const uint32_t qa = smem_addr(sq), ka = smem_addr(sk) + (warp >> 2) * 2 * AWG_GROUP_K;
  float d[UWG_KF][8] = {};
#pragma unroll
  for (int b = 0; b < UWG_KF; b++)
    wg_tie(d[b]);
#pragma unroll
  for (int ks = 0; ks < KS + UWG_KF - 1; ks++) {
    if (ks < KS) {
      const uint32_t off = (ks >> 2) * AWG_ATOM + (ks & 3) * AWG_KSTEP;
      wg_fence(); /* the buffer's last reads (the adds below) come before the MMA writes it */
      awg_mma_n16(d[ks % UWG_KF], awg_desc_k(qa + off, AWG_GROUP_K),
                  awg_desc_k(ka + off, AWG_GROUP_K));
      wg_commit();
    }
    const int done = ks - (UWG_KF - 1);
    if (done < 0)
      continue;
    static_assert(UWG_KF == 2, "the wait below: at most one group pending");
    if (done < KS - 1)
      wg_wait_group<1>();
    else
      wg_wait_group<0>();
    wg_tie(d[done % UWG_KF]);
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
      for (int i = 0; i < 4; i++)
        acc[j][i] += d[done % UWG_KF][4 * j + i];
  }
}

/* N of warpgroup g's 128 dims (two chunks of 64) rescaled by the heads' a, then continued over the
 * tile's 64 rows (zero weights and zero rows past its candidates); complete on return. */
static __device__ void uwg_accumulate(const uint8_t *sp, const uint8_t *sk, const float *alpha,
                                      uint32_t warp, uint32_t lane, float (&d)[2][32]) {
  const uint32_t g = warp >> 2, h = (warp & 3) * 16 + (lane >> 2);
  const float a0 = alpha[h], a1 = alpha[h + 8];
#pragma unroll
  for (int ch = 0; ch < 2; ch++)
#pragma unroll
    for (int j = 0; j < 8; j++) {
      d[ch][4 * j] *= a0;
      d[ch][4 * j + 1] *= a0;
      d[ch][4 * j + 2] *= a1;
      d[ch][4 * j + 3] *= a1;
    }
  const uint32_t pa = smem_addr(sp), pla = smem_addr(sp + 64 * UWG_P_ROW);
  wg_tie(d[0]); /* the rescale stays before the fence */
  wg_tie(d[1]);
  wg_fence(); /* the rescaled registers before the MMAs that continue them */
#pragma unroll
  for (int ch = 0; ch < 2; ch++) {
    const uint32_t va = smem_addr(sk) + (2 * g + ch) * AWG_ATOM;
#pragma unroll
    for (uint32_t k = 0; k < UWG_T / 16; k++) {
      const uint64_t v = awg_desc(va + 2 * k * AWG_GROUP_K, AWG_ATOM, AWG_GROUP_K);
      awg_mma_n64(d[ch], awg_desc_k(pa + k * AWG_KSTEP, UWG_GROUP_P), v);
      awg_mma_n64(d[ch], awg_desc_k(pla + k * AWG_KSTEP, UWG_GROUP_P), v);
    }
  }
  wg_commit();
  wg_wait_group<0>();
  wg_tie(d[0]);
  wg_tie(d[1]);
}

/* Tile `first` of nt candidates, whose raw records are in flight into sr: once they land,
 * dequantised into the tile's rows, then the next tile's nn records put in flight (their addresses
 * in ms) and the scores into ss; the addresses of the tile after it (nnn) follow the scores' MMAs,
 * once every warp has issued its copies. */
template <bool CK>
static __device__ void uwg_tile_scores(const attn_params_t &p, attn_misc_t &ms, union_misc_t &um,
                                       const uint8_t *sq, uint8_t *sk, uint8_t *sr, uint2 *sscl,
                                       float *ss, uint32_t first, uint32_t nt, uint32_t nn,
                                       uint32_t nnn, uint32_t warp, uint32_t lane) {
  dsv4__cp_async_wait_all();
  __syncthreads();
  uwg_dequant(sr, sscl, sk, nt, warp, lane);
  wg_proxy_fence(); /* the staged rows (and q, after the first tile's wait) for the MMAs */
  __syncthreads();  /* and the raw buffer free */
  uwg_copy_raw(ms, sr, sscl, nn, warp, lane);
  __syncwarp(); /* the copies branch by lane; the MMAs' fence is .aligned */
  PHASE_MARK(UPH_STAGE);
  float acc[2][4] = {};
  uwg_scores(sq, sk, warp, acc);
  __syncthreads(); /* every warp has issued its copies: the addresses may change */
  if (nnn)         /* CTA-uniform */
    union_addrs<false, CK>(p, ms, um, first + 2 * UWG_T, nnn, &um.bad);
  fast_store_scores<4, 1, UWG_SS>(ss, warp, lane, nt, acc);
}

/* The CTA's end from the warpgroup's accumulators (as the mma.sync kernel's n-tiles: chunk ch's
 * n-tile j is dims 128 g + 64 ch + 8 j): o = N / D stored, or the split's partial state. */
static __device__ void uwg_end(const attn_params_t &p, const attn_misc_t &ms,
                               const union_misc_t &um, fast_misc_t &fm, uint8_t *sk, uint32_t t,
                               uint32_t h_first, uint32_t split, uint32_t warp, uint32_t lane,
                               const float (&d)[2][32]) {
  float acc[16][4];
#pragma unroll
  for (int j = 0; j < 16; j++)
#pragma unroll
    for (int i = 0; i < 4; i++)
      acc[j][i] = d[j / 8][4 * (j % 8) + i];
  if (p.nsplit > 1) {
    funion_store_part<4, 16>(p, ms, um, t, h_first, split, warp, lane, acc);
    return;
  }
  funion_finish<4>(p, ms, um, fm, t, h_first);
  __syncthreads();
  const uint32_t g = warp >> 2, mt = warp & 3;
#pragma unroll
  for (int ch = 0; ch < 2; ch++) {
    float a[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int i = 0; i < 4; i++)
        a[j][i] = acc[8 * ch + j][i];
    fast_store_out_tile(p, ms, fm, t, h_first, mt, 128 * g + 64 * ch, lane, sk + warp * OUT_TILE,
                        a);
  }
}

/* CK: a split launch of at most UNION_CHECK_ALL_MAX tokens, whose CTAs check what they read
 * (union_setup). */
template <bool CK>
__global__ void __launch_bounds__(512, 1) dsv4__attention_fast_union_wg_kernel(attn_params_t p) {
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ union_misc_t um;
  __shared__ fast_misc_t fm;
  __shared__ float alpha[64];
  __shared__ uint2 sscl[UWG_T]; /* the staged records' scale bytes */
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  sk += smem_align_pad<AWG_ATOM>(smem_dyn);
  uint8_t *sq = sk + (size_t)UWG_T * K_ROW;
  uint8_t *sp = sq + (size_t)64 * K_ROW;
  float *ss = reinterpret_cast<float *>(sp + (size_t)2 * 64 * UWG_P_ROW);
  uint8_t *sr = reinterpret_cast<uint8_t *>(ss + (size_t)64 * UWG_SS);
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, split = blockIdx.y;
  const uint32_t t = blockIdx.x / p.groups, h_first = (blockIdx.x - t * p.groups) * 64;
  PHASE_START();
  if (funion_begin<CK>(p, 64, t, h_first, ms, um, fm))
    return;
  const uint32_t nc = um.nc, per = dsv4__union_split_span(nc, p.nsplit);
  const uint32_t lo = min(split * per, nc), hi = min(lo + per, nc);
  /* q for every tile (attention_fast_union.cu), visible after the first tile's wait and fence */
  if (lo < hi && !p.q_raw)
    fast_copy_q<4, 16, swz_atoms>(p, t, h_first, sq);
  else if (lo < hi)
    fast_load_q<4, 16, swz_atoms>(p, t, h_first, sq, ms.rope);
  float d[2][32];
#pragma unroll
  for (int ch = 0; ch < 2; ch++)
#pragma unroll
    for (int i = 0; i < 32; i++)
      d[ch][i] = 0.0f;
  /* The first tile's records in flight, then the second's addresses; each tile puts the next one's
   * records in flight and the addresses of the one after (uwg_tile_scores). */
  const uint32_t n0 = min(hi - lo, (uint32_t)UWG_T), n1 = min(hi - lo - n0, (uint32_t)UWG_T);
  if (n0)
    union_addrs<false, CK>(p, ms, um, lo, n0, &um.bad);
  __syncthreads();
  uwg_copy_raw(ms, sr, sscl, n0, warp, lane);
  __syncthreads();
  if (n1)
    union_addrs<false, CK>(p, ms, um, lo + UWG_T, n1, &um.bad);
  for (uint32_t first = lo; first < hi; first += UWG_T) {
    const uint32_t nt = min(hi - first, (uint32_t)UWG_T);
    const uint32_t nn = first + nt < hi ? min(hi - first - nt, (uint32_t)UWG_T) : 0u;
    const uint32_t nnn = first + nt + nn < hi ? min(hi - first - nt - nn, (uint32_t)UWG_T) : 0u;
    uwg_tile_scores<CK>(p, ms, um, sq, sk, sr, sscl, ss, first, nt, nn, nnn, warp, lane);
    __syncthreads();
    PHASE_MARK(UPH_SCORES);
    funion_softmax<4, 16, swz_atoms, UWG_T>(ss, sp, ms, um, alpha, warp, lane);
    wg_proxy_fence(); /* the weights, for the MMAs */
    __syncthreads();
    PHASE_MARK(UPH_SOFTMAX);
    uwg_accumulate(sp, sk, alpha, warp, lane, d);
    __syncthreads(); /* the next tile rewrites the records and the weights */
    PHASE_MARK(UPH_SUM);
  }
  dsv4__cp_async_wait_all();          /* a split without a tile: no copy of q outlives the CTA */
  if (CK && p.nsplit > 1 && um.bad) { /* CTA-uniform after the last tile's barriers */
    if (tid == 0)
      atomicOr(p.err, um.bad);
    return;
  }
#ifdef DSV4_TEST_DELAY_PARTS
  if (p.nsplit > 1)
    dsv4__test_delay(); /* as the mma.sync kernel's (attention_fast_union.cu) */
#endif
  uwg_end(p, ms, um, fm, sk, t, h_first, split, warp, lane, d);
  PHASE_END(UPH_OUTPUT);
}

static std::atomic<int> ready_cache[DEV_CACHE];

/* The kernel's only image is sm_90a's: elsewhere its attributes cannot be read. */
static int uwg_ready_probe(int dev) {
  cudaFuncAttributes fa, fc;
  return cudaFuncGetAttributes(&fa, dsv4__attention_fast_union_wg_kernel<false>) == cudaSuccess &&
         cudaFuncGetAttributes(&fc, dsv4__attention_fast_union_wg_kernel<true>) == cudaSuccess &&
         smem_grants(dev, uwg_smem_bytes() + fa.sharedSizeBytes) &&
         smem_grants(dev, uwg_smem_bytes() + fc.sharedSizeBytes);
}

int dsv4__attention_fast_union_wg_ready(void) {
  return per_device_cached(ready_cache, uwg_ready_probe);
}

template <bool CK>
static cudaError_t uwg_launch(const attn_params_t &p, dim3 grid, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  cudaError_t e = dsv4__cuda_smem_limit(dsv4__attention_fast_union_wg_kernel<CK>, uwg_smem_bytes(),
                                        limit_raised);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(dsv4__attention_fast_union_wg_kernel<CK>, grid, 512,
                                uwg_smem_bytes(), s, pdl, p);
}

cudaError_t dsv4__attention_fast_union_wg_launch(const attn_params_t &p, dim3 grid, cudaStream_t s,
                                                 int pdl) {
  return p.check_all && p.nsplit > 1 ? uwg_launch<true>(p, grid, s, pdl)
                                     : uwg_launch<false>(p, grid, s, pdl);
}

#ifdef DSV4_PHASE_PROBE
long long dsv4__attention_fast_union_wg_phases(double cycles[7]) {
  return dsv4__phase_take(cycles);
}
#endif
