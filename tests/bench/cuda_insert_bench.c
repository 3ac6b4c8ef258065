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

#define MAX_POS 65536
#define BS 64

typedef struct {
  gpu_plan_dev_t d;
  uint16_t *q, *kv, *q_out;
  int64_t *slots;
  uint8_t *cache;
  dsv4_map_args_t ma;
  dsv4_insert_args_t ia;
  void *pin_meta; /* DSV4_BENCH_UPLOAD: the packed metadata in pinned host memory */
} set_t;

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
  uint64_t rng = 0x3C6EF372FE94F82Bull ^ ((uint64_t)n << 8) ^ heads;
  double bytes =
      (double)n * ((double)heads * DSV4_HEAD_DIM * 4 + DSV4_HEAD_DIM * 2 + DSV4_RECORD_BYTES + 16);
  /* Input sets: together at least twice the 60 MB of L2 (counting the minimal bytes), at least 2.
   */
  uint32_t sets = (uint32_t)(120e6 / bytes) + 1;
  sets = sets < 2 ? 2 : sets;
  const char *force = getenv("DSV4_BENCH_SETS");
  if (force && strtoul(force, NULL, 10) > 0)
    sets = (uint32_t)strtoul(force, NULL, 10);
  /* Forwards per graph: every set at least once and at least 64 in all. */
  uint32_t per_graph = sets * ((64 + sets - 1) / sets);
  set_t *st = calloc(sets, sizeof(*st));
  gpu_plan_t p;
  gpu_plan_make(&rng, &p, n, n < 64 ? n : 64, BS, MAX_POS, 0);
  gpu_rope_upload(rope, mirror, MAX_POS, p.pos, n);
  size_t q_bytes = (size_t)n * heads * DSV4_HEAD_DIM * 2;
  uint64_t stride = DSV4_BLOCK_STRIDE(BS);
  uint16_t *hq = gpu_host_alloc(q_bytes), *hkv = gpu_host_alloc((size_t)n * 1024);
  gpu_fill_bf16(&rng, hq, q_bytes / 2, 127, 6);
  gpu_fill_bf16(&rng, hkv, (size_t)n * DSV4_HEAD_DIM, 127, 6);
  for (uint32_t i = 0; i < sets; i++) {
    set_t *x = &st[i];
    gpu_plan_upload_packed(&p, &x->d); /* one allocation per set, as the daemon stages it */
    x->q = gpu_dev_alloc(q_bytes);
    x->q_out = gpu_dev_alloc(q_bytes);
    x->kv = gpu_dev_alloc((size_t)n * 1024);
    x->slots = gpu_dev_alloc(sizeof(int64_t) * n);
    x->cache = gpu_dev_alloc((size_t)p.n_blocks * stride);
    CK(cudaMemcpy(x->q, hq, q_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(x->kv, hkv, (size_t)n * 1024, cudaMemcpyHostToDevice));
    CK(cudaMemset(x->cache, 0, (size_t)p.n_blocks * stride));
    x->ma = gpu_plan_map_args(&p, x->d.pos, x->d.tok_seg, x->d.seg_first_lb, x->d.seg_bt_off,
                              x->d.seg_bt_len, x->d.block_table, x->slots);
    if (getenv("DSV4_BENCH_NO_TABLE_LENGTH"))
      x->ma.bt_entries = 0; /* the producer reads the block table from global memory */
    dsv4_insert_args_t ia = {.n_tokens = n,
                             .heads = heads,
                             .q = x->q,
                             .kv = x->kv,
                             .positions = x->d.pos,
                             .slots = x->slots,
                             .eps = 1e-6f,
                             .write_kv = 1,
                             .q_out = x->q_out,
                             .cache = x->cache,
                             .block_size = BS,
                             .n_blocks = p.n_blocks,
                             .stride = stride};
    x->ia = ia;
  }
  const int upload = getenv("DSV4_BENCH_UPLOAD") != NULL;
  for (uint32_t i = 0; upload && i < sets; i++) {
    CK(cudaMallocHost(&st[i].pin_meta, st[i].d.arena_bytes));
    CK(cudaMemcpy(st[i].pin_meta, st[i].d.arena, st[i].d.arena_bytes, cudaMemcpyDeviceToHost));
  }
  CK(cudaDeviceSynchronize());

  /* Forwards (producer + consumer), each kernel alone, and forwards without PDL. */
  double us[4];
  for (int mode = 0; mode < 4; mode++) {
    int pdl = mode != 3;
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (uint32_t k = 0; k < per_graph; k++) {
      set_t *x = &st[k % sets];
      if (upload && mode != 2)
        CK(cudaMemcpyAsync(x->d.arena, x->pin_meta, x->d.arena_bytes, cudaMemcpyHostToDevice, s));
      if (mode != 2)
        CKD(dsv4__cuda_map_slots(&x->ma, s, pdl));
      if (mode != 1)
        CKD(dsv4__cuda_qkv_insert(&x->ia, mirror, MAX_POS, s, pdl));
    }
    CK(cudaStreamEndCapture(s, &g));
    us[mode] = replay_us(s, g, per_graph);
  }
  double gbs = bytes / (us[0] * 1e-6) / 1e9;
  double v = heads == 64 ? vllm_us(n) : 0;
  printf("%6u %4u %10.2f %10.1f %8.1f%% %9.2f %9.2f %9.2f", n, heads, us[0], gbs,
         100.0 * gbs / ceiling, us[1], us[2], us[3]);
  if (v > 0)
    printf(" %9.2f %7.2fx", v, v / us[0]);
  else
    printf(" %9s %8s", "", "");
  printf("   (%u sets, %u forwards per graph)\n", sets, per_graph);
  fflush(stdout);
  for (uint32_t i = 0; i < sets; i++) {
    set_t *x = &st[i];
    gpu_plan_dev_free(&x->d);
    if (x->pin_meta)
      cudaFreeHost(x->pin_meta);
    cudaFree(x->q);
    cudaFree(x->q_out);
    cudaFree(x->kv);
    cudaFree(x->slots);
    cudaFree(x->cache);
  }
  free(st);
  free(hq);
  free(hkv);
  gpu_plan_free(&p);
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
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_plain_default, MAX_POS, &mirror);
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
