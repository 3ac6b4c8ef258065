/*
 * Attention (SPEC §7) on one GPU, exact mode and, where the device has it, fast mode: one-token
 * decode queries, each of its own sequence with a full window of 128 candidates over 3 blocks of 64
 * scattered in a pool, as the daemon's pool holds them. GPU time per call from CUDA-graph replays,
 * against two ceilings measured in the same run (DESIGN.md, "Performance method"): the
 * device-to-device copy bandwidth, for the bytes a call must move (q read, 584 bytes per record
 * read, attn and lse written), and the fp32 FMA rate of a kernel that does nothing else
 * (cuda_fma_peak.cu), for exact mode's arithmetic: 2 fma per head, candidate and dim (the dot
 * product and the accumulation), 4 FLOP; for fast mode the same FLOP against the bf16 tensor-core
 * rate of mma.sync measured the same way.
 *
 * The windows are written by the real slot map and insert first. Each graph cycles through input
 * sets whose bytes together are at least twice the L2, so no call finds its records in the cache.
 *
 * Rows: decode steps of b = 1, 16, 64, 128, 256 sequences, then one prefill call of 16 fresh
 * sequences x 1024 tokens ("16x1024": its FLOP count the candidates each token has, 1 to 128, and
 * its bytes each record once). Then the decode chain after the slot map at the same b: the insert
 * and the attention as two launches through q_out against the fused decode path (SPEC §7).
 *
 * Usage: cuda_attn_bench [heads...]   (default 64; DSV4_BENCH_N="1,128" picks batch sizes and
 * leaves out the prefill row; DSV4_BENCH_WARM_L2=1, a probe, takes one input set for the decode
 * rows instead, whose bytes every call after the first finds in the L2: what the DRAM costs;
 * DSV4_BENCH_NO_WIN=1 launches without the engine's windows, as a direct caller would;
 * DSV4_BENCH_FAST_SYNC=1 runs fast mode's 64-head CTAs on mma.sync where the device would take the
 * warpgroup MMAs)
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/gpu_attn_common.h"
#include "cuda_bench_common.h"
#include "cuda_fma_peak.h"

#define MAX_POS 65536
#define BS 64

/* The slot map's view of plan p's segments and table, whose device copies seg holds
 * (seg_first_lb, seg_bt_off, seg_bt_len, block_table), for bench_insert. */
static dsv4_map_args_t plan_tab(const attn_plan_t *p, void *const seg[4]) {
  dsv4_map_args_t tab = {.n_segments = p->n_segs,
                         .block_size = p->bs,
                         .n_blocks = p->n_blocks,
                         .seg_first_lb = seg[0],
                         .seg_bt_off = seg[1],
                         .seg_bt_len = seg[2],
                         .block_table = seg[3],
                         .bt_entries = p->bt_len};
  return tab;
}

/*
 * The engine's windows (backend.h, dsv4_attn_args_t.win) of every set's launch, in one device
 * buffer: set i's tokens i tokens .. are sequences i b .. i b + b - 1 of plan p (local: each
 * token's segment within its set). NULL with DSV4_BENCH_NO_WIN set: the kernels walk the tables.
 */
static dsv4_attn_win_t *plan_windows(const attn_plan_t *p, uint32_t sets, uint32_t b,
                                     uint32_t tokens, const int32_t *local) {
  if (getenv("DSV4_BENCH_NO_WIN"))
    return NULL;
  dsv4_attn_win_t *w = gpu_host_alloc(sizeof(*w) * sets * tokens);
  for (uint32_t i = 0; i < sets; i++) {
    const size_t g = (size_t)i * b, t0 = (size_t)i * tokens;
    const dsv4_attn_args_t ha = {.n_tokens = tokens,
                                 .n_segments = b,
                                 .positions = p->q_pos + t0,
                                 .tok_seg = local,
                                 .seg_p0 = p->seg_p0 + g,
                                 .seg_first_lb = p->seg_first_lb + g,
                                 .seg_bt_off = p->seg_bt_off + g,
                                 .seg_bt_len = p->seg_bt_len + g,
                                 .block_table = p->block_table,
                                 .bt_entries = p->bt_len,
                                 .block_size = p->bs,
                                 .n_blocks = p->n_blocks};
    CKD(dsv4_attn_windows(&ha, w + t0));
  }
  dsv4_attn_win_t *d = dev_put(w, sizeof(*w) * sets * tokens);
  free(w);
  return d;
}

