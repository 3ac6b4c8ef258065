/*
 * The fast window kernel's CTAs of 64 heads (MT = 4, four warpgroups) on Hopper's warpgroup MMAs:
 * the kernel of attention-fast-window.cuh with its two tensor-core steps issued by warpgroups, both
 * operands read from shared memory by descriptors, instead of each warp's mma.sync on fragments it
 * loads itself. Built for sm_90a only (wgmma has no other target); dsv4__attention_fast_wg_ready
 * says whether the current device runs it.
 *
 * Why: with mma.sync a CTA of 16 warps loads its operands warp by warp, 768 KiB of shared memory
 * for the scores (each of the 4 m-tiles' warps reloads its candidates, each of the 4 candidate
 * groups' warps its queries) and 768 KiB for the weighted sums (the records again for every
 * m-tile), about 6 k cycles each at 128 bytes a cycle, and the weighted sums' 4096 mma.sync (two
 * weight planes) take as long again in the tensor cores. A warpgroup MMA reads its A operand once
 * for the group's four warps and runs at twice mma.sync's rate: 384 KiB for the scores, 256 KiB
 * for the weighted sums.
 *
 * The operands lie as the staging puts them (swz_atoms, attention-fast.cuh): rows in groups of 8
 * whose 128-byte pieces form the 1 KiB atoms of the 128-byte swizzle, which both K-major operands
 * (q and the records for the scores, the weights for the sums) and the MN-major one (the records
 * as V: rows are its K, their dims its N) read as they are.
 *   scores  warpgroup g: candidates 32 g.. of the 64 heads, m64n32k16 over 32 k-steps of 16 dims,
 *           each from zero and added to the total in fp32 as fast_scores adds each mma.sync's
 *           partial (four k-steps in flight, the oldest added while the newer ones run)
 *   output  warpgroup g: dims 128 g.. of the 64 heads in two chunks of 64, m64n64k16 over the
 *           window's k-steps of 16 rows, the hi plane then the lo plane each step, accumulated in
 *           the tensor cores as fast_pv accumulates; then o = N / D and the stores (or a split's
 *           N) as fast_output's, the first chunk's while the second chunk's MMAs run
 * Warp w of warpgroup g holds, of every n8 tile of the group's result, rows 16 w.. in mma.sync's
 * m16n8 fragment: warp 4 g + w is the mma.sync kernel's warp of m-tile w and of candidates (or
 * dims) group g, so the kernel's stores take the fragments as they are, and the bytes are the
 * mma.sync kernel's (gpu_attn_fast_test compares them).
 *
 * Ordering (SPEC §5.2) is the kernel's: the MMAs read only shared memory staged after the wait.
 */
#include "../attention-fast-window.cuh"
#include "attention-wg.cuh"

/* Without sm_90a's features the MMAs below would compile to nothing (CMake builds this file for
 * that architecture alone). */
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90a/attention_fast_wg.cu is built for sm_90a only"
#endif

/* The window kernel's Ops on warpgroup MMAs (fast_mma_ops' counterpart, attention-fast-window.cuh):
 * the rows' layout and alignment, the proxy fence before the barriers, the zero tail, the scores
 * and the weighted sums with the output. */
struct fast_wg_ops {
  using L = swz_atoms;                        /* the staged rows in the 128-byte swizzle */
  static constexpr uint32_t ALIGN = AWG_ATOM; /* whose atoms start on 1 KiB boundaries */
  /* Generic-proxy stores to shared memory made visible to the MMAs' (async-proxy) reads, before
   * the barrier after them. */
  static __device__ void publish() {
    wg_proxy_fence();
  }

  /* The weighted sums read every row of the window (an MMA in a loop of n's length would serialize
   * every MMA of the kernel): rows n.. hold zeros and their weights are zero. */
  static __device__ uint32_t tail_end(uint32_t) {
    return DSV4_WINDOW;
  }

