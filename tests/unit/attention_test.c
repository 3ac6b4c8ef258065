/*
 * Exact-mode attention on the CPU backend (SPEC §7). Batches are written into a paged cache by the
 * backend's own map_slots and qkv_insert, as the engine runs them, and the attention launch is
 * compared byte for byte with a model written here from the SPEC: records decoded with literal
 * offsets (SPEC §3), the canonical dot product spelled out, the steps of §7 in order. Then the
 * edges: a first token (one candidate), p0 > 0, windows across block boundaries with scattered
 * block ids, prefill chunks longer than the window, sinks of +-inf and finite values, equal scores,
 * inputs at the validation bound, 8, 64 and 128 heads and head slices, every kernel level against
 * the scalar one, repeated runs and thread counts, and every malformed launch refused with
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

#define MAX_LB 512 /* logical blocks per test sequence */

#define TEST_RNG_SEED 0x9E3779B97F4A7C15ull
#include "test_rng.h"

static uint16_t bf16(float f) {
  return dsv4_f32_to_bf16(f);
}

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* ---- a cache, its sequences and batches, driven through the backend as the engine does ---- */

typedef struct {
  dsv4_backend_t *be;
  dsv4_devbuf_t cache;
  uint32_t bs, n_blocks;
  uint64_t stride;
  dsv4_rope_table_t *rope;
  int32_t *free_ids; /* a shuffled list of block ids not yet handed out */
  uint32_t n_free;
} fixture_t;

typedef struct {
  int64_t p0, next;
  int32_t blocks[MAX_LB]; /* physical block of logical block p0 / bs + i, or -1 */
} seq_t;

typedef struct {
  uint32_t n, n_segs, heads;
  int64_t *positions;
  int32_t *tok_seg;
  int64_t *seg_p0, *seg_first_lb;
  uint32_t *seg_bt_off, *seg_bt_len;
  int32_t *block_table;
  uint32_t bt_entries;
  int64_t *slots;
  uint16_t *q, *kv, *q_out;
} batch_t;

static void fixture_open(fixture_t *fx, uint32_t bs, uint32_t n_blocks, unsigned threads) {
  memset(fx, 0, sizeof(*fx));
  dsv4_backend_options_t opt = {.threads = threads};
  char why[256];
  assert_int_equal(dsv4_backend_open("cpu", &opt, &fx->be, why, sizeof(why)), 0);
  fx->bs = bs;
  fx->n_blocks = n_blocks;
  fx->stride = DSV4_BLOCK_STRIDE(bs);
  assert_int_equal(fx->be->ops->buf_alloc(fx->be, n_blocks * fx->stride, &fx->cache), 0);
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv_freq);
  assert_int_equal(dsv4_rope_table_create(inv_freq, DSV4_MAX_POSITION_DEFAULT, &fx->rope), 0);
  fx->free_ids = malloc(n_blocks * sizeof(int32_t));
  assert_non_null(fx->free_ids);
  for (uint32_t i = 0; i < n_blocks; i++)
    fx->free_ids[i] = (int32_t)i;
  for (uint32_t i = n_blocks - 1; i > 0; i--) {
    uint32_t j = (uint32_t)(rng() % (i + 1));
    int32_t t = fx->free_ids[i];
    fx->free_ids[i] = fx->free_ids[j];
    fx->free_ids[j] = t;
  }
  fx->n_free = n_blocks;
}

static void fixture_close(fixture_t *fx) {
  fx->be->ops->buf_free(fx->be, &fx->cache);
  dsv4_backend_close(fx->be);
  dsv4_rope_table_destroy(fx->rope);
  free(fx->free_ids);
}

static void seq_init(seq_t *sq, int64_t p0) {
  sq->p0 = p0;
  sq->next = p0;
  for (int i = 0; i < MAX_LB; i++)
    sq->blocks[i] = -1;
}

static void batch_free(batch_t *b) {
  free(b->positions);
  free(b->tok_seg);
  free(b->seg_p0);
  free(b->seg_first_lb);
  free(b->seg_bt_off);
  free(b->seg_bt_len);
  free(b->block_table);
  free(b->slots);
  free(b->q);
  free(b->kv);
  free(b->q_out);
  memset(b, 0, sizeof(*b));
}

/* Random q and kv of the given magnitude (kv_mag 0: the default spread of about 1). */
static void batch_fill(batch_t *b, float kv_mag) {
  for (size_t i = 0; i < (size_t)b->n * b->heads * DSV4_HEAD_DIM; i++)
    b->q[i] = bf16(rnd_unit() * 2.0f);
  for (size_t i = 0; i < (size_t)b->n * DSV4_HEAD_DIM; i++)
    b->kv[i] = bf16(kv_mag > 0.0f ? (rng() & 1 ? kv_mag : -kv_mag) : rnd_unit() * 1.5f);
}