/*
 * b sequences of len query tokens each per call: len 1, one-token decode steps with full windows;
 * len > 1, prefills of fresh sequences (their first len tokens, windows growing to 128).
 */
static void bench(uint32_t heads, uint32_t b, uint32_t len, int fast, double copy, double peak,
                  float *mirror, dsv4_rope_table_t *rope, cudaStream_t s) {
  uint64_t rng = 0x3C6EF372FE94F82Bull ^ ((uint64_t)b << 8) ^ heads ^ ((uint64_t)len << 20);
  /* Candidates of a sequence's len queries: 1, 2, ... up to the window; each record read once. */
  double cands = len == 1 ? DSV4_WINDOW : 0.0, records = len == 1 ? DSV4_WINDOW : len;
  for (uint32_t i = 0; len > 1 && i < len; i++)
    cands += i + 1 < DSV4_WINDOW ? i + 1 : DSV4_WINDOW;
  const uint32_t tokens = b * len;
  double bytes = (double)tokens * ((double)heads * DSV4_HEAD_DIM * 2 * 2 + (double)heads * 4) +
                 (double)b * records * DSV4_RECORD_BYTES;
  double flop = (double)b * cands * heads * DSV4_HEAD_DIM * 4;
  uint32_t sets = (uint32_t)(120e6 / bytes) + 1;
  sets = sets < 2 ? 2 : sets;
  if (getenv("DSV4_BENCH_WARM_L2"))
    sets = 1;
  uint32_t per_graph = len > 1 ? 2 * sets : sets * ((64 + sets - 1) / sets);
  /* Every set's b sequences in one plan: a full window each past its p0 (0 or later), or a fresh
   * sequence's first len tokens. */
  uint32_t n_segs = sets * b;
  attn_seg_spec_t *spec = gpu_host_alloc(sizeof(*spec) * n_segs);
  for (uint32_t g = 0; g < n_segs; g++) {
    int64_t p0 = g % 2 ? (int64_t)gpu_below(&rng, 20000) : 0;
    int64_t first = len > 1 ? p0 : p0 + 127 + (int64_t)gpu_below(&rng, 40000);
    spec[g] = (attn_seg_spec_t){p0, first, len};
  }
  attn_plan_t p;
  attn_plan_make(&rng, &p, spec, n_segs, BS, n_segs);
  CKD(dsv4_rope_table_ensure(rope, p.q_pos, p.n_q));
  gpu_rope_upload(rope, mirror, MAX_POS, p.q_pos, p.n_q);
  gpu_rope_upload(rope, mirror, MAX_POS, p.hist_pos, p.n_hist);
  void *seg[4] = {dev_put(p.seg_first_lb, sizeof(int64_t) * n_segs),
                  dev_put(p.seg_bt_off, sizeof(uint32_t) * n_segs),
                  dev_put(p.seg_bt_len, sizeof(uint32_t) * n_segs),
                  dev_put(p.block_table, sizeof(int32_t) * p.bt_len)};
  int64_t *p0 = dev_put(p.seg_p0, sizeof(int64_t) * n_segs);
  int64_t *qpos = dev_put(p.q_pos, sizeof(int64_t) * p.n_q);
  size_t cache_bytes = (size_t)p.n_blocks * DSV4_BLOCK_STRIDE(BS);
  size_t q_elems = (size_t)p.n_q * heads * DSV4_HEAD_DIM;
  uint8_t *cache = gpu_dev_alloc(cache_bytes);
  uint16_t *q_hist = gpu_dev_alloc((size_t)p.n_hist * DSV4_HEAD_DIM * 2);
  uint16_t *q = gpu_dev_alloc(q_elems * 2), *out = gpu_dev_alloc(q_elems * 2);
  float *lse = gpu_dev_alloc((size_t)p.n_q * heads * sizeof(float));
  uint32_t *err = gpu_dev_alloc(sizeof(uint32_t));
  CK(cudaMemset(cache, 0, cache_bytes));
  CK(cudaMemset(err, 0, sizeof(uint32_t)));
  CK(cudaDeviceSynchronize());
  /* The history with one head (only its records matter), then the queries with all of them. */
  const dsv4_map_args_t tab = plan_tab(&p, seg);
  bench_insert(&tab, p.n_hist, p.hist_pos, p.hist_seg, 1, q_hist, cache, mirror, MAX_POS, &rng, s);
  bench_insert(&tab, p.n_q, p.q_pos, p.q_seg, heads, q, cache, mirror, MAX_POS, &rng, s);
  float *sink = gpu_host_alloc(sizeof(float) * heads);
  for (uint32_t h = 0; h < heads; h++)
    sink[h] = ((float)gpu_below(&rng, 4096) - 2048.0f) * 0x1p-9f;
  float *dsink = dev_put(sink, sizeof(float) * heads);
  /* Set i: sequences i b .. i b + b - 1, whose queries are the plan's tokens i b len ... */
  int32_t *local = gpu_host_alloc(sizeof(int32_t) * tokens);
  for (uint32_t t = 0; t < tokens; t++)
    local[t] = (int32_t)(t / len);
  int32_t *tok_seg = dev_put(local, sizeof(int32_t) * tokens);
  dsv4_attn_win_t *win = plan_windows(&p, sets, b, tokens, local);
  dsv4_attn_args_t *aa = gpu_host_alloc(sizeof(*aa) * sets);
  for (uint32_t i = 0; i < sets; i++) {
    size_t g = (size_t)i * b, t0 = (size_t)i * tokens;
    aa[i] = (dsv4_attn_args_t){.n_tokens = tokens,
                               .n_segments = b,
                               .heads = heads,
                               .q = q + t0 * heads * DSV4_HEAD_DIM,
                               .positions = qpos + t0,
                               .tok_seg = tok_seg,
                               .seg_p0 = p0 + g,
                               .seg_first_lb = (const int64_t *)seg[0] + g,
                               .seg_bt_off = (const uint32_t *)seg[1] + g,
                               .seg_bt_len = (const uint32_t *)seg[2] + g,
                               .block_table = seg[3],
                               .bt_entries = p.bt_len,
                               .cache = cache,
                               .block_size = BS,
                               .n_blocks = p.n_blocks,
                               .stride = DSV4_BLOCK_STRIDE(BS),
                               .sink = dsink,
                               .rope = rope,
                               .out = out + t0 * heads * DSV4_HEAD_DIM,
                               .lse = lse + t0 * heads,
                               .fast = fast,
                               .win = win ? win + t0 : NULL};
  }
  /* A small batch splits each token's window: the partial states (the same shape every set). */
  const uint64_t part_len = dsv4__cuda_attention_part_floats(&aa[0]);
  float *part = part_len ? gpu_dev_alloc(part_len * sizeof(float)) : NULL;
  /* One call outside the graphs: it sets the kernel's shared-memory limit, and a refusal shows
   * here rather than as a timing. */
  CKD(dsv4__cuda_attention(&aa[0], mirror, MAX_POS, part, part_len, err, s, 1));
  CK(cudaStreamSynchronize(s));
  double us[2];
  for (int mode = 0; mode < 2; mode++) {
    cudaGraph_t gr;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (uint32_t k = 0; k < per_graph; k++)
      CKD(dsv4__cuda_attention(&aa[k % sets], mirror, MAX_POS, part, part_len, err, s, mode == 0));
    CK(cudaStreamEndCapture(s, &gr));
    us[mode] = replay_us(s, gr, per_graph);
  }
#ifdef DSV4_PHASE_PROBE
  double ph[7];
  const long long ctas = dsv4__cuda_attention_fast_phases(ph);
  if (fast && ctas > 0)
    printf("%9s phases, cycles a CTA: wait %.0f, window %.0f, copies and check %.0f, stage %.0f, "
           "scores "
           "%.0f, softmax %.0f, weighted sum and stores %.0f (%lld CTAs)\n",
           "", ph[0], ph[1], ph[2], ph[3], ph[4], ph[5], ph[6], ctas);
  const long long xctas = dsv4__cuda_attention_phases(ph);
  if (!fast && xctas > 0)
    printf("%9s phases, cycles a CTA: wait %.0f, setup %.0f, stage %.0f, logits %.0f, weights "
           "%.0f, chains %.0f, stores %.0f (%lld CTAs)\n",
           "", ph[0], ph[1], ph[2], ph[3], ph[4], ph[5], ph[6], xctas);
#endif
  uint32_t word = 1;
  CK(cudaMemcpy(&word, err, sizeof(word), cudaMemcpyDeviceToHost));
  if (word) {
    fprintf(stderr, "cuda_attn_bench: the kernel refused the batch (error word %#x)\n", word);
    exit(1);
  }
  double gbs = bytes / (us[0] * 1e-6) / 1e9, gflops = flop / (us[0] * 1e-6) / 1e9;
  char what[32];
  snprintf(what, sizeof(what), len > 1 ? "%ux%u" : "%u", b, len);
  printf("%9s %4u %5s %6u %10.2f %9.2f %9.1f %7.1f%% %10.1f %7.1f%%   (%u sets, %u calls per "
         "graph, %u split%s)\n",
         what, heads, fast ? "fast" : "exact",
         fast ? dsv4__cuda_attention_fast_heads_per_block(tokens, heads)
              : dsv4__cuda_attention_heads_per_block(tokens, heads),
         us[0], us[1], gbs, 100.0 * gbs / copy, gflops, 100.0 * gflops / peak, sets, per_graph,
         fast ? dsv4__cuda_attention_fast_splits(tokens, heads) : 1,
         fast && dsv4__cuda_attention_fast_splits(tokens, heads) > 1 ? "s" : "");
  fflush(stdout);
  void *bufs[] = {seg[0], seg[1], seg[2], seg[3], p0,    qpos,    cache, q_hist,
                  q,      out,    lse,    err,    dsink, tok_seg, part,  win};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    cudaFree(bufs[i]);
  free(aa);
  free(local);
  free(sink);
  free(spec);
  attn_plan_free(&p);
}

