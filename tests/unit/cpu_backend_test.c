/*
 * The CPU backend against SPEC §2-3. The model below is written per element from the SPEC text and
 * shares only the codecs of dsv4-numerics.h (bf16, e4m3, the UE8M0 exponent and 2^-e) with the code
 * under test; every kernel level the machine supports is checked against it bit for bit.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "cpu/cpu-internal.h"
#include "cpu/cpu_backend.h"
#include "dsv4-numerics.h"
#include "rope.h"

#define MAXPOS DSV4_MAX_POSITION_DEFAULT
#define CANARY 0xA5

/* ---- deterministic random numbers ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(void) {
  uint64_t x = rng_state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  rng_state = x;
  return x * 0x2545F4914F6CDD1Dull;
}

static uint32_t rnd_below(uint32_t n) {
  return (uint32_t)(rnd() % n);
}

/*
 * A bf16 vector whose magnitudes spread over many octaves around a random centre, with zeros,
 * negative zeros and bf16 subnormals mixed in, so that e4m3 subnormals, ties and the UE8M0
 * boundaries all occur. Magnitudes stay below 2^59 (SPEC §6 refuses larger inputs).
 */
static void fill_bf16(uint16_t *v, size_t n) {
  int centre = 127 + (int)rnd_below(70) - 40;
  int spread = 1 + (int)rnd_below(24);
  uint32_t mode = rnd_below(16);
  for (size_t i = 0; i < n; i++) {
    uint16_t sign = (uint16_t)(rnd() & 1 ? 0x8000u : 0u);
    uint32_t k = rnd_below(64);
    if (mode == 0 && i % DSV4_TILE < 40) { /* tiles whose maximum is below the 1e-4 floor */
      v[i] = (uint16_t)(sign | ((uint32_t)(127 - 16 - rnd_below(20)) << 7) | rnd_below(128));
      continue;
    }
    if (k == 0) {
      v[i] = sign;
    } else if (k == 1) {
      v[i] = (uint16_t)(sign | (1 + rnd_below(127))); /* bf16 subnormal */
    } else {
      int e = centre + (int)rnd_below((uint32_t)(2 * spread + 1)) - spread;
      if (e < 1)
        e = 1;
      if (e > 127 + 58)
        e = 127 + 58;
      v[i] = (uint16_t)(sign | ((uint32_t)e << 7) | rnd_below(128));
    }
  }
}

/* ---- the model of SPEC §2, one element at a time ---- */

static float model_rms(const float *x, float eps) {
  float partial[32];
  for (int l = 0; l < 32; l++) {
    partial[l] = +0.0f;
    for (int k = 0; k < 16; k++)
      partial[l] = fmaf(x[16 * l + k], x[16 * l + k], partial[l]);
  }
  for (int step = 16; step >= 1; step /= 2)
    for (int l = 0; l < step; l++)
      partial[l] = partial[l] + partial[l + step];
  float t = partial[0] * 0x1p-9f;
  t = t + eps;
  return 1.0f / sqrtf(t);
}

static void model_q(const uint16_t *q, const float *row, float eps, uint16_t *out) {
  float y[512];
  for (int d = 0; d < 512; d++)
    y[d] = dsv4_bf16_to_f32(q[d]);
  float r = model_rms(y, eps);
  for (int d = 0; d < 512; d++)
    y[d] = y[d] * r;
  for (int d = 0; d < 448; d++)
    out[d] = dsv4_f32_to_bf16(y[d]);
  for (int i = 0; i < 32; i++) {
    float e = y[448 + 2 * i], o = y[449 + 2 * i], c = row[i], s = row[32 + i];
    out[448 + 2 * i] = dsv4_f32_to_bf16(fmaf(e, c, -(o * s)));
    out[449 + 2 * i] = dsv4_f32_to_bf16(fmaf(e, s, o * c));
  }
}

