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
 * KiB, q 64 KiB, the weights 16 KiB, the next tile's raw records 36 KiB). Per tile, in the 128-byte
 * swizzle (swz_atoms), as the window's warpgroup kernel (attention_fast_wg.cu):
 *   staging  the tile's raw records, once landed, dequantised into its rows (zeros past its
 *            candidates: the weighted sums read every row) by the warp that copied them, which
 *            then puts the next tile's in flight into the same raw rows: one barrier a tile
 *   scores   warpgroup g: candidates 16 g.. of the 64 heads, m64n16k16 over 32 k-steps of 16 dims
 *            in chains of two (the first from zero, the second accumulated in the tensor cores),
 *            each chain's partial added to the total in fp32 (two chains in flight)
 *   softmax  online, from the scores in the registers: each head's maximum over the quad's lanes,
 *            then over the four warpgroups through shared memory; the weights written as bf16
 *            pairs, hi and lo planes; each thread keeps its part of a head's sum S, rescaled with
 *            the head's m, and the parts meet once at the end (uwg_state_out)
 *   sums     warpgroup g: dims 128 g.. of the 64 heads, rescaled by a = exp(m - m') in their
 *            registers, then m64n128k16 over the tile's 4 k-steps (the weights read once for the
 *            128 dims), the hi plane then the lo plane each step, accumulated in the tensor cores;
 *            while they run, the addresses of the tile after next are resolved (union_addrs)
 * Warp w of warpgroup g holds rows 16 w.. of its group's results in mma.sync's m16n8 fragment, so
 * the stores are the mma.sync kernel's. The end is the union kernel's: o = N / D, the inverse RoPE
 * and bf16, or a split's partial state for the combine kernel. Tiles of 64, the scores' chains and
 * the sums' parts round differently from the mma.sync kernel's: the bytes are this kernel's own,
 * deterministic, within the same tolerances of exact mode (gpu_attn_fast_test).
 *
 * Ordering (SPEC §5.2) is the union kernel's (union_setup): before griddepcontrol.wait a CTA reads
 * only its parameters and the sinks; the MMAs read only shared memory staged after the wait.
 */
#include "../attention-split.h"
#include "attention-union-wg.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90a/attention_fast_union_wg.cu is built for sm_90a only"
#endif

/* The dynamic shared memory: the records, q, the weights' two planes (all on 1 KiB boundaries), the
 * raw records of the next tile, and room to start them on a boundary. The warps' output tiles take
 * the records' space after the last tile. */
#define UWG_BUF ((size_t)UWG_T * K_ROW)
static constexpr size_t uwg_smem_bytes() {
  return UWG_BUF + (size_t)64 * K_ROW + (size_t)2 * 64 * UWG_P_ROW +
         (size_t)UWG_T * DSV4_TOKEN_DATA_BYTES + AWG_ATOM - 16;
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
  __syncwarp(); /* the copies branch by lane; the MMAs' fences are .aligned */
}

/* The raw buffer's rows 0..nt - 1 into the tile's rows as bf16 (swz_atoms), a warp a row, two in
 * flight, warp w the rows w, w + 16, ... that it copied (uwg_copy_raw): lane l < 28 dequantises
 * NoPE chunk l (dequant8, exact), lanes 28..31 move two chunks of RoPE dims each; then zeros in the
 * rows nt.. of the tile. */
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
static_assert((size_t)16 * OUT_TILE <= UWG_BUF, "the output tiles in the records");

/* CK: a split launch of at most UNION_CHECK_ALL_MAX tokens, whose CTAs check what they read
 * (union_setup). */
