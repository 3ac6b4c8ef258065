/*
 * The compressed branch's decode step on one GPU (SPEC §8.5, §8.6), exact and fast mode: one-token
 * queries of b sequences at context ctx on a C4 layer (the indexer scans every visible index record
 * and picks 512 entries; attention reads the 128-record window and those 512 entries) and on a C128
 * layer (attention over the window and every entry, 512 at 64K). GPU time per call from CUDA-graph
 * replays, against the device-to-device copy ceiling measured in the same run (DESIGN.md,
 * "Performance method"): the indexer's floor is its bytes (68 per visible index record, iq, iw and
 * the selection) at that rate, the attention's its bytes (584 per distinct record read, q, attn and
 * lse), and the step's floor both together; the table prints each time over its floor. Where the
 * device offers fast mode (SPEC §7: tensor cores, compute capability 9.0 and newer) the attention
 * and the step are timed again with it ("attn fast", "step fast"), against the same floors.
 *
 * The caches hold valid records written by the host in a pattern (no compressor runs: its cost is
 * per emitted entry, not per step) over block tables scattered in their pools, as a pool holds
 * them. Each graph cycles through sets of sequences whose bytes together are at least 120 MB, more
 * than twice the L2, so no call finds its records in the cache.
 *
 * Usage: cuda_compress_bench   (DSV4_BENCH_N="1,64" picks batch sizes; default 1, 64, 256)
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/gpu_attn_common.h"
#include "attention-split.h"
#include "cuda_bench_common.h"
#include "dsv4-compress.h"

#define MAX_POS 65536
#define BS 64
#define HEADS 64
#define IH 64    /* index heads */
#define TOPK 512 /* V4-Flash's index_topk */

typedef struct {
  uint32_t ratio, ctx, b;
} shape_t;

/* A valid record's 576 data bytes and 8 scale bytes: e4m3 bytes that are never NaN, bf16 RoPE
 * values of magnitude 0.5..1, scale codes 120..134. */
static void fill_records(uint64_t *rng, uint8_t *block) {
  for (uint32_t o = 0; o < BS; o++) {
    uint8_t *d = block + DSV4_TOKEN_DATA_OFFSET(o);
    for (int i = 0; i < DSV4_NOPE_DIM; i++) {
      uint8_t v = (uint8_t)gpu_rnd(rng);
      d[i] = (v & 0x7f) == 0x7f ? (uint8_t)(v ^ 1) : v;
    }
    for (int i = 0; i < 64; i++) {
      d[DSV4_NOPE_DIM + 2 * i] = (uint8_t)gpu_rnd(rng);
      d[DSV4_NOPE_DIM + 2 * i + 1] = (uint8_t)(0x3f | (gpu_rnd(rng) & 0x80));
    }
    uint8_t *sc = block + (size_t)BS * DSV4_TOKEN_DATA_BYTES + (size_t)o * DSV4_SCALE_BYTES;
    for (int i = 0; i < 7; i++)
      sc[i] = (uint8_t)(120 + gpu_below(rng, 15));
    sc[7] = 0;
  }
}

/* n blocks of `bytes` each on the device, from a host template of 64 blocks made by fill. */
static uint8_t *pool_make(uint64_t *rng, uint32_t n, size_t bytes, int index) {
  const uint32_t tmpl = 64;
  uint8_t *h = gpu_host_alloc(tmpl * bytes);
  for (uint32_t k = 0; k < tmpl; k++) {
    if (index) {
      for (size_t i = 0; i < bytes; i++) /* e2m1 nibbles: every code is a value */
        h[k * bytes + i] = (uint8_t)gpu_rnd(rng);
      for (uint32_t o = 0; o < BS; o++) /* UE8M0 codes after the values */
        for (int i = 0; i < 4; i++)
          h[k * bytes + (size_t)BS * 64 + 4 * o + i] = (uint8_t)(120 + gpu_below(rng, 11));
    } else {
      fill_records(rng, h + k * bytes);
    }
  }
  uint8_t *d = gpu_dev_alloc((size_t)n * bytes);
  for (uint32_t k = 0; k < n; k += tmpl)
    CK(cudaMemcpy(d + (size_t)k * bytes, h, (size_t)(n - k < tmpl ? n - k : tmpl) * bytes,
                  cudaMemcpyHostToDevice));
  free(h);
  return d;
}