/* Writes the token's 576 data bytes and 8 scale bytes into the paged cache at slot. */
static void model_kv(const uint16_t *kv, const float *row, const float *w, float eps,
                     uint8_t *cache, uint32_t bs, int64_t slot) {
  float z[512];
  for (int d = 0; d < 512; d++)
    z[d] = dsv4_bf16_to_f32(kv[d]);
  if (w) {
    float r = model_rms(z, eps);
    for (int d = 0; d < 512; d++)
      z[d] = dsv4_bf16_to_f32(dsv4_f32_to_bf16((z[d] * r) * w[d]));
  }
  uint16_t rope[64];
  for (int i = 0; i < 32; i++) {
    float e = z[448 + 2 * i], o = z[449 + 2 * i], c = row[i], s = row[32 + i];
    rope[2 * i] = dsv4_f32_to_bf16(fmaf(e, c, -(o * s)));
    rope[2 * i + 1] = dsv4_f32_to_bf16(fmaf(e, s, o * c));
  }
  uint64_t block = (uint64_t)slot / bs, off = (uint64_t)slot % bs;
  uint8_t *blk = cache + block * DSV4_BLOCK_STRIDE(bs);
  uint8_t *data = blk + 576 * off;
  uint8_t *scales = blk + 576 * (uint64_t)bs + 8 * off;
  for (int j = 0; j < 7; j++) {
    float amax = 0.0f;
    for (int k = 0; k < 64; k++)
      if (fabsf(z[64 * j + k]) > amax)
        amax = fabsf(z[64 * j + k]);
    if (amax < 1e-4f)
      amax = 1e-4f;
    int e = dsv4_ue8m0_exponent(amax);
    /* The SPEC's own statement of e: the smallest integer with amax <= 448 * 2^e. */
    assert_true(amax <= ldexpf(448.0f, e));
    assert_true(amax > ldexpf(448.0f, e - 1));
    for (int k = 0; k < 64; k++)
      data[64 * j + k] = dsv4_f32_to_e4m3(ldexpf(z[64 * j + k], -e));
    scales[j] = (uint8_t)(e + 127);
  }
  scales[7] = 0;
  for (int i = 0; i < 64; i++) {
    data[448 + 2 * i] = (uint8_t)(rope[i] & 0xff);
    data[449 + 2 * i] = (uint8_t)(rope[i] >> 8);
  }
}

/* ---- batches ---- */

typedef struct {
  uint32_t n, heads, bs, n_blocks;
  uint16_t *q, *kv, *q_out;
  int64_t *pos, *slots;
  float *w; /* NULL: prenormed */
  dsv4_rope_table_t *rope;
  uint8_t *cache; /* canary-filled */
  size_t cache_bytes;
  int write_kv;
} batch_t;

static dsv4_rope_table_t *table_plain, *table_yarn;

static int setup_tables(void **state) {
  (void)state;
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, f);
  if (dsv4_rope_table_create(f, MAXPOS, &table_plain))
    return -1;
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, f);
  if (dsv4_rope_table_create(f, MAXPOS, &table_yarn))
    return -1;
  return 0;
}

static int teardown_tables(void **state) {
  (void)state;
  dsv4_rope_table_destroy(table_plain);
  dsv4_rope_table_destroy(table_yarn);
  return 0;
}

static void batch_random(batch_t *b, uint32_t n, uint32_t heads, int fused, int yarn) {
  static const uint32_t sizes[] = {16, 64, 256};
  memset(b, 0, sizeof(*b));
  b->n = n;
  b->heads = heads;
  b->bs = sizes[rnd_below(3)];
  b->n_blocks = (n + b->bs - 1) / b->bs * 2 + 1;
  b->q = malloc((size_t)n * heads * 512 * 2);
  b->q_out = malloc((size_t)n * heads * 512 * 2);
  b->kv = malloc((size_t)n * 512 * 2);
  b->pos = malloc(n * sizeof(int64_t));
  b->slots = malloc(n * sizeof(int64_t));
  assert_non_null(b->q);
  assert_non_null(b->q_out);
  assert_non_null(b->kv);
  assert_non_null(b->pos);
  assert_non_null(b->slots);
  for (size_t i = 0; i < (size_t)n * heads; i++)
    fill_bf16(b->q + i * 512, 512);
  for (size_t i = 0; i < n; i++)
    fill_bf16(b->kv + i * 512, 512);
  /* Positions: a contiguous run near the start or near the last admissible position. */
  int64_t p0 = rnd_below(2) ? (int64_t)rnd_below(5000) : (int64_t)MAXPOS - n - rnd_below(300);
  for (uint32_t t = 0; t < n; t++)
    b->pos[t] = p0 + t;
  /* Slots: a random permutation of distinct slots, about one token in eight without one. */
  uint64_t nslots = (uint64_t)b->n_blocks * b->bs;
  uint64_t *perm = malloc(nslots * sizeof(uint64_t));
  assert_non_null(perm);
  for (uint64_t i = 0; i < nslots; i++)
    perm[i] = i;
  for (uint64_t i = nslots - 1; i > 0; i--) {
    uint64_t k = rnd() % (i + 1), tmp = perm[i];
    perm[i] = perm[k];
    perm[k] = tmp;
  }
  for (uint32_t t = 0; t < n; t++)
    b->slots[t] = rnd_below(8) == 0 ? -1 : (int64_t)perm[t];
  free(perm);
  if (fused) {
    b->w = malloc(512 * sizeof(float));
    assert_non_null(b->w);
    for (int d = 0; d < 512; d++)
      b->w[d] = dsv4_u2f(0x3f000000u + (uint32_t)(rnd() % 0x1000000u)) *
                (rnd_below(16) == 0 ? -1.0f : 1.0f);
  }
  b->rope = yarn ? table_yarn : table_plain;
  assert_int_equal(dsv4_rope_table_ensure(b->rope, b->pos, n), 0);
  b->cache_bytes = (size_t)b->n_blocks * DSV4_BLOCK_STRIDE(b->bs);
  b->cache = malloc(b->cache_bytes);
  assert_non_null(b->cache);
  memset(b->cache, CANARY, b->cache_bytes);
  b->write_kv = 1;
}

