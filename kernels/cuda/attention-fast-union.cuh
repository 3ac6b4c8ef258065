#ifndef DSV4_KERNELS_CUDA_ATTENTION_FAST_UNION_CUH
#define DSV4_KERNELS_CUDA_ATTENTION_FAST_UNION_CUH
/*
 * What the fast union kernels share (attention_fast_union.cu on mma.sync, sm90a/
 * attention_fast_union_wg.cu on warpgroup MMAs): the probe's phases, a CTA's start and its end
 * (the denominators and lse, or a split's partial state).
 */
#include "attention-fast.cuh"
#include "attention-union.cuh"
#include "phase-probe.cuh"

/* The phases of a union CTA the probe build times (phase-probe.cuh), each tile's added up. */
enum { UPH_WAIT, UPH_SETUP, UPH_STAGE, UPH_SCORES, UPH_SOFTMAX, UPH_SUM, UPH_OUTPUT };

/* A union CTA's start, for its nh heads from h_first of token t: the sinks (immutable data, before
 * the wait), the dependency wait, and the setup (union_setup, CK its split_checks). 1 when the CTA
 * stops there (every thread of it), with nothing in flight. */
template <bool CK>
static __device__ int funion_begin(const attn_params_t &p, uint32_t nh, uint32_t t,
                                   uint32_t h_first, attn_misc_t &ms, union_misc_t &um,
                                   fast_misc_t &fm) {
  const uint32_t tid = threadIdx.x;
  if (tid < nh)
    fm.sink[tid] = p.sink && h_first + tid < p.heads ? p.sink[h_first + tid] : 0.0f;
#ifdef DSV4_TEST_BROKEN_UNION_EARLY_READ
  union_early_count(p, t, um);
#endif
  dsv4__dep_wait_params(p);
  PHASE_MARK(UPH_WAIT);
  dsv4__dep_trigger();
  if (union_setup(p, t, ms, um, CK))
    return 1;
  PHASE_MARK(UPH_SETUP);
  return 0;
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

/* The partial state of split `split` for each of the CTA's heads: N from the warps' accumulators,
 * m and S one thread per head. */
template <int MT, int NT>
static __device__ void funion_store_part(const attn_params_t &p, const attn_misc_t &ms,
                                         const union_misc_t &um, uint32_t t, uint32_t h_first,
                                         uint32_t split, uint32_t warp, uint32_t lane,
                                         const float (&acc)[NT][4]) {
  fast_store_part<NT>(p, t, h_first, (warp % MT) * 16 + (lane >> 2), (warp / MT) * 8 * NT, split,
                      lane, acc);
  const uint32_t hh = threadIdx.x;
  if (hh < 16 * MT && h_first + hh < p.heads)
    part_ms(p)[((uint64_t)t * p.heads + h_first + hh) * p.nsplit + split] =
        make_float2(ms.m[hh], um.s[hh]);
}

/* The kernel of 64 heads on warpgroup MMAs (sm90a/attention_fast_union_wg.cu), where
 * dsv4__attention_fast_union_wg_ready() says the current device runs it (compute capability 9.0,
 * whose sm_90a image it has, granting its shared memory); a probe build's phases of it since the
 * last call (as dsv4__cuda_attention_fast_union_phases). */
cudaError_t dsv4__attention_fast_union_wg_launch(const attn_params_t &p, dim3 grid, cudaStream_t s,
                                                 int pdl);
int dsv4__attention_fast_union_wg_ready(void);
#ifdef DSV4_PHASE_PROBE
long long dsv4__attention_fast_union_wg_phases(double cycles[7]);
#endif

#endif /* DSV4_KERNELS_CUDA_ATTENTION_FAST_UNION_CUH */
