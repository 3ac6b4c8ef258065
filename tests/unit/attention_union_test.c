/*
 * Exact-mode attention over the union of the SWA window and the compressed entries (SPEC §8.6) on
 * the CPU backend. Both caches are filled by the backend's own qkv_insert (the compressed records
 * have the same 584-byte layout, SPEC §3), and every launch is compared byte for byte with a model
 * written here from the SPEC: the candidate list spelled out (the window, then the entries),
 * records decoded with literal offsets, the canonical dot product, one max, dsv4_expf weights, one
 * sum, the sink, one fma chain per dimension, o = N / D, the inverse rotation, bf16. Every
 * comparison runs at every kernel level this machine has and at 1, 2 and 3 worker threads.
 *
 * The cases: ratio 128 in range form with p0 > 0 and entries across several blocks, including the
 * tokens that see the entry they emit; ratio 4 with selections padded with -1, lists longer than a
 * tile, exactly two tiles, and none; a selection of 1024 entries and a range of 8192 (the longest
 * list at the largest position, with head groups bounded by the logits' memory); a launch whose
 * tokens see no entry, which equals the SWA-only launch; and every malformed launch refused with
 * DSV4_EINVAL before anything is written.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "cpu/cpu-internal.h"
#include "dsv4-numerics.h"
#include "rope.h"

#define MAX_SEGS 4
#define MAX_TOKENS 16
#define MAX_BT 64   /* SWA table entries of a scene */
#define MAX_CBT 160 /* compressed table entries of a scene */

#define TEST_RNG_SEED 0xD1B54A32D192ED03ull
#include "test_rng.h"

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* ---- a scene: one layer's two caches, a batch of query tokens and their tables ---- */

typedef struct {
  int64_t p0;
  int64_t first; /* the segment's query positions are first..first + n - 1 */
  uint32_t n;
} seg_spec_t;

typedef struct {
  dsv4_backend_t *be; /* fills the caches */
  uint32_t bs, ratio, heads, n_blocks, c_n_blocks;
  uint64_t stride;
  uint8_t *cache, *c_cache;
  dsv4_rope_table_t *rope;
  int32_t *free_ids, *c_free_ids;
  uint32_t n_free, n_c_free;
  /* The launch's arrays. */
  uint32_t n, n_segs;
  int64_t positions[MAX_TOKENS], seg_p0[MAX_SEGS], seg_first_lb[MAX_SEGS], seg_c_first_lb[MAX_SEGS];
  int32_t tok_seg[MAX_TOKENS];
  uint32_t seg_bt_off[MAX_SEGS], seg_bt_len[MAX_SEGS], seg_cbt_off[MAX_SEGS], seg_cbt_len[MAX_SEGS];
  int32_t block_table[MAX_BT], c_block_table[MAX_CBT];
  uint32_t bt_entries, c_bt_entries;
  int32_t *c_sel; /* [n, c_sel_stride], or NULL (range form) */
  uint32_t c_sel_stride;
  uint16_t *q; /* [n, heads, 512]: the rotated queries */
  float sink[DSV4_MAX_HEADS];
} scene_t;

static int32_t *shuffled_ids(uint32_t n) {
  int32_t *ids = malloc(n * sizeof(int32_t));
  assert_non_null(ids);
  for (uint32_t i = 0; i < n; i++)
    ids[i] = (int32_t)i;
  for (uint32_t i = n - 1; i > 0; i--) {
    uint32_t j = (uint32_t)(rng() % (i + 1));
    int32_t t = ids[i];
    ids[i] = ids[j];
    ids[j] = t;
  }
  return ids;
}

/* Records of the given positions (RoPE rows) written to slots of cache by the backend's insert,
 * from random kv; q_out (when not NULL) receives the rotated random queries of heads heads. */
