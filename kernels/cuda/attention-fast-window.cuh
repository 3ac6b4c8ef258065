#ifndef DSV4_KERNELS_CUDA_ATTENTION_FAST_WINDOW_CUH
#define DSV4_KERNELS_CUDA_ATTENTION_FAST_WINDOW_CUH
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
 * A CTA of W warps takes one query token and 16 MT heads (MT = 1, 2 or 4 m-tiles of 16 heads;
 * W = 8 for one m-tile, 16 for more: one CTA an SM, whose serial instruction stream is the time,
 * so the more warps share it the sooner it ends):
 *   stage   q_out's rows and the window's records copied into shared memory asynchronously, the
 *           records as soon as the window's blocks are known (the launch's check runs under the
 *           copies), then their NoPE bytes dequantised to bf16 in place (swizzled for ldmatrix)
 *   scores  warp w: m-tile w % MT, candidates (w / MT) 128 MT / W.. of the 128, mma m16n8k16 over
 *           the 512 dims
 *   softmax warp w: heads w, w + W, ...: max, w, S, D (with the sink), lse, the weights as bf16
 *   output  warp w: m-tile w % MT, dims (w / MT) 512 MT / W.., 64 at a time: mma over the
 *           candidates, then o = N / D, inverse RoPE, bf16, through the warp's tile in shared
 *           memory to whole 128-byte rows of the output
 * On sm_90a a CTA of 64 heads issues its scores and weighted sums as warpgroup MMAs instead (the
 * kernel's Ops, sm90a/attention_fast_wg.cu): the same fragments in the same warps, the same bytes.
 * Split windows (flash-decoding), when a launch's CTAs fill less than half the device (a decode
 * step of a few tokens; attention-split.h): the grid's y holds nsplit = 2, 4 or 8 splits, and split
 * s stages, scores and weighs only the window's candidates 128 s / nsplit.. (128 / nsplit of them:
 * at one decode token each CTA walks 16 candidates instead of 128). Its softmax keeps m and S over
 * those alone and it writes its partial state (N unnormalised, m, S) instead of the output; a split
 * past a short window writes N = 0, m = -inf, S = 0. The union's combine kernel
 * (attention_fast_union.cu) then merges the splits in fixed order and ends the softmax; the bytes
 * are deterministic for a launch of that shape. Where the launcher splits (always one m-tile) and
 * the device can hold them, the splits of a token's head group run as one thread-block cluster
 * instead (fast_cluster_end): each keeps its partial state in its shared memory and, after the
 * cluster's barrier, split s ends heads s 16 / nsplit.. from every split's state over the cluster's
 * shared memory, with the combine kernel's arithmetic in its order: the same bytes, without the
 * second launch or the partial states' round trip through device memory.
 * Ordering (SPEC §5.2) as the exact kernel: nothing but the parameters and the sinks is read before
 * griddepcontrol.wait; a launch whose check finds a bad token writes nothing (no partial state
 * either, and the combine, seeing the error word, writes nothing).
 */
#include "attention-fast.cuh"
#include "attention-split.h"
#include "phase-probe.cuh"

#include <cooperative_groups.h>

/* The phases of a CTA the probe build times (phase-probe.cuh; dsv4__cuda_attention_fast_phases). */
enum { PH_WAIT, PH_WINDOW, PH_SETUP, PH_STAGE, PH_SCORES, PH_SOFTMAX, PH_OUTPUT };

/* Shared memory of a CTA of MT m-tiles: the window (bf16, 128 rows of 1 KiB), then q (16 MT rows
 * of 1 KiB), whose space the scores and the weights (hi and lo) take once the scores are made.
 * The scores' space then holds the warps' output tiles (OUT_TILE each): at least their size. */
static constexpr __host__ __device__ size_t fast_ss_bytes(int mt) {
  return (size_t)16 * mt * S_STRIDE * 4 > (size_t)fast_warps(mt) * OUT_TILE
             ? (size_t)16 * mt * S_STRIDE * 4
             : (size_t)fast_warps(mt) * OUT_TILE;
}
static constexpr size_t fast_q_bytes(int mt) {
  return (size_t)16 * mt * K_ROW > fast_ss_bytes(mt) + (size_t)16 * mt * 2 * P_ROW
             ? (size_t)16 * mt * K_ROW
             : fast_ss_bytes(mt) + (size_t)16 * mt * 2 * P_ROW;
}
static constexpr size_t fast_smem_bytes(int mt) {
  return (size_t)DSV4_WINDOW * K_ROW + fast_q_bytes(mt);
}

