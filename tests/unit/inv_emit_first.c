/*
 * SPEC §5.2 for the compressed branch (§8.4): a batch's emissions are stored before its indexer and
 * its attention read the entry caches, so a token sees the entries its own batch emitted.
 *
 * The engine runs batches of a ratio-4 and a ratio-128 layer on the CPU backend and asks for attn,
 * lse and topk. Each batch is then sent again: the replay writes nothing (SPEC §8.8) and computes
 * its answer from the caches the first run filled, so it sees every entry the batch emitted. The
 * two answers must be equal byte for byte. The broken build (DSV4_TEST_BROKEN_EMIT_LATE in
 * server/engine/engine.c) launches the attention and the indexer before the compressor; then the
 * first run's tokens miss their own batch's entries and its answer differs from the replay's.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "dsv4-numerics.h"
#include "engine.h"
#include "model.h"

#define HEADS 4
#define TOPK_LAYER 2 /* ratio 4 in the built-in V4-Flash geometry */
#define ALL_LAYER 3  /* ratio 128 */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static double unit(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (double)(rng_state >> 11) / (double)(1ull << 53) * 2.0 - 1.0;
}

static void fill_f32(float *x, size_t n, double scale) {
  for (size_t i = 0; i < n; i++)
    x[i] = (float)(unit() * scale);
}

static void fill_bf16(uint16_t *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    x[i] = dsv4_f32_to_bf16((float)unit());
}

typedef struct {
  float ape4[4 * 1024], norm4[512], iape[4 * 256], inorm[128];
  float ape128[128 * 512], norm128[512];
  float sinks[2 * HEADS];
  dsv4_model_t model;
  dsv4_engine_t *e;
} fx_t;

static void fx_open(fx_t *f) {
  static const uint32_t served[2] = {TOPK_LAYER, ALL_LAYER};
  fill_f32(f->ape4, 4 * 1024, 0.5);
  fill_f32(f->ape128, 128 * 512, 0.5);
  fill_f32(f->iape, 4 * 256, 0.5);
  for (int i = 0; i < 512; i++)
    f->norm4[i] = f->norm128[i] = 1.0f + 0.25f * (float)unit();
  for (int i = 0; i < 128; i++)
    f->inorm[i] = 1.0f + 0.25f * (float)unit();
  fill_f32(f->sinks, 2 * HEADS, 1.0);
  assert_int_equal(dsv4_model_builtin_flash(&f->model), 0);
  f->model.index_topk = 8; /* so that a short sequence already scores its entries */
  const dsv4_engine_compressor_t comp[2] = {{f->ape4, f->norm4, f->iape, f->inorm},
                                            {f->ape128, f->norm128, NULL, NULL}};
  dsv4_engine_params_t p = {.backend = "cpu",
                            .threads = 2,
                            .block_size = 16,
                            .kv_blocks = 64,
                            .heads = HEADS,
                            .model = &f->model,
                            .served_layers = served,
                            .n_served = 2,
                            .attn_sinks = f->sinks,
                            .attention_mode = DSV4_ATTENTION_EXACT,
                            .compressors = comp,
                            .c4_blocks = 16,
                            .c128_blocks = 4,
                            .max_sequences = 4};
  char why[256] = "";
  assert_int_equal(dsv4_engine_create(&p, &f->e, why, sizeof(why)), 0);
  assert_int_equal(dsv4_engine_layer_ratio(f->e, TOPK_LAYER), 4);
  assert_int_equal(dsv4_engine_layer_ratio(f->e, ALL_LAYER), 128);
}

static void fx_close(fx_t *f) {
  dsv4_engine_destroy(f->e);
  dsv4_model_free(&f->model);
}

/* The inputs and outputs of one batch of one segment. */
typedef struct {
  uint16_t *q, *kv, *iq, *q_out, *attn;
  float *ckv, *ikv, *iw, *lse;
  int64_t *slots;
  int32_t *topk;
} io_t;

static void io_alloc(io_t *io, uint32_t n) {
  io->q = malloc((size_t)n * HEADS * 512 * 2);
  io->kv = malloc((size_t)n * 512 * 2);
  io->iq = malloc((size_t)n * 64 * 128 * 2);
  io->ckv = malloc((size_t)n * 2048 * 4);
  io->ikv = malloc((size_t)n * 512 * 4);
  io->iw = malloc((size_t)n * 64 * 4);
  io->q_out = malloc((size_t)n * HEADS * 512 * 2);
  io->attn = malloc((size_t)n * HEADS * 512 * 2);
  io->lse = malloc((size_t)n * HEADS * 4);
  io->slots = malloc((size_t)n * 8);
  io->topk = malloc((size_t)n * 8 * 4);
  fill_bf16(io->q, (size_t)n * HEADS * 512);
  fill_bf16(io->kv, (size_t)n * 512);
  fill_bf16(io->iq, (size_t)n * 64 * 128);
  fill_f32(io->ckv, (size_t)n * 2048, 2.0);
  fill_f32(io->ikv, (size_t)n * 512, 2.0);
  fill_f32(io->iw, (size_t)n * 64, 1.0);
}