static void insert_records(scene_t *sc, uint8_t *cache, uint32_t n_blocks, const int64_t *pos,
                           const int64_t *slots, uint32_t n, uint32_t heads, uint16_t *q_out) {
  uint16_t *q = malloc((size_t)n * heads * 1024), *qo = malloc((size_t)n * heads * 1024);
  uint16_t *kv = malloc((size_t)n * 1024);
  assert_true(q && qo && kv);
  for (size_t i = 0; i < (size_t)n * heads * 512; i++)
    q[i] = dsv4_f32_to_bf16(rnd_unit() * 2.0f);
  for (size_t i = 0; i < (size_t)n * 512; i++)
    kv[i] = dsv4_f32_to_bf16(rnd_unit() * 1.5f);
  assert_int_equal(dsv4_rope_table_ensure(sc->rope, pos, n), 0);
  dsv4_insert_args_t ia = {
      .n_tokens = n,
      .heads = heads,
      .q = q,
      .kv = kv,
      .positions = pos,
      .slots = slots,
      .rope = sc->rope,
      .eps = 1e-6f,
      .write_kv = 1,
      .q_out = qo,
      .cache = cache,
      .block_size = sc->bs,
      .n_blocks = n_blocks,
      .stride = sc->stride,
  };
  assert_int_equal(sc->be->ops->qkv_insert(sc->be, &ia), 0);
  if (q_out)
    memcpy(q_out, qo, (size_t)n * heads * 1024);
  free(q);
  free(qo);
  free(kv);
}

static int64_t window_first(int64_t p, int64_t p0) {
  return p - 127 > p0 ? p - 127 : p0;
}

/* Segment s: its window's records and blocks, its visible entries' records and blocks, and the
 * rotated queries of its tokens (which start at token t0). */
static void scene_segment(scene_t *sc, uint32_t s, const seg_spec_t *sp, uint32_t t0) {
  const int64_t bs = sc->bs, r = sc->ratio, last = sp->first + sp->n - 1;
  const int64_t lo = window_first(sp->first, sp->p0);
  sc->seg_p0[s] = sp->p0;
  sc->seg_first_lb[s] = lo / bs;
  sc->seg_bt_off[s] = sc->bt_entries;
  for (int64_t lb = lo / bs; lb <= last / bs; lb++) {
    assert_true(sc->n_free > 0 && sc->bt_entries < MAX_BT);
    sc->block_table[sc->bt_entries++] = sc->free_ids[--sc->n_free];
  }
  sc->seg_bt_len[s] = sc->bt_entries - sc->seg_bt_off[s];
  uint32_t nw = (uint32_t)(last - lo + 1);
  int64_t *pos = malloc(nw * sizeof(int64_t)), *slots = malloc(nw * sizeof(int64_t));
  uint16_t *qo = malloc((size_t)nw * sc->heads * 1024);
  assert_true(pos && slots && qo);
  for (uint32_t i = 0; i < nw; i++) {
    pos[i] = lo + i;
    int32_t b = sc->block_table[sc->seg_bt_off[s] + (pos[i] / bs - sc->seg_first_lb[s])];
    slots[i] = (int64_t)b * bs + pos[i] % bs;
  }
  insert_records(sc, sc->cache, sc->n_blocks, pos, slots, nw, sc->heads, qo);
  memcpy(sc->q + (size_t)t0 * sc->heads * 512, qo + (size_t)(sp->first - lo) * sc->heads * 512,
         (size_t)sp->n * sc->heads * 1024);
  free(pos);
  free(slots);
  free(qo);
  /* The entries any token of the segment sees. Their RoPE rows are those of positions j rather
   * than r * j (attention reads records as they are, and rows 0..8191 are 2 MiB of table where
   * rows r * j would materialise all of it). */
  int64_t j_lo = sp->p0 / r, j_hi = (last + 1) / r;
  sc->seg_c_first_lb[s] = j_lo / bs;
  sc->seg_cbt_off[s] = sc->c_bt_entries;
  sc->seg_cbt_len[s] = 0;
  if (j_hi <= j_lo)
    return;
  for (int64_t lb = j_lo / bs; lb <= (j_hi - 1) / bs; lb++) {
    assert_true(sc->n_c_free > 0 && sc->c_bt_entries < MAX_CBT);
    sc->c_block_table[sc->c_bt_entries++] = sc->c_free_ids[--sc->n_c_free];
  }
  sc->seg_cbt_len[s] = sc->c_bt_entries - sc->seg_cbt_off[s];
  uint32_t ne = (uint32_t)(j_hi - j_lo);
  pos = malloc(ne * sizeof(int64_t));
  slots = malloc(ne * sizeof(int64_t));
  assert_true(pos && slots);
  for (uint32_t i = 0; i < ne; i++) {
    int64_t j = j_lo + i;
    pos[i] = j;
    int32_t b = sc->c_block_table[sc->seg_cbt_off[s] + (j / bs - sc->seg_c_first_lb[s])];
    slots[i] = (int64_t)b * bs + j % bs;
  }
  insert_records(sc, sc->c_cache, sc->c_n_blocks, pos, slots, ne, 1, NULL);
  free(pos);
  free(slots);
}