static void batch_free(batch_t *b) {
  free(b->q);
  free(b->q_out);
  free(b->kv);
  free(b->pos);
  free(b->slots);
  free(b->w);
  free(b->cache);
}

static dsv4_insert_args_t batch_args(const batch_t *b, uint16_t *q_out, uint8_t *cache) {
  dsv4_insert_args_t a = {
      .n_tokens = b->n,
      .heads = b->heads,
      .q = b->q,
      .kv = b->kv,
      .positions = b->pos,
      .slots = b->slots,
      .rope = b->rope,
      .kv_norm_weight = b->w,
      .eps = dsv4_u2f(DSV4_RMS_EPS_BITS),
      .write_kv = b->write_kv,
      .q_out = q_out,
      .cache = cache,
      .block_size = b->bs,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(b->bs),
  };
  return a;
}

/* The model's q_out and cache for a batch (the cache starts as a copy of the batch's canary cache).
 */
static void model_batch(const batch_t *b, uint16_t *q_out, uint8_t *cache) {
  float eps = dsv4_u2f(DSV4_RMS_EPS_BITS);
  memcpy(cache, b->cache, b->cache_bytes);
  for (uint32_t t = 0; t < b->n; t++) {
    const float *row = dsv4_rope_table_row(b->rope, b->pos[t]);
    for (uint32_t h = 0; h < b->heads; h++) {
      size_t off = ((size_t)t * b->heads + h) * 512;
      model_q(b->q + off, row, eps, q_out + off);
    }
    if (b->write_kv && b->slots[t] >= 0)
      model_kv(b->kv + (size_t)t * 512, row, b->w, eps, cache, b->bs, b->slots[t]);
  }
}

static dsv4_backend_t *open_cpu(uint32_t threads) {
  dsv4_backend_options_t opt = {.threads = threads};
  dsv4_backend_t *be = NULL;
  char why[128];
  assert_int_equal(dsv4_backend_open("cpu", &opt, &be, why, sizeof(why)), 0);
  assert_non_null(be);
  assert_string_equal(be->ops->name, "cpu");
  assert_true(be->ops->caps & DSV4_BE_HOST_MEMORY);
  return be;
}

/* Runs the batch on be into fresh output buffers (cache copied from the canary cache). */
static void run_backend(dsv4_backend_t *be, const batch_t *b, uint16_t *q_out, uint8_t *cache) {
  memcpy(cache, b->cache, b->cache_bytes);
  memset(q_out, 0x5A, (size_t)b->n * b->heads * 1024);
  dsv4_insert_args_t a = batch_args(b, q_out, cache);
  assert_int_equal(be->ops->qkv_insert(be, &a), 0);
  assert_int_equal(be->ops->sync(be), 0);
}

static const int isas[] = {DSV4__CPU_ISA_SCALAR, DSV4__CPU_ISA_AVX2, DSV4__CPU_ISA_AVX512};

/* ---- tests ---- */

