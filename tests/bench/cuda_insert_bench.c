/*
 * The CUDA forward step (slot-map producer + insert consumer, launched back to back with PDL) on
 * one GPU: GPU time per forward from CUDA-graph replays, the minimal bytes it must move, and the
 * device-to-device copy bandwidth measured in the same run as the ceiling (DESIGN.md, "Performance
 * method"; tests/bench/NOTES.md has the table).
 *
 * Minimal bytes per forward: q read and q_out written (2 N H 1024), kv read (N 1024), 584 cache
 * bytes per inserted token, positions and slots (16 per token). Every slot is valid, block size
 * 64, up to 64 sequences per batch. Each graph holds a sequence of forwards over rotating input
 * sets whose total is at least twice the L2, so no forward finds its inputs in the cache.
 *
 * At small batches a forward is latency, not bytes: the run also measures its floor, a pair of
 * empty kernels launched exactly as the producer and the consumer are (cuda_floor.cu).
 *
 * Usage: cuda_insert_bench [heads...]   (default 64 128; DSV4_BENCH_N="64,1024" picks batch sizes;
 * DSV4_BENCH_SETS=k forces k input sets, for diagnosis: 1 leaves everything in the L2;
 * DSV4_BENCH_NO_TABLE_LENGTH=1 keeps the producer from staging the block table in shared memory;
 * DSV4_BENCH_UPLOAD=1 puts a copy of each forward's metadata from pinned host memory in front of
 * its producer, as the daemon runs a forward: the producer then follows a copy, not a kernel)
 * The tuning build cuda_insert_bench_tune also reads DSV4_ROWS_PER_WARP and DSV4_TUNE_FLAGS
 * (cuda-kernels.h).
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/gpu_common.h"
#include "cuda_bench_common.h"
#include "cuda_floor.h"
#include "cuda_insert_sets.h"

/* vLLM's CUDA op on the same GPU at H = 64 (FIELD-NOTES.md), for the last column. */
static double vllm_us(uint32_t n) {
  switch (n) {
  case 1:
    return 2.41;
  case 64:
    return 8.36;
  case 1024:
    return 48.7;
  case 4096:
    return 149;
  case 16384:
    return 554;
  default:
    return 0;
  }
}

static void bench(uint32_t heads, uint32_t n, double ceiling, float *mirror,
                  dsv4_rope_table_t *rope, cudaStream_t s) {
  insert_sets_t x;
  insert_sets_make(&x, heads, n, mirror, rope);
  /* Forwards (producer + consumer), each kernel alone, and forwards without PDL. */
  double us[4];
  for (int mode = 0; mode < 4; mode++)
    us[mode] = insert_sets_us(&x, mode, mirror, s);
  double gbs = x.bytes / (us[0] * 1e-6) / 1e9;
  double v = heads == 64 ? vllm_us(n) : 0;
  printf("%6u %4u %10.2f %10.1f %8.1f%% %9.2f %9.2f %9.2f", n, heads, us[0], gbs,
         100.0 * gbs / ceiling, us[1], us[2], us[3]);
  if (v > 0)
    printf(" %9.2f %7.2fx", v, v / us[0]);
  else
    printf(" %9s %8s", "", "");
  printf("   (%u sets, %u forwards per graph)\n", x.sets, x.per_graph);
  fflush(stdout);
  insert_sets_free(&x);
}

/* GPU time of one pair of empty kernels shaped like the producer and the consumer, from graph
 * replays of 256 pairs. */
static double floor_us(cudaStream_t s, int pdl) {
  const uint32_t pairs = 256;
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (uint32_t k = 0; k < pairs; k++)
    CKD(bench_floor_pair(s, pdl));
  CK(cudaStreamEndCapture(s, &g));
  return replay_us(s, g, pairs);
}

int main(int argc, char **argv) {
  if (!gpu_available("cuda_insert_bench"))
    return GPU_SKIP;
#ifdef DSV4_TEST_TUNE
  /* The tuning build: DSV4_ROWS_PER_WARP overrides the insert kernel's rows per warp. */
  const char *rpw = getenv("DSV4_ROWS_PER_WARP");
  dsv4__cuda_test_rows_per_warp = rpw ? (unsigned)strtoul(rpw, NULL, 10) : 0;
  const char *fl = getenv("DSV4_TUNE_FLAGS");
  dsv4__cuda_test_flags_host = fl ? (unsigned)strtoul(fl, NULL, 10) : 0;
  printf("tuning flags: %u\n", dsv4__cuda_test_flags_host);
  printf("rows per warp: %u (0: the launcher's choice)\n", dsv4__cuda_test_rows_per_warp);
#endif
  uint32_t heads_list[8] = {64, 128};
  int n_heads = 2;
  if (argc > 1) {
    n_heads = 0;
    for (int i = 1; i < argc && n_heads < 8; i++)
      heads_list[n_heads++] = (uint32_t)strtoul(argv[i], NULL, 10);
  }
  double c1 = copy_ceiling((size_t)1 << 30), c4 = copy_ceiling((size_t)4 << 30);
  double ceiling = c1 > c4 ? c1 : c4;
  printf("device-to-device copy (read + written): %.1f GB/s at 1 GiB, %.1f GB/s at 4 GiB; "
         "ceiling %.1f GB/s\n",
         c1, c4, ceiling);
  if (getenv("DSV4_BENCH_UPLOAD"))
    printf("each forward's metadata is first copied from pinned host memory (DSV4_BENCH_UPLOAD)\n");
  float *mirror = NULL;
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_plain_default, INSERT_MAX_POS, &mirror);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint32_t ns[16] = {1, 16, 64, 256, 1024, 4096, 16384};
  size_t n_ns = 7;
  /* DSV4_BENCH_N="64,1024" measures those batch sizes only. */
  const char *only = getenv("DSV4_BENCH_N");
  if (only && *only) {
    n_ns = 0;
    for (char *end = NULL; *only && n_ns < 16; only = *end ? end + 1 : end) {
      ns[n_ns++] = (uint32_t)strtoul(only, &end, 10);
      if (end == only)
        break;
    }
  }
  /* us: a forward (producer + consumer, PDL); map, insert: each kernel alone; no-PDL: a forward
   * launched in plain stream order; vLLM: its CUDA op on the same GPU (FIELD-NOTES.md). */
  printf("floor (a pair of empty kernels per forward): %.2f us with PDL, %.2f us without\n",
         floor_us(s, 1), floor_us(s, 0));
  printf("%6s %4s %10s %10s %9s %9s %9s %9s %9s %8s\n", "N", "H", "us", "GB/s", "%copy", "map us",
         "insert us", "no-PDL us", "vLLM us", "speedup");
  for (int h = 0; h < n_heads; h++)
    for (size_t i = 0; i < n_ns; i++)
      bench(heads_list[h], ns[i], ceiling, mirror, rope, s);
  cudaStreamDestroy(s);
  cudaFree(mirror);
  dsv4_rope_table_destroy(rope);
  return 0;
}