/* A batch of segments seqs[i] x lens[i], each continuing its sequence, with its block table. */
static void batch_build(fixture_t *fx, batch_t *b, seq_t **seqs, const uint32_t *lens,
                        uint32_t n_segs, uint32_t heads) {
  memset(b, 0, sizeof(*b));
  b->n_segs = n_segs;
  b->heads = heads;
  for (uint32_t s = 0; s < n_segs; s++)
    b->n += lens[s];
  b->positions = malloc(b->n * sizeof(int64_t));
  b->tok_seg = malloc(b->n * sizeof(int32_t));
  b->seg_p0 = malloc(n_segs * sizeof(int64_t));
  b->seg_first_lb = malloc(n_segs * sizeof(int64_t));
  b->seg_bt_off = malloc(n_segs * sizeof(uint32_t));
  b->seg_bt_len = malloc(n_segs * sizeof(uint32_t));
  b->block_table = malloc((size_t)n_segs * MAX_LB * sizeof(int32_t));
  b->slots = malloc(b->n * sizeof(int64_t));
  b->q = malloc((size_t)b->n * heads * DSV4_HEAD_DIM * 2);
  b->kv = malloc((size_t)b->n * DSV4_HEAD_DIM * 2);
  b->q_out = malloc((size_t)b->n * heads * DSV4_HEAD_DIM * 2);
  assert_true(b->positions && b->tok_seg && b->seg_p0 && b->seg_first_lb && b->seg_bt_off &&
              b->seg_bt_len && b->block_table && b->slots && b->q && b->kv && b->q_out);
  const int64_t bs = fx->bs;
  uint32_t t = 0;
  for (uint32_t s = 0; s < n_segs; s++) {
    seq_t *sq = seqs[s];
    int64_t start = sq->next, last = start + lens[s] - 1;
    int64_t lo = start - (DSV4_WINDOW - 1) > sq->p0 ? start - (DSV4_WINDOW - 1) : sq->p0;
    b->seg_p0[s] = sq->p0;
    b->seg_first_lb[s] = lo / bs;
    b->seg_bt_off[s] = b->bt_entries;
    for (int64_t lb = lo / bs; lb <= last / bs; lb++) {
      int32_t *id = &sq->blocks[lb - sq->p0 / bs];
      if (*id < 0) {
        assert_true(fx->n_free > 0);
        *id = fx->free_ids[--fx->n_free];
      }
      b->block_table[b->bt_entries++] = *id;
    }
    b->seg_bt_len[s] = b->bt_entries - b->seg_bt_off[s];
    for (int64_t p = start; p <= last; p++, t++) {
      b->positions[t] = p;
      b->tok_seg[t] = (int32_t)s;
    }
  }
  assert_int_equal(dsv4_rope_table_ensure(fx->rope, b->positions, b->n), 0);
  batch_fill(b, 0.0f);
}

/* map_slots then qkv_insert, as the engine runs a batch; the sequences move on. */
static void batch_insert(fixture_t *fx, batch_t *b, seq_t **seqs) {
  dsv4_map_args_t ma = {
      .n_tokens = b->n,
      .n_segments = b->n_segs,
      .block_size = fx->bs,
      .n_blocks = fx->n_blocks,
      .positions = b->positions,
      .tok_seg = b->tok_seg,
      .seg_first_lb = b->seg_first_lb,
      .seg_bt_off = b->seg_bt_off,
      .seg_bt_len = b->seg_bt_len,
      .block_table = b->block_table,
      .slots = b->slots,
      .bt_entries = b->bt_entries,
  };
  assert_int_equal(fx->be->ops->map_slots(fx->be, &ma), 0);
  dsv4_insert_args_t ia = {
      .n_tokens = b->n,
      .heads = b->heads,
      .q = b->q,
      .kv = b->kv,
      .positions = b->positions,
      .slots = b->slots,
      .rope = fx->rope,
      .eps = 1e-6f,
      .write_kv = 1,
      .q_out = b->q_out,
      .cache = fx->cache.ptr,
      .block_size = fx->bs,
      .n_blocks = fx->n_blocks,
      .stride = fx->stride,
  };
  assert_int_equal(fx->be->ops->qkv_insert(fx->be, &ia), 0);
  for (uint32_t t = 0; t < b->n; t++)
    seqs[b->tok_seg[t]]->next = b->positions[t] + 1;
}