/* SPEC §2's subnormal test vector. */
static void test_spec_vector(void **state) {
  (void)state;
  int64_t pos = 5;
  assert_int_equal(dsv4_rope_table_ensure(table_plain, &pos, 1), 0);
  for (size_t k = 0; k < sizeof(isas) / sizeof(isas[0]); k++) {
    if (!dsv4__cpu_isa_supported(isas[k]))
      continue;
    dsv4_backend_t *be = open_cpu(1);
    assert_int_equal(dsv4__cpu_backend_set_isa(be, isas[k]), 0);
    uint16_t q[512] = {0x0001, 0x8001, 0x0080}, kv[512] = {0}, out[512];
    int64_t slot = -1;
    dsv4_insert_args_t a = {.n_tokens = 1,
                            .heads = 1,
                            .q = q,
                            .kv = kv,
                            .positions = &pos,
                            .slots = &slot,
                            .rope = table_plain,
                            .eps = dsv4_u2f(DSV4_RMS_EPS_BITS),
                            .write_kv = 0,
                            .q_out = out};
    assert_int_equal(be->ops->qkv_insert(be, &a), 0);
    assert_int_equal(out[0], 0x01FA);
    assert_int_equal(out[1], 0x81FA);
    assert_int_equal(out[2], 0x057A);
    for (int d = 3; d < 512; d++)
      assert_int_equal(out[d] & 0x7fff, 0);
    dsv4_backend_close(be);
  }
}

static void check_against_model(uint32_t n, uint32_t heads, int fused, int yarn) {
  batch_t b;
  batch_random(&b, n, heads, fused, yarn);
  /* q_out 64-byte aligned, so the non-temporal path can be taken. */
  size_t qbytes = ((size_t)n * heads * 1024 + 63) / 64 * 64;
  uint16_t *mq = malloc(qbytes), *bq = aligned_alloc(64, qbytes);
  uint8_t *mc = malloc(b.cache_bytes), *bc = malloc(b.cache_bytes);
  assert_true(mq && bq && mc && bc);
  model_batch(&b, mq, mc);
  for (size_t k = 0; k < sizeof(isas) / sizeof(isas[0]); k++) {
    if (!dsv4__cpu_isa_supported(isas[k]))
      continue;
    /* Cached stores, then non-temporal stores for every launch. */
    for (int stream = 0; stream < 2; stream++) {
      dsv4_backend_t *be = open_cpu(2);
      assert_int_equal(dsv4__cpu_backend_set_isa(be, isas[k]), 0);
      dsv4__cpu_backend_set_stream_bytes(be, stream ? 0 : UINT64_MAX);
      run_backend(be, &b, bq, bc);
      for (size_t i = 0; i < (size_t)n * heads * 512; i++)
        if (mq[i] != bq[i])
          fail_msg("isa %s stream %d n %u h %u fused %d yarn %d: q_out[%zu] = %04x, model %04x",
                   dsv4__cpu_isa_name(isas[k]), stream, n, heads, fused, yarn, i, bq[i], mq[i]);
      for (size_t i = 0; i < b.cache_bytes; i++)
        if (mc[i] != bc[i])
          fail_msg("isa %s n %u h %u fused %d yarn %d bs %u: cache byte %zu = %02x, model %02x",
                   dsv4__cpu_isa_name(isas[k]), n, heads, fused, yarn, b.bs, i, bc[i], mc[i]);
      dsv4_backend_close(be);
    }
  }
  free(mq);
  free(bq);
  free(mc);
  free(bc);
  batch_free(&b);
}

static void test_random_batches(void **state) {
  (void)state;
  static const uint32_t heads[] = {1, 8, 64, 128};
  for (int round = 0; round < 3; round++)
    for (size_t h = 0; h < 4; h++)
      for (int fused = 0; fused < 2; fused++)
        for (int yarn = 0; yarn < 2; yarn++) {
          uint32_t n = heads[h] >= 64 ? 1 + rnd_below(40) : 1 + rnd_below(300);
          check_against_model(n, heads[h], fused, yarn);
        }
  /* The extremes of the token count. */
  check_against_model(1, 64, 1, 0);
  check_against_model(300, 8, 1, 1);
  check_against_model(300, 1, 0, 1);
}

