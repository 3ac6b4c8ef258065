/*
 * The fast union kernel's CTAs of 64 heads on Hopper's warpgroup MMAs, warp-specialised: the
 * kernel of attention_fast_union_wg.cu (same entry points; CMake builds one of the two, this one
 * with -DDSV4_UNION_WS=ON) with a producer warpgroup that stages each tile while two math
 * warpgroups compute on the one before it. Built for sm_90a only.
 *
 * Why: in the four-warpgroup kernel every warp stages, then computes, each phase behind a barrier,
 * so a tile's staging (the copies' wait, the dequantisation) and its MMAs add up; and each
 * warpgroup reads all of q for its 16 candidates' scores and the weights twice for its two chunks
 * of 64 dims. Here:
 *   producer  warpgroup 2 (88 registers a thread, setmaxnreg): per tile, the next tile's
 *             addresses (one thread a candidate, with L2 prefetches), then each warp's records
 *             (rows w, w + 4, ..., four in flight) loaded from the cache, dequantised (dequant8,
 *             exact) and stored in the 128-byte swizzle into one of two buffers, zeros past the
 *             tile's candidates; the buffer handed over by a named barrier, and taken back once
 *             both math warpgroups have finished its weighted sums
 *   scores    math warpgroup g (208 registers, setmaxnreg): candidates 32 g.. of the 64 heads,
 *             m64n32k16 over 32 k-steps in chains of two (the first from zero, the second
 *             accumulated in the tensor cores), each chain's partial added in fp32 (two in flight)
 *   softmax   online, from the registers: each head's maximum over the quad's lanes and the two
 *             math warpgroups (shared memory); the weights as bf16 pairs, hi and lo planes, into
 *             shared memory for both warpgroups; each thread keeps its part of a head's S
 *   sums      math warpgroup g: dims 256 g.. of the 64 heads (128 registers a thread), rescaled by
 *             a, then m64n256k16 over the tile's 4 k-steps, the hi plane then the lo plane
 * The end is the four-warpgroup kernel's, from warps of 16 heads and 256 dims.
 *
 * Ordering (SPEC §5.2) is the union kernel's (union_setup): before griddepcontrol.wait a CTA reads
 * only its parameters and the sinks; the MMAs read only shared memory staged after the wait.
 */
#include "../attention-split.h"
#include "attention-union-wg.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90a/attention_fast_union_ws.cu is built for sm_90a only"
#endif

#define UWS_BUF ((size_t)UWG_T * K_ROW)
#define UWS_THREADS 384u
#define UWS_MATH 256u
#define UWS_PROD 128u
/* Registers a thread of the math and of the producer warpgroups (setmaxnreg: multiples of 8) */
#define UWS_REGS_MATH 208
#define UWS_REGS_PROD 88
static_assert((size_t)8 * OUT_TILE <= UWS_BUF, "the output tiles in the first buffer");
static_assert(2 * UWG_T <= DSV4_WINDOW, "two tiles' addresses in ms.rec");

/* The probe build's last mark, after the math warps only (the producer has left). */
#ifdef DSV4_PHASE_PROBE
#define UWS_PHASE_END(k)                                                                           \
  do {                                                                                             \
    uwg_sync<2>();                                                                                 \
    PHASE_MARK(k);                                                                                 \
    if (threadIdx.x == 0)                                                                          \
      atomicAdd(&dsv4__phase_cycles[DSV4_PHASE_SLOTS - 1], 1ull);                                  \
  } while (0)
#else
#define UWS_PHASE_END(k) ((void)0)
#endif

/* Named barriers (0 is __syncthreads): a buffer full (producer arrives, math waits), a buffer
 * empty (math arrives, producer waits), the math warpgroups, the producer warpgroup. */
enum { UWS_BAR_FULL = 1, UWS_BAR_EMPTY = 3, UWS_BAR_PROD = 6 };

/* The dynamic shared memory: two record buffers, q, the weights' two planes (all on 1 KiB
 * boundaries), and room to start them on a boundary. */
static constexpr size_t uws_smem_bytes() {
  return 2 * UWS_BUF + (size_t)64 * K_ROW + (size_t)2 * 64 * UWG_P_ROW + AWG_ATOM - 16;
}

static __device__ __forceinline__ void uws_bar_sync(uint32_t id, uint32_t n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

static __device__ __forceinline__ void uws_bar_arrive(uint32_t id, uint32_t n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

static __device__ __forceinline__ void uws_regs_math(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(UWS_REGS_MATH) : "memory");
#endif
}

static __device__ __forceinline__ void uws_regs_producer(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(UWS_REGS_PROD) : "memory");
#endif
}

/* Tile `first` of nt candidates, whose addresses ms holds from slot0 on, into buffer sk by the
 * producer (pt: its thread, 0..127): warp w's rows w, w + 4, ..., four in flight: lane l < 28
 * loads and dequantises NoPE chunk l, lanes 28..31 move two chunks of RoPE dims each; zeros in the
 * rows nt..; published to the MMAs (the caller's barrier hands the buffer over). */