static dsv4_attn_args_t attn_args(const fixture_t *fx, const batch_t *b, const float *sink,
                                  uint16_t *out, float *lse) {
  dsv4_attn_args_t a = {
      .n_tokens = b->n,
      .n_segments = b->n_segs,
      .heads = b->heads,
      .q = b->q_out,
      .positions = b->positions,
      .tok_seg = b->tok_seg,
      .seg_p0 = b->seg_p0,
      .seg_first_lb = b->seg_first_lb,
      .seg_bt_off = b->seg_bt_off,
      .seg_bt_len = b->seg_bt_len,
      .block_table = b->block_table,
      .bt_entries = b->bt_entries,
      .cache = fx->cache.ptr,
      .block_size = fx->bs,
      .n_blocks = fx->n_blocks,
      .stride = fx->stride,
      .sink = sink,
      .rope = fx->rope,
      .out = out,
      .lse = lse,
  };
  return a;
}

/* ---- the model: SPEC §3 and §7 written out ---- */

/* Candidate i of token t: its 584-byte record decoded to 512 fp32 values (literal offsets). */
static void model_key(const dsv4_attn_args_t *a, int64_t pos, uint32_t s, float *k) {
  int64_t bs = a->block_size;
  int32_t block = a->block_table[a->seg_bt_off[s] + (pos / bs - a->seg_first_lb[s])];
  const uint8_t *blk = a->cache + (uint64_t)block * a->stride;
  const uint8_t *tok = blk + 576 * (pos % bs);
  const uint8_t *codes = blk + 576 * bs + 8 * (pos % bs);
  for (int d = 0; d < 448; d++)
    k[d] = ldexpf(dsv4_e4m3_to_f32(tok[d]), codes[d / 64] - 127);
  for (int d = 0; d < 64; d++) {
    uint32_t bits = ((uint32_t)tok[448 + 2 * d] | (uint32_t)tok[449 + 2 * d] << 8) << 16;
    memcpy(&k[448 + d], &bits, 4);
  }
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

static float model_k[DSV4_WINDOW][DSV4_HEAD_DIM];

static void model_token(const dsv4_attn_args_t *a, uint32_t t, uint16_t *out, float *lse) {
  uint32_t s = (uint32_t)a->tok_seg[t];
  int64_t p = a->positions[t];
  int64_t first = p - 127 > a->seg_p0[s] ? p - 127 : a->seg_p0[s];
  int nc = (int)(p - first + 1);
  for (int i = 0; i < nc; i++)
    model_key(a, first + i, s, model_k[i]);
  const float *cs = dsv4_rope_table_row(a->rope, p);
  for (uint32_t h = 0; h < a->heads; h++) {
    size_t row = (size_t)t * a->heads + h;
    float q[512], l[DSV4_WINDOW], n[512];
    for (int d = 0; d < 512; d++)
      q[d] = dsv4_bf16_to_f32(a->q[row * 512 + d]);
    float m = -INFINITY;
    for (int i = 0; i < nc; i++) {
      l[i] = model_dot(q, model_k[i]) * 0x1.6a09e6p-5f;
      m = fmaxf(m, l[i]);
    }
    float sum = 0.0f;
    for (int i = 0; i < nc; i++) {
      l[i] = dsv4_expf(l[i] - m);
      sum += l[i];
    }
    float den = a->sink ? sum + dsv4_expf(a->sink[h] - m) : sum;
    for (int d = 0; d < 512; d++) {
      n[d] = 0.0f;
      for (int i = 0; i < nc; i++)
        n[d] = fmaf(l[i], model_k[i][d], n[d]);
      n[d] /= den;
    }
    for (int i = 0; i < 32; i++) {
      float e = n[448 + 2 * i], o = n[449 + 2 * i], c = cs[i], sn = cs[32 + i];
      n[448 + 2 * i] = fmaf(e, c, o * sn);
      n[449 + 2 * i] = fmaf(-e, sn, o * c);
    }
    for (int d = 0; d < 512; d++)
      out[row * 512 + d] = bf16(n[d]);
    if (lse)
      lse[row] = m + dsv4_logf(sum);
  }
}

static void model(const dsv4_attn_args_t *a, uint16_t *out, float *lse) {
  for (uint32_t t = 0; t < a->n_tokens; t++)
    model_token(a, t, out, lse);
}

/* ---- helpers of the tests ---- */

typedef struct {
  uint16_t *out, *want;
  float *lse, *want_lse;
  size_t n_out, n_lse;
} outputs_t;

static void outputs_alloc(outputs_t *o, const batch_t *b) {
  o->n_out = (size_t)b->n * b->heads * DSV4_HEAD_DIM;
  o->n_lse = (size_t)b->n * b->heads;
  o->out = malloc(o->n_out * 2);
  o->want = malloc(o->n_out * 2);
  o->lse = malloc(o->n_lse * 4);
  o->want_lse = malloc(o->n_lse * 4);
  assert_true(o->out && o->want && o->lse && o->want_lse);
  memset(o->out, 0xAB, o->n_out * 2);
  memset(o->lse, 0xAB, o->n_lse * 4);
}

static void outputs_free(outputs_t *o) {
  free(o->out);
  free(o->want);
  free(o->lse);
  free(o->want_lse);
}

/* The launch equals the model byte for byte (out and lse); reports the first difference. */
static void expect_model(fixture_t *fx, const batch_t *b, const float *sink, const char *what) {
  outputs_t o;
  outputs_alloc(&o, b);
  dsv4_attn_args_t a = attn_args(fx, b, sink, o.out, o.lse);
  assert_int_equal(fx->be->ops->attention(fx->be, &a), 0);
  model(&a, o.want, o.want_lse);
  for (size_t i = 0; i < o.n_out; i++)
    if (o.out[i] != o.want[i]) {
      print_error("%s: out[token %zu, head %zu, dim %zu] = 0x%04x, model 0x%04x\n", what,
                  i / 512 / b->heads, i / 512 % b->heads, i % 512, o.out[i], o.want[i]);
      fail();
    }
  assert_memory_equal(o.lse, o.want_lse, o.n_lse * 4);
  outputs_free(&o);
}

/* One sequence from p0: a prefill of `first` tokens, then decode steps, each checked. */
static void run_sequence(uint32_t bs, int64_t p0, uint32_t first, uint32_t steps, uint32_t heads) {
  fixture_t fx;
  fixture_open(&fx, bs, 64, 2);
  seq_t sq;
  seq_init(&sq, p0);
  seq_t *seqs[1] = {&sq};
  for (uint32_t k = 0; k <= steps; k++) {
    uint32_t len = k == 0 ? first : 1;
    batch_t b;
    batch_build(&fx, &b, seqs, &len, 1, heads);
    batch_insert(&fx, &b, seqs);
    expect_model(&fx, &b, NULL, "sequence");
    batch_free(&b);
  }
  fixture_close(&fx);
}

/* ---- the tests ---- */

/* The first token of a sequence has itself as its only candidate: o = k exactly, lse = its logit.
 */
static void test_first_token(void **state) {
  (void)state;
  fixture_t fx;
  fixture_open(&fx, 64, 8, 2);
  seq_t sq;
  seq_init(&sq, 0);
  seq_t *seqs[1] = {&sq};
  uint32_t len = 1;
  batch_t b;
  batch_build(&fx, &b, seqs, &len, 1, 8);
  batch_insert(&fx, &b, seqs);
  outputs_t o;
  outputs_alloc(&o, &b);
  dsv4_attn_args_t a = attn_args(&fx, &b, NULL, o.out, o.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  float k[512];
  model_key(&a, 0, 0, k);
  for (uint32_t h = 0; h < 8; h++) {
    /* An e4m3 value times a power of two is exact in bf16. */
    for (int d = 0; d < 448; d++)
      assert_int_equal(o.out[h * 512 + d], bf16(k[d]));
    float q[512];
    for (int d = 0; d < 512; d++)
      q[d] = dsv4_bf16_to_f32(b.q_out[h * 512 + d]);
    assert_int_equal(f2u(o.lse[h]), f2u(model_dot(q, k) * 0x1.6a09e6p-5f));
  }
  model(&a, o.want, o.want_lse);
  assert_memory_equal(o.out, o.want, o.n_out * 2);
  outputs_free(&o);
  batch_free(&b);
  fixture_close(&fx);
}

/* A sequence that starts at p0 > 0: no candidate below p0, then a full window. */
static void test_p0_positive(void **state) {
  (void)state;
  run_sequence(64, 1000, 20, 3, 8);
  run_sequence(16, 1000 + 7, 150, 2, 8); /* p0 inside a block */
}

/* Windows across block boundaries (block size 16: 9 blocks per window, scattered ids), and prefill
 * chunks longer than the window. */
static void test_block_boundaries(void **state) {
  (void)state;
  run_sequence(16, 0, 300, 20, 8);
  run_sequence(256, 3, 400, 2, 8);
  run_sequence(32, 0, 129, 1, 8);
}

/* Several sequences in one batch, prefills and decodes mixed, at several head counts. */
static void mixed_batch(fixture_t *fx, uint32_t heads, const float *sink, const char *what) {
  seq_t s0, s1, s2;
  seq_init(&s0, 0);
  seq_init(&s1, 500);
  seq_init(&s2, 61);
  seq_t *seqs[3] = {&s0, &s1, &s2};
  uint32_t lens[3] = {140, 3, 70};
  batch_t b;
  batch_build(fx, &b, seqs, lens, 3, heads);
  batch_insert(fx, &b, seqs);
  expect_model(fx, &b, sink, what);
  batch_free(&b);
  uint32_t lens2[3] = {1, 1, 5};
  batch_build(fx, &b, seqs, lens2, 3, heads);
  batch_insert(fx, &b, seqs);
  expect_model(fx, &b, sink, what);
  batch_free(&b);
}

static void test_heads(void **state) {
  (void)state;
  static const uint32_t hs[] = {8, 64, 128, 1};
  for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++) {
    fixture_t fx;
    fixture_open(&fx, 64, 32, 2);
    float sink[128];
    for (int h = 0; h < 128; h++)
      sink[h] = rnd_unit() * 4.0f;
    mixed_batch(&fx, hs[i], sink, "heads");
    fixture_close(&fx);
  }
}

/* Sinks: +inf zeroes every output (lse keeps its value: it excludes the sink), -inf is no sink,
 * finite values only enlarge the denominator. */
static void test_sinks(void **state) {
  (void)state;
  fixture_t fx;
  fixture_open(&fx, 64, 16, 2);
  seq_t sq;
  seq_init(&sq, 0);
  seq_t *seqs[1] = {&sq};
  uint32_t len = 200;
  batch_t b;
  batch_build(&fx, &b, seqs, &len, 1, 8);
  batch_insert(&fx, &b, seqs);
  float pinf[8], ninf[8], mixed[8] = {0.0f, -3.5f, 2.0f, 30.0f, -INFINITY, INFINITY, 1e30f, -1e30f};
  for (int h = 0; h < 8; h++) {
    pinf[h] = INFINITY;
    ninf[h] = -INFINITY;
  }
  outputs_t o0, o1, o2;
  outputs_alloc(&o0, &b);
  outputs_alloc(&o1, &b);
  outputs_alloc(&o2, &b);
  dsv4_attn_args_t a = attn_args(&fx, &b, NULL, o0.out, o0.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  a = attn_args(&fx, &b, ninf, o1.out, o1.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  assert_memory_equal(o0.out, o1.out, o0.n_out * 2);
  assert_memory_equal(o0.lse, o1.lse, o0.n_lse * 4);
  a = attn_args(&fx, &b, pinf, o2.out, o2.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  for (size_t i = 0; i < o2.n_out; i++)
    assert_int_equal(o2.out[i] & 0x7fffu, 0);
  assert_memory_equal(o0.lse, o2.lse, o0.n_lse * 4);
  /* Finite sinks lower every output's magnitude; the model checks the bytes. */
  expect_model(&fx, &b, mixed, "sinks");
  a = attn_args(&fx, &b, mixed, o2.out, o2.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  for (uint32_t t = 0; t < b.n; t++) {
    const uint16_t *r = o2.out + (size_t)t * 8 * 512;
    for (int d = 0; d < 512; d++) {
      assert_int_equal(r[5 * 512 + d] & 0x7fffu, 0);                           /* +inf */
      assert_int_equal(r[4 * 512 + d], o0.out[((size_t)t * 8 + 4) * 512 + d]); /* -inf */
      assert_int_equal(r[7 * 512 + d], o0.out[((size_t)t * 8 + 7) * 512 + d]); /* e^-1e30 = 0 */
      assert_int_equal(r[6 * 512 + d] & 0x7fffu, 0); /* e^(1e30 - m) = inf */
    }
  }
  outputs_free(&o0);
  outputs_free(&o1);
  outputs_free(&o2);
  batch_free(&b);
  fixture_close(&fx);
}

/* Equal scores (zero queries): every weight is exactly 1, S = nc and lse = ln nc exactly. */
static void test_equal_scores(void **state) {
  (void)state;
  fixture_t fx;
  fixture_open(&fx, 16, 32, 2);
  seq_t sq;
  seq_init(&sq, 5);
  seq_t *seqs[1] = {&sq};
  uint32_t len = 140;
  batch_t b;
  batch_build(&fx, &b, seqs, &len, 1, 8);
  batch_insert(&fx, &b, seqs);
  memset(b.q_out, 0, (size_t)b.n * 8 * 512 * 2);
  outputs_t o;
  outputs_alloc(&o, &b);
  dsv4_attn_args_t a = attn_args(&fx, &b, NULL, o.out, o.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  for (uint32_t t = 0; t < b.n; t++) {
    uint32_t nc = t + 1 < DSV4_WINDOW ? t + 1 : DSV4_WINDOW;
    for (int h = 0; h < 8; h++)
      assert_int_equal(f2u(o.lse[t * 8 + h]), f2u(dsv4_logf((float)nc)));
  }
  model(&a, o.want, o.want_lse);
  assert_memory_equal(o.out, o.want, o.n_out * 2);
  outputs_free(&o);
  batch_free(&b);
  fixture_close(&fx);
}

/* Inputs at the validation bound (SPEC §6: |x| < 2^59): kv of +-(2^59 - 2^51) (prenormed, so the
 * cache holds values near 2^59) and queries with one dominant element per head (q_out near
 * sqrt(512)). Logits near 2^69 and sums near 2^67 stay finite. */
static void test_input_bound(void **state) {
  (void)state;
  fixture_t fx;
  fixture_open(&fx, 64, 16, 2);
  seq_t sq;
  seq_init(&sq, 0);
  seq_t *seqs[1] = {&sq};
  uint32_t len = 130;
  batch_t b;
  batch_build(&fx, &b, seqs, &len, 1, 8);
  batch_fill(&b, dsv4_bf16_to_f32(0x5CFF));
  for (uint32_t i = 0; i < b.n * 8; i++) {
    memset(b.q + (size_t)i * 512, 0, 1024);
    b.q[(size_t)i * 512 + rng() % 512] = (uint16_t)(0x5CFF | (rng() & 1 ? 0x8000 : 0));
  }
  batch_insert(&fx, &b, seqs);
  outputs_t o;
  outputs_alloc(&o, &b);
  dsv4_attn_args_t a = attn_args(&fx, &b, NULL, o.out, o.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  for (size_t i = 0; i < o.n_out; i++)
    assert_true((o.out[i] & 0x7f80u) != 0x7f80u);
  for (size_t i = 0; i < o.n_lse; i++)
    assert_true(isfinite(o.lse[i]));
  model(&a, o.want, o.want_lse);
  assert_memory_equal(o.out, o.want, o.n_out * 2);
  assert_memory_equal(o.lse, o.want_lse, o.n_lse * 4);
  outputs_free(&o);
  batch_free(&b);
  fixture_close(&fx);
}

/* A deployment serving heads [off, off + n) of 128: its q is those heads' rows and its sink the
 * slice from head_offset; the output equals those rows of the full launch. */
static void test_head_slices(void **state) {
  (void)state;
  fixture_t fx;
  fixture_open(&fx, 64, 16, 2);
  seq_t sq;
  seq_init(&sq, 0);
  seq_t *seqs[1] = {&sq};
  uint32_t len = 40;
  batch_t b;
  batch_build(&fx, &b, seqs, &len, 1, 128);
  batch_insert(&fx, &b, seqs);
  float sink[128];
  for (int h = 0; h < 128; h++)
    sink[h] = rnd_unit() * 3.0f;
  outputs_t full;
  outputs_alloc(&full, &b);
  dsv4_attn_args_t a = attn_args(&fx, &b, sink, full.out, full.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  static const uint32_t slices[][2] = {{0, 64}, {64, 64}, {40, 8}, {127, 1}};
  for (size_t k = 0; k < sizeof(slices) / sizeof(slices[0]); k++) {
    uint32_t off = slices[k][0], n = slices[k][1];
    uint16_t *q = malloc((size_t)b.n * n * 1024), *out = malloc((size_t)b.n * n * 1024);
    float *lse = malloc((size_t)b.n * n * 4);
    assert_true(q && out && lse);
    for (uint32_t t = 0; t < b.n; t++)
      memcpy(q + (size_t)t * n * 512, b.q_out + ((size_t)t * 128 + off) * 512, (size_t)n * 1024);
    dsv4_attn_args_t s = a;
    s.heads = n;
    s.q = q;
    s.sink = sink + off;
    s.out = out;
    s.lse = lse;
    assert_int_equal(fx.be->ops->attention(fx.be, &s), 0);
    for (uint32_t t = 0; t < b.n; t++) {
      assert_memory_equal(out + (size_t)t * n * 512, full.out + ((size_t)t * 128 + off) * 512,
                          (size_t)n * 1024);
      assert_memory_equal(lse + (size_t)t * n, full.lse + (size_t)t * 128 + off, (size_t)n * 4);
    }
    free(q);
    free(out);
    free(lse);
  }
  outputs_free(&full);
  batch_free(&b);
  fixture_close(&fx);
}

/* Every level stores the scalar level's bytes; repeated runs and thread counts change nothing. */
static void test_levels_and_determinism(void **state) {
  (void)state;
  fixture_t fx;
  fixture_open(&fx, 16, 48, 2);
  seq_t s0, s1;
  seq_init(&s0, 0);
  seq_init(&s1, 77);
  seq_t *seqs[2] = {&s0, &s1};
  uint32_t lens[2] = {150, 9};
  batch_t b;
  batch_build(&fx, &b, seqs, lens, 2, 64);
  batch_insert(&fx, &b, seqs);
  float sink[64];
  for (int h = 0; h < 64; h++)
    sink[h] = rnd_unit() * 6.0f;
  outputs_t ref, o;
  outputs_alloc(&ref, &b);
  outputs_alloc(&o, &b);
  assert_int_equal(dsv4__cpu_backend_set_isa(fx.be, DSV4__CPU_ISA_SCALAR), 0);
  dsv4_attn_args_t a = attn_args(&fx, &b, sink, ref.out, ref.lse);
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  a.out = o.out;
  a.lse = o.lse;
  for (int isa = 0; isa < DSV4__CPU_ISA_COUNT; isa++) {
    if (dsv4__cpu_backend_set_isa(fx.be, isa) != 0) {
      printf("attention: level %s not supported here\n", dsv4__cpu_isa_name(isa));
      continue;
    }
    for (int run = 0; run < 3; run++) {
      memset(o.out, 0xAB, o.n_out * 2);
      memset(o.lse, 0xAB, o.n_lse * 4);
      assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
      assert_memory_equal(o.out, ref.out, o.n_out * 2);
      assert_memory_equal(o.lse, ref.lse, o.n_lse * 4);
    }
    /* One thread: items are no longer split across participants. */
    dsv4_backend_options_t opt = {.threads = 1};
    dsv4_backend_t *one;
    char why[128];
    assert_int_equal(dsv4_backend_open("cpu", &opt, &one, why, sizeof(why)), 0);
    assert_int_equal(dsv4__cpu_backend_set_isa(one, isa), 0);
    memset(o.out, 0xAB, o.n_out * 2);
    assert_int_equal(one->ops->attention(one, &a), 0);
    assert_memory_equal(o.out, ref.out, o.n_out * 2);
    assert_memory_equal(o.lse, ref.lse, o.n_lse * 4);
    dsv4_backend_close(one);
  }
  outputs_free(&ref);
  outputs_free(&o);
  batch_free(&b);
  fixture_close(&fx);
}

/* The launch is refused, and out and lse keep every byte they had. */
static void expect_refused(fixture_t *fx, const dsv4_attn_args_t *a, outputs_t *o,
                           const char *what) {
  memset(o->out, 0xAB, o->n_out * 2);
  memset(o->lse, 0xCD, o->n_lse * 4);
  int rc = fx->be->ops->attention(fx->be, a);
  if (rc != DSV4_EINVAL) {
    print_error("%s: attention returned %d, expected DSV4_EINVAL\n", what, rc);
    fail();
  }
  for (size_t i = 0; i < o->n_out; i++)
    assert_int_equal(o->out[i], 0xABAB);
  for (size_t i = 0; i < o->n_lse; i++)
    assert_int_equal(f2u(o->lse[i]), 0xCDCDCDCDu);
}

/* The engine's windows (dsv4_attn_windows) of a batch mixing prefill chunks and decode tokens at
 * block sizes 16 and 64, against the window rule written out (SPEC §7): max(p0, p - 127)..p, its
 * logical blocks through the segment's table, -1 past them. */
static void test_windows(void **state) {
  (void)state;
  const uint32_t sizes[2] = {16, 64};
  for (int z = 0; z < 2; z++) {
    fixture_t fx;
    fixture_open(&fx, sizes[z], 256, 1);
    seq_t sq[4];
    seq_t *seqs[4] = {&sq[0], &sq[1], &sq[2], &sq[3]};
    const int64_t p0[4] = {0, 37, 1000, 5};
    const int64_t skip[4] = {0, 250, 3, 126}; /* positions before the batch (no blocks needed) */
    const uint32_t lens[4] = {200, 1, 150, 2};
    for (int i = 0; i < 4; i++) {
      seq_init(&sq[i], p0[i]);
      sq[i].next = p0[i] + skip[i];
    }
    batch_t b;
    batch_build(&fx, &b, seqs, lens, 4, 1);
    dsv4_attn_win_t *win = malloc(b.n * sizeof(*win));
    assert_non_null(win);
    const dsv4_attn_args_t a = attn_args(&fx, &b, NULL, NULL, NULL);
    assert_int_equal(dsv4_attn_windows(&a, win), 0);
    const int64_t bs = fx.bs;
    for (uint32_t t = 0; t < b.n; t++) {
      const uint32_t s = (uint32_t)b.tok_seg[t];
      const int64_t p = b.positions[t], lo = p - 127 > b.seg_p0[s] ? p - 127 : b.seg_p0[s];
      assert_int_equal(win[t].lo, lo);
      assert_int_equal(win[t].n, p - lo + 1);
      assert_int_equal(win[t].reserved, 0);
      for (int64_t k = 0; k < DSV4_ATTN_WIN_BLOCKS; k++) {
        const int64_t lb = lo / bs + k;
        const int32_t want =
            lb <= p / bs ? b.block_table[b.seg_bt_off[s] + (lb - b.seg_first_lb[s])] : -1;
        assert_int_equal(win[t].blk[k], want);
      }
    }
    free(win);
    batch_free(&b);
    fixture_close(&fx);
  }
}

/* A decode token whose window spans three blocks, and every way its launch can be malformed. */
static void test_refusals(void **state) {
  (void)state;
  fixture_t fx;
  fixture_open(&fx, 64, 8, 2);
  seq_t sq;
  seq_init(&sq, 0);
  seq_t *seqs[1] = {&sq};
  uint32_t len = 130;
  batch_t b;
  batch_build(&fx, &b, seqs, &len, 1, 8);
  batch_insert(&fx, &b, seqs);
  batch_free(&b);
  len = 1;
  batch_build(&fx, &b, seqs, &len, 1, 8); /* position 130: candidates 3..130, blocks 0..2 */
  batch_insert(&fx, &b, seqs);
  assert_int_equal(b.seg_bt_len[0], 3);
  outputs_t o;
  outputs_alloc(&o, &b);
  const dsv4_attn_args_t good = attn_args(&fx, &b, NULL, o.out, o.lse);
  dsv4_attn_args_t a = good;
  dsv4_attn_win_t win[1];
  int32_t saved = b.block_table[0];
  b.block_table[0] = -1; /* the block of candidates 3..63 is missing */
  expect_refused(&fx, &a, &o, "missing block");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.block_table[0] = (int32_t)fx.n_blocks;
  expect_refused(&fx, &a, &o, "block id past the pool");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.block_table[0] = saved;
  b.seg_first_lb[0] = 1; /* the table would start at the second block */
  expect_refused(&fx, &a, &o, "block before the table");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.seg_first_lb[0] = 0;
  b.seg_bt_len[0] = 2;
  expect_refused(&fx, &a, &o, "block after the table");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.seg_bt_len[0] = 3;
  a.bt_entries = 2;
  expect_refused(&fx, &a, &o, "table past bt_entries");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  a = good;
  b.seg_p0[0] = 131;
  expect_refused(&fx, &a, &o, "position below p0");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.seg_p0[0] = -1;
  expect_refused(&fx, &a, &o, "negative p0");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.seg_p0[0] = 0;
  b.tok_seg[0] = 1;
  expect_refused(&fx, &a, &o, "segment out of range");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.tok_seg[0] = -1;
  expect_refused(&fx, &a, &o, "negative segment");
  assert_int_equal(dsv4_attn_windows(&a, win), DSV4_EINVAL);
  b.tok_seg[0] = 0;
  assert_int_equal(dsv4_attn_windows(&a, win), 0); /* the good launch's window */
  assert_int_equal(win[0].lo, 3);
  assert_int_equal(win[0].n, 128);
  a.win = (const dsv4_attn_win_t *)((const uint8_t *)win + 4);
  expect_refused(&fx, &a, &o, "windows not 16-byte aligned");
  a = good;
  b.positions[0] = 900000; /* no RoPE row there */
  expect_refused(&fx, &a, &o, "RoPE row not materialised");
  b.positions[0] = DSV4_MAX_POSITION_DEFAULT;
  expect_refused(&fx, &a, &o, "position past the RoPE table");
  b.positions[0] = 130;
  /* The argument check itself. */
  a.heads = 0;
  expect_refused(&fx, &a, &o, "0 heads");
  a.heads = 129;
  expect_refused(&fx, &a, &o, "129 heads");
  a = good;
  a.block_size = 48;
  expect_refused(&fx, &a, &o, "block size");
  a = good;
  a.stride -= 576;
  expect_refused(&fx, &a, &o, "stride");
  const void **ptrs[] = {
      (const void **)&a.q,          (const void **)&a.positions,    (const void **)&a.tok_seg,
      (const void **)&a.seg_p0,     (const void **)&a.seg_first_lb, (const void **)&a.seg_bt_off,
      (const void **)&a.seg_bt_len, (const void **)&a.block_table,  (const void **)&a.cache,
      (const void **)&a.rope};
  for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++) {
    a = good;
    *ptrs[i] = NULL;
    expect_refused(&fx, &a, &o, "a NULL input");
  }
  a = good;
  a.n_segments = 0;
  expect_refused(&fx, &a, &o, "no segment");
  a = good;
  a.out = NULL;
  assert_int_equal(fx.be->ops->attention(fx.be, &a), DSV4_EINVAL);
  assert_int_equal(dsv4_backend_check_attn_args(NULL), DSV4_EINVAL);
  /* Zero tokens: valid without any array. */
  dsv4_attn_args_t empty = {.heads = 8, .block_size = 64};
  assert_int_equal(fx.be->ops->attention(fx.be, &empty), 0);
  /* And the good launch still runs, without lse. */
  a = good;
  a.lse = NULL;
  assert_int_equal(fx.be->ops->attention(fx.be, &a), 0);
  outputs_free(&o);
  batch_free(&b);
  fixture_close(&fx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_first_token),
      cmocka_unit_test(test_p0_positive),
      cmocka_unit_test(test_block_boundaries),
      cmocka_unit_test(test_heads),
      cmocka_unit_test(test_sinks),
      cmocka_unit_test(test_equal_scores),
      cmocka_unit_test(test_input_bound),
      cmocka_unit_test(test_head_slices),
      cmocka_unit_test(test_levels_and_determinism),
      cmocka_unit_test(test_windows),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