/* A random permutation of 0..n-1 as block ids. */
static int32_t *block_ids(uint64_t *rng, uint32_t n) {
  int32_t *p = gpu_host_alloc(sizeof(int32_t) * n);
  for (uint32_t i = 0; i < n; i++)
    p[i] = (int32_t)i;
  for (uint32_t i = n - 1; i > 0; i--) {
    uint32_t j = gpu_below(rng, i + 1);
    int32_t x = p[i];
    p[i] = p[j];
    p[j] = x;
  }
  return p;
}

/* Device arrays of one shape: every set's sequences, their tables and the per-token inputs. */
typedef struct {
  uint32_t seqs, sets, e, cbps; /* sequences in all sets, entries and entry blocks per sequence */
  int64_t *pos, *p0, *first_lb, *c_first_lb;
  int32_t *tok_seg, *bt, *cbt, *sel;
  uint32_t *bt_off, *bt_len, *cbt_off, *cbt_len, *keys, *err;
  uint8_t *cache, *c_cache, *i_cache;
  uint16_t *q, *out, *iq;
  float *iw, *lse, *sink, *part;
  uint64_t keys_len, part_len; /* part: the split fast union's partial states, or NULL */
} world_t;

static void world_make(uint64_t *rng, const shape_t *sh, uint32_t sets, world_t *w, float *mirror,
                       dsv4_rope_table_t *rope) {
  memset(w, 0, sizeof(*w));
  const uint32_t n = sets * sh->b, e = sh->ctx / sh->ratio, cbps = (e + BS - 1) / BS;
  w->seqs = n;
  w->sets = sets;
  w->e = e;
  w->cbps = cbps;
  int64_t *pos = gpu_host_alloc(8 * n), *zeros = gpu_host_alloc(8 * n),
          *flb = gpu_host_alloc(8 * n);
  int32_t *local = gpu_host_alloc(4 * sh->b);
  uint32_t *bo = gpu_host_alloc(4 * n), *bl = gpu_host_alloc(4 * n), *co = gpu_host_alloc(4 * n),
           *cl = gpu_host_alloc(4 * n);
  for (uint32_t g = 0; g < n; g++) {
    pos[g] = sh->ctx - 1;
    zeros[g] = 0;
    flb[g] = (sh->ctx - DSV4_WINDOW) / BS; /* the window's two blocks */
    bo[g] = 2 * g;
    bl[g] = 2;
    co[g] = g * cbps;
    cl[g] = cbps;
  }
  for (uint32_t t = 0; t < sh->b; t++)
    local[t] = (int32_t)t;
  gpu_rope_upload(rope, mirror, MAX_POS, pos, 1);
  int32_t *bt = block_ids(rng, 2 * n), *cbt = block_ids(rng, n * cbps);
  w->pos = dev_put(pos, 8 * n);
  w->p0 = dev_put(zeros, 8 * n);
  w->first_lb = dev_put(flb, 8 * n);
  w->c_first_lb = dev_put(zeros, 8 * n);
  w->tok_seg = dev_put(local, 4 * sh->b);
  w->bt = dev_put(bt, 4 * 2 * n);
  w->cbt = dev_put(cbt, 4 * (size_t)n * cbps);
  w->bt_off = dev_put(bo, 4 * n);
  w->bt_len = dev_put(bl, 4 * n);
  w->cbt_off = dev_put(co, 4 * n);
  w->cbt_len = dev_put(cl, 4 * n);
  w->cache = pool_make(rng, 2 * n, DSV4_BLOCK_STRIDE(BS), 0);
  w->c_cache = pool_make(rng, n * cbps, DSV4_BLOCK_STRIDE(BS), 0);
  if (sh->ratio == 4)
    w->i_cache = pool_make(rng, n * cbps, DSV4_INDEX_BLOCK_BYTES(BS), 1);
  size_t qn = (size_t)n * HEADS * DSV4_HEAD_DIM, iqn = (size_t)n * IH * 128;
  uint16_t *hq = gpu_host_alloc(2 * (qn > iqn ? qn : iqn));
  gpu_fill_bf16(rng, hq, qn, 127, 3);
  w->q = dev_put(hq, 2 * qn);
  gpu_fill_bf16(rng, hq, iqn, 127, 3);
  w->iq = dev_put(hq, 2 * iqn);
  float *hw = gpu_host_alloc(4 * (size_t)n * IH);
  for (size_t i = 0; i < (size_t)n * IH; i++)
    hw[i] = ((float)gpu_below(rng, 4096) - 2048.0f) * 0x1p-10f;
  w->iw = dev_put(hw, 4 * (size_t)n * IH);
  w->sink = dev_put(hw, 4 * HEADS);
  w->out = gpu_dev_alloc(2 * qn);
  w->lse = gpu_dev_alloc(4 * (size_t)n * HEADS);
  w->sel = gpu_dev_alloc(4 * (size_t)n * TOPK);
  w->keys_len = (uint64_t)dsv4__cuda_indexer_ctas(sh->b) * dsv4__cuda_indexer_keys_per_cta(MAX_POS);
  w->keys = gpu_dev_alloc(4 * w->keys_len);
  w->part_len =
      dsv4__union_part_floats(sh->b, HEADS, dsv4__cuda_attention_fast_union_splits(sh->b, HEADS));
  w->part = w->part_len ? gpu_dev_alloc(4 * w->part_len) : NULL;
  w->err = gpu_dev_alloc(4);
  CK(cudaMemset(w->err, 0, 4));
  CK(cudaDeviceSynchronize());
  void *hs[] = {pos, zeros, flb, local, bo, bl, co, cl, bt, cbt, hq, hw};
  for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++)
    free(hs[i]);
}