static void scene_open(scene_t *sc, uint32_t bs, uint32_t ratio, uint32_t heads, uint32_t n_blocks,
                       uint32_t c_n_blocks, const seg_spec_t *segs, uint32_t n_segs) {
  memset(sc, 0, sizeof(*sc));
  dsv4_backend_options_t opt = {.threads = 2};
  char why[256];
  assert_int_equal(dsv4_backend_open("cpu", &opt, &sc->be, why, sizeof(why)), 0);
  sc->bs = bs;
  sc->ratio = ratio;
  sc->heads = heads;
  sc->n_blocks = n_blocks;
  sc->c_n_blocks = c_n_blocks;
  sc->stride = DSV4_BLOCK_STRIDE(bs);
  sc->cache = calloc(n_blocks, sc->stride);
  sc->c_cache = calloc(c_n_blocks, sc->stride);
  sc->free_ids = shuffled_ids(n_blocks);
  sc->c_free_ids = shuffled_ids(c_n_blocks);
  sc->n_free = n_blocks;
  sc->n_c_free = c_n_blocks;
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, inv);
  assert_int_equal(dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &sc->rope), 0);
  for (uint32_t s = 0; s < n_segs; s++)
    sc->n += segs[s].n;
  assert_true(sc->cache && sc->c_cache && sc->n <= MAX_TOKENS && n_segs <= MAX_SEGS);
  sc->q = malloc((size_t)sc->n * heads * 1024);
  assert_non_null(sc->q);
  sc->n_segs = n_segs;
  uint32_t t = 0;
  for (uint32_t s = 0; s < n_segs; s++) {
    scene_segment(sc, s, &segs[s], t);
    for (uint32_t i = 0; i < segs[s].n; i++, t++) {
      sc->positions[t] = segs[s].first + i;
      sc->tok_seg[t] = (int32_t)s;
    }
  }
  assert_int_equal(dsv4_rope_table_ensure(sc->rope, sc->positions, sc->n), 0);
  for (uint32_t h = 0; h < DSV4_MAX_HEADS; h++)
    sc->sink[h] = rnd_unit() * 4.0f;
}

static void scene_close(scene_t *sc) {
  dsv4_backend_close(sc->be);
  dsv4_rope_table_destroy(sc->rope);
  free(sc->cache);
  free(sc->c_cache);
  free(sc->free_ids);
  free(sc->c_free_ids);
  free(sc->c_sel);
  free(sc->q);
}

/* Selection form: every token's row holds count[t] visible entries (a uniform sample, increasing),
 * then -1 up to stride. */
static void scene_select(scene_t *sc, uint32_t stride, const uint32_t *count) {
  free(sc->c_sel);
  sc->c_sel_stride = stride;
  sc->c_sel = malloc((size_t)sc->n * stride * sizeof(int32_t));
  assert_non_null(sc->c_sel);
  for (uint32_t t = 0; t < sc->n; t++) {
    int32_t *row = sc->c_sel + (size_t)t * stride;
    int64_t j_lo = sc->seg_p0[sc->tok_seg[t]] / sc->ratio;
    int64_t j_hi = (sc->positions[t] + 1) / sc->ratio;
    uint64_t left = (uint64_t)(j_hi - j_lo), want = count[t];
    assert_true(want <= left && want <= stride);
    uint32_t k = 0;
    for (int64_t j = j_lo; j < j_hi && k < count[t]; j++, left--)
      if (rng() % left < want - k)
        row[k++] = (int32_t)j;
    assert_int_equal(k, count[t]);
    for (; k < stride; k++)
      row[k] = -1;
  }
}