/* Slot -1 rows and write_kv = 0 leave the cache alone; written records end in a zero pad byte. */
static void test_cache_untouched(void **state) {
  (void)state;
  batch_t b;
  batch_random(&b, 200, 4, 1, 0);
  uint16_t *q = malloc((size_t)b.n * b.heads * 1024);
  uint8_t *c = malloc(b.cache_bytes);
  assert_true(q && c);
  dsv4_backend_t *be = open_cpu(2);
  b.write_kv = 0;
  run_backend(be, &b, q, c);
  assert_memory_equal(c, b.cache, b.cache_bytes);
  b.write_kv = 1;
  run_backend(be, &b, q, c);
  uint64_t stride = DSV4_BLOCK_STRIDE(b.bs);
  uint8_t *written = calloc((size_t)b.n_blocks * b.bs, 1);
  assert_non_null(written);
  for (uint32_t t = 0; t < b.n; t++)
    if (b.slots[t] >= 0)
      written[b.slots[t]] = 1;
  for (uint64_t s = 0; s < (uint64_t)b.n_blocks * b.bs; s++) {
    uint8_t *blk = c + s / b.bs * stride;
    uint8_t *data = blk + 576 * (s % b.bs), *sc = blk + 576 * b.bs + 8 * (s % b.bs);
    if (written[s]) {
      assert_int_equal(sc[7], 0);
      for (int j = 0; j < 7; j++)
        assert_true(sc[j] >= 105 && sc[j] <= 247);
    } else {
      for (int i = 0; i < 576; i++)
        assert_int_equal(data[i], CANARY);
      for (int i = 0; i < 8; i++)
        assert_int_equal(sc[i], CANARY);
    }
  }
  for (uint32_t blk = 0; blk < b.n_blocks; blk++)
    for (uint64_t i = 584 * (uint64_t)b.bs; i < stride; i++)
      assert_int_equal(c[blk * stride + i], CANARY);
  free(written);
  dsv4_backend_close(be);
  free(q);
  free(c);
  batch_free(&b);
}

/* 1, 2 and 4 threads give the same bytes, and so do 20 runs in a row. */
static void test_threads_and_repeats(void **state) {
  (void)state;
  static const uint32_t ns[] = {1, 3, 37, 260};
  for (size_t k = 0; k < 4; k++) {
    batch_t b;
    batch_random(&b, ns[k], 64, (int)(k & 1), (int)(k >> 1));
    size_t qbytes = (size_t)b.n * b.heads * 1024;
    uint16_t *q0 = malloc(qbytes), *q1 = malloc(qbytes);
    uint8_t *c0 = malloc(b.cache_bytes), *c1 = malloc(b.cache_bytes);
    assert_true(q0 && q1 && c0 && c1);
    dsv4_backend_t *be1 = open_cpu(1);
    assert_int_equal(dsv4__cpu_backend_workers(be1), 0);
    run_backend(be1, &b, q0, c0);
    dsv4_backend_close(be1);
    static const uint32_t threads[] = {2, 4};
    for (size_t t = 0; t < 2; t++) {
      dsv4_backend_t *be = open_cpu(threads[t]);
      assert_int_equal(dsv4__cpu_backend_workers(be), threads[t] - 1);
      int runs = t == 0 ? 20 : 3;
      for (int r = 0; r < runs; r++) {
        run_backend(be, &b, q1, c1);
        assert_memory_equal(q0, q1, qbytes);
        assert_memory_equal(c0, c1, b.cache_bytes);
      }
      dsv4_backend_close(be);
    }
    free(q0);
    free(q1);
    free(c0);
    free(c1);
    batch_free(&b);
  }
}

