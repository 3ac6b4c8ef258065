/*
 * The engine without HTTP: forward batches through plan -> map_slots -> qkv_insert -> commit, the
 * guarantee that a refused batch changes nothing, and the device-failure path (SPEC §4: every
 * sequence of the failed batch is dropped, the engine reports itself unusable, nothing is served
 * afterwards). Device failures are injected by a backend that wraps the CPU backend.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "dsv4-numerics.h"
#include "cpu_staged.h"
#include "engine-internal.h"
#include "engine.h"
#include "engine_admin.h"
#include "engine_restore.h"
#include "host_flush.h"
#include "model.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

/* The backend under test: "cpu", or "cpu_staged" (the engine's device staging path) from argv[1].
 */
static const char *backend = "cpu";

/* ---- a CPU backend whose qkv_insert fails on demand ---- */

typedef struct {
  dsv4_backend_t base; /* first */
  dsv4_backend_t *inner;
  dsv4_backend_ops_t ops;
} faulty_t;

static int fail_next_insert;
static int fail_next_upload;

static dsv4_backend_t *inner_of(dsv4_backend_t *be) {
  return ((faulty_t *)be)->inner;
}
static void f_destroy(dsv4_backend_t *be) {
  dsv4_backend_close(inner_of(be));
  free(be);
}
static int f_alloc(dsv4_backend_t *be, size_t size, dsv4_devbuf_t *out) {
  return inner_of(be)->ops->buf_alloc(inner_of(be), size, out);
}
static void f_free(dsv4_backend_t *be, dsv4_devbuf_t *buf) {
  inner_of(be)->ops->buf_free(inner_of(be), buf);
}
static int f_upload(dsv4_backend_t *be, const dsv4_devbuf_t *dst, size_t off, const void *src,
                    size_t n) {
  if (fail_next_upload) {
    fail_next_upload = 0;
    return DSV4_EBACKEND;
  }
  return inner_of(be)->ops->upload(inner_of(be), dst, off, src, n);
}
static int f_download(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                      size_t n) {
  return inner_of(be)->ops->download(inner_of(be), dst, src, off, n);
}
static int f_download_async(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                            size_t n) {
  return inner_of(be)->ops->download_async(inner_of(be), dst, src, off, n);
}
static int f_batch_phase(dsv4_backend_t *be, int phase, uint64_t *ticket) {
  return inner_of(be)->ops->batch_phase(inner_of(be), phase, ticket);
}
static int f_batch_wait(dsv4_backend_t *be, uint64_t ticket) {
  return inner_of(be)->ops->batch_wait(inner_of(be), ticket);
}
static int f_map(dsv4_backend_t *be, const dsv4_map_args_t *a) {
  return inner_of(be)->ops->map_slots(inner_of(be), a);
}
static int f_insert(dsv4_backend_t *be, const dsv4_insert_args_t *a) {
  if (fail_next_insert) {
    dsv4_backend_t *in = inner_of(be);
    int64_t slot0 = -1;
    fail_next_insert = 0;
    /* A device fault after part of the batch was written: write one record's worth of garbage,
     * through the inner backend's copies when its memory is not host memory. */
    if (in->ops->caps & DSV4_BE_HOST_MEMORY) {
      slot0 = a->slots[0];
      if (a->write_kv && slot0 >= 0)
        memset(a->cache + (uint64_t)(slot0 / a->block_size) * a->stride, 0xA5, 64);
    } else {
      uint8_t junk[64];
      dsv4_devbuf_t slots = {(void *)a->slots, sizeof(int64_t)};
      dsv4_devbuf_t cache = {a->cache, (size_t)a->n_blocks * a->stride};
      memset(junk, 0xA5, sizeof(junk));
      assert_int_equal(in->ops->download(in, &slot0, &slots, 0, sizeof(slot0)), 0);
      if (a->write_kv && slot0 >= 0)
        assert_int_equal(in->ops->upload(in, &cache, (uint64_t)(slot0 / a->block_size) * a->stride,
                                         junk, sizeof(junk)),
                         0);
    }
    return DSV4_EBACKEND;
  }
  return inner_of(be)->ops->qkv_insert(inner_of(be), a);
}
/* The host_register hook of a device backend, counted: registered bytes, live registrations. */
static size_t registered_bytes;
static int registrations;
static int fail_next_register;
static int f_host_register(dsv4_backend_t *be, void *p, size_t n) {
  (void)be;
  (void)p;
  if (fail_next_register) {
    fail_next_register = 0;
    return DSV4_EBACKEND;
  }
  registered_bytes += n;
  registrations++;
  return 0;
}
static void f_host_unregister(dsv4_backend_t *be, void *p) {
  (void)be;
  (void)p;
  registrations--;
}
static int f_attn(dsv4_backend_t *be, const dsv4_attn_args_t *a) {
  return inner_of(be)->ops->attention(inner_of(be), a);
}
static int f_sync(dsv4_backend_t *be) {
  return inner_of(be)->ops->sync(inner_of(be));
}

static void f_host_parallel(dsv4_backend_t *be, void (*fn)(void *, size_t, size_t), void *arg,
                            size_t n) {
  inner_of(be)->ops->host_parallel(inner_of(be), fn, arg, n);
}

static int faulty_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                       size_t why_len) {
  faulty_t *f = calloc(1, sizeof(*f));
  int rc;
  if (!f)
    return DSV4_ENOMEM;
  rc = dsv4_backend_open(backend, opt, &f->inner, why, why_len);
  if (rc) {
    free(f);
    return rc;
  }
  f->ops = *f->inner->ops;
  f->ops.name = "faulty";
  f->ops.destroy = f_destroy;
  f->ops.buf_alloc = f_alloc;
  f->ops.buf_free = f_free;
  f->ops.upload = f_upload;
  f->ops.download = f_download;
  f->ops.download_async = f->inner->ops->download_async ? f_download_async : NULL;
  f->ops.batch_phase = f->inner->ops->batch_phase ? f_batch_phase : NULL;
  f->ops.batch_wait = f->inner->ops->batch_wait ? f_batch_wait : NULL;
  f->ops.map_slots = f_map;
  f->ops.qkv_insert = f_insert;
  f->ops.sync = f_sync;
  f->ops.attention = f->inner->ops->attention ? f_attn : NULL;
  f->ops.host_register = f_host_register;
  f->ops.host_unregister = f_host_unregister;
  f->ops.host_alias = NULL; /* the counting hooks register nothing with the inner backend */
  f->ops.host_parallel = f->inner->ops->host_parallel ? f_host_parallel : NULL;
  f->base.ops = &f->ops;
  *out = &f->base;
  return 0;
}

/* ---- fixtures ---- */

#define HEADS 8
#define BLOCKS 16

static dsv4_model_t model;
static const uint32_t served[2] = {0, 2}; /* a plain and a YaRN layer of V4-Flash */

static dsv4_engine_t *open_engine_w(const char *name, const float *kv_norm_weights) {
  dsv4_engine_params_t p = {
      .backend = name,
      .threads = 2,
      .block_size = 64,
      .kv_blocks = BLOCKS,
      .heads = HEADS,
      .model = &model,
      .served_layers = served,
      .n_served = 2,
      .max_sequences = 64,
      .idle_timeout_ns = 0,
      .kv_norm_weights = kv_norm_weights,
  };
  dsv4_engine_t *e = NULL;
  char why[256];
  assert_int_equal(dsv4_engine_create(&p, &e, why, sizeof(why)), 0);
  return e;
}

static dsv4_engine_t *open_engine(const char *name) {
  return open_engine_w(name, NULL);
}

/* in_place_max_bytes of the engines open_engine_full opens (0: no limit). */
static uint64_t in_place_limit;
/* cache_flush_bytes of the engines open_engine_full opens (0: never). */
static uint64_t cache_flush;

/* An engine with attention sinks for both served layers, prefill_chunk_tokens = chunk,
 * prefill_chunk_tokens_alone = alone and q_piece_bytes = piece. */
static dsv4_engine_t *open_engine_full(const char *name, uint32_t chunk, uint32_t alone,
                                       uint32_t piece) {
  float sinks[2 * HEADS];
  for (int i = 0; i < 2 * HEADS; i++)
    sinks[i] = -1.0f + 0.25f * (float)i;
  dsv4_engine_params_t p = {
      .backend = name,
      .threads = 2,
      .block_size = 64,
      .kv_blocks = BLOCKS,
      .heads = HEADS,
      .model = &model,
      .served_layers = served,
      .n_served = 2,
      .max_sequences = 64,
      .attn_sinks = sinks,
      .prefill_chunk_tokens = chunk,
      .prefill_chunk_tokens_alone = alone,
      .q_piece_bytes = piece,
      .in_place_max_bytes = in_place_limit,
      .cache_flush_bytes = cache_flush,
  };
  dsv4_engine_t *e = NULL;
  char why[256];
  assert_int_equal(dsv4_engine_create(&p, &e, why, sizeof(why)), 0);
  return e;
}

static dsv4_engine_t *open_engine_pieces(const char *name, uint32_t chunk, uint32_t piece) {
  return open_engine_full(name, chunk, 0, piece);
}

static dsv4_engine_t *open_engine_chunked(const char *name, uint32_t chunk) {
  return open_engine_pieces(name, chunk, 0);
}

/* Deterministic small bf16 inputs for token t of a batch. */
static uint16_t val(uint64_t seed, size_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  /* Exponents around 1.0 with random mantissa and sign: always in range. */
  return (uint16_t)(((x & 1) << 15) | ((0x7C + (x >> 8) % 6) << 7) | ((x >> 16) & 0x7F));
}

typedef struct {
  uint32_t n;
  uint16_t *q, *kv, *q_out;
  int64_t *slots;
  dsv4_seg_req_t segs[4];
  dsv4_forward_t f;
} batch_t;

static void batch_make(batch_t *b, uint32_t layer, uint64_t seed, uint32_t n_segs,
                       const char *const *names, const int64_t *starts, const uint32_t *lens,
                       const int *is_new) {
  memset(b, 0, sizeof(*b));
  for (uint32_t s = 0; s < n_segs; s++) {
    b->segs[s].name = names[s];
    b->segs[s].name_len = (uint32_t)strlen(names[s]);
    b->segs[s].start = starts[s];
    b->segs[s].len = lens[s];
    b->segs[s].is_new = is_new[s];
    b->n += lens[s];
  }
  size_t nq = (size_t)b->n * HEADS * DSV4_HEAD_DIM, nk = (size_t)b->n * DSV4_HEAD_DIM;
  b->q = malloc(nq * 2);
  b->kv = malloc(nk * 2);
  b->q_out = malloc(nq * 2);
  b->slots = malloc(b->n * sizeof(int64_t));
  for (size_t i = 0; i < nq; i++)
    b->q[i] = val(seed, i);
  for (size_t i = 0; i < nk; i++)
    b->kv[i] = val(seed ^ 0xABCDEF, i);
  b->f.layer = layer;
  b->f.n_tokens = b->n;
  b->f.q = b->q;
  b->f.kv = b->kv;
  b->f.segs = b->segs;
  b->f.n_segs = n_segs;
  b->f.want_digest = 1;
  b->f.q_out = b->q_out;
  b->f.slots = b->slots;
}

static void batch_free(batch_t *b) {
  dsv4_forward_release(&b->f);
  free(b->q);
  free(b->kv);
  free(b->q_out);
  free(b->slots);
}

static int run1(dsv4_engine_t *e, uint32_t layer, uint64_t seed, const char *name, int64_t start,
                uint32_t len, int is_new, uint64_t *digest) {
  batch_t b;
  const char *names[1] = {name};
  int64_t starts[1] = {start};
  uint32_t lens[1] = {len};
  int nw[1] = {is_new};
  batch_make(&b, layer, seed, 1, names, starts, lens, nw);
  int rc = dsv4_engine_forward(e, &b.f);
  if (rc == 0 && digest)
    *digest = b.f.digest;
  batch_free(&b);
  return rc;
}

/* ---- the compressed branch (SPEC §8) ---- */

#define C4_LAYER 2   /* ratio 4 in the built-in V4-Flash geometry */
#define C128_LAYER 3 /* ratio 128 */
#define C_BS 16      /* small blocks, so that entries span several of them */
#define C_TOPK 8     /* index_topk: short sequences already score their entries */
#define C_IH 64      /* index heads */

static struct {
  float ape4[4 * 1024], norm4[512], iape[4 * 256], inorm[128];
  float ape128[128 * 512], norm128[512];
  float sinks[2 * HEADS];
  dsv4_model_t model;
} cfx;

static uint64_t c_rng = 0x9E3779B97F4A7C15ull;

static double c_unit(void) {
  c_rng ^= c_rng << 13;
  c_rng ^= c_rng >> 7;
  c_rng ^= c_rng << 17;
  return (double)(c_rng >> 11) / (double)(1ull << 53) * 2.0 - 1.0;
}

static void c_fill(float *x, size_t n, double scale) {
  for (size_t i = 0; i < n; i++)
    x[i] = (float)(c_unit() * scale);
}

static void c_weights(void) {
  c_fill(cfx.ape4, 4 * 1024, 0.5);
  c_fill(cfx.ape128, 128 * 512, 0.5);
  c_fill(cfx.iape, 4 * 256, 0.5);
  for (int i = 0; i < 512; i++)
    cfx.norm4[i] = cfx.norm128[i] = 1.0f + 0.25f * (float)c_unit();
  for (int i = 0; i < 128; i++)
    cfx.inorm[i] = 1.0f + 0.25f * (float)c_unit();
  c_fill(cfx.sinks, 2 * HEADS, 1.0);
}

static int group_setup(void **state) {
  (void)state;
  assert_int_equal(dsv4_model_builtin_flash(&model), 0);
  assert_int_equal(dsv4_model_builtin_flash(&cfx.model), 0);
  cfx.model.index_topk = C_TOPK;
  c_weights();
  assert_int_equal(dsv4_backend_register("faulty", faulty_open), 0);
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  dsv4_model_free(&model);
  dsv4_model_free(&cfx.model);
  return 0;
}