template <bool CK>
__global__ void __launch_bounds__(512, 1) dsv4__attention_fast_union_wg_kernel(attn_params_t p) {
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ union_misc_t um;
  __shared__ fast_misc_t fm;
  __shared__ float red[4 * 64]; /* a float a warpgroup and head (uwg_softmax, uwg_state_out) */
  __shared__ uint2 sscl[UWG_T]; /* the raw records' scale bytes */
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  sk += smem_align_pad<AWG_ATOM>(smem_dyn);
  uint8_t *sq = sk + UWG_BUF;
  uint8_t *sp = sq + (size_t)64 * K_ROW;
  uint8_t *sr = sp + (size_t)2 * 64 * UWG_P_ROW;
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
  float d[64], m[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 64; i++)
    d[i] = 0.0f;
  /* The first tile's records in flight, then the second's addresses. Each tile, once its records
   * have landed and are staged, puts the next one's in flight; the addresses of the one after it
   * are resolved while the weighted sums run. */
  const uint32_t n0 = min(hi - lo, (uint32_t)UWG_T), n1 = min(hi - lo - n0, (uint32_t)UWG_T);
  if (n0)
    union_addrs<false, CK>(p, ms, um, lo, n0, &um.bad);
  __syncthreads();
  uwg_copy_raw(ms, sr, sscl, n0, warp, lane);
  __syncthreads(); /* every copy issued: the addresses may change */
  if (n1)
    union_addrs<false, CK>(p, ms, um, lo + UWG_T, n1, &um.bad);
  __syncthreads(); /* the second tile's addresses, for the copies the first tile issues */
  for (uint32_t first = lo; first < hi; first += UWG_T) {
    const uint32_t nt = min(hi - first, (uint32_t)UWG_T);
    const uint32_t nn = first + nt < hi ? min(hi - first - nt, (uint32_t)UWG_T) : 0u;
    const uint32_t nnn = first + nt + nn < hi ? min(hi - first - nt - nn, (uint32_t)UWG_T) : 0u;
    /* A warp dequantises the raw rows it copied, then copies the next tile's into them. */
    dsv4__cp_async_wait_all();
    __syncwarp();
    uwg_dequant(sr, sscl, sk, nt, warp, lane);
    __syncwarp();
    uwg_copy_raw(ms, sr, sscl, nn, warp, lane);
    wg_proxy_fence(); /* the staged rows (and q, after the first tile's wait) for the MMAs */
    __syncthreads();  /* every warp's rows staged */
    PHASE_MARK(UPH_STAGE);
    float acc[8] = {}, a[2];
    awg_scores<16>(smem_addr(sq), smem_addr(sk) + (warp >> 2) * 2 * AWG_GROUP_K, acc);
    PHASE_MARK(UPH_SCORES);
    uwg_softmax<4, 2>(acc, red, sp, nt, warp, lane, m, sum, a);
    wg_proxy_fence(); /* the weights, for the MMAs */
    __syncthreads();  /* and every copy of the next tile issued: the addresses may change */
    PHASE_MARK(UPH_SOFTMAX);
    uwg_sums_issue(sp, sk, a, warp >> 2, d);
    if (nnn) /* CTA-uniform, as nn */
      union_addrs<false, CK>(p, ms, um, first + 2 * UWG_T, nnn, &um.bad);
    __syncwarp(); /* the MMAs' wait is .aligned */
    uwg_sums_wait(d);
    __syncthreads(); /* the records and the weights read */
    PHASE_MARK(UPH_SUM);
  }
  dsv4__cp_async_wait_all(); /* a split without a tile: no copy of q outlives the CTA */
  uwg_state_out<4>(ms, um, red, warp, lane, m, sum);
  if (CK && p.nsplit > 1 && um.bad) { /* CTA-uniform after the last tile's barriers */
    if (tid == 0)
      atomicOr(p.err, um.bad);
    return;
  }
#ifdef DSV4_TEST_DELAY_PARTS
  if (p.nsplit > 1)
    dsv4__test_delay(); /* as the mma.sync kernel's (attention_fast_union.cu) */
#endif
  uwg_end<4, 16>(p, ms, um, fm, sk, t, h_first, split, warp, lane, d);
  PHASE_END(UPH_OUTPUT);
}

static std::atomic<int> ready_cache[DEV_CACHE];

static int uwg_ready_probe(int dev) {
  return uwg_probe(dev, dsv4__attention_fast_union_wg_kernel<false>,
                   dsv4__attention_fast_union_wg_kernel<true>, uwg_smem_bytes(), 512, 0);
}

int dsv4__attention_fast_union_wg_ready(void) {
  return per_device_cached(ready_cache, uwg_ready_probe);
}

template <bool CK>
static cudaError_t uwg_launch(const attn_params_t &p, dim3 grid, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  return uwg_launch_kernel(dsv4__attention_fast_union_wg_kernel<CK>, limit_raised, p, grid, 512,
                           uwg_smem_bytes(), s, pdl);
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