/*
 * Warp per head (heads warp, warp + W, ...): the maximum m, the weights w = exp(l - m)
 * (fast_weights), S and D = S + exp(sink - m), lse = m + log S; a split's m and S into its partial
 * state (into cms, in shared memory, for a cluster split).
 */
template <int MT, int W, class L>
static __device__ void fast_softmax(const attn_params_t &p, const float *ss, uint8_t *sp,
                                    fast_misc_t &fm, float2 *cms, uint32_t t, uint32_t h_first,
                                    uint32_t split, uint32_t warp, uint32_t lane) {
  constexpr int HPW = 16 * MT / W;
  float m[HPW], sum[HPW];
#pragma unroll
  for (int i = 0; i < HPW; i++)
    m[i] = -INFINITY;
  fast_weights<HPW, W, L>(ss, sp, sp + 16 * MT * P_ROW, warp, lane, m, sum);
  if (lane != 0)
    return;
#pragma unroll
  for (int i = 0; i < HPW; i++) {
    const uint32_t h = warp + W * i;
    if (cms) {
      cms[h] = make_float2(m[i], sum[i]); /* a cluster split's m and S, in its shared memory */
    } else if (p.nsplit > 1) {
      if (h_first + h < p.heads) /* a split's partial m and S: the combine ends the softmax */
        part_ms(p)[((uint64_t)t * p.heads + h_first + h) * p.nsplit + split] =
            make_float2(m[i], sum[i]);
    } else {
      fm.den[h] = fast_den(p, sum[i], m[i], fm.sink[h]);
      if (p.lse && h_first + h < p.heads)
        p.lse[(uint64_t)t * p.heads + h_first + h] = fast_lse(m[i], sum[i]);
    }
  }
}

/* Floats a row of a cluster split's N takes in its shared memory: 512 and a pad, so that the quads'
 * float2 stores into 8 rows fall in different banks. */
#define CL_N_STRIDE 520
/* Where a cluster split keeps N: past the 64 rows of the window that a split's candidates can take
 * (128 / nsplit of them, nsplit >= 2). */
#define CL_N_OFF ((size_t)64 * K_ROW)
static_assert((size_t)16 * CL_N_STRIDE * sizeof(float) <= (size_t)64 * K_ROW, "N beside the rows");

/* A cluster split's state beside its N: each head's (m, S), and whether its check stopped it. */
typedef struct {
  float2 ms[16];
  uint32_t stop;
} fast_cl_t;

/* N of n-tile j of dims d0.. of heads h and h + 8 into the cluster split's rows cn (a lane holds
 * dims d, d + 1 of two heads, as in fast_store_part). */
template <int NT>
static __device__ __forceinline__ void
fast_cluster_put_n(float *cn, uint32_t h, uint32_t d0, uint32_t lane, const float (&acc)[NT][4]) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    float *row = cn + (size_t)(h + 8 * half) * CL_N_STRIDE;
#pragma unroll
    for (int j = 0; j < NT; j++)
      *reinterpret_cast<float2 *>(row + d0 + 8 * j + 2 * (lane & 3)) =
          make_float2(acc[j][2 * half], acc[j][2 * half + 1]);
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/*
 * Split `split` of a cluster of NS ends heads split 16 / NS.. of the CTA's 16 from every split's
 * partial state in the cluster's shared memory, as the combine kernel (attention_fast_union.cu)
 * ends a (token, head): the same arithmetic in the same order, so the same bytes. 128 threads a
 * head, 4 dims each; a thread's 8 remote loads (8 / NS heads of NS splits) are all in flight
 * before the first sum.
 */