static dsv4_attn_args_t scene_args(const scene_t *sc, uint16_t *out, float *lse) {
  dsv4_attn_args_t a = {
      .n_tokens = sc->n,
      .n_segments = sc->n_segs,
      .heads = sc->heads,
      .q = sc->q,
      .positions = sc->positions,
      .tok_seg = sc->tok_seg,
      .seg_p0 = sc->seg_p0,
      .seg_first_lb = sc->seg_first_lb,
      .seg_bt_off = sc->seg_bt_off,
      .seg_bt_len = sc->seg_bt_len,
      .block_table = sc->block_table,
      .bt_entries = sc->bt_entries,
      .cache = sc->cache,
      .block_size = sc->bs,
      .n_blocks = sc->n_blocks,
      .stride = sc->stride,
      .sink = sc->sink,
      .rope = sc->rope,
      .out = out,
      .lse = lse,
      .ratio = sc->ratio,
      .c_cache = sc->c_cache,
      .c_n_blocks = sc->c_n_blocks,
      .seg_c_first_lb = sc->seg_c_first_lb,
      .seg_cbt_off = sc->seg_cbt_off,
      .seg_cbt_len = sc->seg_cbt_len,
      .c_block_table = sc->c_block_table,
      .c_bt_entries = sc->c_bt_entries,
      .c_sel = sc->c_sel,
      .c_sel_stride = sc->c_sel_stride,
  };
  return a;
}

/* ---- the model: SPEC §3, §7 and §8.6 written out ---- */

/* The record at offset o of block b of a cache, decoded to 512 fp32 values (literal offsets). */
static void model_record(const uint8_t *cache, uint64_t stride, int64_t bs, int32_t b, int64_t o,
                         float *k) {
  const uint8_t *blk = cache + (uint64_t)b * stride;
  const uint8_t *tok = blk + 576 * o;
  const uint8_t *codes = blk + 576 * bs + 8 * o;
  for (int d = 0; d < 448; d++)
    k[d] = ldexpf(dsv4_e4m3_to_f32(tok[d]), codes[d / 64] - 127);
  for (int d = 0; d < 64; d++) {
    uint32_t bits = ((uint32_t)tok[448 + 2 * d] | (uint32_t)tok[449 + 2 * d] << 8) << 16;
    memcpy(&k[448 + d], &bits, 4);
  }
}

/* Token t's candidates decoded in list order into keys (room for 128 + the entries); their count.
 */
static size_t model_keys(const dsv4_attn_args_t *a, uint32_t t, float *keys) {
  const int64_t bs = a->block_size, p = a->positions[t];
  const uint32_t s = (uint32_t)a->tok_seg[t];
  const int64_t p0 = a->seg_p0[s];
  size_t nc = 0;
  for (int64_t pos = window_first(p, p0); pos <= p; pos++) {
    int32_t b = a->block_table[a->seg_bt_off[s] + (pos / bs - a->seg_first_lb[s])];
    model_record(a->cache, a->stride, bs, b, pos % bs, keys + 512 * nc++);
  }
  if (!a->c_cache)
    return nc;
  int64_t j_first = p0 / a->ratio, j_end = (p + 1) / a->ratio;
  for (int64_t k = 0;; k++) {
    int64_t j;
    if (a->c_sel) {
      if (k == (int64_t)a->c_sel_stride || a->c_sel[(size_t)t * a->c_sel_stride + k] == -1)
        break;
      j = a->c_sel[(size_t)t * a->c_sel_stride + k];
    } else {
      j = j_first + k;
      if (j >= j_end)
        break;
    }
    int32_t b = a->c_block_table[a->seg_cbt_off[s] + (j / bs - a->seg_c_first_lb[s])];
    model_record(a->c_cache, a->stride, bs, b, j % bs, keys + 512 * nc++);
  }
  return nc;
}

/* SPEC §2: 32 fma chains of 16 elements from +0, then the pairwise fold 16, 8, 4, 2, 1. */
static float model_dot(const float *x, const float *y) {
  float p[32];
  for (int c = 0; c < 32; c++) {
    p[c] = 0.0f;
    for (int i = 0; i < 16; i++)
      p[c] = fmaf(x[16 * c + i], y[16 * c + i], p[c]);
  }
  for (int step = 16; step > 0; step /= 2)
    for (int c = 0; c < step; c++)
      p[c] = p[c] + p[c + step];
  return p[0];
}