static void test_map_slots(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cpu(2);
  /* Segment 0 maps logical blocks 3..5 to 7, -1, 2; segment 1 maps logical blocks 0..1 to 0, 9. */
  const int32_t table[] = {7, -1, 2, 0, 9};
  const int64_t first_lb[] = {3, 0};
  const uint32_t bt_off[] = {0, 3}, bt_len[] = {3, 2};
  const int64_t pos[] = {48, 63, 64, 95, 96, 111, 112, 47, 0, 17, 31, 32, 5};
  const int32_t seg[] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1};
  /* bs 16: 48 -> lb 3 -> block 7; 64 -> lb 4 -> -1; 96..112 -> lb 6..7, beyond the segment;
   * 47 -> lb 2, before it; 32 -> lb 2 of segment 1, beyond its two entries. */
  const int64_t want[] = {7 * 16, 7 * 16 + 15, -1,         2 * 16 + 15, -1, -1, -1,
                          -1,     0,           9 * 16 + 1, 9 * 16 + 15, -1, 5};
  int64_t slots[13];
  memset(slots, 0x77, sizeof(slots));
  dsv4_map_args_t a = {.n_tokens = 13,
                       .n_segments = 2,
                       .block_size = 16,
                       .n_blocks = 10,
                       .positions = pos,
                       .tok_seg = seg,
                       .seg_first_lb = first_lb,
                       .seg_bt_off = bt_off,
                       .seg_bt_len = bt_len,
                       .block_table = table,
                       .slots = slots};
  assert_int_equal(be->ops->map_slots(be, &a), 0);
  for (int t = 0; t < 13; t++)
    assert_int_equal(slots[t], want[t]);
  /* Position 96 at bs 32 is logical block 3, entry 0 of segment 0 -> block 7, offset 0. */
  a.block_size = 32;
  assert_int_equal(be->ops->map_slots(be, &a), 0);
  assert_int_equal(slots[4], 7 * 32);
  assert_int_equal(slots[0], -1); /* 48 at bs 32 is logical block 1, before segment 0 */
  /* A block id beyond the pool, a bad segment index and a bad block size are refused. */
  a.block_size = 16;
  a.n_blocks = 8;
  assert_int_equal(be->ops->map_slots(be, &a), DSV4_EINVAL);
  a.n_blocks = 10;
  int32_t badseg[13];
  memcpy(badseg, seg, sizeof(badseg));
  badseg[3] = 2;
  a.tok_seg = badseg;
  assert_int_equal(be->ops->map_slots(be, &a), DSV4_EINVAL);
  a.tok_seg = seg;
  /* The table's length, when given: exactly the five entries are accepted, four are not. */
  a.bt_entries = 5;
  assert_int_equal(be->ops->map_slots(be, &a), 0);
  assert_int_equal(slots[9], 9 * 16 + 1);
  memset(slots, 0x77, sizeof(slots));
  a.bt_entries = 4;
  assert_int_equal(be->ops->map_slots(be, &a), DSV4_EINVAL);
  assert_int_equal(slots[0], 0x7777777777777777ll);
  a.bt_entries = 0;
  /* A table length needs a table, even with no segment to map. */
  dsv4_map_args_t none = a;
  none.n_segments = 0;
  none.block_table = NULL;
  assert_int_equal(dsv4_backend_check_map_args(&none), 0);
  none.bt_entries = 5;
  assert_int_equal(dsv4_backend_check_map_args(&none), DSV4_EINVAL);
  a.block_size = 24;
  assert_int_equal(be->ops->map_slots(be, &a), DSV4_EINVAL);
  dsv4_backend_close(be);
}

/* A slot beyond the pool is refused before anything is written. */
static void test_bad_slot_refused(void **state) {
  (void)state;
  batch_t b;
  batch_random(&b, 20, 2, 0, 0);
  b.slots[19] = (int64_t)b.n_blocks * b.bs;
  uint16_t *q = malloc((size_t)b.n * b.heads * 1024);
  uint8_t *c = malloc(b.cache_bytes);
  assert_true(q && c);
  memcpy(c, b.cache, b.cache_bytes);
  dsv4_backend_t *be = open_cpu(2);
  dsv4_insert_args_t a = batch_args(&b, q, c);
  assert_int_equal(be->ops->qkv_insert(be, &a), DSV4_EINVAL);
  assert_memory_equal(c, b.cache, b.cache_bytes);
  a.stride += 576;
  a.slots = b.slots;
  b.slots[19] = -1;
  assert_int_equal(be->ops->qkv_insert(be, &a), DSV4_EINVAL);
  dsv4_backend_close(be);
  free(q);
  free(c);
  batch_free(&b);
}

static void test_buffers(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cpu(1);
  dsv4_devbuf_t buf;
  assert_int_equal(be->ops->buf_alloc(be, 100000, &buf), 0);
  assert_int_equal((uintptr_t)buf.ptr % 64, 0);
  for (size_t i = 0; i < buf.size; i++)
    assert_int_equal(((uint8_t *)buf.ptr)[i], 0);
  uint8_t src[300], dst[300];
  for (int i = 0; i < 300; i++)
    src[i] = (uint8_t)(i * 7);
  assert_int_equal(be->ops->upload(be, &buf, 99700, src, 300), 0);
  assert_int_equal(be->ops->download(be, dst, &buf, 99700, 300), 0);
  assert_memory_equal(src, dst, 300);
  assert_int_equal(be->ops->upload(be, &buf, 99701, src, 300), DSV4_EINVAL);
  assert_int_equal(be->ops->download(be, dst, &buf, 100001, 0), DSV4_EINVAL);
  be->ops->buf_free(be, &buf);
  assert_null(buf.ptr);
  dsv4_backend_close(be);
}