template <int NS>
static __device__ void fast_cluster_combine(const attn_params_t &p, const attn_misc_t &ms,
                                            const fast_misc_t &fm, fast_cl_t &cl, float *cn,
                                            uint32_t t, uint32_t h_first, uint32_t split) {
  constexpr int HC = 16 / NS, ITEMS = HC / 2;
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const uint32_t i = threadIdx.x & 127, h0 = split * HC + (threadIdx.x >> 7);
  float2 v[ITEMS][NS];
  float4 x[ITEMS][NS];
#pragma unroll
  for (int it = 0; it < ITEMS; it++)
#pragma unroll
    for (int s = 0; s < NS; s++) {
      const uint32_t hl = h0 + 2 * it;
      v[it][s] = cluster.map_shared_rank(&cl, s)->ms[hl];
      x[it][s] = reinterpret_cast<const float4 *>(cluster.map_shared_rank(cn, s) +
                                                  (size_t)hl * CL_N_STRIDE)[i];
    }
#pragma unroll
  for (int it = 0; it < ITEMS; it++) {
    const uint32_t hl = h0 + 2 * it, h = h_first + hl;
    if (h >= p.heads)
      continue;
    float m = -INFINITY, sum = 0.0f;
#pragma unroll
    for (int s = 0; s < NS; s++)
      m = fmaxf(m, v[it][s].x); /* finite: split 0 holds the window's first candidates */
    float4 n = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int s = 0; s < NS; s++)
      fast_merge_term(v[it][s], x[it][s], m, sum, n);
    fast_merge_out(p, m, sum, n, fm.sink[hl], ms.rope, t, h, i);
  }
}
#endif

/*
 * The end of a cluster split (one m-tile): a split without candidates (n = 0) puts N = 0, m = -inf,
 * S = 0 where the others put their partial states, every CTA its stop, then the cluster's barrier
 * makes them visible to all. Unless a CTA of the cluster stopped (the launch's check is the same
 * for all of a token's CTAs; a stop seen by any is honoured by all, so that the cluster's barriers
 * are met by every CTA), each split ends its heads (fast_cluster_combine). A second barrier keeps
 * every CTA's shared memory until the others have read it.
 */
