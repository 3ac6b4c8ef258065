/*
 * The producer: sequence block tables -> one cache slot per token (SPEC §4), the device twin of
 * cpu_map_slots. One thread per token and a few integer operations, so the grid is as small as the
 * batch allows and the kernel's cost is its launch and its memory latency, which is on the
 * critical path of every forward (the consumer waits for this grid to complete). So every thread
 * issues all of its block's loads at once, into registers, before it stores any of them to shared
 * memory: its token's segment and position, one segment's entry (up to one per thread of the
 * block) and up to MAP_BT_PER_THREAD block-table entries (the whole table when the launch gives
 * its length and it has at most 4 entries per thread of the block; a decode batch's table is a few
 * entries per sequence). A token's slot is then one memory latency away instead of two (the
 * segment's entry, then the table entry it selects). Blocks have MAP_BLOCK threads, or one warp
 * when one warp covers the whole batch (at most 32 tokens, 32 segments and 128 table entries),
 * which shortens a small forward further (see tests/bench/NOTES.md, "Figures formerly quoted in
 * kernel comments", map_slots: the one-warp block).
 *
 * Under programmatic dependent launch the kernel first lets its dependent (the insert kernel)
 * launch, so that kernel's prologue overlaps this one; the dependent still waits for this grid's
 * completion before it reads a slot (cuda-kernels.h, SPEC §5.2). Before its own wait the kernel
 * prefetches the lines of all those loads into the L2: it is launched while the previous forward's
 * last blocks run, and its loads after the wait then find the lines in the L2 instead of DRAM
 * (when the kernel follows the copy of its metadata instead, the prefetch neither helps nor hurts;
 * see tests/bench/NOTES.md, "Figures formerly quoted in kernel comments", map_slots: the L2
 * prefetch).
 */
#include "cuda-internal.cuh"

#include "dsv4-error.h"

#define MAP_BLOCK 256
#define MAP_BT_PER_THREAD 4
#define MAP_SMALL 32 /* the block of a small batch */

typedef struct {
  dsv4_map_args_t a;
  uint32_t bs_shift; /* log2(block_size) */
} map_params_t;

template <int B> __global__ void __launch_bounds__(B) dsv4__map_slots_kernel(map_params_t p) {
  __shared__ int64_t s_first[B];
  __shared__ uint32_t s_off[B], s_len[B];
  __shared__ int32_t s_bt[B * MAP_BT_PER_THREAD];
  dsv4__dep_trigger();
  const dsv4_map_args_t *a = &p.a;
  const uint32_t x = threadIdx.x;
  const uint32_t t = blockIdx.x * B + x;
  const int in = t < a->n_tokens;
  const int seg_staged = a->n_segments <= B;
  const int seg_mine = seg_staged && x < a->n_segments;
  const uint32_t n_bt = a->bt_entries;
  const int bt_staged = n_bt > 0 && n_bt <= B * MAP_BT_PER_THREAD;
  /* The lines of every load below are prefetched into the L2 while the previous grid runs. */
  if (in) {
    dsv4__prefetch_l2(a->tok_seg + t);
    dsv4__prefetch_l2(a->positions + t);
  }
  if (seg_mine) {
    dsv4__prefetch_l2(a->seg_first_lb + x);
    dsv4__prefetch_l2(a->seg_bt_off + x);
    dsv4__prefetch_l2(a->seg_bt_len + x);
  }
#pragma unroll
  for (int k = 0; k < MAP_BT_PER_THREAD; k++)
    if (bt_staged && x + k * B < n_bt)
      dsv4__prefetch_l2(a->block_table + x + k * B);
#ifdef DSV4_TEST_BROKEN_EARLY_MAP_READ
  /* Test-only breakage of SPEC §5.2 (tests/gpu/gpu_inv_producer_wait.c): the block-table entries
   * are loaded before the wait, while the grid before this one may still be writing them. */
  int32_t early_bt[MAP_BT_PER_THREAD];
#pragma unroll
  for (int k = 0; k < MAP_BT_PER_THREAD; k++)
    early_bt[k] = bt_staged && x + k * B < n_bt ? a->block_table[x + k * B] : -1;
#endif
  /* The inputs may have been written by the kernel this launch overlaps. */
  dsv4__dep_wait_params(p);
#ifdef DSV4_TEST_DELAY_PRODUCER
  /* Test-only (tests/gpu/gpu_inv_no_early_read.c): the producer has triggered its dependents and
   * waits before it writes a slot, so a consumer that reads slots before its wait reads stale ones.
   */
  dsv4__test_delay();
#endif
  /* Every load first (see the top) ... */
  const int32_t s = in ? a->tok_seg[t] : -1;
  const int64_t pos = in ? a->positions[t] : -1;
  const int64_t my_first = seg_mine ? a->seg_first_lb[x] : 0;
  const uint32_t my_off = seg_mine ? a->seg_bt_off[x] : 0;
  const uint32_t my_len = seg_mine ? a->seg_bt_len[x] : 0;
  int32_t my_bt[MAP_BT_PER_THREAD];
#pragma unroll
  for (int k = 0; k < MAP_BT_PER_THREAD; k++) {
    const uint32_t i = x + k * B;
    my_bt[k] = bt_staged && i < n_bt ? a->block_table[i] : -1;
#ifdef DSV4_TEST_BROKEN_EARLY_MAP_READ
    my_bt[k] = early_bt[k];
#endif
  }
  /* ... then the shared-memory stores, which wait for them. */
  if (seg_mine) {
    s_first[x] = my_first;
    s_off[x] = my_off;
    s_len[x] = my_len;
  }
#pragma unroll
  for (int k = 0; k < MAP_BT_PER_THREAD; k++)
    if (bt_staged)
      s_bt[x + k * B] = my_bt[k]; /* -1 past the table, never read */
  __syncthreads();
  if (!in)
    return;
  const int64_t bs = a->block_size;
  int64_t slot = -1;
  /* The host validated the batch (cuda-kernels.h); these checks only keep a bad one in bounds. */
  if (s >= 0 && (uint32_t)s < a->n_segments && pos >= 0) {
    const int64_t first = seg_staged ? s_first[s] : a->seg_first_lb[s];
    const uint32_t off = seg_staged ? s_off[s] : a->seg_bt_off[s];
    const uint32_t len = seg_staged ? s_len[s] : a->seg_bt_len[s];
    const int64_t idx = (pos >> p.bs_shift) - first;
    const uint64_t e = (uint64_t)off + (uint64_t)idx;
    if (idx >= 0 && idx < (int64_t)len && (n_bt == 0 || e < n_bt)) {
      const int32_t b = bt_staged ? s_bt[e] : a->block_table[e];
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
  /* A batch that one warp covers (tokens, segments and staged table) gets a block of one warp. */
  if (a->n_tokens <= MAP_SMALL && a->n_segments <= MAP_SMALL && a->bt_entries > 0 &&
      a->bt_entries <= MAP_SMALL * MAP_BT_PER_THREAD)
    return dsv4__cuda_err(
        dsv4__cuda_launch(dsv4__map_slots_kernel<MAP_SMALL>, 1, MAP_SMALL, s, pdl && dev.pdl, p));
  uint64_t blocks = ((uint64_t)a->n_tokens + MAP_BLOCK - 1) / MAP_BLOCK;
  if (blocks > 0x7fffffffu)
    return DSV4_EINVAL;
  return dsv4__cuda_err(dsv4__cuda_launch(dsv4__map_slots_kernel<MAP_BLOCK>, (unsigned)blocks,
                                          MAP_BLOCK, s, pdl && dev.pdl, p));
}