/* One set's launches of the decode chain: the insert (with q_out, or the KV rows only) and the
 * attention (on q_out, or on the raw q). */
typedef struct {
  dsv4_insert_args_t ia[2];
  dsv4_attn_args_t aa[2];
} chain_t;

/*
 * The decode step of b sequences as the engine runs it after the slot map, per call: the two
 * launches (qkv_insert writing q_out, then the attention reading it) against the fused chain
 * (SPEC §7: the insert of the KV rows only, then the attention normalising the raw q itself).
 * Each graph holds one chain; the sets cycle as in bench(). Bytes of the fused chain: raw q and kv
 * read, 584 per record written, the window's records read, attn and lse written; the two launches
 * move q_out's bytes twice more.
 */
static void bench_chain(uint32_t heads, uint32_t b, int fast, double copy, float *mirror,
                        dsv4_rope_table_t *rope, cudaStream_t s) {
  uint64_t rng = 0x243F6A8885A308D3ull ^ ((uint64_t)b << 8) ^ heads;
  const double qb = (double)b * heads * DSV4_HEAD_DIM * 2;
  double bytes = qb * 2 + (double)b * (heads * 4 + 1024 + (1 + DSV4_WINDOW) * DSV4_RECORD_BYTES);
  uint32_t sets = (uint32_t)(120e6 / bytes) + 1;
  sets = sets < 2 ? 2 : sets;
  uint32_t n_segs = sets * b, per_graph = sets * ((64 + sets - 1) / sets);
  attn_seg_spec_t *spec = gpu_host_alloc(sizeof(*spec) * n_segs);
  for (uint32_t g = 0; g < n_segs; g++) {
    int64_t p0 = g % 2 ? (int64_t)gpu_below(&rng, 20000) : 0;
    spec[g] = (attn_seg_spec_t){p0, p0 + 127 + (int64_t)gpu_below(&rng, 40000), 1};
  }
  attn_plan_t p;
  attn_plan_make(&rng, &p, spec, n_segs, BS, n_segs);
  CKD(dsv4_rope_table_ensure(rope, p.q_pos, p.n_q));
  gpu_rope_upload(rope, mirror, MAX_POS, p.q_pos, p.n_q);
  gpu_rope_upload(rope, mirror, MAX_POS, p.hist_pos, p.n_hist);
  void *seg[4] = {dev_put(p.seg_first_lb, sizeof(int64_t) * n_segs),
                  dev_put(p.seg_bt_off, sizeof(uint32_t) * n_segs),
                  dev_put(p.seg_bt_len, sizeof(uint32_t) * n_segs),
                  dev_put(p.block_table, sizeof(int32_t) * p.bt_len)};
  int64_t *p0 = dev_put(p.seg_p0, sizeof(int64_t) * n_segs);
  int64_t *qpos = dev_put(p.q_pos, sizeof(int64_t) * p.n_q);
  int32_t *qseg = dev_put(p.q_seg, sizeof(int32_t) * p.n_q);
  size_t cache_bytes = (size_t)p.n_blocks * DSV4_BLOCK_STRIDE(BS);
  size_t q_elems = (size_t)p.n_q * heads * DSV4_HEAD_DIM;
  uint8_t *cache = gpu_dev_alloc(cache_bytes);
  uint16_t *q_hist = gpu_dev_alloc((size_t)p.n_hist * DSV4_HEAD_DIM * 2);
  uint16_t *q_out = gpu_dev_alloc(q_elems * 2), *out = gpu_dev_alloc(q_elems * 2);
  uint16_t *hq = gpu_host_alloc(q_elems * 2), *hkv = gpu_host_alloc((size_t)p.n_q * 1024);
  gpu_fill_bf16(&rng, hq, q_elems, 127, 3);
  gpu_fill_bf16(&rng, hkv, (size_t)p.n_q * DSV4_HEAD_DIM, 127, 3);
  uint16_t *q = dev_put(hq, q_elems * 2), *kv = dev_put(hkv, (size_t)p.n_q * 1024);
  int64_t *slots = gpu_dev_alloc(sizeof(int64_t) * p.n_q);
  float *lse = gpu_dev_alloc((size_t)p.n_q * heads * sizeof(float));
  uint32_t *err = gpu_dev_alloc(sizeof(uint32_t));
  CK(cudaMemset(cache, 0, cache_bytes));
  CK(cudaMemset(err, 0, sizeof(uint32_t)));
  CK(cudaDeviceSynchronize());
  dsv4_map_args_t ma = plan_tab(&p, seg);
  bench_insert(&ma, p.n_hist, p.hist_pos, p.hist_seg, 1, q_hist, cache, mirror, MAX_POS, &rng, s);
  /* The queries' slots, once: every chain rewrites its records at them with the same bytes. */
  ma.n_tokens = p.n_q;
  ma.positions = qpos;
  ma.tok_seg = qseg;
  ma.slots = slots;
  CKD(dsv4__cuda_map_slots(&ma, s, 1));
  int32_t *local = gpu_host_alloc(sizeof(int32_t) * b);
  for (uint32_t t = 0; t < b; t++)
    local[t] = (int32_t)t;
  int32_t *tok_seg = dev_put(local, sizeof(int32_t) * b);
  dsv4_attn_win_t *win = plan_windows(&p, sets, b, b, local);
  float *sink = gpu_host_alloc(sizeof(float) * heads);
  for (uint32_t h = 0; h < heads; h++)
    sink[h] = ((float)gpu_below(&rng, 4096) - 2048.0f) * 0x1p-9f;
  float *dsink = dev_put(sink, sizeof(float) * heads);
  chain_t *ch = gpu_host_alloc(sizeof(*ch) * sets);
  for (uint32_t i = 0; i < sets; i++) {
    size_t t0 = (size_t)i * b, q0 = t0 * heads * DSV4_HEAD_DIM;
    for (int f = 0; f < 2; f++) {
      ch[i].ia[f] = (dsv4_insert_args_t){.n_tokens = b,
                                         .heads = heads,
                                         .q = q + q0,
                                         .kv = kv + t0 * DSV4_HEAD_DIM,
                                         .positions = qpos + t0,
                                         .slots = slots + t0,
                                         .eps = 1e-6f,
                                         .write_kv = 1,
                                         .q_out = f ? NULL : q_out + q0,
                                         .cache = cache,
                                         .block_size = BS,
                                         .n_blocks = p.n_blocks,
                                         .stride = DSV4_BLOCK_STRIDE(BS)};
      ch[i].aa[f] = (dsv4_attn_args_t){.n_tokens = b,
                                       .n_segments = b,
                                       .heads = heads,
                                       .q = f ? q + q0 : q_out + q0,
                                       .positions = qpos + t0,
                                       .tok_seg = tok_seg,
                                       .seg_p0 = p0 + t0,
                                       .seg_first_lb = (const int64_t *)seg[0] + t0,
                                       .seg_bt_off = (const uint32_t *)seg[1] + t0,
                                       .seg_bt_len = (const uint32_t *)seg[2] + t0,
                                       .block_table = seg[3],
                                       .bt_entries = p.bt_len,
                                       .cache = cache,
                                       .block_size = BS,
                                       .n_blocks = p.n_blocks,
                                       .stride = DSV4_BLOCK_STRIDE(BS),
                                       .sink = dsink,
                                       .rope = rope,
                                       .out = out + q0,
                                       .lse = lse + t0 * heads,
                                       .fast = fast,
                                       .q_raw = f,
                                       .eps = 1e-6f,
                                       .win = win ? win + t0 : NULL};
    }
  }
  /* us[0]: the two launches; us[1]: the fused chain. One chain of each outside the graphs first:
   * it sets the kernels' shared-memory limits, and a refusal shows here rather than as a time. */
  const uint64_t part_len = dsv4__cuda_attention_part_floats(&ch[0].aa[0]);
  float *part = part_len ? gpu_dev_alloc(part_len * sizeof(float)) : NULL;
  double us[2];
  for (int f = 0; f < 2; f++) {
    CKD(dsv4__cuda_qkv_insert(&ch[0].ia[f], mirror, MAX_POS, s, 1));
    CKD(dsv4__cuda_attention(&ch[0].aa[f], mirror, MAX_POS, part, part_len, err, s, 1));
    CK(cudaStreamSynchronize(s));
    cudaGraph_t gr;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (uint32_t k = 0; k < per_graph; k++) {
      CKD(dsv4__cuda_qkv_insert(&ch[k % sets].ia[f], mirror, MAX_POS, s, 1));
      CKD(dsv4__cuda_attention(&ch[k % sets].aa[f], mirror, MAX_POS, part, part_len, err, s, 1));
    }
    CK(cudaStreamEndCapture(s, &gr));
    us[f] = replay_us(s, gr, per_graph);
  }
  uint32_t word = 1;
  CK(cudaMemcpy(&word, err, sizeof(word), cudaMemcpyDeviceToHost));
  if (word) {
    fprintf(stderr, "cuda_attn_bench: the kernel refused the batch (error word %#x)\n", word);
    exit(1);
  }
  const double two = (bytes + 2 * qb) / (us[0] * 1e-6) / 1e9, one = bytes / (us[1] * 1e-6) / 1e9;
  printf("%9u %4u %5s %10.2f %7.1f%% %10.2f %7.1f%% %7.2fx   (%u sets, %u chains per graph)\n", b,
         heads, fast ? "fast" : "exact", us[0], 100.0 * two / copy, us[1], 100.0 * one / copy,
         us[0] / us[1], sets, per_graph);
  fflush(stdout);
  void *bufs[] = {seg[0], seg[1], seg[2], seg[3], p0,  qpos, qseg,    cache, q_hist, q_out,
                  out,    q,      kv,     slots,  lse, err,  tok_seg, dsink, part,   win};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    cudaFree(bufs[i]);
  free(ch);
  free(local);
  free(sink);
  free(hq);
  free(hkv);
  free(spec);
  attn_plan_free(&p);
}