/* Worker threads start with flush-to-zero and denormals-are-zero off (SPEC §2). */
static void test_worker_mxcsr(void **state) {
  (void)state;
  dsv4_backend_t *be = open_cpu(4);
  assert_int_equal(dsv4__cpu_backend_workers(be), 3);
#if defined(__x86_64__) || defined(__i386__)
  for (unsigned w = 0; w < 3; w++) {
    unsigned csr = dsv4__cpu_backend_worker_mxcsr(be, w);
    assert_int_equal(csr & 0x8040u, 0);
    /* The round-to-nearest mode, the only one SPEC §2 uses. */
    assert_int_equal(csr & 0x6000u, 0);
    /* The default exception masks are set, so a recorded MXCSR is not simply zero. */
    assert_int_equal(csr & 0x1f80u, 0x1f80u);
  }
#endif
  dsv4_backend_close(be);
}

/*
 * A machine with AVX2 or AVX-512 runs (and so tests) those kernels: no level is skipped silently.
 * The best level is AVX-512 where it exists, else AVX2, and every supported level can be forced.
 */
static void test_isa_levels(void **state) {
  (void)state;
  assert_true(dsv4__cpu_isa_supported(DSV4__CPU_ISA_SCALAR));
  assert_int_equal(sizeof(isas) / sizeof(isas[0]), DSV4__CPU_ISA_COUNT);
#if defined(__x86_64__)
  __builtin_cpu_init();
  int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  assert_int_equal(dsv4__cpu_isa_supported(DSV4__CPU_ISA_AVX512), avx512);
  assert_int_equal(dsv4__cpu_isa_supported(DSV4__CPU_ISA_AVX2), avx2);
  assert_int_equal(dsv4__cpu_isa_best(), avx512 ? DSV4__CPU_ISA_AVX512
                                         : avx2 ? DSV4__CPU_ISA_AVX2
                                                : DSV4__CPU_ISA_SCALAR);
  if (!avx2)
    print_message("this CPU has no AVX2 + FMA: the AVX2 kernels were not checked\n");
  if (!avx512)
    print_message("this CPU has no AVX-512: the AVX-512 kernels were not checked\n");
#endif
  assert_string_equal(dsv4__cpu_isa_name(DSV4__CPU_ISA_SCALAR), "scalar");
  assert_string_equal(dsv4__cpu_isa_name(DSV4__CPU_ISA_AVX2), "avx2");
  assert_string_equal(dsv4__cpu_isa_name(DSV4__CPU_ISA_AVX512), "avx512");
  dsv4_backend_t *be = open_cpu(1);
  for (int isa = 0; isa < DSV4__CPU_ISA_COUNT; isa++)
    assert_int_equal(dsv4__cpu_backend_set_isa(be, isa),
                     dsv4__cpu_isa_supported(isa) ? 0 : DSV4_EUNSUPPORTED);
  assert_int_equal(dsv4__cpu_backend_set_isa(be, 99), DSV4_EUNSUPPORTED);
  assert_int_equal(dsv4__cpu_backend_set_isa(be, DSV4__CPU_ISA_COUNT), DSV4_EUNSUPPORTED);
  dsv4_backend_close(be);
}

/*
 * Inputs the random batches avoid, straight into the per-token kernels of every level, compared
 * with the scalar level byte for byte: q heads of arbitrary admissible bf16 bit patterns (SPEC §6:
 * |x| < 2^59, so no Inf or NaN, whose payloads IEEE leaves open; huge, tiny and subnormal values
 * side by side), and kv tokens with magnitudes across the same range, whole tiles of subnormals or
 * zeros, and values on the e4m3 rounding boundaries. Every fourth round also gives a few q heads
 * values beyond the range (up to the largest finite bf16, Inf, NaN), and every eighth round runs
 * the q heads with a NaN eps whose payload fills the mantissa: their outputs must match too, except
 * that any NaN matches any NaN.
 */
static int bf16_same(uint16_t a, uint16_t b) {
  return a == b || ((a & 0x7fffu) > 0x7f80u && (b & 0x7fffu) > 0x7f80u);
}