static void world_free(world_t *w) {
  void *d[] = {w->pos,  w->p0,  w->first_lb, w->c_first_lb, w->tok_seg, w->bt,
               w->cbt,  w->sel, w->bt_off,   w->bt_len,     w->cbt_off, w->cbt_len,
               w->keys, w->err, w->cache,    w->c_cache,    w->i_cache, w->q,
               w->out,  w->iq,  w->iw,       w->lse,        w->sink,    w->part};
  for (size_t i = 0; i < sizeof(d) / sizeof(d[0]); i++)
    if (d[i])
      cudaFree(d[i]);
}

/* The indexer's and the attention's arguments for set i. */
static void set_args(const shape_t *sh, const world_t *w, dsv4_rope_table_t *rope, uint32_t i,
                     dsv4_indexer_args_t *xa, dsv4_attn_args_t *aa) {
  const size_t g = (size_t)i * sh->b;
  *xa = (dsv4_indexer_args_t){.n_tokens = sh->b,
                              .n_segments = sh->b,
                              .topk = TOPK,
                              .n_heads = IH,
                              .w_scale = dsv4_u2f(DSV4_INDEX_W_SCALE_BITS),
                              .positions = w->pos + g,
                              .tok_seg = w->tok_seg,
                              .seg_p0 = w->p0 + g,
                              .iq = w->iq + g * IH * 128,
                              .iw = w->iw + g * IH,
                              .rope = rope,
                              .seg_c_first_lb = w->c_first_lb + g,
                              .seg_cbt_off = w->cbt_off + g,
                              .seg_cbt_len = w->cbt_len + g,
                              .c_block_table = w->cbt,
                              .c_bt_entries = w->seqs * w->cbps,
                              .i_cache = w->i_cache,
                              .c_n_blocks = w->seqs * w->cbps,
                              .block_size = BS,
                              .sel = w->sel + g * TOPK};
  *aa = (dsv4_attn_args_t){.n_tokens = sh->b,
                           .n_segments = sh->b,
                           .heads = HEADS,
                           .q = w->q + g * HEADS * DSV4_HEAD_DIM,
                           .positions = w->pos + g,
                           .tok_seg = w->tok_seg,
                           .seg_p0 = w->p0 + g,
                           .seg_first_lb = w->first_lb + g,
                           .seg_bt_off = w->bt_off + g,
                           .seg_bt_len = w->bt_len + g,
                           .block_table = w->bt,
                           .bt_entries = 2 * w->seqs,
                           .cache = w->cache,
                           .block_size = BS,
                           .n_blocks = 2 * w->seqs,
                           .stride = DSV4_BLOCK_STRIDE(BS),
                           .sink = w->sink,
                           .rope = rope,
                           .out = w->out + g * HEADS * DSV4_HEAD_DIM,
                           .lse = w->lse + g * HEADS,
                           .ratio = sh->ratio,
                           .c_cache = w->c_cache,
                           .c_n_blocks = w->seqs * w->cbps,
                           .seg_c_first_lb = w->c_first_lb + g,
                           .seg_cbt_off = w->cbt_off + g,
                           .seg_cbt_len = w->cbt_len + g,
                           .c_block_table = w->cbt,
                           .c_bt_entries = w->seqs * w->cbps,
                           .c_sel = sh->ratio == 4 ? w->sel + g * TOPK : NULL,
                           .c_sel_stride = sh->ratio == 4 ? TOPK : 0};
}