/* One head of token t over its nc decoded candidates. */
static void model_head(const dsv4_attn_args_t *a, uint32_t t, uint32_t h, const float *keys,
                       size_t nc, float *l, uint16_t *out, float *lse) {
  size_t row = (size_t)t * a->heads + h;
  float q[512], n[512];
  for (int d = 0; d < 512; d++)
    q[d] = dsv4_bf16_to_f32(a->q[row * 512 + d]);
  float m = -INFINITY;
  for (size_t i = 0; i < nc; i++) {
    l[i] = model_dot(q, keys + 512 * i) * 0x1.6a09e6p-5f;
    m = fmaxf(m, l[i]);
  }
  float sum = 0.0f;
  for (size_t i = 0; i < nc; i++) {
    l[i] = dsv4_expf(l[i] - m);
    sum += l[i];
  }
  float den = a->sink ? sum + dsv4_expf(a->sink[h] - m) : sum;
  for (int d = 0; d < 512; d++) {
    n[d] = 0.0f;
    for (size_t i = 0; i < nc; i++)
      n[d] = fmaf(l[i], keys[512 * i + d], n[d]);
    n[d] /= den;
  }
  const float *cs = dsv4_rope_table_row(a->rope, a->positions[t]);
  for (int i = 0; i < 32; i++) {
    float e = n[448 + 2 * i], o = n[449 + 2 * i], c = cs[i], sn = cs[32 + i];
    n[448 + 2 * i] = fmaf(e, c, o * sn);
    n[449 + 2 * i] = fmaf(-e, sn, o * c);
  }
  for (int d = 0; d < 512; d++)
    out[row * 512 + d] = dsv4_f32_to_bf16(n[d]);
  lse[row] = m + dsv4_logf(sum);
}

static void model(const dsv4_attn_args_t *a, uint16_t *out, float *lse) {
  size_t most = 128 + (a->c_sel ? a->c_sel_stride : 8192);
  float *keys = malloc(most * 512 * sizeof(float)), *l = malloc(most * sizeof(float));
  assert_true(keys && l);
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    size_t nc = model_keys(a, t, keys);
    assert_true(nc <= most);
    for (uint32_t h = 0; h < a->heads; h++)
      model_head(a, t, h, keys, nc, l, out, lse);
  }
  free(keys);
  free(l);
}

/* ---- helpers of the tests ---- */

typedef struct {
  uint16_t *out, *want;
  float *lse, *want_lse;
  size_t n_out, n_lse;
} outputs_t;

static void outputs_alloc(outputs_t *o, const scene_t *sc) {
  o->n_out = (size_t)sc->n * sc->heads * 512;
  o->n_lse = (size_t)sc->n * sc->heads;
  o->out = malloc(o->n_out * 2);
  o->want = malloc(o->n_out * 2);
  o->lse = malloc(o->n_lse * 4);
  o->want_lse = malloc(o->n_lse * 4);
  assert_true(o->out && o->want && o->lse && o->want_lse);
}

static void outputs_free(outputs_t *o) {
  free(o->out);
  free(o->want);
  free(o->lse);
  free(o->want_lse);
}

static void expect_equal(const outputs_t *o, uint32_t heads, const char *what, const char *how) {
  for (size_t i = 0; i < o->n_out; i++)
    if (o->out[i] != o->want[i]) {
      print_error("%s (%s): out[token %zu, head %zu, dim %zu] = 0x%04x, model 0x%04x\n", what, how,
                  i / 512 / heads, i / 512 % heads, i % 512, o->out[i], o->want[i]);
      fail();
    }
  for (size_t i = 0; i < o->n_lse; i++)
    if (f2u(o->lse[i]) != f2u(o->want_lse[i])) {
      print_error("%s (%s): lse[%zu] = %a, model %a\n", what, how, i, (double)o->lse[i],
                  (double)o->want_lse[i]);
      fail();
    }
}