static __device__ void fast_cluster_end(const attn_params_t &p, const attn_misc_t &ms,
                                        const fast_misc_t &fm, fast_cl_t &cl, float *cn, int stop,
                                        uint32_t n, uint32_t t, uint32_t h_first, uint32_t split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (!stop && n == 0) {
    for (uint32_t i = threadIdx.x; i < 16 * DSV4_HEAD_DIM / 4; i += blockDim.x) {
      float *row = cn + (size_t)(i / (DSV4_HEAD_DIM / 4)) * CL_N_STRIDE;
      reinterpret_cast<float4 *>(row)[i % (DSV4_HEAD_DIM / 4)] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (threadIdx.x < 16)
      cl.ms[threadIdx.x] = make_float2(-INFINITY, 0.0f);
  }
  if (threadIdx.x == 0)
    cl.stop = (uint32_t)stop;
#ifndef DSV4_TEST_BROKEN_CLUSTER_EARLY_READ
  cluster.sync(); /* release and acquire: every split's state is visible to every split */
#else
  /* Test-only (gpu_attn_split_test's broken build): the states read before the barrier that
   * publishes them, while the delayed splits have not written theirs. */
  __syncthreads();
#endif
  uint32_t any = 0;
  for (uint32_t s = 0; s < p.nsplit; s++)
    any |= cluster.map_shared_rank(&cl, s)->stop;
  if (!any && p.nsplit == 2)
    fast_cluster_combine<2>(p, ms, fm, cl, cn, t, h_first, split);
  else if (!any && p.nsplit == 4)
    fast_cluster_combine<4>(p, ms, fm, cl, cn, t, h_first, split);
  else if (!any)
    fast_cluster_combine<8>(p, ms, fm, cl, cn, t, h_first, split);
  cluster.sync(); /* no CTA leaves while another still reads its shared memory */
#else
  (void)p, (void)ms, (void)fm, (void)cl, (void)cn, (void)stop, (void)n, (void)t, (void)h_first,
      (void)split;
  __trap(); /* launched on sm_90+ only (launch_fast_mt) */
#endif
}

/*
 * The weighted sums of the warp's m-tile over its DW = 512 MT / W dims: N = P_hi V + P_lo V over
 * the candidates 0..n16 - 1, then stored. The output in chunks of 64 dims through the warp's tile
 * (so: the scores' space, free after the softmax), each chunk's stores draining while the next
 * chunk's MMAs run; a split's N unnormalised into its partial state (into cn, in shared memory,
 * for a cluster split), in chunks of at most 128 dims (16 n-tiles of accumulators).
 */
template <int MT, int W>
static __device__ void fast_output(const attn_params_t &p, const attn_misc_t &ms,
                                   const fast_misc_t &fm, const uint8_t *sp, const uint8_t *sk,
                                   uint8_t *so, float *cn, uint32_t n, uint32_t t, uint32_t h_first,
                                   uint32_t split, uint32_t warp, uint32_t lane) {
  constexpr int DW = DSV4_HEAD_DIM * MT / W;
  constexpr int NT = DW / 8 < 16 ? DW / 8 : 16, CHUNKS = DW / 8 / NT;
  static_assert(DW % 64 == 0, "whole output tiles");
  const uint32_t mt = warp % MT, dw0 = (warp / MT) * DW;
  const uint32_t pa = smem_addr(sp), pla = smem_addr(sp + 16 * MT * P_ROW), ka = smem_addr(sk);
  const uint32_t kcs = ((n + 15) / 16) * 2;
  if (p.nsplit == 1) {
#pragma unroll 1
    for (int ch = 0; ch < DW / 64; ch++) {
      float acc[8][4] = {};
      fast_pv<8>(pa, pla, ka, mt, dw0 + 64 * ch, kcs, lane, acc);
      fast_store_out_tile(p, ms, fm, t, h_first, mt, dw0 + 64 * ch, lane, so + warp * OUT_TILE,
                          acc);
    }
    return;
  }
#pragma unroll 1
  for (int ch = 0; ch < CHUNKS; ch++) {
    const uint32_t d0 = dw0 + ch * 8 * NT;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
      acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    fast_pv<NT>(pa, pla, ka, mt, d0, kcs, lane, acc);
    if (cn)
      fast_cluster_put_n<NT>(cn, mt * 16 + (lane >> 2), d0, lane, acc);
    else
      fast_store_part<NT>(p, t, h_first, mt * 16 + (lane >> 2), d0, split, lane, acc);
  }
}

/* The window's n candidates from `first` on into rows 0..n - 1 (raw, fast_copy_record): warp w
 * copies candidates w, w + W, ..., whose addresses it reads from ms.blk. */
template <int W, class L>
static __device__ void fast_copy_window(const attn_params_t &p, const attn_misc_t &ms, uint8_t *sk,
                                        uint2 *sscl, uint32_t first, uint32_t n, uint32_t warp,
                                        uint32_t lane) {
  const int64_t lo = ms.lo, lb0 = lo >> p.bs_shift;
  const int64_t mask = ((int64_t)1 << p.bs_shift) - 1;
  for (uint32_t s = warp; s < n; s += W) {
    const int64_t pos = lo + first + s, o = pos & mask;
    const uint8_t *base = p.cache + (uint64_t)ms.blk[(pos >> p.bs_shift) - lb0] * p.stride;
    fast_copy_record<L>(sk, sscl, s, base + (uint64_t)o * DSV4_TOKEN_DATA_BYTES,
                        base + ((uint64_t)DSV4_TOKEN_DATA_BYTES << p.bs_shift) +
                            (uint64_t)o * DSV4_SCALE_BYTES,
                        lane);
  }
}

/*
 * The kernel's tensor-core steps on mma.sync: the scores of the warp's m-tile and its 16 NP
 * candidates (warps whose candidates all lie past n rest), and the weighted sums with the output
 * (fast_output). The warpgroup-MMA form (sm90a/attention_fast_wg.cu) gives the same fragments.
 */
struct fast_mma_ops {
  using L = swz_rows;                   /* the staged rows' layout */
  static constexpr uint32_t ALIGN = 16; /* and their alignment (ldmatrix's rows) */
  /* A thread's shared-memory stores made visible to the MMAs' reads, with the barrier after it:
   * nothing more is needed for mma.sync's fragments. */
  static __device__ void publish() {}
  /* The rows the weighted sums read: n rounded up to 16. */
  static __device__ uint32_t tail_end(uint32_t n) {
    return (n + 15) & ~15u;
  }
  template <int MT, int NP>
  static __device__ void scores(const uint8_t *sq, const uint8_t *sk, uint32_t n, uint32_t warp,
                                uint32_t lane, float (&acc)[2 * NP][4]) {
    if ((warp / MT) * 16 * NP < n) /* warp-uniform */
      fast_scores<MT, NP>(sq, sk, warp, lane, acc);
  }
  template <int MT, int W>
  static __device__ void output(const attn_params_t &p, const attn_misc_t &ms,
                                const fast_misc_t &fm, const uint8_t *sp, const uint8_t *sk,
                                uint8_t *so, float *cn, uint32_t n, uint32_t t, uint32_t h_first,
                                uint32_t split, uint32_t warp, uint32_t lane) {
    fast_output<MT, W>(p, ms, fm, sp, sk, so, cn, n, t, h_first, split, warp, lane);
  }
};

/* Where the staged rows start in the dynamic shared memory: at Ops::ALIGN, but on a 1 KiB boundary
 * for a CTA of 16 heads (mma.sync), whose time moved with where the static variables happen to end
 * (b = 16 6 % faster on a boundary; the 32-head CTAs 2.5 % slower there: tests/bench/NOTES.md). */
template <int MT, class Ops> static constexpr __host__ __device__ uint32_t fast_rows_align() {
  return MT == 1 && Ops::ALIGN < 1024 ? 1024u : Ops::ALIGN;
}

/* The dynamic shared memory a launch of the mma.sync kernel gives a CTA of MT m-tiles, with the
 * room fast_rows_align needs (the dynamic shared memory starts on a 16-byte boundary). */
template <int MT> static constexpr size_t fast_launch_smem() {
  return fast_smem_bytes(MT) + fast_rows_align<MT, fast_mma_ops>() - 16;
}

/* CL: the splits of a head group are one thread-block cluster (one m-tile only). Ops: the
 * tensor-core steps (fast_mma_ops, or the warpgroup MMAs' for 64 heads on sm_90a), whose ALIGN
 * says where the staged rows start in the dynamic shared memory (the launch gives ALIGN - 16 bytes
 * more than fast_smem_bytes). */
template <int MT, bool CL = false, int W = fast_warps(MT), class Ops = fast_mma_ops>
__global__ void __launch_bounds__(32 * W, 1) dsv4__attention_fast_kernel(attn_params_t p) {
  constexpr int NP = 8 * MT / W; /* pairs of n-tiles of candidates a warp scores */
  static_assert(!CL || MT == 1, "a cluster split ends 16 heads");
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ fast_misc_t fm;
  __shared__ fast_cl_t cl;
  __shared__ uint2 sscl[DSV4_WINDOW]; /* the staged records' scale bytes */
  using L = typename Ops::L;          /* the staged rows' layout */
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  constexpr uint32_t AL = fast_rows_align<MT, Ops>();
  if constexpr (AL > 16) /* the dynamic shared memory starts on a 16-byte boundary anyway */
    sk += smem_align_pad<AL>(smem_dyn);
  uint8_t *sq = sk + (size_t)DSV4_WINDOW * K_ROW;
  float *ss = reinterpret_cast<float *>(sq);
  uint8_t *sp = sq + fast_ss_bytes(MT);
  float *cn = CL ? reinterpret_cast<float *>(sk + CL_N_OFF) : nullptr;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, split = blockIdx.y;
  const uint32_t t = blockIdx.x / p.groups;
  const uint32_t h_first = (blockIdx.x - t * p.groups) * 16 * MT;
  PHASE_START();
  /* Before the wait: the sinks, immutable data. */
  if (tid < 16 * MT)
    fm.sink[tid] = p.sink && h_first + tid < p.heads ? p.sink[h_first + tid] : 0.0f;
#ifdef DSV4_TEST_BROKEN_FAST_EARLY_READ
  /* Test-only breakage of SPEC §5.2 (tests/gpu/gpu_inv_attn_wait.c, "fast"): the queries are
   * loaded before the wait, while the grid before this one may still be writing q_out. */
  fast_load_q<MT, W, L>(p, t, h_first, sq, ms.rope);
#endif
  dsv4__dep_wait_params(p);
  PHASE_MARK(PH_WAIT);
  dsv4__dep_trigger();
  /* Ahead of q's copies where a CTA has a token's heads to itself; a cluster's splits (a small
   * batch) load them with the rest of the window, which measured 0.25 us faster at b = 1. */
  const win_first_t wf = CL ? win_first_t{} : attn_window_first(p, t);
#ifdef DSV4_TEST_DELAY_CLUSTER
  /* Test-only: NaN where the split's N goes, so that a state read before it is written shows. */
  for (uint32_t i = tid; CL && i < 16 * CL_N_STRIDE; i += 32 * W)
    cn[i] = __uint_as_float(0x7fc00000u);
#endif
#ifndef DSV4_TEST_BROKEN_FAST_EARLY_READ
  if (!p.q_raw) /* q_out's rows land while the window and the check are read */
    fast_copy_q<MT, W, L>(p, t, h_first, sq);
#endif
  /* The window's records are copied as soon as its blocks are known (reading them needs no more
   * than that they lie in the pool); the launch's check runs under the copies. */
  const uint32_t bits = attn_window(p, t, ms, wf);
  const bool own_bad = __syncthreads_or(bits != 0);
  PHASE_MARK(PH_WINDOW);
  /* The CTA's candidates: the window, or split `split`'s part of it. */
  const uint32_t span = DSV4_WINDOW / p.nsplit, first = split * span;
  const uint32_t n = own_bad ? 0 : first < ms.n ? min(ms.n - first, span) : 0;
  fast_copy_window<W, L>(p, ms, sk, sscl, first, n, warp, lane);
  const int stop = attn_check(p, bits);
  if (stop || n == 0) {
    dsv4__cp_async_wait_all(); /* no copy outlives the CTA */
    if (CL) {
#ifdef DSV4_TEST_DELAY_CLUSTER
      if (split != 0)
        dsv4__test_delay();
#endif
      fast_cluster_end(p, ms, fm, cl, cn, stop, n, t, h_first, split);
    } else if (!stop) { /* a split past a short window (uniform: ms.n is the CTA's) */
      fast_empty_part(p, t, h_first, 16 * MT, split);
    }
    return;
  }
  PHASE_MARK(PH_SETUP);
#ifndef DSV4_TEST_BROKEN_FAST_EARLY_READ
  if (p.q_raw)
    fast_load_q<MT, W, L>(p, t, h_first, sq, ms.rope);
#endif
  dsv4__cp_async_wait_all();
  __syncthreads();
  fast_dequant_rows<W, L>(sk, sscl, n, warp, lane);
  fast_zero_tail<L>(sk, n, Ops::tail_end(n));
  Ops::publish(); /* the staged rows and q, for the MMAs' reads */
  __syncthreads();
  PHASE_MARK(PH_STAGE);
  {
    float acc[2 * NP][4] = {};
    Ops::template scores<MT, NP>(sq, sk, n, warp, lane, acc);
    __syncthreads(); /* every warp is done with q: its space takes the scores */
    fast_store_scores<MT, NP>(ss, warp, lane, n, acc);
  }
  __syncthreads();
  PHASE_MARK(PH_SCORES);
  fast_softmax<MT, W, L>(p, ss, sp, fm, CL ? cl.ms : nullptr, t, h_first, split, warp, lane);
  Ops::publish(); /* the weights */
  __syncthreads();
  PHASE_MARK(PH_SOFTMAX);
#ifdef DSV4_TEST_DELAY_CLUSTER
  /* Test-only (gpu_attn_split_test): every split but the first writes N 200 µs late. */
  if (CL && split != 0)
    dsv4__test_delay();
#endif
  Ops::template output<MT, W>(p, ms, fm, sp, sk, sq, cn, n, t, h_first, split, warp, lane);
  if (CL)
    fast_cluster_end(p, ms, fm, cl, cn, 0, n, t, h_first, split);
  PHASE_END(PH_OUTPUT);
}

/* The kernel of 64 heads on warpgroup MMAs (sm90a/attention_fast_wg.cu), where
 * dsv4__attention_fast_wg_ready() says the current device runs it (compute capability 9.0, whose
 * sm_90a image it has, granting its shared memory); a probe build's phases of it since the last
 * call (as dsv4__cuda_attention_fast_phases). */
cudaError_t dsv4__attention_fast_wg_launch(const attn_params_t &p, dim3 grid, cudaStream_t s,
                                           int pdl);
int dsv4__attention_fast_wg_ready(void);
#ifdef DSV4_PHASE_PROBE
long long dsv4__attention_fast_wg_phases(double cycles[7]);
#endif

#endif /* DSV4_KERNELS_CUDA_ATTENTION_FAST_WINDOW_CUH */