  /* The scores of warpgroup g's 32 candidates (all of them: the kernel's store puts -inf past n,
   * and an MMA under a branch would serialize every MMA of the kernel), k-step by k-step, AWG_KF
   * of them in flight: each k-step's partial is added to the total, in k-step order, once it has
   * landed, while the later ones run. */
  template <int MT, int NP>
  static __device__ void scores(const uint8_t *sq, const uint8_t *sk, uint32_t n, uint32_t warp,
                                uint32_t lane, float (&acc)[2 * NP][4]) {
    static_assert(MT == 4 && NP == 2, "64 heads, 32 candidates a warpgroup");
    (void)n, (void)lane;
    constexpr int KS = DSV4_HEAD_DIM / 16;
    const uint32_t qa = smem_addr(sq), ka = smem_addr(sk) + (warp >> 2) * 4 * AWG_GROUP_K;
    float d[AWG_KF][16] = {};
#pragma unroll
    for (int b = 0; b < AWG_KF; b++)
      wg_tie(d[b]);
#pragma unroll
    for (int ks = 0; ks < KS + AWG_KF - 1; ks++) {
      if (ks < KS) {
        const uint32_t off = (ks >> 2) * AWG_ATOM + (ks & 3) * AWG_KSTEP;
        wg_fence(); /* the buffer's last reads (the adds below) come before the MMA writes it */
        awg_mma_n32(d[ks % AWG_KF], awg_desc_k(qa + off, AWG_GROUP_K),
                    awg_desc_k(ka + off, AWG_GROUP_K));
        wg_commit();
      }
      const int done = ks - (AWG_KF - 1); /* the k-step whose partial is added now */
      if (done < 0)
        continue;
      awg_wait_kstep(KS - 1 - done);
      wg_tie(d[done % AWG_KF]);
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++)
          acc[j][i] += d[done % AWG_KF][4 * j + i];
    }
  }

  /* N of warpgroup g's 128 dims over the window's rows (zero weights past n), in two chunks of 64
   * dims, then the output (or a split's N): the first chunk's stores run while the second
   * chunk's MMAs do. */
  template <int MT, int W>
  static __device__ void output(const attn_params_t &p, const attn_misc_t &ms,
                                const fast_misc_t &fm, const uint8_t *sp, const uint8_t *sk,
                                uint8_t *so, float *cn, uint32_t n, uint32_t t, uint32_t h_first,
                                uint32_t split, uint32_t warp, uint32_t lane) {
    static_assert(MT == 4 && W == 16, "64 heads, 128 dims a warpgroup");
    (void)cn; /* never a cluster split: those have one m-tile */
    (void)n;
    const uint32_t g = warp >> 2, mt = warp & 3;
    const uint32_t pa = smem_addr(sp), pla = smem_addr(sp + 16 * MT * P_ROW);
    float d[2][32];
#pragma unroll
    for (int ch = 0; ch < 2; ch++) {
#pragma unroll
      for (int i = 0; i < 32; i++)
        d[ch][i] = 0.0f;
      wg_tie(d[ch]);
    }
    wg_fence();
#pragma unroll
    for (int ch = 0; ch < 2; ch++) {
      const uint32_t va = smem_addr(sk) + (2 * g + ch) * AWG_ATOM;
#pragma unroll
      for (uint32_t k = 0; k < DSV4_WINDOW / 16; k++) {
        const uint32_t off = (k >> 2) * AWG_ATOM + (k & 3) * AWG_KSTEP;
        const uint64_t v = awg_desc(va + 2 * k * AWG_GROUP_K, AWG_ATOM, AWG_GROUP_K);
        awg_mma_n64(d[ch], awg_desc_k(pa + off, AWG_GROUP_P), v);
        awg_mma_n64(d[ch], awg_desc_k(pla + off, AWG_GROUP_P), v);
      }
      wg_commit();
    }
#pragma unroll
    for (int ch = 0; ch < 2; ch++) {
      if (ch == 0)
        wg_wait_group<1>();
      else
        wg_wait_group<0>();
      wg_tie(d[ch]);
      float a[8][4];
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++)
          a[j][i] = d[ch][4 * j + i];
      if (p.nsplit == 1) {
        fast_store_out_tile(p, ms, fm, t, h_first, mt, 128 * g + 64 * ch, lane,
                            so + warp * OUT_TILE, a);
      } else {
        fast_store_part<8>(p, t, h_first, mt * 16 + (lane >> 2), 128 * g + 64 * ch, split, lane, a);
        __syncwarp(); /* its stores branch by lane (heads % 8 != 0); the next wait is .aligned */
      }
    }
  }
};

/* The weights' planes (sp, sp + 16 KiB) start on 1 KiB boundaries, as sk (fast_wg_ops::ALIGN)
 * and q do. */
static_assert(fast_ss_bytes(4) % AWG_ATOM == 0 && 16 * 4 * P_ROW % AWG_ATOM == 0,
              "the weights' atoms on 1 KiB boundaries");

#define AWG_KERNEL dsv4__attention_fast_kernel<4, false, 16, fast_wg_ops>
/* The kernel's dynamic shared memory: room to start the rows on a 1 KiB boundary. */
#define AWG_SMEM (fast_smem_bytes(4) + AWG_ATOM - 16)

static std::atomic<int> ready_cache[DEV_CACHE];

/* The kernel's only image is sm_90a's: elsewhere its attributes cannot be read. */
static int wg_ready_probe(int dev) {
  cudaFuncAttributes fa;
  return cudaFuncGetAttributes(&fa, AWG_KERNEL) == cudaSuccess &&
         smem_grants(dev, AWG_SMEM + fa.sharedSizeBytes);
}

int dsv4__attention_fast_wg_ready(void) {
  return per_device_cached(ready_cache, wg_ready_probe);
}

cudaError_t dsv4__attention_fast_wg_launch(const attn_params_t &p, dim3 grid, cudaStream_t s,
                                           int pdl) {
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  const size_t smem = AWG_SMEM;
  cudaError_t e = dsv4__cuda_smem_limit(AWG_KERNEL, smem, limit_raised);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(AWG_KERNEL, grid, 32 * 16, smem, s, pdl, p);
}

#ifdef DSV4_PHASE_PROBE
long long dsv4__attention_fast_wg_phases(double cycles[7]) {
  return dsv4__phase_take(cycles);
}
#endif