static void io_free(io_t *io) {
  void *p[] = {io->q,     io->kv,   io->iq,  io->ckv,   io->ikv, io->iw,
               io->q_out, io->attn, io->lse, io->slots, io->topk};
  for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
    free(p[i]);
}

static void run(fx_t *f, uint32_t layer, const char *seq, int64_t start, uint32_t n, int is_new,
                io_t *io, int *replayed) {
  dsv4_seg_req_t s = {
      .name = seq, .name_len = (uint32_t)strlen(seq), .start = start, .len = n, .is_new = is_new};
  dsv4_forward_t fw = {.layer = layer,
                       .n_tokens = n,
                       .q = io->q,
                       .kv = io->kv,
                       .segs = &s,
                       .n_segs = 1,
                       .q_out = io->q_out,
                       .slots = io->slots,
                       .attn = io->attn,
                       .lse = io->lse,
                       .attention = DSV4_ATTENTION_EXACT,
                       .ckv = io->ckv,
                       .ikv = io->ikv,
                       .iq = io->iq,
                       .iw = io->iw,
                       .topk = layer == TOPK_LAYER ? io->topk : NULL};
  int rc = dsv4_engine_forward(f->e, &fw);
  dsv4_forward_release(&fw);
  assert_int_equal(rc, 0);
  *replayed = fw.replayed;
}

/* The first violation found, reported once everything is freed (a sanitizer build must show no leak
 * even when the invariant is broken). */
static char violation[512];

/* Send a batch, then again (a replay); the two answers must be equal byte for byte. Returns 0, or
 * 1 with the violation written. */
static int check_batch(fx_t *f, uint32_t layer, const char *seq, int64_t start, uint32_t n,
                       int is_new) {
  io_t a, b;
  int replayed, bad = 0;
  io_alloc(&a, n);
  io_alloc(&b, n);
  memcpy(b.q, a.q, (size_t)n * HEADS * 512 * 2);
  memcpy(b.kv, a.kv, (size_t)n * 512 * 2);
  memcpy(b.iq, a.iq, (size_t)n * 64 * 128 * 2);
  memcpy(b.ckv, a.ckv, (size_t)n * 2048 * 4);
  memcpy(b.ikv, a.ikv, (size_t)n * 512 * 4);
  memcpy(b.iw, a.iw, (size_t)n * 64 * 4);
  run(f, layer, seq, start, n, is_new, &a, &replayed);
  assert_false(replayed);
  run(f, layer, seq, start, n, 0, &b, &replayed);
  assert_true(replayed);
  uint32_t r = dsv4_engine_layer_ratio(f->e, layer);
  for (uint32_t t = 0; t < n && !bad; t++) {
    int64_t p = start + (int64_t)t;
    int same = !memcmp(a.attn + (size_t)t * HEADS * 512, b.attn + (size_t)t * HEADS * 512,
                       (size_t)HEADS * 512 * 2) &&
               !memcmp(a.lse + (size_t)t * HEADS, b.lse + (size_t)t * HEADS, HEADS * 4) &&
               (layer != TOPK_LAYER || !memcmp(a.topk + (size_t)t * 8, b.topk + (size_t)t * 8, 32));
    if (!same) {
      snprintf(violation, sizeof(violation),
               "invariant violated: SPEC 5.2: layer %u token at position %lld (%lld entries "
               "visible): its attention did not see the entries its own batch emitted (the "
               "answer differs from the replay's, which reads them from the cache)",
               layer, (long long)p, (long long)((p + 1) / r));
      bad = 1;
    }
  }
  io_free(&a);
  io_free(&b);
  return bad;
}

static void test_emissions_before_attention(void **state) {
  (void)state;
  fx_t f;
  int bad;
  fx_open(&f);
  /* Ratio 4: a prefill emitting 10 entries (more than topk 8 visible at its end), then chunks
   * and decode steps that each emit inside the batch. */
  bad = check_batch(&f, TOPK_LAYER, "a", 0, 40, 1);
  if (!bad)
    bad = check_batch(&f, TOPK_LAYER, "a", 40, 7, 0);
  for (int64_t p = 47; p < 52 && !bad; p++)
    bad = check_batch(&f, TOPK_LAYER, "a", p, 1, 0);
  /* Ratio 128: the batch emitting entry 0 at position 127, then one emitting entry 1 mid-batch. */
  if (!bad)
    bad = check_batch(&f, ALL_LAYER, "b", 0, 130, 1);
  if (!bad)
    bad = check_batch(&f, ALL_LAYER, "b", 130, 200, 0);
  fx_close(&f);
  if (bad)
    fail_msg("%s", violation);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_emissions_before_attention),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