/* The launch equals the model byte for byte at every level this machine has and at 1, 2 and 3
 * worker threads. */
static void expect_model(const scene_t *sc, const char *what) {
  outputs_t o;
  outputs_alloc(&o, sc);
  dsv4_attn_args_t a = scene_args(sc, o.out, o.lse);
  model(&a, o.want, o.want_lse);
  for (uint32_t threads = 1; threads <= 3; threads++) {
    dsv4_backend_options_t opt = {.threads = threads};
    dsv4_backend_t *be;
    char why[128];
    assert_int_equal(dsv4_backend_open("cpu", &opt, &be, why, sizeof(why)), 0);
    for (int isa = 0; isa < DSV4__CPU_ISA_COUNT; isa++) {
      if (dsv4__cpu_backend_set_isa(be, isa) != 0) {
        if (threads == 1)
          printf("attention_union: level %s not supported here\n", dsv4__cpu_isa_name(isa));
        continue;
      }
      char how[64];
      snprintf(how, sizeof(how), "%s, %u threads", dsv4__cpu_isa_name(isa), threads);
      memset(o.out, 0xAB, o.n_out * 2);
      memset(o.lse, 0xAB, o.n_lse * 4);
      assert_int_equal(be->ops->attention(be, &a), 0);
      expect_equal(&o, sc->heads, what, how);
    }
    dsv4_backend_close(be);
  }
  outputs_free(&o);
}

/* ---- the tests ---- */

/*
 * Ratio 128, range form, block size 16: a segment from p0 = 1000 (entries from 7) whose tokens
 * straddle an emission (position 128 * 40 - 1 sees the entry it emits, 39), and a decode token of
 * a sequence from 0 with 70 entries over five blocks. Without a sink, then with.
 */
static void test_range_128(void **state) {
  (void)state;
  const seg_spec_t segs[] = {{1000, 128 * 40 - 3, 5}, {0, 128 * 70 + 5, 1}};
  scene_t sc;
  scene_open(&sc, 16, 128, 8, 64, 32, segs, 2);
  assert_true(sc.seg_cbt_len[0] >= 3 && sc.seg_cbt_len[1] == 5);
  expect_model(&sc, "ratio 128, range");
  memset(sc.sink, 0, sizeof(sc.sink));
  sc.sink[1] = INFINITY;
  sc.sink[2] = -INFINITY;
  expect_model(&sc, "ratio 128, range, sinks");
  scene_close(&sc);
}

/*
 * Ratio 4, selection form (stride 300) with 13 heads (the vector levels' last quad holds one real
 * head): lists of 200 (longer than a tile) then -1, none, 1, 129, 256 (exactly two tiles), a full
 * row of 300 without padding, and the entry the token emits.
 */
static void test_select_4(void **state) {
  (void)state;
  const seg_spec_t segs[] = {{0, 1999, 6}, {6, 1600, 1}};
  scene_t sc;
  scene_open(&sc, 64, 4, 13, 16, 32, segs, 2);
  const uint32_t counts[7] = {200, 0, 1, 129, 256, 300, 120};
  scene_select(&sc, 300, counts);
  expect_model(&sc, "ratio 4, selection");
  /* Token 0 at 1999 emits entry 499: its list ends with it. */
  sc.c_sel[199] = 499;
  assert_true(sc.c_sel[198] < 499);
  expect_model(&sc, "ratio 4, selection with the emitted entry");
  /* The range form is allowed at ratio 4 too (every visible entry). */
  free(sc.c_sel);
  sc.c_sel = NULL;
  sc.c_sel_stride = 0;
  expect_model(&sc, "ratio 4, range");
  scene_close(&sc);
}

/*
 * Long lists: a selection of 1024 entries (V4-Pro's index_topk) for two tokens, and the range of
 * 8192 entries a ratio-128 token sees at the largest position, with 40 heads, whose logits (40 x
 * 8320) exceed what one work item keeps, so the heads go in several groups.
 */