/* ---- tests ---- */

/* Prefill then decode across a block boundary on two layers: digests equal on two engines. */
static void test_prefill_decode_deterministic(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine(backend), *b = open_engine("faulty");
  uint64_t da, db;
  for (uint32_t li = 0; li < 2; li++) {
    assert_int_equal(run1(a, served[li], 1, "s", 0, 60, li == 0, &da), 0);
    assert_int_equal(run1(b, served[li], 1, "s", 0, 60, li == 0, &db), 0);
    assert_int_equal(da, db);
  }
  for (int64_t p = 60; p < 70; p++)
    for (uint32_t li = 0; li < 2; li++) {
      assert_int_equal(run1(a, served[li], 100 + (uint64_t)p, "s", p, 1, 0, &da), 0);
      assert_int_equal(run1(b, served[li], 100 + (uint64_t)p, "s", p, 1, 0, &db), 0);
      assert_int_equal(da, db);
    }
  dsv4_seq_info_t ia;
  assert_int_equal(dsv4_engine_seq_info(a, "s", 1, &ia), 0);
  assert_int_equal(ia.next[0], 70);
  assert_int_equal(ia.next[1], 70);
  dsv4_seq_info_free(&ia);
  assert_int_equal(dsv4_engine_blocks_free(a), BLOCKS - 2);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/* The range check finds one value at or above the limit wherever it lies: inside a whole block of
 * the vectorised loop, in the tail after the last block, with either sign, and lets the largest
 * value below the limit through. */
static void test_bf16_range_check_every_position(void **state) {
  (void)state;
  enum { N = 1024 + 77 };
  static uint16_t x[N];
  for (size_t i = 0; i < N; i++)
    x[i] = (uint16_t)((i * 2654435761u) % DSV4_BF16_LIMIT_BITS) | (uint16_t)((i & 1) << 15);
  const size_t lens[] = {0, 1, 511, 512, 513, 1024, N};
  for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++)
    assert_int_equal(dsv4_bf16_any_out_of_range(x, lens[l]), 0);
  const uint16_t hits[] = {DSV4_BF16_LIMIT_BITS, DSV4_BF16_LIMIT_BITS | 0x8000u, 0x7fffu, 0xffffu};
  for (size_t h = 0; h < sizeof(hits) / sizeof(hits[0]); h++)
    for (size_t i = 0; i < N; i++) {
      uint16_t keep = x[i];
      x[i] = hits[h];
      assert_int_equal(dsv4_bf16_any_out_of_range(x, N), 1);
      assert_int_equal(dsv4_bf16_any_out_of_range(x, i), 0); /* the value just past the end */
      x[i] = (uint16_t)(DSV4_BF16_LIMIT_BITS - 1u) | (uint16_t)(hits[h] & 0x8000u);
      assert_int_equal(dsv4_bf16_any_out_of_range(x, N), 0);
      x[i] = keep;
    }
}

/* The f32 check (the compressed branch's ckv, ikv and iw, SPEC §8.8) and the bf16 one at another
 * limit (iq) alike: one value at or above the limit found wherever it lies, with either sign, Inf
 * and NaN among them, and the largest value below it let through. */
static void test_range_check_f32_and_limits(void **state) {
  (void)state;
  enum { N = 1536 + 29 };
  static float x[N];
  static uint16_t y[N];
  const uint32_t limits[] = {0x5D000000u, 0x4F800000u}; /* 2^59, 2^32 */
  for (size_t l = 0; l < 2; l++) {
    const uint32_t lim = limits[l];
    for (size_t i = 0; i < N; i++) {
      const uint32_t u = (uint32_t)((i * 2654435761u) % lim) | (uint32_t)(i & 1) << 31;
      memcpy(&x[i], &u, 4);
      y[i] = (uint16_t)(u >> 16);
    }
    const size_t lens[] = {0, 1, 511, 512, 513, 1024, N};
    for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
      assert_int_equal(dsv4_f32_any_at_least(x, lens[k], lim), 0);
      assert_int_equal(dsv4_bf16_any_at_least(y, lens[k], (uint16_t)(lim >> 16)), 0);
    }
    const uint32_t hits[] = {lim, lim | 0x80000000u, 0x7f800000u, 0x7fc00000u, 0xffffffffu};
    for (size_t h = 0; h < sizeof(hits) / sizeof(hits[0]); h++)
      for (size_t i = 0; i < N; i += 7) {
        const float kx = x[i];
        const uint16_t ky = y[i];
        const uint32_t below = (lim - 1u) | (hits[h] & 0x80000000u);
        memcpy(&x[i], &hits[h], 4);
        y[i] = (uint16_t)(hits[h] >> 16);
        assert_int_equal(dsv4_f32_any_at_least(x, N, lim), 1);
        assert_int_equal(dsv4_f32_any_at_least(x, i, lim), 0);
        assert_int_equal(dsv4_bf16_any_at_least(y, N, (uint16_t)(lim >> 16)), 1);
        assert_int_equal(dsv4_bf16_any_at_least(y, i, (uint16_t)(lim >> 16)), 0);
        memcpy(&x[i], &below, 4);
        y[i] = (uint16_t)(below >> 16);
        assert_int_equal(dsv4_f32_any_at_least(x, N, lim), 0);
        assert_int_equal(dsv4_bf16_any_at_least(y, N, (uint16_t)(lim >> 16)), 0);
        x[i] = kx;
        y[i] = ky;
      }
  }
}

/* A batch refused for any reason leaves the next valid batch's bytes as on a fresh engine. */
static void test_refused_batch_changes_nothing(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine(backend), *fresh = open_engine(backend);
  uint64_t da, df;
  assert_int_equal(run1(a, 0, 7, "x", 3, 10, 1, NULL), 0);
  assert_int_equal(run1(fresh, 0, 7, "x", 3, 10, 1, NULL), 0);

  /* |x| >= 2^59 in kv, at the very last element. */
  {
    batch_t b;
    const char *names[1] = {"x"};
    int64_t starts[1] = {13};
    uint32_t lens[1] = {4};
    int nw[1] = {0};
    batch_make(&b, 0, 9, 1, names, starts, lens, nw);
    b.kv[(size_t)4 * DSV4_HEAD_DIM - 1] = 0x5D00;
    assert_int_equal(dsv4_engine_forward(a, &b.f), DSV4_ERANGE);
    batch_free(&b);
  }
  /* A position gap, an unknown sequence, an existing one with "new", and a pool overrun. */
  assert_int_equal(run1(a, 0, 9, "x", 14, 4, 0, NULL), DSV4_EPOSITION);
  assert_int_equal(run1(a, 0, 9, "nobody", 0, 4, 0, NULL), DSV4_ENOSEQ);
  assert_int_equal(run1(a, 0, 9, "x", 13, 4, 1, NULL), DSV4_EEXIST);
  assert_int_equal(run1(a, 0, 9, "big", 0, 64 * BLOCKS, 1, NULL), DSV4_ENOSPC);
  assert_int_equal(dsv4_engine_sequences(a), 1);

  assert_int_equal(run1(a, 0, 9, "x", 13, 4, 0, &da), 0);
  assert_int_equal(run1(fresh, 0, 9, "x", 13, 4, 0, &df), 0);
  assert_int_equal(da, df);
  assert_int_equal(dsv4_engine_blocks_free(a), dsv4_engine_blocks_free(fresh));
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(fresh);
}

/* A replayed batch writes nothing and answers the same q_out and digest. */
static void test_replay(void **state) {
  (void)state;
  dsv4_engine_t *e = open_engine(backend);
  batch_t b1, b2;
  const char *names[1] = {"r"};
  int64_t starts[1] = {0};
  uint32_t lens[1] = {5};
  int nw[1] = {1};
  batch_make(&b1, 0, 3, 1, names, starts, lens, nw);
  batch_make(&b2, 0, 3, 1, names, starts, lens, nw);
  assert_int_equal(dsv4_engine_forward(e, &b1.f), 0);
  assert_false(b1.f.replayed);
  assert_int_equal(dsv4_engine_forward(e, &b2.f), 0);
  assert_true(b2.f.replayed);
  assert_memory_equal(b1.q_out, b2.q_out, (size_t)5 * HEADS * DSV4_HEAD_DIM * 2);
  assert_memory_equal(b1.slots, b2.slots, 5 * sizeof(int64_t));
  assert_int_equal(b1.f.digest, b2.f.digest);
  batch_free(&b1);
  batch_free(&b2);
  dsv4_engine_destroy(e);
}

/* SPEC §4: a device failure drops every sequence of the batch and nothing is served afterwards. */
static void test_device_failure_drops_batch(void **state) {
  (void)state;
  dsv4_engine_t *e = open_engine("faulty");
  assert_int_equal(run1(e, 0, 1, "a", 0, 20, 1, NULL), 0);
  assert_int_equal(run1(e, 0, 2, "other", 0, 3, 1, NULL), 0);
  assert_true(dsv4_engine_healthy(e));
  {
    batch_t b;
    const char *names[2] = {"a", "b"};
    int64_t starts[2] = {20, 0};
    uint32_t lens[2] = {2, 3};
    int nw[2] = {0, 1};
    batch_make(&b, 0, 5, 2, names, starts, lens, nw);
    fail_next_insert = 1;
    assert_int_equal(dsv4_engine_forward(e, &b.f), DSV4_EBACKEND);
    assert_int_equal(b.f.n_dropped, 2);
    assert_string_equal(b.f.dropped[0], "a");
    assert_string_equal(b.f.dropped[1], "b");
    batch_free(&b);
  }
  dsv4_seq_info_t info;
  assert_int_equal(dsv4_engine_seq_info(e, "a", 1, &info), DSV4_ENOSEQ);
  assert_int_equal(dsv4_engine_seq_info(e, "b", 1, &info), DSV4_ENOSEQ);
  /* The sequence outside the batch is untouched, but the device is no longer trusted. */
  assert_int_equal(dsv4_engine_seq_info(e, "other", 5, &info), 0);
  dsv4_seq_info_free(&info);
  assert_false(dsv4_engine_healthy(e));
  assert_int_equal(run1(e, 0, 6, "other", 3, 1, 0, NULL), DSV4_EBACKEND);
  assert_int_equal(dsv4_engine_blocks_free(e), BLOCKS - 1);
  dsv4_engine_destroy(e);
}

/*
 * Overlapped batches (a backend with DSV4_BE_OVERLAP under test): x is in flight when the device
 * fails y's insert. y's sequence is dropped at once; x, whose plan is not committed yet, ends with
 * DSV4_EBACKEND and its sequence dropped too (the device is no longer trusted), and nothing is
 * served afterwards. Skipped (passes trivially, saying so) on a backend that cannot overlap.
 */
static void test_overlap_failure_drops_both(void **state) {
  (void)state;
  dsv4_engine_t *e = open_engine("faulty");
  assert_int_equal(run1(e, 0, 1, "x", 0, 20, 1, NULL), 0);
  batch_t x, y;
  const char *nx[1] = {"x"}, *ny[1] = {"y"};
  int64_t sx[1] = {20}, sy[1] = {0};
  uint32_t lx[1] = {3}, ly[1] = {4};
  int old[1] = {0}, nw[1] = {1};
  batch_make(&x, 0, 7, 1, nx, sx, lx, old);
  batch_make(&y, 0, 8, 1, ny, sy, ly, nw);
  x.f.want_digest = y.f.want_digest = 0;
  if (!dsv4_engine_can_overlap(e, &x.f)) {
    print_message("backend %s cannot overlap: nothing to test\n", backend);
  } else {
    assert_int_equal(dsv4_engine_forward_begin(e, &x.f), 0);
    assert_true(x.f.in_flight);
    assert_int_equal(dsv4_engine_in_flight(e), 1);
    fail_next_insert = 1;
    assert_int_equal(dsv4_engine_forward_begin(e, &y.f), DSV4_EBACKEND);
    assert_int_equal(y.f.n_dropped, 1);
    assert_false(dsv4_engine_healthy(e));
    assert_int_equal(dsv4_engine_forward_end(e, &x.f), DSV4_EBACKEND);
    assert_int_equal(x.f.n_dropped, 1);
    assert_string_equal(x.f.dropped[0], "x");
    assert_int_equal(dsv4_engine_in_flight(e), 0);
    dsv4_seq_info_t info;
    assert_int_equal(dsv4_engine_seq_info(e, "x", 1, &info), DSV4_ENOSEQ);
    assert_int_equal(dsv4_engine_seq_info(e, "y", 1, &info), DSV4_ENOSEQ);
    assert_int_equal(dsv4_engine_blocks_free(e), BLOCKS);
  }
  batch_free(&x);
  batch_free(&y);
  dsv4_engine_destroy(e);
}

/* Every cache byte of every served layer, read through the engine (whatever memory it is in). */
static uint8_t *cache_bytes(dsv4_engine_t *e, size_t *len) {
  size_t per = (size_t)BLOCKS * DSV4_BLOCK_STRIDE(64);
  uint8_t *all = malloc(per * 2);
  assert_non_null(all);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(dsv4__engine_cache_read(e, i, 0, per, all + i * per), 0);
  *len = per * 2;
  return all;
}

/* Engines a and b hold the same cache bytes, every block of both served layers. */
static void same_cache(dsv4_engine_t *a, dsv4_engine_t *b) {
  size_t la, lb;
  uint8_t *ca = cache_bytes(a, &la), *cb = cache_bytes(b, &lb);
  assert_int_equal(la, lb);
  assert_memory_equal(ca, cb, la);
  free(ca);
  free(cb);
}

/*
 * The admin plane's reads on two engines (a on host memory, b possibly behind downloads) agree with
 * each other and with kvcache/records.h over a's cache bytes `ca` (cache_bytes): pool and block
 * digests, sequence digests, the multi-job digests and the records themselves.
 */
