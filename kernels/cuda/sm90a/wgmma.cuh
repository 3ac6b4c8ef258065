#ifndef DSV4_KERNELS_CUDA_SM90A_WGMMA_CUH
#define DSV4_KERNELS_CUDA_SM90A_WGMMA_CUH
/*
 * The warpgroup MMAs' ordering instructions, for the sm_90a kernels (indexer_wgmma.cu,
 * attention_fast_wg.cu); without sm_90a's features they compile to nothing.
 */

static __device__ __forceinline__ void wg_fence(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void wg_commit(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

/* Until at most N of the warpgroup's MMA groups are pending. */
template <int N> static __device__ __forceinline__ void wg_wait_group(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

/* d's registers are read or written only after this point (after a wait), or before it (before a
 * fence): the empty asm ties them to it. */
template <int R> static __device__ __forceinline__ void wg_tie(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; i++)
    asm volatile("" : "+f"(d[i])::"memory");
}

/* Generic-proxy stores to shared memory made visible to the MMAs' reads (before a barrier). */
static __device__ __forceinline__ void wg_proxy_fence(void) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#endif /* DSV4_KERNELS_CUDA_SM90A_WGMMA_CUH */