int main(int argc, char **argv) {
  if (!gpu_available("cuda_attn_bench"))
    return GPU_SKIP;
  if (!dsv4__cuda_attention_supported(0)) {
    printf("cuda_attn_bench: device 0 cannot run the attention kernel\n");
    return GPU_SKIP;
  }
  uint32_t heads_list[8] = {64};
  int n_heads = 1;
  if (argc > 1) {
    n_heads = 0;
    for (int i = 1; i < argc && n_heads < 8; i++)
      heads_list[n_heads++] = (uint32_t)strtoul(argv[i], NULL, 10);
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double c1 = copy_ceiling((size_t)1 << 30), c4 = copy_ceiling((size_t)4 << 30);
  double copy = c1 > c4 ? c1 : c4;
  printf("device-to-device copy (read + written): %.1f GB/s at 1 GiB, %.1f GB/s at 4 GiB; "
         "ceiling %.1f GB/s\n",
         c1, c4, copy);
  const int has_fast = dsv4__cuda_attention_fast_supported(0);
  double peaks[2];
  if (bench_peaks("cuda_attn_bench", s, has_fast, peaks))
    return 1;
  const double peak = peaks[0], tc = peaks[1];
  if (getenv("DSV4_BENCH_FAST_SYNC"))
    dsv4__cuda_attention_fast_force_sync(1);
  if (has_fast)
    printf("fast mode's 64-head CTAs: %s\n",
           dsv4__cuda_attention_fast_wg() ? "warpgroup MMAs (DSV4_BENCH_FAST_SYNC=1: mma.sync)"
                                          : "mma.sync (DSV4_BENCH_FAST_SYNC, or no sm_90a device)");
  printf("windows: %s\n",
         getenv("DSV4_BENCH_NO_WIN")
             ? "walked from the tables (DSV4_BENCH_NO_WIN)"
             : "the engine's (dsv4_attn_windows; DSV4_BENCH_NO_WIN=1: the tables)");
  float *mirror = NULL;
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_plain_default, MAX_POS, &mirror);
  uint32_t ns[16] = {1, 16, 64, 128, 256};
  size_t n_ns = 5;
  const char *only = getenv("DSV4_BENCH_N");
  if (only && *only) {
    n_ns = 0;
    for (char *end = NULL; *only && n_ns < 16; only = *end ? end + 1 : end) {
      ns[n_ns++] = (uint32_t)strtoul(only, &end, 10);
      if (end == only)
        break;
    }
  }
  /* us: a call with PDL behind the previous one; no-PDL: in plain stream order. Bytes: q, 584 per
   * record, attn and lse. FLOP: 4 per head, candidate and dim. %peak: of the FMA peak (exact) or
   * the tensor-core peak (fast). */
  printf("%9s %4s %5s %6s %10s %9s %9s %8s %10s %8s\n", "b", "H", "mode", "H/CTA", "us", "no-PDL",
         "GB/s", "%copy", "GFLOP/s", "%peak");
  for (int fast = 0; fast <= has_fast; fast++)
    for (int h = 0; h < n_heads; h++) {
      for (size_t i = 0; i < n_ns; i++)
        bench(heads_list[h], ns[i], 1, fast, copy, fast ? tc : peak, mirror, rope, s);
      /* The prefill row: 16 fresh sequences of 1024 tokens in one call. */
      if (!getenv("DSV4_BENCH_N"))
        bench(heads_list[h], 16, 1024, fast, copy, fast ? tc : peak, mirror, rope, s);
    }
  /* The decode chain after the slot map: two launches against the fused one (SPEC §7). %copy: of
   * the copy ceiling, for the bytes each chain moves. */
  printf("\ndecode chain (insert + attention), full windows\n");
  printf("%9s %4s %5s %10s %8s %10s %8s %8s\n", "b", "H", "mode", "two us", "%copy", "fused us",
         "%copy", "speedup");
  for (int fast = 0; fast <= has_fast; fast++)
    for (int h = 0; h < n_heads; h++)
      for (size_t i = 0; i < n_ns; i++)
        bench_chain(heads_list[h], ns[i], fast, copy, mirror, rope, s);
  cudaStreamDestroy(s);
  cudaFree(mirror);
  dsv4_rope_table_destroy(rope);
  return 0;
}