static void same_admin_reads(dsv4_engine_t *a, dsv4_engine_t *b, const uint8_t *ca,
                             const char *const *names, uint32_t n_names) {
  const size_t per = (size_t)BLOCKS * DSV4_BLOCK_STRIDE(64);
  for (uint32_t i = 0; i < 2; i++) {
    uint64_t pa = 0, pb = 1, ph = 2, bda[BLOCKS] = {0}, bdb[BLOCKS] = {0};
    uint8_t ua[BLOCKS] = {0}, ub[BLOCKS] = {0};
    dsv4_layer_src_t host = dsv4_layer_src_host(ca + i * per, 64);
    assert_int_equal(dsv4_engine_pool_digest(a, i, served[i], &pa, bda, ua), 0);
    assert_int_equal(dsv4_engine_pool_digest(b, i, served[i], &pb, bdb, ub), 0);
    assert_int_equal(dsv4_pool_digest(&a->pool, served[i], &host, &ph, NULL, NULL), 0);
    assert_true(pa == pb && pa == ph && pa != 0);
    assert_memory_equal(bda, bdb, sizeof(bda));
    assert_memory_equal(ua, ub, sizeof(ua));
    for (uint32_t k = 0; k < n_names; k++) {
      dsv4_seq_info_t ia, ib;
      uint32_t len = (uint32_t)strlen(names[k]);
      assert_int_equal(dsv4_engine_seq_info(a, names[k], len, &ia), 0);
      assert_int_equal(dsv4_engine_seq_info(b, names[k], len, &ib), 0);
      uint64_t da = 0, db = 1, dh = 2;
      int64_t f, t, f2, t2;
      assert_int_equal(dsv4_engine_seq_digest(a, i, &ia, &da, &f, &t), 0);
      assert_int_equal(dsv4_engine_seq_digest(b, i, &ib, &db, &f2, &t2), 0);
      assert_int_equal(dsv4_seq_digest(&host, &ia, i, &dh, NULL, NULL), 0);
      assert_true(da == db && da == dh);
      assert_true(f == f2 && t == t2 && t > f);
      /* The same digest twice at once, fed by the backend's host threads (one job each). */
      dsv4_records_digest_t *d[2];
      for (int j = 0; j < 2; j++)
        assert_int_equal(dsv4_records_digest_create(&d[j]), 0);
      dsv4_engine_digest_job_t jobs[2] = {{i, &ia, f, (uint32_t)(t - f), d[0]},
                                          {i, &ia, f, (uint32_t)(t - f), d[1]}};
      assert_int_equal(dsv4_engine_digest_records_multi(a, jobs, 2), 0);
      assert_true(dsv4_records_digest_value(d[0]) == da && dsv4_records_digest_value(d[1]) == da);
      for (int j = 0; j < 2; j++)
        dsv4_records_digest_destroy(d[j]);
      uint8_t *ra = malloc((size_t)(t - f) * DSV4_RECORD_BYTES);
      uint8_t *rb = malloc((size_t)(t - f) * DSV4_RECORD_BYTES);
      assert_true(ra && rb);
      assert_int_equal(dsv4_engine_read_records(a, i, &ia, f, (uint32_t)(t - f), ra), 0);
      assert_int_equal(dsv4_engine_read_records(b, i, &ib, f, (uint32_t)(t - f), rb), 0);
      assert_memory_equal(ra, rb, (size_t)(t - f) * DSV4_RECORD_BYTES);
      free(ra);
      free(rb);
      dsv4_seq_info_free(&ia);
      dsv4_seq_info_free(&ib);
    }
  }
}

/* One batch on two engines: both succeed with identical q_out, slots, digest and replay flag. */
static void same_batch(dsv4_engine_t *a, dsv4_engine_t *b, uint32_t layer, uint64_t seed,
                       uint32_t n_segs, const char *const *names, const int64_t *starts,
                       const uint32_t *lens, const int *is_new) {
  batch_t ba, bb;
  batch_make(&ba, layer, seed, n_segs, names, starts, lens, is_new);
  batch_make(&bb, layer, seed, n_segs, names, starts, lens, is_new);
  assert_int_equal(dsv4_engine_forward(a, &ba.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &bb.f), 0);
  assert_memory_equal(ba.q_out, bb.q_out, (size_t)ba.n * HEADS * DSV4_HEAD_DIM * 2);
  assert_memory_equal(ba.slots, bb.slots, ba.n * sizeof(int64_t));
  assert_int_equal(ba.f.digest, bb.f.digest);
  assert_int_equal(ba.f.replayed, bb.f.replayed);
  batch_free(&ba);
  batch_free(&bb);
}

/*
 * The device staging path gives the host-memory path's bytes: q_out, slots, digests and every
 * cache byte, over two-segment prefills across block boundaries, decode steps, a replay and the
 * fused kv_norm (whose weights the engine uploads once). The staged backend refuses any launch
 * argument that is not one of its device buffers, so this also shows that nothing reaches a launch
 * unstaged. With a device backend under test (argv[1], e.g. cuda) the same batches compare that
 * backend with the CPU reference.
 */
static void test_staged_matches_cpu(void **state) {
  (void)state;
  const char *other = strcmp(backend, "cpu") ? backend : "cpu_staged";
  float w[2 * DSV4_HEAD_DIM];
  for (int i = 0; i < 2 * DSV4_HEAD_DIM; i++)
    w[i] = 0.5f + (float)(i % 37) / 16.0f;
  for (int fused = 0; fused < 2; fused++) {
    dsv4_engine_t *a = open_engine_w("cpu", fused ? w : NULL);
    dsv4_engine_t *b = open_engine_w(other, fused ? w : NULL);
    assert_string_equal(dsv4_engine_backend_name(b), other);
    /* v's decode steps cross position 512, so a chunk of RoPE rows (DSV4_ROPE_CHUNK_ROWS = 256)
     * appears after a device backend has mirrored the first ones. */
    const char *names[2] = {"u", "v"};
    int64_t starts[2] = {0, 480};
    uint32_t lens[2] = {70, 20};
    int nw[2] = {1, 1};
    for (uint32_t li = 0; li < 2; li++) {
      nw[0] = nw[1] = li == 0;
      same_batch(a, b, served[li], 40 + li, 2, names, starts, lens, nw);
      same_batch(a, b, served[li], 40 + li, 2, names, starts, lens, nw); /* a replay */
    }
    for (int64_t step = 0; step < 70; step++)
      for (uint32_t li = 0; li < 2; li++) {
        int64_t st2[2] = {70 + step, 500 + step};
        uint32_t one[2] = {1, 1};
        int old[2] = {0, 0};
        same_batch(a, b, served[li], 1000 + (uint64_t)step * 2 + li, 2, names, st2, one, old);
      }
    size_t la, lb;
    uint8_t *ca = cache_bytes(a, &la), *cb = cache_bytes(b, &lb);
    assert_int_equal(la, lb);
    assert_memory_equal(ca, cb, la);
    same_admin_reads(a, b, ca, names, 2);
    free(ca);
    free(cb);
    if (!strcmp(other, "cpu_staged")) {
      dsv4_test_cpu_staged_stats_t st;
      dsv4_test_cpu_staged_stats(b->be, &st);
      const size_t batches = 2 * 2 + 70 * 2;
      /* One upload each for q and kv per batch, and the kv_norm weights once: the packed
       * metadata (positions, segments, table) is read where the engine assembled it, registered
       * with the backend. The four prefills (two and their replays) run their q half before
       * their validation, with q uploaded then instead of after it (engine.c, q_early_launch). */
      assert_int_equal(st.uploads, 2 * batches + (size_t)fused);
      /* q_out and slots complete at the batch's one sync (download_async, which leaves 0xa5
       * bytes in them until then: the comparison with the CPU above fails if the engine read them
       * earlier, as its digest does); the digest's reads of the cache wait for their bytes. */
      assert_int_equal(st.async_downloads, 2 * batches);
      assert_true(st.downloads >= batches);
      /* One sync a batch, and one after the kv_norm weights' upload. */
      assert_int_equal(st.syncs, batches + (size_t)fused);
    }
    assert_int_equal(dsv4_engine_blocks_free(a), dsv4_engine_blocks_free(b));
    dsv4_engine_destroy(a);
    dsv4_engine_destroy(b);
  }
}

/* ---- prefills in chunks ---- */

/* A batch with attention outputs too (attn and lse), for the chunked tests. */
typedef struct {
  batch_t b;
  uint16_t *attn;
  float *lse;
} attn_batch_t;

static void attn_batch_make(attn_batch_t *ab, uint32_t layer, uint64_t seed, uint32_t n_segs,
                            const char *const *names, const int64_t *starts, const uint32_t *lens,
                            const int *is_new) {
  batch_make(&ab->b, layer, seed, n_segs, names, starts, lens, is_new);
  ab->attn = malloc((size_t)ab->b.n * HEADS * DSV4_HEAD_DIM * 2);
  ab->lse = malloc((size_t)ab->b.n * HEADS * sizeof(float));
  assert_true(ab->attn && ab->lse);
  ab->b.f.attn = ab->attn;
  ab->b.f.lse = ab->lse;
  ab->b.f.attention = DSV4_ATTENTION_EXACT;
}

static void attn_batch_free(attn_batch_t *ab) {
  batch_free(&ab->b);
  free(ab->attn);
  free(ab->lse);
}

/* Every output of two answers to the same batch is the same, byte for byte. */
static void same_answer(const attn_batch_t *x, const attn_batch_t *y) {
  size_t n = x->b.n;
  assert_int_equal(x->b.n, y->b.n);
  assert_memory_equal(x->b.q_out, y->b.q_out, n * HEADS * DSV4_HEAD_DIM * 2);
  assert_memory_equal(x->b.slots, y->b.slots, n * sizeof(int64_t));
  assert_memory_equal(x->attn, y->attn, n * HEADS * DSV4_HEAD_DIM * 2);
  assert_memory_equal(x->lse, y->lse, n * HEADS * sizeof(float));
  assert_int_equal(x->b.f.digest, y->b.f.digest);
}

/* The yield hook of the chunked tests: on its first call, one decode batch of a sequence of its
 * own runs on the engine, as the executor runs a waiting decode between two chunks. */
typedef struct {
  dsv4_engine_t *e;
  uint32_t calls;
  attn_batch_t *decode; /* run at the first call, or NULL */
  int decode_rc;
  int fail_decode; /* the decode's insert fails on the device (the faulty backend) */
} yield_probe_t;

static void probe_yield(void *arg) {
  yield_probe_t *y = arg;
  if (y->calls++ == 0 && y->decode) {
    fail_next_insert = y->fail_decode;
    y->decode_rc = dsv4_engine_forward(y->e, &y->decode->b.f);
  }
}

static const char *const pf_names[2] = {"p", "q"};
static const int64_t pf_starts[2] = {0, 0};
static const uint32_t pf_lens[2] = {100, 30};
static const int pf_new[2] = {1, 1};

/*
 * A prefill run in chunks of 16 tokens, with a decode of another sequence between its first two
 * chunks, gives the bytes of one launch on an engine that never chunks: q_out, slots, attn, lse,
 * the digest, the decode's answer and every cache byte; its replay is recognised and answers the
 * same bytes; the sequences then continue alike.
 */