static __device__ void uws_produce(const attn_misc_t &ms, uint8_t *sk, uint32_t slot0, uint32_t nt,
                                   uint32_t pt) {
  const uint32_t w = pt >> 5, lane = pt & 31;
  const uint32_t j = lane < 28 ? lane : 28 + 2 * (lane - 28); /* the first chunk it reads */
  const uint32_t c = lane < 28 ? 2 * lane : 56 + 2 * (lane - 28);
  for (uint32_t s0 = w; s0 < nt; s0 += 16) {
    uint4 a[4], b[4];
    uint32_t code[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const uint32_t s = s0 + 4 * r;
      if (s < nt) {
        const uint4 *rec = reinterpret_cast<const uint4 *>(ms.rec[slot0 + s]);
        a[r] = __ldcg(rec + j);
        if (lane >= 28)
          b[r] = __ldcg(rec + j + 1);
        code[r] = __ldcg(ms.scl[slot0 + s] + (lane >> 2));
      }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const uint32_t s = s0 + 4 * r;
      if (s >= nt)
        continue;
      if (lane < 28) {
        b[r] = dequant8(a[r].z, a[r].w, code[r]);
        a[r] = dequant8(a[r].x, a[r].y, code[r]);
      }
      /* a quarter warp's lanes 0..3 the even places first, 4..7 the odd ones: no bank twice */
      const bool odd = (lane >> 2) & 1;
      *reinterpret_cast<uint4 *>(sk + swz_atoms::at(s, c + odd, K_ROW)) = odd ? b[r] : a[r];
      *reinterpret_cast<uint4 *>(sk + swz_atoms::at(s, c + !odd, K_ROW)) = odd ? a[r] : b[r];
    }
  }
  for (uint32_t i = pt; i < (UWG_T - nt) * 64; i += UWS_PROD)
    *reinterpret_cast<uint4 *>(sk + swz_atoms::at(nt + (i >> 6), i & 63, K_ROW)) =
        make_uint4(0, 0, 0, 0);
  wg_proxy_fence();
}

/* The producer warpgroup: the split's tiles into the two buffers in turn, each taken back once the
 * math warpgroups have read it (after the first two). A tile's addresses are resolved (with their
 * L2 prefetches) while the tile before it is staged, into the other half of ms.rec's 128 slots. */
template <bool CK>
static __device__ void uws_producer(const attn_params_t &p, attn_misc_t &ms, union_misc_t &um,
                                    uint8_t *sk0, uint32_t lo, uint32_t hi) {
  uws_regs_producer();
  const uint32_t pt = threadIdx.x - UWS_MATH;
  if (lo < hi)
    union_addrs<true, CK>(p, ms, um, lo, min(hi - lo, (uint32_t)UWG_T), &um.bad, pt, 0);
  uws_bar_sync(UWS_BAR_PROD, UWS_PROD);
  uint32_t i = 0;
  for (uint32_t first = lo; first < hi; first += UWG_T, i++) {
    const uint32_t b = i & 1, next = first + UWG_T;
    if (next < hi) /* into the slots the tile before this one used */
      union_addrs<true, CK>(p, ms, um, next, min(hi - next, (uint32_t)UWG_T), &um.bad, pt,
                            UWG_T * (b ^ 1));
    if (i >= 2)
      uws_bar_sync(UWS_BAR_EMPTY + b, UWS_THREADS);
    uws_produce(ms, sk0 + b * UWS_BUF, UWG_T * b, min(hi - first, (uint32_t)UWG_T), pt);
    uws_bar_arrive(UWS_BAR_FULL + b, UWS_THREADS);
    uws_bar_sync(UWS_BAR_PROD, UWS_PROD); /* this tile's slots read, the next one's written */
  }
}

/* The math warpgroups over the split's tiles: each buffer once the producer hands it over, given
 * back after its weighted sums while the producer has a tile for it. */
static __device__ void uws_math(const uint8_t *sq, uint8_t *sp, const uint8_t *sk0, float *red,
                                uint32_t lo, uint32_t hi, uint32_t warp, uint32_t lane,
                                float (&d)[128], float (&m)[2], float (&sum)[2]) {
  const uint32_t g = warp >> 2;
  uint32_t i = 0;
  for (uint32_t first = lo; first < hi; first += UWG_T, i++) {
    const uint32_t b = i & 1, nt = min(hi - first, (uint32_t)UWG_T);
    const uint8_t *cur = sk0 + b * UWS_BUF;
    uws_bar_sync(UWS_BAR_FULL + b, UWS_THREADS);
    PHASE_MARK(UPH_STAGE);
    float acc[16] = {}, a[2];
    awg_scores<32>(smem_addr(sq), smem_addr(cur) + g * 4 * AWG_GROUP_K, acc);
    PHASE_MARK(UPH_SCORES);
    uwg_softmax<2, 4>(acc, red, sp, nt, warp, lane, m, sum, a);
    wg_proxy_fence(); /* the weights, for the MMAs */
    uwg_sync<2>();
    PHASE_MARK(UPH_SOFTMAX);
    uwg_sums_issue(sp, cur, a, g, d);
    uwg_sums_wait(d);
    if (first + 2 * UWG_T < hi)
      uws_bar_arrive(UWS_BAR_EMPTY + b, UWS_THREADS);
    PHASE_MARK(UPH_SUM);
  }
}