/* GPU time per call of the indexer (what = 0), the attention (what = 1) or the attention in fast
 * mode (what = 2), cycling the sets. */
static double time_calls(const shape_t *sh, world_t *w, dsv4_rope_table_t *rope, float *mirror,
                         int what, cudaStream_t s) {
  const uint32_t per_graph = w->sets * ((32 + w->sets - 1) / w->sets);
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (uint32_t k = 0; k < per_graph; k++) {
    dsv4_indexer_args_t xa;
    dsv4_attn_args_t aa;
    set_args(sh, w, rope, k % w->sets, &xa, &aa);
    aa.fast = what == 2;
    if (what == 0)
      CKD(dsv4__cuda_indexer(&xa, mirror, MAX_POS, w->keys, w->keys_len, w->err, s, 1));
    else
      CKD(dsv4__cuda_attention(&aa, mirror, MAX_POS, w->part, w->part_len, w->err, s, 1));
  }
  CK(cudaStreamEndCapture(s, &g));
  return replay_us(s, g, per_graph);
}

/* One row of the table: time us against floor us. */
static void row(const char *name, uint32_t b, const char *part, double us, double floor) {
  printf("%-9s %4u %-9s %9.2f %9.2f %6.2fx %8.1f%%", name, b, part, us, floor, us / floor,
         100.0 * floor / us);
}

static void bench(const shape_t *sh, double copy, float *mirror, dsv4_rope_table_t *rope,
                  cudaStream_t s, int fast) {
  uint64_t rng = 0x9E3779B97F4A7C15ull ^ ((uint64_t)sh->ctx << 16) ^ sh->b ^ sh->ratio;
  const uint32_t e = sh->ctx / sh->ratio, k = sh->ratio == 4 ? (e < TOPK ? e : TOPK) : e;
  const double q_io = (double)HEADS * DSV4_HEAD_DIM * 2 * 2 + HEADS * 4.0;
  const double attn_bytes = (double)sh->b * ((DSV4_WINDOW + k) * (double)DSV4_RECORD_BYTES + q_io);
  const double index_bytes =
      sh->ratio == 4
          ? (double)sh->b * (e * (double)DSV4_INDEX_RECORD_BYTES + IH * 128 * 2 + IH * 4 + TOPK * 4)
          : 0.0;
  uint32_t sets = (uint32_t)(120e6 / (attn_bytes + index_bytes)) + 1;
  sets = sets < 2 ? 2 : sets;
  world_t w;
  world_make(&rng, sh, sets, &w, mirror, rope);
  /* Every set's selection, once, outside the graphs; then one attention call (it sets the
   * kernel's shared-memory limit, and a refusal shows here rather than as a timing). */
  for (uint32_t i = 0; i < sets; i++) {
    dsv4_indexer_args_t xa;
    dsv4_attn_args_t aa;
    set_args(sh, &w, rope, i, &xa, &aa);
    if (sh->ratio == 4)
      CKD(dsv4__cuda_indexer(&xa, mirror, MAX_POS, w.keys, w.keys_len, w.err, s, 1));
    CKD(dsv4__cuda_attention(&aa, mirror, MAX_POS, w.part, w.part_len, w.err, s, 1));
    aa.fast = fast;
    CKD(dsv4__cuda_attention(&aa, mirror, MAX_POS, w.part, w.part_len, w.err, s, 1));
  }
  CK(cudaStreamSynchronize(s));
  double t_index = sh->ratio == 4 ? time_calls(sh, &w, rope, mirror, 0, s) : 0.0;
  double t_attn = time_calls(sh, &w, rope, mirror, 1, s);
  double t_fast = fast ? time_calls(sh, &w, rope, mirror, 2, s) : 0.0;
  uint32_t word = 1;
  CK(cudaMemcpy(&word, w.err, sizeof(word), cudaMemcpyDeviceToHost));
  if (word) {
    fprintf(stderr, "cuda_compress_bench: a launch refused its batch (error word %#x)\n", word);
    exit(1);
  }
  const double f_index = index_bytes / (copy * 1e3), f_attn = attn_bytes / (copy * 1e3);
  char name[24];
  snprintf(name, sizeof(name), "C%u %uK", sh->ratio, sh->ctx / 1024);
  if (sh->ratio == 4) {
    row(name, sh->b, "indexer", t_index, f_index);
    printf("   (%u sets)\n", sets);
  }
  row(name, sh->b, "attention", t_attn, f_attn);
  printf("   (%u entries + %u window records)\n", k, DSV4_WINDOW);
  row(name, sh->b, "step", t_index + t_attn, f_index + f_attn);
  printf("\n");
  if (fast) {
    row(name, sh->b, "attn fast", t_fast, f_attn);
    printf("   (%u heads per CTA, %u splits)\n",
           dsv4__cuda_attention_fast_union_heads_per_block(sh->b, HEADS),
           dsv4__cuda_attention_fast_union_splits(sh->b, HEADS));
    row(name, sh->b, "step fast", t_index + t_fast, f_index + f_attn);
    printf("\n");
  }
  fflush(stdout);
  world_free(&w);
}