static void test_long_lists(void **state) {
  (void)state;
  const seg_spec_t sel_segs[] = {{0, 8190, 2}};
  scene_t sc;
  scene_open(&sc, 64, 4, 8, 8, 40, sel_segs, 1);
  const uint32_t counts[2] = {1024, 1024};
  scene_select(&sc, 1024, counts);
  expect_model(&sc, "a selection of 1024");
  scene_close(&sc);
  const seg_spec_t range_segs[] = {{0, DSV4_MAX_POSITION_DEFAULT - 1, 1}};
  scene_open(&sc, 64, 128, 40, 8, 130, range_segs, 1);
  assert_int_equal(sc.seg_cbt_len[0], 8192 / 64);
  expect_model(&sc, "a range of 8192");
  scene_close(&sc);
}

/* Tokens that see no entry (positions below ratio - 1, or an empty selection): the union launch
 * stores the SWA-only launch's bytes. */
static void test_no_entries(void **state) {
  (void)state;
  const seg_spec_t segs[] = {{0, 0, 8}, {5, 100, 3}};
  scene_t sc;
  scene_open(&sc, 16, 128, 8, 32, 4, segs, 2);
  assert_int_equal(sc.c_bt_entries, 0);
  outputs_t o;
  outputs_alloc(&o, &sc);
  dsv4_attn_args_t a = scene_args(&sc, o.want, o.want_lse);
  a.c_cache = NULL;
  assert_int_equal(sc.be->ops->attention(sc.be, &a), 0);
  a = scene_args(&sc, o.out, o.lse);
  assert_int_equal(sc.be->ops->attention(sc.be, &a), 0);
  expect_equal(&o, sc.heads, "no visible entry", "range");
  const uint32_t none[11] = {0};
  sc.ratio = 4;
  scene_select(&sc, 16, none);
  a = scene_args(&sc, o.out, o.lse);
  memset(o.out, 0, o.n_out * 2);
  assert_int_equal(sc.be->ops->attention(sc.be, &a), 0);
  expect_equal(&o, sc.heads, "an empty selection", "selection");
  outputs_free(&o);
  scene_close(&sc);
}

/* The launch is refused, and out and lse keep every byte they had. */
static void expect_refused(const scene_t *sc, const dsv4_attn_args_t *a, outputs_t *o,
                           const char *what) {
  memset(o->out, 0xAB, o->n_out * 2);
  memset(o->lse, 0xCD, o->n_lse * 4);
  int rc = sc->be->ops->attention(sc->be, a);
  if (rc != DSV4_EINVAL) {
    print_error("%s: attention returned %d, expected DSV4_EINVAL\n", what, rc);
    fail();
  }
  for (size_t i = 0; i < o->n_out; i++)
    assert_int_equal(o->out[i], 0xABAB);
  for (size_t i = 0; i < o->n_lse; i++)
    assert_int_equal(f2u(o->lse[i]), 0xCDCDCDCDu);
}

/* Every way the selection can be wrong. Token 0 at 1001 of a sequence from p0 = 70 sees entries
 * 17..249 (logical blocks 1..15 of 16 entries): 17, 100, 101, 249 are listed. */
static void refusals_select(scene_t *sc, outputs_t *o) {
  const dsv4_attn_args_t a = scene_args(sc, o->out, o->lse);
  int32_t *row = sc->c_sel;
  const int32_t good[5] = {17, 100, 101, 249, -1};
  memcpy(row, good, sizeof(good));
  assert_int_equal(sc->be->ops->attention(sc->be, &a), 0);
  row[2] = 100;
  expect_refused(sc, &a, o, "a repeated entry");
  row[2] = 99;
  expect_refused(sc, &a, o, "a decreasing entry");
  memcpy(row, good, sizeof(good));
  row[3] = 250;
  expect_refused(sc, &a, o, "an entry not yet visible (emitted by position 1003)");
  row[3] = 249;
  row[0] = 16;
  expect_refused(sc, &a, o, "an entry below floor(p0 / ratio)");
  row[0] = -2;
  expect_refused(sc, &a, o, "a negative entry other than -1");
  memcpy(row, good, sizeof(good));
  row[4] = 250; /* the row's last slot: no -1 ends the list */
  expect_refused(sc, &a, o, "an invisible entry in the last slot");
  memcpy(row, good, sizeof(good));
  row[4] = -1;
  row[1] = -1; /* the list ends here: what follows is never read */
  row[2] = 5;
  assert_int_equal(sc->be->ops->attention(sc->be, &a), 0);
  memcpy(row, good, sizeof(good));
}

