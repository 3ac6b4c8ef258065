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
 * the same bytes as the one before. Every tile holds at least one candidate (the first, the query's
 * own position), so m is finite from a CTA's first tile on (a = 0 there, and N and S start from
 * zero).
 *
 * A CTA of W warps (attention-fast.cuh's fast_warps: 8 at MT = 1, 16 at MT = 2) takes one query
 * token and 16 MT heads (MT = 1 or 2: the accumulators N of the warp's 16 heads and 512 MT / W
 * dims, 256 MT / W floats a lane, live across the tiles in registers; on sm_90a, where such CTAs
 * would need another wave, a CTA of 64 heads on warpgroup MMAs instead: dsv4__union_choose_mt,
 * sm90a/attention_fast_union_wg.cu):
 *   q        copied once right after the wait (under the setup), swizzled, kept in shared
 *            memory for every tile
 *   per tile the records copied raw (a warp a record; their addresses from union_addrs, while the
 *            copies are in flight the next tile's, with L2 prefetches) and their NoPE
 *            bytes dequantised in place to bf16 (swizzled), the scores (warp
 *            w: m-tile w % MT, candidates (w / MT) 128 MT / W..), the online softmax (warp per
 *            head), then N rescaled and continued (warp w: m-tile w % MT, dims (w / MT) 512 MT /
 *            W..)
 *   end      D = S + exp(sink - m), lse = m + log S, o = N (1 / D), inverse RoPE, bf16, stored
 * Shared memory: 128 KiB of records, 16 MT KiB of queries, the scores (16 MT rows of 132 floats)
 * and the two weight planes (16 MT rows of 256 bytes each): about 193 KiB at MT = 2.
 *
 * Split lists (flash-decoding), when a launch's CTAs (tokens times head groups) fill less than half
 * the device: at one decode token there are 4 CTAs on 132 SMs, each walking 5 or more tiles in
 * turn. The launch then has nsplit splits (attention-split.h: as many as fit beside the CTAs, at
 * most 32, from the launch's shape only) in its grid's y: split s walks its share of the token's
 * list (candidates s span.., span = the list's length / nsplit rounded up to 16) in tiles of at
 * most 128 with the same online softmax and, instead of the end above, writes its partial state per
 * head: N unnormalised (512 floats), its maximum m and its sum S (a split without a candidate:
 * m = -inf, S = 0, N = 0). The combine kernel then merges the splits of a (token, head) in the
 * fixed order 0..nsplit - 1:
 *   M = max m_s, a_s = exp(m_s - M), S = sum of S_s a_s, N = sum of N_s a_s,
 *   D = S + exp(sink - M), lse = M + log S, o = N (1 / D), inverse RoPE, bf16, stored,
 * with the end's arithmetic (fast_den, fast_lse, fast_out_pair). Every sum keeps one order, so a
 * split launch is as deterministic as an unsplit one; its output differs from it by the rounding of
 * the rescales, within the same tolerances of exact mode. nsplit = 1 is the path above, with no
 * partial state and no combine. A combine CTA of 128 threads takes one (token, head), 4 dims a
 * thread.
 *
 * Ordering (SPEC §5.2) as the exact union kernel: before griddepcontrol.wait a CTA reads only its
 * parameters and the sinks; the check kernel (attention.cu) runs first, or, for a launch of at most
 * UNION_CHECK_ALL_MAX tokens, the CTAs check it after the wait (union_setup: unsplit, each the
 * whole launch; split, each its token's window and the entries it reads), and a CTA that finds an
 * error or its error word set returns before writing anything (a split: its partial state). The
 * combine waits before it reads the partial states (the union kernel's, complete after the wait) or
 * anything else but its parameters and the sinks, and writes nothing once the error word is set;
 * the next launch on the stream writes partial states only after its own wait, once the combine has
 * completed.
 */
#include "attention-fast-union.cuh"
#include "attention-split.h"

/* Threads of a combine CTA: one (token, head), 4 of its 512 dims each. */
#define COMBINE_THREADS 128

#ifdef DSV4_TEST_TUNE
/* Test-only (cuda-kernels.h): the splits of every fast union launch; 0 = the launcher's choice. */
unsigned dsv4__cuda_test_union_splits;
#endif

/* Where the dynamic shared memory's buffers start: on a 1 KiB boundary, not wherever the static
 * variables end, which moves with their size and moves the kernels' time with it (the window
 * kernel's 16-head CTAs 6 % faster on a boundary, its 32-head ones 2.5 % slower:
 * tests/bench/NOTES.md); the union kernel's were measured on one. */
#define FUNION_ALIGN 1024u

static constexpr size_t funion_smem_bytes(int mt) {
  return (size_t)DSV4_WINDOW * K_ROW + (size_t)16 * mt * (K_ROW + S_STRIDE * 4 + 2 * P_ROW) +
         FUNION_ALIGN - 16;
}

/*
 * One tile of 128 candidates of the online softmax, warp per head (heads warp, warp + W, ...): the
 * new maximum m' (ms.m) and the weights exp(l - m') as bf16 pairs into the two weight planes
 * (fast_weights, layout L), the rescale a = exp(m - m') of the earlier tiles (alpha), and S = S a +
 * the tile's sum (um.s).
 */
template <int MT, int W, class L = swz_rows>
static __device__ void funion_softmax(const float *ss, uint8_t *sp, attn_misc_t &ms,
                                      union_misc_t &um, float *alpha, uint32_t warp,
                                      uint32_t lane) {
  constexpr int HPW = 16 * MT / W;
  float m_old[HPW], m[HPW], sum[HPW];
#pragma unroll
  for (int i = 0; i < HPW; i++)
    m_old[i] = m[i] = ms.m[warp + W * i];
  fast_weights<HPW, W, L>(ss, sp, sp + 16 * MT * P_ROW, warp, lane, m, sum);
  __syncwarp(); /* every lane has read ms.m before lane 0 replaces it */
  if (lane != 0)
    return;
#pragma unroll
  for (int i = 0; i < HPW; i++) {
    const uint32_t h = warp + W * i;
    const float a = __expf(m_old[i] - m[i]); /* 0 on the first tile (m_old = -inf) */
    um.s[h] = um.s[h] * a + sum[i];
    ms.m[h] = m[i];
    alpha[h] = a;
  }
}

/* N of the warp's m-tile and its NT n-tiles of dims rescaled by the heads' a, then continued over
 * the tile's nt candidates (rows nt..nt16 - 1 hold zeros and weights +0). */
template <int MT, int NT>
static __device__ void funion_accumulate(const uint8_t *sp, const uint8_t *sk, const float *alpha,
                                         uint32_t nt, uint32_t warp, uint32_t lane,
                                         float (&acc)[NT][4]) {
  const uint32_t mt = warp % MT, dw0 = (warp / MT) * 8 * NT;
  const uint32_t h = mt * 16 + (lane >> 2);
  const float a0 = alpha[h], a1 = alpha[h + 8];
#pragma unroll
  for (int j = 0; j < NT; j++) {
    acc[j][0] *= a0;
    acc[j][1] *= a0;
    acc[j][2] *= a1;
    acc[j][3] *= a1;
  }
  fast_pv<NT>(smem_addr(sp), smem_addr(sp + 16 * MT * P_ROW), smem_addr(sk), mt, dw0,
              ((nt + 15) / 16) * 2, lane, acc);
}

/* Tile `first` of nt candidates, whose addresses ms holds (union_addrs, before a barrier): records
 * copied (a warp each, candidates warp, warp + W, ...) and dequantised in place to bf16 (zeros up
 * to a multiple of 16), scores into ss (-inf past nt). While the copies are in flight the next
 * tile's nn addresses (none when nn = 0) replace the tile's in ms, with their L2 prefetches, so
 * that its copies find their lines in the L2. */
template <int MT, int W, bool CK>
static __device__ void funion_tile_scores(const attn_params_t &p, attn_misc_t &ms, union_misc_t &um,
                                          const uint8_t *sq, uint8_t *sk, uint2 *sscl, float *ss,
                                          uint32_t first, uint32_t nt, uint32_t nn, uint32_t warp,
                                          uint32_t lane) {
  for (uint32_t s = warp; s < nt; s += W)
    fast_copy_record(sk, sscl, s, ms.rec[s], ms.scl[s], lane);
  if (nn) {          /* CTA-uniform */
    __syncthreads(); /* every warp has issued its copies: the addresses may change */
    union_addrs<true, CK>(p, ms, um, first + DSV4_WINDOW, nn, &um.bad);
  }
  dsv4__cp_async_wait_all();
  __syncthreads();
  fast_dequant_rows<W>(sk, sscl, nt, warp, lane);
  fast_zero_tail(sk, nt, (nt + 15) & ~15u);
  __syncthreads();
  PHASE_MARK(UPH_STAGE);
  constexpr int NP = 8 * MT / W; /* pairs of n-tiles of candidates a warp scores */
  float acc[2 * NP][4] = {};
  if ((warp / MT) * 16 * NP < nt) /* warp-uniform: a warp whose candidates all lie past nt rests */
    fast_scores<MT, NP>(sq, sk, warp, lane, acc);
  fast_store_scores<MT, NP>(ss, warp, lane, nt, acc);
}

/* CK: a split launch of at most UNION_CHECK_ALL_MAX tokens, whose CTAs check what they read
 * (union_setup); its own instance, so that the others' tiles keep their code. */
template <int MT, bool CK = false, int W = fast_warps(MT)>
__global__ void __launch_bounds__(32 * W, 1) dsv4__attention_fast_union_kernel(attn_params_t p) {
  constexpr int NT = DSV4_HEAD_DIM * MT / W / 8; /* n-tiles of N's dims a warp accumulates */
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ union_misc_t um;
  __shared__ fast_misc_t fm;
  __shared__ float alpha[16 * MT];
  __shared__ uint2 sscl[DSV4_WINDOW]; /* the staged records' scale bytes */
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  sk += smem_align_pad<FUNION_ALIGN>(smem_dyn);
  uint8_t *sq = sk + (size_t)DSV4_WINDOW * K_ROW;
  float *ss = reinterpret_cast<float *>(sq + (size_t)16 * MT * K_ROW);
  uint8_t *sp = reinterpret_cast<uint8_t *>(ss + (size_t)16 * MT * S_STRIDE);
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, split = blockIdx.y;
  const uint32_t t = blockIdx.x / p.groups;
  const uint32_t h_first = (blockIdx.x - t * p.groups) * 16 * MT;
  PHASE_START();
  if (funion_begin<CK>(p, 16 * MT, t, h_first, ms, um, fm))
    return;
  /* The CTA's part of the list: candidates lo..hi - 1 (attention-split.h), in tiles of 128. */
  const uint32_t nc = um.nc, per = dsv4__union_split_span(nc, p.nsplit);
  const uint32_t lo = min(split * per, nc), hi = min(lo + per, nc);
  /* q is read once and kept for every tile, where the window's kernel reuses its space after
   * its one tile: q_out's rows copied after the setup (before it, the setup's dependent loads
   * waited behind them) to land beside the first tile's records, the fused path's raw rows
   * normalised here (with the RoPE row of the setup); made visible by the first tile's wait and
   * barriers. A split without a tile needs none. */
  if (lo < hi && !p.q_raw)
    fast_copy_q<MT, W>(p, t, h_first, sq);
  else if (lo < hi)
    fast_load_q<MT, W>(p, t, h_first, sq, ms.rope);
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  if (lo < hi) /* the first tile's addresses; each tile puts the next one's (funion_tile_scores) */
    union_addrs<false, CK>(p, ms, um, lo, min(hi - lo, (uint32_t)DSV4_WINDOW), &um.bad);
  __syncthreads();
  for (uint32_t first = lo; first < hi; first += DSV4_WINDOW) {
    const uint32_t nt = min(hi - first, (uint32_t)DSV4_WINDOW);
    const uint32_t nn = first + nt < hi ? min(hi - first - nt, (uint32_t)DSV4_WINDOW) : 0u;
    funion_tile_scores<MT, W, CK>(p, ms, um, sq, sk, sscl, ss, first, nt, nn, warp, lane);
    __syncthreads();
    PHASE_MARK(UPH_SCORES);
    funion_softmax<MT, W>(ss, sp, ms, um, alpha, warp, lane);
    __syncthreads();
    PHASE_MARK(UPH_SOFTMAX);
    funion_accumulate<MT, NT>(sp, sk, alpha, nt, warp, lane, acc);
    __syncthreads(); /* the next tile rewrites the records and the weights */
    PHASE_MARK(UPH_SUM);
  }
  dsv4__cp_async_wait_all(); /* a split without a tile: no copy of q outlives the CTA */
  if (p.nsplit > 1) {
    if (CK && um.bad) { /* CTA-uniform after the last tile's barriers */
      if (tid == 0)
        atomicOr(p.err, um.bad);
      return;
    }
#ifdef DSV4_TEST_DELAY_PARTS
    /* Test-only (tests/gpu/gpu_inv_union_wait.c, "split"): the split has let the combine launch
     * and waits before it writes its partial state, so a combine that reads the partial states
     * before its wait reads stale ones. */
    dsv4__test_delay();
#endif
    funion_store_part<MT, NT>(p, ms, um, t, h_first, split, warp, lane, acc);
    PHASE_END(UPH_OUTPUT);
    return;
  }
  funion_finish<MT>(p, ms, um, fm, t, h_first);
  __syncthreads();
  /* The output through the warps' tiles in the records' space, free after the last tile. */
  static_assert(NT == 8, "a warp's dims are one output tile");
  fast_store_out_tile(p, ms, fm, t, h_first, warp % MT, (warp / MT) * 8 * NT, lane,
                      sk + warp * OUT_TILE, acc);
  PHASE_END(UPH_OUTPUT);
}

/*
 * Merges the nsplit partial states of one (token, head) in order 0..nsplit - 1 (the file's
 * comment), thread i dims 4 i..4 i + 3; a split window launch (attention_fast.cu) ends here too.
 * The error word set by the check or the splits' kernel (or an earlier kernel of the batch):
 * nothing written.
 */
template <uint32_t MS>
__global__ void __launch_bounds__(COMBINE_THREADS)
    dsv4__attention_fast_combine_kernel(attn_params_t p) {
  static_assert(MS <= DSV4_UNION_MAX_SPLITS, "the pairs' shared array");
  static_assert(COMBINE_THREADS >= DSV4_UNION_MAX_SPLITS, "a thread a split's pair");
  const uint32_t t = blockIdx.x / p.heads, h = blockIdx.x - t * p.heads, i = threadIdx.x;
  const uint64_t k0 = ((uint64_t)t * p.heads + h) * p.nsplit;
  __shared__ float2 sv[DSV4_UNION_MAX_SPLITS]; /* the splits' pairs (m, S) */
  /* Before the wait: the sink, immutable data. */
  const float sink = p.sink ? p.sink[h] : 0.0f;
#ifdef DSV4_TEST_BROKEN_COMBINE_EARLY_READ
  /* Test-only breakage of SPEC §5.2 (tests/gpu/gpu_inv_union_wait.c, "split"): the splits' pairs
   * (m, S) are loaded before the wait, while the union kernel before this one may still be writing
   * them. */
  const float2 early = i < p.nsplit ? part_ms(p)[k0 + i] : make_float2(0.0f, 0.0f);
#endif
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  /* Every load of the merge is issued before the error word's check, so that their latencies
   * overlap instead of following one another: thread s < nsplit split s's pair, every thread its 4
   * dims of every split's N (the splits past the last with a candidate too, which are not used),
   * the rotated dims' threads the query position. Nothing reaches device memory before the check
   * (only the pairs' shared array is written), and what was loaded is used only after it. */
  if (i < p.nsplit)
#ifndef DSV4_TEST_BROKEN_COMBINE_EARLY_READ
    sv[i] = part_ms(p)[k0 + i];
#else
    sv[i] = early;
#endif
  float4 x[MS];
#pragma unroll
  for (uint32_t s = 0; s < MS; s++)
    if (s < p.nsplit)
      x[s] = reinterpret_cast<const float4 *>(p.part + (k0 + s) * DSV4_HEAD_DIM)[i];
  const bool rotated = 4 * i >= DSV4_NOPE_DIM;
  const int64_t pos = rotated ? token_pos(p, t) : 0; /* used once the check has passed */
  if (__syncthreads_or(i == 0 && __ldcg(p.err) != 0))
    return;
  float m = -INFINITY, sum = 0.0f;
  uint32_t used = 0; /* the splits up to the last one with a candidate */
  for (uint32_t s = 0; s < p.nsplit; s++) {
    const float ms_s = sv[s].x;
    m = fmaxf(m, ms_s); /* finite: split 0 holds the list's first candidates */
    used = ms_s != -INFINITY ? s + 1 : used;
  }
  /* The terms in order. The splits from `used` on hold no candidate (m = -inf, S = 0, N = 0: a
   * term of a = 0, which adds +0 to sums that are never -0): a one-token list of 640 candidates
   * fills 20 of 32 splits. */
  float4 n = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (uint32_t s = 0; s < MS; s++)
    if (s < used)
      fast_merge_term(sv[s], x[s], m, sum, n);
  /* The query position's RoPE row, for the dims that are rotated (with the engine's windows the
   * position is their last). */
  const float *rope =
      rotated ? reinterpret_cast<const float *>(p.rope) + (uint64_t)pos * DSV4_ROPE_ROW_FLOATS
              : nullptr;
  fast_merge_out(p, m, sum, n, sink, rope, t, h, i);
}

template <int MT, bool CK>
static cudaError_t launch_funion_mt(const attn_params_t &p, dim3 grid, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  const size_t smem = funion_smem_bytes(MT);
  cudaError_t e =
      dsv4__cuda_smem_limit(dsv4__attention_fast_union_kernel<MT, CK>, smem, limit_raised);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(dsv4__attention_fast_union_kernel<MT, CK>, grid,
                                32 * fast_warps(MT), smem, s, pdl, p);
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

static std::atomic<int> force_wg{0};

extern "C" void dsv4__cuda_attention_fast_union_force_wg(int on) {
  force_wg.store(on, std::memory_order_relaxed);
}

extern "C" int dsv4__cuda_attention_fast_union_wg(void) {
  return dsv4__cuda_attention_fast_wg() && dsv4__attention_fast_union_wg_ready();
}

/* A launch's shape: MT (4: the warpgroup kernel), the head groups and the splits (the test build
 * may force the splits; the tests may force the warpgroup kernel wherever the device runs it). */
static void funion_shape(uint32_t n_tokens, uint32_t heads, int sms, int *mt, uint32_t *groups,
                         uint32_t *nsplit) {
  const bool wg = heads > 32 && dsv4__cuda_attention_fast_union_wg();
  *mt = wg && force_wg.load(std::memory_order_relaxed)
            ? 4
            : dsv4__union_choose_mt(n_tokens, heads, sms, wg);
  *groups = (heads + 16u * *mt - 1) / (16u * *mt);
  *nsplit = dsv4__union_splits((uint64_t)n_tokens * *groups, sms);
#ifdef DSV4_TEST_TUNE
  if (dsv4__cuda_test_union_splits)
    *nsplit = dsv4__cuda_test_union_splits < DSV4_UNION_MAX_SPLITS ? dsv4__cuda_test_union_splits
                                                                   : DSV4_UNION_MAX_SPLITS;
#endif
}

#ifdef DSV4_PHASE_PROBE
/* The mma.sync kernels' and the warpgroup-MMA kernel's phases together, each CTA counted once. */
extern "C" long long dsv4__cuda_attention_fast_union_phases(double cycles[7]) {
  static_assert(UPH_OUTPUT < DSV4_PHASE_SLOTS - 1, "a slot a phase");
  return dsv4__phase_take_with(cycles, dsv4__attention_fast_union_wg_phases);
}
#endif

extern "C" uint32_t dsv4__cuda_attention_fast_union_heads_per_block(uint32_t n_tokens,
                                                                    uint32_t heads) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  int mt;
  uint32_t groups, nsplit;
  funion_shape(n_tokens, heads, dev.sms, &mt, &groups, &nsplit);
  return 16u * (uint32_t)mt;
}

extern "C" uint32_t dsv4__cuda_attention_fast_union_splits(uint32_t n_tokens, uint32_t heads) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  return dsv4__attention_fast_union_splits(n_tokens, heads, dev.sms);
}

uint32_t dsv4__attention_fast_union_splits(uint32_t n_tokens, uint32_t heads, int sms) {
  int mt;
  uint32_t groups, nsplit;
  funion_shape(n_tokens, heads, sms, &mt, &groups, &nsplit);
  return nsplit;
}

cudaError_t dsv4__attention_fast_union_launch(attn_params_t p, int sms, cudaStream_t s, int pdl) {
  int mt;
  funion_shape(p.n_tokens, p.heads, sms, &mt, &p.groups, &p.nsplit);
  const uint64_t ctas = (uint64_t)p.n_tokens * p.groups, rows = (uint64_t)p.n_tokens * p.heads;
  if (ctas > 0x7fffffffu || rows > 0x7fffffffu)
    return cudaErrorInvalidValue;
  const dim3 grid((unsigned)ctas, p.nsplit, 1);
  const bool ck = p.check_all && p.nsplit > 1; /* union_setup */
  cudaError_t e = mt == 4   ? dsv4__attention_fast_union_wg_launch(p, grid, s, pdl)
                  : mt == 1 ? (ck ? launch_funion_mt<1, true>(p, grid, s, pdl)
                                  : launch_funion_mt<1, false>(p, grid, s, pdl))
                            : (ck ? launch_funion_mt<2, true>(p, grid, s, pdl)
                                  : launch_funion_mt<2, false>(p, grid, s, pdl));
  if (e != cudaSuccess || p.nsplit == 1)
    return e;
  return dsv4__attention_fast_combine_launch(p, s, pdl);
}

cudaError_t dsv4__attention_fast_combine_launch(const attn_params_t &p, cudaStream_t s, int pdl) {
  const uint64_t rows = (uint64_t)p.n_tokens * p.heads;
  if (rows > 0x7fffffffu || p.nsplit > DSV4_UNION_MAX_SPLITS)
    return cudaErrorInvalidValue;
  /* The kernel whose registers hold the launch's splits' N: 8 (a window's splits at most), 16 or
   * 32, so that a launch of few splits keeps its threads' registers few. */
  if (p.nsplit <= 8)
    return dsv4__cuda_launch(dsv4__attention_fast_combine_kernel<8>, (unsigned)rows,
                             COMBINE_THREADS, s, pdl, p);
  if (p.nsplit <= 16)
    return dsv4__cuda_launch(dsv4__attention_fast_combine_kernel<16>, (unsigned)rows,
                             COMBINE_THREADS, s, pdl, p);
  return dsv4__cuda_launch(dsv4__attention_fast_combine_kernel<DSV4_UNION_MAX_SPLITS>,
                           (unsigned)rows, COMBINE_THREADS, s, pdl, p);
}
