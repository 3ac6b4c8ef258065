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
 * The decode rows' caches hold valid records written by the host in a pattern (no compressor runs:
 * its cost is per emitted entry, not per step) over block tables scattered in their pools, as a
 * pool holds them. Each graph cycles through sets of sequences whose bytes together are at least
 * 120 MB, more than twice the L2, so no call finds its records in the cache (a prefill: two sets).
 *
 * Then the prefill row ("16x1024", SPEC §8.3-8.6): 16 fresh sequences of 1024 tokens each
 * (positions 0..1023) in one batch of a C4 layer. One call is the layer's compressed branch over
 * the batch as the daemon runs it after the batch's insert, every emission before the indexer and
 * the attention (SPEC §8.4): the compressor (the rows into the sequences' rings, 256 entries a
 * sequence into the entry and index caches), the indexer (no token sees more than 256 entries, so
 * each lists every visible one and none is scored) and the union attention (the token at position p
 * reads its window of min(p + 1, 128) records, then its (p + 1) / 4 entries). "step" is the three
 * launches in one call; each is also timed alone. The table gives µs a call, tokens a second, and
 * each time over two floors:
 *
 *   FLOP floor: the union attention's FLOP, counted as cuda_attn_bench counts them, 4 per head,
 *   candidate and dim (the dot product and the accumulation), over every token's window records
 *   and visible entries (the two terms above; 532 GFLOP a call at 64 heads), at the fp32 FMA peak
 *   measured in the run for exact mode and at the bf16 tensor-core peak (mma.sync m16n8k16,
 *   cuda_fma_peak.cu) for fast mode. Nothing else counts: the indexer computes no score here, and
 *   the compressor's pooling (per row and channel a max, a subtraction, an exp, an add and an fma;
 *   8 rows and 640 channels an entry, about 0.02 % of the attention's FLOP) is not matrix work.
 *
 *   Memory floor: the bytes at the copy ceiling: the compressor's ckv and ikv read (10 KiB a token)
 *   and its records written (584 + 68 bytes an entry; the rings' rows left out), the selection
 *   written (2 KiB a token; the indexer reads no index record, iq or iw here), q read, attn and lse
 *   written, and each window record and entry read once.
 *
 * The window records and q (the insert's q_out) are written beforehand by the real slot map and
 * insert, which are not part of the call (cuda_insert_bench times them), and the entries by each
 * set's first call, outside the graphs; every later call rewrites them with the same bytes. The
 * daemon makes the three launches once over such a batch with prefill_chunk_tokens 0; with its
 * default of 512 it makes them once per chunk of 512 tokens, 32 chunks here (SPEC §4). The bench
 * times the one launch of each.
 *
 * Usage: cuda_compress_bench   (DSV4_BENCH_N="1,64" picks the decode batch sizes, default 1, 64,
 * 256, and leaves out the prefill row; DSV4_BENCH_LAYERS="C4/64K,C128/64K" picks the layers, of
 * C4/8K, C4/64K and C128/64K; DSV4_BENCH_INDEXER=threads|partial|scalar|fast times the
 * indexer's per-entry kernel, the tensor-core kernel held to a lower mode, or its fast mode (the
 * heads' sum in registers) instead of the daemon's choice, on warpgroup MMAs where the device runs
 * them; sync and fast_sync: the daemon's choice and fast mode on mma.sync;
 * DSV4_BENCH_INDEX_CODES=narrow writes index records whose block codes are within one of each
 * other, as the compressor's are; DSV4_BENCH_FAST_SYNC=1 runs fast mode's union on mma.sync, CTAs
 * of 32 or 16 heads, where the device would take 64-head CTAs on warpgroup MMAs)
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/gpu_attn_common.h"
#include "attention-split.h"
#include "cuda_bench_common.h"
#include "cuda_fma_peak.h"
#include "dsv4-compress.h"

#define MAX_POS 65536
#define BS 64
#define HEADS 64
#define IH 64    /* index heads */
#define TOPK 512 /* V4-Flash's index_topk */
/* q read, attn and lse written: the bytes of one query token. */
#define Q_IO ((double)HEADS * DSV4_HEAD_DIM * 2 * 2 + HEADS * 4.0)
/* The prefill row: sequences, tokens each. */
#define PREFILL_SEQS 16
#define PREFILL_LEN 1024
/* A ratio-4 token's compressor inputs (SPEC §8.2): ckv and ikv floats. */
#define CKV_FLOATS 2048
#define IKV_FLOATS 512
/* The compressor's weights at ratio 4, in one array: ape [4, 1024], norm [512], the indexer's
 * ape [4, 256] and norm [128]. */
#define W_NORM 4096
#define W_I_APE (W_NORM + 512)
#define W_I_NORM (W_I_APE + 1024)
#define W_FLOATS (W_I_NORM + 128)

/* b sequences at context ctx on a layer of that ratio, len query tokens each a call: 1 for a
 * decode step, ctx for a prefill of fresh sequences. */
typedef struct {
  uint32_t ratio, ctx, b, len;
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

/* DSV4_BENCH_INDEX_CODES=narrow: each index record's four block codes within one of each other,
 * as the compressor writes them (its Hadamard spreads a key evenly over the blocks), rather than
 * independent in 120..130. The tensor-core indexer takes its fused mode on such records and its
 * partial mode on the default ones (indexer_mma.cu). */
static int narrow_codes;

/* n blocks of `bytes` each on the device, from a host template of 64 blocks made by fill. */
static uint8_t *pool_make(uint64_t *rng, uint32_t n, size_t bytes, int index) {
  const uint32_t tmpl = 64;
  uint8_t *h = gpu_host_alloc(tmpl * bytes);
  for (uint32_t k = 0; k < tmpl; k++) {
    if (index) {
      for (size_t i = 0; i < bytes; i++) /* e2m1 nibbles: every code is a value */
        h[k * bytes + i] = (uint8_t)gpu_rnd(rng);
      for (uint32_t o = 0; o < BS; o++) { /* UE8M0 codes after the values */
        const uint32_t base = 124 + gpu_below(rng, 5);
        for (int i = 0; i < 4; i++)
          h[k * bytes + (size_t)BS * 64 + 4 * o + i] =
              (uint8_t)(narrow_codes ? base + gpu_below(rng, 2) : 120 + gpu_below(rng, 11));
      }
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
  uint32_t seqs, sets, e, cbps;  /* sequences in all sets, entries and entry blocks per sequence */
  uint32_t n_tok;                /* tokens in all sets */
  uint32_t bt_entries, n_blocks; /* the SWA table's entries and the SWA pool's blocks */
  int64_t *pos, *p0, *first_lb, *c_first_lb;
  int32_t *tok_seg, *bt, *cbt, *sel;
  uint32_t *bt_off, *bt_len, *cbt_off, *cbt_len, *keys, *err;
  uint8_t *cache, *c_cache, *i_cache;
  uint16_t *q, *out, *iq;
  float *iw, *lse, *sink, *part;
  uint64_t keys_len, part_len; /* part: the split fast union's partial states, or NULL */
  /* The prefill's compressor: state slots, inputs, rings and weights (W_*); NULL for decode. */
  uint32_t *slot;
  float *ckv, *ikv, *ring, *cw;
} world_t;

/* n floats centre + spread * u, u uniform in [-1, 1) on a grid of 2^-11. */
static void fill_f32(uint64_t *rng, float *v, size_t n, float centre, float spread) {
  for (size_t i = 0; i < n; i++)
    v[i] = centre + spread * (((float)gpu_below(rng, 4096) - 2048.0f) * 0x1p-11f);
}

/* fill_f32's values on the device. */
static float *dev_rand_f32(uint64_t *rng, size_t n, float centre, float spread) {
  float *h = gpu_host_alloc(sizeof(float) * n);
  fill_f32(rng, h, n, centre, spread);
  float *d = dev_put(h, sizeof(float) * n);
  free(h);
  return d;
}

/* Decode: every sequence at position ctx - 1 with its window in the last two blocks of its table;
 * the window records, entries and index records written by the host in a pattern; q random. */
static void world_decode(uint64_t *rng, const shape_t *sh, world_t *w, float *mirror,
                         dsv4_rope_table_t *rope) {
  const uint32_t n = w->seqs;
  int64_t *pos = gpu_host_alloc(8 * n), *flb = gpu_host_alloc(8 * n);
  uint32_t *bo = gpu_host_alloc(4 * n), *bl = gpu_host_alloc(4 * n);
  for (uint32_t g = 0; g < n; g++) {
    pos[g] = sh->ctx - 1;
    flb[g] = (sh->ctx - DSV4_WINDOW) / BS; /* the window's two blocks */
    bo[g] = 2 * g;
    bl[g] = 2;
  }
  gpu_rope_upload(rope, mirror, MAX_POS, pos, 1);
  int32_t *bt = block_ids(rng, 2 * n);
  w->pos = dev_put(pos, 8 * n);
  w->first_lb = dev_put(flb, 8 * n);
  w->bt = dev_put(bt, 4 * 2 * n);
  w->bt_off = dev_put(bo, 4 * n);
  w->bt_len = dev_put(bl, 4 * n);
  w->bt_entries = w->n_blocks = 2 * n;
  w->cache = pool_make(rng, 2 * n, DSV4_BLOCK_STRIDE(BS), 0);
  w->c_cache = pool_make(rng, n * w->cbps, DSV4_BLOCK_STRIDE(BS), 0);
  if (sh->ratio == 4)
    w->i_cache = pool_make(rng, n * w->cbps, DSV4_INDEX_BLOCK_BYTES(BS), 1);
  size_t qn = (size_t)n * HEADS * DSV4_HEAD_DIM;
  uint16_t *hq = gpu_host_alloc(2 * qn);
  gpu_fill_bf16(rng, hq, qn, 127, 3);
  w->q = dev_put(hq, 2 * qn);
  void *hs[] = {pos, flb, bo, bl, bt, hq};
  for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++)
    free(hs[i]);
}

/*
 * Prefill: every sequence fresh (p0 0, positions 0 .. len - 1) in one plan over blocks scattered in
 * the SWA pool, its window records and q (the insert's q_out) written by the real slot map and
 * insert; a state slot each; the compressor's inputs random (ckv and ikv within +-2), its weights
 * like a checkpoint's (ape within +-0.5, norm weights 1 +- 0.25); the rings and the entry and index
 * pools zero-filled, as the daemon allocates them, for the compressor to write.
 */
static void world_prefill(uint64_t *rng, const shape_t *sh, world_t *w, float *mirror,
                          dsv4_rope_table_t *rope, cudaStream_t s) {
  const uint32_t n = w->seqs;
  attn_seg_spec_t *spec = gpu_host_alloc(sizeof(*spec) * n);
  uint32_t *slot = gpu_host_alloc(4 * n);
  for (uint32_t g = 0; g < n; g++) {
    spec[g] = (attn_seg_spec_t){0, 0, sh->len};
    slot[g] = g;
  }
  attn_plan_t p;
  attn_plan_make(rng, &p, spec, n, BS, n);
  gpu_rope_upload(rope, mirror, MAX_POS, p.q_pos, p.n_q);
  w->pos = dev_put(p.q_pos, 8 * (size_t)p.n_q);
  w->first_lb = dev_put(p.seg_first_lb, 8 * n);
  w->bt_off = dev_put(p.seg_bt_off, 4 * n);
  w->bt_len = dev_put(p.seg_bt_len, 4 * n);
  w->bt = dev_put(p.block_table, 4 * (size_t)p.bt_len);
  w->bt_entries = p.bt_len;
  w->n_blocks = p.n_blocks;
  w->slot = dev_put(slot, 4 * n);
  const size_t bytes[4] = {(size_t)p.n_blocks * DSV4_BLOCK_STRIDE(BS),
                           (size_t)n * w->cbps * DSV4_BLOCK_STRIDE(BS),
                           (size_t)n * w->cbps * DSV4_INDEX_BLOCK_BYTES(BS),
                           (size_t)n * DSV4_RING_FLOATS(4) * sizeof(float)};
  void *pools[4];
  for (int i = 0; i < 4; i++) {
    pools[i] = gpu_dev_alloc(bytes[i]);
    CK(cudaMemset(pools[i], 0, bytes[i]));
  }
  w->cache = pools[0];
  w->c_cache = pools[1];
  w->i_cache = pools[2];
  w->ring = pools[3];
  w->q = gpu_dev_alloc((size_t)w->n_tok * HEADS * DSV4_HEAD_DIM * 2);
  const dsv4_map_args_t tab = {.n_segments = n,
                               .block_size = BS,
                               .n_blocks = p.n_blocks,
                               .seg_first_lb = w->first_lb,
                               .seg_bt_off = w->bt_off,
                               .seg_bt_len = w->bt_len,
                               .block_table = w->bt,
                               .bt_entries = p.bt_len};
  bench_insert(&tab, p.n_q, p.q_pos, p.q_seg, HEADS, w->q, w->cache, mirror, MAX_POS, rng, s);
  w->ckv = dev_rand_f32(rng, (size_t)w->n_tok * CKV_FLOATS, 0.0f, 2.0f);
  w->ikv = dev_rand_f32(rng, (size_t)w->n_tok * IKV_FLOATS, 0.0f, 2.0f);
  float *hw = gpu_host_alloc(sizeof(float) * W_FLOATS);
  fill_f32(rng, hw, W_NORM, 0.0f, 0.5f);
  fill_f32(rng, hw + W_NORM, W_I_APE - W_NORM, 1.0f, 0.25f);
  fill_f32(rng, hw + W_I_APE, W_I_NORM - W_I_APE, 0.0f, 0.5f);
  fill_f32(rng, hw + W_I_NORM, W_FLOATS - W_I_NORM, 1.0f, 0.25f);
  w->cw = dev_put(hw, sizeof(float) * W_FLOATS);
  free(hw);
  free(slot);
  free(spec);
  attn_plan_free(&p);
}

/* Both kinds: the entry tables (every sequence's entry blocks scattered in the pools), p0 0, each
 * call's segment of every token, iq and iw (random), the sinks, attn, lse, the selection, the
 * indexer's key scratch and the fast union's partial states for a call, and the error word. */
static void world_make(uint64_t *rng, const shape_t *sh, uint32_t sets, world_t *w, float *mirror,
                       dsv4_rope_table_t *rope, cudaStream_t s) {
  memset(w, 0, sizeof(*w));
  const uint32_t n = sets * sh->b, e = sh->ctx / sh->ratio, cbps = (e + BS - 1) / BS;
  const uint32_t call = sh->b * sh->len;
  w->seqs = n;
  w->sets = sets;
  w->e = e;
  w->cbps = cbps;
  w->n_tok = n * sh->len;
  int64_t *zeros = gpu_host_alloc(8 * n);
  int32_t *local = gpu_host_alloc(4 * (size_t)call);
  uint32_t *co = gpu_host_alloc(4 * n), *cl = gpu_host_alloc(4 * n);
  for (uint32_t g = 0; g < n; g++) {
    zeros[g] = 0;
    co[g] = g * cbps;
    cl[g] = cbps;
  }
  for (uint32_t t = 0; t < call; t++)
    local[t] = (int32_t)(t / sh->len);
  int32_t *cbt = block_ids(rng, n * cbps);
  w->p0 = dev_put(zeros, 8 * n);
  w->c_first_lb = dev_put(zeros, 8 * n);
  w->tok_seg = dev_put(local, 4 * (size_t)call);
  w->cbt = dev_put(cbt, 4 * (size_t)n * cbps);
  w->cbt_off = dev_put(co, 4 * n);
  w->cbt_len = dev_put(cl, 4 * n);
  if (sh->len > 1)
    world_prefill(rng, sh, w, mirror, rope, s);
  else
    world_decode(rng, sh, w, mirror, rope);
  const size_t nt = w->n_tok, iqn = nt * IH * 128;
  uint16_t *hq = gpu_host_alloc(2 * iqn);
  gpu_fill_bf16(rng, hq, iqn, 127, 3);
  w->iq = dev_put(hq, 2 * iqn);
  w->iw = dev_rand_f32(rng, nt * IH, 0.0f, 2.0f);
  w->sink = dev_rand_f32(rng, HEADS, 0.0f, 2.0f);
  w->out = gpu_dev_alloc(nt * HEADS * DSV4_HEAD_DIM * 2);
  w->lse = gpu_dev_alloc(4 * nt * HEADS);
  w->sel = gpu_dev_alloc(4 * nt * TOPK);
  w->keys_len = (uint64_t)dsv4__cuda_indexer_ctas(call) * dsv4__cuda_indexer_keys_per_cta(MAX_POS);
  w->keys = gpu_dev_alloc(4 * w->keys_len);
  w->part_len =
      dsv4__union_part_floats(call, HEADS, dsv4__cuda_attention_fast_union_splits(call, HEADS));
  w->part = w->part_len ? gpu_dev_alloc(4 * w->part_len) : NULL;
  w->err = gpu_dev_alloc(4);
  CK(cudaMemset(w->err, 0, 4));
  CK(cudaDeviceSynchronize());
  void *hs[] = {zeros, local, co, cl, cbt, hq};
  for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++)
    free(hs[i]);
}

static void world_free(world_t *w) {
  void *d[] = {w->pos,  w->p0,  w->first_lb, w->c_first_lb, w->tok_seg, w->bt,
               w->cbt,  w->sel, w->bt_off,   w->bt_len,     w->cbt_off, w->cbt_len,
               w->keys, w->err, w->cache,    w->c_cache,    w->i_cache, w->q,
               w->out,  w->iq,  w->iw,       w->lse,        w->sink,    w->part,
               w->slot, w->ckv, w->ikv,      w->ring,       w->cw};
  for (size_t i = 0; i < sizeof(d) / sizeof(d[0]); i++)
    if (d[i])
      cudaFree(d[i]);
}

/* The indexer's and the attention's arguments for set i: its sequences i b .., its tokens
 * i b len ... */
static void set_args(const shape_t *sh, const world_t *w, dsv4_rope_table_t *rope, uint32_t i,
                     dsv4_indexer_args_t *xa, dsv4_attn_args_t *aa) {
  const size_t g = (size_t)i * sh->b, t0 = g * sh->len;
  const uint32_t n = sh->b * sh->len;
  *xa = (dsv4_indexer_args_t){.n_tokens = n,
                              .n_segments = sh->b,
                              .topk = TOPK,
                              .n_heads = IH,
                              .w_scale = dsv4_u2f(DSV4_INDEX_W_SCALE_BITS),
                              .positions = w->pos + t0,
                              .tok_seg = w->tok_seg,
                              .seg_p0 = w->p0 + g,
                              .iq = w->iq + t0 * IH * 128,
                              .iw = w->iw + t0 * IH,
                              .rope = rope,
                              .seg_c_first_lb = w->c_first_lb + g,
                              .seg_cbt_off = w->cbt_off + g,
                              .seg_cbt_len = w->cbt_len + g,
                              .c_block_table = w->cbt,
                              .c_bt_entries = w->seqs * w->cbps,
                              .i_cache = w->i_cache,
                              .c_n_blocks = w->seqs * w->cbps,
                              .block_size = BS,
                              .sel = w->sel + t0 * TOPK};
  *aa = (dsv4_attn_args_t){.n_tokens = n,
                           .n_segments = sh->b,
                           .heads = HEADS,
                           .q = w->q + t0 * HEADS * DSV4_HEAD_DIM,
                           .positions = w->pos + t0,
                           .tok_seg = w->tok_seg,
                           .seg_p0 = w->p0 + g,
                           .seg_first_lb = w->first_lb + g,
                           .seg_bt_off = w->bt_off + g,
                           .seg_bt_len = w->bt_len + g,
                           .block_table = w->bt,
                           .bt_entries = w->bt_entries,
                           .cache = w->cache,
                           .block_size = BS,
                           .n_blocks = w->n_blocks,
                           .stride = DSV4_BLOCK_STRIDE(BS),
                           .sink = w->sink,
                           .rope = rope,
                           .out = w->out + t0 * HEADS * DSV4_HEAD_DIM,
                           .lse = w->lse + t0 * HEADS,
                           .ratio = sh->ratio,
                           .c_cache = w->c_cache,
                           .c_n_blocks = w->seqs * w->cbps,
                           .seg_c_first_lb = w->c_first_lb + g,
                           .seg_cbt_off = w->cbt_off + g,
                           .seg_cbt_len = w->cbt_len + g,
                           .c_block_table = w->cbt,
                           .c_bt_entries = w->seqs * w->cbps,
                           .c_sel = sh->ratio == 4 ? w->sel + t0 * TOPK : NULL,
                           .c_sel_stride = sh->ratio == 4 ? TOPK : 0};
}

/* The compressor's arguments for set i of a prefill world: the set's tokens, segments, entry tables
 * and caches as its indexer launch xa sees them, and the compressor's own arrays. */
static void compress_args(const shape_t *sh, const world_t *w, const dsv4_indexer_args_t *xa,
                          uint32_t i, dsv4_compress_args_t *ca) {
  const size_t g = (size_t)i * sh->b, t0 = g * sh->len;
  *ca = (dsv4_compress_args_t){.ratio = sh->ratio,
                               .n_tokens = xa->n_tokens,
                               .n_segments = xa->n_segments,
                               .positions = xa->positions,
                               .tok_seg = xa->tok_seg,
                               .seg_p0 = xa->seg_p0,
                               .seg_slot = w->slot + g,
                               .ckv = w->ckv + t0 * CKV_FLOATS,
                               .ikv = w->ikv + t0 * IKV_FLOATS,
                               .ring = w->ring,
                               .n_slots = w->seqs,
                               .ape = w->cw,
                               .norm_weight = w->cw + W_NORM,
                               .i_ape = w->cw + W_I_APE,
                               .i_norm_weight = w->cw + W_I_NORM,
                               .eps = 1e-6f,
                               .rope = xa->rope,
                               .seg_c_first_lb = xa->seg_c_first_lb,
                               .seg_cbt_off = xa->seg_cbt_off,
                               .seg_cbt_len = xa->seg_cbt_len,
                               .c_block_table = xa->c_block_table,
                               .c_bt_entries = xa->c_bt_entries,
                               .c_cache = w->c_cache,
                               .i_cache = w->i_cache,
                               .c_n_blocks = xa->c_n_blocks,
                               .block_size = xa->block_size,
                               .stride = DSV4_BLOCK_STRIDE(BS)};
}

/* What a call runs: any of the compressor, the indexer and the attention, in the daemon's order
 * (SPEC §8.4), the attention in exact or fast mode. */
enum { RUN_COMPRESS = 1, RUN_INDEXER = 2, RUN_ATTN = 4, RUN_FAST = 8 };
#define RUN_STEP (RUN_COMPRESS | RUN_INDEXER | RUN_ATTN)

/* The launches of one call on set i, on s (PDL behind the previous launch). */
static void run_set(const shape_t *sh, const world_t *w, dsv4_rope_table_t *rope, float *mirror,
                    uint32_t i, unsigned what, cudaStream_t s) {
  dsv4_compress_args_t ca;
  dsv4_indexer_args_t xa;
  dsv4_attn_args_t aa;
  set_args(sh, w, rope, i, &xa, &aa);
  aa.fast = (what & RUN_FAST) != 0;
  if (what & RUN_COMPRESS) {
    compress_args(sh, w, &xa, i, &ca);
    CKD(dsv4__cuda_compress(&ca, mirror, MAX_POS, w->err, s, 1));
  }
  if (what & RUN_INDEXER)
    CKD(dsv4__cuda_indexer(&xa, mirror, MAX_POS, w->keys, w->keys_len, w->err, s, 1));
  if (what & RUN_ATTN)
    CKD(dsv4__cuda_attention(&aa, mirror, MAX_POS, w->part, w->part_len, w->err, s, 1));
}

/* GPU time per call of `what`, cycling the sets: at least 32 decode calls a graph, or each set's
 * prefill twice (milliseconds a call). */
static double time_calls(const shape_t *sh, const world_t *w, dsv4_rope_table_t *rope,
                         float *mirror, unsigned what, cudaStream_t s) {
  const uint32_t per_graph = sh->len > 1 ? 2 * w->sets : w->sets * ((32 + w->sets - 1) / w->sets);
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (uint32_t k = 0; k < per_graph; k++)
    run_set(sh, w, rope, mirror, k % w->sets, what, s);
  CK(cudaStreamEndCapture(s, &g));
  return replay_us(s, g, per_graph);
}

/* Exits when a launch refused its batch (the kernels' error word is set). */
static void check_word(const world_t *w) {
  uint32_t word = 1;
  CK(cudaMemcpy(&word, w->err, sizeof(word), cudaMemcpyDeviceToHost));
  if (word) {
    fprintf(stderr, "cuda_compress_bench: a launch refused its batch (error word %#x)\n", word);
    exit(1);
  }
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
  const double attn_bytes = (double)sh->b * ((DSV4_WINDOW + k) * (double)DSV4_RECORD_BYTES + Q_IO);
  const double index_bytes =
      sh->ratio == 4
          ? (double)sh->b * (e * (double)DSV4_INDEX_RECORD_BYTES + IH * 128 * 2 + IH * 4 + TOPK * 4)
          : 0.0;
  uint32_t sets = (uint32_t)(120e6 / (attn_bytes + index_bytes)) + 1;
  sets = sets < 2 ? 2 : sets;
  world_t w;
  world_make(&rng, sh, sets, &w, mirror, rope, s);
  /* Every set's selection, once, outside the graphs; then one attention call (it sets the
   * kernel's shared-memory limit, and a refusal shows here rather than as a timing). */
  for (uint32_t i = 0; i < sets; i++) {
    run_set(sh, &w, rope, mirror, i, (sh->ratio == 4 ? RUN_INDEXER : 0) | RUN_ATTN, s);
    if (fast)
      run_set(sh, &w, rope, mirror, i, RUN_ATTN | RUN_FAST, s);
  }
  CK(cudaStreamSynchronize(s));
  double t_index = sh->ratio == 4 ? time_calls(sh, &w, rope, mirror, RUN_INDEXER, s) : 0.0;
  double t_attn = time_calls(sh, &w, rope, mirror, RUN_ATTN, s);
  double t_fast = fast ? time_calls(sh, &w, rope, mirror, RUN_ATTN | RUN_FAST, s) : 0.0;
  check_word(&w);
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
#ifdef DSV4_PHASE_PROBE
    double ph[7];
    const long long ctas = dsv4__cuda_attention_fast_union_phases(ph);
    if (ctas > 0)
      printf("          attn fast phases, cycles a CTA: wait %.0f, setup %.0f, staging %.0f, "
             "scores %.0f, softmax %.0f, weighted sum %.0f, output %.0f (%lld CTAs)\n",
             ph[0], ph[1], ph[2], ph[3], ph[4], ph[5], ph[6], ctas);
#endif
  }
  fflush(stdout);
  world_free(&w);
}

/* The calls of the prefill table: the parts alone, then the step; fast mode where the device has it
 * (the compressor and the indexer have one mode). */
static const struct {
  const char *mode, *part;
  unsigned what;
} prefill_runs[] = {
    {"exact", "compress", RUN_COMPRESS},        {"exact", "indexer", RUN_INDEXER},
    {"exact", "attention", RUN_ATTN},           {"exact", "step", RUN_STEP},
    {"fast", "attention", RUN_ATTN | RUN_FAST}, {"fast", "step", RUN_STEP | RUN_FAST}};

/*
 * The prefill row (the file's header): PREFILL_SEQS fresh sequences of PREFILL_LEN tokens on a C4
 * layer. peak: the fp32 FMA and bf16 tensor-core rates in GFLOP/s; copy: the copy ceiling in GB/s.
 */
static void bench_prefill(double copy, const double peak[2], float *mirror, dsv4_rope_table_t *rope,
                          cudaStream_t s, int fast) {
  const shape_t sh = {4, PREFILL_LEN, PREFILL_SEQS, PREFILL_LEN};
  uint64_t rng = 0x3C6EF372FE94F82Bull ^ ((uint64_t)PREFILL_LEN << 20) ^ PREFILL_SEQS;
  /* A sequence's candidates: the token at position p has min(p + 1, 128) window records and
   * (p + 1) / 4 entries, every visible one selected. */
  double cands = 0.0;
  for (uint32_t p = 0; p < PREFILL_LEN; p++)
    cands += (p + 1 < DSV4_WINDOW ? p + 1 : DSV4_WINDOW) + (p + 1) / 4;
  const double tokens = (double)PREFILL_SEQS * PREFILL_LEN, entries = tokens / 4;
  const double flop = (double)PREFILL_SEQS * cands * HEADS * DSV4_HEAD_DIM * 4;
  /* Bytes of the compressor, the indexer and the attention (the file's header). */
  const double bytes[3] = {tokens * (CKV_FLOATS + IKV_FLOATS) * 4.0 +
                               entries * (DSV4_RECORD_BYTES + DSV4_INDEX_RECORD_BYTES),
                           tokens * TOPK * 4.0,
                           tokens * Q_IO + (tokens + entries) * DSV4_RECORD_BYTES};
  uint32_t sets = (uint32_t)(120e6 / (bytes[0] + bytes[1] + bytes[2])) + 1;
  sets = sets < 2 ? 2 : sets;
  world_t w;
  world_make(&rng, &sh, sets, &w, mirror, rope, s);
  /* Each set's step once outside the graphs: the compressor writes the set's entries, the kernels
   * set their shared-memory limits, and a refusal shows here rather than as a timing. */
  for (uint32_t i = 0; i < sets; i++) {
    run_set(&sh, &w, rope, mirror, i, RUN_STEP, s);
    if (fast)
      run_set(&sh, &w, rope, mirror, i, RUN_ATTN | RUN_FAST, s);
  }
  CK(cudaStreamSynchronize(s));
  check_word(&w);
  const size_t n_runs = fast ? 6 : 4;
  double us[6];
  for (size_t r = 0; r < n_runs; r++)
    us[r] = time_calls(&sh, &w, rope, mirror, prefill_runs[r].what, s);
  check_word(&w);
  /* us: GPU time per call; tok/s: the batch's tokens over it; FLOP us: the attention's FLOP at the
   * FMA peak (exact) or the tensor-core peak (fast), for the calls that run it; mem us: the bytes
   * of the parts run at the copy ceiling; x: us over each floor. */
  printf("\nprefill: %u fresh sequences x %u tokens on a C4 layer, H = %u (%u entries a sequence, "
         "every visible one selected; %.1f GFLOP of attention a call; %u sets)\n",
         PREFILL_SEQS, PREFILL_LEN, HEADS, PREFILL_LEN / 4, flop * 1e-9, sets);
  char batch[24];
  snprintf(batch, sizeof(batch), "%ux%u", PREFILL_SEQS, PREFILL_LEN);
  printf("%-8s %-5s %-9s %10s %10s %10s %8s %10s %8s\n", "batch", "mode", "part", "us", "tok/s",
         "FLOP us", "x", "mem us", "x");
  for (size_t r = 0; r < n_runs; r++) {
    const unsigned what = prefill_runs[r].what;
    const double mem =
        ((what & RUN_COMPRESS ? bytes[0] : 0.0) + (what & RUN_INDEXER ? bytes[1] : 0.0) +
         (what & RUN_ATTN ? bytes[2] : 0.0)) /
        (copy * 1e3);
    const double fl = what & RUN_ATTN ? flop / (peak[what & RUN_FAST ? 1 : 0] * 1e3) : 0.0;
    printf("%-8s %-5s %-9s %10.2f %10.0f ", batch, prefill_runs[r].mode, prefill_runs[r].part,
           us[r], tokens / (us[r] * 1e-6));
    if (fl > 0)
      printf("%10.2f %7.2fx", fl, us[r] / fl);
    else
      printf("%10s %8s", "-", "-");
    printf(" %10.2f %7.2fx\n", mem, us[r] / mem);
  }
  fflush(stdout);
  world_free(&w);
}

/* Whether DSV4_BENCH_LAYERS (a comma-separated list of names such as "C4/64K"; unset or empty:
 * all) names the layer of ratio r over ctx positions. */
static int layer_picked(const char *list, uint32_t r, uint32_t ctx) {
  char name[24];
  if (!list || !*list)
    return 1;
  snprintf(name, sizeof(name), "C%u/%uK", r, ctx / 1024);
  for (const char *at = list; *at;) {
    size_t n = strcspn(at, ",");
    if (n == strlen(name) && !strncmp(at, name, n))
      return 1;
    at += n + (at[n] == ',');
  }
  return 0;
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
  /* The prefill row's FLOP ceilings, measured only when it runs (DSV4_BENCH_N unset). */
  const int prefill = !getenv("DSV4_BENCH_N");
  double peak[2] = {0.0, 0.0};
  if (prefill && bench_peaks("cuda_compress_bench", s, fast, peak))
    return 1;
  const char *codes = getenv("DSV4_BENCH_INDEX_CODES"), *path = getenv("DSV4_BENCH_INDEXER");
  narrow_codes = codes && !strcmp(codes, "narrow");
  if (path && *path) {
    static const char *const names[7] = {"auto", "threads",   "partial", "scalar",
                                         "fast", "fast_sync", "sync"};
    int k = 0;
    while (k < 7 && strcmp(path, names[k]))
      k++;
    if (k == 7) {
      fprintf(stderr, "cuda_compress_bench: DSV4_BENCH_INDEXER is auto, threads, partial, "
                      "scalar, fast, fast_sync or sync\n");
      return 2;
    }
    /* DSV4_CUDA_INDEXER_AUTO .. _MMA_FAST in that order; fast_sync and sync: fast and auto on
     * mma.sync */
    dsv4__cuda_indexer_set_path(k < 5    ? k
                                : k == 5 ? DSV4_CUDA_INDEXER_MMA_FAST
                                         : DSV4_CUDA_INDEXER_AUTO);
    dsv4__cuda_indexer_force_sync(k >= 5);
  }
  printf("indexer: %s path, index records' block codes %s; tensor cores by %s\n",
         path && *path ? path : "auto",
         narrow_codes ? "within one of each other" : "independent in 120..130",
         path && strstr(path, "sync") ? "mma.sync"
         : dsv4__cuda_indexer_wg(64)  ? "warpgroup MMAs"
                                      : "mma.sync");
  if (getenv("DSV4_BENCH_FAST_SYNC"))
    dsv4__cuda_attention_fast_force_sync(1);
  if (fast)
    printf("fast union of 64 heads: %s\n",
           dsv4__cuda_attention_fast_union_wg()
               ? "warpgroup MMAs, 64-head CTAs (DSV4_BENCH_FAST_SYNC=1: mma.sync)"
               : "mma.sync, 32- or 16-head CTAs (DSV4_BENCH_FAST_SYNC, or no sm_90a device)");
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
  const char *pick = getenv("DSV4_BENCH_LAYERS");
  for (size_t l = 0; l < 3; l++)
    for (size_t i = 0; i < n_b && layer_picked(pick, layers[l][0], layers[l][1]); i++) {
      shape_t sh = {layers[l][0], layers[l][1], bs[i], 1};
      bench(&sh, copy, mirror, rope, s, fast);
    }
  if (prefill)
    bench_prefill(copy, peak, mirror, rope, s, fast);
  cudaStreamDestroy(s);
  cudaFree(mirror);
  dsv4_rope_table_destroy(rope);
  return 0;
}