/* Every way a compressed block can be missing. */
static void refusals_blocks(scene_t *sc, outputs_t *o) {
  dsv4_attn_args_t a = scene_args(sc, o->out, o->lse);
  int32_t *first = &sc->c_block_table[sc->seg_cbt_off[0]];
  int32_t saved = *first;
  *first = -1;
  expect_refused(sc, &a, o, "a compressed block missing");
  *first = (int32_t)sc->c_n_blocks;
  expect_refused(sc, &a, o, "a compressed block past the pool");
  *first = saved;
  sc->seg_c_first_lb[0] += 1;
  expect_refused(sc, &a, o, "a compressed block before the table");
  sc->seg_c_first_lb[0] -= 1;
  sc->seg_cbt_len[0] -= 1;
  expect_refused(sc, &a, o, "a compressed block after the table");
  sc->seg_cbt_len[0] += 1;
  a.c_bt_entries = sc->seg_cbt_off[0] + sc->seg_cbt_len[0] - 1;
  expect_refused(sc, &a, o, "a compressed table past c_bt_entries");
  /* The range form reads every visible entry's block. */
  a = scene_args(sc, o->out, o->lse);
  a.c_sel = NULL;
  a.c_sel_stride = 0;
  assert_int_equal(sc->be->ops->attention(sc->be, &a), 0);
  int32_t *last = &sc->c_block_table[sc->seg_cbt_off[0] + sc->seg_cbt_len[0] - 1];
  saved = *last;
  *last = -1;
  expect_refused(sc, &a, o, "the range's last block missing");
  *last = saved;
}

/* The argument check of the new fields. */
static void refusals_args(scene_t *sc, outputs_t *o) {
  const dsv4_attn_args_t good = scene_args(sc, o->out, o->lse);
  dsv4_attn_args_t a = good;
  static const uint32_t ratios[] = {0, 1, 2, 64, 256};
  for (size_t i = 0; i < sizeof(ratios) / sizeof(ratios[0]); i++) {
    a.ratio = ratios[i];
    expect_refused(sc, &a, o, "a ratio other than 4 or 128");
  }
  a = good;
  a.c_cache = NULL;
  expect_refused(sc, &a, o, "a selection without a compressed cache");
  a = good;
  a.c_n_blocks = 0;
  expect_refused(sc, &a, o, "an empty compressed pool");
  a = good;
  a.c_sel_stride = 0;
  expect_refused(sc, &a, o, "a selection of stride 0");
  const void **ptrs[] = {(const void **)&a.seg_c_first_lb, (const void **)&a.seg_cbt_off,
                         (const void **)&a.seg_cbt_len, (const void **)&a.c_block_table};
  for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++) {
    a = good;
    *ptrs[i] = NULL;
    expect_refused(sc, &a, o, "a NULL compressed input");
  }
  assert_int_equal(dsv4_backend_check_attn_args(&good), 0);
  /* An SWA-only launch ignores the compressed fields but the selection. */
  a = good;
  a.c_cache = NULL;
  a.c_sel = NULL;
  a.ratio = 7;
  a.c_block_table = NULL;
  assert_int_equal(sc->be->ops->attention(sc->be, &a), 0);
}

static void test_refusals(void **state) {
  (void)state;
  const seg_spec_t segs[] = {{70, 1001, 1}, {0, 3, 1}};
  scene_t sc;
  scene_open(&sc, 16, 4, 8, 32, 32, segs, 2);
  assert_int_equal(sc.seg_cbt_len[0], 15);
  const uint32_t counts[2] = {4, 0};
  scene_select(&sc, 5, counts);
  outputs_t o;
  outputs_alloc(&o, &sc);
  refusals_select(&sc, &o);
  refusals_blocks(&sc, &o);
  refusals_args(&sc, &o);
  outputs_free(&o);
  scene_close(&sc);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_range_128),  cmocka_unit_test(test_select_4),
      cmocka_unit_test(test_long_lists), cmocka_unit_test(test_no_entries),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
