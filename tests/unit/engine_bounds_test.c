/*
 * dsv4_engine_forward's own checks of segment lengths and positions, for callers that did not
 * validate the batch first: lengths whose sum wraps 32 bits and starts whose end wraps 64 bits must
 * be refused before any byte of q or kv is read, and refused batches change nothing.
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
#include "cpu_staged.h"
#include "engine.h"
#include "model.h"

/* The backend under test: "cpu", or "cpu_staged" (the engine's device staging path) from argv[1].
 */
static const char *backend = "cpu";

#define HEADS 4
#define BLOCKS 8

static dsv4_model_t model;
static const uint32_t served[1] = {0};

static dsv4_engine_t *open_engine(void) {
  dsv4_engine_params_t p = {
      .backend = backend,
      .threads = 1,
      .block_size = 64,
      .kv_blocks = BLOCKS,
      .heads = HEADS,
      .model = &model,
      .served_layers = served,
      .n_served = 1,
      .max_sequences = 16,
  };
  dsv4_engine_t *e = NULL;
  char why[256];
  assert_int_equal(dsv4_engine_create(&p, &e, why, sizeof(why)), 0);
  return e;
}

typedef struct {
  uint16_t *q, *kv, *q_out;
  int64_t *slots;
  dsv4_seg_req_t segs[2];
  dsv4_forward_t f;
} batch_t;

/* A batch of n tokens (buffers sized for exactly n) with the segments given. */
static void batch_make(batch_t *b, uint32_t n, uint32_t n_segs, const int64_t *starts,
                       const uint32_t *lens) {
  static const char *const names[2] = {"a", "b"};
  memset(b, 0, sizeof(*b));
  size_t nq = (size_t)n * HEADS * DSV4_HEAD_DIM, nk = (size_t)n * DSV4_HEAD_DIM;
  b->q = malloc(nq * 2);
  b->kv = malloc(nk * 2);
  b->q_out = malloc(nq * 2);
  b->slots = malloc(n * sizeof(int64_t));
  assert_non_null(b->q);
  assert_non_null(b->kv);
  assert_non_null(b->q_out);
  assert_non_null(b->slots);
  for (size_t i = 0; i < nq; i++)
    b->q[i] = (uint16_t)(0x3F80 + (i % 64));
  for (size_t i = 0; i < nk; i++)
    b->kv[i] = (uint16_t)(0xBF80 + (i % 64));
  for (uint32_t s = 0; s < n_segs; s++) {
    b->segs[s].name = names[s];
    b->segs[s].name_len = 1;
    b->segs[s].start = starts[s];
    b->segs[s].len = lens[s];
    b->segs[s].is_new = 1;
  }
  b->f.layer = 0;
  b->f.n_tokens = n;
  b->f.q = b->q;
  b->f.kv = b->kv;
  b->f.segs = b->segs;
  b->f.n_segs = n_segs;
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

static int group_setup(void **state) {
  (void)state;
  return dsv4_model_builtin_flash(&model);
}

static int group_teardown(void **state) {
  (void)state;
  dsv4_model_free(&model);
  return 0;
}

/*
 * Lengths 2 and 2^32 - 2 over a 2-token batch: their 32-bit sum wraps to 0. The geometry allows
 * 2^32 positions (the configuration's limit), so the second segment's positions are in range and
 * only the length check stands between the engine and a read far past the buffers.
 */
static void test_segment_lengths_wrapping(void **state) {
  (void)state;
  int64_t saved = model.max_position_embeddings;
  model.max_position_embeddings = (int64_t)1 << 32;
  dsv4_engine_t *e = open_engine();
  batch_t b;
  int64_t starts[2] = {0, 0};
  uint32_t lens[2] = {2, UINT32_MAX - 1};
  batch_make(&b, 2, 2, starts, lens);
  assert_int_equal(dsv4_engine_forward(e, &b.f), DSV4_EINVAL);
  assert_int_equal(dsv4_engine_sequences(e), 0);
  assert_int_equal(dsv4_engine_blocks_free(e), BLOCKS);
  batch_free(&b);
  dsv4_engine_destroy(e);
  model.max_position_embeddings = saved;
}

/* Starts whose last position is past INT64_MAX are out of range, not wrapped below the limit. */
static void test_start_near_int64_max(void **state) {
  (void)state;
  dsv4_engine_t *e = open_engine();
  const int64_t bad[3] = {INT64_MAX, INT64_MAX - 1, INT64_MAX - 2};
  for (int i = 0; i < 3; i++) {
    batch_t b;
    int64_t starts[1] = {bad[i]};
    uint32_t lens[1] = {4};
    batch_make(&b, 4, 1, starts, lens);
    assert_int_equal(dsv4_engine_forward(e, &b.f), DSV4_EPOSRANGE);
    batch_free(&b);
  }
  /* The last position of the table is accepted, one past it is not. */
  {
    batch_t b;
    int64_t starts[1] = {model.max_position_embeddings - 2};
    uint32_t lens[1] = {3};
    batch_make(&b, 3, 1, starts, lens);
    assert_int_equal(dsv4_engine_forward(e, &b.f), DSV4_EPOSRANGE);
    batch_free(&b);
  }
  assert_int_equal(dsv4_engine_sequences(e), 0);
  assert_int_equal(dsv4_engine_blocks_free(e), BLOCKS);
  {
    batch_t b;
    int64_t starts[1] = {model.max_position_embeddings - 2};
    uint32_t lens[1] = {2};
    batch_make(&b, 2, 1, starts, lens);
    assert_int_equal(dsv4_engine_forward(e, &b.f), 0);
    batch_free(&b);
  }
  assert_int_equal(dsv4_engine_sequences(e), 1);
  dsv4_engine_destroy(e);
}

int main(int argc, char **argv) {
  int skip = dsv4_test_backend_from_args(argc, argv, &backend);
  if (skip)
    return skip;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_segment_lengths_wrapping),
      cmocka_unit_test(test_start_near_int64_max),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