/* CK: a split launch of at most UNION_CHECK_ALL_MAX tokens, whose CTAs check what they read
 * (union_setup). */
template <bool CK>
__global__ void __launch_bounds__(UWS_THREADS, 1)
    dsv4__attention_fast_union_ws_kernel(attn_params_t p) {
  extern __shared__ uint4 smem_dyn[];
  __shared__ attn_misc_t ms;
  __shared__ union_misc_t um;
  __shared__ fast_misc_t fm;
  __shared__ float red[2 * 64]; /* a float a math warpgroup and head */
  uint8_t *sk = reinterpret_cast<uint8_t *>(smem_dyn);
  sk += smem_align_pad<AWG_ATOM>(smem_dyn);
  uint8_t *sq = sk + 2 * UWS_BUF;
  uint8_t *sp = sq + (size_t)64 * K_ROW;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, split = blockIdx.y;
  const uint32_t t = blockIdx.x / p.groups, h_first = (blockIdx.x - t * p.groups) * 64;
  PHASE_START();
  if (funion_begin<CK>(p, 64, t, h_first, ms, um, fm))
    return;
  const uint32_t nc = um.nc, per = dsv4__union_split_span(nc, p.nsplit);
  const uint32_t lo = min(split * per, nc), hi = min(lo + per, nc);
  /* q by the math warps, for every tile */
  if (lo < hi && tid < UWS_MATH && !p.q_raw)
    fast_copy_q<4, 8, swz_atoms>(p, t, h_first, sq);
  else if (lo < hi && tid < UWS_MATH)
    fast_load_q<4, 8, swz_atoms>(p, t, h_first, sq, ms.rope);
  dsv4__cp_async_wait_all();
  wg_proxy_fence();
  __syncthreads();
  if (warp >= UWS_MATH / 32) {
    uws_producer<CK>(p, ms, um, sk, lo, hi);
    return;
  }
  uws_regs_math();
  float d[128], m[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 128; i++)
    d[i] = 0.0f;
  uws_math(sq, sp, sk, red, lo, hi, warp, lane, d, m, sum);
  uwg_state_out<2>(ms, um, red, warp, lane, m, sum);
  if (CK && p.nsplit > 1 && um.bad) { /* uniform: the producer's last hand-over came before */
    if (tid == 0)
      atomicOr(p.err, um.bad);
    return;
  }
#ifdef DSV4_TEST_DELAY_PARTS
  if (p.nsplit > 1)
    dsv4__test_delay(); /* as the mma.sync kernel's (attention_fast_union.cu) */
#endif
  uwg_end<2, 32>(p, ms, um, fm, sk, t, h_first, split, warp, lane, d);
  UWS_PHASE_END(UPH_OUTPUT);
}

static std::atomic<int> ready_cache[DEV_CACHE];

/* The registers the warpgroups take with setmaxnreg: no more than the launch allocates, or the
 * math warps' increase would wait for ever (uwg_probe). */
static int uws_ready_probe(int dev) {
  return uwg_probe(dev, dsv4__attention_fast_union_ws_kernel<false>,
                   dsv4__attention_fast_union_ws_kernel<true>, uws_smem_bytes(), UWS_THREADS,
                   (int)(UWS_MATH * UWS_REGS_MATH + UWS_PROD * UWS_REGS_PROD));
}

int dsv4__attention_fast_union_wg_ready(void) {
  return per_device_cached(ready_cache, uws_ready_probe);
}

template <bool CK>
static cudaError_t uws_launch(const attn_params_t &p, dim3 grid, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  return uwg_launch_kernel(dsv4__attention_fast_union_ws_kernel<CK>, limit_raised, p, grid,
                           UWS_THREADS, uws_smem_bytes(), s, pdl);
}

cudaError_t dsv4__attention_fast_union_wg_launch(const attn_params_t &p, dim3 grid, cudaStream_t s,
                                                 int pdl) {
  return p.check_all && p.nsplit > 1 ? uws_launch<true>(p, grid, s, pdl)
                                     : uws_launch<false>(p, grid, s, pdl);
}

#ifdef DSV4_PHASE_PROBE
long long dsv4__attention_fast_union_wg_phases(double cycles[7]) {
  return dsv4__phase_take(cycles);
}
#endif
