/*
 * The producer: sequence block tables -> one cache slot per token (SPEC §4), the device twin of
 * cpu_map_slots. One thread per token; a few integer operations and two dependent loads each, so
 * the grid is as small as the batch allows and the kernel's cost is its launch and its latency.
 *
 * Under programmatic dependent launch the kernel first lets its dependent (the insert kernel)
 * launch, so that kernel's prologue overlaps this one; the dependent still waits for this grid's
 * completion before it reads a slot (cuda-kernels.h, SPEC §5.2).
 */
#include "cuda-internal.cuh"

#include "dsv4-error.h"

#define MAP_BLOCK 256

typedef struct {
  dsv4_map_args_t a;
  uint32_t bs_shift; /* log2(block_size) */
} map_params_t;

#ifdef DSV4_TEST_DELAY_PRODUCER
/*
 * Test-only (tests/gpu/gpu_inv_no_early_read.c): the producer has triggered its dependents and
 * then waits this long before it writes a slot, so a consumer that reads slots before its
 * dependency wait reads the stale ones.
 */
#define TEST_DELAY_NS 200000ull
static __device__ __forceinline__ uint64_t globaltimer(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

__global__ void __launch_bounds__(MAP_BLOCK) dsv4__map_slots_kernel(map_params_t p) {
  __shared__ int64_t s_first[MAP_BLOCK];
  __shared__ uint32_t s_off[MAP_BLOCK], s_len[MAP_BLOCK];
  dsv4__dep_trigger();
  /* The inputs may have been written by the kernel this launch overlaps. */
  dsv4__dep_wait();
#ifdef DSV4_TEST_DELAY_PRODUCER
  uint64_t t0 = globaltimer();
  while (globaltimer() - t0 < TEST_DELAY_NS)
    __nanosleep(1000);
#endif
  const dsv4_map_args_t *a = &p.a;
  const uint32_t t = blockIdx.x * MAP_BLOCK + threadIdx.x;
  const int in = t < a->n_tokens;
  /* The token's loads and, for up to MAP_BLOCK segments, every segment's entry are issued together,
   * so only the block-table load waits for another: two memory latencies instead of three. */
  int32_t s = in ? a->tok_seg[t] : -1;
  int64_t pos = in ? a->positions[t] : -1;
  const int staged = a->n_segments <= MAP_BLOCK;
  if (staged && threadIdx.x < a->n_segments) {
    s_first[threadIdx.x] = a->seg_first_lb[threadIdx.x];
    s_off[threadIdx.x] = a->seg_bt_off[threadIdx.x];
    s_len[threadIdx.x] = a->seg_bt_len[threadIdx.x];
  }
  __syncthreads();
  if (!in)
    return;
  const int64_t bs = a->block_size;
  int64_t slot = -1;
  /* The host validated the batch (cuda-kernels.h); these checks only keep a bad one in bounds. */
  if (s >= 0 && (uint32_t)s < a->n_segments && pos >= 0) {
    int64_t first = staged ? s_first[s] : a->seg_first_lb[s];
    uint32_t off = staged ? s_off[s] : a->seg_bt_off[s];
    uint32_t len = staged ? s_len[s] : a->seg_bt_len[s];
    int64_t idx = (pos >> p.bs_shift) - first;
    if (idx >= 0 && idx < (int64_t)len) {
      int32_t b = a->block_table[(uint64_t)off + (uint64_t)idx];
      if (b >= 0 && (uint32_t)b < a->n_blocks)
        slot = (int64_t)b * bs + (pos & (bs - 1));
    }
  }
  a->slots[t] = slot;
}

extern "C" int dsv4__cuda_map_slots(const dsv4_map_args_t *a, cudaStream_t s, int pdl) {
  int rc = dsv4_backend_check_map_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  dsv4__cuda_dev_t dev;
  int err = dsv4__cuda_dev_info(&dev);
  if (err)
    return err;
  map_params_t p;
  p.a = *a;
  p.bs_shift = 0;
  while ((1u << p.bs_shift) < a->block_size)
    p.bs_shift++;
  uint32_t blocks = (a->n_tokens + MAP_BLOCK - 1) / MAP_BLOCK;
  if (blocks > 0x7fffffffu)
    return DSV4_EINVAL;
  return dsv4__cuda_err(
      dsv4__cuda_launch(dsv4__map_slots_kernel, blocks, MAP_BLOCK, s, pdl && dev.pdl, p));
}