static void test_levels_edge_values(void **state) {
  (void)state;
  enum { HEADS = 24, ROUNDS = 400 };
  static _Alignas(64) uint16_t q[HEADS * 512], ref_q[HEADS * 512], out_q[HEADS * 512];
  uint16_t kv[512];
  float w[512], row[64];
  uint8_t ref_d[576], ref_s[8], out_d[576], out_s[8];
  float eps = dsv4_u2f(DSV4_RMS_EPS_BITS);
  size_t checked = 0;
  for (int round = 0; round < ROUNDS; round++) {
    for (int i = 0; i < 64; i++)
      row[i] =
          dsv4_u2f(0x3f000000u + (uint32_t)(rnd() % 0x1000000u)) * (rnd_below(2) ? -1.0f : 1.0f);
    for (size_t i = 0; i < HEADS * 512; i++)
      q[i] = (uint16_t)((rnd() & 0x8000u) | rnd_below(DSV4_BF16_LIMIT_BITS));
    /* Some heads of ordinary values, so that not every factor is NaN or zero. */
    for (int h = 0; h < HEADS; h += 3)
      fill_bf16(q + h * 512, 512);
    for (int h = 1; round % 4 == 0 && h < HEADS; h += 5)
      for (int k = 0; k < 3; k++)
        q[h * 512 + rnd_below(512)] =
            (uint16_t)(DSV4_BF16_LIMIT_BITS + rnd_below(0x10000u - DSV4_BF16_LIMIT_BITS));
    uint32_t mode = rnd_below(4);
    for (int d = 0; d < 512; d++) {
      uint16_t sign = (uint16_t)(rnd() & 1 ? 0x8000u : 0u);
      uint32_t e = mode == 0 ? 1 + rnd_below(127 + 58) : 127 - 10 + rnd_below(20);
      uint32_t m = rnd_below(128);
      if (mode == 1 && d % 64 < 60) /* e4m3 ties and midpoints: mantissa bits below the top 3 */
        m = (m & 0x70u) | (rnd_below(2) ? 0x08u : 0x00u);
      if (mode == 2 && (d / 64) % 2 == 0)
        e = rnd_below(3) ? 0 : 1; /* tiles of bf16 subnormals and zeros, below the amax floor */
      kv[d] = (uint16_t)(sign | (e << 7) | m);
      w[d] = dsv4_u2f(0x3e000000u + (uint32_t)(rnd() % 0x3000000u));
    }
    float q_eps = round % 8 == 4 ? dsv4_u2f(0x7fffffffu) : eps;
    dsv4__cpu_q_heads(DSV4__CPU_ISA_SCALAR, q, ref_q, HEADS, row, q_eps, 0);
    const float *wsel = round % 2 ? w : NULL;
    dsv4__cpu_kv_token(DSV4__CPU_ISA_SCALAR, kv, row, wsel, eps, ref_d, ref_s);
    for (int isa = DSV4__CPU_ISA_SCALAR + 1; isa < DSV4__CPU_ISA_COUNT; isa++) {
      if (!dsv4__cpu_isa_supported(isa))
        continue;
      memset(out_q, 0x5A, sizeof(out_q));
      dsv4__cpu_q_heads(isa, q, out_q, HEADS, row, q_eps, round % 3 == 0);
      for (size_t i = 0; i < HEADS * 512; i++)
        if (!bf16_same(out_q[i], ref_q[i]))
          fail_msg("%s round %d: q_out[%zu] = %04x, scalar %04x (q %04x)", dsv4__cpu_isa_name(isa),
                   round, i, out_q[i], ref_q[i], q[i]);
      memset(out_d, 0x5A, sizeof(out_d));
      memset(out_s, 0x5A, sizeof(out_s));
      dsv4__cpu_kv_token(isa, kv, row, wsel, eps, out_d, out_s);
      for (int i = 0; i < 576; i++)
        if (out_d[i] != ref_d[i])
          fail_msg("%s round %d mode %u fused %d: data[%d] = %02x, scalar %02x",
                   dsv4__cpu_isa_name(isa), round, mode, wsel != NULL, i, out_d[i], ref_d[i]);
      assert_memory_equal(out_s, ref_s, 8);
      checked++;
    }
  }
  print_message("edge values: %zu rounds compared with the scalar level\n", checked);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_isa_levels),      cmocka_unit_test(test_levels_edge_values),
      cmocka_unit_test(test_spec_vector),     cmocka_unit_test(test_random_batches),
      cmocka_unit_test(test_cache_untouched), cmocka_unit_test(test_threads_and_repeats),
      cmocka_unit_test(test_map_slots),       cmocka_unit_test(test_bad_slot_refused),
      cmocka_unit_test(test_buffers),         cmocka_unit_test(test_worker_mxcsr),
  };
  return cmocka_run_group_tests(tests, setup_tables, teardown_tables);
}