int main(void) {
  if (!gpu_available("cuda_compress_bench"))
    return GPU_SKIP;
  if (!dsv4__cuda_attention_supported(0)) {
    printf("cuda_compress_bench: device 0 cannot run the attention kernel\n");
    return GPU_SKIP;
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double c1 = copy_ceiling((size_t)1 << 30), c4 = copy_ceiling((size_t)4 << 30);
  double copy = c1 > c4 ? c1 : c4;
  printf("device-to-device copy (read + written): %.1f GB/s at 1 GiB, %.1f GB/s at 4 GiB; "
         "ceiling %.1f GB/s\n",
         c1, c4, copy);
  const int fast =
      dsv4__cuda_attention_fast_supported(0) && dsv4__cuda_attention_fast_union_supported(0);
  if (!fast)
    printf("device 0 has no fast mode (compute capability < 9.0): exact mode only\n");
  float *mirror = NULL;
  dsv4_rope_table_t *rope = gpu_rope_open(&dsv4_rope_yarn_default, MAX_POS, &mirror);
  uint32_t bs[8] = {1, 64, 256};
  size_t n_b = 3;
  const char *only = getenv("DSV4_BENCH_N");
  if (only && *only) {
    n_b = 0;
    for (char *end = NULL; *only && n_b < 8; only = *end ? end + 1 : end) {
      bs[n_b++] = (uint32_t)strtoul(only, &end, 10);
      if (end == only)
        break;
    }
  }
  /* us: GPU time per call (PDL behind the previous call); floor: its bytes at the copy ceiling;
   * x: us over floor (the target for a step: 1.5); %copy: floor over us. Exact mode, then
   * fast mode where the device offers it (the same floors). */
  printf("%-9s %4s %-9s %9s %9s %7s %9s\n", "layer", "b", "part", "us", "floor us", "x", "%copy");
  static const uint32_t layers[][2] = {{4, 8192}, {4, 65536}, {128, 65536}};
  for (size_t l = 0; l < 3; l++)
    for (size_t i = 0; i < n_b; i++) {
      shape_t sh = {layers[l][0], layers[l][1], bs[i]};
      bench(&sh, copy, mirror, rope, s, fast);
    }
  cudaStreamDestroy(s);
  cudaFree(mirror);
  dsv4_rope_table_destroy(rope);
  return 0;
}