static void test_chunked_prefill_matches_one_launch(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine_chunked(backend, 0), *b = open_engine_chunked(backend, 16);
  const char *dn[1] = {"d"};
  const int64_t d0[1] = {0};
  const uint32_t one[1] = {1};
  const int dnew[1] = {1};
  attn_batch_t pa, pb, da, db;
  attn_batch_make(&pa, 0, 11, 2, pf_names, pf_starts, pf_lens, pf_new);
  attn_batch_make(&pb, 0, 11, 2, pf_names, pf_starts, pf_lens, pf_new);
  attn_batch_make(&da, 0, 12, 1, dn, d0, one, dnew);
  attn_batch_make(&db, 0, 12, 1, dn, d0, one, dnew);
  yield_probe_t ya = {.e = a}, yb = {.e = b, .decode = &db};
  pa.b.f.yield = probe_yield;
  pa.b.f.yield_arg = &ya;
  pb.b.f.yield = probe_yield;
  pb.b.f.yield_arg = &yb;
  assert_int_equal(dsv4_engine_forward(a, &pa.b.f), 0);
  assert_int_equal(dsv4_engine_forward(a, &da.b.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &pb.b.f), 0);
  assert_int_equal(yb.decode_rc, 0);
  assert_int_equal(pa.b.f.chunks, 1);
  assert_int_equal(ya.calls, 0);
  assert_int_equal(pb.b.f.chunks, (130 + 15) / 16);
  assert_int_equal(yb.calls, (130 + 15) / 16 - 1);
  assert_false(pb.b.f.replayed);
  same_answer(&pa, &pb);
  same_answer(&da, &db);
  if (!strncmp(backend, "cpu_staged", 10)) {
    /* Every attention launch of the SWA-only layer came with the engine's windows, which the
     * staged backend found equal to the tables': the chunks' (their windows reach into the chunks
     * before them) and the decode's. */
    dsv4_test_cpu_staged_stats_t st;
    dsv4_test_cpu_staged_stats(b->be, &st);
    assert_int_equal(st.attn_launches, (130 + 15) / 16 + 1);
    assert_int_equal(st.windows, st.attn_launches);
  }

  /* The whole request again: a replay, recognised although it ran in chunks, with the same bytes.
   */
  attn_batch_t ra, rb;
  attn_batch_make(&ra, 0, 11, 2, pf_names, pf_starts, pf_lens, pf_new);
  attn_batch_make(&rb, 0, 11, 2, pf_names, pf_starts, pf_lens, pf_new);
  yield_probe_t yr = {.e = b};
  rb.b.f.yield = probe_yield;
  rb.b.f.yield_arg = &yr;
  assert_int_equal(dsv4_engine_forward(a, &ra.b.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &rb.b.f), 0);
  assert_true(ra.b.f.replayed && rb.b.f.replayed);
  assert_int_equal(rb.b.f.chunks, (130 + 15) / 16);
  same_answer(&pb, &rb);
  same_answer(&ra, &rb);

  /* The sequences continue alike on the other layer and with a decode step. */
  const uint32_t other_lens[2] = {100, 30};
  same_batch(a, b, served[1], 13, 2, pf_names, pf_starts, other_lens, (const int[]){0, 0});
  same_batch(a, b, 0, 14, 2, pf_names, (const int64_t[]){100, 30}, (const uint32_t[]){1, 1},
             (const int[]){0, 0});
  same_cache(a, b);
  assert_int_equal(dsv4_engine_blocks_free(a), dsv4_engine_blocks_free(b));
  attn_batch_free(&pa);
  attn_batch_free(&pb);
  attn_batch_free(&da);
  attn_batch_free(&db);
  attn_batch_free(&ra);
  attn_batch_free(&rb);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/*
 * prefill_chunk_tokens_alone: on an engine with chunks of 16 and of 64 alone, a first prefill runs
 * its first chunk long, then short after the decode its hook runs; the next prefill, after that
 * decode, short throughout; the one after it, with no decode since, long again. Every answer is
 * the one launch's of an engine that never chunks.
 */
static void test_chunks_alone(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine_chunked(backend, 0), *b = open_engine_full(backend, 16, 64, 0);
  const char *const names[3][2] = {{"p", "q"}, {"r", "s"}, {"t", "u"}};
  const char *dn[1] = {"d"};
  const uint32_t one[1] = {1};
  const int dnew[1] = {1};
  /* 130 tokens: 64 then 66 in 16s; 130 in 16s; 130 in 64s. */
  const uint32_t want[3] = {1 + (66 + 15) / 16, (130 + 15) / 16, (130 + 63) / 64};
  attn_batch_t da, db;
  attn_batch_make(&da, 0, 22, 1, dn, (const int64_t[]){0}, one, dnew);
  attn_batch_make(&db, 0, 22, 1, dn, (const int64_t[]){0}, one, dnew);
  for (int i = 0; i < 3; i++) {
    attn_batch_t pa, pb;
    attn_batch_make(&pa, 0, 23 + (uint64_t)i, 2, names[i], pf_starts, pf_lens, pf_new);
    attn_batch_make(&pb, 0, 23 + (uint64_t)i, 2, names[i], pf_starts, pf_lens, pf_new);
    yield_probe_t ya = {.e = a}, yb = {.e = b, .decode = i == 0 ? &db : NULL};
    pa.b.f.yield = probe_yield;
    pa.b.f.yield_arg = &ya;
    pb.b.f.yield = probe_yield;
    pb.b.f.yield_arg = &yb;
    assert_int_equal(dsv4_engine_forward(a, &pa.b.f), 0);
    if (i == 0)
      assert_int_equal(dsv4_engine_forward(a, &da.b.f), 0);
    assert_int_equal(dsv4_engine_forward(b, &pb.b.f), 0);
    assert_int_equal(yb.decode_rc, 0);
    assert_int_equal(pb.b.f.chunks, want[i]);
    same_answer(&pa, &pb);
    attn_batch_free(&pa);
    attn_batch_free(&pb);
  }
  same_answer(&da, &db);
  same_cache(a, b);
  attn_batch_free(&da);
  attn_batch_free(&db);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/*
 * SPEC §7's fused decode path: decode steps of two sequences whose q is not an output, on both
 * served layers, give on the backend under test the CPU backend's attn, lse, slots and digests
 * (the reference answers q as well, so it runs the unfused path), and the same caches. Where the
 * backend offers the path (DSV4_BE_ATTN_FUSED_Q) it leaves q_out as it was, which shows that the
 * path ran; elsewhere q_out is the reference's. A replay of the last step, which runs unfused,
 * answers the same bytes again, q_out included.
 */
static void test_fused_decode(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine_chunked("cpu", 0), *b = open_engine_chunked(backend, 0);
  const int fused = (b->be->ops->caps & DSV4_BE_ATTN_FUSED_Q) != 0;
  const uint32_t layers[2] = {0, served[1]}, prefill[2] = {100, 30}, one[2] = {1, 1};
  const int yes[2] = {1, 1}, no[2] = {0, 0};
  const size_t q_bytes = 2 * HEADS * DSV4_HEAD_DIM * 2;
  for (int l = 0; l < 2; l++)
    same_batch(a, b, layers[l], 70 + (uint64_t)l, 2, pf_names, pf_starts, prefill, l ? no : yes);
  attn_batch_t x, y;
  int64_t st[2] = {100, 30};
  for (int k = 0; k < 6; k++) {
    const uint32_t layer = layers[k % 2];
    attn_batch_make(&x, layer, 80 + (uint64_t)k, 2, pf_names, st, one, no);
    attn_batch_make(&y, layer, 80 + (uint64_t)k, 2, pf_names, st, one, no);
    y.b.f.q_unwanted = 1;
    memset(y.b.q_out, 0xA5, q_bytes);
    assert_int_equal(dsv4_engine_forward(a, &x.b.f), 0);
    assert_int_equal(dsv4_engine_forward(b, &y.b.f), 0);
    assert_false(y.b.f.replayed);
    assert_memory_equal(x.b.slots, y.b.slots, 2 * sizeof(int64_t));
    assert_memory_equal(x.attn, y.attn, q_bytes);
    assert_memory_equal(x.lse, y.lse, 2 * HEADS * sizeof(float));
    assert_int_equal(x.b.f.digest, y.b.f.digest);
    if (fused) {
      for (size_t i = 0; i < q_bytes; i++)
        assert_int_equal(((const uint8_t *)y.b.q_out)[i], 0xA5);
    } else {
      assert_memory_equal(x.b.q_out, y.b.q_out, q_bytes);
    }
    if (k % 2) {
      st[0]++;
      st[1]++;
    }
    if (k < 5) {
      attn_batch_free(&x);
      attn_batch_free(&y);
    }
  }
  /* The last step again on b: a replay, which runs unfused and answers q_out as well. */
  attn_batch_t r;
  st[0]--;
  st[1]--;
  attn_batch_make(&r, layers[1], 85, 2, pf_names, st, one, no);
  r.b.f.q_unwanted = 1;
  assert_int_equal(dsv4_engine_forward(b, &r.b.f), 0);
  assert_true(r.b.f.replayed);
  assert_memory_equal(x.b.q_out, r.b.q_out, q_bytes);
  assert_memory_equal(x.attn, r.attn, q_bytes);
  assert_memory_equal(x.lse, r.lse, 2 * HEADS * sizeof(float));
  assert_int_equal(x.b.f.digest, r.b.f.digest);
  same_cache(a, b);
  attn_batch_free(&x);
  attn_batch_free(&y);
  attn_batch_free(&r);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/* n bytes of src (or n zero bytes when src is NULL) at *off + skew of region, *off then moved past
 * them to the next 64-byte boundary. */
static void *in_region(uint8_t *region, size_t cap, size_t *off, const void *src, size_t n,
                       size_t skew) {
  uint8_t *p = region + *off + skew;
  assert_true(*off + skew + n <= cap);
  if (src)
    memcpy(p, src, n);
  else
    memset(p, 0, n);
  *off = (*off + skew + n + 63) & ~(size_t)63;
  return p;
}

/* y's inputs and outputs moved into region from byte at (skew bytes past 64-byte boundaries). */
static void batch_into_region_at(attn_batch_t *y, uint8_t *region, size_t cap, size_t skew,
                                 size_t at) {
  size_t off = at, n = y->b.n, qb = n * HEADS * DSV4_HEAD_DIM * 2;
  y->b.f.q = in_region(region, cap, &off, y->b.q, qb, skew);
  y->b.f.kv = in_region(region, cap, &off, y->b.kv, n * DSV4_HEAD_DIM * 2, skew);
  y->b.f.q_out = in_region(region, cap, &off, NULL, qb, skew);
  y->b.f.slots = in_region(region, cap, &off, NULL, n * sizeof(int64_t), skew);
  if (y->b.f.attn) {
    y->b.f.attn = in_region(region, cap, &off, NULL, qb, skew);
    y->b.f.lse = in_region(region, cap, &off, NULL, n * HEADS * sizeof(float), skew);
  }
}

static void batch_into_region(attn_batch_t *y, uint8_t *region, size_t cap, size_t skew) {
  batch_into_region_at(y, region, cap, skew, 0);
}

/* The in-place tests' setting: engine a on the CPU backend, engine b on backend other, and a
 * region of cap bytes registered with b. */
typedef struct {
  uint8_t *region;
  dsv4_engine_t *a, *b;
} beside_t;

/* (b's q_piece_bytes: piece) */
static beside_t beside_open_pieces(const char *other, size_t cap, uint32_t piece) {
  beside_t t = {aligned_alloc(4096, cap), open_engine_chunked("cpu", 0),
                open_engine_pieces(other, 0, piece)};
  assert_non_null(t.region);
  assert_int_equal(dsv4_engine_host_register(t.b, t.region, cap), 0);
  return t;
}

static beside_t beside_open(const char *other, size_t cap) {
  return beside_open_pieces(other, cap, 0);
}

static void beside_close(beside_t *t) {
  dsv4_engine_host_unregister(t->b, t->region);
  dsv4_engine_destroy(t->a);
  dsv4_engine_destroy(t->b);
  free(t->region);
}

/* The same batch of two segments twice (x for one engine, y for the other), on served layer 0,
 * without attention outputs unless attn. */
static void attn_pair_make(attn_batch_t *x, attn_batch_t *y, uint64_t seed,
                           const char *const *names, const int64_t *st, const uint32_t *len,
                           const int *is_new, int attn) {
  attn_batch_make(x, served[0], seed, 2, names, st, len, is_new);
  attn_batch_make(y, served[0], seed, 2, names, st, len, is_new);
  if (!attn) {
    x->b.f.attn = y->b.f.attn = NULL;
    x->b.f.lse = y->b.f.lse = NULL;
  }
}

/* One batch on a (host memory) and b (its tensors in region, skew bytes off alignment): the same
 * answer. Returns the staged backend's uploads and downloads for b's batch (0 on other backends).
 */
static size_t in_place_batch(dsv4_engine_t *a, dsv4_engine_t *b, uint8_t *region, size_t cap,
                             size_t skew, uint64_t seed, const char *const *names,
                             const int64_t *st, const uint32_t *len, const int *is_new, int attn,
                             int q_wanted) {
  attn_batch_t x, y;
  attn_pair_make(&x, &y, seed, names, st, len, is_new, attn);
  y.b.f.q_unwanted = !q_wanted;
  batch_into_region(&y, region, cap, skew);
  dsv4_test_cpu_staged_stats_t s0 = {0}, s1 = {0};
  const int staged = !strncmp(dsv4_engine_backend_name(b), "cpu_staged", 10);
  if (staged)
    dsv4_test_cpu_staged_stats(b->be, &s0);
  assert_int_equal(dsv4_engine_forward(a, &x.b.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &y.b.f), 0);
  if (staged)
    dsv4_test_cpu_staged_stats(b->be, &s1);
  size_t n = x.b.n, qb = n * HEADS * DSV4_HEAD_DIM * 2;
  assert_memory_equal(x.b.slots, y.b.f.slots, n * sizeof(int64_t));
  if (q_wanted)
    assert_memory_equal(x.b.q_out, y.b.f.q_out, qb);
  if (attn) {
    assert_memory_equal(x.attn, y.b.f.attn, qb);
    assert_memory_equal(x.lse, y.b.f.lse, n * HEADS * sizeof(float));
  }
  assert_int_equal(x.b.f.digest, y.b.f.digest);
  attn_batch_free(&x);
  attn_batch_free(&y);
  return (s1.uploads - s0.uploads) * 100 + (s1.async_downloads - s0.async_downloads);
}

/*
 * A batch whose tensors lie in memory given to host_register (the daemon's page-locked pool, a
 * shared region): where they are aligned (DSV4_ALIAS_ALIGN) the launches read q and kv and write
 * q_out in place (host_alias) instead of uploads and downloads; 8 bytes off, they are copied as
 * before. Both answer the CPU backend's bytes: prefills with attention, q-only batches (q_out in
 * place) and decode steps with and without q (the fused path). On the staged backend the copies
 * are counted: in place, no upload a batch but the packed metadata's and q's on the fused path
 * when the attention runs, and no download but attn's and lse's, and q_out's when the attention
 * reads it. On
 * cuda (argv[1]) this runs the device's mapping of the pages.
 */
static void test_in_place_matches_cpu(void **state) {
  (void)state;
  const size_t cap = (size_t)8 << 20;
  const char *other = strcmp(backend, "cpu") ? backend : "cpu_staged";
  beside_t t = beside_open(other, cap);
  uint8_t *region = t.region;
  dsv4_engine_t *a = t.a, *b = t.b;
  const int staged = !strcmp(other, "cpu_staged");
  const int fused = (b->be->ops->caps & DSV4_BE_ATTN_FUSED_Q) != 0;
  const uint32_t prefill[2] = {40, 23}, one[2] = {1, 1};
  const int yes[2] = {1, 1}, no[2] = {0, 0};
  for (size_t skew = 0; skew <= 8; skew += 8) {
    int64_t st[2] = {0, 0};
    const char *names[2] = {skew ? "r" : "p", skew ? "s" : "q"};
    size_t c = in_place_batch(a, b, region, cap, skew, 90 + skew, names, st, prefill, yes, 1, 1);
    /* In place: q, kv and the slots (q_out is staged for the attention, attn and lse always, and
     * the packed metadata is uploaded for the attention). */
    if (staged)
      assert_int_equal(c, skew ? 304 : 103);
    st[0] = prefill[0];
    st[1] = prefill[1];
    for (int k = 0; k < 4; k++) {
      const int attn = k != 1, q_wanted = k != 2;
      c = in_place_batch(a, b, region, cap, skew, 91 + skew + (uint64_t)k, names, st, one, no, attn,
                         q_wanted);
      /* The fused decode path uploads q (its attention CTAs read it), and a batch with attention
       * the packed metadata; the attention's q_out is staged unless fused; attn and lse always
       * are. */
      const size_t is_fused = fused && attn && !q_wanted, down = attn ? 2u : 0u;
      if (staged && !skew)
        assert_int_equal(c, (is_fused + (size_t)attn) * 100 + down + (size_t)(attn && !is_fused));
      if (staged && skew) /* the slots too */
        assert_int_equal(c, 200 + (size_t)attn * 100 + 1 + down + (size_t)!is_fused);
      st[0]++;
      st[1]++;
    }
  }
  if (staged) {
    dsv4_test_cpu_staged_stats_t sb;
    dsv4_test_cpu_staged_stats(b->be, &sb);
    assert_true(sb.aliases > 0);
  }
  same_cache(a, b);
  beside_close(&t);
}

/* in_place_max_bytes: a batch whose q is larger goes through staging (q, kv and the metadata
 * uploaded, q_out and the slots downloaded), a smaller one in place, both answering the CPU
 * backend's bytes; a prefill in chunks goes by its chunks' q. */
static void test_in_place_limit(void **state) {
  (void)state;
  const size_t cap = (size_t)8 << 20, row = (size_t)HEADS * DSV4_HEAD_DIM * 2;
  const char *other = strcmp(backend, "cpu") ? backend : "cpu_staged";
  in_place_limit = 16 * row; /* 16 tokens */
  beside_t t = beside_open(other, cap);
  in_place_limit = 0;
  const int staged = !strcmp(other, "cpu_staged");
  const char *names[2] = {"a", "b"};
  const uint32_t big[2] = {10, 7}, small[2] = {9, 7}, one[2] = {1, 1};
  const int yes[2] = {1, 1}, no[2] = {0, 0};
  int64_t st[2] = {0, 0};
  /* 17 tokens: the metadata, q and kv up, q_out and the slots down; 16 and 2: nothing copied. */
  size_t c = in_place_batch(t.a, t.b, t.region, cap, 0, 71, names, st, big, yes, 0, 1);
  if (staged)
    assert_int_equal(c, 302);
  st[0] += big[0];
  st[1] += big[1];
  c = in_place_batch(t.a, t.b, t.region, cap, 0, 72, names, st, small, no, 0, 1);
  if (staged)
    assert_int_equal(c, 0);
  st[0] += small[0];
  st[1] += small[1];
  c = in_place_batch(t.a, t.b, t.region, cap, 0, 73, names, st, one, no, 0, 1);
  if (staged)
    assert_int_equal(c, 0);
  same_cache(t.a, t.b);
  beside_close(&t);
}

/* One batch of two segments (lens, from st) on a (the CPU backend) and b: the same answers (q_out,
 * slots, attn and lse where asked); returns the bytes b flushed from the host's caches. */
static uint64_t flush_batch_pair(dsv4_engine_t *a, dsv4_engine_t *b, uint64_t seed,
                                 const char *const *names, const int64_t *st, const uint32_t *lens,
                                 const int *is_new, int attn) {
  attn_batch_t x, y;
  attn_pair_make(&x, &y, seed, names, st, lens, is_new, attn);
  assert_int_equal(dsv4_engine_forward(a, &x.b.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &y.b.f), 0);
  const size_t n = x.b.n, qb = n * HEADS * DSV4_HEAD_DIM * 2;
  assert_memory_equal(x.b.q_out, y.b.q_out, qb);
  assert_memory_equal(x.b.slots, y.b.slots, n * sizeof(int64_t));
  if (attn) {
    assert_memory_equal(x.attn, y.attn, qb);
    assert_memory_equal(x.lse, y.lse, n * HEADS * sizeof(float));
  }
  assert_int_equal(x.b.f.timing.flushed_bytes, 0); /* no device, nothing flushed */
  const uint64_t flushed = y.b.f.timing.flushed_bytes;
  attn_batch_free(&x);
  attn_batch_free(&y);
  return flushed;
}

/*
 * cache_flush_bytes: a batch with more q than the bound has its q and kv flushed from the CPU
 * caches (engine.c, flush_batch), once validated or, where its q half reads q before the
 * validation (no attention, enough q), before that; one at the bound is not. The answers are the
 * CPU backend's.
 */
static void test_cache_flush(void **state) {
  (void)state;
  const uint64_t row = (uint64_t)HEADS * DSV4_HEAD_DIM * 2, kv_row = DSV4_HEAD_DIM * 2;
  const char *other = strcmp(backend, "cpu") ? backend : "cpu_staged";
  cache_flush = 16 * row;
  dsv4_engine_t *a = open_engine_full("cpu", 0, 0, 0), *b = open_engine_full(other, 0, 0, 0);
  cache_flush = 0;
  const int works = dsv4_host_flush_works();
  const char *names[2] = {"fa", "fb"};
  int64_t st[2] = {0, 0};
  const uint32_t big[2] = {10, 7}, at[2] = {9, 7}, early[2] = {30, 10};
  const int yes[2] = {1, 1}, no[2] = {0, 0};
  assert_int_equal(flush_batch_pair(a, b, 600, names, st, big, yes, 1),
                   works ? 17 * (row + kv_row) : 0);
  st[0] += big[0];
  st[1] += big[1];
  assert_int_equal(flush_batch_pair(a, b, 601, names, st, at, no, 1), 0);
  st[0] += at[0];
  st[1] += at[1];
  /* 40 tokens of q alone: 320 KiB, the q half's. */
  assert_int_equal(flush_batch_pair(a, b, 602, names, st, early, no, 0),
                   works ? 40 * (row + kv_row) : 0);
  st[0] += early[0];
  st[1] += early[1];
  assert_int_equal(flush_batch_pair(a, b, 603, names, st, big, no, 1),
                   works ? 17 * (row + kv_row) : 0);
  same_cache(a, b);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
  /* In chunks of 16 tokens (each at the bound, the batch over it): every chunk's q and kv before
   * its kernels, and nothing after the validation, so each byte once. */
  cache_flush = 16 * row;
  a = open_engine_full("cpu", 0, 0, 0);
  b = open_engine_full(other, 16, 0, 0);
  cache_flush = 0;
  attn_batch_t pa, pb;
  attn_batch_make(&pa, served[0], 604, 2, pf_names, pf_starts, pf_lens, pf_new);
  attn_batch_make(&pb, served[0], 604, 2, pf_names, pf_starts, pf_lens, pf_new);
  yield_probe_t yb = {.e = b};
  pb.b.f.yield = probe_yield;
  pb.b.f.yield_arg = &yb;
  assert_int_equal(dsv4_engine_forward(a, &pa.b.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &pb.b.f), 0);
  assert_int_equal(pb.b.f.chunks, (130 + 15) / 16);
  assert_int_equal(pb.b.f.timing.flushed_bytes, works ? 130 * (row + kv_row) : 0);
  same_answer(&pa, &pb);
  attn_batch_free(&pa);
  attn_batch_free(&pb);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/* The staged backend's launches so far (0 on other backends). */
static size_t staged_launches(dsv4_engine_t *e) {
  dsv4_test_cpu_staged_stats_t s = {0};
  if (!strncmp(dsv4_engine_backend_name(e), "cpu_staged", 10))
    dsv4_test_cpu_staged_stats(e->be, &s);
  return s.launches;
}

/* A q-only batch of two segments continuing names at st, in region on b, refused with want_rc (a q
 * value out of range at its very end when bad_q): its outputs' bytes in the region stay as they
 * were. */
static void refused_in_place(dsv4_engine_t *b, uint8_t *region, size_t cap, uint64_t seed,
                             const char *const *names, const int64_t *st, const uint32_t *len,
                             int bad_q, int want_rc) {
  attn_batch_t y;
  const int no[2] = {0, 0};
  attn_batch_make(&y, served[0], seed, 2, names, st, len, no);
  y.b.f.attn = NULL;
  y.b.f.lse = NULL;
  const size_t n = y.b.n, qb = n * HEADS * DSV4_HEAD_DIM * 2;
  if (bad_q)
    y.b.q[n * HEADS * DSV4_HEAD_DIM - 1] = 0x5D00; /* 2^59 */
  y.b.f.want_digest = 0; /* so that it may begin beside a batch in flight */
  batch_into_region_at(&y, region, cap, 0, cap / 2);
  memset(y.b.f.q_out, 0x5a, qb);
  memset(y.b.f.slots, 0x5a, n * sizeof(int64_t));
  assert_int_equal(dsv4_engine_forward(b, &y.b.f), want_rc);
  const uint8_t *qo = (const uint8_t *)y.b.f.q_out, *sl = (const uint8_t *)y.b.f.slots;
  for (size_t i = 0; i < qb; i++)
    assert_int_equal(qo[i], 0x5a);
  for (size_t i = 0; i < n * sizeof(int64_t); i++)
    assert_int_equal(sl[i], 0x5a);
  attn_batch_free(&y);
}

/* The staged backend's marked downloads so far, and those that asked for bytes before they were
 * written (0 on other backends). */
static size_t staged_marked(dsv4_engine_t *e, size_t *early) {
  dsv4_test_cpu_staged_stats_t s = {0};
  if (!strncmp(dsv4_engine_backend_name(e), "cpu_staged", 10))
    dsv4_test_cpu_staged_stats(e->be, &s);
  *early = s.early_marked;
  return s.marked_downloads;
}

/*
 * A batch with enough q (here 504 KiB) read in place and no attention runs its q half while the
 * host checks and plans it (engine.c, q_early_launch), and its KV rows after: the CPU backend's
 * bytes, a replay's too; a batch refused after its q half (a q value out of range, a position
 * gap) writes nothing into the region, the cache or the sequences (the next batch answers as on
 * the CPU backend). On the staged backend: three launches a batch (q half, producer, KV rows), two
 * for a replay (no KV rows), and q_out downloaded from staging. With q_piece_bytes 64 KiB the q
 * half goes in 8 launches, each downloaded on its own after its mark (backend.h). Over the
 * in_place_max_bytes bound (limit) the q half runs too, on q uploaded piece by piece, and the
 * batch's insert uploads no q again. On cuda (argv[1]) the device's.
 */
static void q_half_first(uint32_t piece, uint64_t limit) {
  const size_t cap = (size_t)8 << 20;
  const char *other = strcmp(backend, "cpu") ? backend : "cpu_staged";
  in_place_limit = limit;
  beside_t t = beside_open_pieces(other, cap, piece);
  in_place_limit = 0;
  uint8_t *region = t.region;
  dsv4_engine_t *a = t.a, *b = t.b;
  const int staged = !strncmp(other, "cpu_staged", 10);
  const size_t pieces = piece ? 8 : 1, pieces_marked = piece ? 8 : 0;
  const uint32_t len[2] = {40, 23};
  const int yes[2] = {1, 1}, no[2] = {0, 0};
  const char *names[2] = {"e", "f"};
  int64_t st[2] = {0, 0};
  size_t early, m0 = staged_marked(b, &early), l0 = staged_launches(b);
  size_t c = in_place_batch(a, b, region, cap, 0, 300, names, st, len, yes, 0, 1);
  if (staged && limit) {
    /* Up: q's pieces, the metadata and kv (the q half reads the positions in place, in the
     * registered metadata); down: q_out's pieces and the slots. */
    assert_int_equal(c, (pieces + 2) * 100 + pieces + 1);
    assert_int_equal(staged_launches(b) - l0, pieces + 2);
    assert_int_equal(staged_marked(b, &early) - m0, pieces_marked);
    assert_int_equal(early, 0);
  } else if (staged) {
    assert_int_equal(c, pieces); /* q_out downloaded, nothing uploaded */
    assert_int_equal(staged_launches(b) - l0, pieces + 2);
    assert_int_equal(staged_marked(b, &early) - m0, pieces_marked);
    assert_int_equal(early, 0);
  }
  l0 = staged_launches(b);
  (void)in_place_batch(a, b, region, cap, 0, 300, names, st, len, yes, 0, 1); /* a replay */
  if (staged)
    assert_int_equal(staged_launches(b) - l0, pieces + 1);
  st[0] = len[0];
  st[1] = len[1];
  refused_in_place(b, region, cap, 301, names, st, len, 1, DSV4_ERANGE);
  st[0]++;
  refused_in_place(b, region, cap, 302, names, st, len, 0, DSV4_EPOSITION);
  st[0]--;
  (void)in_place_batch(a, b, region, cap, 0, 303, names, st, len, no, 0, 1);
  same_cache(a, b);
  beside_close(&t);
}

static void test_q_half_first(void **state) {
  (void)state;
  const uint64_t row = (uint64_t)HEADS * DSV4_HEAD_DIM * 2;
  q_half_first(0, 0);
  q_half_first(64u << 10, 0);
  q_half_first(0, 16 * row);
  q_half_first(64u << 10, 16 * row);
}

/* A q-only batch of one segment (name at st, len tokens) for a (x, host memory) and b (y, in
 * region from byte at). */
static void q_pair(attn_batch_t *x, attn_batch_t *y, uint64_t seed, const char *name, int64_t st,
                   uint32_t len, uint8_t *region, size_t cap, size_t at) {
  const char *names[1] = {name};
  const int nw[1] = {st == 0};
  attn_batch_make(x, served[0], seed, 1, names, &st, &len, nw);
  attn_batch_make(y, served[0], seed, 1, names, &st, &len, nw);
  x->b.f.attn = y->b.f.attn = NULL;
  x->b.f.lse = y->b.f.lse = NULL;
  x->b.f.want_digest = y->b.f.want_digest = 0;
  batch_into_region_at(y, region, cap, 0, at);
}

static void same_q_answer(const attn_batch_t *x, const attn_batch_t *y) {
  const size_t n = x->b.n;
  assert_memory_equal(x->b.q_out, y->b.f.q_out, n * HEADS * DSV4_HEAD_DIM * 2);
  assert_memory_equal(x->b.slots, y->b.f.slots, n * sizeof(int64_t));
}

/*
 * The q half first beside a batch in flight (an overlapping backend: cpu_staged_overlap, or the
 * device's): B begins while A is in flight and launches its q half before its validation; both end
 * with the CPU backend's answers. Then C, refused (a q value out of range) while D is in flight,
 * writes nothing into the region, and D ends as on the CPU backend.
 */
static void test_q_half_first_beside_flight(void **state) {
  (void)state;
  const size_t cap = (size_t)16 << 20, quarter = cap / 4;
  const char *other = !strncmp(backend, "cpu", 3) ? "cpu_staged_overlap" : backend;
  beside_t t = beside_open(other, cap);
  uint8_t *region = t.region;
  dsv4_engine_t *a = t.a, *b = t.b;
  const int staged = !strncmp(other, "cpu_staged", 10);
  attn_batch_t xa, ya, xb, yb, xd, yd;
  q_pair(&xa, &ya, 400, "ga", 0, 40, region, cap, 0);
  q_pair(&xb, &yb, 401, "gb", 0, 33, region, cap, quarter);
  assert_true(dsv4_engine_can_overlap(b, &ya.b.f));
  assert_int_equal(dsv4_engine_forward(a, &xa.b.f), 0);
  assert_int_equal(dsv4_engine_forward(a, &xb.b.f), 0);
  assert_int_equal(dsv4_engine_forward_begin(b, &ya.b.f), 0);
  assert_true(ya.b.f.in_flight);
  const size_t l0 = staged_launches(b);
  assert_int_equal(dsv4_engine_forward_begin(b, &yb.b.f), 0);
  assert_true(yb.b.f.in_flight);
  if (staged)
    assert_int_equal(staged_launches(b) - l0, 3); /* q half, producer, KV rows */
  assert_int_equal(dsv4_engine_forward_end(b, &ya.b.f), 0);
  assert_int_equal(dsv4_engine_forward_end(b, &yb.b.f), 0);
  same_q_answer(&xa, &ya);
  same_q_answer(&xb, &yb);
  q_pair(&xd, &yd, 402, "gb", 33, 33, region, cap, quarter);
  assert_int_equal(dsv4_engine_forward(a, &xd.b.f), 0);
  assert_int_equal(dsv4_engine_forward_begin(b, &yd.b.f), 0);
  assert_true(yd.b.f.in_flight);
  const char *names[2] = {"ga", "ga"};
  const int64_t st[2] = {40, 41};
  const uint32_t len[2] = {1, 39};
  refused_in_place(b, region, cap, 403, names, st, len, 1, DSV4_ERANGE);
  assert_int_equal(dsv4_engine_forward_end(b, &yd.b.f), 0);
  same_q_answer(&xd, &yd);
  same_cache(a, b);
  attn_batch_free(&xa);
  attn_batch_free(&ya);
  attn_batch_free(&xb);
  attn_batch_free(&yb);
  attn_batch_free(&xd);
  attn_batch_free(&yd);
  beside_close(&t);
}

/* ---- restore ---- */

/* What a dump of sequence name on e holds: its state and the stored records of each served layer.
 */
typedef struct {
  dsv4_seq_layer_state_t ls[2];
  uint8_t *recs[2];
  int64_t first;
  uint64_t digest[2];
} saved_t;

static void save(dsv4_engine_t *e, const char *name, saved_t *sv) {
  dsv4_seq_info_t info;
  dsv4_seq_state_t st = {0, sv->ls};
  uint32_t len = (uint32_t)strlen(name);
  assert_int_equal(dsv4_engine_seq_info(e, name, len, &info), 0);
  assert_int_equal(dsv4_engine_seq_state(e, name, len, &st), 0);
  for (uint32_t i = 0; i < 2; i++) {
    int64_t f, end;
    assert_int_equal(dsv4_engine_seq_digest(e, i, &info, &sv->digest[i], &f, &end), 0);
    sv->first = f;
    sv->recs[i] = malloc((size_t)(end - f + 1) * DSV4_RECORD_BYTES);
    assert_int_equal(dsv4_engine_read_records(e, i, &info, f, (uint32_t)(end - f), sv->recs[i]), 0);
  }
  dsv4_seq_info_free(&info);
}

static int restore(dsv4_engine_t *e, const char *name, const saved_t *sv, int replace,
                   dsv4_engine_restore_result_t *res) {
  const uint8_t *recs[2] = {sv->recs[0], sv->recs[1]};
  dsv4_engine_restore_t r = {0, sv->first, sv->ls, recs, NULL};
  return dsv4_engine_restore(e, name, (uint32_t)strlen(name), &r, replace, 1, res);
}

static void digests_of(dsv4_engine_t *e, const char *name, uint64_t d[2]) {
  dsv4_seq_info_t info;
  assert_int_equal(dsv4_engine_seq_info(e, name, (uint32_t)strlen(name), &info), 0);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(dsv4_engine_seq_digest(e, i, &info, &d[i], NULL, NULL), 0);
  dsv4_seq_info_free(&info);
}

/* A sequence restored on another engine has the same digests and continues byte for byte; each
 * refusal changes nothing; a device that fails while the records are written restores nothing. */
static void test_restore(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine(backend), *b = open_engine("faulty");
  dsv4_engine_restore_result_t res;
  uint64_t da, db, d2[2];
  saved_t sv;
  /* Layer 0 runs ahead (150 then decode), so blocks before its window go; layer 2 stays at 0..99.
   */
  assert_int_equal(run1(a, 0, 1, "s", 0, 150, 1, NULL), 0);
  assert_int_equal(run1(a, 2, 2, "s", 0, 100, 0, NULL), 0);
  assert_int_equal(run1(a, 0, 3, "s", 150, 1, 0, NULL), 0);
  save(a, "s", &sv);
  /* Another sequence on b fills the pool but two blocks: s needs three. */
  assert_int_equal(run1(b, 0, 4, "o", 0, 64 * (BLOCKS - 2), 1, NULL), 0);
  assert_int_equal(restore(b, "s", &sv, 0, &res), DSV4_ENOSPC);
  assert_int_equal(res.needed, 3);
  assert_int_equal(res.free, 2);
  assert_int_equal(dsv4_engine_sequences(b), 1);
  int existed;
  assert_int_equal(dsv4_engine_delete(b, "o", 1, &existed), 0);
  /* On a device backend the records are uploaded: a failed upload restores nothing. */
  if (strcmp(backend, "cpu") != 0) {
    fail_next_upload = 1;
    assert_int_equal(restore(b, "s", &sv, 0, &res), DSV4_EBACKEND);
    assert_int_equal(dsv4_engine_sequences(b), 0);
    assert_int_equal(dsv4_engine_blocks_free(b), BLOCKS);
    assert_false(dsv4_engine_healthy(b));
    dsv4_engine_destroy(b);
    b = open_engine("faulty");
  }
  assert_int_equal(restore(b, "s", &sv, 0, &res), 0);
  assert_int_equal(res.blocks, 3);
  assert_false(res.replaced);
  digests_of(b, "s", d2);
  assert_memory_equal(d2, sv.digest, sizeof(d2));
  assert_int_equal(restore(b, "s", &sv, 0, &res), DSV4_EEXIST);
  assert_int_equal(restore(b, "s", &sv, 1, &res), 0);
  assert_true(res.replaced);
  assert_int_equal(dsv4_engine_blocks_free(b), BLOCKS - 3);
  /* Records that do not reach back to the windows are refused. */
  sv.first += 1;
  assert_int_equal(restore(b, "t", &sv, 0, &res), DSV4_EINVAL);
  sv.first -= 1;
  /* The last segment replays, and the next batches are the same bytes on both engines. */
  assert_int_equal(run1(b, 0, 3, "s", 150, 1, 0, &db), 0);
  assert_int_equal(run1(a, 0, 3, "s", 150, 1, 0, &da), 0);
  assert_int_equal(da, db);
  for (int64_t p = 100; p < 151; p += 17) {
    uint32_t n = p + 17 > 151 ? (uint32_t)(151 - p) : 17;
    assert_int_equal(run1(a, 2, 10 + (uint64_t)p, "s", p, n, 0, &da), 0);
    assert_int_equal(run1(b, 2, 10 + (uint64_t)p, "s", p, n, 0, &db), 0);
    assert_int_equal(da, db);
  }
  digests_of(a, "s", sv.digest);
  digests_of(b, "s", d2);
  assert_memory_equal(d2, sv.digest, sizeof(d2));
  assert_int_equal(dsv4_engine_blocks_free(a), dsv4_engine_blocks_free(b));
  free(sv.recs[0]);
  free(sv.recs[1]);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/*
 * A chunked prefill whose one segment holds more q than one validation slice (2 MiB; here 600
 * tokens x 8 heads x 1 KiB) yields to a waiting decode while its range check and hash run, before
 * anything of it is applied, and still answers one launch's bytes. With a value out of range in
 * its last kv row it is refused after such a yield and changes nothing.
 */
static void test_chunked_validation_yields(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine_chunked(backend, 0), *b = open_engine_chunked(backend, 64);
  const char *nm[1] = {"L"}, *dn[1] = {"d"}, *bad_nm[1] = {"M"};
  const int64_t st[1] = {0};
  const uint32_t len[1] = {600}, one[1] = {1};
  const int nw[1] = {1};
  attn_batch_t pa, pb, da, db, x;
  attn_batch_make(&pa, 0, 31, 1, nm, st, len, nw);
  attn_batch_make(&pb, 0, 31, 1, nm, st, len, nw);
  attn_batch_make(&da, 0, 32, 1, dn, st, one, nw);
  attn_batch_make(&db, 0, 32, 1, dn, st, one, nw);
  yield_probe_t yb = {.e = b, .decode = &db};
  pb.b.f.yield = probe_yield;
  pb.b.f.yield_arg = &yb;
  /* On b the decode runs during the prefill's validation, before its plan: a runs them in that
   * order, so that both pools hand out the same blocks. */
  assert_int_equal(dsv4_engine_forward(a, &da.b.f), 0);
  assert_int_equal(dsv4_engine_forward(a, &pa.b.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &pb.b.f), 0);
  assert_int_equal(yb.decode_rc, 0);
  assert_int_equal(pb.b.f.chunks, (600 + 63) / 64);
  /* Two yields while validating (3 slices of q), then one between each two kernel chunks. */
  assert_int_equal(yb.calls, 2 + (600 + 63) / 64 - 1);
  same_answer(&pa, &pb);
  same_answer(&da, &db);

  uint32_t free0 = dsv4_engine_blocks_free(b), seqs0 = dsv4_engine_sequences(b);
  attn_batch_make(&x, 0, 33, 1, bad_nm, st, len, nw);
  x.b.kv[(size_t)600 * DSV4_HEAD_DIM - 1] = 0x5D00; /* |x| >= 2^59 in the last kv row */
  yield_probe_t y = {.e = b};
  x.b.f.yield = probe_yield;
  x.b.f.yield_arg = &y;
  assert_int_equal(dsv4_engine_forward(b, &x.b.f), DSV4_ERANGE);
  assert_true(y.calls >= 1);
  assert_int_equal(x.b.f.chunks, 0);
  assert_int_equal(dsv4_engine_blocks_free(b), free0);
  assert_int_equal(dsv4_engine_sequences(b), seqs0);
  attn_batch_t *all[] = {&pa, &pb, &da, &db, &x};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    attn_batch_free(all[i]);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/* A chunked batch that fails validation or its plan runs no kernel chunk and changes nothing. */
static void test_chunked_refusal_changes_nothing(void **state) {
  (void)state;
  dsv4_engine_t *e = open_engine_chunked(backend, 16), *fresh = open_engine_chunked(backend, 16);
  uint32_t free0 = dsv4_engine_blocks_free(e);
  for (int k = 0; k < 3; k++) {
    attn_batch_t x;
    yield_probe_t y = {.e = e};
    if (k < 2) {
      attn_batch_make(&x, 0, 21, 2, pf_names, pf_starts, pf_lens, pf_new);
    } else {
      /* One block more than the pool holds. */
      const uint32_t big[2] = {64 * BLOCKS - 30 + 1, 30};
      attn_batch_make(&x, 0, 21, 2, pf_names, pf_starts, big, pf_new);
    }
    x.b.f.yield = probe_yield;
    x.b.f.yield_arg = &y;
    int want = DSV4_ERANGE;
    if (k == 0) {
      x.b.kv[(size_t)130 * DSV4_HEAD_DIM - 1] = 0x5D00; /* |x| >= 2^59 in the last chunk */
    } else if (k == 1) {
      x.b.segs[1].start = 5; /* "new" may start anywhere, but "p" twice is a duplicate */
      x.b.segs[1].name = "p";
      want = DSV4_EDUPSEQ;
    } else {
      want = DSV4_ENOSPC;
    }
    assert_int_equal(dsv4_engine_forward(e, &x.b.f), want);
    /* The 995-token segment's range check and hash (7.96 MiB of q, then 0.97 MiB of kv: five
     * rounds of at most 2 MiB) yield between their rounds, before the plan finds the pool too
     * small; nothing of the batch was applied then. */
    assert_int_equal(y.calls, k == 2 ? 4 : 0);
    assert_int_equal(x.b.f.chunks, 0);
    attn_batch_free(&x);
  }
  assert_int_equal(dsv4_engine_sequences(e), 0);
  assert_int_equal(dsv4_engine_blocks_free(e), free0);
  same_batch(e, fresh, 0, 22, 2, pf_names, pf_starts, pf_lens, pf_new);
  dsv4_engine_destroy(e);
  dsv4_engine_destroy(fresh);
}

/* A device failure in a batch run between two chunks fails the chunked batch too: both batches'
 * sequences are dropped, and the blocks come back. */
static void test_chunked_device_failure(void **state) {
  (void)state;
  dsv4_engine_t *e = open_engine_chunked("faulty", 16);
  const char *dn[1] = {"d"};
  attn_batch_t p, d;
  attn_batch_make(&p, 0, 31, 2, pf_names, pf_starts, pf_lens, pf_new);
  attn_batch_make(&d, 0, 32, 1, dn, (const int64_t[]){0}, (const uint32_t[]){1}, (const int[]){1});
  yield_probe_t y = {.e = e, .decode = &d, .fail_decode = 1};
  p.b.f.yield = probe_yield;
  p.b.f.yield_arg = &y;
  assert_int_equal(dsv4_engine_forward(e, &p.b.f), DSV4_EBACKEND);
  assert_int_equal(y.decode_rc, DSV4_EBACKEND);
  assert_int_equal(y.calls, 1);
  assert_int_equal(d.b.f.n_dropped, 1);
  assert_int_equal(p.b.f.n_dropped, 2);
  assert_string_equal(p.b.f.dropped[0], "p");
  assert_string_equal(p.b.f.dropped[1], "q");
  assert_int_equal(dsv4_engine_sequences(e), 0);
  assert_int_equal(dsv4_engine_blocks_free(e), BLOCKS);
  assert_false(dsv4_engine_healthy(e));
  attn_batch_free(&p);
  attn_batch_free(&d);
  dsv4_engine_destroy(e);
}

/* A shared region goes to the backend's host_register hook once, and back; a backend without the
 * hook (the CPU) needs none and takes any region. */
static void test_host_register(void **state) {
  (void)state;
  static uint8_t region[1 << 16];
  dsv4_engine_t *f = open_engine("faulty"), *c = open_engine("cpu");
  registered_bytes = 0;
  registrations = 0;
  assert_int_equal(dsv4_engine_host_register(f, region, sizeof(region)), 0);
  assert_int_equal(registrations, 1);
  assert_int_equal(registered_bytes, sizeof(region));
  fail_next_register = 1;
  assert_int_equal(dsv4_engine_host_register(f, region, 4096), DSV4_EBACKEND);
  assert_int_equal(registrations, 1);
  dsv4_engine_host_unregister(f, region);
  assert_int_equal(registrations, 0);
  assert_int_equal(dsv4_engine_host_register(c, region, sizeof(region)), 0);
  dsv4_engine_host_unregister(c, region);
  assert_true(dsv4_engine_healthy(f) && dsv4_engine_healthy(c));
  dsv4_engine_destroy(f);
  dsv4_engine_destroy(c);
}

/* An engine serving a ratio-4 and a ratio-128 layer with their compressors (the weights drawn once
 * by c_weights), on backend name, running batches with a yield hook in chunks of chunk tokens. */
static dsv4_engine_t *open_c_engine(const char *name, uint32_t chunk) {
  static const uint32_t layers[2] = {C4_LAYER, C128_LAYER};
  const dsv4_engine_compressor_t comp[2] = {{cfx.ape4, cfx.norm4, cfx.iape, cfx.inorm},
                                            {cfx.ape128, cfx.norm128, NULL, NULL}};
  dsv4_engine_params_t p = {.backend = name,
                            .threads = 2,
                            .block_size = C_BS,
                            .kv_blocks = 512, /* sequences advance at one layer only: no release */
                            .heads = HEADS,
                            .model = &cfx.model,
                            .served_layers = layers,
                            .n_served = 2,
                            .attn_sinks = cfx.sinks,
                            .attention_mode = DSV4_ATTENTION_EXACT,
                            .compressors = comp,
                            .c4_blocks = 24,
                            .c128_blocks = 8,
                            .max_sequences = 8,
                            .prefill_chunk_tokens = chunk};
  dsv4_engine_t *e = NULL;
  char why[256] = "";
  if (dsv4_engine_create(&p, &e, why, sizeof(why)))
    fail_msg("engine on %s: %s", name, why);
  /* The branch runs on this backend: a backend without it would pass every comparison below by
   * serving the SWA part only. */
  assert_int_equal(dsv4_engine_layer_ratio(e, C4_LAYER), 4);
  assert_int_equal(dsv4_engine_layer_ratio(e, C128_LAYER), 128);
  return e;
}

/* One batch's inputs and outputs; outputs: 1 attn and lse, 2 topk (ratio 4), 3 both; with 4, q is
 * not an output (q_unwanted: a decode batch may run the fused path and leave q_out unwritten). */
typedef struct {
  batch_t b;
  float *ckv, *ikv, *iw;
  uint16_t *iq, *attn;
  float *lse;
  int32_t *topk;
} cbatch_t;

static void cbatch_make(cbatch_t *c, uint32_t layer, uint64_t seed, uint32_t n_segs,
                        const char *const *names, const int64_t *starts, const uint32_t *lens,
                        const int *is_new, int outputs) {
  memset(c, 0, sizeof(*c));
  batch_make(&c->b, layer, seed, n_segs, names, starts, lens, is_new);
  size_t n = c->b.n, w = layer == C4_LAYER ? 2048 : 1024;
  c_rng = seed * 0x2545F4914F6CDD1Dull + 1;
  /* Independent q and kv (batch_make's are correlated, which would let the window's logits
   * drown the entries' weights). */
  for (size_t i = 0; i < n * HEADS * DSV4_HEAD_DIM; i++)
    c->b.q[i] = dsv4_f32_to_bf16((float)c_unit());
  for (size_t i = 0; i < n * DSV4_HEAD_DIM; i++)
    c->b.kv[i] = dsv4_f32_to_bf16((float)c_unit());
  c->ckv = malloc(n * w * 4);
  c_fill(c->ckv, n * w, 2.0);
  c->b.f.ckv = c->ckv;
  if (layer == C4_LAYER) {
    c->ikv = malloc(n * 512 * 4);
    c->iw = malloc(n * C_IH * 4);
    c->iq = malloc(n * C_IH * 128 * 2);
    c_fill(c->ikv, n * 512, 2.0);
    c_fill(c->iw, n * C_IH, 1.0);
    for (size_t i = 0; i < n * C_IH * 128; i++)
      c->iq[i] = val(seed ^ 0x5A5A, i);
    c->b.f.ikv = c->ikv;
    c->b.f.iw = c->iw;
    c->b.f.iq = c->iq;
    if (outputs & 2) {
      c->topk = malloc(n * C_TOPK * 4);
      c->b.f.topk = c->topk;
    }
  }
  c->b.f.q_unwanted = (outputs & 4) != 0;
  if (outputs & 1) {
    c->attn = malloc(n * HEADS * 512 * 2);
    c->lse = malloc(n * HEADS * 4);
    c->b.f.attn = c->attn;
    c->b.f.lse = c->lse;
    c->b.f.attention = DSV4_ATTENTION_EXACT;
  }
}

static void cbatch_free(cbatch_t *c) {
  batch_free(&c->b);
  free(c->ckv);
  free(c->ikv);
  free(c->iw);
  free(c->iq);
  free(c->attn);
  free(c->lse);
  free(c->topk);
}

/* The first byte where two outputs differ, for a message that locates it. */
static void c_same(const void *x, const void *y, size_t n, size_t row, const char *what,
                   uint32_t layer) {
  const uint8_t *a = x, *b = y;
  for (size_t i = 0; i < n; i++)
    if (a[i] != b[i])
      fail_msg("layer %u: %s differs first at byte %zu (token %zu): %02x against %02x", layer, what,
               i, i / row, a[i], b[i]);
}

/* Two answers of one batch are equal byte for byte (the first difference named). */
static void same_c_answer(const cbatch_t *ca, const cbatch_t *cb, uint32_t layer) {
  size_t n = ca->b.n;
  if (!ca->b.f.q_unwanted)
    c_same(ca->b.q_out, cb->b.q_out, n * HEADS * 512 * 2, HEADS * 512 * 2, "q_out", layer);
  c_same(ca->b.slots, cb->b.slots, n * 8, 8, "slots", layer);
  if (ca->attn) {
    c_same(ca->attn, cb->attn, n * HEADS * 512 * 2, HEADS * 512 * 2, "attn", layer);
    c_same(ca->lse, cb->lse, n * HEADS * 4, HEADS * 4, "lse", layer);
  }
  if (ca->topk)
    c_same(ca->topk, cb->topk, n * C_TOPK * 4, C_TOPK * 4, "topk", layer);
  assert_int_equal(ca->b.f.digest, cb->b.f.digest);
  assert_int_equal(ca->b.f.replayed, cb->b.f.replayed);
}

/* A decode step of a sequence of its own, run by b's yield hook between two chunks of a batch (as
 * the executor runs a waiting decode), and on a after that batch. */
typedef struct {
  uint32_t layer;
  uint64_t seed;
  const char *name;
  int64_t start;
} c_decode_t;

typedef struct {
  dsv4_engine_t *e;
  cbatch_t *decode; /* run at the first call, or NULL */
  int rc;
  uint32_t calls;
} c_yield_t;

static void c_yield(void *arg) {
  c_yield_t *y = arg;
  if (y->calls++ == 0 && y->decode)
    y->rc = dsv4_engine_forward(y->e, &y->decode->b.f);
}

/* A check of c's tensors (q, kv, then the compressed ones of the layer's ratio) begun as if they
 * had arrived whole, or the first two thirds of each (part). */
static dsv4_check_t *c_check_fed(const cbatch_t *c, uint32_t layer, int part) {
  uint32_t lens[4];
  for (uint32_t s = 0; s < c->b.f.n_segs; s++)
    lens[s] = c->b.segs[s].len;
  const uint32_t ratio = layer == C4_LAYER ? 4 : 128;
  const dsv4_check_shape_t sh = {HEADS, ratio, C_IH};
  dsv4_check_t *k = dsv4_check_create(&sh, lens, c->b.f.n_segs);
  assert_non_null(k);
  const void *data[6] = {c->b.f.q, c->b.f.kv, c->b.f.ckv, c->b.f.ikv, c->b.f.iq, c->b.f.iw};
  const size_t n = c->b.n;
  size_t vals[6] = {n * HEADS * 512, n * 512,        n * (ratio == 4 ? 2048 : 1024),
                    n * 512,         n * C_IH * 128, n * C_IH};
  for (int t = 0; part && t < 6; t++)
    vals[t] = vals[t] * 2 / 3;
  assert_int_equal(dsv4_check_feed(k, data, vals), 0);
  return k;
}

/* same_c_batch's calls: every other one gives b its batch's check begun (c_check_fed), whole or in
 * part in turn, so that a replay meets the other path. */
static unsigned c_arrivals;

/* One batch on engines a (the CPU reference) and b (chunked when it is long, with dec between its
 * first two chunks when given): the same answers, byte for byte. */
static void same_c_batch(dsv4_engine_t *a, dsv4_engine_t *b, uint32_t layer, uint64_t seed,
                         uint32_t n_segs, const char *const *names, const int64_t *starts,
                         const uint32_t *lens, const int *is_new, int outputs,
                         const c_decode_t *dec) {
  cbatch_t ca, cb, da, db;
  cbatch_make(&ca, layer, seed, n_segs, names, starts, lens, is_new, outputs);
  cbatch_make(&cb, layer, seed, n_segs, names, starts, lens, is_new, outputs);
  c_yield_t y = {.e = b};
  if (dec) {
    const uint32_t one = 1;
    const int yes = 1;
    cbatch_make(&da, dec->layer, dec->seed, 1, &dec->name, &dec->start, &one, &yes, 3);
    cbatch_make(&db, dec->layer, dec->seed, 1, &dec->name, &dec->start, &one, &yes, 3);
    y.decode = &db;
  }
  cb.b.f.yield = c_yield;
  cb.b.f.yield_arg = &y;
  const unsigned call = c_arrivals++;
  if (call % 2)
    cb.b.f.check = c_check_fed(&cb, layer, call % 4 == 3);
  assert_int_equal(dsv4_engine_forward(a, &ca.b.f), 0);
  if (dec)
    assert_int_equal(dsv4_engine_forward(a, &da.b.f), 0);
  assert_int_equal(dsv4_engine_forward(b, &cb.b.f), 0);
  dsv4_check_free(cb.b.f.check);
  cb.b.f.check = NULL;
  same_c_answer(&ca, &cb, layer);
  if (dec) {
    assert_true(y.calls >= 1); /* b ran the batch in chunks */
    assert_int_equal(y.rc, 0);
    same_c_answer(&da, &db, dec->layer);
    cbatch_free(&da);
    cbatch_free(&db);
  }
  cbatch_free(&ca);
  cbatch_free(&cb);
}

/* Every byte of a buffer of the engine, whatever memory the backend keeps it in. */
static uint8_t *devbuf_bytes(dsv4_engine_t *e, const dsv4_devbuf_t *buf) {
  uint8_t *out = malloc(buf->size ? buf->size : 1);
  assert_non_null(out);
  if (e->be->ops->caps & DSV4_BE_HOST_MEMORY)
    memcpy(out, buf->ptr, buf->size);
  else
    assert_int_equal(e->be->ops->download(e->be, out, buf, 0, buf->size), 0);
  return out;
}

/* The rings, entry caches, index cache and SWA caches of a and b are equal. */
static void same_c_state(dsv4_engine_t *a, dsv4_engine_t *b) {
  for (uint32_t i = 0; i < 2; i++) {
    const dsv4_devbuf_t *bufs_a[4] = {&a->cache[i], &a->ring[i], &a->c_cache[i], &a->i_cache[i]};
    const dsv4_devbuf_t *bufs_b[4] = {&b->cache[i], &b->ring[i], &b->c_cache[i], &b->i_cache[i]};
    static const char *what[4] = {"SWA cache", "rings", "entry cache", "index cache"};
    for (int k = 0; k < (i == 0 ? 4 : 3); k++) {
      assert_int_equal(bufs_a[k]->size, bufs_b[k]->size);
      uint8_t *x = devbuf_bytes(a, bufs_a[k]), *y = devbuf_bytes(b, bufs_b[k]);
      c_same(x, y, bufs_a[k]->size, 1, what[k], i == 0 ? C4_LAYER : C128_LAYER);
      free(x);
      free(y);
    }
  }
}

/*
 * The compressed branch on the backend under test gives the CPU backend's bytes (on cpu, through
 * the staged CPU backend, i.e. the engine's device staging path): attn, lse, topk, q_out, slots,
 * digests (with the batch's entries and index records), and at the end every byte of the rings,
 * the entry and index caches and the SWA caches. Two sequences start at p0 > 0; prefills in chunks
 * that split windows, decode steps across emissions, a batch of two sequences at different phases,
 * replays; topk 8 of up to 40 visible entries (the scoring path), entries across blocks of 16 in
 * both pools; outputs with and without attention and topk (the selection then stays internal). On
 * b, batches longer than 32 tokens run in chunks, and between the first two chunks of the first
 * batch of each layer a decode step of another sequence of that layer runs (a runs it after).
 */
static void test_compressed_matches_cpu(void **state) {
  (void)state;
  const char *other = strcmp(backend, "cpu") ? backend : "cpu_staged";
  dsv4_engine_t *a = open_c_engine("cpu", 0), *b = open_c_engine(other, 32);
  const char *names[2] = {"c", "d"};
  const int yes[2] = {1, 1}, no[2] = {0, 0};
  /* Ratio 4: c from 0, d from p0 = 37, together, then chunks, a replay and decode steps. */
  int64_t st[2] = {0, 37};
  uint32_t len[2] = {70, 45};
  const c_decode_t g = {C4_LAYER, 2, "g", 6}, h = {C128_LAYER, 3, "h", 0};
  same_c_batch(a, b, C4_LAYER, 1, 2, names, st, len, yes, 3, &g);
  same_c_batch(a, b, C4_LAYER, 1, 2, names, st, len, no, 3, NULL); /* a replay */
  static const uint32_t chunks[][2] = {{1, 7}, {3, 1}, {23, 26}, {41, 5}};
  for (size_t k = 0; k < sizeof(chunks) / sizeof(chunks[0]); k++) {
    st[0] += len[0];
    st[1] += len[1];
    len[0] = chunks[k][0];
    len[1] = chunks[k][1];
    same_c_batch(a, b, C4_LAYER, 10 + k, 2, names, st, len, no, (int)(k % 3) + 1, NULL);
  }
  for (int k = 0; k < 9; k++) {
    st[0] += len[0];
    st[1] += len[1];
    len[0] = len[1] = 1;
    /* Every other step without q: the fused decode path where the backend offers it. */
    same_c_batch(a, b, C4_LAYER, 20 + (uint64_t)k, 2, names, st, len, no, k % 2 ? 7 : 3, NULL);
  }
  /* Ratio 128: e from 0 and f from p0 = 300 in chunks that straddle emissions, up to entries in a
   * second block (16 entries a block: position 2048 on). */
  names[0] = "e";
  names[1] = "f";
  int64_t s2[2] = {0, 300};
  uint32_t l2[2] = {130, 1};
  same_c_batch(a, b, C128_LAYER, 30, 2, names, s2, l2, yes, 1, &h);
  same_c_batch(a, b, C128_LAYER, 30, 2, names, s2, l2, no, 1, NULL); /* a replay */
  for (uint64_t k = 0; s2[0] + l2[0] < 2200; k++) {
    s2[0] += l2[0];
    s2[1] += l2[1];
    l2[0] = k % 2 ? 250 : 137;
    l2[1] = k % 2 ? 3 : 200;
    same_c_batch(a, b, C128_LAYER, 40 + k, 2, names, s2, l2, no, k % 3 ? 1 : 0, NULL);
  }
  for (int k = 0; k < 4; k++) {
    s2[0] += l2[0];
    s2[1] += l2[1];
    l2[0] = l2[1] = 1;
    same_c_batch(a, b, C128_LAYER, 60 + (uint64_t)k, 2, names, s2, l2, no, k % 2 ? 5 : 1, NULL);
  }
  same_c_state(a, b);
  if (!strcmp(other, "cpu_staged")) {
    dsv4_test_cpu_staged_stats_t sa;
    dsv4_test_cpu_staged_stats(b->be, &sa);
    assert_true(sa.launches > 0 && sa.uploads > 0 && sa.downloads > 0);
    /* The outputs and the selections come back by each batch's sync (download_async). */
    assert_true(sa.async_downloads > 0);
  }
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/*
 * The indexer runs in the batch's attention mode, also for a batch that asks for topk alone (SPEC
 * §8.9): such a batch asking for fast mode reaches the backend's indexer with fast set, one that
 * names no mode with the engine's (exact here), and the CPU selects the same entries either way.
 */
static void test_indexer_mode(void **state) {
  (void)state;
  dsv4_engine_t *a = open_c_engine("cpu", 0), *b = open_c_engine("cpu_staged", 0);
  const char *names[2] = {"c", "d"};
  const int yes[2] = {1, 1}, no[2] = {0, 0};
  int64_t st[2] = {0, 5};
  uint32_t len[2] = {120, 90}; /* 30 and 23 visible entries, topk 8: both score */
  static const int modes[3] = {DSV4_ATTENTION_FAST, DSV4_ATTENTION_DEFAULT, DSV4_ATTENTION_FAST};
  size_t fast_before = 0;
  for (int k = 0; k < 3; k++) {
    cbatch_t ca, cb;
    cbatch_make(&ca, C4_LAYER, 70 + (uint64_t)k, 2, names, st, len, k ? no : yes, 2);
    cbatch_make(&cb, C4_LAYER, 70 + (uint64_t)k, 2, names, st, len, k ? no : yes, 2);
    cb.b.f.attention = modes[k];
    assert_int_equal(dsv4_engine_forward(a, &ca.b.f), 0);
    assert_int_equal(dsv4_engine_forward(b, &cb.b.f), 0);
    same_c_answer(&ca, &cb, C4_LAYER);
    dsv4_test_cpu_staged_stats_t sb;
    dsv4_test_cpu_staged_stats(b->be, &sb);
    assert_true(sb.indexer_launches > 0);
    assert_int_equal(sb.fast_indexer_launches - fast_before, modes[k] == DSV4_ATTENTION_FAST);
    fast_before = sb.fast_indexer_launches;
    cbatch_free(&ca);
    cbatch_free(&cb);
    st[0] += len[0];
    st[1] += len[1];
    len[0] = len[1] = 1;
  }
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
}

/* ---- the range check and hashes begun as a batch arrives (dsv4_check_t) ---- */

/* SPEC §4's replay identity of segment s of b, computed here: XXH3 of its q bytes, then its kv. */
static uint64_t spec_seg_hash(const batch_t *b, uint32_t s) {
  uint32_t t0 = 0;
  for (uint32_t i = 0; i < s; i++)
    t0 += b->segs[i].len;
  const size_t q_row = (size_t)HEADS * DSV4_HEAD_DIM, len = b->segs[s].len;
  XXH3_state_t *st = XXH3_createState();
  assert_non_null(st);
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, b->q + t0 * q_row, len * q_row * 2);
  XXH3_64bits_update(st, b->kv + (size_t)t0 * DSV4_HEAD_DIM, len * DSV4_HEAD_DIM * 2);
  uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

/* The check's shape on the engines' layers 0 and 2 (no compressed branch: q and kv). */
static const dsv4_check_shape_t qkv_shape = {HEADS, 0, 0};

static int feed_qkv(dsv4_check_t *c, const uint16_t *q, size_t qv, const uint16_t *kv, size_t kvv) {
  const void *data[2] = {q, kv};
  const size_t vals[2] = {qv, kvv};
  return dsv4_check_feed(c, data, vals);
}

/* A check of b's segments fed in steps of `step` values of q and of kv, kv_first: all of kv before
 * any q, as a body whose kv tensor comes first; up to q_part and kv_part values in all. */
static dsv4_check_t *check_fed(const batch_t *b, size_t step, int kv_first, size_t q_part,
                               size_t kv_part) {
  uint32_t lens[4];
  for (uint32_t s = 0; s < b->f.n_segs; s++)
    lens[s] = b->segs[s].len;
  dsv4_check_t *c = dsv4_check_create(&qkv_shape, lens, b->f.n_segs);
  assert_non_null(c);
  size_t qv = 0, kvv = 0;
  while (qv < q_part || kvv < kv_part) {
    if (kv_first && kvv < kv_part)
      kvv = kvv + step < kv_part ? kvv + step : kv_part;
    else if (qv < q_part)
      qv = qv + step < q_part ? qv + step : q_part;
    else
      kvv = kvv + step < kv_part ? kvv + step : kv_part;
    assert_int_equal(feed_qkv(c, b->q, qv, b->kv, kvv), 0);
  }
  return c;
}

/* The hashes of a batch whose check began as it arrived (every order, whole or in part, and in a
 * chunked batch's slices) are SPEC §4's, its answer that of a batch checked by the engine alone; a
 * value out of range found on arrival refuses the batch with nothing changed; a check begun for
 * other segments is not used. */
static void test_check_on_arrival(void **state) {
  (void)state;
  const char *names[3] = {"a", "b", "c"};
  const int64_t starts[3] = {0, 0, 0};
  const uint32_t lens[3] = {3, 1, 300};
  const int nw[3] = {1, 1, 1};
  const size_t nq = (size_t)304 * HEADS * DSV4_HEAD_DIM, nk = (size_t)304 * DSV4_HEAD_DIM;
  const struct {
    size_t step, q_part, kv_part;
    int kv_first, chunked, other_lens;
  } cases[] = {
      {4096, nq, nk, 0, 0, 0},      {777, nq, nk, 1, 0, 0},       {65536, nq / 3, 0, 0, 0, 0},
      {65536, nq, nk / 2, 0, 0, 0}, {100000, nq / 2, 0, 0, 1, 0}, {4096, nq, nk, 0, 0, 1},
  };
  batch_t ref;
  batch_make(&ref, 0, 41, 3, names, starts, lens, nw);
  dsv4_engine_t *e0 = open_engine(backend);
  assert_int_equal(dsv4_engine_forward(e0, &ref.f), 0);
  for (uint32_t s = 0; s < 3; s++)
    assert_int_equal(ref.segs[s].hash, spec_seg_hash(&ref, s));
  for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
    batch_t b;
    batch_make(&b, 0, 41, 3, names, starts, lens, nw);
    const uint32_t other[2] = {4, 300};
    dsv4_check_t *c =
        check_fed(&b, cases[k].step, cases[k].kv_first, cases[k].q_part, cases[k].kv_part);
    if (cases[k].other_lens) {
      dsv4_check_free(c);
      c = dsv4_check_create(&qkv_shape, other, 2);
      assert_int_equal(feed_qkv(c, b.q, nq, b.kv, nk), 0);
    }
    /* q goes in as it comes; kv here only where all of q came (or no kv came). */
    assert_int_equal(dsv4_check_fed_bytes(c), cases[k].other_lens
                                                  ? (nq + nk) * 2
                                                  : (cases[k].q_part + cases[k].kv_part) * 2);
    dsv4_engine_t *e = cases[k].chunked ? open_engine_chunked(backend, 64) : open_engine(backend);
    b.f.check = c;
    yield_probe_t y = {.e = e};
    if (cases[k].chunked) {
      b.f.yield = probe_yield;
      b.f.yield_arg = &y;
    }
    assert_int_equal(dsv4_engine_forward(e, &b.f), 0);
    for (uint32_t s = 0; s < 3; s++)
      assert_int_equal(b.segs[s].hash, ref.segs[s].hash);
    assert_int_equal(b.f.digest, ref.f.digest);
    assert_memory_equal(b.q_out, ref.q_out, nq * 2);
    if (cases[k].chunked)
      assert_true(y.calls >= 1); /* the rest of q took more than one slice */
    dsv4_check_free(c);
    batch_free(&b);
    dsv4_engine_destroy(e);
  }
  /* Out of range in the last segment's q, found on arrival: refused, nothing changed. */
  batch_t x;
  batch_make(&x, 0, 41, 3, names, starts, lens, nw);
  x.q[nq - 5] = 0x5D00;
  dsv4_check_t *c = dsv4_check_create(&qkv_shape, lens, 3);
  assert_int_equal(feed_qkv(c, x.q, nq / 2, x.kv, 0), 0);
  assert_int_equal(feed_qkv(c, x.q, nq, x.kv, 0), 1);
  assert_int_equal(feed_qkv(c, x.q, nq, x.kv, nk), 1);
  dsv4_engine_t *e = open_engine(backend);
  x.f.check = c;
  assert_int_equal(dsv4_engine_forward(e, &x.f), DSV4_ERANGE);
  assert_int_equal(dsv4_engine_sequences(e), 0);
  assert_int_equal(dsv4_engine_blocks_free(e), BLOCKS);
  dsv4_check_free(c);
  batch_free(&x);
  dsv4_engine_destroy(e);
  dsv4_engine_destroy(e0);
  batch_free(&ref);
}

int main(int argc, char **argv) {
  int skip = dsv4_test_backend_from_args(argc, argv, &backend);
  if (skip)
    return skip;
  print_message("backend under test: %s\n", backend);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_prefill_decode_deterministic),
      cmocka_unit_test(test_bf16_range_check_every_position),
      cmocka_unit_test(test_range_check_f32_and_limits),
      cmocka_unit_test(test_refused_batch_changes_nothing),
      cmocka_unit_test(test_replay),
      cmocka_unit_test(test_device_failure_drops_batch),
      cmocka_unit_test(test_overlap_failure_drops_both),
      cmocka_unit_test(test_restore),
      cmocka_unit_test(test_staged_matches_cpu),
      cmocka_unit_test(test_compressed_matches_cpu),
      cmocka_unit_test(test_indexer_mode),
      cmocka_unit_test(test_chunked_prefill_matches_one_launch),
      cmocka_unit_test(test_chunks_alone),
      cmocka_unit_test(test_fused_decode),
      cmocka_unit_test(test_chunked_refusal_changes_nothing),
      cmocka_unit_test(test_chunked_validation_yields),
      cmocka_unit_test(test_chunked_device_failure),
      cmocka_unit_test(test_host_register),
      cmocka_unit_test(test_in_place_matches_cpu),
      cmocka_unit_test(test_q_half_first),
      cmocka_unit_test(test_q_half_first_beside_flight),
      cmocka_unit_test(test_check_on_arrival),
      cmocka_unit_test(test_in_place_limit),
      cmocka_unit_test(test_cache_flush),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
