/*
 * The fast window kernel's launches (attention-fast-window.cuh says what the kernel does): its CTA
 * shape, the splits and their clusters, and on Hopper the warpgroup-MMA form of its 64-head CTAs
 * (sm90a/attention_fast_wg.cu).
 */
#include "attention-fast-window.cuh"

#ifdef DSV4_TEST_TUNE
/* Test-only (cuda-kernels.h): 1 = a split window launch ends in the combine kernel; the launches
 * queued as clusters. */
unsigned dsv4__cuda_test_window_combine, dsv4__cuda_test_window_cluster_launches;
#endif

/* The launch configuration of a cluster launch (grid's y: the splits, one cluster of them). */
static cudaLaunchConfig_t fast_cluster_config(const attn_params_t &p, dim3 grid, cudaStream_t s,
                                              int pdl, cudaLaunchAttribute (&attr)[2]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(32 * fast_warps(1), 1, 1);
  cfg.dynamicSmemBytes = fast_launch_smem<1>();
  cfg.stream = s;
  attr[0] = {};
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = p.nsplit;
  attr[0].val.clusterDim.z = 1;
  attr[1] = {};
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  return cfg;
}

/*
 * The window's splits as clusters (fast_cluster_end), when the current device can run a cluster of
 * p.nsplit such CTAs at once (asked once per device and split count; devices from 64 on at every
 * launch): cudaSuccess, or cudaErrorNotSupported where it cannot or the launch failed (then
 * nothing was queued, and that device and split count take the combine kernel from then on).
 */
static cudaError_t launch_fast_cluster(const attn_params_t &p, dim3 grid, cudaStream_t s, int pdl) {
  static std::atomic<uint64_t> limit_raised{0};
  static std::atomic<uint32_t> known[64]; /* bit k: asked for 2^k splits; bit 8 + k: it can */
  void (*k)(attn_params_t) = dsv4__attention_fast_kernel<1, true>;
  cudaError_t e = dsv4__cuda_smem_limit(k, fast_launch_smem<1>(), limit_raised);
  int dev = 0;
  if (e == cudaSuccess)
    e = cudaGetDevice(&dev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  const uint32_t lg = p.nsplit >= 8 ? 3 : p.nsplit >= 4 ? 2 : 1;
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = fast_cluster_config(p, grid, s, pdl, attr);
  uint32_t st = dev >= 0 && dev < 64 ? known[dev].load(std::memory_order_acquire) : 0;
  if (!(st & (1u << lg))) {
    int clusters = 0;
    cudaLaunchConfig_t one = cfg;
    one.gridDim = dim3(1, p.nsplit, 1);
    one.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&clusters, k, &one) != cudaSuccess) {
      (void)cudaGetLastError();
      clusters = 0;
    }
    st = (1u << lg) | (clusters > 0 ? 1u << (8 + lg) : 0u);
    if (dev >= 0 && dev < 64)
      known[dev].fetch_or(st, std::memory_order_release);
  }
  if (!(st & (1u << (8 + lg))))
    return cudaErrorNotSupported;
  if (cudaLaunchKernelEx(&cfg, k, p) == cudaSuccess) {
#ifdef DSV4_TEST_TUNE
    dsv4__cuda_test_window_cluster_launches++;
#endif
    return cudaSuccess;
  }
  /* Not queued: the launch takes the combine kernel, now and from here on. */
  (void)cudaGetLastError();
  if (dev >= 0 && dev < 64)
    known[dev].fetch_and(~(1u << (8 + lg)), std::memory_order_release);
  return cudaErrorNotSupported;
}

static std::atomic<int> force_sync{0};

extern "C" void dsv4__cuda_attention_fast_force_sync(int on) {
  force_sync.store(on, std::memory_order_relaxed);
}

extern "C" int dsv4__cuda_attention_fast_wg(void) {
  return !force_sync.load(std::memory_order_relaxed) && dsv4__attention_fast_wg_ready();
}

template <int MT>
static cudaError_t launch_fast_mt(const attn_params_t &p, dim3 grid, cudaStream_t s, int pdl) {
  if (MT == 4 && dsv4__cuda_attention_fast_wg())
    return dsv4__attention_fast_wg_launch(p, grid, s, pdl);
  static std::atomic<uint64_t> limit_raised{0}; /* the devices whose limit is raised */
  const size_t smem = fast_launch_smem<MT>();
  cudaError_t e = dsv4__cuda_smem_limit(dsv4__attention_fast_kernel<MT>, smem, limit_raised);
  if (e != cudaSuccess)
    return e;
  return dsv4__cuda_launch_smem(dsv4__attention_fast_kernel<MT>, grid, 32 * fast_warps(MT), smem, s,
                                pdl, p);
}

extern "C" int dsv4__cuda_attention_fast_supported(int dev) {
  int optin = 0, major = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return major >= 9 && (size_t)optin >= fast_smem_bytes(4) + sizeof(attn_misc_t) +
                                            sizeof(fast_misc_t) + DSV4_WINDOW * sizeof(uint2);
}

#ifdef DSV4_PHASE_PROBE
/* The mma.sync kernels' and the warpgroup-MMA kernel's phases together, each CTA counted once. */
extern "C" long long dsv4__cuda_attention_fast_phases(double cycles[7]) {
  static_assert(PH_OUTPUT < DSV4_PHASE_SLOTS - 1, "a slot a phase");
  return dsv4__phase_take_with(cycles, dsv4__attention_fast_wg_phases);
}
#endif

extern "C" uint32_t dsv4__cuda_attention_fast_heads_per_block(uint32_t n_tokens, uint32_t heads) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  return 16u * (uint32_t)choose_mt(n_tokens, heads ? heads : 1, dev.sms, 4);
}

/* A launch's shape: MT, the head groups and the splits (the test build may force the splits,
 * rounded down to a power of two). */
static void fast_shape(uint32_t n_tokens, uint32_t heads, int sms, int *mt, uint32_t *groups,
                       uint32_t *nsplit) {
  *mt = choose_mt(n_tokens, heads ? heads : 1, sms, 4);
  *groups = (heads + 16u * *mt - 1) / (16u * *mt);
  *nsplit = dsv4__window_splits((uint64_t)n_tokens * *groups, sms);
#ifdef DSV4_TEST_TUNE
  if (dsv4__cuda_test_union_splits)
    *nsplit = dsv4__window_split_count(dsv4__cuda_test_union_splits);
#endif
}

uint32_t dsv4__attention_fast_splits(uint32_t n_tokens, uint32_t heads, int sms) {
  int mt;
  uint32_t groups, nsplit;
  fast_shape(n_tokens, heads, sms, &mt, &groups, &nsplit);
  return nsplit;
}

extern "C" uint32_t dsv4__cuda_attention_fast_splits(uint32_t n_tokens, uint32_t heads) {
  dsv4__cuda_dev_t dev;
  if (dsv4__cuda_dev_info(&dev))
    return 0;
  return dsv4__attention_fast_splits(n_tokens, heads, dev.sms);
}

cudaError_t dsv4__attention_fast_launch(attn_params_t p, int sms, cudaStream_t s, int pdl) {
  int mt;
  fast_shape(p.n_tokens, p.heads, sms, &mt, &p.groups, &p.nsplit);
  const uint64_t ctas = (uint64_t)p.n_tokens * p.groups;
  if (ctas > 0x7fffffffu || (uint64_t)p.n_tokens * p.heads > 0x7fffffffu)
    return cudaErrorInvalidValue;
  const dim3 grid((unsigned)ctas, p.nsplit, 1);
  int cluster = mt == 1 && p.nsplit > 1;
#ifdef DSV4_TEST_TUNE
  cluster = cluster && !dsv4__cuda_test_window_combine;
#endif
  if (cluster) {
    cudaError_t e = launch_fast_cluster(p, grid, s, pdl);
    if (e != cudaErrorNotSupported)
      return e;
  }
  if (p.nsplit > 1 && !p.part)
    return cudaErrorInvalidValue;
  cudaError_t e;
  switch (mt) {
  case 1:
    e = launch_fast_mt<1>(p, grid, s, pdl);
    break;
  case 2:
    e = launch_fast_mt<2>(p, grid, s, pdl);
    break;
  default:
    e = launch_fast_mt<4>(p, grid, s, pdl);
    break;
  }
  if (e != cudaSuccess || p.nsplit == 1)
    return e;
  return dsv4__attention_fast_combine_launch(p, s, pdl);
}
